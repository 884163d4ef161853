//! Per-slot execution: one [`SlotRunner`] consumes one slot and runs the
//! messages of each group one at a time, in arrival order (a *lane*), with at
//! most `max_concurrent_groups` lanes running at once. Messages without a
//! group are unordered and run with bounded concurrency. Stopping a runner
//! (shutdown, handoff) stops taking deliveries, returns the ones not yet
//! started, and waits for every call in flight: the drain.
//!
//! Lanes never queue into each other: a lane's queue holds only what the
//! broker delivered (bounded by prefetch), and the worker pool's queue is
//! unbounded, so no cycle of bounded buffers can form.
//!
//! Batching lives inside the lanes, not beside them. A message whose binding
//! is batched ([`BatchRule`]) waits in its group's lane like any other; when
//! the lane's head is such a message, the lane's next work is one
//! `handle-batch` call over the head's run of members of the same (tenant,
//! group, handler), up to `size`, in arrival order. The run goes once it is
//! full, once the next message cannot join it, or once its oldest member has
//! waited `linger`; a batch therefore never overlaps its group's other
//! messages and never waits on a buffer of its own. Batched messages without
//! a group get a lane per (tenant, handler) that may run several batches at
//! once (they are unordered). Each member is settled by its own result
//! through the same code as a single message; a batch call that traps or
//! times out is replayed member by member through `handle`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::FutureExt as _;
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::watch;

use crate::envelope::{self, Envelope};
use crate::partition;
use crate::retry::capture::{self, Captured, Outcome, Provenance, Reason};
use crate::retry::schedule::{Redelivery, Schedule, Step};
use crate::router::{BatchRule, Router};
use crate::runtime::bindings::weir::handler::types::Failure;
use crate::runtime::pool::WorkerPool;
use crate::runtime::{BatchOutcome, CallOutcome, FaultKind, HandlerVersion};
use crate::stats::{FlushReason, Stats};
use crate::transport::{Acker, Delivery, Disposition, Transport};

/// What a node shares between its slot runners.
pub struct Pipeline {
    /// The broker.
    pub transport: Arc<dyn Transport>,
    /// Wasm worker threads.
    pub pool: Arc<WorkerPool>,
    /// Bindings and handler versions.
    pub router: Arc<Router>,
    /// Outcome counters.
    pub stats: Arc<Stats>,
    /// Told the outcome of every settled message (ledgers, tests).
    pub observer: Option<Arc<dyn SettleObserver>>,
}

/// Told how each message was settled.
pub trait SettleObserver: Send + Sync {
    /// `id` was settled with `outcome`.
    fn settled(&self, id: &str, outcome: Outcome);
}

impl Pipeline {
    fn record(&self, id: &str, outcome: Outcome) {
        self.stats.record(outcome);
        if let Some(o) = &self.observer {
            o.settled(id, outcome);
        }
    }

    /// [`Pipeline::record`], also counted for the slot and the handler.
    fn record_in(&self, s: &SlotSettings, handler: Option<&HandlerVersion>, id: &str, outcome: Outcome) {
        self.record(id, outcome);
        s.counters.record(outcome);
        if let Some(h) = handler {
            h.settings.metrics.outcomes.record(outcome);
        }
    }
}

/// How one slot is run.
#[derive(Debug, Clone)]
pub struct SlotSettings {
    /// Topology name.
    pub topology: Arc<str>,
    /// The slot this runner consumes.
    pub slot: u32,
    /// Outcomes of this slot's messages (`weir_slot_messages_total`).
    pub counters: Arc<crate::stats::OutcomeCounters>,
    /// Slots in the topology (for cascades).
    pub slots: u32,
    /// Lanes (groups) running at once in this slot.
    pub max_concurrent_groups: usize,
    /// Jobs of unordered messages running at once in this slot.
    pub max_unordered: usize,
    /// Unsettled deliveries the broker may hand this runner.
    pub prefetch: u32,
    /// Messages of one lane handed to a worker in one job (they still run
    /// one after another).
    pub max_run: usize,
    /// The retry ladder as this broker serves it.
    pub schedule: Schedule,
    /// Negative control for tests: ignore groups, run every message as if
    /// unordered. Breaks guarantee 1 on purpose; never set it in production.
    #[doc(hidden)]
    pub bypass_lanes: bool,
    /// Negative control for tests: run batches in a lane of their own
    /// instead of their group's (the classic batcher beside the lanes).
    /// Breaks guarantee 1 on purpose; never set it in production.
    #[doc(hidden)]
    pub bypass_batch_lanes: bool,
    /// Fault injection for tests: the job holding the first message of this
    /// type panics (once per node). Never set in production.
    #[doc(hidden)]
    pub inject_panic: Option<Arc<InjectedPanic>>,
}

/// A panic a test asks for, fired once: see [`SlotSettings::inject_panic`].
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct InjectedPanic {
    /// The message type whose job panics.
    pub message_type: String,
    /// Set once it fired.
    pub fired: AtomicBool,
}

impl InjectedPanic {
    #[allow(clippy::panic, reason = "panicking on request is this test hook's job")]
    fn fire(&self, envs: &[Envelope]) {
        if envs.iter().any(|e| e.message_type == self.message_type) && !self.fired.swap(true, Ordering::SeqCst) {
            panic!(
                "injected panic (test hook) in a job holding a `{}` message",
                self.message_type
            );
        }
    }
}

/// Every kind of work a runner can have in flight. The drain must wait for
/// each; `tests` enumerate [`LaneKind::ALL`] so a new kind cannot skip it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaneKind {
    /// A group's lane: its messages one at a time.
    Grouped,
    /// Messages without a group id: unordered, bounded concurrency.
    Unordered,
    /// A capture with no handler call (undecodable, no handler).
    Capture,
    /// One `handle-batch` call (and its replay, if it failed) in a lane.
    Batch,
}

impl LaneKind {
    /// All kinds.
    pub const ALL: [LaneKind; 4] = [
        LaneKind::Grouped,
        LaneKind::Unordered,
        LaneKind::Capture,
        LaneKind::Batch,
    ];
}

