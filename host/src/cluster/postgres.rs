//! The PostgreSQL coordinator (`cluster.mode = "postgres"`): node registry
//! with leases, one leader by lease row, balanced slot assignment with live
//! handoff, and fencing. Messages never touch the database.
//!
//! Every node runs [`run`], a loop that ticks every [`TICK`]:
//! 1. **Renew** its lease (`lease_until = now() + lease`, only while the
//!    lease has not expired: an expired node registers again as a new node
//!    and starts from no slots). The renewal is timed on the node's
//!    monotonic clock from *before* the request was sent, so the node's own
//!    deadline is never later than the database's.
//! 2. **Fence** when the last successful renewal is older than
//!    `lease − fence margin`: interrupt the in-flight calls of every slot,
//!    drain, stop consuming. This happens before the lease can expire, so
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

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::FutureExt as _;
use sqlx::Row as _;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use tokio::sync::watch;
use uuid::Uuid;

use super::assign;
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
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://***{}", &url[..s], &url[at..]),
        _ => url.to_owned(),
    }
}

/// Margin between fencing and lease expiry: a quarter of the lease, at
/// least three ticks.
pub fn fence_margin(lease: Duration) -> Duration {
    (lease / 4).max(TICK * 3)
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// One node's view of the coordinator.
pub struct Coordinator {
    pool: PgPool,
    name: String,
    lease: Duration,
    /// `cluster.drain_deadline`: how long a leaving node lets its calls run.
    drain_deadline: Duration,
    /// Every (topology, slot) of the config, in order.
    all_slots: Vec<SlotKey>,
    slots: Arc<SlotSet>,
    no_drain: bool,
    /// True while this node holds a live lease (for `GET /ready`).
    ready: Arc<std::sync::atomic::AtomicBool>,
}

/// The loop's state between ticks.
struct Tick {
    node_id: Uuid,
    /// Monotonic time the last successful renewal was *sent*.
    renewed: Option<Instant>,
    fenced: bool,
    leader: bool,
    /// Slots being drained for release, with the epoch to release.
    releasing: HashMap<SlotKey, tokio::task::JoinHandle<()>>,
    /// Epoch of each slot this node runs.
    epochs: HashMap<SlotKey, i64>,
    /// Slots the database gave this node at the last reconcile.
    owned: usize,
}

impl Coordinator {
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

    /// How long one database step may take: half the fence margin.
    fn db_timeout(&self) -> Duration {
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

    async fn register(&self) -> anyhow::Result<Uuid> {
        let id = Uuid::now_v7();
        sqlx::query(
            "INSERT INTO weir_nodes (node_id, name, lease_until) VALUES ($1, $2, now() + make_interval(secs => $3))",
        )
        .bind(id)
        .bind(&self.name)
        .bind(secs(self.lease))
        .execute(&self.pool)
        .await
        .context("registering this node in weir_nodes")?;
        notify(&self.pool).await?;
        Ok(id)
    }

    /// Extend the lease; false when it had expired already (or the row is gone).
    async fn renew(&self, id: Uuid) -> anyhow::Result<bool> {
        let r = sqlx::query(
            "UPDATE weir_nodes SET lease_until = now() + make_interval(secs => $2), renewed_at = now() \
             WHERE node_id = $1 AND lease_until > now()",
        )
        .bind(id)
        .bind(secs(self.lease))
        .execute(&self.pool)
        .await
        .context("renewing this node's lease")?;
        Ok(r.rows_affected() == 1)
    }

    /// Take or keep the leader lease; true while this node leads.
    async fn try_lead(&self, id: Uuid) -> anyhow::Result<bool> {
        let row = sqlx::query(
            "INSERT INTO weir_leader (id, node_id, term, lease_until) VALUES (1, $1, 1, now() + make_interval(secs => $2)) \
             ON CONFLICT (id) DO UPDATE SET node_id = EXCLUDED.node_id, lease_until = EXCLUDED.lease_until, \
                 term = weir_leader.term + CASE WHEN weir_leader.node_id = EXCLUDED.node_id THEN 0 ELSE 1 END \
             WHERE weir_leader.node_id = EXCLUDED.node_id OR weir_leader.lease_until < now() \
             RETURNING term",
        )
        .bind(id)
        .bind(secs(self.lease))
        .fetch_optional(&self.pool)
        .await
        .context("taking the leader lease")?;
        Ok(row.is_some())
    }

    /// One leader pass, in one transaction that re-checks leadership first.
    async fn lead(&self, id: Uuid) -> anyhow::Result<()> {
        let mut tx = self.pool.begin().await.context("leader: begin")?;
        // The leader row locked, and the transaction bounded: a node that
        // stalls inside it (its network, its process) is cut off by the
        // server, which frees every row it locked for the others.
        let still = sqlx::query(
            "SELECT set_config('idle_in_transaction_session_timeout', $2, true) FROM weir_leader \
             WHERE id = 1 AND node_id = $1 AND lease_until > now() FOR UPDATE",
        )
        .bind(id)
        .bind(self.idle_in_transaction())
        .fetch_optional(&mut *tx)
        .await?;
        if still.is_none() {
            return Ok(());
        }
        for (t, s) in &self.all_slots {
            sqlx::query("INSERT INTO weir_slots (topology, slot) VALUES ($1, $2) ON CONFLICT DO NOTHING")
                .bind(t)
                .bind(i32::try_from(*s).unwrap_or(i32::MAX))
                .execute(&mut *tx)
                .await?;
        }
        let expired: Vec<Uuid> = sqlx::query(
            "DELETE FROM weir_nodes WHERE lease_until < now() - make_interval(secs => $1) RETURNING node_id",
        )
        .bind(secs(REASSIGN_MARGIN))
        .fetch_all(&mut *tx)
        .await?
        .iter()
        .map(|r| r.get::<Uuid, _>(0))
        .collect();
        if !expired.is_empty() {
            let freed = sqlx::query(
                "UPDATE weir_slots SET owner = NULL, state = 'free', target = NULL, changed_at = now() WHERE owner = ANY($1)",
            )
            .bind(&expired)
            .execute(&mut *tx)
            .await?;
            tracing::warn!(nodes = ?expired, slots = freed.rows_affected(), "leader: nodes whose lease expired were removed; their slots are free");
        }
        // Every registered node, whether its lease is live and whether it is
        // leaving, in one read. `FOR SHARE`: a node marking itself leaving
        // waits for this pass to commit, so it sees (and releases) whatever
        // this pass gives it.
        let nodes: Vec<(Uuid, bool, bool)> =
            sqlx::query("SELECT node_id, lease_until > now(), leaving FROM weir_nodes ORDER BY node_id FOR SHARE")
                .fetch_all(&mut *tx)
                .await?
                .iter()
                .map(|r| (r.get::<Uuid, _>(0), r.get::<bool, _>(1), r.get::<bool, _>(2)))
                .collect();
        // Nodes that may be given slots: live and not leaving.
        let live: Vec<Uuid> = nodes
            .iter()
            .filter(|(_, l, leaving)| *l && !*leaving)
            .map(|(n, ..)| *n)
            .collect();
        let registered: HashSet<Uuid> = nodes.iter().map(|(n, ..)| *n).collect();
        // Registered, lease expired (not yet by the margin): may be fencing.
        let expiring: HashSet<Uuid> = nodes.iter().filter(|(_, l, _)| !*l).map(|(n, ..)| *n).collect();
        let rows = sqlx::query(
            "SELECT topology, slot, owner, epoch, state, target FROM weir_slots ORDER BY topology, slot FOR UPDATE",
        )
        .fetch_all(&mut *tx)
        .await?;
        struct SlotRow {
            topology: String,
            slot: i32,
            owner: Option<Uuid>,
            state: String,
            target: Option<Uuid>,
        }
        let rows: Vec<SlotRow> = rows
            .iter()
            .map(|r| SlotRow {
                topology: r.get(0),
                slot: r.get(1),
                owner: r.get(2),
                state: r.get(4),
                target: r.get(5),
            })
            .collect();
        let live_set: HashSet<Uuid> = live.iter().copied().collect();
        // A slot whose owner's lease expired, but not yet by the margin, is
        // left alone: that owner may still be fencing itself. A leaving
        // owner keeps its slots until it releases them, to the target set
        // here when there is one.
        let current: Vec<Option<Uuid>> = rows.iter().map(|r| r.owner.filter(|o| live_set.contains(o))).collect();
        let desired = assign::assign(&live, &current);
        let mut changed = false;
        for (row, want) in rows.iter().zip(desired) {
            let pinned = row.owner.is_some_and(|o| expiring.contains(&o));
            if pinned || row.owner == want {
                continue;
            }
            // An owner that is no longer registered left (after draining) or
            // was removed (after fencing): nothing of it runs. Its slot
            // would otherwise wait for a release that never comes.
            if let Some(gone) = row.owner.filter(|o| !registered.contains(o)) {
                sqlx::query(
                    "UPDATE weir_slots SET owner = $4, epoch = epoch + CASE WHEN $4::uuid IS NULL THEN 0 ELSE 1 END, \
                         state = CASE WHEN $4::uuid IS NULL THEN 'free' ELSE 'assigned' END, target = NULL, changed_at = now() \
                     WHERE topology = $1 AND slot = $2 AND owner = $3",
                )
                .bind(&row.topology)
                .bind(row.slot)
                .bind(gone)
                .bind(want)
                .execute(&mut *tx)
                .await?;
                changed = true;
                tracing::warn!(topology = %row.topology, slot = row.slot, gone = %gone, owner = ?want, "leader: the slot's owner is no longer registered; slot reassigned");
                continue;
            }
            match (row.owner, want) {
                (None, Some(node)) => {
                    sqlx::query(
                        "UPDATE weir_slots SET owner = $3, epoch = epoch + 1, state = 'assigned', target = NULL, changed_at = now() \
                         WHERE topology = $1 AND slot = $2 AND owner IS NULL",
                    )
                    .bind(&row.topology)
                    .bind(row.slot)
                    .bind(node)
                    .execute(&mut *tx)
                    .await?;
                    changed = true;
                    tracing::info!(topology = %row.topology, slot = row.slot, owner = %node, "leader: slot assigned");
                }
                (Some(_), Some(node)) if row.state == "assigned" || row.target != Some(node) => {
                    sqlx::query(
                        "UPDATE weir_slots SET state = 'releasing', target = $3, changed_at = now() WHERE topology = $1 AND slot = $2",
                    )
                    .bind(&row.topology)
                    .bind(row.slot)
                    .bind(node)
                    .execute(&mut *tx)
                    .await?;
                    changed = true;
                    tracing::info!(topology = %row.topology, slot = row.slot, from = ?row.owner, to = %node, "leader: asked the owner to release the slot");
                }
                _ => {}
            }
        }
        if changed || !expired.is_empty() {
            notify(&mut *tx).await?;
        }
        tx.commit().await.context("leader: commit")?;
        Ok(())
    }

    /// This node's slots as the database has them: key → (epoch, releasing).
    async fn mine(&self, id: Uuid) -> anyhow::Result<HashMap<SlotKey, (i64, bool)>> {
        let rows = sqlx::query("SELECT topology, slot, epoch, state FROM weir_slots WHERE owner = $1")
            .bind(id)
            .fetch_all(&self.pool)
            .await
            .context("reading this node's slots")?;
        Ok(rows
            .iter()
            .map(|r| {
                let slot: i32 = r.get(1);
                (
                    (r.get::<String, _>(0), u32::try_from(slot).unwrap_or(0)),
                    (r.get::<i64, _>(2), r.get::<String, _>(3) == "releasing"),
                )
            })
            .collect())
    }

    /// Give a drained slot up, only if this node still owns it at `epoch`:
    /// straight to the target the leader chose (epoch + 1) when that node's
    /// lease is live, which saves the handoff a leader tick; else free.
    async fn release(pool: &PgPool, id: Uuid, key: &SlotKey, epoch: i64) -> anyhow::Result<bool> {
        let r = sqlx::query(
            "UPDATE weir_slots s SET \
                 owner = CASE WHEN t.live THEN s.target END, \
                 epoch = s.epoch + CASE WHEN t.live THEN 1 ELSE 0 END, \
                 state = CASE WHEN t.live THEN 'assigned' ELSE 'free' END, \
                 target = NULL, changed_at = now() \
             FROM (SELECT EXISTS (SELECT 1 FROM weir_slots x JOIN weir_nodes n ON n.node_id = x.target \
                                  WHERE x.topology = $1 AND x.slot = $2 AND n.lease_until > now() AND NOT n.leaving) AS live) t \
             WHERE s.topology = $1 AND s.slot = $2 AND s.owner = $3 AND s.epoch = $4",
        )
        .bind(&key.0)
        .bind(i32::try_from(key.1).unwrap_or(i32::MAX))
        .bind(id)
        .bind(epoch)
        .execute(pool)
        .await
        .with_context(|| format!("releasing slot {} of `{}`", key.1, key.0))?;
        if r.rows_affected() == 1 {
            notify(pool).await?;
        }
        Ok(r.rows_affected() == 1)
    }

    /// Start the slots assigned to this node, drain and release the ones it
    /// is asked to give up. While `leaving`, every slot it owns is drained
    /// and released, and none is started.
    async fn reconcile(&self, st: &mut Tick, leaving: bool) -> anyhow::Result<()> {
        let mine = self.mine(st.node_id).await?;
        st.owned = mine.len();
        st.releasing.retain(|_, h| !h.is_finished());
        // Slots this node runs that the database no longer gives it: it was
        // expired and removed. Fence them (should not happen: it fences first).
        for key in self.slots.running() {
            if !mine.contains_key(&key) && !st.releasing.contains_key(&key) {
                tracing::error!(topology = %key.0, slot = key.1, "slot no longer ours in the database; interrupting and stopping it");
                self.slots.fence(&key).await;
                st.epochs.remove(&key);
            }
        }
        for (key, (epoch, releasing)) in mine {
            if st.releasing.contains_key(&key) {
                continue;
            }
            if releasing || leaving {
                st.epochs.remove(&key);
                let (slots, pool, id, no_drain, k) = (
                    self.slots.clone(),
                    self.pool.clone(),
                    st.node_id,
                    self.no_drain,
                    key.clone(),
                );
                let limit = self.db_timeout();
                let h = tokio::spawn(async move {
                    let started = Instant::now();
                    if no_drain {
                        let _ = bounded(limit, Self::release(&pool, id, &k, epoch)).await;
                    }
                    let report = slots.drain(&k).await;
                    match bounded(limit, Self::release(&pool, id, &k, epoch)).await {
                        Ok(true) => {
                            tracing::info!(topology = %k.0, slot = k.1, epoch, pause_ms = started.elapsed().as_millis(), released = report.map(|r| r.released).unwrap_or(0), "slot drained and released")
                        }
                        Ok(false) => {}
                        Err(e) => {
                            tracing::warn!(topology = %k.0, slot = k.1, error = %format!("{e:#}"), "slot drained but releasing it failed; trying again at the next pass")
                        }
                    }
                });
                st.releasing.insert(key, h);
            } else if !self.slots.is_running(&key) {
                tracing::info!(topology = %key.0, slot = key.1, epoch, "slot assigned to this node; consuming");
                self.slots.start(&key);
                st.epochs.insert(key, epoch);
            }
        }
        Ok(())
    }

    /// Mark this node `leaving`: the leader assigns it nothing more and
    /// moves what it owns to the others.
    async fn mark_leaving(&self, id: Uuid) -> anyhow::Result<()> {
        sqlx::query("UPDATE weir_nodes SET leaving = true WHERE node_id = $1")
            .bind(id)
            .execute(&self.pool)
            .await
            .context("marking this node as leaving")?;
        notify(&self.pool).await
    }

    /// Give up every slot and the registration, in one transaction (the
    /// caller has drained every slot already, or fenced).
    async fn leave(&self, id: Uuid) -> anyhow::Result<()> {
        let mut tx = self.pool.begin().await.context("leaving: begin")?;
        sqlx::query("SELECT set_config('idle_in_transaction_session_timeout', $1, true)")
            .bind(self.idle_in_transaction())
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "UPDATE weir_slots SET owner = NULL, state = 'free', target = NULL, changed_at = now() WHERE owner = $1",
        )
        .bind(id)
        .execute(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM weir_nodes WHERE node_id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE weir_leader SET lease_until = now() WHERE node_id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        notify(&mut *tx).await?;
        tx.commit().await.context("leaving: commit")?;
        Ok(())
    }
}

/// Where a node is in its leaving sequence (after `stop`).
struct Leaving {
    /// When the stop came.
    since: Instant,
    /// The `leaving` mark is in the database.
    marked: bool,
    /// The drain deadline passed: every call was interrupted.
    interrupted: bool,
}

/// One database step of the loop: `f`, or an error once `db_timeout` passed
/// or the fencing deadline came, whichever is first. The fencing deadline is
/// a timer of its own: no step can hold the loop past it.
async fn step<T>(
    c: &Coordinator,
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

/// Run the coordinator until `stop`; then leave: mark the node leaving,
/// drain and release every slot (interrupting the calls still running at
/// `cluster.drain_deadline`), deregister. The lease is renewed throughout,
/// and the node fences itself whenever it cannot renew in time, leaving or
/// not.
pub async fn run(c: Coordinator, mut stop: watch::Receiver<bool>) -> anyhow::Result<()> {
    let mut st = Tick {
        node_id: c.register().await?,
        renewed: Some(Instant::now()),
        fenced: false,
        leader: false,
        releasing: HashMap::new(),
        epochs: HashMap::new(),
        owned: 0,
    };
    tracing::info!(node = %c.name, id = %st.node_id, lease = ?c.lease, "registered with the coordinator");
    let fence_after = if std::env::var(NEGATIVE_CONTROL_LATE_FENCE).is_ok_and(|v| v == "1") {
        tracing::error!(
            "{NEGATIVE_CONTROL_LATE_FENCE}=1: fencing AFTER the lease expired (a test's negative control; never in production)"
        );
        c.lease + TICK * 3
    } else {
        c.lease.saturating_sub(fence_margin(c.lease))
    };
    let mut listener = Wakeups::default();
    let mut leaving: Option<Leaving> = None;
    loop {
        // The fencing deadline: the last renewal sent + lease − margin
        // (none while fenced: there is nothing left to fence).
        let fence_at = st.renewed.filter(|_| !st.fenced).map(|r| r + fence_after);
        let drain_at = leaving
            .as_ref()
            .filter(|l| !l.interrupted)
            .map(|l| l.since + c.drain_deadline);
        if fence_at.is_some_and(|f| Instant::now() >= f) {
            fence(&c, &mut st, fence_after).await;
        } else if drain_at.is_some_and(|d| Instant::now() >= d) {
            if let Some(l) = leaving.as_mut() {
                l.interrupted = true;
            }
            tracing::warn!(node = %c.name, deadline = ?c.drain_deadline, running = ?c.slots.running(), "drain deadline: interrupting the calls still running (they are released, not failed)");
            c.slots.interrupt_all();
        }
        if let Some(l) = &leaving {
            let done =
                st.fenced || (l.marked && st.owned == 0 && st.releasing.is_empty() && c.slots.running().is_empty());
            if done {
                break;
            }
            // A lease after the deadline the interrupted calls have ended;
            // a runner still not done waits on something else (the broker).
            // Give up: stop renewing without freeing anything, so the
            // leader frees the slots only once the lease (and the margin)
            // ran out, by which time this process has exited.
            if l.interrupted && l.since.elapsed() >= c.drain_deadline + c.lease {
                let stuck = c.slots.running();
                tracing::error!(node = %c.name, slots = ?stuck, "drain deadline + lease passed and these slots still drain; exiting without releasing them (the leader frees them when this node's lease expires)");
                for (_, h) in st.releasing.drain() {
                    h.abort();
                }
                c.ready.store(false, std::sync::atomic::Ordering::Relaxed);
                anyhow::bail!("{} slots did not finish draining: {stuck:?}", stuck.len());
            }
        }
        let fence_at = st.renewed.filter(|_| !st.fenced).map(|r| r + fence_after);
        let give_up_at = leaving
            .as_ref()
            .filter(|l| l.interrupted)
            .map(|l| l.since + c.drain_deadline + c.lease);
        let wake_at = [fence_at, drain_at, give_up_at].into_iter().flatten().min();
        listener.ensure(&c, fence_at).await;
        tokio::select! {
            _ = tokio::time::sleep(TICK) => {}
            () = listener.next() => {}
            () = sleep_until(wake_at) => continue,
            changed = stop.changed(), if leaving.is_none() => {
                if changed.is_err() || *stop.borrow() {
                    tracing::info!(node = %c.name, drain_deadline = ?c.drain_deadline, "leaving the cluster: draining every slot, renewing the lease until done");
                    c.ready.store(false, std::sync::atomic::Ordering::Relaxed);
                    leaving = Some(Leaving { since: Instant::now(), marked: false, interrupted: false });
                }
            }
        }
        let sent = Instant::now();
        match step(&c, fence_at, c.renew(st.node_id)).await {
            Ok(true) => {
                if st.fenced {
                    tracing::info!(node = %c.name, "database reachable again; lease renewed");
                }
                st.renewed = Some(sent);
                st.fenced = false;
                if leaving.is_none() {
                    c.ready.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            }
            Ok(false) => {
                // Expired: whatever we held may be someone else's now.
                tracing::warn!(node = %c.name, id = %st.node_id, "this node's lease had expired; stopping every slot and registering again as a new node");
                fence_all(&c, &mut st).await;
                if leaving.is_some() {
                    break;
                }
                match step(&c, None, c.register()).await {
                    Ok(id) => {
                        st.node_id = id;
                        st.renewed = Some(sent);
                        st.fenced = false;
                        tracing::info!(node = %c.name, id = %id, "registered again");
                    }
                    Err(e) => tracing::warn!(error = %format!("{e:#}"), "registering again failed; retrying"),
                }
                continue;
            }
            Err(e) => tracing::warn!(node = %c.name, error = %format!("{e:#}"), "lease renewal failed"),
        }
        if st.renewed.is_none_or(|r| r.elapsed() >= fence_after) {
            fence(&c, &mut st, fence_after).await;
            continue;
        }
        let fence_at = st.renewed.map(|r| r + fence_after);
        if let Some(l) = leaving.as_mut().filter(|l| !l.marked) {
            match step(&c, fence_at, c.mark_leaving(st.node_id)).await {
                Ok(()) => l.marked = true,
                Err(e) => {
                    tracing::warn!(node = %c.name, error = %format!("{e:#}"), "marking this node as leaving failed; retrying")
                }
            }
        }
        // A leaving node keeps the leadership it has (and its duties) but
        // does not take it.
        if leaving.is_none() || st.leader {
            match step(&c, fence_at, c.try_lead(st.node_id)).await {
                Ok(lead) => {
                    if lead != st.leader {
                        tracing::info!(node = %c.name, leader = lead, "leadership changed");
                    }
                    st.leader = lead;
                    if lead && let Err(e) = step(&c, fence_at, c.lead(st.node_id)).await {
                        tracing::warn!(error = %format!("{e:#}"), "leader pass failed");
                    }
                }
                Err(e) => tracing::warn!(error = %format!("{e:#}"), "leader lease check failed"),
            }
        }
        if let Err(e) = step(&c, fence_at, c.reconcile(&mut st, leaving.is_some())).await {
            tracing::warn!(error = %format!("{e:#}"), "reconciling this node's slots failed");
        }
    }
    // Every slot is drained (or fenced): give up what is left and the
    // registration. Bounded: a database that does not answer lets the lease
    // expire, and the leader frees the slots then.
    for (_, h) in st.releasing.drain() {
        h.abort();
    }
    c.slots.fence_all().await;
    match bounded(c.db_timeout() * 2, c.leave(st.node_id)).await {
        Ok(()) => tracing::info!(node = %c.name, "left the cluster: slots freed for the others"),
        Err(e) => {
            tracing::warn!(node = %c.name, error = %format!("{e:#}"), "could not leave the cluster cleanly; the leader frees this node's slots when its lease expires")
        }
    }
    Ok(())
}

/// Sleep until `at`; never returns without one.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Fence, unless fenced already.
async fn fence(c: &Coordinator, st: &mut Tick, fence_after: Duration) {
    if st.fenced {
        return;
    }
    let since = st.renewed.map_or(Duration::MAX, |r| r.elapsed());
    tracing::error!(
        node = %c.name,
        since_renewal_ms = since.as_millis(),
        fence_after_ms = fence_after.as_millis(),
        lease_ms = c.lease.as_millis(),
        "cannot renew the lease: fencing (interrupting calls, stopping every slot) before it expires"
    );
    fence_all(c, st).await;
    tracing::error!(node = %c.name, "fenced: consuming nothing until the database is back");
}

/// Channel of the change notifications (`NOTIFY weir_slots`).
const CHANNEL: &str = "weir_slots";

/// Wake every node's loop: slots changed (sent at commit).
async fn notify<'e>(db: impl sqlx::PgExecutor<'e>) -> anyhow::Result<()> {
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(CHANNEL)
        .execute(db)
        .await
        .context("notifying the cluster")?;
    Ok(())
}

/// `LISTEN weir_slots`, so a node acts on a change at once instead of at its
/// next tick (the handoff pause is two such waits). Best effort: without a
/// listener the loop still runs every tick, and it tries to listen again at
/// most once a second.
#[derive(Default)]
struct Wakeups {
    listener: Option<sqlx::postgres::PgListener>,
    tried: Option<Instant>,
}

impl Wakeups {
    async fn ensure(&mut self, c: &Coordinator, fence_at: Option<Instant>) {
        if self.listener.is_some() || self.tried.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return;
        }
        self.tried = Some(Instant::now());
        let connect = async {
            let mut l = sqlx::postgres::PgListener::connect_with(&c.pool).await?;
            l.listen(CHANNEL).await?;
            anyhow::Ok(l)
        };
        match step(c, fence_at, connect).await {
            Ok(l) => self.listener = Some(l),
            Err(e) => tracing::debug!(error = %format!("{e:#}"), "cannot listen for cluster changes; ticking only"),
        }
    }

    /// The next notification (drains any that queued up behind it); never
    /// returns without a listener.
    async fn next(&mut self) {
        let Some(l) = self.listener.as_mut() else {
            return std::future::pending().await;
        };
        match l.try_recv().await {
            Ok(Some(_)) => while let Some(Ok(Some(_))) = l.try_recv().now_or_never() {},
            // Ok(None): the connection was lost (it reconnects on the next
            // call); Err: drop it and listen again later.
            Ok(None) | Err(_) => self.listener = None,
        }
    }
}

/// `f`, or an error once `limit` passed: a database that stops answering
/// must not stop the loop from fencing in time.
async fn bounded<T>(limit: Duration, f: impl std::future::Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r,
        Err(_) => Err(anyhow::anyhow!("no answer from the database within {limit:?}")),
    }
}

async fn fence_all(c: &Coordinator, st: &mut Tick) {
    c.ready.store(false, std::sync::atomic::Ordering::Relaxed);
    st.fenced = true;
    st.leader = false;
    for (_, h) in st.releasing.drain() {
        h.abort();
    }
    c.slots.fence_all().await;
    st.epochs.clear();
}

/// A node as `weir status` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NodeStatus {
    /// Registration id (new on every start).
    pub id: Uuid,
    /// `[node] name`.
    pub name: String,
    /// Seconds since the last renewal (database clock).
    pub lease_age_s: f64,
    /// Seconds until the lease expires (negative: expired).
    pub lease_left_s: f64,
    /// Holds the leader lease.
    pub leader: bool,
}

