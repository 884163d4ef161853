//! Test guest whose behaviour is chosen by the message type, so host tests can provoke every
//! outcome: success, retry, reject, traps (panic, OOM, stack overflow), endless loops, slow
//! calls, cascades, config reads and sandbox probes. See `handle` for the table.
//! A type `batch.X` behaves as `X` (tests bind the `batch.` types to `handle-batch`); a batch
//! with a `trap` or `batch.trap` member traps as a whole. `handle-batch` attributes each member's
//! publishes to it (`weir_guest::members`). Types `wb.*`: see `witbatch`.

#![allow(clippy::panic, reason = "trapping on request is this guest's job")]

use std::hint::black_box;
use std::time::{Duration, Instant};

use weir_guest::{Failure, Handler, Message};

mod admin_hardening;
mod bytes;
mod hostile;
mod soak;
mod witbatch;

/// The faulty handler.
pub struct Faulty;

impl Handler for Faulty {
    fn handle(msg: Message) -> Result<(), Failure> {
        let kind = msg.message_type();
        if kind.starts_with("wb.") {
            return witbatch::handle(msg);
        }
        match kind.strip_prefix("batch.").unwrap_or(kind) {
            "ok" => Ok(()),
            "trap" => panic!("trap requested by test"),
            "loop" => spin_forever(),
            "hog" => hog_memory(),
            "recurse" => {
                black_box(recurse(black_box(0)));
                Ok(())
            }
            "slow" => {
                let text = msg.text()?;
                let ms: u64 = text
                    .trim()
                    .parse()
                    .map_err(|e| Failure::reject(format!("slow: payload {text:?} is not milliseconds: {e}")))?;
                busy_wait(Duration::from_millis(ms));
                Ok(())
            }
            "reject" => Err(Failure::reject("rejected by test")),
            "retry" => Err(Failure::retry("retry by test")),
            // Retries when its version was granted `WEIR_TEST_CANARY_BREAKS`
            // (grants are per version: a canary deployed with it breaks, the
            // stable version does not).
            "canary" => match std::env::var("WEIR_TEST_CANARY_BREAKS") {
                Ok(_) => Err(Failure::retry("canary: this version breaks (WEIR_TEST_CANARY_BREAKS)")),
                Err(_) => Ok(()),
            },
            // Fails with `retry` while the attempt is at most the payload's number.
            "flaky" => {
                let text = msg.text()?;
                let failing: u32 = text
                    .trim()
                    .parse()
                    .map_err(|e| Failure::reject(format!("flaky: payload {text:?} is not a number: {e}")))?;
                if msg.attempt() <= failing {
                    Err(Failure::retry(format!(
                        "flaky: attempt {} of the first {failing} fails",
                        msg.attempt()
                    )))
                } else {
                    Ok(())
                }
            }
            "publish" => weir_guest::publish("ok", msg.group_id(), &[], msg.payload()),
            "publish-then-trap" => {
                weir_guest::publish("ok", msg.group_id(), &[], msg.payload())?;
                panic!("trap after publish requested by test")
            }
            "config" => {
                let value = weir_guest::config(msg.text()?);
                Err(Failure::reject(format!("config={value:?}")))
            }
            "env" => Err(Failure::reject(probe_sandbox())),
            "leak-write" => {
                leak_write(msg.payload());
                Ok(())
            }
            "leak-scan" => Err(Failure::reject(leak_scan(msg.payload()))),
            k if k.starts_with("hostile.") => hostile::handle(&k["hostile.".len()..], &msg),
            k if k.starts_with("admin.") => admin_hardening::handle(k, &msg),
            k if k.starts_with("bytes.") => bytes::handle(&k["bytes.".len()..], &msg),
            s if s.starts_with("soak.") => soak::handle(&msg),
            other => Err(Failure::reject(format!("faulty: unknown message type {other:?}"))),
        }
    }