enum Done {
    /// A job that panicked, with what it would have returned and the
    /// panic's message.
    Panicked(Box<Done>, String),
    /// A job that ran the messages of these lanes (by lane key).
    Groups(Vec<u64>),
    Unordered,
    Capture,
    /// Batches of these lanes (by lane key; a loose lane may repeat).
    Batches(Vec<u64>),
}

impl Done {
    fn kind(&self) -> LaneKind {
        match self {
            Done::Panicked(done, _) => done.kind(),
            Done::Groups(_) => LaneKind::Grouped,
            Done::Unordered => LaneKind::Unordered,
            Done::Capture => LaneKind::Capture,
            Done::Batches(_) => LaneKind::Batch,
        }
    }
}

/// A delivery waiting in a lane.
struct Queued {
    d: Delivery,
    /// When the runner took it (a batch's linger counts from its oldest member).
    at: Instant,
    /// How it is batched, if it is.
    batch: Option<Arc<BatchRule>>,
}

impl Queued {
    fn env(&self) -> Option<&Envelope> {
        self.d.message.as_ref().ok()
    }
}

#[derive(Default)]
struct Lane {
    queue: VecDeque<Queued>,
    /// Jobs of this lane in flight (at most one unless `loose`).
    running: usize,
    ready: bool,
    /// The head batch waits for more members until then.
    lingering: Option<Instant>,
    /// Ungrouped batched messages of one (tenant, handler): no order to keep,
    /// so several of its batches may run at once.
    loose: bool,
}

impl Lane {
    /// May the scheduler take another job from this lane now?
    fn can_start(&self) -> bool {
        !self.queue.is_empty() && (self.running == 0 || self.loose) && self.lingering.is_none()
    }
}

/// What the head of a lane gives when its head is a batched message.
enum Take {
    /// Run these members now, for this reason.
    Batch(Vec<Delivery>, FlushReason),
    /// Not yet: the batch may grow until this instant.
    Wait(Instant),
}

/// Take the batch at the head of `lane`: the head and the members after it
/// of the same rule, tenant and group, up to the rule's size.
fn take_batch(lane: &mut Lane, rule: &Arc<BatchRule>, now: Instant) -> Take {
    let Some(head) = lane.queue.front() else {
        return Take::Wait(now);
    };
    let (tenant, group) = head
        .env()
        .map(|e| (e.tenant_id.clone(), e.group_id.clone()))
        .unwrap_or_default();
    let oldest = head.at;
    let mut n = 0;
    let mut boundary = false;
    for q in &lane.queue {
        if n == rule.size {
            break;
        }
        let joins = q.batch.as_ref().is_some_and(|r| Arc::ptr_eq(r, rule))
            && q.env().is_some_and(|e| e.tenant_id == tenant && e.group_id == group);
        if !joins {
            boundary = true;
            break;
        }
        n += 1;
    }
    let reason = if n == rule.size {
        FlushReason::Size
    } else if boundary {
        FlushReason::Boundary
    } else if now >= oldest + rule.linger {
        FlushReason::Linger
    } else {
        return Take::Wait(oldest + rule.linger);
    };
    Take::Batch(lane.queue.drain(..n).map(|q| q.d).collect(), reason)
}

/// The key of a group's lane: the FNV-1a hash of (tenant, group id), so two
/// tenants' groups of the same name never share a lane (one tenant cannot
/// hold another's messages behind its own). Without a tenant it is the hash
/// of the group id alone (the same hash the slot function starts from). Two
/// keys that collide share a lane and are serialised together: slower,
/// never unsafe.
fn lane_key(tenant: Option<&str>, group: &str) -> u64 {
    match tenant {
        None => partition::fnv1a_64(group.as_bytes()),
        // A NUL cannot be part of the tenant's UTF-8 name, so ("a", "bc") and
        // ("ab", "c") hash different byte strings.
        Some(t) => partition::fnv1a_64_continue(
            partition::fnv1a_64_continue(partition::fnv1a_64(t.as_bytes()), b"\0"),
            group.as_bytes(),
        ),
    }
}

/// The lane of ungrouped batched messages of one (tenant, handler).
fn loose_key(tenant: Option<&str>, handler: &str) -> u64 {
    let key = format!("\0loose\0{}\0{handler}", tenant.unwrap_or_default());
    partition::fnv1a_64(key.as_bytes())
}

/// What `bypass_batch_lanes` mixes into a group's key to give its batches a
/// lane of their own (the negative control).
const BYPASS_SALT: u64 = 0x9e37_79b9_7f4a_7c15;

type LaneMap = HashMap<u64, Lane, nohash_hasher::BuildNoHashHasher<u64>>;

/// Take a lane's queue for release at a drain (its batch members counted).
fn take_queue(stats: &Stats, lane: &mut Lane) -> Vec<Delivery> {
    let members = lane.queue.iter().filter(|q| q.batch.is_some()).count() as u64;
    stats.batch_released.fetch_add(members, Ordering::Relaxed);
    lane.lingering = None;
    lane.queue.drain(..).map(|q| q.d).collect()
}

/// Deliveries a runner takes from the subscription before it schedules.
const BURST: usize = 512;

/// What a runner did, returned when it stops.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RunnerReport {
    /// Deliveries received.
    pub received: u64,
    /// Deliveries returned unstarted at the drain.
    pub released: u64,
    /// In-flight jobs the drain waited for, by kind.
    pub drained: Vec<LaneKind>,
}

/// Consumes one slot. See the module docs.
pub struct SlotRunner {
    p: Arc<Pipeline>,
    s: Arc<SlotSettings>,
    cancel: Arc<AtomicBool>,
    lanes: LaneMap,
    ready: VecDeque<u64>,
    /// Lanes whose head batch lingers, by deadline (stale entries skipped).
    lingering: BinaryHeap<Reverse<(Instant, u64)>>,
    /// Messages waiting in lane queues (not yet handed to a worker).
    queued: usize,
    running_groups: usize,
    unordered: VecDeque<Delivery>,
    running_unordered: usize,
    inflight: FuturesUnordered<BoxFuture<'static, Done>>,
    report: RunnerReport,
    /// Set by the first job that panicked: the runner drains and stops.
    poisoned: Option<String>,
}

