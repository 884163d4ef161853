//! Dedup records in PostgreSQL (`cluster.mode = "postgres"`): table
//! `weir_dedup` (migration 0004), windows on the database's clock, on a
//! pool of their own so lookups never queue ahead of lease renewals.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use async_trait::async_trait;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use super::{Key, Store};

/// Connections of the dedup pool.
const CONNECTIONS: u32 = 4;
/// Every this many writes, one also deletes expired records (a bounded chunk).
const PURGE_EVERY: u64 = 256;
/// Most expired records one purge deletes.
const PURGE_CHUNK: i64 = 10_000;

/// The `weir_dedup` table.
pub struct Postgres {
    pool: PgPool,
    writes: AtomicU64,
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

    /// Over `pool`.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            writes: AtomicU64::new(0),
        }
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

    async fn purge(&self) -> anyhow::Result<u64> {
        let done = sqlx::query(
            "DELETE FROM weir_dedup WHERE ctid IN \
             (SELECT ctid FROM weir_dedup WHERE expires_at < now() LIMIT $1)",
        )
        .bind(PURGE_CHUNK)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }
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
        if self.writes.fetch_add(1, Ordering::Relaxed) % PURGE_EVERY == PURGE_EVERY - 1 {
            match self.purge().await {
                Ok(n) => tracing::debug!(deleted = n, "expired dedup records purged"),
                Err(e) => {
                    tracing::warn!(error = %e, "purging expired dedup records failed; the next purge tries again")
                }
            }
        }
        Ok(())
    }
}
