//! The chaos soak's behaviour (`weir-soak`, types `soak.*`), a ledger that
//! does not depend on Weir's own journal: `soak.call` runs for the
//! milliseconds its payload names (busy, so a fence's epoch interruption
//! can stop it) and then reports its wall-clock interval as a cascade of
//! type `soak.interval`, which the soak reads off the broker itself.
//! A payload `MS sleep` sleeps instead (WASI clock: no CPU, but a fence's
//! epoch interruption cannot stop it until it returns), for runs that
//! need many long calls on a small machine.
//! `soak.interval` is bound to this handler too and just succeeds. Neither
//! ever fails on a well-formed payload: any dead letter is a false one.
//!
//! Interval line (tab-separated): message id, group, tenant, node (the
//! handler's `config.node`), attempt, start and end in ns since the epoch.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use weir_guest::{Failure, Message};

/// Dispatch a `soak.*` message.
pub fn handle(msg: &Message) -> Result<(), Failure> {
    match msg.message_type() {
        "soak.call" => call(msg),
        "soak.interval" => Ok(()),
        other => Err(Failure::reject(format!(
            "soak: unknown message type {other:?} (expected soak.call or soak.interval)"
        ))),
    }
}

fn call(msg: &Message) -> Result<(), Failure> {
    let text = msg.text()?;
    let mut words = text.split_whitespace();
    let first = words.next().unwrap_or("");
    let sleep = words.next() == Some("sleep");
    let ms: u64 = first.parse().map_err(|e| {
        Failure::reject(format!(
            "soak.call: payload {text:?} does not start with milliseconds: {e}"
        ))
    })?;
    let start = now_ns();
    if sleep {
        std::thread::sleep(Duration::from_millis(ms));
    } else {
        super::busy_wait(Duration::from_millis(ms));
    }
    let end = now_ns();
    let node = weir_guest::config("node").unwrap_or_default();
    let line = format!(
        "{}\t{}\t{}\t{}\t{}\t{start}\t{end}",
        msg.id(),
        msg.group_id().unwrap_or(""),
        msg.tenant_id().unwrap_or(""),
        node,
        msg.attempt(),
    );
    weir_guest::publish("soak.interval", None, &[], line.as_bytes())
}

/// Wall-clock nanoseconds since the Unix epoch (WASI wall clock: the host's).
fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}