impl SlotRunner {
    /// A runner for one slot; nothing happens until [`SlotRunner::run`].
    pub fn new(p: Arc<Pipeline>, s: SlotSettings) -> Self {
        Self {
            p,
            s: Arc::new(s),
            cancel: Arc::new(AtomicBool::new(false)),
            lanes: LaneMap::default(),
            ready: VecDeque::new(),
            lingering: BinaryHeap::new(),
            queued: 0,
            running_groups: 0,
            unordered: VecDeque::new(),
            running_unordered: 0,
            inflight: FuturesUnordered::new(),
            report: RunnerReport::default(),
            poisoned: None,
        }
    }

    /// Set to interrupt this slot's running calls (ownership lost).
    pub fn cancel_handle(&self) -> Arc<AtomicBool> {
        self.cancel.clone()
    }

    /// Consume until `stop` turns true (or its sender is dropped), then drain.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) -> anyhow::Result<RunnerReport> {
        let s = self.s.clone();
        let mut sub = self
            .p
            .transport
            .subscribe(&s.topology, s.slot, s.prefetch)
            .await
            .map_err(|e| anyhow::anyhow!("subscribing to slot {} of topology `{}`: {e}", s.slot, s.topology))?;
        tracing::debug!(topology = %s.topology, slot = s.slot, "slot runner started");
        if !*stop.borrow() {
            'consume: loop {
                let linger = self.lingering.peek().map(|Reverse((at, _))| *at);
                let wake = linger.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
                tokio::select! {
                    biased;
                    Some(done) = self.inflight.next(), if !self.inflight.is_empty() => self.finish(done),
                    () = tokio::time::sleep_until(wake.into()), if linger.is_some() => self.wake_lingering(Instant::now()),
                    changed = stop.changed() => if changed.is_err() || *stop.borrow() { break },
                    next = sub.next() => match next {
                        Some(Ok(d)) => {
                            self.report.received += 1;
                            self.accept(d);
                            // Take what else is already here in one go, so
                            // jobs can carry several messages.
                            for _ in 0..BURST {
                                match sub.try_next() {
                                    Some(Ok(d)) => {
                                        self.report.received += 1;
                                        self.accept(d);
                                    }
                                    Some(Err(e)) => {
                                        tracing::warn!(topology = %s.topology, slot = s.slot, error = %e, "subscription error; interrupting in-flight calls");
                                        self.cancel.store(true, Ordering::Relaxed);
                                        break 'consume;
                                    }
                                    None => break,
                                }
                            }
                        }
                        Some(Err(e)) => {
                            // The consumer is gone (connection lost): its
                            // deliveries go back to the broker, which may hand
                            // them to another consumer. Interrupt the calls in
                            // flight so none of them runs alongside that one.
                            tracing::warn!(topology = %s.topology, slot = s.slot, error = %e, "subscription error; interrupting in-flight calls");
                            self.cancel.store(true, Ordering::Relaxed);
                            break;
                        }
                        None => break,
                    },
                }
                if self.poisoned.is_some() {
                    break;
                }
                self.schedule();
                s.counters
                    .set_depth(self.queued + self.unordered.len(), self.running_groups);
            }
        }
        s.counters.set_depth(0, 0);
        self.drain(sub.as_mut()).await;
        sub.close().await;
        drop(sub);
        tracing::debug!(topology = %s.topology, slot = s.slot, "slot runner drained");
        if let Some(text) = self.poisoned.take() {
            anyhow::bail!("a job of slot {} of topology `{}` panicked: {text}", s.slot, s.topology);
        }
        Ok(self.report)
    }

    /// Stop the subscription first, so nothing more is delivered into this
    /// draining runner: what had already been sent to it is taken into its
    /// lanes, unstarted, until the subscription ends. A subscription that
    /// cannot end that way (RabbitMQ) has its unstarted deliveries released
    /// at once, as the broker redelivers them elsewhere only when the
    /// channel closes. Then wait for every job in flight, and release the
    /// rest. Releases go out one after another in arrival order (the
    /// broker's position), so each group's messages return head first and
    /// the broker can hand them to the next owner in order; none is sent
    /// while the subscription could still take it back. A release is never
    /// a failure: it does not count as an attempt.
    async fn drain(&mut self, sub: &mut dyn crate::transport::Subscription) {
        let mut collecting = sub.stop().await;
        self.ready.clear();
        self.lingering.clear();
        let stats = self.p.stats.clone();
        if !collecting {
            let mut idle: Vec<Delivery> = self.unordered.drain(..).collect();
            for lane in self.lanes.values_mut() {
                idle.extend(take_queue(&stats, lane));
            }
            self.queued = 0;
            self.release(idle).await;
        }
        while collecting || !self.inflight.is_empty() {
            tokio::select! {
                Some(done) = self.inflight.next(), if !self.inflight.is_empty() => {
                    self.report.drained.push(done.kind());
                    self.finish(done);
                }
                next = sub.next(), if collecting => match next {
                    Some(Ok(d)) => {
                        self.report.received += 1;
                        self.accept(d);
                    }
                    Some(Err(e)) => {
                        tracing::warn!(topology = %self.s.topology, slot = self.s.slot, error = %e, "subscription error while draining");
                        collecting = false;
                    }
                    None => collecting = false,
                },
            }
        }
        self.ready.clear();
        self.lingering.clear();
        let mut rest: Vec<Delivery> = self.unordered.drain(..).collect();
        for lane in self.lanes.values_mut() {
            rest.extend(take_queue(&stats, lane));
        }
        self.lanes.clear();
        self.queued = 0;
        self.release(rest).await;
    }

    /// Release `pending` one after another in arrival order.
    async fn release(&mut self, mut pending: Vec<Delivery>) {
        pending.sort_by_key(|d| d.tag);
        self.report.released += pending.len() as u64;
        for d in pending {
            if let Err(e) = d.acker.settle(Disposition::Release).await {
                tracing::warn!(tag = d.tag, error = %e, "release at drain failed; the broker redelivers it");
            }
            self.p.stats.record(Outcome::Released);
        }
    }

    fn accept(&mut self, d: Delivery) {
        let key = match &d.message {
            Err(_) => {
                let (p, s) = (self.p.clone(), self.s.clone());
                self.job(Done::Capture, async move { capture_undecodable(&p, &s, d).await });
                return;
            }
            Ok(env) => {
                let batch = self.p.router.batch_rule(&self.s.topology, env).cloned();
                match (env.group().filter(|_| !self.s.bypass_lanes), batch) {
                    (Some(g), batch) => {
                        let salt = if batch.is_some() && self.s.bypass_batch_lanes {
                            BYPASS_SALT
                        } else {
                            0
                        };
                        Some((lane_key(env.tenant_id.as_deref(), g) ^ salt, batch, false))
                    }
                    (None, Some(rule)) => Some((loose_key(env.tenant_id.as_deref(), &rule.handler), Some(rule), true)),
                    (None, None) => None,
                }
            }
        };
        let Some((key, batch, loose)) = key else {
            self.unordered.push_back(d);
            return;
        };
        let lane = self.lanes.entry(key).or_insert_with(|| Lane {
            loose,
            ..Lane::default()
        });
        // Keys of a group and of loose batches could collide: the lane then
        // keeps order (slower, never unsafe).
        lane.loose &= loose;
        lane.queue.push_back(Queued {
            d,
            at: Instant::now(),
            batch,
        });
        self.queued += 1;
        // A lingering batch may be complete now: look again.
        lane.lingering = None;
        if lane.can_start() && !lane.ready {
            lane.ready = true;
            self.ready.push_back(key);
        }
    }

    /// Batches whose linger ran out go back to the ready queue.
    fn wake_lingering(&mut self, now: Instant) {
        while let Some(Reverse((at, key))) = self.lingering.peek().copied() {
            if at > now {
                break;
            }
            self.lingering.pop();
            let Some(lane) = self.lanes.get_mut(&key) else { continue };
            if lane.lingering != Some(at) {
                continue; // stale: the lane was looked at again since
            }
            lane.lingering = None;
            if lane.can_start() && !lane.ready {
                lane.ready = true;
                self.ready.push_back(key);
            }
        }
    }

    fn lane_done(&mut self, key: u64) {
        self.running_groups -= 1;
        let Some(lane) = self.lanes.get_mut(&key) else { return };
        lane.running -= 1;
        if lane.queue.is_empty() && lane.running == 0 {
            self.lanes.remove(&key);
        } else if lane.can_start() && !lane.ready {
            lane.ready = true;
            self.ready.push_back(key);
        }
    }

    /// Put `work` in flight; `done` says what it occupies. A panic in it is
    /// caught here: the messages it held are left unsettled (the broker
    /// redelivers them once this runner's subscription is gone), the panic
    /// is counted and logged at once, the slot is marked failing (`/ready`
    /// answers 503), and the runner stops taking deliveries, drains what
    /// else runs and returns an error, so its supervisor restarts it.
    fn job(&mut self, done: Done, work: impl std::future::Future<Output = ()> + Send + 'static) {
        self.inflight.push(Box::pin(async move {
            match std::panic::AssertUnwindSafe(work).catch_unwind().await {
                Ok(()) => done,
                Err(panic) => Done::Panicked(Box::new(done), panic_text(panic.as_ref())),
            }
        }));
    }

    fn finish(&mut self, done: Done) {
        match done {
            Done::Panicked(done, text) => {
                let s = &self.s;
                self.p.stats.runner_panics.fetch_add(1, Ordering::Relaxed);
                self.p.stats.mark_failing(&s.topology, s.slot, &text);
                tracing::error!(
                    topology = %s.topology, slot = s.slot, panic = %text,
                    "a job of this slot panicked; its messages are left to the broker, and the runner drains and restarts"
                );
                self.poisoned.get_or_insert(text);
                self.finish(*done);
            }
            Done::Groups(keys) => {
                for key in keys {
                    self.lane_done(key);
                }
            }
            Done::Batches(keys) => {
                for key in keys {
                    self.lane_done(key);
                }
            }
            Done::Unordered => self.running_unordered -= 1,
            Done::Capture => {}
        }
    }

    /// Hand ready work to the pool. A job may carry the next messages of
    /// several lanes (each lane's in order, one lane after another, on one
    /// worker); its size is the backlog shared out over the workers, capped
    /// at `max_run`, so a backlog amortises the hand-off and a trickle still
    /// goes out one message at a time. A lane whose head is a batched
    /// message gives a batch instead (or lingers); the batches taken in one
    /// round share one job the same way, their members counting towards its
    /// size.
    fn schedule(&mut self) {
        let workers = self.p.pool.size().max(1);
        let max_run = self.s.max_run.max(1);
        let now = Instant::now();
        while self.running_groups < self.s.max_concurrent_groups && !self.ready.is_empty() {
            let target = (self.queued / workers).clamp(1, max_run);
            let mut run: Vec<Delivery> = Vec::with_capacity(target);
            let mut keys = Vec::new();
            let mut batches = Vec::new();
            let mut batch_keys = Vec::new();
            let mut members = 0;
            // One tenant per job: a job runs on one worker, one message after
            // another, so a tenant waiting on its concurrency limit or
            // running away must not hold another tenant's messages.
            let mut job_tenant: Option<Option<String>> = None;
            while run.len() + members < target && self.running_groups < self.s.max_concurrent_groups {
                let Some(key) = self.ready.pop_front() else { break };
                let Some(lane) = self.lanes.get_mut(&key) else { continue };
                let tenant = lane
                    .queue
                    .front()
                    .and_then(Queued::env)
                    .and_then(|e| e.tenant_id.as_deref());
                match &job_tenant {
                    None => job_tenant = Some(tenant.map(str::to_owned)),
                    Some(t) if t.as_deref() == tenant => {}
                    Some(_) => {
                        self.ready.push_front(key);
                        break;
                    }
                }
                lane.ready = false;
                if let Some(rule) = lane.queue.front().and_then(|q| q.batch.clone()) {
                    match take_batch(lane, &rule, now) {
                        Take::Wait(until) => {
                            lane.lingering = Some(until);
                            self.lingering.push(Reverse((until, key)));
                        }
                        Take::Batch(batch, reason) => {
                            self.queued -= batch.len();
                            members += batch.len();
                            lane.running += 1;
                            self.running_groups += 1;
                            if lane.can_start() {
                                lane.ready = true;
                                self.ready.push_back(key);
                            }
                            batches.push((batch, reason));
                            batch_keys.push(key);
                        }
                    }
                    continue;
                }
                // Single messages up to the next batched one.
                let n = lane
                    .queue
                    .iter()
                    .take(target - run.len() - members)
                    .take_while(|q| q.batch.is_none())
                    .count();
                run.extend(lane.queue.drain(..n).map(|q| q.d));
                self.queued -= n;
                lane.running += 1;
                self.running_groups += 1;
                keys.push(key);
            }
            if !batches.is_empty() {
                let (p, s, c) = (self.p.clone(), self.s.clone(), self.cancel.clone());
                self.job(Done::Batches(batch_keys), run_batches(p, s, c, batches));
            }
            if !keys.is_empty() {
                let (p, s, c) = (self.p.clone(), self.s.clone(), self.cancel.clone());
                self.job(Done::Groups(keys), run_lane(p, s, c, run));
            }
        }
        let unordered_run = if self.s.bypass_lanes { 1 } else { max_run };
        while self.running_unordered < self.s.max_unordered.max(1) && !self.unordered.is_empty() {
            let n = (self.unordered.len() / workers)
                .clamp(1, unordered_run)
                .min(self.unordered.len());
            // One tenant per job, as for lanes.
            fn tenant_of(d: &Delivery) -> Option<&str> {
                d.message.as_ref().ok().and_then(|e| e.tenant_id.as_deref())
            }
            let first = self.unordered.front().and_then(tenant_of);
            let n = self
                .unordered
                .iter()
                .take(n)
                .take_while(|d| tenant_of(d) == first)
                .count()
                .max(1);
            let run: Vec<Delivery> = self.unordered.drain(..n).collect();
            self.running_unordered += 1;
            let (p, s, c) = (self.p.clone(), self.s.clone(), self.cancel.clone());
            self.job(Done::Unordered, run_lane(p, s, c, run));
        }
    }
}

