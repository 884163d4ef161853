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
//!
//! The files follow a delivery: [`runner`] takes it from the slot's
//! subscription, `intake` queues it in a [`lane`], `schedule` hands the
//! lanes' work to the pool, [`batch`] takes a
//! batch from a lane's head, [`job`] admits what a worker runs, calls the
//! handler and hands the outcomes to [`crate::settle`]; [`supervisor`]
//! restarts a runner whose subscription ended, with [`backoff`].

pub mod backoff;
pub mod batch;
mod dedup_calls;
mod intake;
pub mod job;
pub mod lane;
mod park;
pub mod runner;
mod schedule;
pub mod supervisor;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::envelope::Envelope;
use crate::observe::stats::{OutcomeCounters, Stats};
use crate::outcome::SettleObserver;
use crate::retry::schedule::Schedule;
use crate::router::Router;
use crate::runtime::pool::WorkerPool;
use crate::settle::{Sink, Slot};
use crate::transport::Transport;

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
    /// Where `handler.dedup` keeps its records (`None`: no handler asks).
    pub dedup: Option<Arc<dyn crate::dedup::Store>>,
    /// Where parked groups are kept for the slot's next owner (`None`: no
    /// handler parks, or the cluster mode has no store).
    pub parked: Option<Arc<dyn crate::parked::Store>>,
    /// Each running slot's inbox for operators' orders on parked groups.
    pub orders: parking_lot::Mutex<std::collections::HashMap<(Arc<str>, u32), OrderInbox>>,
    /// Seals the `weir-*` headers this node writes, and checks those it receives.
    pub seal: crate::seal::Seal,
}

/// Where a slot runner takes [`GroupOrder`]s.
pub type OrderInbox = tokio::sync::mpsc::UnboundedSender<GroupOrder>;

/// An operator's order for a parked group (`weir groups unpark|skip`).
#[derive(Debug)]
pub struct GroupOrder {
    /// The group's tenant (`None`: its messages have none).
    pub tenant: Option<String>,
    /// The group id.
    pub group: String,
    /// Skip the head (dead-letter it `skipped` when it comes back) instead
    /// of leaving it to run late.
    pub skip: bool,
    /// The parked head's message id, or why nothing was done.
    pub reply: tokio::sync::oneshot::Sender<Result<String, String>>,
}

impl Pipeline {
    /// Where this node's settlements go.
    pub fn sink(&self) -> Sink<'_> {
        Sink {
            transport: self.transport.as_ref(),
            stats: &self.stats,
            observer: self.observer.as_deref(),
            dedup: self.dedup.as_deref(),
            seal: &self.seal,
        }
    }

    /// Settling in slot `s`.
    pub fn slot<'a>(&'a self, s: &'a SlotSettings) -> Slot<'a> {
        Slot {
            sink: self.sink(),
            topology: &s.topology,
            slots: s.slots,
            schedule: &s.schedule,
            counters: &s.counters,
        }
    }
}

/// How every slot of one topology is run (a slot's own settings,
/// [`SlotSettings`], add the slot and its counters).
#[derive(Debug, Clone)]
pub struct TopologySettings {
    /// Topology name.
    pub topology: Arc<str>,
    /// Slots in the topology (for cascades).
    pub slots: u32,
    /// Lanes (groups) running at once in this slot.
    pub max_concurrent_groups: usize,
    /// Jobs of unordered messages running at once in this slot.
    pub max_unordered: usize,
    /// Unsettled deliveries the broker may hand this runner.
    pub prefetch: u32,
    /// Most messages a parked group may hold (`topology.park_hold`).
    pub park_hold: usize,
    /// Most messages the parked groups of the slot may hold together, their
    /// heads counted on JetStream (`topology.park_hold_slot`): below
    /// `prefetch`, so held messages never fill the window that their heads
    /// and the slot's other groups come back through.
    pub park_hold_slot: usize,
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

/// How one slot is run: its topology's settings (reached through `Deref`:
/// `s.prefetch`), the slot, and its counters.
#[derive(Debug, Clone)]
pub struct SlotSettings {
    /// How every slot of the topology runs.
    pub per_topology: TopologySettings,
    /// The slot this runner consumes.
    pub slot: u32,
    /// Outcomes of this slot's messages (`weir_slot_messages_total`).
    pub counters: Arc<OutcomeCounters>,
}

impl std::ops::Deref for SlotSettings {
    type Target = TopologySettings;

    fn deref(&self) -> &TopologySettings {
        &self.per_topology
    }
}

impl TopologySettings {
    /// The settings of `slot`, counted in `counters`.
    pub fn for_slot(&self, slot: u32, counters: Arc<OutcomeCounters>) -> SlotSettings {
        SlotSettings {
            per_topology: self.clone(),
            slot,
            counters,
        }
    }
}

/// A panic a test asks for, fired once: see [`TopologySettings::inject_panic`].
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
    pub(crate) fn fire(&self, envs: &[Envelope]) {
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

/// The message of a caught panic.
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// Admission per handler (`limits.instances`) and per tenant
/// (`tenant.limits.concurrency`), acquired in one global order (handlers by
/// version id, then tenants by name) so two lanes can never each hold what
/// the other waits for.
pub(crate) async fn admission<'a>(
    handlers: impl Iterator<Item = &'a Arc<crate::runtime::HandlerVersion>>,
) -> Vec<tokio::sync::OwnedSemaphorePermit> {
    let mut handlers: Vec<&Arc<crate::runtime::HandlerVersion>> = handlers.collect();
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

/// Call `handle` for each item in order on one worker. `None` when the pool
/// is gone (process shutting down): the deliveries are then neither acked
/// nor captured, so the broker redelivers them.
pub(crate) async fn call_each(
    p: &Pipeline,
    items: Vec<(Arc<crate::runtime::HandlerVersion>, crate::envelope::Envelope)>,
    cancel: Arc<crate::runtime::Interrupt>,
) -> Option<Vec<(crate::envelope::Envelope, crate::runtime::CallOutcome)>> {
    match p.pool.run_each(items, Some(cancel)).await {
        Ok(o) => Some(o),
        Err(e) => {
            tracing::error!(error = %e, "worker pool unavailable; leaving deliveries unsettled");
            None
        }
    }
}
