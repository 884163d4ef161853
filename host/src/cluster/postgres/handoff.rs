//! This node's side of a handoff: start the slots assigned to it, drain
//! the ones it is asked to give up and release them epoch-checked, fence
//! everything when the lease cannot be renewed in time.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use sqlx::Row as _;
use sqlx::postgres::PgPool;
use uuid::Uuid;

use super::listen::notify;
use super::{Member, Tick, bounded};
use crate::cluster::slots::SlotKey;

impl Member {
    /// This node's slots as the database has them: key → (epoch, releasing).
    pub(super) async fn mine(&self, id: Uuid) -> anyhow::Result<HashMap<SlotKey, (i64, bool)>> {
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
    pub(super) async fn release(pool: &PgPool, id: Uuid, key: &SlotKey, epoch: i64) -> anyhow::Result<bool> {
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
    pub(super) async fn reconcile(&self, st: &mut Tick, leaving: bool) -> anyhow::Result<()> {
        let mine = self.mine(st.node_id).await?;
        st.owned = mine.len();
        st.releasing.retain(|_, h| !h.is_finished());
        // Slots this node runs that the database no longer gives it: it was
        // expired and removed. Fence them (should not happen: it fences first).
        for key in self.slots.running() {
            // A fenced slot drains on after its fence: fenced once, not every pass.
            if !mine.contains_key(&key) && !st.releasing.contains_key(&key) && !self.slots.is_stopping(&key) {
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
}

/// Fence, unless fenced already.
pub(super) async fn fence(c: &Member, st: &mut Tick, fence_after: Duration) {
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

/// Stop every slot at once (interrupting its calls) and forget the epochs.
pub(super) async fn fence_all(c: &Member, st: &mut Tick) {
    c.ready.store(false, std::sync::atomic::Ordering::Relaxed);
    st.fenced = true;
    st.leader = false;
    for (_, h) in st.releasing.drain() {
        h.abort();
    }
    c.slots.fence_all().await;
    st.epochs.clear();
}
