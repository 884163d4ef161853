//! A fixed pool of worker threads, each with its own [`Executor`]. Lanes hand
//! it work as [`Job`]s; a job's calls run one after another on one thread, so
//! a lane that submits one job at a time never runs two of its messages at
//! once. Wasm calls are synchronous and never block the async runtime.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::sync::oneshot;

use super::{BatchOutcome, CallOutcome, Executor, HandlerVersion, Interrupt, Runtime};
use crate::envelope::Envelope;

/// Work for one worker: calls that must run in order, on one thread.
pub enum Job {
    /// Call `handle` for each message in turn.
    Each {
        /// (handler, message) in lane order.
        items: Vec<(Arc<HandlerVersion>, Envelope)>,
        /// Outcomes of the job's first items, when a demoted worker handed the rest back.
        done: Vec<(Envelope, CallOutcome)>,
        /// Set to interrupt the running call.
        cancel: Option<Arc<Interrupt>>,
        /// Messages come back with their outcomes, same order.
        reply: oneshot::Sender<Vec<(Envelope, CallOutcome)>>,
    },
    /// Call `handle-batch` once.
    Batch {
        /// The handler.
        handler: Arc<HandlerVersion>,
        /// Its members.
        batch: Vec<Envelope>,
        /// Set to interrupt the call.
        cancel: Option<Arc<Interrupt>>,
        /// Members come back with the outcome.
        reply: oneshot::Sender<(Vec<Envelope>, BatchOutcome)>,
    },
    /// Call `handle-batch` once per batch, in order (batches of several
    /// lanes sharing one hand-off).
    Batches {
        /// (handler, members) per call.
        calls: Vec<(Arc<HandlerVersion>, Vec<Envelope>)>,
        /// Outcomes of the job's first calls, when a demoted worker handed the rest back.
        done: Vec<(Vec<Envelope>, BatchOutcome)>,
        /// Set to interrupt the running call.
        cancel: Option<Arc<Interrupt>>,
        /// Each batch's members with its outcome, same order.
        reply: oneshot::Sender<Vec<(Vec<Envelope>, BatchOutcome)>>,
    },
}

/// The worker threads. Dropping the pool lets them finish queued jobs and exit.
///
/// Fair share: a call that outlives the runtime's `demote_after` (a runaway
/// or very heavy guest) moves its thread to the idle scheduling class for
/// the rest of that call, and a fresh worker takes its place in the pool; the
/// demoted thread exits when the call ends. So the pool always has its full
/// number of workers at normal priority for everyone else, while the long
/// call still gets whatever CPU is left over until its timeout ends it.
/// The rest of the demoted worker's job (calls not yet started, of other
/// lanes too) is handed back to the queue for a worker at normal priority.
///
/// Failing work is charged too, and so is a call that went over its log
/// budget (a flood answered `ok`): the CPU a call that failed took on its
/// worker (the guest's part, and the host's: re-instantiating after a trap,
/// building and cutting the failure text) is added to its tenant's debt,
/// which halves every [`FAILING_HALF_LIFE`]. While a tenant's debt is above
/// [`FAILING_CPU`], its jobs run on background workers at the lowest normal
/// priority (nice 19), as many as the pool has workers, so short failing
/// calls, each below `demote_after`, cannot take their turns' share of the
/// CPU from tenants whose calls succeed; they still run, on what is left.
/// A handler bound to no tenant is charged per (handler, message tenant).
pub struct WorkerPool {
    tx: Option<crossbeam_channel::Sender<Job>>,
    shared: Arc<Shared>,
    size: usize,
}

