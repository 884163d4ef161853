//! `weir-bench coordination`: the real coordinator code of `cluster.mode =
//! "postgres"` ([`weir::cluster::leased`]: `Member`, `run::run`, the
//! handoff, over [`weir::cluster::postgres::Tables`]: the leader pass,
//! leases) for many nodes in one process, against a real PostgreSQL.
//!
//! Each simulated node is a thread with a runtime of its own (as a node's
//! coordinator thread is), the coordinator's own pool
//! ([`weir::cluster::postgres::node_pool`]) and a [`SlotSet`] whose
//! runners do nothing but wait for their stop: what is measured is
//! coordination, not the broker. Crashing a node drops its runtime: its
//! renewals stop, its connections close, nothing of it runs.
//!
//! Phases, each until the assignment is balanced (every slot owned by a
//! live node, owners' counts within one, nothing `releasing`) and every
//! node runs exactly the slots the database gives it:
//! 1. start `--nodes` nodes at once;
//! 2. steady state for `--steady-secs`: coordinator statements and
//!    transactions per second, lease renewals per second, connections;
//! 3. add `--churn` nodes; 4. stop `--churn` nodes gracefully (the first
//!    ones started, the leader among them); 5. crash `--churn` nodes.
//!
//! Slots moved per change: the net moves between the balanced assignments
//! before and after, the handoffs that happened (epoch increments), and the
//! lower bound (slots without a live owner, plus each node's excess over
//! the largest quota it could be given). The run fails if a phase does not
//! balance within `--deadline-secs` or moves fewer slots than the bound.
//!
//! The cluster side is behind [`Backend`] so that a second coordinator
//! (`nats-kv`, issue 20 item 3) plugs into the same phases.
//!
//! Usage: `weir-bench coordination [--nodes N] [--slots S] [--churn C]
//! [--lease-ms MS] [--steady-secs S] [--deadline-secs S] [--no-crash]
//! [--database-url URL] [--server-pid PID] [--json PATH] [--verbose]`.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use futures::future::BoxFuture;
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Connection as _, Row as _};
use tokio::sync::{oneshot, watch};

use weir::cluster::leased::{Member, Mine, Store, run};
use weir::cluster::postgres::{self as pg, NODE_CONNECTIONS, Tables};
use weir::cluster::slots::{SlotKey, SlotSet, Supervisor};
use weir::dispatch::{Pipeline, RunnerReport, TopologySettings};

/// Warnings and errors the coordinators logged, by level and message (the
/// timeouts, fences and re-registrations behind a slow phase).
#[derive(Clone, Default)]
struct Tally(Arc<parking_lot::Mutex<BTreeMap<String, u64>>>);

impl Tally {
    fn snapshot(&self) -> BTreeMap<String, u64> {
        self.0.lock().clone()
    }

    /// What was logged since `before`.
    fn since(&self, before: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
        self.snapshot()
            .into_iter()
            .map(|(k, v)| {
                let was = before.get(&k).copied().unwrap_or(0);
                (k, v - was)
            })
            .filter(|(_, v)| *v > 0)
            .collect()
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Tally {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let mut m = Message(String::new());
        event.record(&mut m);
        let key = format!("{} {}", event.metadata().level(), m.0);
        *self.0.lock().entry(key).or_default() += 1;
    }
}

/// CPU seconds (user + system) of process `pid`, and with `children` of
/// every process whose parent it is (a PostgreSQL server's backends).
fn cpu_seconds(pid: u32, children: bool) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let ticks = |stat: &str| -> Option<(u32, f64)> {
        // Fields after the command (which may hold spaces), from field 3 on.
        let rest = stat.rsplit_once(')')?.1;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ppid = f.get(1)?.parse().ok()?;
        let t = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
        Some((ppid, t))
    };
    let mut total = 0.0;
    if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        && let Some((_, t)) = ticks(&stat)
    {
        total += t;
    }
    if children && let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            if let Ok(stat) = std::fs::read_to_string(e.path().join("stat"))
                && let Some((ppid, t)) = ticks(&stat)
                && ppid == pid
            {
                total += t;
            }
        }
    }
    total / hz
}

/// The one topology of the simulated cluster.
const TOPOLOGY: &str = "scale";
/// How often the bench looks at the cluster while it waits.
const POLL: Duration = Duration::from_millis(50);

struct Opts {
    nodes: usize,
    slots: u32,
    churn: usize,
    lease: Duration,
    steady: Duration,
    deadline: Duration,
    crash: bool,
    /// `postgres` or `nats-kv`.
    mode: String,
    database_url: String,
    nats_url: String,
    json: Option<std::path::PathBuf>,
    verbose: bool,
    /// The database server's (postmaster's) pid, for its CPU time.
    server_pid: Option<u32>,
}

fn usage() -> &'static str {
    "usage: weir-bench coordination [--mode postgres|nats-kv] [--nodes N] [--slots S] [--churn C] [--lease-ms MS] \
     [--steady-secs S] [--deadline-secs S] [--no-crash] [--database-url URL] [--nats-url URL] [--server-pid PID] \
     [--json PATH] [--verbose]\n\
     defaults: 100 nodes, 1024 slots, churn 10, lease 5000 ms (cluster.lease's default), 10 s of steady state, \
     120 s per phase; URL from WEIR_BENCH_DATABASE_URL or postgres://postgres@127.0.0.1:5432/postgres \
     (a database of its own is created there and dropped afterwards); --server-pid: the server's postmaster, \
     whose CPU time (and its backends') the steady state reports; nats-kv: a bucket of its own on --nats-url \
     (WEIR_BENCH_NATS_URL or nats://127.0.0.1:4222), deleted afterwards; --server-pid: the nats-server's pid"
}

