//! The backoff between restarts of what consumes a broker (a slot runner, an
//! ingress forwarder): doubling from 100 ms up to 5 s, cut short by the
//! node's stop. The one copy of that loop's waiting.

use std::time::Duration;

use tokio::sync::watch;

/// The first delay, and the one after a reset.
pub const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// The longest delay.
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// True once the node is stopping (stop sent, or its sender gone).
pub fn stopping(stop: &watch::Receiver<bool>) -> bool {
    *stop.borrow() || stop.has_changed().is_err()
}

/// Sleep `delay`, or less if the node stops; true when it stopped.
async fn pause(stop: &mut watch::Receiver<bool>, delay: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(delay) => stopping(stop),
        changed = stop.changed() => changed.is_err() || *stop.borrow(),
    }
}

/// A doubling delay between restarts.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    delay: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { delay: BACKOFF_MIN }
    }
}

impl Backoff {
    /// The delay the next wait sleeps.
    pub fn delay(&self) -> Duration {
        self.delay
    }

    /// Back to the first delay (the last run went well).
    pub fn reset(&mut self) {
        self.delay = BACKOFF_MIN;
    }

    /// Sleep the current delay (or less if the node stops) without growing
    /// it; true when the node stopped.
    pub async fn pause(&self, stop: &mut watch::Receiver<bool>) -> bool {
        pause(stop, self.delay).await
    }

    /// Sleep the current delay, then double it (up to [`BACKOFF_MAX`]); true
    /// when the node stopped.
    pub async fn wait(&mut self, stop: &mut watch::Receiver<bool>) -> bool {
        let stopped = pause(stop, self.delay).await;
        self.delay = (self.delay * 2).min(BACKOFF_MAX);
        stopped
    }
}