/// The message of a caught panic.
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

async fn capture_undecodable(p: &Pipeline, s: &SlotSettings, d: Delivery) {
    let Delivery {
        message,
        source,
        tag,
        acker,
    } = d;
    let Err((wire, err)) = message else { return };
    capture_raw(p, &s.topology, wire, &err, &source, tag, acker).await;
}

/// Dead-letter a message that did not decode (reason `undecodable`), keep
/// its bytes and headers as received, and record the outcome under its
/// message id (or `source#tag` when it has none).
pub(crate) async fn capture_raw(
    p: &Pipeline,
    topology: &str,
    wire: crate::envelope::Wire,
    err: &crate::envelope::DecodeError,
    source: &str,
    tag: u64,
    acker: Box<dyn Acker>,
) -> Outcome {
    let error = err.to_string();
    let prov = Provenance {
        reason: Reason::Undecodable,
        error: &error,
        source,
        handler: None,
        tag,
    };
    let id = wire
        .header(envelope::header::MESSAGE_ID)
        .map_or_else(|| format!("{source}#{tag}"), str::to_owned);
    let outcome = capture::capture(p.transport.as_ref(), topology, Captured::Raw(wire), acker, &prov).await;
    p.record(&id, outcome);
    outcome
}

/// Dead-letter a decoded message with its provenance (the one place lanes
/// build a [`Provenance`] for an envelope).
#[allow(clippy::too_many_arguments)]
async fn capture_envelope(
    p: &Pipeline,
    s: &SlotSettings,
    env: &Envelope,
    acker: Box<dyn Acker>,
    reason: Reason,
    error: &str,
    source: &str,
    handler: Option<&HandlerVersion>,
    tag: u64,
) -> Outcome {
    let prov = Provenance {
        reason,
        error,
        source,
        handler: handler.map(|h| (h.name(), h.digest.as_str())),
        tag,
    };
    capture::capture(p.transport.as_ref(), &s.topology, Captured::Envelope(env), acker, &prov).await
}

