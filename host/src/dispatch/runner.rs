//! The slot runner: consumes one slot, queues each delivery in its lane,
//! schedules ready lanes onto the worker pool, and drains on stop. The way
//! of a delivery into its lane is in `intake`, the scheduler in `schedule`:
//! both are methods of [`SlotRunner`], kept apart so each file reads alone.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::FutureExt as _;
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::watch;

use crate::outcome::{Outcome, Reason};
use crate::retry::schedule::Redelivery;
use crate::runtime::Interrupt;
use crate::settle::capture::capture_envelope;
use crate::transport::{Delivery, Disposition};

use super::job::Parks;
use super::lane::{LaneMap, take_queue};
use super::{LaneKind, Pipeline, RunnerReport, SlotSettings, panic_text};

/// Negative control for the drain tests, never for production: with this
/// environment variable set to `1` a draining slot's jobs go on starting
/// their next calls (the drain waits for whole jobs, as before issue 33).
pub const NEGATIVE_CONTROL_DRAIN_STARTS_CALLS: &str = "WEIR_NEGATIVE_CONTROL_DRAIN_STARTS_CALLS";

fn drain_starts_calls() -> bool {
    std::env::var(NEGATIVE_CONTROL_DRAIN_STARTS_CALLS).is_ok_and(|v| v == "1")
}

pub(super) enum Done {
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

/// The hold bound a parked group's message ran into.
#[derive(Debug, Clone, Copy)]
pub(super) enum Bound {
    /// `topology.park_hold`: the group's own.
    Group,
    /// `topology.park_hold_slot`: all the parked groups of the slot together.
    Slot,
}

/// Deliveries a runner takes from the subscription before it schedules.
const BURST: usize = 512;

/// Consumes one slot. See the module docs.
pub struct SlotRunner {
    pub(super) p: Arc<Pipeline>,
    pub(super) s: Arc<SlotSettings>,
    pub(super) cancel: Arc<Interrupt>,
    pub(super) lanes: LaneMap,
    pub(super) ready: VecDeque<u64>,
    /// Lanes whose head batch lingers, by deadline (stale entries skipped).
    pub(super) lingering: BinaryHeap<Reverse<(Instant, u64)>>,
    /// Messages waiting in lane queues (not yet handed to a worker).
    pub(super) queued: usize,
    pub(super) running_groups: usize,
    pub(super) unordered: VecDeque<Delivery>,
    pub(super) running_unordered: usize,
    /// Each job in flight, with how many deliveries it holds, and the
    /// groups it parked.
    pub(super) inflight: FuturesUnordered<BoxFuture<'static, (Done, usize, Parks)>>,
    /// Lanes with a parked group.
    pub(super) parked: usize,
    /// Messages waiting in the queues of parked lanes: held in the slot's
    /// window until their group's head ends (see `SlotRunner::slot_hold` in `park`).
    pub(super) held: usize,
    /// The broker keeps a parked group's failed head unacknowledged while
    /// it waits on the ladder (JetStream: a delayed `Nak`), so the head
    /// fills a place in the slot's window too.
    pub(super) heads_pending: bool,
    /// Parked groups read from the store at start, by the time their head
    /// must be back (stale entries skipped).
    pub(super) park_deadlines: BinaryHeap<Reverse<(Instant, u64)>>,
    /// Heads an operator skipped: dead-lettered `skipped` when they come back.
    pub(super) skipped: std::collections::HashSet<String>,
    /// Deliveries held by the jobs in flight (until they are settled).
    pub(super) in_jobs: usize,
    pub(super) report: RunnerReport,
    /// Set by the first job that panicked: the runner drains and stops.
    pub(super) poisoned: Option<String>,
}

impl SlotRunner {
    /// A runner for one slot; nothing happens until [`SlotRunner::run`].
    pub fn new(p: Arc<Pipeline>, s: SlotSettings) -> Self {
        let heads_pending = matches!(s.schedule.redelivery(), Redelivery::JetStream { .. });
        Self {
            p,
            s: Arc::new(s),
            cancel: Arc::default(),
            lanes: LaneMap::default(),
            ready: VecDeque::new(),
            lingering: BinaryHeap::new(),
            queued: 0,
            running_groups: 0,
            unordered: VecDeque::new(),
            running_unordered: 0,
            inflight: FuturesUnordered::new(),
            parked: 0,
            held: 0,
            heads_pending,
            park_deadlines: BinaryHeap::new(),
            skipped: std::collections::HashSet::new(),
            in_jobs: 0,
            report: RunnerReport::default(),
            poisoned: None,
        }
    }