struct Shared {
    rx: crossbeam_channel::Receiver<Job>,
    runtime: Arc<Runtime>,
    threads: parking_lot::Mutex<Vec<std::thread::JoinHandle<()>>>,
    spawned: std::sync::atomic::AtomicUsize,
    demoted: std::sync::atomic::AtomicU64,
    /// Where a demoted worker hands back the unstarted rest of its job (`None` once the
    /// pool is dropped: the demoted worker then finishes the job itself).
    handback: parking_lot::Mutex<Option<crossbeam_channel::Sender<Job>>>,
    /// The background workers' queue: jobs of failing tenants (`None` once the pool is
    /// dropped: a worker then runs such a job itself).
    background: parking_lot::Mutex<Option<crossbeam_channel::Sender<Job>>>,
    background_rx: crossbeam_channel::Receiver<Job>,
    /// Background workers started (at most `size`, started when first needed).
    background_spawned: std::sync::atomic::AtomicUsize,
    /// Jobs sent to the background workers.
    backgrounded: std::sync::atomic::AtomicU64,
    /// CPU debt of failed calls, per tenant: (nanoseconds, when last updated).
    debts: parking_lot::Mutex<HashMap<String, (f64, Instant)>>,
    size: usize,
}

/// A tenant whose failed calls took more CPU than this (decayed by
/// [`FAILING_HALF_LIFE`]) has its jobs run by the background workers.
pub const FAILING_CPU: Duration = Duration::from_millis(50);

/// How fast a failing tenant's CPU debt is forgiven: by half in this time.
pub const FAILING_HALF_LIFE: Duration = Duration::from_secs(1);

/// Whom a call's cost is charged to: the handler's tenant, else the handler and the
/// message's tenant.
fn debtor(h: &HandlerVersion, msg: &Envelope) -> String {
    match h.tenant() {
        Some(t) => t.name.to_string(),
        None => format!("{}\u{1f}{}", h.name(), msg.tenant_id.as_deref().unwrap_or_default()),
    }
}

/// `debt` nanoseconds recorded at `at`, as of `now`.
fn decayed(debt: f64, at: Instant, now: Instant) -> f64 {
    let halvings = now.saturating_duration_since(at).as_secs_f64() / FAILING_HALF_LIFE.as_secs_f64();
    debt * 0.5f64.powf(halvings)
}

/// Whether a call failed in a way that is the guest's (not a cancellation by the host).
fn failed(outcome: &CallOutcome) -> bool {
    match outcome {
        CallOutcome::Done { result, .. } => result.is_err(),
        CallOutcome::Fault(f) => f.kind != super::FaultKind::Cancelled,
    }
}

fn batch_failed(outcome: &BatchOutcome) -> bool {
    match outcome {
        BatchOutcome::Done { results, .. } => results.iter().any(Result::is_err),
        BatchOutcome::Fault(f) => f.kind != super::FaultKind::Cancelled,
    }
}

