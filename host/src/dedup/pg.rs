//! Dedup records in PostgreSQL (`cluster.mode = "postgres"`): table
//! `weir_dedup` (migration 0004), windows on the database's clock, on a
//! pool of their own so lookups never queue ahead of lease renewals.
//!
//! Expired records are deleted by a task of the store's own, every
//! [`PURGE_EVERY`], in bounded chunks found through the index on
//! `expires_at` until none is left (at most [`PURGE_ROUNDS`] chunks a
//! turn), so the table holds about rate × window, and no write of a
//! record ever waits for a purge.

use std::time::Duration;

use anyhow::Context as _;
use async_trait::async_trait;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use super::{Key, Store};

/// Connections of the dedup pool.
const CONNECTIONS: u32 = 4;
/// How often expired records are deleted.
pub const PURGE_EVERY: Duration = Duration::from_secs(1);
/// Most expired records one DELETE removes.
const PURGE_CHUNK: i64 = 5_000;
/// Most DELETEs one turn runs (a backlog is worked off over several turns).
const PURGE_ROUNDS: usize = 40;

/// The `weir_dedup` table.
pub struct Postgres {
    pool: PgPool,
    /// The purge task (aborted when the store is dropped).
    purger: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if let Some(p) = self.purger.take() {
            p.abort();
        }
    }
}

impl Postgres {
    /// Connect to `url` (the table is made by the node's migrations).
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        let opts: PgConnectOptions = url.parse().context("cluster.database_url is not a PostgreSQL URL")?;
        let pool = PgPoolOptions::new()
            .max_connections(CONNECTIONS)
            .acquire_timeout(super::STORE_TIMEOUT)
            .connect_with(opts)
            .await
            .context("handler.dedup: connecting to cluster.database_url")?;
        Ok(Self::new(pool))
    }

    /// Over `pool`, purging every [`PURGE_EVERY`] (spawns the purge task on
    /// the current runtime).
    pub fn new(pool: PgPool) -> Self {
        Self::with_purge(pool, Some(PURGE_EVERY))
    }

    /// Over `pool`, purging every `every` (`None`: never, for a test's
    /// negative control).
    #[doc(hidden)]
    pub fn with_purge(pool: PgPool, every: Option<Duration>) -> Self {
        let purger = every.map(|every| tokio::spawn(purge_loop(pool.clone(), every)));
        Self { pool, purger }
    }

    fn columns<'a>(keys: impl Iterator<Item = &'a Key>) -> (Vec<&'a str>, Vec<&'a str>, Vec<&'a str>) {
        let mut t = Vec::new();
        let mut g = Vec::new();
        let mut m = Vec::new();
        for k in keys {
            t.push(k.tenant.as_str());
            g.push(k.group.as_str());
            m.push(k.id.as_str());
        }
        (t, g, m)
    }
}

/// Every `every`, delete expired records until none is left (bounded).
async fn purge_loop(pool: PgPool, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let mut deleted = 0;
        for _ in 0..PURGE_ROUNDS {
            match purge_chunk(&pool).await {
                Ok(n) => {
                    deleted += n;
                    if n < PURGE_CHUNK as u64 {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "deleting expired dedup records failed; the next turn tries again");
                    break;
                }
            }
        }
        if deleted > 0 {
            tracing::debug!(deleted, "expired dedup records deleted");
        }
    }
}

/// Delete up to [`PURGE_CHUNK`] expired records, found by the index on
/// `expires_at`; rows another node is deleting are skipped, not waited for.
async fn purge_chunk(pool: &PgPool) -> anyhow::Result<u64> {
    let done = tokio::time::timeout(
        super::STORE_TIMEOUT,
        sqlx::query(
            "DELETE FROM weir_dedup WHERE ctid = ANY(ARRAY(\
             SELECT ctid FROM weir_dedup WHERE expires_at < now() LIMIT $1 FOR UPDATE SKIP LOCKED))",
        )
        .bind(PURGE_CHUNK)
        .execute(pool),
    )
    .await
    .context("deleting expired records from weir_dedup took too long")?
    .context("deleting expired records from weir_dedup")?;
    Ok(done.rows_affected())
}

#[async_trait]
impl Store for Postgres {
    fn what(&self) -> &'static str {
        "postgres"
    }

    async fn seen(&self, keys: &[Key]) -> anyhow::Result<Vec<bool>> {
        let mut seen = vec![false; keys.len()];
        if keys.is_empty() {
            return Ok(seen);
        }
        let (t, g, m) = Self::columns(keys.iter());
        let hits: Vec<i64> = sqlx::query_scalar(
            "SELECT k.i FROM UNNEST($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS k(t, g, m, i) \
             JOIN weir_dedup d ON d.tenant = k.t AND d.group_id = k.g AND d.message_id = k.m \
             WHERE d.expires_at > now()",
        )
        .bind(&t)
        .bind(&g)
        .bind(&m)
        .fetch_all(&self.pool)
        .await
        .context("reading weir_dedup")?;
        for i in hits {
            if let Some(s) = usize::try_from(i - 1).ok().and_then(|i| seen.get_mut(i)) {
                *s = true;
            }
        }
        Ok(seen)
    }

    async fn record(&self, keys: &[(Key, Duration)]) -> anyhow::Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let (t, g, m) = Self::columns(keys.iter().map(|(k, _)| k));
        let w: Vec<f64> = keys.iter().map(|(_, w)| w.as_secs_f64()).collect();
        sqlx::query(
            "INSERT INTO weir_dedup (tenant, group_id, message_id, expires_at) \
             SELECT t, g, m, now() + make_interval(secs => w) \
             FROM UNNEST($1::text[], $2::text[], $3::text[], $4::float8[]) AS k(t, g, m, w) \
             ON CONFLICT (tenant, group_id, message_id) DO UPDATE SET expires_at = EXCLUDED.expires_at",
        )
        .bind(&t)
        .bind(&g)
        .bind(&m)
        .bind(&w)
        .execute(&self.pool)
        .await
        .context("writing weir_dedup")?;
        Ok(())
    }
}