/// On a broker that counts deliveries itself (JetStream), a delivery past
/// the handler's last only retries the dead-letter capture of a message whose
/// capture failed (`Role::CaptureRetry`): returns the handler's last delivery
/// when `attempt` is such a one.
fn capture_retry(schedule: &Schedule, attempt: u32) -> Option<u32> {
    if !matches!(schedule.redelivery(), Redelivery::JetStream { .. }) {
        return None;
    }
    schedule.handler_deliveries().filter(|last| attempt > *last)
}

struct Pending {
    acker: Box<dyn Acker>,
    source: Arc<str>,
    tag: u64,
    handler: Arc<HandlerVersion>,
}

/// Take a delivery into a call: a delivery kept in reserve for a capture
/// retry, or one with no handler, is captured here (and `None` returned);
/// otherwise the message and what settling it needs.
async fn admit(p: &Pipeline, s: &SlotSettings, d: Delivery) -> Option<(Envelope, Pending)> {
    let Delivery {
        message,
        source,
        tag,
        acker,
    } = d;
    // Undecodable deliveries never reach a lane.
    let env = message.ok()?;
    if let Some(last) = capture_retry(&s.schedule, env.attempt) {
        let error = format!(
            "delivery {} comes after the handler's last ({last}): it is kept in reserve to retry a \
             dead-letter capture that failed, so the handler does not run again",
            env.attempt
        );
        let outcome = capture_envelope(p, s, &env, acker, Reason::Exhausted, &error, &source, None, tag).await;
        p.record_in(s, None, &env.id, outcome);
        return None;
    }
    match p.router.route(&s.topology, &env) {
        Some(handler) => Some((
            env,
            Pending {
                acker,
                source,
                tag,
                handler,
            },
        )),
        None => {
            let error = format!(
                "no handler for message type `{}` (tenant {}) in topology `{}`",
                env.message_type,
                env.tenant_id.as_deref().unwrap_or("none"),
                s.topology
            );
            let outcome = capture_envelope(p, s, &env, acker, Reason::NoHandler, &error, &source, None, tag).await;
            p.record_in(s, None, &env.id, outcome);
            None
        }
    }
}