thread_local! {
    /// Set on a worker thread that demoted itself during a long call.
    static DEMOTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Set on a background worker (failing tenants' jobs, at low priority already).
    static BACKGROUND: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Shared {
    fn spawn_worker(self: &Arc<Self>) -> anyhow::Result<()> {
        let i = self.spawned.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let shared = self.clone();
        let t = std::thread::Builder::new()
            .name(format!("weir-worker-{i}"))
            .stack_size(8 << 20)
            .spawn(move || shared.work())
            .context("starting a worker thread")?;
        self.threads.lock().push(t);
        Ok(())
    }

    fn work(self: Arc<Self>) {
        let mut exec = Executor::new(self.runtime.clone());
        let me = Arc::downgrade(&self);
        exec.on_long_call(Arc::new(move || {
            if DEMOTED.get() || BACKGROUND.get() {
                return;
            }
            DEMOTED.set(true);
            // The replacement first: a thread inherits its creator's
            // scheduling class, so one spawned after the demotion would
            // run at idle priority too (and so would every worker after it).
            if let Some(shared) = me.upgrade() {
                shared.demoted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if let Err(e) = shared.spawn_worker() {
                    tracing::error!(error = %e, "cannot replace a demoted worker");
                }
            }
            demote_current_thread();
        }));
        while let Ok(job) = self.rx.recv() {
            let job = match self.to_background(job) {
                Ok(()) => continue,
                Err(job) => job,
            };
            run(&mut exec, job, &self);
            if DEMOTED.get() {
                // A replacement runs at normal priority already.
                break;
            }
        }
    }

    /// A background worker: failing tenants' jobs, at the lowest normal priority.
    fn work_background(self: Arc<Self>) {
        BACKGROUND.set(true);
        lower_current_thread();
        let mut exec = Executor::new(self.runtime.clone());
        exec.on_long_call(Arc::new(|| {}));
        while let Ok(job) = self.background_rx.recv() {
            run(&mut exec, job, &self);
        }
    }

    /// Send `job` to the background workers when one of its calls is of a failing tenant;
    /// the job back otherwise (or when the pool is shutting down). A job moves whole: an
    /// `Each` job is one lane's run (one tenant, one group), whose calls must stay in order
    /// on one worker; a `Batches` job is one slot's flush, split by nobody.
    fn to_background(self: &Arc<Self>, job: Job) -> Result<(), Job> {
        // Fair share off (no `demote_after`): failing work is not moved either.
        if self.runtime.options().demote_after.is_none() {
            return Err(job);
        }
        let failing = {
            let debts = self.debts.lock();
            let now = Instant::now();
            // Forgiven debts stay in the map until it grows: check them
            // first, so that while no tenant is over the line a job builds
            // no debtor key (an allocation per message) at all.
            let threshold = FAILING_CPU.as_nanos() as f64;
            if debts.values().all(|&(d, at)| decayed(d, at, now) <= threshold) {
                return Err(job);
            }
            // A tenant's key is its name: looked up without building it.
            let over = |h: &HandlerVersion, m: &Envelope| {
                let debt = match h.tenant() {
                    Some(t) => debts.get(&*t.name),
                    None => debts.get(&debtor(h, m)),
                };
                debt.is_some_and(|&(d, at)| decayed(d, at, now) > threshold)
            };
            match &job {
                Job::Each { items, .. } => items.iter().any(|(h, m)| over(h, m)),
                Job::Batch { handler, batch, .. } => batch.first().is_some_and(|m| over(handler, m)),
                Job::Batches { calls, .. } => calls.iter().any(|(h, b)| b.first().is_some_and(|m| over(h, m))),
            }
        };
        if !failing {
            return Err(job);
        }
        let Some(tx) = self.background.lock().clone() else {
            return Err(job);
        };
        use std::sync::atomic::Ordering::Relaxed;
        loop {
            let n = self.background_spawned.load(Relaxed);
            if n >= self.size {
                break;
            }
            if self
                .background_spawned
                .compare_exchange(n, n + 1, Relaxed, Relaxed)
                .is_err()
            {
                continue;
            }
            let shared = self.clone();
            let spawned = std::thread::Builder::new()
                .name("weir-background".into())
                .stack_size(8 << 20)
                .spawn(move || shared.work_background());
            match spawned {
                Ok(t) => self.threads.lock().push(t),
                Err(e) => {
                    tracing::error!(error = %e, "cannot start a background worker; failing work stays on the pool");
                    return Err(job);
                }
            }
        }
        self.backgrounded.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tx.send(job).map_err(|crossbeam_channel::SendError(job)| job)
    }

    /// Charge `cpu` to `debtor` when its call failed or went over its log budget.
    fn charge(&self, h: &HandlerVersion, msg: Option<&Envelope>, cpu: Duration) {
        let Some(msg) = msg else { return };
        let now = Instant::now();
        let mut debts = self.debts.lock();
        let entry = debts.entry(debtor(h, msg)).or_insert((0.0, now));
        *entry = (decayed(entry.0, entry.1, now) + cpu.as_nanos() as f64, now);
        // Forgiven debts go, so the map stays as small as the set of failing tenants.
        if debts.len() > 64 {
            debts.retain(|_, &mut (d, at)| decayed(d, at, now) >= 1e6);
        }
    }
}

/// The lowest normal priority for the calling thread (nice 19): it gets a small share of
/// a busy core next to normal threads, but is not starved as the idle class would be.
fn lower_current_thread() {
    if crate::sched::nice_current_thread(19).is_err() {
        tracing::warn!("could not lower a background worker's priority");
    }
}

/// Move the calling thread to the idle scheduling class (it then runs only
/// when a core would otherwise idle); nice 19 where that is refused.
fn demote_current_thread() {
    if crate::sched::idle_current_thread().is_err() {
        tracing::warn!("could not lower a long call's worker priority");
    }
}

impl WorkerPool {
    /// Start `workers` threads (0 = one per core).
    pub fn new(runtime: Arc<Runtime>, workers: usize) -> anyhow::Result<Self> {
        let workers = if workers == 0 {
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2)
        } else {
            workers
        };
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let (background, background_rx) = crossbeam_channel::unbounded::<Job>();
        let shared = Arc::new(Shared {
            rx,
            runtime,
            threads: parking_lot::Mutex::new(Vec::with_capacity(workers)),
            spawned: std::sync::atomic::AtomicUsize::new(0),
            demoted: std::sync::atomic::AtomicU64::new(0),
            handback: parking_lot::Mutex::new(Some(tx.clone())),
            background: parking_lot::Mutex::new(Some(background)),
            background_rx,
            background_spawned: std::sync::atomic::AtomicUsize::new(0),
            backgrounded: std::sync::atomic::AtomicU64::new(0),
            debts: parking_lot::Mutex::new(HashMap::new()),
            size: workers,
        });
        for _ in 0..workers {
            shared.spawn_worker()?;
        }
        Ok(Self {
            tx: Some(tx),
            shared,
            size: workers,
        })
    }

    /// Calls that outlived `demote_after` and had their worker replaced.
    pub fn demoted(&self) -> u64 {
        self.shared.demoted.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Jobs of failing tenants sent to the background workers.
    pub fn backgrounded(&self) -> u64 {
        self.shared.backgrounded.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Number of worker threads at normal priority.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Queue a job. The queue is unbounded on purpose: what is in flight is
    /// bounded by the broker (prefetch), and a bounded queue here would form
    /// a cycle with the lanes that wait on it.
    pub fn submit(&self, job: Job) {
        if let Some(tx) = &self.tx
            && tx.send(job).is_err()
        {
            tracing::error!("worker pool is gone; job dropped (its messages stay unacknowledged)");
        }
    }

    /// Run `handle` for each item in order; resolves with the outcomes.
    pub async fn run_each(
        &self,
        items: Vec<(Arc<HandlerVersion>, Envelope)>,
        cancel: Option<Arc<Interrupt>>,
    ) -> anyhow::Result<Vec<(Envelope, CallOutcome)>> {
        let (reply, rx) = oneshot::channel();
        self.submit(Job::Each {
            items,
            done: Vec::new(),
            cancel,
            reply,
        });
        rx.await.context("worker pool stopped during a call")
    }

    /// Run `handle-batch` once; resolves with the members and the outcome.
    pub async fn run_batch(
        &self,
        handler: Arc<HandlerVersion>,
        batch: Vec<Envelope>,
        cancel: Option<Arc<Interrupt>>,
    ) -> anyhow::Result<(Vec<Envelope>, BatchOutcome)> {
        let (reply, rx) = oneshot::channel();
        self.submit(Job::Batch {
            handler,
            batch,
            cancel,
            reply,
        });
        rx.await.context("worker pool stopped during a call")
    }
}

impl WorkerPool {
    /// Run `handle-batch` once for each of `calls`, in order, on one worker.
    pub async fn run_batches(
        &self,
        calls: Vec<(Arc<HandlerVersion>, Vec<Envelope>)>,
        cancel: Option<Arc<Interrupt>>,
    ) -> anyhow::Result<Vec<(Vec<Envelope>, BatchOutcome)>> {
        let (reply, rx) = oneshot::channel();
        self.submit(Job::Batches {
            calls,
            done: Vec::new(),
            cancel,
            reply,
        });
        rx.await.context("worker pool stopped during a call")
    }
}

/// Whether this worker was demoted during the job and the pool can take the rest back.
fn hand_back(shared: &Shared) -> Option<crossbeam_channel::Sender<Job>> {
    if DEMOTED.get() && !BACKGROUND.get() {
        shared.handback.lock().clone()
    } else {
        None
    }
}

#[allow(
    clippy::while_let_on_iterator,
    reason = "the rest of the iterator is handed back from inside the loop"
)]
fn run(exec: &mut Executor, job: Job, shared: &Shared) {
    match job {
        Job::Each {
            items,
            mut done,
            cancel,
            reply,
        } => {
            let mut items = items.into_iter();
            while let Some((h, msg)) = items.next() {
                super::fault::before_call();
                let started = super::host::thread_cpu_time();
                let outcome = exec.call(&h, &msg, &cancel);
                if failed(&outcome) || exec.over_budget() {
                    shared.charge(&h, Some(&msg), super::host::thread_cpu_time().saturating_sub(started));
                }
                done.push((msg, outcome));
                // Demoted during that call: the calls not started yet go back to the queue
                // for a worker at normal priority, in order, with what is done so far.
                if !items.as_slice().is_empty()
                    && let Some(tx) = hand_back(shared)
                {
                    let rest = Job::Each {
                        items: items.collect(),
                        done,
                        cancel,
                        reply,
                    };
                    if let Err(crossbeam_channel::SendError(rest)) = tx.send(rest) {
                        run_here(exec, rest);
                    }
                    return;
                }
            }
            // The receiver may have gone (shutdown): nothing to settle then.
            let _ = reply.send(done);
        }
        Job::Batch {
            handler,
            batch,
            cancel,
            reply,
        } => {
            let started = super::host::thread_cpu_time();
            let outcome = exec.call_batch(&handler, &batch, &cancel);
            if batch_failed(&outcome) || exec.over_budget() {
                let cpu = super::host::thread_cpu_time().saturating_sub(started);
                shared.charge(&handler, batch.first(), cpu);
            }
            let _ = reply.send((batch, outcome));
        }
        Job::Batches {
            calls,
            mut done,
            cancel,
            reply,
        } => {
            let mut calls = calls.into_iter();
            while let Some((h, batch)) = calls.next() {
                let started = super::host::thread_cpu_time();
                let outcome = exec.call_batch(&h, &batch, &cancel);
                if batch_failed(&outcome) || exec.over_budget() {
                    shared.charge(
                        &h,
                        batch.first(),
                        super::host::thread_cpu_time().saturating_sub(started),
                    );
                }
                done.push((batch, outcome));
                if !calls.as_slice().is_empty()
                    && let Some(tx) = hand_back(shared)
                {
                    let rest = Job::Batches {
                        calls: calls.collect(),
                        done,
                        cancel,
                        reply,
                    };
                    if let Err(crossbeam_channel::SendError(rest)) = tx.send(rest) {
                        run_here(exec, rest);
                    }
                    return;
                }
            }
            let _ = reply.send(done);
        }
    }
}

/// Finish a job on this thread whatever its priority (the pool is shutting down).
fn run_here(exec: &mut Executor, job: Job) {
    let closed = Shared {
        rx: crossbeam_channel::never(),
        runtime: exec.runtime.clone(),
        threads: parking_lot::Mutex::new(Vec::new()),
        spawned: std::sync::atomic::AtomicUsize::new(0),
        demoted: std::sync::atomic::AtomicU64::new(0),
        handback: parking_lot::Mutex::new(None),
        background: parking_lot::Mutex::new(None),
        background_rx: crossbeam_channel::never(),
        background_spawned: std::sync::atomic::AtomicUsize::new(0),
        backgrounded: std::sync::atomic::AtomicU64::new(0),
        debts: parking_lot::Mutex::new(HashMap::new()),
        size: 0,
    };
    run(exec, job, &closed);
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.tx = None;
        self.shared.handback.lock().take();
        self.shared.background.lock().take();
        // Demoted workers may start replacements while the queue drains.
        loop {
            let threads = std::mem::take(&mut *self.shared.threads.lock());
            if threads.is_empty() {
                break;
            }
            for t in threads {
                let _ = t.join();
            }
        }
    }
}