fn parse(args: impl Iterator<Item = String>) -> anyhow::Result<Opts> {
    let mut o = Opts {
        nodes: 100,
        slots: 1024,
        churn: 10,
        lease: weir::config::defaults::LEASE,
        steady: Duration::from_secs(10),
        deadline: Duration::from_secs(120),
        crash: true,
        mode: "postgres".into(),
        nats_url: std::env::var("WEIR_BENCH_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into()),
        database_url: std::env::var("WEIR_BENCH_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into()),
        json: None,
        verbose: false,
        server_pid: None,
    };
    let mut args = args.peekable();
    while let Some(a) = args.next() {
        let mut value = |name: &str| -> anyhow::Result<String> {
            args.next()
                .with_context(|| format!("{name} needs a value\n{}", usage()))
        };
        let mut num = |name: &str| -> anyhow::Result<u64> {
            let v = value(name)?;
            v.replace('_', "")
                .parse::<u64>()
                .with_context(|| format!("{name} {v:?} is not a count\n{}", usage()))
        };
        match a.as_str() {
            "--nodes" => o.nodes = usize::try_from(num("--nodes")?)?,
            "--slots" => o.slots = u32::try_from(num("--slots")?)?,
            "--churn" => o.churn = usize::try_from(num("--churn")?)?,
            "--lease-ms" => o.lease = Duration::from_millis(num("--lease-ms")?),
            "--steady-secs" => o.steady = Duration::from_secs(num("--steady-secs")?),
            "--deadline-secs" => o.deadline = Duration::from_secs(num("--deadline-secs")?),
            "--no-crash" => o.crash = false,
            "--database-url" => o.database_url = value("--database-url")?,
            "--mode" => o.mode = value("--mode")?,
            "--nats-url" => o.nats_url = value("--nats-url")?,
            "--json" => o.json = Some(value("--json")?.into()),
            "--verbose" => o.verbose = true,
            "--server-pid" => o.server_pid = Some(u32::try_from(num("--server-pid")?)?),
            "-h" | "--help" => {
                println!("{}", usage());
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}\n{}", usage()),
        }
    }
    if !["postgres", "nats-kv"].contains(&o.mode.as_str()) {
        bail!("--mode {:?}: accepted: postgres, nats-kv\n{}", o.mode, usage());
    }
    if o.nodes == 0 || o.slots == 0 {
        bail!("--nodes and --slots must be at least 1\n{}", usage());
    }
    let removed = o.churn * if o.crash { 2 } else { 1 };
    if removed >= o.nodes + o.churn {
        bail!(
            "--churn {} removes {removed} of {} nodes: at least one must stay",
            o.churn,
            o.nodes + o.churn
        );
    }
    if o.lease < Duration::from_millis(500) {
        bail!("--lease-ms must be at least 500 (the coordinator's tick is 100 ms)");
    }
    Ok(o)
}

/// The cluster as the coordinator's store has it.
#[derive(Clone, Debug, Default)]
pub struct View {
    /// Owner (node name) of each slot, by slot number; `None`: free.
    pub owners: Vec<Option<String>>,
    /// Slots in `releasing`.
    pub releasing: usize,
    /// Sum of the slots' fencing epochs (one per assignment).
    pub epochs: i64,
    /// Registered nodes: name → (lease live, leaving).
    pub nodes: BTreeMap<String, (bool, bool)>,
    /// The leader's name, while its lease is live.
    pub leader: Option<String>,
    /// Connections the coordinator holds on its store now.
    pub connections: u64,
}

/// Monotonic counters of the coordinator's store, read before and after a
/// window.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    /// Statements (or requests) the coordinator ran.
    pub statements: Option<u64>,
    /// Transactions committed (autocommit statements count one each).
    pub transactions: u64,
    /// Lease renewals.
    pub renewals: u64,
    /// Statements by kind (a label → count), when the store can say.
    pub by_kind: BTreeMap<String, u64>,
    /// Server time spent executing each kind, milliseconds.
    pub exec_ms_by_kind: BTreeMap<String, f64>,
}

/// A coordinator under test: how one node's coordinator runs, and how the
/// bench reads the cluster: [`Postgres`] and [`NatsKv`].
pub trait Backend: Send + Sync + 'static {
    /// `cluster.mode` of this backend.
    fn mode(&self) -> &'static str;
    /// Connections (client sessions) one node opens at most.
    fn connections_per_node(&self) -> u32;
    /// Node `name`'s coordinator until `stop`, given its slots. Called on
    /// the node's own runtime.
    fn node(
        &self,
        name: String,
        all: Vec<SlotKey>,
        slots: Arc<SlotSet>,
        stop: watch::Receiver<bool>,
    ) -> BoxFuture<'static, anyhow::Result<()>>;
    /// The cluster now.
    fn view(&self, slots: u32) -> impl Future<Output = anyhow::Result<View>> + Send;
    /// The counters now.
    fn counters(&self) -> impl Future<Output = anyhow::Result<Counters>> + Send;
    /// Remove what the run created.
    fn cleanup(&self) -> impl Future<Output = anyhow::Result<()>> + Send;
}

/// `cluster.mode = "postgres"` in a database of its own.
pub struct Postgres {
    /// Where nodes connect.
    node_options: PgConnectOptions,
    /// The bench's own connections (view, counters).
    observer: PgPool,
    /// The server, for creating and dropping the database.
    admin: PgConnectOptions,
    database: String,
    lease: Duration,
    drain_deadline: Duration,
    /// `pg_stat_statements` answers in this database.
    statements: bool,
}