    fn handle_batch(batch: Vec<Message>) -> Vec<Result<(), Failure>> {
        if batch.iter().any(|m| matches!(m.message_type(), "trap" | "batch.trap")) {
            panic!("batch trap requested by test");
        }
        if batch.iter().any(|m| m.message_type() == "batch.hostile.keep-handle") {
            let n = batch.len();
            for m in batch {
                if m.message_type() == "batch.hostile.keep-handle" {
                    hostile::keep(m);
                }
            }
            return vec![Ok(()); n];
        }
        if witbatch::is_legacy(&batch) {
            return witbatch::legacy_batch(batch);
        }
        weir_guest::members(batch).map(Self::handle).collect()
    }
}

weir_guest::export!(Faulty);

fn spin_forever() -> ! {
    let mut n: u64 = 0;
    loop {
        n = black_box(n.wrapping_add(1));
    }
}

/// Allocates and touches 1 MiB chunks until allocation fails, which aborts (a trap).
fn hog_memory() -> ! {
    const CHUNK: usize = 1 << 20;
    let mut kept: Vec<Vec<u8>> = Vec::new();
    loop {
        let mut chunk = vec![0u8; CHUNK];
        for byte in chunk.iter_mut().step_by(4096) {
            *byte = 1;
        }
        kept.push(black_box(chunk));
        black_box(&kept);
    }
}

/// Unbounded, non-tail recursion with a 1 KiB frame: overflows the stack (a trap).
#[inline(never)]
#[allow(unconditional_recursion, reason = "the stack overflow is the point")]
fn recurse(depth: u64) -> u64 {
    let mut frame = [0u8; 1024];
    frame[(depth % 1024) as usize] = depth as u8;
    let frame = black_box(frame);
    recurse(black_box(depth + 1)).wrapping_add(u64::from(frame[(depth % 7) as usize]))
}

fn busy_wait(duration: Duration) {
    let start = Instant::now();
    while start.elapsed() < duration {
        black_box(());
    }
}

/// Each byte of a leaked copy is the marker's XOR this, so the marker the
/// scan is given (in its payload) never matches itself.
const LEAK_MASK: u8 = 0x5a;

/// Fill 3 MiB of heap (above and below the pool's 2 MiB kept resident)
/// with masked copies of `marker` and leak it: what a later instance in the
/// same pool slot must never see.
fn leak_write(marker: &[u8]) {
    let masked: Vec<u8> = marker.iter().map(|b| b ^ LEAK_MASK).collect();
    let mut heap = Vec::with_capacity(3 << 20);
    while heap.len() + masked.len() <= 3 << 20 {
        heap.extend_from_slice(&masked);
    }
    std::mem::forget(black_box(heap));
}

/// Grow linear memory by 4 MiB (as far as an earlier instance wrote, and
/// more), then look through all of it for a masked copy of `marker`:
/// `clean`, or where the first one is.
fn leak_scan(marker: &[u8]) -> String {
    if marker.is_empty() {
        return "leak-scan: an empty marker".into();
    }
    #[cfg(target_arch = "wasm32")]
    let size = {
        core::arch::wasm32::memory_grow(0, 64);
        core::arch::wasm32::memory_size(0) * 65536
    };
    #[cfg(not(target_arch = "wasm32"))]
    let size = 0usize;
    let mut found = None;
    // Page 0 holds nothing of ours; reading it is fine in Wasm (no null trap).
    'scan: for at in 0..size.saturating_sub(marker.len()) {
        for (k, want) in marker.iter().enumerate() {
            // SAFETY: `at + k` is inside linear memory, all of which is readable in Wasm.
            let got = unsafe { core::ptr::read_volatile((at + k) as *const u8) };
            if got ^ LEAK_MASK != *want {
                continue 'scan;
            }
        }
        found = Some(at);
        break;
    }
    match found {
        Some(at) => format!("found at {at} of {size}"),
        None => format!("clean ({size} bytes)"),
    }
}

/// Reports what the sandbox let through, e.g. `env: HOME=None; read_dir(/)=denied (...)`.
fn probe_sandbox() -> String {
    let home = std::env::var("HOME").ok();
    let dir = match std::fs::read_dir("/") {
        Ok(entries) => format!("ok ({} entries)", entries.count()),
        Err(e) => format!("denied ({e})"),
    };
    format!("env: HOME={home:?}; read_dir(/)={dir}")
}
