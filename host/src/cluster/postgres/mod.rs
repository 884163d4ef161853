//! The PostgreSQL coordinator (`cluster.mode = "postgres"`): node registry
//! with leases, one leader by lease row, balanced slot assignment with live
//! handoff, and fencing. Messages never touch the database.
//!
//! Every node runs [`run::run`], a loop that ticks every [`TICK`]:
//! 1. **Renew** its lease (`lease_until = now() + lease`, only while the
//!    lease has not expired: an expired node registers again as a new node
//!    and starts from no slots). The renewal is timed on the node's
//!    monotonic clock from *before* the request was sent, so the node's own
//!    deadline is never later than the database's. Renewals go out from a
//!    task of their own every tick, several at once when the database is
//!    slow ([`renewals`]): they never wait behind the other steps.
//! 2. **Fence** when the last successful renewal is older than
//!    `lease − fence margin`: interrupt the in-flight calls of every slot
//!    and stop them; the fence is done once no call runs and none can
//!    start (the drain's broker traffic goes on after it). This happens before the lease can expire, so
//!    before the leader may hand the slots to anyone else. The fencing
//!    deadline is a timer of its own: every database step is cut short when
//!    it comes ([`step`]), so a stalled database cannot delay the fence.
//! 3. **Lead**, if it holds (or can take) the leader lease. Each leader
//!    action runs in one transaction that first locks the leader row and
//!    re-checks the lease, so a leader that lost its lease (a pooler that
//!    dropped its connection, a pause) changes nothing. The leader deletes
//!    nodes whose lease expired more than [`REASSIGN_MARGIN`] ago and frees
//!    their slots; assigns free slots (epoch + 1); and asks owners of slots
//!    that should move to release them (`releasing`).
//! 4. **Reconcile** its own slots: start the assigned ones; drain the
//!    `releasing` ones (stop taking messages, return unstarted ones, wait
//!    for every running call, stop consuming) and only then hand them,
//!    epoch-checked, to the target the leader chose (epoch + 1), or set them
//!    free when that node is gone (the leader assigns it at its next tick).
//!
//! 5. **Leave**, on stop: mark the node `leaving` (the leader assigns it
//!    nothing more and picks targets for its slots), drain and release
//!    every slot as in 4, then delete its row and give up the leader lease,
//!    renewing the lease all along. At `cluster.drain_deadline` the calls
//!    still running are interrupted (released to the broker, not failed); a
//!    lease after that, a drain that still has not ended is given up and
//!    the node exits without releasing those slots (the leader frees them
//!    once the lease ran out). The leader also reassigns any slot whose
//!    owner is no longer registered, whatever the order of events.
//!
//! All lease arithmetic is on the database clock; the node's own fencing
//! deadline is on its monotonic clock, measured conservatively.

//!
//! The files: [`lease`] (register, renew, leave), [`leader`] (the leader
//! pass), [`handoff`] (start, drain and release this node's slots, fence),
//! [`listen`] (NOTIFY wake-ups), [`status`] (the registry as `weir status`
//! shows it), [`run`] (the loop, and the [`crate::cluster::Coordinator`]
//! of this mode).

pub mod handoff;
pub mod leader;
pub mod lease;
pub mod listen;
pub mod margin;
mod renewals;
pub mod run;
pub mod status;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use uuid::Uuid;

use super::slots::{SlotKey, SlotSet};

/// How often a node renews, leads and reconciles.
pub const TICK: Duration = Duration::from_millis(100);
/// The leader frees an expired node's slots only this long after expiry.
pub const REASSIGN_MARGIN: Duration = Duration::from_millis(500);

/// Negative control for the handoff test, never for production: with this
/// environment variable set to `1` a node gives a slot up in the database
/// *before* draining it, so the next owner can start while calls still run.
pub const NEGATIVE_CONTROL_NO_DRAIN: &str = "WEIR_NEGATIVE_CONTROL_NO_DRAIN";

/// Negative control for the fencing test, never for production: with this
/// environment variable set to `1` a node fences only after its lease
/// expired (lease + 3 ticks), so the test can show it measures lateness.
pub const NEGATIVE_CONTROL_LATE_FENCE: &str = "WEIR_NEGATIVE_CONTROL_LATE_FENCE";

/// Negative control for the stalled-leader test, never for production: with
/// this environment variable set to `1` a node's transactions have no
/// `idle_in_transaction_session_timeout`, so a node that stalls inside one
/// keeps its rows locked for as long as the server keeps its session.
pub const NEGATIVE_CONTROL_NO_TX_TIMEOUT: &str = "WEIR_NEGATIVE_CONTROL_NO_TX_TIMEOUT";

