//! Fault injection for tests, never for production: with
//! [`KILL_BEFORE_ACK`] set to `N`, the process sends itself SIGKILL right
//! before the ack of its `N`-th handled message, after the call succeeded,
//! its cascades were confirmed and its `handler.dedup` record was written:
//! the kill -9 between a success and its ack, made deterministic.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable (a positive count).
pub const KILL_BEFORE_ACK: &str = "WEIR_FAULT_KILL_BEFORE_ACK";

/// Called right before each handled message's ack.
pub fn before_ack() {
    static AT: OnceLock<Option<u64>> = OnceLock::new();
    static ACKS: AtomicU64 = AtomicU64::new(0);
    let at = *AT.get_or_init(|| {
        let at = std::env::var(KILL_BEFORE_ACK)
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|n| *n > 0);
        if let Some(n) = at {
            tracing::error!("{KILL_BEFORE_ACK}={n}: this process kills itself before its {n}th ack (a test's fault; never in production)");
        }
        at
    });
    let Some(at) = at else { return };
    if ACKS.fetch_add(1, Ordering::SeqCst) + 1 == at {
        tracing::error!("{KILL_BEFORE_ACK}: SIGKILL before this ack");
        // SAFETY: kill(2) on our own pid; SIGKILL cannot be caught, so
        // nothing runs after it.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}
