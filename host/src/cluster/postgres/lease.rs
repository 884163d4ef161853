//! This node's registration: register, renew (from the loop's renewal
//! task), mark leaving, leave.

use anyhow::Context as _;
use uuid::Uuid;

use super::listen::notify;
use super::{Tables, secs};

impl Tables {
    pub(super) async fn register(&self) -> anyhow::Result<Uuid> {
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
    pub(super) async fn renew(&self, id: Uuid) -> anyhow::Result<bool> {
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

    /// Mark this node `leaving`: the leader assigns it nothing more and
    /// moves what it owns to the others.
    pub(super) async fn mark_leaving(&self, id: Uuid) -> anyhow::Result<()> {
        sqlx::query("UPDATE weir_nodes SET leaving = true WHERE node_id = $1")
            .bind(id)
            .execute(&self.pool)
            .await
            .context("marking this node as leaving")?;
        notify(&self.pool).await
    }

    /// Give up every slot and the registration, in one transaction (the
    /// caller has drained every slot already, or fenced).
    pub(super) async fn leave(&self, id: Uuid) -> anyhow::Result<()> {
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
