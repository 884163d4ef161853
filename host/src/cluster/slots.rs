//! The slots a node runs, started and stopped one at a time: the static
//! modes start them all at once; the coordinator starts, drains and fences
//! them as assignments change.
//!
//! Draining is cancel-safe: each slot's runner is awaited by a task of its
//! own (spawned with the runner), which removes the slot from the set when
//! the runner ends and keeps its report for the first drainer. A drain only
//! sends the stop and waits for that task, so a drain that is cancelled (a
//! timeout, an aborted release) leaves nothing behind: the runner still
//! stops, the slot still leaves the set, and any later drain waits for the
//! same end.
//!
//! Fencing does not wait for the drain: it interrupts the calls, stops the
//! runners and returns once no call of those slots runs guest code any more
//! and none can start ([`crate::runtime::Interrupt::calls_ended`]). What is
//! left of the drain (releases, acks, closing the consumer) is broker
//! traffic that harms nobody, and may be slow exactly when a fence is
//! urgent; the slots stay in the set until it is done, so none is started
//! again before.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::dispatch::supervisor::{self, CancelCell};
use crate::dispatch::{Pipeline, RunnerReport, SlotSettings, TopologySettings};

/// (topology, slot).
pub type SlotKey = (String, u32);

/// What runs a slot until its stop turns true: [`supervisor::supervise_slot`]
/// in a node; a test's own runner in the unit tests.
pub type Supervisor = Arc<
    dyn Fn(
            Arc<Pipeline>,
            SlotSettings,
            watch::Receiver<bool>,
            CancelCell,
        ) -> BoxFuture<'static, anyhow::Result<RunnerReport>>
        + Send
        + Sync,
>;

/// The end of one runner: true once it ended (and left the set); its
/// report, taken by the first drainer.
struct Ended {
    done: watch::Receiver<bool>,
    report: Arc<Mutex<Option<RunnerReport>>>,
}

struct Running {
    /// Tells this runner apart from a later one of the same slot.
    generation: u64,
    stop: watch::Sender<bool>,
    cancel: CancelCell,
    done: watch::Receiver<bool>,
    report: Arc<Mutex<Option<RunnerReport>>>,
}

type Map = Arc<Mutex<BTreeMap<SlotKey, Running>>>;

/// See the module docs.
pub struct SlotSet {
    pipeline: Arc<Pipeline>,
    /// How the slots of each topology run.
    topologies: HashMap<String, TopologySettings>,
    running: Map,
    /// Once the node is leaving: the report of every slot drained since
    /// (by the coordinator's leave or by the last drain), for its summary.
    leaving: Mutex<Option<Vec<RunnerReport>>>,
    generations: std::sync::atomic::AtomicU64,
    supervisor: Supervisor,
    /// The node's runtime: runners run there even when the coordinator
    /// that starts them runs on a thread of its own.
    runtime: tokio::runtime::Handle,
}

impl SlotSet {
    /// A set with nothing running; each slot runs [`supervisor::supervise_slot`].
    pub fn new(pipeline: Arc<Pipeline>, topologies: HashMap<String, TopologySettings>) -> Self {
        let supervisor: Supervisor =
            Arc::new(|p, s, stop, cancel| Box::pin(supervisor::supervise_slot(p, s, stop, cancel)));
        Self::with_supervisor(pipeline, topologies, supervisor)
    }

    /// Hand an operator's order for a parked group to the runner of its
    /// slot on this node: `Ok(head)`, or `Err(why)` (not parked here, its
    /// slot does not run here, no such topology).
    pub async fn order_group(
        &self,
        topology: &str,
        tenant: Option<String>,
        group: String,
        skip: bool,
    ) -> Result<String, String> {
        let Some(t) = self.topologies.get(topology) else {
            return Err(format!("no topology `{topology}` on this node"));
        };
        let slot = crate::partition::slot_for(Some(&group), "", t.slots);
        let inbox = self.pipeline.orders.lock().get(&(Arc::from(topology), slot)).cloned();
        let Some(inbox) = inbox else {
            return Err(format!(
                "slot {slot} of `{topology}` (group `{group}`'s) does not run on this node"
            ));
        };
        let (reply, answer) = tokio::sync::oneshot::channel();
        let order = crate::dispatch::GroupOrder {
            tenant,
            group,
            skip,
            reply,
        };
        inbox
            .send(order)
            .map_err(|_| format!("slot {slot} of `{topology}` is stopping"))?;
        answer
            .await
            .map_err(|_| format!("slot {slot} of `{topology}` stopped before it answered"))?
    }