/// Admission per handler (`limits.instances`) and per tenant
/// (`tenant.limits.concurrency`), acquired in one global order (handlers by
/// version id, then tenants by name) so two lanes can never each hold what
/// the other waits for.
async fn admission<'a>(
    handlers: impl Iterator<Item = &'a Arc<HandlerVersion>>,
) -> Vec<tokio::sync::OwnedSemaphorePermit> {
    let mut handlers: Vec<&Arc<HandlerVersion>> = handlers.collect();
    handlers.sort_by_key(|h| h.id);
    handlers.dedup_by_key(|h| h.id);
    let mut tenants: Vec<&crate::runtime::TenantShare> = handlers
        .iter()
        .filter_map(|h| h.tenant())
        .filter(|t| t.permits.is_some())
        .collect();
    tenants.sort_by(|a, b| a.name.cmp(&b.name));
    tenants.dedup_by(|a, b| a.name == b.name);
    let mut permits = Vec::with_capacity(handlers.len() + tenants.len());
    let sems = handlers
        .iter()
        .map(|h| (h.name(), &h.permits))
        .chain(tenants.iter().filter_map(|t| Some((&*t.name, t.permits.as_ref()?))));
    for (name, sem) in sems {
        match sem.clone().acquire_owned().await {
            Ok(permit) => permits.push(permit),
            Err(_) => tracing::error!(handler = name, "admission closed"),
        }
    }
    permits
}

/// [`admit`] each delivery, in order: the messages that go to a handler
/// and, at the same index, what settling each needs.
async fn admit_all(p: &Pipeline, s: &SlotSettings, run: Vec<Delivery>) -> (Vec<Envelope>, Vec<Pending>) {
    let mut envs = Vec::with_capacity(run.len());
    let mut pending = Vec::with_capacity(run.len());
    for d in run {
        if let Some((env, pend)) = admit(p, s, d).await {
            envs.push(env);
            pending.push(pend);
        }
    }
    (envs, pending)
}

/// Call `handle` for each item in order on one worker. `None` when the pool
/// is gone (process shutting down): the deliveries are then neither acked
/// nor captured, so the broker redelivers them.
async fn call_each(
    p: &Pipeline,
    items: Vec<(Arc<HandlerVersion>, Envelope)>,
    cancel: Arc<AtomicBool>,
) -> Option<Vec<(Envelope, CallOutcome)>> {
    match p.pool.run_each(items, Some(cancel)).await {
        Ok(o) => Some(o),
        Err(e) => {
            tracing::error!(error = %e, "worker pool unavailable; leaving deliveries unsettled");
            None
        }
    }
}

/// Run one lane's messages (in order, on one worker) and settle each.
async fn run_lane(p: Arc<Pipeline>, s: Arc<SlotSettings>, cancel: Arc<AtomicBool>, run: Vec<Delivery>) {
    let (envs, pending) = admit_all(&p, &s, run).await;
    if envs.is_empty() {
        return;
    }
    if let Some(i) = &s.inject_panic {
        i.fire(&envs);
    }
    let items = pending.iter().map(|x| x.handler.clone()).zip(envs).collect();
    let permits = admission(pending.iter().map(|x| &x.handler)).await;
    let Some(outcomes) = call_each(&p, items, cancel).await else {
        return;
    };
    drop(permits);
    settle_all(&p, &s, outcomes, pending).await;
}

/// Run batches (each of one tenant, group and handler, in order) through
/// `handle-batch`, all on one worker, then settle each member by its own
/// result. A call that traps or times out gives no results: its members are
/// replayed one at a time through `handle`, unchanged (group, tenant,
/// attempt), and settled by those calls. A cancelled call releases its
/// members.
async fn run_batches(
    p: Arc<Pipeline>,
    s: Arc<SlotSettings>,
    cancel: Arc<AtomicBool>,
    batches: Vec<(Vec<Delivery>, FlushReason)>,
) {
    let mut calls = Vec::with_capacity(batches.len());
    let mut pendings = Vec::with_capacity(batches.len());
    for (members, reason) in batches {
        let (batch, pending) = admit_all(&p, &s, members).await;
        // Every member routes to the same handler; one version runs them
        // all (a swap between two lookups must not split the batch).
        let Some(handler) = pending.first().map(|x| x.handler.clone()) else {
            continue;
        };
        p.stats.record_batch(batch.len(), reason);
        calls.push((handler, batch));
        pendings.push(pending);
    }
    if calls.is_empty() {
        return;
    }
    let permits = admission(calls.iter().map(|(h, _)| h)).await;
    let handlers: Vec<Arc<HandlerVersion>> = calls.iter().map(|(h, _)| h.clone()).collect();
    let results = match p.pool.run_batches(calls, Some(cancel.clone())).await {
        Ok(o) => o,
        Err(e) => {
            tracing::error!(error = %e, "worker pool unavailable; leaving batch members unsettled");
            return;
        }
    };
    let mut settled = Vec::with_capacity(results.len());
    for ((batch, outcome), handler) in results.into_iter().zip(handlers) {
        let Some(outcomes) = batch_outcomes(&p, &s, &handler, batch, outcome, &cancel).await else {
            return;
        };
        settled.push(outcomes);
    }
    drop(permits);
    for (outcomes, pending) in settled.into_iter().zip(pendings) {
        settle_all(&p, &s, outcomes, pending).await;
    }
}

