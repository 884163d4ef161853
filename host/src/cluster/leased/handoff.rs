//! This node's side of a handoff: start the slots assigned to it, drain
//! the ones it is asked to give up and release them epoch-checked, fence
//! everything when the lease cannot be renewed in time.

use std::time::{Duration, Instant};

use super::{Member, Tick, bounded};

impl Member {
    /// Start the slots assigned to this node, drain and release the ones it
    /// is asked to give up. While `leaving`, every slot it owns is drained
    /// and released, and none is started.
    pub(super) async fn reconcile(&self, st: &mut Tick, leaving: bool) -> anyhow::Result<()> {
        let mine = self.store.mine(st.node_id).await?;
        st.owned = mine.len();
        st.releasing.retain(|_, h| !h.is_finished());
        // Slots this node runs that the store no longer gives it: it was
        // expired and removed. Fence them (should not happen: it fences first).
        for key in self.slots.running() {
            // A fenced slot drains on after its fence: fenced once, not every pass.
            if !mine.contains_key(&key) && !st.releasing.contains_key(&key) && !self.slots.is_stopping(&key) {
                tracing::error!(topology = %key.0, slot = key.1, "slot no longer ours in the coordinator; interrupting and stopping it");
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
                let (slots, store, id, no_drain, k) = (
                    self.slots.clone(),
                    self.store.clone(),
                    st.node_id,
                    self.no_drain,
                    key.clone(),
                );
                let limit = self.step_timeout();
                let h = tokio::spawn(async move {
                    let started = Instant::now();
                    if no_drain {
                        let _ = bounded(store.what(), limit, store.release(id, &k, epoch)).await;
                    }
                    let report = slots.drain(&k).await;
                    match bounded(store.what(), limit, store.release(id, &k, epoch)).await {
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
    tracing::error!(node = %c.name, "fenced: consuming nothing until the coordinator answers again");
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