    /// A set whose slots run `supervisor` (tests). Must be called on the
    /// runtime the runners are to run on.
    #[doc(hidden)]
    pub fn with_supervisor(
        pipeline: Arc<Pipeline>,
        topologies: HashMap<String, TopologySettings>,
        supervisor: Supervisor,
    ) -> Self {
        Self {
            pipeline,
            topologies,
            running: Arc::default(),
            leaving: Mutex::new(None),
            generations: std::sync::atomic::AtomicU64::new(0),
            supervisor,
            runtime: tokio::runtime::Handle::current(),
        }
    }

    /// What a set whose runners are a [`Supervisor`] of the caller's needs
    /// besides it: a pipeline with an in-memory broker, one idle Wasm worker
    /// and no handlers, and the settings of one topology of `slots` slots.
    /// For the tests and the coordination benchmark, which exercise who
    /// runs which slot, not what a slot does.
    #[doc(hidden)]
    pub fn inert_parts(topology: &str, slots: u32) -> anyhow::Result<(Arc<Pipeline>, TopologySettings)> {
        use crate::retry::schedule::{Redelivery, RetryPolicy};
        let runtime = crate::runtime::Runtime::new(crate::runtime::RuntimeOptions::default())?;
        let pipeline = Arc::new(Pipeline {
            transport: Arc::new(crate::transport::memory::MemoryBroker::new()),
            pool: Arc::new(crate::runtime::pool::WorkerPool::new(runtime, 1)?),
            router: Arc::new(crate::router::Router::new()),
            stats: Arc::default(),
            observer: None,
            dedup: None,
            parked: None,
            orders: Default::default(),
            seal: crate::seal::Seal::ephemeral(),
        });
        let settings = TopologySettings {
            topology: Arc::from(topology),
            slots,
            max_concurrent_groups: 1,
            max_unordered: 1,
            prefetch: 1,
            park_hold: 1,
            park_hold_slot: 0,
            max_run: 1,
            schedule: RetryPolicy::new(Vec::new(), 3).schedule(Redelivery::Host),
            bypass_lanes: false,
            bypass_batch_lanes: false,
            inject_panic: None,
        };
        Ok((pipeline, settings))
    }

    /// The node's runtime, where the runners run.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.runtime
    }

    /// Start consuming `key` (no-op if it runs or its topology is unknown).
    pub fn start(&self, key: &SlotKey) -> bool {
        let Some(topology) = self.topologies.get(&key.0) else {
            tracing::error!(topology = %key.0, slot = key.1, "asked to run a slot of a topology this node does not have");
            return false;
        };
        let mut running = self.running.lock();
        if running.contains_key(key) {
            return false;
        }
        let settings = topology.for_slot(key.1, self.pipeline.stats.slot(&topology.topology, key.1));
        let (stop, stop_rx) = watch::channel(false);
        let cancel: CancelCell = Arc::new(Mutex::new(Arc::default()));
        let generation = self.generations.fetch_add(1, Ordering::Relaxed);
        let task = self.runtime.spawn((self.supervisor)(
            self.pipeline.clone(),
            settings,
            stop_rx,
            cancel.clone(),
        ));
        let (done_tx, done) = watch::channel(false);
        let report = Arc::new(Mutex::new(None));
        // The runner's end is awaited here, not by whoever drains: a
        // drainer that is cancelled cannot lose it.
        let (map, k, cell) = (self.running.clone(), key.clone(), report.clone());
        self.runtime.spawn(async move {
            let r = join(&k, task).await;
            *cell.lock() = Some(r);
            {
                let mut running = map.lock();
                if running.get(&k).is_some_and(|r| r.generation == generation) {
                    running.remove(&k);
                }
            }
            let _ = done_tx.send(true);
        });
        running.insert(
            key.clone(),
            Running {
                generation,
                stop,
                cancel,
                done,
                report,
            },
        );
        true
    }

    /// True while `key` runs (or drains).
    pub fn is_running(&self, key: &SlotKey) -> bool {
        self.running.lock().contains_key(key)
    }

    /// True once `key` was told to stop (it drains, or was fenced).
    pub fn is_stopping(&self, key: &SlotKey) -> bool {
        self.running.lock().get(key).is_some_and(|r| *r.stop.borrow())
    }

    /// The slots that run (or drain), in order.
    pub fn running(&self) -> Vec<SlotKey> {
        self.running.lock().keys().cloned().collect()
    }

    /// Stop taking messages of `key`, return unstarted ones, wait for every
    /// running call, stop consuming. `None` if it did not run, or when
    /// another drain of the same runner took the report. Cancel-safe.
    pub async fn drain(&self, key: &SlotKey) -> Option<RunnerReport> {
        let ended = {
            let running = self.running.lock();
            let r = running.get(key)?;
            let _ = r.stop.send(true);
            Ended {
                done: r.done.clone(),
                report: r.report.clone(),
            }
        };
        let Ended { mut done, report } = ended;
        // Err: the watcher task is gone (the runtime shuts down); nothing to wait for.
        let _ = done.wait_for(|d| *d).await;
        let taken = report.lock().take();
        if let (Some(r), Some(kept)) = (&taken, self.leaving.lock().as_mut()) {
            kept.push(r.clone());
        }
        taken
    }

    /// The node is leaving: from now on keep the report of every slot
    /// drained, whoever drains it, for [`SlotSet::left`].
    pub fn leave(&self) {
        self.leaving.lock().get_or_insert_with(Vec::new);
    }

    /// The reports of the slots drained since [`SlotSet::leave`].
    pub fn left(&self) -> Vec<RunnerReport> {
        self.leaving.lock().take().unwrap_or_default()
    }

    /// Ownership of `key` is lost: interrupt its calls and stop it; returns
    /// once none of its calls runs (see the module docs). Its drain goes on
    /// in the background.
    pub async fn fence(&self, key: &SlotKey) {
        let fenced = {
            let running = self.running.lock();
            let Some(r) = running.get(key) else { return };
            stop(r)
        };
        calls_ended(&fenced).await;
    }

    /// Interrupt the running calls of every slot without draining them:
    /// drains in progress end as soon as those calls do (the drain deadline
    /// of a leaving node).
    pub fn interrupt_all(&self) {
        for r in self.running.lock().values() {
            r.cancel.lock().cancel();
        }
    }

    /// Drain every slot at once; reports in slot order.
    pub async fn drain_all(&self) -> Vec<RunnerReport> {
        let keys = self.running();
        let drains = keys.iter().map(|k| self.drain(k));
        futures::future::join_all(drains).await.into_iter().flatten().collect()
    }

    /// [`SlotSet::fence`] every slot at once: returns once no call of this
    /// node runs guest code and none can start.
    pub async fn fence_all(&self) {
        let fenced: Vec<CancelCell> = self.running.lock().values().map(stop).collect();
        futures::future::join_all(fenced.iter().map(calls_ended)).await;
    }

    /// Interrupt every call and wait for every runner's end (a leaving
    /// node's last step).
    pub async fn interrupt_and_drain_all(&self) -> Vec<RunnerReport> {
        self.interrupt_all();
        self.drain_all().await
    }
}