impl Postgres {
    /// Create a fresh database on the server at `url`, migrate it.
    pub async fn create(url: &str, lease: Duration) -> anyhow::Result<Self> {
        let admin: PgConnectOptions = url
            .parse()
            .with_context(|| format!("{url:?} is not a PostgreSQL URL"))?;
        let database = format!(
            "weir_scale_{}_{}",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let mut conn = sqlx::PgConnection::connect_with(&admin)
            .await
            .with_context(|| format!("connecting to {}", pg::redact(url)))?;
        sqlx::query(&format!("CREATE DATABASE {database}"))
            .execute(&mut conn)
            .await
            .with_context(|| format!("creating database {database}"))?;
        conn.close().await.ok();
        let node_options = admin.clone().database(&database);
        let observer = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(node_options.clone())
            .await
            .with_context(|| format!("connecting to {database}"))?;
        pg::MIGRATOR
            .run(&observer)
            .await
            .with_context(|| format!("migrating {database}"))?;
        // Exact per-statement counts, where the server loads the module.
        let statements = sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(&observer)
            .await
            .is_ok()
            && sqlx::query("SELECT count(*) FROM pg_stat_statements /* weir-bench */")
                .fetch_one(&observer)
                .await
                .is_ok();
        Ok(Self {
            node_options,
            observer,
            admin,
            database,
            lease,
            drain_deadline: weir::config::defaults::drain_deadline(lease),
            statements,
        })
    }

    /// Connections the server still has for us (`max_connections` less
    /// those in use).
    async fn free_connections(&self) -> anyhow::Result<i64> {
        let row = sqlx::query(
            "SELECT current_setting('max_connections')::int - (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend') /* weir-bench */",
        )
        .fetch_one(&self.observer)
        .await?;
        Ok(row.try_get::<i64, _>(0)?)
    }
}

/// Statement kinds by their first words, for the breakdown.
fn kind(query: &str) -> String {
    let q = query.trim_start();
    let label = [
        ("UPDATE weir_nodes SET lease_until", "renew lease"),
        ("INSERT INTO weir_leader", "take/keep leader lease"),
        (
            "SELECT topology, slot, epoch, state FROM weir_slots WHERE owner",
            "reconcile: read own slots",
        ),
        ("SELECT set_config", "leader: lock leader row"),
        ("INSERT INTO weir_slots", "leader: ensure slot rows"),
        (
            "DELETE FROM weir_nodes WHERE lease_until",
            "leader: remove expired nodes",
        ),
        ("SELECT node_id, lease_until", "leader: read nodes"),
        ("SELECT topology, slot, owner", "leader: read slots"),
        ("UPDATE weir_slots SET state = 'releasing'", "leader: ask to release"),
        ("UPDATE weir_slots SET owner = $3", "leader: assign free slot"),
        ("UPDATE weir_slots SET owner = $4", "leader: reassign from gone owner"),
        ("UPDATE weir_slots SET owner = NULL", "free slots (leave/expired)"),
        ("UPDATE weir_slots s SET", "release drained slot"),
        ("SELECT pg_notify", "notify"),
        ("INSERT INTO weir_nodes", "register"),
        ("UPDATE weir_nodes SET leaving", "mark leaving"),
        ("DELETE FROM weir_nodes WHERE node_id", "leave"),
        ("UPDATE weir_leader", "leave: give up leader lease"),
        ("LISTEN", "listen"),
    ]
    .iter()
    .find(|(prefix, _)| q.starts_with(prefix))
    .map(|(_, l)| (*l).to_owned());
    label.unwrap_or_else(|| {
        let upper = q.to_uppercase();
        match upper.split_whitespace().next() {
            Some(w @ ("BEGIN" | "COMMIT" | "ROLLBACK")) => w.to_lowercase(),
            _ => q.chars().take(40).collect(),
        }
    })
}

impl Backend for Postgres {
    fn mode(&self) -> &'static str {
        "postgres"
    }

    fn connections_per_node(&self) -> u32 {
        NODE_CONNECTIONS
    }

    fn node(
        &self,
        name: String,
        all: Vec<SlotKey>,
        slots: Arc<SlotSet>,
        stop: watch::Receiver<bool>,
    ) -> BoxFuture<'static, anyhow::Result<()>> {
        let pool = pg::node_pool(self.node_options.clone());
        let ready = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let store = Arc::new(Tables::new(pool, &name, self.lease, all));
        let member = Member::new(store, &name, self.lease, self.drain_deadline, slots, ready);
        Box::pin(run::run(member, stop))
    }

    async fn view(&self, slots: u32) -> anyhow::Result<View> {
        let mut tx = self.observer.begin().await?;
        // One snapshot for all three reads.
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ /* weir-bench */")
            .execute(&mut *tx)
            .await?;
        let mut v = View {
            owners: vec![None; slots as usize],
            ..View::default()
        };
        let rows = sqlx::query(
            "SELECT s.slot, s.owner IS NOT NULL, n.name, s.state = 'releasing', s.epoch \
             FROM weir_slots s LEFT JOIN weir_nodes n ON n.node_id = s.owner WHERE s.topology = $1 /* weir-bench */",
        )
        .bind(TOPOLOGY)
        .fetch_all(&mut *tx)
        .await?;
        for r in rows {
            let slot = usize::try_from(r.get::<i32, _>(0)).unwrap_or(usize::MAX);
            let owned: bool = r.get(1);
            let name: Option<String> = r.get(2);
            if let Some(o) = v.owners.get_mut(slot) {
                // An owner no longer registered counts as nobody live.
                *o = owned.then(|| name.unwrap_or_else(|| "<unregistered>".to_owned()));
            }
            v.releasing += usize::from(r.get::<bool, _>(3));
            v.epochs += r.get::<i64, _>(4);
        }
        for r in sqlx::query("SELECT name, lease_until > now(), leaving FROM weir_nodes /* weir-bench */")
            .fetch_all(&mut *tx)
            .await?
        {
            v.nodes.insert(r.get(0), (r.get(1), r.get(2)));
        }
        v.leader = sqlx::query(
            "SELECT n.name FROM weir_leader l JOIN weir_nodes n ON n.node_id = l.node_id WHERE l.lease_until > now() /* weir-bench */",
        )
        .fetch_optional(&mut *tx)
        .await?
        .map(|r| r.get(0));
        tx.commit().await?;
        v.connections = u64::try_from(
            sqlx::query("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() /* weir-bench */")
                .fetch_one(&self.observer)
                .await?
                .get::<i64, _>(0),
        )
        .unwrap_or(0)
        .saturating_sub(1); // the bench's own
        Ok(v)
    }

    async fn counters(&self) -> anyhow::Result<Counters> {
        let mut c = Counters::default();
        let row = sqlx::query(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database() /* weir-bench */",
        )
        .fetch_one(&self.observer)
        .await?;
        c.transactions = u64::try_from(row.get::<i64, _>(0)).unwrap_or(0);
        if self.statements {
            let rows = sqlx::query(
                "SELECT query, calls, total_exec_time FROM pg_stat_statements \
                 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                   AND query NOT LIKE '%weir-bench%' /* weir-bench */",
            )
            .fetch_all(&self.observer)
            .await?;
            let mut total = 0;
            for r in rows {
                let calls = u64::try_from(r.get::<i64, _>(1)).unwrap_or(0);
                total += calls;
                let k = kind(r.get(0));
                *c.exec_ms_by_kind.entry(k.clone()).or_default() += r.get::<f64, _>(2);
                *c.by_kind.entry(k).or_default() += calls;
            }
            c.statements = Some(total);
            c.renewals = c.by_kind.get("renew lease").copied().unwrap_or(0);
        } else {
            // Without pg_stat_statements: rows updated in weir_nodes (the
            // renewals, and a `leaving` mark per stop), flushed by the server
            // about once a second.
            let row = sqlx::query(
                "SELECT coalesce(sum(n_tup_upd), 0)::bigint FROM pg_stat_user_tables WHERE relname = 'weir_nodes' /* weir-bench */",
            )
            .fetch_one(&self.observer)
            .await?;
            c.renewals = u64::try_from(row.get::<i64, _>(0)).unwrap_or(0);
        }
        Ok(c)
    }

    async fn cleanup(&self) -> anyhow::Result<()> {
        self.observer.close().await;
        let mut conn = sqlx::PgConnection::connect_with(&self.admin).await?;
        sqlx::query(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.database))
            .execute(&mut conn)
            .await
            .with_context(|| format!("dropping database {}", self.database))?;
        conn.close().await.ok();
        Ok(())
    }
}