    /// Set to interrupt this slot's running calls (ownership lost).
    pub fn cancel_handle(&self) -> Arc<Interrupt> {
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
        let (inbox, mut orders) = tokio::sync::mpsc::unbounded_channel();
        self.p.orders.lock().insert((s.topology.clone(), s.slot), inbox.clone());
        if !*stop.borrow() {
            self.load_parked().await?;
            'consume: loop {
                let linger = self.lingering.peek().map(|Reverse((at, _))| *at);
                let wake = linger.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
                let overdue = self.park_deadlines.peek().map(|Reverse((at, _))| *at);
                let overdue_at = overdue.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
                tokio::select! {
                    biased;
                    Some(done) = self.inflight.next(), if !self.inflight.is_empty() => self.finish(done),
                    () = tokio::time::sleep_until(wake.into()), if linger.is_some() => self.wake_lingering(Some(Instant::now())),
                    () = tokio::time::sleep_until(overdue_at.into()), if overdue.is_some() => self.drop_overdue_parks(),
                    Some(order) = orders.recv() => self.order(order),
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
                                        self.cancel.cancel();
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
                            self.cancel.cancel();
                            break;
                        }
                        None => break,
                    },
                }
                if self.poisoned.is_some() {
                    break;
                }
                if !self.lingering.is_empty() && self.window_full() {
                    // No batch can grow until something settles: run them.
                    self.wake_lingering(None);
                }
                self.schedule();
                s.counters
                    .set_depth(self.queued + self.unordered.len(), self.running_groups);
                s.counters.set_parked(self.parked);
                s.counters.set_held(self.slot_hold());
                debug_assert!(
                    self.parked > 0 || self.held == 0,
                    "held messages without a parked group"
                );
            }
        }
        {
            let mut inboxes = self.p.orders.lock();
            let key = (s.topology.clone(), s.slot);
            if inboxes.get(&key).is_some_and(|i| i.same_channel(&inbox)) {
                inboxes.remove(&key);
            }
        }
        s.counters.set_depth(0, 0);
        s.counters.set_parked(0);
        s.counters.set_held(0);
        self.p.stats.forget_parked_groups(&(s.topology.clone(), s.slot));
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
    ///
    /// From the moment the drain begins no call starts: the calls inside
    /// guest code finish, and a job holding several messages releases the
    /// ones it has not started yet ([`Interrupt::stop_starting`]).
    async fn drain(&mut self, sub: &mut dyn crate::transport::Subscription) {
        let mut collecting = sub.stop().await;
        if drain_starts_calls() {
            tracing::error!(
                "{NEGATIVE_CONTROL_DRAIN_STARTS_CALLS}=1: a draining slot's jobs start their next calls \
                 (a test's negative control; never in production)"
            );
        }
        // What the jobs in flight release from here on (the messages they
        // had not started) counts as held and not started, like the queues.
        let released_by_jobs = self.s.counters.released();
        if !drain_starts_calls() {
            let running = self.cancel.stop_starting();
            tracing::debug!(topology = %self.s.topology, slot = self.s.slot, running, "draining: no call starts any more");
        }
        self.ready.clear();
        self.lingering.clear();
        let stats = self.p.stats.clone();
        if !collecting {
            let mut idle: Vec<Delivery> = self.unordered.drain(..).collect();
            for lane in self.lanes.values_mut() {
                idle.extend(take_queue(&stats, lane));
            }
            self.queued = 0;
            self.held = 0;
            self.release(idle).await;
        }
        while collecting || !self.inflight.is_empty() {
            tokio::select! {
                Some(done) = self.inflight.next(), if !self.inflight.is_empty() => {
                    self.report.drained.push(done.0.kind());
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
        self.held = 0;
        self.release(rest).await;
        self.report.released += self.s.counters.released().saturating_sub(released_by_jobs);
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

    /// Does this slot hold all the deliveries its prefetch allows (queued in
    /// lanes or in calls)? Then nothing more arrives until something settles,
    /// and a batch that waits for more members only holds the window.
    pub(super) fn window_full(&self) -> bool {
        let window = self.s.prefetch as usize;
        window > 0 && self.queued + self.unordered.len() + self.in_jobs >= window
    }

    /// Batches whose linger ran out by `now` (every lingering one for `None`)
    /// go back to the ready queue.
    fn wake_lingering(&mut self, now: Option<Instant>) {
        while let Some(Reverse((at, key))) = self.lingering.peek().copied() {
            if now.is_some_and(|now| at > now) {
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
        if lane.queue.is_empty() && lane.running == 0 && lane.parked.is_none() {
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
    /// `held`: how many deliveries the job holds until it has settled them.
    pub(super) fn job(
        &mut self,
        done: Done,
        held: usize,
        work: impl std::future::Future<Output = Parks> + Send + 'static,
    ) {
        self.in_jobs += held;
        self.inflight.push(Box::pin(async move {
            match std::panic::AssertUnwindSafe(work).catch_unwind().await {
                Ok(parks) => (done, held, parks),
                Err(panic) => (
                    Done::Panicked(Box::new(done), panic_text(panic.as_ref())),
                    held,
                    Parks::new(),
                ),
            }
        }));
    }

    fn finish(&mut self, (done, held, parks): (Done, usize, Parks)) {
        self.in_jobs -= held;
        if let Done::Groups(keys) = &done {
            self.park(keys, parks);
        }
        self.done(done);
    }

    /// Dead-letter `d` with `reason` without a call.
    pub(super) fn capture_now(&mut self, d: Delivery, reason: Reason, error: String) {
        let (p, s) = (self.p.clone(), self.s.clone());
        self.job(Done::Capture, 1, async move {
            let cx = p.slot(&s);
            let Delivery {
                message,
                source,
                tag,
                acker,
            } = d;
            if let Ok(env) = message {
                tracing::warn!(
                    topology = %s.topology, slot = s.slot, message_id = %env.id, group = env.group().unwrap_or(""),
                    "{error}: dead-lettered {reason}"
                );
                let outcome = capture_envelope(&cx, &env, acker, reason, &error, &source, None, tag).await;
                cx.record(None, &env.id, outcome);
            }
            Parks::new()
        });
    }

    fn done(&mut self, done: Done) {
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
                self.done(*done);
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
}