/// One outcome per member of a batch call: its own result with its own
/// cascades (published by [`settle`] before that member's ack, so a member
/// that answered `retry` or `reject` sends nothing), the replay's result after
/// a trap or timeout, or the cancellation. A call that published for the
/// whole batch (before naming a member: every 0.1.0 component) sends those
/// cascades before any ack when every member succeeded, and is replayed
/// member by member through `handle` otherwise, since nobody can tell whose
/// they were. `None` when the pool is gone.
async fn batch_outcomes(
    p: &Arc<Pipeline>,
    s: &Arc<SlotSettings>,
    handler: &Arc<HandlerVersion>,
    batch: Vec<Envelope>,
    outcome: BatchOutcome,
    cancel: &Arc<AtomicBool>,
) -> Option<Vec<(Envelope, CallOutcome)>> {
    match outcome {
        BatchOutcome::Done {
            results, unattributed, ..
        } if !unattributed.is_empty() && !results.iter().all(Result::is_ok) => {
            p.stats.batch_replays.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                handler = handler.name(),
                group = batch.first().and_then(|e| e.group()),
                members = batch.len(),
                unattributed = unattributed.len(),
                "handle-batch published for no member in particular (no begin-member first) and not every \
                 member succeeded; replaying its members one at a time through handle"
            );
            let items = batch.into_iter().map(|env| (handler.clone(), env)).collect();
            call_each(p, items, cancel.clone()).await
        }
        BatchOutcome::Done {
            results,
            published,
            unattributed,
        } => {
            // Whole-batch cascades (every member succeeded) go out before any
            // member is acked; if they cannot, every member is retried like a
            // single message whose cascade failed.
            let cascade_error = if unattributed.is_empty() {
                None
            } else {
                publish_cascades(p, s, unattributed.into_iter().map(|o| o.envelope))
                    .await
                    .err()
            };
            let outcomes = batch
                .into_iter()
                .zip(results.into_iter().zip(published))
                .map(|(env, (result, published))| {
                    let done = match (result, &cascade_error) {
                        (Ok(()), Some(e)) => CallOutcome::Done {
                            result: Err(Failure::Retry(format!("cascaded publish of its batch failed: {e}"))),
                            published: Vec::new(),
                        },
                        (result, _) => CallOutcome::Done { result, published },
                    };
                    (env, done)
                })
                .collect();
            Some(outcomes)
        }
        BatchOutcome::Fault(f) if f.kind == FaultKind::Cancelled => Some(
            batch
                .into_iter()
                .map(|env| (env, CallOutcome::Fault(f.clone())))
                .collect(),
        ),
        BatchOutcome::Fault(f) => {
            p.stats.faults.fetch_add(1, Ordering::Relaxed);
            p.stats.batch_replays.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                handler = handler.name(), group = batch.first().and_then(|e| e.group()), members = batch.len(),
                fault = %f, "handle-batch failed; replaying its members one at a time through handle"
            );
            let items = batch.into_iter().map(|env| (handler.clone(), env)).collect();
            call_each(p, items, cancel.clone()).await
        }
    }
}

/// Settle every message of a call by its outcome (the one path single
/// messages and batch members share).
async fn settle_all(
    p: &Arc<Pipeline>,
    s: &Arc<SlotSettings>,
    outcomes: Vec<(Envelope, CallOutcome)>,
    pending: Vec<Pending>,
) {
    // The common case, handled with nothing to publish, only needs its ack:
    // settle those in order right here. Everything else (cascades to
    // confirm, retries, captures) may wait on the broker, so those settle
    // concurrently, each boxed so this future stays small.
    let mut slow = Vec::new();
    for ((env, outcome), pend) in outcomes.into_iter().zip(pending) {
        match outcome {
            CallOutcome::Done {
                result: Ok(()),
                published,
            } if published.is_empty() => {
                if let Err(e) = pend.acker.settle(Disposition::Ack).await {
                    p.stats.ack_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(tag = pend.tag, error = %e, "ack of a handled message failed; it may be delivered again");
                }
                p.record_in(s, Some(&pend.handler), &env.id, Outcome::Handled);
            }
            outcome => {
                let (p, s) = (p.clone(), s.clone());
                slow.push(Box::pin(async move {
                    let id = p.observer.as_ref().map(|_| env.id.clone());
                    let handler = pend.handler.clone();
                    let o = settle(&p, &s, env, outcome, pend).await;
                    p.record_in(&s, Some(&handler), id.as_deref().unwrap_or_default(), o);
                }));
            }
        }
    }
    if !slow.is_empty() {
        futures::future::join_all(slow).await;
    }
}

/// Negative control for the fence tests, never for production: with this
/// environment variable set to `1` a call the host cancelled (a fence, a
/// drain deadline, a lost subscription) and the calls after it in its job
/// count as failed attempts (as a timeout does) instead of being released.
pub const NEGATIVE_CONTROL_CANCEL_FAILS: &str = "WEIR_NEGATIVE_CONTROL_CANCEL_FAILS";

fn cancel_fails() -> bool {
    static SET: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SET.get_or_init(|| {
        let set = std::env::var(NEGATIVE_CONTROL_CANCEL_FAILS).is_ok_and(|v| v == "1");
        if set {
            tracing::error!(
                "{NEGATIVE_CONTROL_CANCEL_FAILS}=1: cancelled calls count as FAILED attempts (a test's negative control; never in production)"
            );
        }
        set
    })
}

