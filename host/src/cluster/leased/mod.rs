//! Slot ownership by lease: the loop shared by `cluster.mode = "postgres"`
//! and `cluster.mode = "nats-kv"`. What is stored where is a [`Store`]
//! ([`crate::cluster::postgres`] keeps it in tables, [`crate::cluster::nats_kv`]
//! in a JetStream KV bucket); the steps, their order, the fencing and the
//! handoff are here, once, so that every fix lands in both modes.
//!
//! Every node runs [`run::run`], a loop that ticks every [`TICK`]:
//! 1. **Renew** its lease (only while the lease has not expired: an expired
//!    node registers again as a new node and starts from no slots). The
//!    renewal is timed on the node's monotonic clock from *before* the
//!    request was sent, so the node's own deadline is never later than the
//!    store's. Renewals go out from a task of their own, several at once
//!    when the store is slow ([`renewals`]): they never wait behind the
//!    other steps.
//! 2. **Fence** when the last successful renewal is older than
//!    `lease − fence margin`: interrupt the in-flight calls of every slot
//!    and stop them; the fence is done once no call runs and none can
//!    start (the drain's broker traffic goes on after it). This happens
//!    before the lease can expire, so before the leader may hand the slots
//!    to anyone else. The fencing deadline is a timer of its own: every
//!    store step is cut short when it comes ([`step`]), so a stalled store
//!    cannot delay the fence.
//! 3. **Lead**, if it holds (or can take) the leader lease. A leader that
//!    lost its lease changes nothing (how each store makes sure of it is in
//!    its docs). The leader deletes nodes whose lease expired more than
//!    [`REASSIGN_MARGIN`] ago and frees their slots; assigns free slots
//!    (epoch + 1); and asks owners of slots that should move to release
//!    them (`releasing`).
//! 4. **Reconcile** its own slots: start the assigned ones; drain the
//!    `releasing` ones (stop taking messages, return unstarted ones, wait
//!    for every running call, stop consuming) and only then hand them,
//!    epoch-checked, to the target the leader chose (epoch + 1), or set them
//!    free when that node is gone (the leader assigns it at its next tick).
//! 5. **Leave**, on stop: mark the node `leaving` (the leader assigns it
//!    nothing more and picks targets for its slots), drain and release
//!    every slot as in 4, then deregister and give up the leader lease,
//!    renewing the lease all along. At `cluster.drain_deadline` the calls
//!    still running are interrupted (released to the broker, not failed); a
//!    lease after that, a drain that still has not ended is given up and
//!    the node exits without releasing those slots (the leader frees them
//!    once the lease ran out). The leader also reassigns any slot whose
//!    owner is no longer registered, whatever the order of events.
//!
//! All lease arithmetic is on the store's clock; the node's own fencing
//! deadline is on its monotonic clock, measured conservatively.
//!
//! The files: [`run`] (the loop, and the thread it runs on), [`handoff`]
//! (start, drain and release this node's slots, fence), [`renewals`],
//! [`margin`] (the fence margin, grown by measured lateness).

pub mod handoff;
pub mod margin;
pub(crate) mod renewals;
pub mod run;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::stream::BoxStream;
use uuid::Uuid;

use super::slots::{SlotKey, SlotSet};

/// How often a node renews, leads and reconciles.
pub const TICK: Duration = Duration::from_millis(100);
/// The leader frees an expired node's slots only this long after expiry.
pub const REASSIGN_MARGIN: Duration = Duration::from_millis(500);

/// Negative control for the handoff test, never for production: with this
/// environment variable set to `1` a node gives a slot up in the store
/// *before* draining it, so the next owner can start while calls still run.
pub const NEGATIVE_CONTROL_NO_DRAIN: &str = "WEIR_NEGATIVE_CONTROL_NO_DRAIN";

/// Negative control for the fencing test, never for production: with this
/// environment variable set to `1` a node fences only after its lease
/// expired (lease + 3 ticks), so the test can show it measures lateness.
pub const NEGATIVE_CONTROL_LATE_FENCE: &str = "WEIR_NEGATIVE_CONTROL_LATE_FENCE";

/// Margin between fencing and lease expiry: a quarter of the lease, at
/// least three ticks.
pub fn fence_margin(lease: Duration) -> Duration {
    (lease / 4).max(TICK * 3)
}

/// How long one store step may take: half the fence margin.
pub fn step_timeout(lease: Duration) -> Duration {
    (fence_margin(lease) / 2).max(TICK)
}

/// A store step that cannot be answered yet because the store is still
/// reading what it holds (a watch catching up): the loop tries again at its
/// next turn, without a warning.
#[derive(Debug)]
pub struct NotReady(pub String);

impl std::fmt::Display for NotReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NotReady {}

/// This node's slots as the store has them: key → (epoch, releasing).
pub type Mine = HashMap<SlotKey, (i64, bool)>;

