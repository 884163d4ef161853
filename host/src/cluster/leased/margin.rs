//! The fence margin: a quarter of the lease at least, grown by how late
//! timers fire on this node. A node starved of CPU (busy neighbours, a
//! loaded host) runs its fence late; fencing earlier by a multiple of the
//! lateness it measured keeps the fence ahead of the lease.
//!
//! Two clocks are watched: the coordinator loop's own ticks, and a probe on
//! the node's runtime, where the slot runners whose calls a fence
//! interrupts run.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{TICK, fence_margin};

/// How long a lateness counts (then it decays to the next one seen).
const WINDOW: Duration = Duration::from_secs(10);
/// The margin covers this many times the worst lateness seen.
const FACTOR: u32 = 4;

/// The worst lateness seen within the last [`WINDOW`] (roughly: a smaller
/// one replaces it once it is older than that).
#[derive(Clone, Copy)]
struct Worst {
    late: Duration,
    at: Instant,
}

impl Worst {
    fn new() -> Self {
        Self {
            late: Duration::ZERO,
            at: Instant::now(),
        }
    }

    fn observe(&mut self, late: Duration, now: Instant) {
        if late >= self.late || now.duration_since(self.at) > WINDOW {
            *self = Self { late, at: now };
        }
    }

    fn get(&self, now: Instant) -> Duration {
        if now.duration_since(self.at) > WINDOW {
            Duration::ZERO
        } else {
            self.late
        }
    }
}

/// See the module docs.
pub struct Margin {
    lease: Duration,
    own: Worst,
    node: Arc<Mutex<Worst>>,
    /// The margin last logged (changes of more than a tick are logged).
    shown: Duration,
}

impl Margin {
    /// A margin for `lease`, and the probe to spawn on the node's runtime
    /// (it ends when the margin is dropped).
    pub(super) fn new(lease: Duration) -> (Self, impl std::future::Future<Output = ()> + Send + 'static) {
        let node = Arc::new(Mutex::new(Worst::new()));
        let probe = probe(Arc::downgrade(&node));
        let margin = Self {
            lease,
            own: Worst::new(),
            node,
            shown: fence_margin(lease),
        };
        (margin, probe)
    }

    /// The loop woke at `now` for a timer due at `due`.
    pub(super) fn woke(&mut self, due: Instant, now: Instant) {
        self.own.observe(now.saturating_duration_since(due), now);
    }

    /// The margin now: `max(fence_margin(lease), FACTOR × worst lateness)`,
    /// at most half the lease (a renewal must still have time to land).
    pub(super) fn current(&mut self, name: &str) -> Duration {
        let now = Instant::now();
        let worst = self.own.get(now).max(self.node.lock().get(now));
        let m = grown(self.lease, worst);
        if m.abs_diff(self.shown) > TICK {
            if m > self.shown {
                tracing::warn!(node = %name, late_ms = worst.as_millis(), margin_ms = m.as_millis(), lease_ms = self.lease.as_millis(), "timers fire late on this node (CPU starvation?): fencing earlier before the lease expires");
            } else {
                tracing::info!(node = %name, margin_ms = m.as_millis(), "timers are on time again: fence margin back down");
            }
            self.shown = m;
        }
        m
    }
}

/// The margin for a lateness of `worst`.
fn grown(lease: Duration, worst: Duration) -> Duration {
    let base = fence_margin(lease);
    base.max(worst * FACTOR).min(base.max(lease / 2))
}

/// Measure the node runtime's timer lateness every tick into `into`.
async fn probe(into: Weak<Mutex<Worst>>) {
    loop {
        let due = Instant::now() + TICK;
        tokio::time::sleep_until(due.into()).await;
        let now = Instant::now();
        let Some(worst) = into.upgrade() else { return };
        worst.lock().observe(now.saturating_duration_since(due), now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_margin_grows_with_lateness_up_to_half_the_lease() {
        let lease = Duration::from_secs(2);
        assert_eq!(grown(lease, Duration::ZERO), Duration::from_millis(500));
        assert_eq!(grown(lease, Duration::from_millis(100)), Duration::from_millis(500));
        assert_eq!(grown(lease, Duration::from_millis(200)), Duration::from_millis(800));
        assert_eq!(grown(lease, Duration::from_secs(5)), Duration::from_secs(1));
    }

    #[test]
    fn a_lateness_counts_for_a_window_then_decays() {
        let t0 = Instant::now();
        let mut w = Worst {
            late: Duration::ZERO,
            at: t0,
        };
        w.observe(Duration::from_millis(300), t0);
        w.observe(Duration::from_millis(10), t0 + Duration::from_secs(1));
        assert_eq!(w.get(t0 + Duration::from_secs(2)), Duration::from_millis(300));
        assert_eq!(w.get(t0 + WINDOW + Duration::from_secs(1)), Duration::ZERO);
        w.observe(Duration::from_millis(10), t0 + WINDOW + Duration::from_secs(1));
        assert_eq!(w.get(t0 + WINDOW + Duration::from_secs(1)), Duration::from_millis(10));
    }
}