/// `cluster.mode = "nats-kv"` in a bucket of its own (one replica, on the
/// server at `--nats-url`): the same coordinator loop over
/// [`weir::cluster::nats_kv::Bucket`]. Each node has one NATS connection,
/// made on its own runtime as a node's coordinator thread makes it.
pub struct NatsKv {
    urls: Vec<String>,
    bucket: String,
    /// The bench's own view of the bucket.
    observer: async_nats::jetstream::kv::Store,
    lease: Duration,
    drain_deadline: Duration,
    /// The nodes' store calls, by kind (counted in this process).
    calls: Arc<CallCounts>,
    /// NATS connections the nodes hold now.
    connections: Arc<std::sync::atomic::AtomicU64>,
}

/// Calls of the coordinator's store, by kind.
#[derive(Default)]
struct CallCounts(parking_lot::Mutex<BTreeMap<&'static str, u64>>);

impl CallCounts {
    fn count(&self, kind: &'static str) {
        *self.0.lock().entry(kind).or_default() += 1;
    }
}

/// A [`Store`] that counts its calls, by kind.
struct Counted {
    inner: Arc<dyn Store>,
    calls: Arc<CallCounts>,
}

#[async_trait::async_trait]
impl Store for Counted {
    fn what(&self) -> &'static str {
        self.inner.what()
    }
    async fn register(&self) -> anyhow::Result<uuid::Uuid> {
        self.calls.count("register");
        self.inner.register().await
    }
    async fn renew(&self, id: uuid::Uuid) -> anyhow::Result<bool> {
        self.calls.count("renew lease");
        self.inner.renew(id).await
    }
    async fn mark_leaving(&self, id: uuid::Uuid) -> anyhow::Result<()> {
        self.calls.count("mark leaving");
        self.inner.mark_leaving(id).await
    }
    async fn leave(&self, id: uuid::Uuid) -> anyhow::Result<()> {
        self.calls.count("leave");
        self.inner.leave(id).await
    }
    async fn try_lead(&self, id: uuid::Uuid) -> anyhow::Result<bool> {
        self.calls.count("try lead");
        self.inner.try_lead(id).await
    }
    async fn lead(&self, id: uuid::Uuid) -> anyhow::Result<()> {
        self.calls.count("leader pass");
        self.inner.lead(id).await
    }
    async fn mine(&self, id: uuid::Uuid) -> anyhow::Result<Mine> {
        self.calls.count("read own slots");
        self.inner.mine(id).await
    }
    async fn release(&self, id: uuid::Uuid, key: &SlotKey, epoch: i64) -> anyhow::Result<bool> {
        self.calls.count("release slot");
        self.inner.release(id, key, epoch).await
    }
    async fn changes(&self) -> anyhow::Result<futures::stream::BoxStream<'static, ()>> {
        self.calls.count("follow changes");
        self.inner.changes().await
    }
}

