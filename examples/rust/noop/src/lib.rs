//! The smallest handler: accepts every message without looking at it. Used by benchmarks to
//! measure the host's own cost per message.
//!
//! Optional: `config = { spin_us = "50" }` makes it burn that many microseconds of CPU per
//! message first (a busy loop on the monotonic clock), so a benchmark can give it a known amount
//! of work. Without the key it does nothing, as before.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use weir_guest::{Failure, Handler, Message};

/// Accepts everything.
pub struct Noop;

/// The configured work per message, read once per instance.
fn spin() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(|| {
        weir_guest::config("spin_us")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(Duration::ZERO, Duration::from_micros)
    })
}

/// Busy-wait for `d` of wall time on the guest's own thread (CPU, not sleep).
fn burn(d: Duration) {
    if d.is_zero() {
        return;
    }
    let start = Instant::now();
    while start.elapsed() < d {
        std::hint::spin_loop();
    }
}

impl Handler for Noop {
    fn handle(_msg: Message) -> Result<(), Failure> {
        burn(spin());
        Ok(())
    }

    fn handle_batch(batch: Vec<Message>) -> Vec<Result<(), Failure>> {
        burn(spin() * u32::try_from(batch.len()).unwrap_or(u32::MAX));
        vec![Ok(()); batch.len()]
    }
}

weir_guest::export!(Noop);