/// Where a mode keeps nodes, leases, the leader lease and slot ownership.
/// Each store is made for one node (its name, its lease, the slots of its
/// config); the loop ([`run::run`]) calls these, each bounded by
/// [`step_timeout`] or the fencing deadline.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// What answers, for messages: "the database", "NATS".
    fn what(&self) -> &'static str;
    /// Register this node with a new id and a fresh lease.
    async fn register(&self) -> anyhow::Result<Uuid>;
    /// Extend `id`'s lease; `false` when it had expired already (or `id` is
    /// gone): the node must fence and register again.
    async fn renew(&self, id: Uuid) -> anyhow::Result<bool>;
    /// Mark `id` leaving: the leader assigns it nothing more and moves what
    /// it owns to the others.
    async fn mark_leaving(&self, id: Uuid) -> anyhow::Result<()>;
    /// Give up every slot, the registration and the leader lease (the
    /// caller drained every slot already, or fenced).
    async fn leave(&self, id: Uuid) -> anyhow::Result<()>;
    /// Take or keep the leader lease; true while `id` leads.
    async fn try_lead(&self, id: Uuid) -> anyhow::Result<bool>;
    /// One leader pass; does nothing when `id` no longer leads.
    async fn lead(&self, id: Uuid) -> anyhow::Result<()>;
    /// `id`'s slots.
    async fn mine(&self, id: Uuid) -> anyhow::Result<Mine>;
    /// Give a drained slot up, only if `id` still owns it at `epoch`:
    /// straight to the target the leader chose (epoch + 1) when that node is
    /// live, else free. True when it was given up.
    async fn release(&self, id: Uuid, key: &SlotKey, epoch: i64) -> anyhow::Result<bool>;
    /// Wake-ups: an item whenever slots, nodes or the leader changed, so the
    /// loop acts at once instead of at its next tick. Best effort: the
    /// loop asks again when the stream ends.
    async fn changes(&self) -> anyhow::Result<BoxStream<'static, ()>>;
}

/// One node's view of the coordinator.
pub struct Member {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) name: String,
    pub(crate) lease: Duration,
    /// `cluster.drain_deadline`: how long a leaving node lets its calls run.
    pub(crate) drain_deadline: Duration,
    pub(crate) slots: Arc<SlotSet>,
    pub(crate) no_drain: bool,
    /// True while this node holds a live lease (for `GET /ready`).
    pub(crate) ready: Arc<std::sync::atomic::AtomicBool>,
}

/// The loop's state between ticks.
pub(crate) struct Tick {
    pub(crate) node_id: Uuid,
    /// Monotonic time the last successful renewal was *sent*.
    pub(crate) renewed: Option<Instant>,
    pub(crate) fenced: bool,
    pub(crate) leader: bool,
    /// Slots being drained for release, with the epoch to release.
    pub(crate) releasing: HashMap<SlotKey, tokio::task::JoinHandle<()>>,
    /// Epoch of each slot this node runs.
    pub(crate) epochs: HashMap<SlotKey, i64>,
    /// Slots the store gave this node at the last reconcile.
    pub(crate) owned: usize,
}

impl Member {
    /// A coordinator for this node over `store`.
    pub fn new(
        store: Arc<dyn Store>,
        name: &str,
        lease: Duration,
        drain_deadline: Duration,
        slots: Arc<SlotSet>,
        ready: Arc<std::sync::atomic::AtomicBool>,
    ) -> Self {
        let no_drain = std::env::var(NEGATIVE_CONTROL_NO_DRAIN).is_ok_and(|v| v == "1");
        if no_drain {
            tracing::error!(
                "{NEGATIVE_CONTROL_NO_DRAIN}=1: slots are given up BEFORE their drain (a test's negative control; never in production)"
            );
        }
        Self {
            store,
            name: name.to_owned(),
            lease,
            drain_deadline,
            slots,
            no_drain,
            ready,
        }
    }

    /// The fence margin, with its lateness probe running on the node's
    /// runtime (where the calls a fence interrupts are driven).
    pub(crate) fn margin(&self) -> margin::Margin {
        let (m, probe) = margin::Margin::new(self.lease);
        self.slots.runtime().spawn(probe);
        m
    }

    /// How long one store step may take: half the fence margin.
    pub(crate) fn step_timeout(&self) -> Duration {
        step_timeout(self.lease)
    }
}

/// One store step of the loop: `f`, or an error once the step timeout
/// passed or the fencing deadline came, whichever is first. The fencing
/// deadline is a timer of its own: no step can hold the loop past it.
pub(crate) async fn step<T>(
    c: &Member,
    fence_at: Option<Instant>,
    f: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    let limit = Instant::now() + c.step_timeout();
    let until = fence_at.map_or(limit, |f| f.min(limit));
    match tokio::time::timeout_at(until.into(), f).await {
        Ok(r) => r,
        Err(_) if until < limit => Err(anyhow::anyhow!(
            "the fencing deadline came before {} answered",
            c.store.what()
        )),
        Err(_) => Err(anyhow::anyhow!(
            "no answer from {} within {:?}",
            c.store.what(),
            c.step_timeout()
        )),
    }
}

/// `f`, or an error once `limit` passed: a store that stops answering must
/// not stop the loop from fencing in time.
pub(crate) async fn bounded<T>(
    what: &str,
    limit: Duration,
    f: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r,
        Err(_) => Err(anyhow::anyhow!("no answer from {what} within {limit:?}")),
    }
}