/// Holds one count of [`NatsKv::connections`] while it lives.
struct Held(Arc<std::sync::atomic::AtomicU64>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl NatsKv {
    /// A fresh bucket on the server at `url`.
    pub async fn create(url: &str, lease: Duration) -> anyhow::Result<Self> {
        let urls = vec![url.to_owned()];
        let bucket = format!(
            "weir-scale-{}-{}",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let observer = weir::cluster::nats_kv::NatsKv::open(&urls, "weir-bench observer", &bucket, 1)
            .await
            .with_context(|| format!("creating bucket {bucket} on {url}"))?;
        Ok(Self {
            urls,
            bucket,
            observer,
            lease,
            drain_deadline: weir::config::defaults::drain_deadline(lease),
            calls: Arc::default(),
            connections: Arc::default(),
        })
    }
}

impl Backend for NatsKv {
    fn mode(&self) -> &'static str {
        "nats-kv"
    }

    fn connections_per_node(&self) -> u32 {
        1
    }

    fn node(
        &self,
        name: String,
        all: Vec<SlotKey>,
        slots: Arc<SlotSet>,
        stop: watch::Receiver<bool>,
    ) -> BoxFuture<'static, anyhow::Result<()>> {
        let (urls, bucket, lease, drain_deadline) =
            (self.urls.clone(), self.bucket.clone(), self.lease, self.drain_deadline);
        let (calls, connections) = (self.calls.clone(), self.connections.clone());
        Box::pin(async move {
            let kv = weir::cluster::nats_kv::NatsKv::open(&urls, &format!("weir-bench {name}"), &bucket, 1).await?;
            connections.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let _held = Held(connections);
            let store = Arc::new(Counted {
                inner: Arc::new(weir::cluster::nats_kv::Bucket::new(kv, &name, lease, all)),
                calls,
            });
            let ready = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let member = Member::new(store, &name, lease, drain_deadline, slots, ready);
            run::run(member, stop).await
        })
    }

    async fn view(&self, slots: u32) -> anyhow::Result<View> {
        let st = weir::cluster::nats_kv::status(&self.observer, self.lease).await?;
        let mut v = View {
            owners: vec![None; slots as usize],
            ..View::default()
        };
        let registered: BTreeSet<&str> = st.nodes.iter().map(|n| n.name.as_str()).collect();
        for s in st.slots.iter().filter(|s| s.topology == TOPOLOGY) {
            if let Some(o) = v.owners.get_mut(s.slot as usize) {
                // `status` names owners that are registered; an owner no
                // longer registered has no name, and counts as nobody live.
                *o = s.owner.clone().filter(|n| registered.contains(n.as_str()));
                if o.is_none() && s.state != "free" {
                    *o = Some("<unregistered>".to_owned());
                }
            }
            v.releasing += usize::from(s.state == "releasing");
            v.epochs += s.epoch;
        }
        let raw = weir::cluster::nats_kv::cache::snapshot(&self.observer, Duration::from_secs(5)).await?;
        for n in &st.nodes {
            let leaving = raw
                .entries
                .get(&weir::cluster::nats_kv::node_key(n.id))
                .and_then(|e| serde_json::from_slice::<weir::cluster::nats_kv::NodeValue>(&e.value).ok())
                .is_some_and(|n| n.leaving);
            v.nodes.insert(n.name.clone(), (n.lease_left_s > 0.0, leaving));
        }
        v.leader = st.nodes.iter().find(|n| n.leader).map(|n| n.name.clone());
        v.connections = self.connections.load(std::sync::atomic::Ordering::Relaxed);
        Ok(v)
    }

    async fn counters(&self) -> anyhow::Result<Counters> {
        let mut c = Counters::default();
        // Every write to the bucket is a message of its stream: the
        // stream's last sequence counts them, on the server.
        let mut stream = self.observer.stream.clone();
        let info = stream.info().await?;
        c.statements = Some(info.state.last_sequence);
        c.transactions = info.state.last_sequence;
        let calls = self.calls.0.lock().clone();
        c.renewals = calls.get("renew lease").copied().unwrap_or(0);
        c.by_kind = calls.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        Ok(c)
    }

    async fn cleanup(&self) -> anyhow::Result<()> {
        let client = weir::transport::nats::connect(&self.urls, "weir-bench cleanup").await?;
        async_nats::jetstream::new(client)
            .delete_key_value(&self.bucket)
            .await
            .with_context(|| format!("deleting bucket {}", self.bucket))?;
        Ok(())
    }
}

/// One simulated node: a thread with its own runtime, its slot set and its
/// coordinator.
struct SimNode {
    name: String,
    slots: Arc<SlotSet>,
    stop: watch::Sender<bool>,
    crash: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
}

impl SimNode {
    fn start<B: Backend>(
        backend: &Arc<B>,
        pipeline: &Arc<Pipeline>,
        settings: &TopologySettings,
        name: String,
        slots: u32,
    ) -> anyhow::Result<Self> {
        let (stop, stop_rx) = watch::channel(false);
        let (crash, crash_rx) = oneshot::channel::<()>();
        let (set_tx, set_rx) = std::sync::mpsc::channel();
        let (backend, pipeline, settings) = (backend.clone(), pipeline.clone(), settings.clone());
        let thread_name = name.clone();
        let thread = std::thread::Builder::new()
            .name(format!("sim-{name}"))
            .spawn(move || -> anyhow::Result<()> {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                let ran = rt.block_on(async move {
                    // Runners that hold their slot until told to stop.
                    let supervisor: Supervisor = Arc::new(|_, _, mut stop, _| {
                        Box::pin(async move {
                            let _ = stop.wait_for(|s| *s).await;
                            Ok(RunnerReport::default())
                        })
                    });
                    let set = Arc::new(SlotSet::with_supervisor(
                        pipeline,
                        std::collections::HashMap::from([(TOPOLOGY.to_owned(), settings)]),
                        supervisor,
                    ));
                    let _ = set_tx.send(set.clone());
                    let all: Vec<SlotKey> = (0..slots).map(|s| (TOPOLOGY.to_owned(), s)).collect();
                    let coordinator = backend.node(thread_name, all, set, stop_rx);
                    tokio::select! {
                        r = coordinator => r,
                        // A crash: the coordinator is dropped mid-flight, then
                        // the runtime with every task and connection of it.
                        _ = crash_rx => Ok(()),
                    }
                });
                rt.shutdown_background();
                ran
            })
            .with_context(|| format!("starting node {name}"))?;
        let slots = set_rx
            .recv()
            .with_context(|| format!("node {name} ended before it built its slot set"))?;
        Ok(Self {
            name,
            slots,
            stop,
            crash: Some(crash),
            thread: Some(thread),
        })
    }

    fn ended(&self) -> bool {
        self.thread.as_ref().is_none_or(std::thread::JoinHandle::is_finished)
    }

    /// The coordinator's result, once [`SimNode::ended`].
    fn join(&mut self) -> anyhow::Result<()> {
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| anyhow::anyhow!("node {} panicked", self.name))?
                .with_context(|| format!("node {}", self.name)),
            None => Ok(()),
        }
    }
}

