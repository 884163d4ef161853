//! `payload-size`: what a byte of payload costs on its way from the broker to
//! the guest. `e2e-reuse` on the memory broker with 256 B, 16 KiB and 256 KiB
//! payloads; per row the wall time per message and per KiB, and the copies
//! of each payload byte: one for the lowering into guest memory (the guest's
//! allocator, invisible here) plus the host's allocations of 4 KiB or more
//! during the drain (counted by [`Counting`], the bench's global allocator)
//! divided by the payload bytes drained. A host copy always lands in a fresh
//! buffer of the payload's size, so that quotient counts them; a grown buffer
//! is counted at its new size, so it can only overstate.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::{Opts, Row};

/// Allocations at least this large are counted.
const COUNTED: usize = 4096;

/// Bytes in allocations of [`COUNTED`] bytes or more since the start.
pub static LARGE_BYTES: AtomicU64 = AtomicU64::new(0);

/// The payload size of [`crate::message`].
pub static PAYLOAD_BYTES: AtomicUsize = AtomicUsize::new(256);

/// mimalloc, counting its large allocations.
pub struct Counting;

fn count(size: usize) {
    if size >= COUNTED {
        LARGE_BYTES.fetch_add(size as u64, Ordering::Relaxed);
    }
}

// SAFETY: every method forwards to mimalloc with the caller's arguments
// unchanged; counting touches only an atomic.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { mimalloc::MiMalloc.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: as above.
        unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            count(new_size);
        }
        // SAFETY: as above.
        unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) }
    }
}

/// (row name, payload bytes).
const SIZES: [(&str, usize); 3] = [
    ("payload-256", 256),
    ("payload-16k", 16 << 10),
    ("payload-256k", 256 << 10),
];

/// At most this many payload bytes per run.
const BYTES_PER_RUN: u64 = 512 << 20;

pub fn payload_size(o: &Opts) -> anyhow::Result<Vec<Row>> {
    let tokio_rt = weir::sched::async_runtime()?;
    let config = crate::bench_config(o.slots, o.prefetch, weir::config::InstanceMode::Reuse, None);
    let mut rows = Vec::new();
    for (name, size) in SIZES {
        PAYLOAD_BYTES.store(size, Ordering::Relaxed);
        let n = o.messages.min(BYTES_PER_RUN / size as u64).max(1_000);
        let group = |i| crate::default_group(o, i);
        crate::e2e_shaped(&tokio_rt, o, &config, o.slots, (n / 10).max(100), &group)?;
        let (mut ns, mut per_kib, mut copies) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..o.runs {
            let run = crate::e2e_shaped(&tokio_rt, o, &config, o.slots, n, &group)?;
            let timed = n.saturating_sub(run.handled_at_start).max(1) as f64;
            let per_msg = run.wall.as_nanos() as f64 / timed;
            let c = 1.0 + run.large_alloc_bytes as f64 / (timed * size as f64);
            eprintln!(
                "[weir-bench] {name:<12} run {}/{}: {n} msgs, {per_msg:.0} ns/msg, {:.0} ns/KiB, {c:.2} copies per byte",
                r + 1,
                o.runs,
                per_msg * 1024.0 / size as f64
            );
            ns.push(per_msg);
            per_kib.push(per_msg * 1024.0 / size as f64);
            copies.push(c);
        }
        let mut extra = vec![("ns_per_kib", per_kib)];
        // Below the counting threshold the copies are not seen.
        if size >= COUNTED {
            extra.push(("copies_per_byte", copies));
        }
        rows.push(Row {
            name,
            messages: n,
            runs_ns: ns,
            extra,
            note: format!(
                "e2e-reuse with {size}-byte payloads, memory broker; copies = 1 (lowering) + host allocations >= 4 KiB / payload bytes"
            ),
        });
    }
    PAYLOAD_BYTES.store(256, Ordering::Relaxed);
    Ok(rows)
}