/// Stop a runner and interrupt its calls; its cancel cell.
fn stop(r: &Running) -> CancelCell {
    // The stop first: a supervisor that starts a new runner after it
    // (an old one failed) lets that runner consume nothing.
    let _ = r.stop.send(true);
    r.cancel.lock().cancel();
    r.cancel.clone()
}

/// Once the runner in `cell` has no call in guest code. A supervisor may
/// have put a new runner in since the cancel: cancel and wait for that one
/// too.
async fn calls_ended(cell: &CancelCell) {
    loop {
        let interrupt = cell.lock().clone();
        interrupt.cancel();
        interrupt.calls_ended().await;
        if Arc::ptr_eq(&interrupt, &cell.lock()) {
            return;
        }
    }
}

async fn join(key: &SlotKey, task: JoinHandle<anyhow::Result<RunnerReport>>) -> RunnerReport {
    match task.await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            tracing::error!(topology = %key.0, slot = key.1, error = %format!("{e:#}"), "slot runner failed");
            RunnerReport::default()
        }
        Err(e) => {
            tracing::error!(topology = %key.0, slot = key.1, error = %e, "slot runner panicked");
            RunnerReport::default()
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::time::Duration;

    use tokio::sync::Semaphore;

    use super::*;

    /// A set of one topology `t` whose runners wait for their stop, then
    /// for a permit of `gate` (a call still running), then end.
    fn set(gate: Arc<Semaphore>) -> SlotSet {
        let supervisor: Supervisor = Arc::new(move |_, _, mut stop, _| {
            let gate = gate.clone();
            Box::pin(async move {
                let _ = stop.wait_for(|s| *s).await;
                gate.acquire().await.unwrap().forget();
                Ok(RunnerReport {
                    received: 7,
                    ..RunnerReport::default()
                })
            })
        });
        with(supervisor)
    }

    /// A set of one topology `t` of two slots whose runners run `supervisor`.
    fn with(supervisor: Supervisor) -> SlotSet {
        let (pipeline, settings) = SlotSet::inert_parts("t", 2).unwrap();
        SlotSet::with_supervisor(pipeline, HashMap::from([("t".to_owned(), settings)]), supervisor)
    }

    /// A drain cut short by a timeout leaves no trace: the next drain waits
    /// for the same runner's end and gets its report, the slot leaves the
    /// set, and it can be started (consumed) again.
    #[tokio::test]
    async fn a_drain_cancelled_midway_is_finished_by_the_next() {
        let gate = Arc::new(Semaphore::new(0));
        let set = set(gate.clone());
        let key: SlotKey = ("t".into(), 1);
        assert!(set.start(&key));
        assert!(
            tokio::time::timeout(Duration::from_millis(20), set.drain(&key))
                .await
                .is_err(),
            "the runner is held by its running call"
        );
        assert!(set.is_running(&key), "still draining");
        let again = tokio::spawn({
            let set = Arc::new(set);
            let key = key.clone();
            async move {
                let r = set.drain(&key).await;
                (set, r)
            }
        });
        gate.add_permits(1);
        let (set, report) = again.await.unwrap();
        assert_eq!(
            report.map(|r| r.received),
            Some(7),
            "the second drain waited for the runner's end"
        );
        assert!(!set.is_running(&key), "a drained slot leaves the set");
        assert!(set.start(&key), "and can be consumed again");
        gate.add_permits(1);
        assert!(set.drain(&key).await.is_some());
    }

    /// A leaving node aborts the releases in progress (their drains): the
    /// drain it does itself still waits for those runners' end.
    #[tokio::test]
    async fn an_aborted_drain_task_is_waited_for_by_drain_all() {
        let gate = Arc::new(Semaphore::new(0));
        let set = Arc::new(set(gate.clone()));
        let key: SlotKey = ("t".into(), 0);
        assert!(set.start(&key));
        let release = tokio::spawn({
            let (set, key) = (set.clone(), key.clone());
            async move { set.drain(&key).await }
        });
        // The release task has sent the stop (it is parked on the runner's end).
        while !set.running.lock().get(&key).is_some_and(|r| *r.stop.borrow()) {
            tokio::task::yield_now().await;
        }
        release.abort();
        let _ = release.await;
        let all = tokio::spawn({
            let set = set.clone();
            async move { set.interrupt_and_drain_all().await }
        });
        gate.add_permits(1);
        let reports = all.await.unwrap();
        assert_eq!(
            reports.len(),
            1,
            "the drain waited for the slot whose release was aborted"
        );
        assert!(set.running().is_empty());
    }

    /// A fence ends when the calls do, not when the drain does: the runner
    /// below has one call in guest code (a thread holding its interrupt's
    /// entry until cancelled and let go) and a drain held by `gate` (the
    /// broker's close, slow on a starved machine). `fence_all` must wait
    /// for the call and return without the drain; the slot stays in the set
    /// until its runner ends, so it cannot be started twice.
    #[tokio::test]
    async fn a_fence_waits_for_the_calls_and_not_for_the_drain() {
        let gate = Arc::new(Semaphore::new(0));
        let release_call = Arc::new(std::sync::Barrier::new(2));
        let supervisor: Supervisor = Arc::new({
            let (gate, release_call) = (gate.clone(), release_call.clone());
            move |_, _, mut stop, cell: CancelCell| {
                let (gate, release_call) = (gate.clone(), release_call.clone());
                Box::pin(async move {
                    let interrupt = cell.lock().clone();
                    let call = std::thread::spawn(move || {
                        let entered = interrupt.enter().expect("not cancelled yet");
                        while !interrupt.is_cancelled() {
                            std::thread::yield_now();
                        }
                        release_call.wait();
                        drop(entered);
                    });
                    let _ = stop.wait_for(|s| *s).await;
                    gate.acquire().await.unwrap().forget();
                    call.join().unwrap();
                    Ok(RunnerReport::default())
                })
            }
        });
        let set = Arc::new(with(supervisor));
        let key: SlotKey = ("t".into(), 0);
        assert!(set.start(&key));
        let cell = set.running.lock().get(&key).unwrap().cancel.clone();
        while cell.lock().running() == 0 {
            tokio::task::yield_now().await;
        }
        let fence = tokio::spawn({
            let set = set.clone();
            async move { set.fence_all().await }
        });
        // The call is still in guest code: the fence waits.
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert!(!fence.is_finished(), "the fence returned while a call ran");
        tokio::task::spawn_blocking({
            let release_call = release_call.clone();
            move || release_call.wait()
        })
        .await
        .unwrap();
        tokio::time::timeout(Duration::from_secs(10), fence)
            .await
            .expect("the fence returned once the call ended, its drain still held")
            .unwrap();
        assert!(set.is_running(&key), "the slot drains on, still in the set");
        assert!(!set.start(&key), "and cannot be started twice meanwhile");
        gate.add_permits(1);
        assert!(set.drain(&key).await.is_some());
        assert!(!set.is_running(&key));
    }
}