/// Is `v` balanced over `live` (and do the nodes in `running` run exactly
/// the slots it gives them)? `Err`: what is still missing, for progress.
fn balanced(v: &View, live: &BTreeSet<String>, running: &[&SimNode]) -> Result<(), String> {
    let mut counts: BTreeMap<&str, usize> = live.iter().map(|n| (n.as_str(), 0)).collect();
    let mut orphans = 0;
    for o in &v.owners {
        match o.as_deref().and_then(|o| counts.get_mut(o)) {
            Some(c) => *c += 1,
            None => orphans += 1,
        }
    }
    let (lo, hi) = (
        counts.values().min().copied().unwrap_or(0),
        counts.values().max().copied().unwrap_or(0),
    );
    if orphans > 0 || v.releasing > 0 || hi - lo > 1 {
        return Err(format!(
            "{} slots without a live owner, {} releasing, {lo}..{hi} per node",
            orphans, v.releasing
        ));
    }
    // Every slot runs on its owner, and nowhere else.
    let mut wrong = 0usize;
    for n in running {
        let runs: BTreeSet<u32> = n.slots.running().into_iter().map(|(_, s)| s).collect();
        let owns: BTreeSet<u32> = v
            .owners
            .iter()
            .enumerate()
            .filter(|(_, o)| o.as_deref() == Some(n.name.as_str()))
            .filter_map(|(s, _)| u32::try_from(s).ok())
            .collect();
        wrong += runs.symmetric_difference(&owns).count();
    }
    if wrong > 0 {
        return Err(format!(
            "assignment balanced ({lo}..{hi} per node); {wrong} slots not yet started/stopped on their nodes"
        ));
    }
    Ok(())
}

/// The fewest slots that must change owner to go from `before` to any
/// balanced assignment over `live`: slots without a live owner, plus each
/// node's excess over the largest quota it could be given.
pub fn lower_bound(before: &[Option<String>], live: &BTreeSet<String>) -> usize {
    if live.is_empty() {
        return 0;
    }
    let (base, extra) = (before.len() / live.len(), before.len() % live.len());
    let mut held: Vec<usize> = live
        .iter()
        .map(|n| before.iter().filter(|o| o.as_deref() == Some(n.as_str())).count())
        .collect();
    held.sort_unstable_by(|a, b| b.cmp(a));
    let orphans = before
        .iter()
        .filter(|o| !o.as_ref().is_some_and(|n| live.contains(n)))
        .count();
    let excess: usize = held
        .iter()
        .enumerate()
        .map(|(i, h)| h.saturating_sub(base + usize::from(i < extra)))
        .sum();
    orphans + excess
}

/// What one change cost.
struct Phase {
    name: &'static str,
    seconds: f64,
    net_moves: usize,
    handoffs: i64,
    lower_bound: usize,
    peak_connections: u64,
    leader_before: Option<String>,
    leader_after: Option<String>,
    /// Warnings and errors logged during the phase.
    events: BTreeMap<String, u64>,
}

impl Phase {
    fn json(&self) -> Value {
        json!({
            "phase": self.name,
            "seconds_to_balance": self.seconds,
            "slots_moved_net": self.net_moves,
            "handoffs": self.handoffs,
            "lower_bound": self.lower_bound,
            "peak_connections": self.peak_connections,
            "leader_before": self.leader_before,
            "leader_after": self.leader_after,
            "events": self.events,
        })
    }
}

/// The bench's cluster: the backend and the nodes it runs.
struct Cluster<B: Backend> {
    backend: Arc<B>,
    pipeline: Arc<Pipeline>,
    settings: TopologySettings,
    slots: u32,
    nodes: Vec<SimNode>,
    next: usize,
    deadline: Duration,
    tally: Tally,
}

impl<B: Backend> Cluster<B> {
    fn live(&self) -> BTreeSet<String> {
        self.nodes.iter().map(|n| n.name.clone()).collect()
    }

    fn add(&mut self, n: usize) -> anyhow::Result<()> {
        for _ in 0..n {
            let name = format!("n{:03}", self.next);
            self.next += 1;
            self.nodes.push(SimNode::start(
                &self.backend,
                &self.pipeline,
                &self.settings,
                name,
                self.slots,
            )?);
        }
        Ok(())
    }