/// Turn a call's outcome into a settled delivery.
async fn settle(p: &Pipeline, s: &SlotSettings, env: Envelope, outcome: CallOutcome, pend: Pending) -> Outcome {
    let Pending {
        acker,
        source,
        tag,
        handler,
    } = pend;
    let (error, final_reason) = match outcome {
        CallOutcome::Done {
            result: Ok(()),
            published,
        } => match publish_cascades(p, s, published.into_iter().map(|o| o.envelope)).await {
            Ok(()) => {
                if let Err(e) = acker.settle(Disposition::Ack).await {
                    p.stats.ack_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(tag, error = %e, "ack of a handled message failed; it may be delivered again");
                }
                return Outcome::Handled;
            }
            Err(e) => (format!("cascaded publish failed: {e}"), Reason::Exhausted),
        },
        CallOutcome::Done {
            result: Err(Failure::Reject(reason)),
            ..
        } => {
            return capture_envelope(
                p,
                s,
                &env,
                acker,
                Reason::Rejected,
                &reason,
                &source,
                Some(&handler),
                tag,
            )
            .await;
        }
        CallOutcome::Done {
            result: Err(Failure::Retry(reason)),
            ..
        } => (reason, Reason::Exhausted),
        CallOutcome::Fault(f) => {
            p.stats.faults.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(handler = handler.name(), message = %env.id, attempt = env.attempt, fault = %f, "guest fault");
            match f.kind {
                FaultKind::Cancelled if cancel_fails() => (f.to_string(), Reason::Timeout),
                FaultKind::Cancelled => {
                    if let Err(e) = acker.settle(Disposition::Release).await {
                        tracing::warn!(tag, error = %e, "release of a cancelled call failed; the broker redelivers it");
                    }
                    return Outcome::Released;
                }
                FaultKind::Timeout => (f.to_string(), Reason::Timeout),
                FaultKind::Trap | FaultKind::MemoryLimit | FaultKind::Instantiate => (f.to_string(), Reason::Trap),
            }
        }
    };
    match s.schedule.next_step(env.attempt) {
        Step::RetryAfter(delay) => {
            let mut next = env;
            next.attempt += 1;
            tracing::debug!(handler = handler.name(), message = %next.id, next_attempt = next.attempt, ?delay, error, "retry scheduled");
            match acker.settle(Disposition::Retry { envelope: next, delay }).await {
                Ok(()) => Outcome::RetryScheduled,
                Err(e) => {
                    tracing::warn!(tag, error = %e, "scheduling a retry failed; the broker redelivers the original");
                    Outcome::Requeued
                }
            }
        }
        Step::Exhausted => {
            capture_envelope(p, s, &env, acker, final_reason, &error, &source, Some(&handler), tag).await
        }
    }
}

/// Publish cascaded messages through the broker (never a local shortcut),
/// each to the slot of its group, waiting for every confirm.
async fn publish_cascades(
    p: &Pipeline,
    s: &SlotSettings,
    out: impl Iterator<Item = Envelope>,
) -> Result<(), crate::transport::TransportError> {
    for env in out {
        let slot = partition::slot_for(env.group(), &env.id, s.slots);
        p.transport.publish(&s.topology, slot, envelope::encode(&env)).await?;
        p.stats.cascaded.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct NoAck;

    #[async_trait::async_trait]
    impl Acker for NoAck {
        async fn settle(self: Box<Self>, _: Disposition) -> Result<(), crate::transport::TransportError> {
            Ok(())
        }
    }

    fn rule(size: usize) -> Arc<BatchRule> {
        Arc::new(BatchRule {
            handler: Arc::from("h"),
            size,
            linger: Duration::from_millis(20),
        })
    }

    fn queued(rule: Option<&Arc<BatchRule>>, group: &str, tenant: &str, at: Instant) -> Queued {
        let env = envelope::new_message(
            envelope::fresh_id(),
            "t",
            Some(group.to_owned()),
            Some(tenant.to_owned()),
            vec![],
            vec![],
        );
        Queued {
            d: Delivery {
                message: Ok(env),
                source: Arc::from("q"),
                tag: 0,
                acker: Box::new(NoAck),
            },
            at,
            batch: rule.cloned(),
        }
    }

    fn lane(items: Vec<Queued>) -> Lane {
        Lane {
            queue: items.into(),
            ..Lane::default()
        }
    }

    fn taken(t: Take) -> (usize, Option<FlushReason>) {
        match t {
            Take::Batch(members, reason) => (members.len(), Some(reason)),
            Take::Wait(_) => (0, None),
        }
    }

    #[test]
    fn a_full_batch_goes_at_size_and_leaves_the_rest() {
        let (r, now) = (rule(2), Instant::now());
        let mut l = lane((0..3).map(|_| queued(Some(&r), "g", "a", now)).collect());
        assert_eq!(taken(take_batch(&mut l, &r, now)), (2, Some(FlushReason::Size)));
        assert_eq!(l.queue.len(), 1);
    }

    #[test]
    fn a_batch_stops_at_another_tenant_group_rule_or_a_single_message() {
        let (r, other, now) = (rule(10), rule(10), Instant::now());
        for next in [
            queued(Some(&r), "g", "b", now),     // another tenant
            queued(Some(&r), "h", "a", now),     // another group (colliding lane key)
            queued(Some(&other), "g", "a", now), // another handler's rule
            queued(None, "g", "a", now),         // a single message
        ] {
            let mut l = lane(vec![queued(Some(&r), "g", "a", now), next]);
            assert_eq!(taken(take_batch(&mut l, &r, now)), (1, Some(FlushReason::Boundary)));
            assert_eq!(l.queue.len(), 1);
        }
    }

    #[test]
    fn a_partial_batch_waits_until_its_oldest_member_has_lingered() {
        let (r, start) = (rule(10), Instant::now());
        let mut l = lane(vec![
            queued(Some(&r), "g", "a", start),
            queued(Some(&r), "g", "a", start + Duration::from_millis(15)),
        ]);
        match take_batch(&mut l, &r, start + Duration::from_millis(19)) {
            Take::Wait(until) => assert_eq!(until, start + r.linger),
            Take::Batch(..) => panic!("ran before the linger"),
        }
        assert_eq!(
            taken(take_batch(&mut l, &r, start + r.linger)),
            (2, Some(FlushReason::Linger))
        );
    }
}
