//! The PostgreSQL coordinator (`cluster.mode = "postgres"`): the leased loop
//! of [`crate::cluster::leased`] over tables (`weir_nodes`, `weir_leader`,
//! `weir_slots`). Messages never touch the database.
//!
//! What the tables add to the loop's guarantees:
//! - Every lease is `lease_until` on the database clock (`now()`); a renewal
//!   extends it only while it has not expired.
//! - Each leader pass runs in one transaction that first locks the leader
//!   row and re-checks the lease, so a leader that lost its lease (a pooler
//!   that dropped its connection, a pause) changes nothing; and the
//!   transaction is bounded (`idle_in_transaction_session_timeout`), so a
//!   node that stalls inside it frees its locks for the others.
//! - `NOTIFY weir_slots` at every commit that changes slots wakes every
//!   node's loop ([`listen`]).
//!
//! The files: [`lease`] (register, renew, mark leaving, leave), [`leader`]
//! (the leader pass), [`owned`] (this node's slots, release), [`listen`]
//! (NOTIFY wake-ups), [`status`] (the registry as `weir status` shows it).

pub mod leader;
pub mod lease;
pub mod listen;
pub mod owned;
pub mod status;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use async_trait::async_trait;
use futures::stream::BoxStream;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use tokio::task::JoinHandle;
use uuid::Uuid;

pub use super::leased::{
    Member, NEGATIVE_CONTROL_LATE_FENCE, NEGATIVE_CONTROL_NO_DRAIN, REASSIGN_MARGIN, TICK, fence_margin,
};
use super::leased::{Mine, Store, run};
use super::slots::SlotKey;
use crate::cluster::coordinator::{Coordinator, Start};
use crate::cluster::status::Status;
use crate::config::Config;

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

pub(super) fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Connections one node's coordinator opens at most: the renewals' own
/// ([`crate::cluster::leased::renewals::IN_FLIGHT`]), the loop's steps (and
/// its `LISTEN`), and a spare.
pub const NODE_CONNECTIONS: u32 = crate::cluster::leased::renewals::IN_FLIGHT as u32 + 3;

/// The pool one node's coordinator runs on ([`NODE_CONNECTIONS`]
/// connections, opened lazily). Call it on the runtime that runs the loop:
/// the connections' I/O is driven there.
pub fn node_pool(options: PgConnectOptions) -> PgPool {
    PgPoolOptions::new()
        .max_connections(NODE_CONNECTIONS)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy_with(options)
}

/// One node's registry in the database: the [`Store`] of `postgres` mode.
pub struct Tables {
    pub(super) pool: PgPool,
    pub(super) name: String,
    pub(super) lease: Duration,
    /// Every (topology, slot) of the config, in order.
    pub(super) all_slots: Vec<SlotKey>,
}

impl Tables {
    /// The registry of node `name` (lease `lease`, the config's slots `all_slots`) over `pool`.
    pub fn new(pool: PgPool, name: &str, lease: Duration, all_slots: Vec<SlotKey>) -> Self {
        Self {
            pool,
            name: name.to_owned(),
            lease,
            all_slots,
        }
    }

    /// `idle_in_transaction_session_timeout` of this node's transactions, in
    /// ms: a step's own limit (the node gave up on the step by then). `0`
    /// (none) under [`NEGATIVE_CONTROL_NO_TX_TIMEOUT`].
    fn idle_in_transaction(&self) -> String {
        if std::env::var(NEGATIVE_CONTROL_NO_TX_TIMEOUT).is_ok_and(|v| v == "1") {
            return "0".to_owned();
        }
        super::leased::step_timeout(self.lease).as_millis().to_string()
    }
}

#[async_trait]
impl Store for Tables {
    fn what(&self) -> &'static str {
        "the database"
    }
    async fn register(&self) -> anyhow::Result<Uuid> {
        Tables::register(self).await
    }
    async fn renew(&self, id: Uuid) -> anyhow::Result<bool> {
        Tables::renew(self, id).await
    }
    async fn mark_leaving(&self, id: Uuid) -> anyhow::Result<()> {
        Tables::mark_leaving(self, id).await
    }
    async fn leave(&self, id: Uuid) -> anyhow::Result<()> {
        Tables::leave(self, id).await
    }
    async fn try_lead(&self, id: Uuid) -> anyhow::Result<bool> {
        Tables::try_lead(self, id).await
    }
    async fn lead(&self, id: Uuid) -> anyhow::Result<()> {
        Tables::lead(self, id).await
    }
    async fn mine(&self, id: Uuid) -> anyhow::Result<Mine> {
        Tables::mine(self, id).await
    }
    async fn release(&self, id: Uuid, key: &SlotKey, epoch: i64) -> anyhow::Result<bool> {
        Tables::release(self, id, key, epoch).await
    }
    async fn changes(&self) -> anyhow::Result<BoxStream<'static, ()>> {
        listen::changes(&self.pool).await
    }
}

/// `cluster.mode = "postgres"`: slots are assigned by the coordinator
/// database; nothing runs until this node is given some.
pub struct Postgres {
    pool: PgPool,
    setup: run::Setup,
}

impl Postgres {
    /// This node's membership over `pool` (connected and migrated).
    pub fn new(pool: PgPool, config: &Config) -> Self {
        Self {
            pool,
            setup: run::Setup::of(config),
        }
    }
}

#[async_trait]
impl Coordinator for Postgres {
    /// The coordinator starts slots as it is assigned them.
    fn initial_slots(&self, _slots: u32) -> Vec<u32> {
        Vec::new()
    }

    /// Ready once the lease is renewed.
    fn ready_at_start(&self) -> bool {
        false
    }

    /// The loop runs on a thread of its own ([`run::spawn`]), with a pool
    /// of its own.
    fn start(&self, start: Start) -> Option<JoinHandle<anyhow::Result<()>>> {
        let options = (*self.pool.connect_options()).clone();
        Some(run::spawn(self.setup.clone(), start, move |setup, all| {
            let store: Arc<dyn Store> = Arc::new(Tables::new(
                node_pool(options.clone()),
                &setup.name,
                setup.lease,
                all.to_vec(),
            ));
            Box::pin(std::future::ready(Ok(store)))
        }))
    }

    async fn status(&self) -> anyhow::Result<Option<Status>> {
        status::status(&self.pool).await.map(Some)
    }
}

/// A database of its own on the test server (`WEIR_TEST_PG_URL`, else the
/// local one), migrated by [`connect`]; [`ScratchDb::drop`] removes it.
#[cfg(test)]
pub(crate) struct ScratchDb {
    /// The pool on it.
    pub pool: PgPool,
    server: String,
    name: String,
}

#[cfg(test)]
impl ScratchDb {
    /// A new database named `{prefix}_{8 hex}`.
    #[allow(clippy::unwrap_used, reason = "test setup: a failure is the test's")]
    pub(crate) async fn new(prefix: &str) -> Self {
        use sqlx::Connection as _;
        let server = std::env::var("WEIR_TEST_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
        let name = format!("{prefix}_{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let mut admin = sqlx::PgConnection::connect(&format!("{server}/postgres"))
            .await
            .unwrap();
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .await
            .unwrap();
        let pool = connect(&format!("{server}/{name}")).await.unwrap();
        Self { pool, server, name }
    }

    /// Close the pool and drop the database (its other connections too).
    pub(crate) async fn drop(self) {
        use sqlx::Connection as _;
        self.pool.close().await;
        if let Ok(mut admin) = sqlx::PgConnection::connect(&format!("{}/postgres", self.server)).await {
            let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name))
                .execute(&mut admin)
                .await;
        }
    }
}