    /// Poll until balanced over the nodes running; progress every second.
    /// Also waits for `leaving` nodes' threads to end. The peak of
    /// connections seen.
    async fn settle(
        &mut self,
        label: &str,
        t0: Instant,
        leaving: &mut Vec<SimNode>,
    ) -> anyhow::Result<(View, Duration, u64)> {
        let live = self.live();
        let mut last_progress = Instant::now();
        let mut peak = 0;
        loop {
            // The nodes that ended first, then the view: a view taken after
            // a node's end shows what its leaving did.
            for n in leaving.iter_mut().filter(|n| n.ended()) {
                n.join()?;
            }
            leaving.retain(|n| n.thread.is_some());
            let v = self.backend.view(self.slots).await?;
            peak = peak.max(v.connections);
            let running: Vec<&SimNode> = self.nodes.iter().collect();
            let state = balanced(&v, &live, &running);
            for n in &self.nodes {
                if n.ended() {
                    bail!("{label}: node {} ended on its own", n.name);
                }
            }
            if state.is_ok() && leaving.is_empty() {
                return Ok((v, t0.elapsed(), peak));
            }
            if t0.elapsed() > self.deadline {
                bail!(
                    "{label}: not balanced after {:?}: {}; {} leaving nodes not ended",
                    self.deadline,
                    state.err().unwrap_or_default(),
                    leaving.len()
                );
            }
            if last_progress.elapsed() >= Duration::from_secs(1) {
                last_progress = Instant::now();
                let registered = v.nodes.values().filter(|(live, _)| *live).count();
                eprintln!(
                    "[coordination] {label}: {:5.1} s: {}; {registered} registered, {} leaving ended pending, {} connections",
                    t0.elapsed().as_secs_f64(),
                    state.err().unwrap_or_else(|| "balanced".into()),
                    leaving.len(),
                    v.connections
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Run `change`, wait for balance; what it cost.
    async fn phase(
        &mut self,
        name: &'static str,
        before: &View,
        change: impl FnOnce(&mut Self) -> anyhow::Result<Vec<SimNode>>,
    ) -> anyhow::Result<(Phase, View)> {
        eprintln!("[coordination] {name} ...");
        let logged = self.tally.snapshot();
        let t0 = Instant::now();
        let mut leaving = change(self)?;
        let live = self.live();
        let bound = lower_bound(&before.owners, &live);
        let (after, took, peak) = self.settle(name, t0, &mut leaving).await?;
        let p = Phase {
            name,
            seconds: took.as_secs_f64(),
            net_moves: weir::cluster::assign::moves(&before.owners, &after.owners),
            handoffs: after.epochs - before.epochs,
            lower_bound: bound,
            peak_connections: peak,
            leader_before: before.leader.clone(),
            leader_after: after.leader.clone(),
            events: self.tally.since(&logged),
        };
        eprintln!(
            "[coordination] {name}: balanced in {:.2} s; {} slots moved (net), {} handoffs, lower bound {}; leader {:?} -> {:?}",
            p.seconds, p.net_moves, p.handoffs, p.lower_bound, p.leader_before, p.leader_after
        );
        for (what, n) in &p.events {
            eprintln!("[coordination] {name}:   logged {n} x {what}");
        }
        if p.net_moves < p.lower_bound || usize::try_from(p.handoffs).unwrap_or(0) < p.lower_bound {
            bail!(
                "{name}: {} slots moved ({} handoffs), fewer than the lower bound {}: the bound or the view is wrong",
                p.net_moves,
                p.handoffs,
                p.lower_bound
            );
        }
        Ok((p, after))
    }
}

/// Counters over the steady-state window, per second.
fn rates(a: &Counters, b: &Counters, secs: f64) -> Value {
    let per = |x: u64, y: u64| y.saturating_sub(x) as f64 / secs;
    let by_kind: BTreeMap<&String, f64> = b
        .by_kind
        .iter()
        .map(|(k, v)| (k, per(a.by_kind.get(k).copied().unwrap_or(0), *v)))
        .filter(|(_, r)| *r > 0.0)
        .collect();
    // Milliseconds of server time per second of wall time, by kind.
    let exec: BTreeMap<&String, f64> = b
        .exec_ms_by_kind
        .iter()
        .map(|(k, v)| (k, (v - a.exec_ms_by_kind.get(k).copied().unwrap_or(0.0)) / secs))
        .filter(|(_, r)| *r > 0.0)
        .collect();
    json!({
        "server_exec_ms_per_s": exec,
        "seconds": secs,
        "statements_per_s": a.statements.zip(b.statements).map(|(x, y)| per(x, y)),
        "transactions_per_s": per(a.transactions, b.transactions),
        "renewals_per_s": per(a.renewals, b.renewals),
        "statements_by_kind_per_s": by_kind,
    })
}

async fn bench<B: Backend>(o: &Opts, backend: Arc<B>, tally: Tally) -> anyhow::Result<Value> {
    let (pipeline, settings) = SlotSet::inert_parts(TOPOLOGY, o.slots)?;
    let mut c = Cluster {
        backend: backend.clone(),
        pipeline,
        settings,
        slots: o.slots,
        nodes: Vec::new(),
        next: 0,
        deadline: o.deadline,
        tally: tally.clone(),
    };
    let mut phases = Vec::new();
    let empty = View {
        owners: vec![None; o.slots as usize],
        ..View::default()
    };
    let (p, mut view) = c
        .phase("start", &empty, |c| {
            c.add(o.nodes)?;
            Ok(Vec::new())
        })
        .await?;
    phases.push(p);

    eprintln!(
        "[coordination] steady state: {} nodes, {:?} ...",
        c.nodes.len(),
        o.steady
    );
    // Let the start's pools and listeners settle before counting.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let logged = tally.snapshot();
    let me = std::process::id();
    let cpu = || (cpu_seconds(me, false), o.server_pid.map(|p| cpu_seconds(p, true)));
    let (a, t0, cpu0) = (backend.counters().await?, Instant::now(), cpu());
    tokio::time::sleep(o.steady).await;
    let (b, secs, cpu1) = (backend.counters().await?, t0.elapsed().as_secs_f64(), cpu());
    let steady_view = backend.view(o.slots).await?;
    let mut steady = rates(&a, &b, secs);
    steady["nodes"] = json!(c.nodes.len());
    steady["connections"] = json!(steady_view.connections);
    steady["events"] = json!(tally.since(&logged));
    // Cores busy: every node's coordinator (this process), the server.
    steady["nodes_cpu_cores"] = json!((cpu1.0 - cpu0.0) / secs);
    steady["server_cpu_cores"] = json!(cpu0.1.zip(cpu1.1).map(|(x, y)| (y - x) / secs));
    eprintln!("[coordination] steady state: {steady}");
    if balanced(&steady_view, &c.live(), &c.nodes.iter().collect::<Vec<_>>()).is_err() {
        bail!("the cluster left balance in steady state (a fence? see the log)");
    }

    if o.churn > 0 {
        let (p, v) = c
            .phase("add", &view, |c| {
                c.add(o.churn)?;
                Ok(Vec::new())
            })
            .await?;
        phases.push(p);
        view = v;
        // The first nodes started: the leader is among them.
        let (p, v) = c
            .phase("leave", &view, |c| {
                let gone: Vec<SimNode> = c.nodes.drain(..o.churn).collect();
                for n in &gone {
                    let _ = n.stop.send(true);
                }
                Ok(gone)
            })
            .await?;
        phases.push(p);
        view = v;
        if o.crash {
            let (p, _) = c
                .phase("crash", &view, |c| {
                    let mut gone: Vec<SimNode> = c.nodes.drain(..o.churn).collect();
                    for n in &mut gone {
                        if let Some(crash) = n.crash.take() {
                            let _ = crash.send(());
                        }
                    }
                    Ok(gone)
                })
                .await?;
            phases.push(p);
        }
    }

    eprintln!("[coordination] stopping the {} nodes left ...", c.nodes.len());
    for n in &c.nodes {
        let _ = n.stop.send(true);
    }
    let stop_deadline = Instant::now() + o.deadline;
    for n in &mut c.nodes {
        while !n.ended() {
            if Instant::now() > stop_deadline {
                bail!("node {} did not stop within {:?}", n.name, o.deadline);
            }
            tokio::time::sleep(POLL).await;
        }
        n.join()?;
    }
    Ok(json!({
        "mode": backend.mode(),
        "nodes": o.nodes,
        "slots": o.slots,
        "churn": o.churn,
        "lease_ms": o.lease.as_millis(),
        "connections_per_node_max": backend.connections_per_node(),
        "phases": phases.iter().map(Phase::json).collect::<Vec<_>>(),
        "steady": steady,
    }))
}

fn print(r: &Value) {
    println!(
        "\ncoordination: mode {}, {} nodes x {} slots, churn {}, lease {} ms",
        r["mode"].as_str().unwrap_or("?"),
        r["nodes"],
        r["slots"],
        r["churn"],
        r["lease_ms"]
    );
    println!(
        "{:<8} {:>10} {:>10} {:>9} {:>12} {:>12}  leader",
        "phase", "balance s", "moved net", "handoffs", "lower bound", "peak conns"
    );
    for p in r["phases"].as_array().into_iter().flatten() {
        println!(
            "{:<8} {:>10.2} {:>10} {:>9} {:>12} {:>12}  {} -> {}",
            p["phase"].as_str().unwrap_or("?"),
            p["seconds_to_balance"].as_f64().unwrap_or(f64::NAN),
            p["slots_moved_net"].to_string(),
            p["handoffs"].to_string(),
            p["lower_bound"].to_string(),
            p["peak_connections"].to_string(),
            p["leader_before"].as_str().unwrap_or("-"),
            p["leader_after"].as_str().unwrap_or("-"),
        );
    }
    let s = &r["steady"];
    println!(
        "steady state ({} nodes, {:.1} s): {} statements/s, {:.0} transactions/s, {:.1} renewals/s, {} connections",
        s["nodes"],
        s["seconds"].as_f64().unwrap_or(f64::NAN),
        s["statements_per_s"]
            .as_f64()
            .map_or("n/a (no pg_stat_statements)".to_owned(), |v| format!("{v:.0}")),
        s["transactions_per_s"].as_f64().unwrap_or(f64::NAN),
        s["renewals_per_s"].as_f64().unwrap_or(f64::NAN),
        s["connections"],
    );
    println!(
        "  CPU cores busy: {:.2} for all the nodes' coordinators (this process), {} for the server",
        s["nodes_cpu_cores"].as_f64().unwrap_or(f64::NAN),
        s["server_cpu_cores"]
            .as_f64()
            .map_or("n/a (no --server-pid)".to_owned(), |v| format!("{v:.2}"))
    );
    if let Some(kinds) = s["statements_by_kind_per_s"].as_object().filter(|k| !k.is_empty()) {
        let mut kinds: Vec<(&String, f64)> = kinds.iter().map(|(k, v)| (k, v.as_f64().unwrap_or(0.0))).collect();
        kinds.sort_by(|a, b| b.1.total_cmp(&a.1));
        println!("  {:>10}  {:>16}  statement", "calls/s", "server ms/s");
        for (k, v) in kinds {
            let ms = s["server_exec_ms_per_s"][k.as_str()].as_f64().unwrap_or(0.0);
            println!("  {v:>10.1}  {ms:>16.1}  {k}");
        }
    }
    for p in r["phases"].as_array().into_iter().flatten().chain([s]) {
        for (what, n) in p["events"].as_object().into_iter().flatten() {
            println!(
                "logged in {}: {n} x {what}",
                p["phase"].as_str().unwrap_or("steady state")
            );
        }
    }
}

/// `weir-bench coordination ...`.
pub fn main(args: impl Iterator<Item = String>) -> anyhow::Result<()> {
    let o = parse(args)?;
    // Errors on stderr (everything from INFO with --verbose); warnings and
    // errors counted per phase.
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::{Layer as _, filter::LevelFilter};
    let tally = Tally::default();
    let shown = if o.verbose {
        LevelFilter::INFO
    } else {
        LevelFilter::ERROR
    };
    tracing::subscriber::set_global_default(
        tracing_subscriber::registry()
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_filter(shown),
            )
            .with(tally.clone().with_filter(LevelFilter::WARN)),
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let r = rt.block_on(async {
        if o.mode == "nats-kv" {
            let backend = Arc::new(NatsKv::create(&o.nats_url, o.lease).await?);
            eprintln!("[coordination] bucket {} on {}", backend.bucket, o.nats_url);
            let ran = bench(&o, backend.clone(), tally).await;
            let cleaned = backend.cleanup().await;
            let r = ran?;
            cleaned?;
            return anyhow::Ok(r);
        }
        let backend = Arc::new(Postgres::create(&o.database_url, o.lease).await?);
        eprintln!(
            "[coordination] database {} (pg_stat_statements: {})",
            backend.database,
            if backend.statements { "yes" } else { "no" }
        );
        let need = i64::from(backend.connections_per_node()) * i64::try_from(o.nodes + o.churn)?;
        let free = backend.free_connections().await?;
        let ran = if need > free {
            Err(anyhow::anyhow!(
                "{} nodes open up to {need} connections ({} each, the coordinator's pool); the server has {free} free \
                 (max_connections less those in use): raise max_connections or run fewer nodes",
                o.nodes + o.churn,
                backend.connections_per_node()
            ))
        } else {
            bench(&o, backend.clone(), tally).await
        };
        let cleaned = backend.cleanup().await;
        let r = ran?;
        cleaned?;
        Ok(r)
    })?;
    print(&r);
    if let Some(path) = &o.json {
        std::fs::write(path, serde_json::to_vec_pretty(&r)?).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owners(v: &[&str]) -> Vec<Option<String>> {
        v.iter().map(|s| (!s.is_empty()).then(|| (*s).to_owned())).collect()
    }

    fn set(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn the_lower_bound_counts_orphans_and_excess() {
        // a:3 b:3, c joins: two slots must move (6/3 = 2 each).
        assert_eq!(
            lower_bound(&owners(&["a", "a", "a", "b", "b", "b"]), &set(&["a", "b", "c"])),
            2
        );
        // b leaves: its three slots.
        assert_eq!(lower_bound(&owners(&["a", "a", "a", "b", "b", "b"]), &set(&["a"])), 3);
        // Nothing assigned yet: every slot.
        assert_eq!(lower_bound(&owners(&["", "", ""]), &set(&["a", "b"])), 3);
        // Balanced with a remainder: nothing.
        assert_eq!(lower_bound(&owners(&["a", "a", "b"]), &set(&["a", "b"])), 0);
    }
}
