//! This node's slots in `weir_slots`: which it owns, and giving one up
//! epoch-checked once it is drained.

use anyhow::Context as _;
use sqlx::Row as _;
use uuid::Uuid;

use super::Tables;
use super::listen::notify;
use crate::cluster::leased::Mine;
use crate::cluster::slots::SlotKey;

impl Tables {
    /// This node's slots as the database has them: key → (epoch, releasing).
    pub(super) async fn mine(&self, id: Uuid) -> anyhow::Result<Mine> {
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
    pub(super) async fn release(&self, id: Uuid, key: &SlotKey, epoch: i64) -> anyhow::Result<bool> {
        let pool = &self.pool;
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
}
