//! The slot runner: consumes one slot, queues each delivery in its lane,
//! schedules ready lanes onto the worker pool, and drains on stop.

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
use crate::settle::capture::{capture_envelope, capture_undecodable};
use crate::transport::{Delivery, Disposition};

use super::batch::{Take, take_batch};
use super::job::{Parks, run_batches, run_lane};
use super::lane::{BYPASS_SALT, Lane, LaneMap, Queued, lane_key, loose_key, take_queue};
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

    fn accept(&mut self, mut d: Delivery) {
        match &mut d.message {
            Ok(env) => self.admit_headers(env),
            Err((wire, _)) => {
                if self.p.seal.admit_raw(wire) > 0 {
                    self.p.stats.untrusted_headers.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let park;
        let key = match &d.message {
            Err(_) => {
                let (p, s) = (self.p.clone(), self.s.clone());
                self.job(Done::Capture, 1, async move {
                    capture_undecodable(&p.slot(&s), d).await;
                    Parks::new()
                });
                return;
            }
            Ok(env) if !self.skipped.is_empty() && self.skipped.remove(&env.id) => {
                let error = "an operator skipped this head of a parked group (weir groups skip)".to_owned();
                self.capture_now(d, Reason::Skipped, error);
                return;
            }
            Ok(env) => {
                let (batch, parks) = self.p.router.lane_rule(&self.s.topology, env);
                let batch = batch.cloned();
                park = parks && batch.is_none() && env.group().is_some() && !self.s.bypass_lanes;
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
        let slot_full = self.slot_hold() >= self.s.park_hold_slot;
        let lane = self.lanes.entry(key).or_insert_with(|| Lane {
            loose,
            ..Lane::default()
        });
        // Keys of a group and of loose batches could collide: the lane then
        // keeps order (slower, never unsafe).
        lane.loose &= loose;
        let queued = Queued {
            d,
            at: Instant::now(),
            batch,
            park,
        };
        match lane.parked.as_mut() {
            // The parked head is back from the ladder: it runs first.
            // (Back before its job ended, on a ladder that retries at once:
            // it waits at the back for [`SlotRunner::park`] to bring it
            // forward. A head is never dead-lettered for the hold.)
            Some(p) if queued.env().is_some_and(|e| e.id == p.id) => {
                if p.head_back {
                    lane.queue.push_back(queued);
                } else {
                    p.head_back = true;
                    lane.queue.push_front(queued);
                }
                self.held += 1;
            }
            // A parked group holds what it may, and all the parked groups
            // of the slot together hold less than its window; the rest is
            // dead-lettered.
            Some(p) if lane.queue.len() >= self.s.park_hold => {
                let head = p.id.clone();
                self.overflow(queued.d, &head, Bound::Group);
                return;
            }
            Some(p) if slot_full => {
                let head = p.id.clone();
                self.overflow(queued.d, &head, Bound::Slot);
                return;
            }
            Some(_) => {
                lane.queue.push_back(queued);
                self.held += 1;
            }
            None => lane.queue.push_back(queued),
        }
        self.queued += 1;
        // A lingering batch may be complete now: look again.
        lane.lingering = None;
        if lane.can_start() && !lane.ready {
            lane.ready = true;
            self.ready.push_back(key);
        }
    }

    /// Weir's own headers are Weir's: before anything reads a `weir-*`
    /// header of this delivery, the ones without a valid seal (a
    /// publisher's, a guest's) are moved aside ([`crate::seal`]).
    fn admit_headers(&self, env: &mut crate::envelope::Envelope) {
        let host_attempts = self.p.transport.retry_owner() == crate::transport::RetryOwner::Host;
        if let crate::seal::Admission::Untrusted(moved) = self.p.seal.admit(env, host_attempts) {
            self.p.stats.untrusted_headers.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                topology = %self.s.topology,
                slot = self.s.slot,
                message_id = %crate::settle::capture::cut_text(&env.id, 128),
                moved,
                "weir-* headers without a valid seal moved under untrusted- names"
            );
        }
    }

    /// Does this slot hold all the deliveries its prefetch allows (queued in
    /// lanes or in calls)? Then nothing more arrives until something settles,
    /// and a batch that waits for more members only holds the window.
    fn window_full(&self) -> bool {
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
        let window_full = self.window_full();
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
            // Parked heads back from the ladder in this job.
            let mut returning: Vec<String> = Vec::new();
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
                    match take_batch(lane, &rule, now, window_full) {
                        Take::Wait(until) => {
                            lane.lingering = Some(until);
                            self.lingering.push(Reverse((until, key)));
                        }
                        Take::Batch(batch, reason) => {
                            self.queued -= batch.len();
                            if lane.parked.is_some() {
                                self.held -= batch.len();
                            }
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
                // Single messages up to the next batched one; a message
                // that parks its group on failure runs alone.
                let n = if lane.queue.front().is_some_and(|q| q.park) {
                    if let Some(p) = lane.parked.as_ref().filter(|p| p.head_back) {
                        returning.push(p.id.clone());
                    }
                    1
                } else {
                    lane.queue
                        .iter()
                        .take(target - run.len() - members)
                        .take_while(|q| q.batch.is_none() && !q.park)
                        .count()
                };
                run.extend(lane.queue.drain(..n).map(|q| q.d));
                self.queued -= n;
                if lane.parked.is_some() {
                    self.held -= n;
                }
                lane.running += 1;
                self.running_groups += 1;
                keys.push(key);
            }
            if !batches.is_empty() {
                let (p, s, c) = (self.p.clone(), self.s.clone(), self.cancel.clone());
                self.job(Done::Batches(batch_keys), members, async move {
                    run_batches(p, s, c, batches).await;
                    Parks::new()
                });
            }
            if !keys.is_empty() {
                let (p, s, c) = (self.p.clone(), self.s.clone(), self.cancel.clone());
                let held = run.len();
                self.job(Done::Groups(keys), held, run_lane(p, s, c, run, returning));
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
            self.job(Done::Unordered, n, run_lane(p, s, c, run, Vec::new()));
        }
    }
}