/// The embedded migrations (`host/migrations`).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Connect to the coordinator database and run the migrations.
pub async fn connect(url: &str) -> anyhow::Result<PgPool> {
    let opts: PgConnectOptions = url
        .parse()
        .with_context(|| format!("cluster.database_url = {:?} is not a PostgreSQL URL", redact(url)))?;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(opts)
        .await
        .with_context(|| format!("cluster.database_url: cannot connect to {}", redact(url)))?;
    MIGRATOR
        .run(&pool)
        .await
        .with_context(|| format!("running Weir's migrations on {}", redact(url)))?;
    Ok(pool)
}

/// The URL without its password, for messages.
pub fn redact(url: &str) -> String {
    crate::transport::redact_url(url)
}

/// Margin between fencing and lease expiry: a quarter of the lease, at
/// least three ticks.
pub fn fence_margin(lease: Duration) -> Duration {
    (lease / 4).max(TICK * 3)
}

pub(super) fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// One node's view of the coordinator.
pub struct Member {
    pub(super) pool: PgPool,
    pub(super) name: String,
    pub(super) lease: Duration,
    /// `cluster.drain_deadline`: how long a leaving node lets its calls run.
    pub(super) drain_deadline: Duration,
    /// Every (topology, slot) of the config, in order.
    pub(super) all_slots: Vec<SlotKey>,
    pub(super) slots: Arc<SlotSet>,
    pub(super) no_drain: bool,
    /// True while this node holds a live lease (for `GET /ready`).
    pub(super) ready: Arc<std::sync::atomic::AtomicBool>,
}

/// The loop's state between ticks.
pub(super) struct Tick {
    pub(super) node_id: Uuid,
    /// Monotonic time the last successful renewal was *sent*.
    pub(super) renewed: Option<Instant>,
    pub(super) fenced: bool,
    pub(super) leader: bool,
    /// Slots being drained for release, with the epoch to release.
    pub(super) releasing: HashMap<SlotKey, tokio::task::JoinHandle<()>>,
    /// Epoch of each slot this node runs.
    pub(super) epochs: HashMap<SlotKey, i64>,
    /// Slots the database gave this node at the last reconcile.
    pub(super) owned: usize,
}

impl Member {
    /// A coordinator for this node over `pool`.
    pub fn new(
        pool: PgPool,
        name: &str,
        lease: Duration,
        drain_deadline: Duration,
        all_slots: Vec<SlotKey>,
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
            pool,
            name: name.to_owned(),
            lease,
            drain_deadline,
            all_slots,
            slots,
            no_drain,
            ready,
        }
    }

    /// The fence margin, with its lateness probe running on the node's
    /// runtime (where the calls a fence interrupts are driven).
    pub(super) fn margin(&self) -> margin::Margin {
        let (m, probe) = margin::Margin::new(self.lease);
        self.slots.runtime().spawn(probe);
        m
    }

    /// How long one database step may take: half the fence margin.
    pub(super) fn db_timeout(&self) -> Duration {
        (fence_margin(self.lease) / 2).max(TICK)
    }

    /// `idle_in_transaction_session_timeout` of this node's transactions, in
    /// ms: a step's own limit (the node gave up on the step by then). `0`
    /// (none) under [`NEGATIVE_CONTROL_NO_TX_TIMEOUT`].
    fn idle_in_transaction(&self) -> String {
        if std::env::var(NEGATIVE_CONTROL_NO_TX_TIMEOUT).is_ok_and(|v| v == "1") {
            return "0".to_owned();
        }
        self.db_timeout().as_millis().to_string()
    }
}

/// One database step of the loop: `f`, or an error once `db_timeout` passed
/// or the fencing deadline came, whichever is first. The fencing deadline is
/// a timer of its own: no step can hold the loop past it.
pub(super) async fn step<T>(
    c: &Member,
    fence_at: Option<Instant>,
    f: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    let limit = Instant::now() + c.db_timeout();
    let until = fence_at.map_or(limit, |f| f.min(limit));
    match tokio::time::timeout_at(until.into(), f).await {
        Ok(r) => r,
        Err(_) if until < limit => Err(anyhow::anyhow!(
            "the fencing deadline came before the database answered"
        )),
        Err(_) => Err(anyhow::anyhow!(
            "no answer from the database within {:?}",
            c.db_timeout()
        )),
    }
}

/// `f`, or an error once `limit` passed: a database that stops answering
/// must not stop the loop from fencing in time.
pub(super) async fn bounded<T>(
    limit: Duration,
    f: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r,
        Err(_) => Err(anyhow::anyhow!("no answer from the database within {limit:?}")),
    }
}
