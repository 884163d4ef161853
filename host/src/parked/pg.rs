//! Parked groups in PostgreSQL: table `weir_parked` (migration 0005).

use anyhow::Context as _;
use async_trait::async_trait;
use sqlx::PgPool;

use super::{Record, Store};

/// The `weir_parked` table.
pub struct Postgres {
    pool: PgPool,
}

impl Postgres {
    /// Over `pool`.
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }
}

#[async_trait]
impl Store for Postgres {
    async fn park(&self, r: &Record) -> anyhow::Result<()> {
        sqlx::query(
            "INSERT INTO weir_parked (topology, slot, tenant, group_id, head_id) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (topology, slot, tenant, group_id) DO UPDATE SET head_id = EXCLUDED.head_id",
        )
        .bind(&r.topology)
        .bind(i64::from(r.slot))
        .bind(&r.tenant)
        .bind(&r.group)
        .bind(&r.head)
        .execute(&self.pool)
        .await
        .context("writing weir_parked")?;
        Ok(())
    }

    async fn release(&self, r: &Record) -> anyhow::Result<()> {
        sqlx::query("DELETE FROM weir_parked WHERE topology = $1 AND slot = $2 AND tenant = $3 AND group_id = $4")
            .bind(&r.topology)
            .bind(i64::from(r.slot))
            .bind(&r.tenant)
            .bind(&r.group)
            .execute(&self.pool)
            .await
            .context("deleting from weir_parked")?;
        Ok(())
    }

    async fn parked(&self, topology: &str, slot: u32) -> anyhow::Result<Vec<Record>> {
        let rows: Vec<(String, String, String)> = sqlx::query_as(
            "SELECT tenant, group_id, head_id FROM weir_parked WHERE topology = $1 AND slot = $2 ORDER BY since",
        )
        .bind(topology)
        .bind(i64::from(slot))
        .fetch_all(&self.pool)
        .await
        .context("reading weir_parked")?;
        Ok(rows
            .into_iter()
            .map(|(tenant, group, head)| Record {
                topology: topology.to_owned(),
                slot,
                tenant,
                group,
                head,
            })
            .collect())
    }
}