/// A slot as `weir status` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SlotStatus {
    /// Topology name.
    pub topology: String,
    /// Slot number.
    pub slot: u32,
    /// Owner's name (`None`: free).
    pub owner: Option<String>,
    /// Fencing epoch.
    pub epoch: i64,
    /// `free`, `assigned` or `releasing`.
    pub state: String,
    /// Messages waiting on the broker for this slot (`None`: unknown).
    pub lag: Option<u64>,
}

/// The registry as `weir status` and `GET /v1/slots` show it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Status {
    /// Registered nodes.
    pub nodes: Vec<NodeStatus>,
    /// Every slot.
    pub slots: Vec<SlotStatus>,
}

/// Read the registry.
pub async fn status(pool: &PgPool) -> anyhow::Result<Status> {
    let nodes = sqlx::query(
        "SELECT n.node_id, n.name, extract(epoch FROM now() - n.renewed_at)::float8, \
                extract(epoch FROM n.lease_until - now())::float8, \
                coalesce(l.node_id = n.node_id AND l.lease_until > now(), false) \
         FROM weir_nodes n LEFT JOIN weir_leader l ON l.id = 1 ORDER BY n.name, n.started_at",
    )
    .fetch_all(pool)
    .await
    .context("reading weir_nodes")?
    .iter()
    .map(|r| NodeStatus {
        id: r.get(0),
        name: r.get(1),
        lease_age_s: r.get(2),
        lease_left_s: r.get(3),
        leader: r.get(4),
    })
    .collect();
    let slots = sqlx::query(
        "SELECT s.topology, s.slot, n.name, s.epoch, s.state FROM weir_slots s \
         LEFT JOIN weir_nodes n ON n.node_id = s.owner ORDER BY s.topology, s.slot",
    )
    .fetch_all(pool)
    .await
    .context("reading weir_slots")?
    .iter()
    .map(|r| SlotStatus {
        topology: r.get(0),
        slot: u32::try_from(r.get::<i32, _>(1)).unwrap_or(0),
        owner: r.get(2),
        epoch: r.get(3),
        state: r.get(4),
        lag: None,
    })
    .collect();
    Ok(Status { nodes, slots })
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "nodes ({}):", self.nodes.len())?;
        writeln!(f, "  {:<24} {:>12} {:>12}  role", "name", "lease age", "lease left")?;
        for n in &self.nodes {
            writeln!(
                f,
                "  {:<24} {:>11.1}s {:>11.1}s  {}",
                n.name,
                n.lease_age_s,
                n.lease_left_s,
                if n.leader { "leader" } else { "" }
            )?;
        }
        writeln!(f, "slots ({}):", self.slots.len())?;
        writeln!(
            f,
            "  {:<20} {:>5}  {:<24} {:>6}  {:<9} {:>8}",
            "topology", "slot", "owner", "epoch", "state", "lag"
        )?;
        for s in &self.slots {
            writeln!(
                f,
                "  {:<20} {:>5}  {:<24} {:>6}  {:<9} {:>8}",
                s.topology,
                s.slot,
                s.owner.as_deref().unwrap_or("-"),
                s.epoch,
                s.state,
                s.lag.map_or_else(|| "?".to_owned(), |l| l.to_string())
            )?;
        }
        Ok(())
    }
}
