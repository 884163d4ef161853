//! The lease renewals, on a task of their own beside the loop.
//!
//! A renewal must never wait behind the loop's other steps (a leader pass,
//! a reconcile, each allowed its step timeout), nor be thrown away
//! because one answer was slow: on a starved machine a round trip can take
//! longer than a step may, and a node that gives up on each one fences with
//! its store merely slow. So a renewal is sent every [`interval`] (a
//! tenth of the lease, at least a [`TICK`]), whatever the loop does, with
//! up to [`IN_FLIGHT`] of them waiting at once, and each is kept when it
//! comes back, however late. The loop reads the newest one sent that
//! succeeded: it is timed from before it was sent, so the node's deadline is
//! never later than the store's (which counts the lease from when the
//! renewal arrived).

use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt as _};
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use uuid::Uuid;

use super::{Store, TICK};

/// Renewals waiting for an answer at most, each on its own connection.
pub(crate) const IN_FLIGHT: usize = 2;

/// How often a lease is renewed: a tenth of it, at least a [`TICK`]. The
/// fence comes `lease − margin` after the newest renewal sent (the margin is
/// a quarter of the lease at least), so a tenth leaves seven renewals or
/// more to succeed before a fence, while a 5 s lease costs the database 2
/// renewals a second per node instead of 10 (docs/SCALE.md).
pub(crate) fn interval(lease: Duration) -> Duration {
    (lease / 10).max(TICK)
}

/// What the renewals found, for the loop.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Renewed {
    /// When the newest successful renewal of the current registration was sent.
    pub(super) sent: Option<Instant>,
    /// The current registration's lease had expired (or its row is gone).
    pub(super) expired: bool,
}

/// The renewal task; stopped when dropped.
pub(super) struct Renewals {
    state: watch::Receiver<Renewed>,
    registration: watch::Sender<(Uuid, Instant)>,
    task: JoinHandle<()>,
}

impl Drop for Renewals {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Renewals {
    /// Renew `id`'s lease from now on; `registered` is when its
    /// registration was sent (its lease counts from then).
    pub(crate) fn start(store: Arc<dyn Store>, lease: Duration, id: Uuid, registered: Instant) -> Self {
        let (tx, state) = watch::channel(Renewed {
            sent: Some(registered),
            expired: false,
        });
        let (registration, current) = watch::channel((id, registered));
        let task = tokio::spawn(run(store, lease, current, tx));
        Self {
            state,
            registration,
            task,
        }
    }

    /// The newest state.
    pub(super) fn now(&self) -> Renewed {
        *self.state.borrow()
    }

    /// This node registered again as `id` (sent at `registered`): renew that one.
    pub(super) fn registered(&self, id: Uuid, registered: Instant) {
        let _ = self.registration.send((id, registered));
    }
}

async fn run(
    store: Arc<dyn Store>,
    lease: Duration,
    mut current: watch::Receiver<(Uuid, Instant)>,
    tx: watch::Sender<Renewed>,
) {
    let mut ticks = tokio::time::interval(interval(lease));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut waiting = FuturesUnordered::new();
    let mut failures = 0u32;
    let mut last_warned: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = ticks.tick() => {
                let (id, _) = *current.borrow();
                if waiting.len() < IN_FLIGHT && !tx.borrow().expired {
                    let store = store.clone();
                    waiting.push(async move {
                        let sent = Instant::now();
                        // Kept however late it comes, but not for ever: a
                        // renewal older than the lease is worth nothing.
                        let r = match tokio::time::timeout(lease, store.renew(id)).await {
                            Ok(r) => r,
                            Err(_) => Err(anyhow::anyhow!("no answer within the lease ({lease:?})")),
                        };
                        (id, sent, r)
                    });
                }
            }
            Some((id, sent, r)) = waiting.next(), if !waiting.is_empty() => {
                if id != current.borrow().0 {
                    continue; // an earlier registration's
                }
                match r {
                    Ok(true) => {
                        failures = 0;
                        tx.send_if_modified(|s| {
                            let newer = s.sent.is_none_or(|at| sent > at);
                            if newer {
                                s.sent = Some(sent);
                            }
                            newer
                        });
                    }
                    Ok(false) => {
                        tx.send_modify(|s| s.expired = true);
                    }
                    Err(e) => {
                        failures += 1;
                        // Every failure counts; the log says so once a lease at most.
                        if last_warned.is_none_or(|w| w.elapsed() >= lease) {
                            last_warned = Some(Instant::now());
                            tracing::warn!(error = %format!("{e:#}"), failures, "lease renewal failed");
                        }
                    }
                }
            }
            changed = current.changed() => {
                if changed.is_err() {
                    return;
                }
                let (_, registered) = *current.borrow_and_update();
                tx.send_replace(Renewed { sent: Some(registered), expired: false });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenth_of_the_lease_and_never_below_a_tick() {
        assert_eq!(interval(Duration::from_secs(5)), Duration::from_millis(500));
        assert_eq!(interval(Duration::from_secs(2)), Duration::from_millis(200));
        assert_eq!(interval(Duration::from_millis(500)), TICK);
        // Enough renewals before the fence: it comes lease − margin (at
        // least a quarter of the lease) after the newest one sent. (Below a
        // second the tick is the interval, as before.)
        for lease in [1_000, 2_000, 5_000, 30_000].map(Duration::from_millis) {
            let before_fence = lease - super::super::fence_margin(lease);
            assert!(before_fence >= interval(lease) * 3, "lease {lease:?}");
        }
    }
}
