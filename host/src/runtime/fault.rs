//! Fault injection for tests, never for production: with
//! [`KILL_BEFORE_ACK`] set to `N`, the process sends itself SIGKILL right
//! before the ack of its `N`-th handled message, after the call succeeded,
//! its cascades were confirmed and its `handler.dedup` record was written:
//! the kill -9 between a success and its ack, made deterministic. With
//! [`KILL_BEFORE_CALL`] set to `N`, it does so right before its `N`-th call
//! of `handle` starts: the calls before it in its job have succeeded and
//! are not acked yet.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable (a positive count).
pub const KILL_BEFORE_ACK: &str = "WEIR_FAULT_KILL_BEFORE_ACK";

/// The environment variable (a positive count).
pub const KILL_BEFORE_CALL: &str = "WEIR_FAULT_KILL_BEFORE_CALL";

/// Called right before each handled message's ack.
pub fn before_ack() {
    static AT: OnceLock<Option<u64>> = OnceLock::new();
    static ACKS: AtomicU64 = AtomicU64::new(0);
    count_and_kill(&AT, &ACKS, KILL_BEFORE_ACK, "ack");
}

/// Called right before each call of `handle`.
pub fn before_call() {
    static AT: OnceLock<Option<u64>> = OnceLock::new();
    static CALLS: AtomicU64 = AtomicU64::new(0);
    count_and_kill(&AT, &CALLS, KILL_BEFORE_CALL, "call");
}

/// Count one more `what`; SIGKILL this process at the count in `var`.
fn count_and_kill(at: &OnceLock<Option<u64>>, count: &AtomicU64, var: &str, what: &str) {
    let at = *at.get_or_init(|| {
        let at = std::env::var(var)
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|n| *n > 0);
        if let Some(n) = at {
            tracing::error!(
                "{var}={n}: this process kills itself before its {n}th {what} (a test's fault; never in production)"
            );
        }
        at
    });
    let Some(at) = at else { return };
    if count.fetch_add(1, Ordering::SeqCst) + 1 == at {
        tracing::error!("{var}: SIGKILL before this {what}");
        // SAFETY: kill(2) on our own pid; SIGKILL cannot be caught, so
        // nothing runs after it.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}
