//! Outcome counters of a node: every settled delivery lands in exactly one.
//! Read by the demo's summary, tests, and (later) the metrics endpoint.
//! Batches are counted too: sizes, why each ran, replays.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::retry::capture::{Outcome, Reason};

/// Counters, all monotonic.
#[derive(Debug, Default)]
pub struct Stats {
    /// Handler succeeded, cascades confirmed, acked.
    pub handled: AtomicU64,
    /// Put on the retry ladder.
    pub retry_scheduled: AtomicU64,
    /// Captured on the dead-letter destination, by reason (index = `Reason as usize`).
    pub dead_lettered: [AtomicU64; Reason::ALL.len()],
    /// Capture failed with no delivery left.
    pub stranded: AtomicU64,
    /// Capture confirmed, ack unconfirmed.
    pub uncertain: AtomicU64,
    /// Capture failed; the message went back to its queue.
    pub requeued: AtomicU64,
    /// Returned unprocessed (drain, handoff).
    pub released: AtomicU64,
    /// Acks of handled messages whose confirmation failed (it may be redelivered).
    pub ack_failures: AtomicU64,
    /// Cascaded messages published.
    pub cascaded: AtomicU64,
    /// Guest calls that trapped, timed out or were cancelled.
    pub faults: AtomicU64,
    /// Batches handed to `handle-batch`, by size bucket (index = [`size_bucket`]).
    pub batch_sizes: [AtomicU64; BATCH_SIZE_BUCKETS.len()],
    /// Members of every batch handed to `handle-batch`.
    pub batch_members: AtomicU64,
    /// Batches by the reason they ran (index = `FlushReason as usize`).
    pub batch_flushes: [AtomicU64; FlushReason::ALL.len()],
    /// Batches whose call trapped or timed out, replayed member by member.
    pub batch_replays: AtomicU64,
    /// Members of unfinished batches returned to the broker by a drain.
    pub batch_released: AtomicU64,
}

/// Upper bounds (inclusive) of the batch size buckets; the last is open.
pub const BATCH_SIZE_BUCKETS: [u64; 5] = [1, 10, 100, 1000, u64::MAX];

/// The bucket of a batch of `n` members.
pub fn size_bucket(n: usize) -> usize {
    let n = n as u64;
    BATCH_SIZE_BUCKETS
        .iter()
        .position(|b| n <= *b)
        .unwrap_or(BATCH_SIZE_BUCKETS.len() - 1)
}

/// Why a batch ran when it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FlushReason {
    /// It reached the rule's `size`.
    Size,
    /// Its oldest member had waited `linger`.
    Linger,
    /// The next message of its lane cannot join it (another type, tenant or
    /// handler), so waiting could not make it bigger.
    Boundary,
}

impl FlushReason {
    /// Every reason, in a fixed order.
    pub const ALL: [FlushReason; 3] = [FlushReason::Size, FlushReason::Linger, FlushReason::Boundary];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            FlushReason::Size => "size",
            FlushReason::Linger => "linger",
            FlushReason::Boundary => "boundary",
        }
    }
}

impl Stats {
    /// Count one settled delivery.
    pub fn record(&self, outcome: Outcome) {
        let c = match outcome {
            Outcome::Handled => &self.handled,
            Outcome::RetryScheduled => &self.retry_scheduled,
            Outcome::DeadLettered(r) => &self.dead_lettered[r as usize],
            Outcome::Stranded => &self.stranded,
            Outcome::Uncertain => &self.uncertain,
            Outcome::Requeued => &self.requeued,
            Outcome::Released => &self.released,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Count a batch of `size` members handed to `handle-batch` for `reason`.
    pub fn record_batch(&self, size: usize, reason: FlushReason) {
        self.batch_sizes[size_bucket(size)].fetch_add(1, Ordering::Relaxed);
        self.batch_members.fetch_add(size as u64, Ordering::Relaxed);
        self.batch_flushes[reason as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// A plain copy of the counters.
    pub fn snapshot(&self) -> Snapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Snapshot {
            handled: g(&self.handled),
            retry_scheduled: g(&self.retry_scheduled),
            dead_lettered: Reason::ALL.map(|r| (r, g(&self.dead_lettered[r as usize]))),
            stranded: g(&self.stranded),
            uncertain: g(&self.uncertain),
            requeued: g(&self.requeued),
            released: g(&self.released),
            ack_failures: g(&self.ack_failures),
            cascaded: g(&self.cascaded),
            faults: g(&self.faults),
            batch_sizes: std::array::from_fn(|i| (BATCH_SIZE_BUCKETS[i], g(&self.batch_sizes[i]))),
            batch_members: g(&self.batch_members),
            batch_flushes: FlushReason::ALL.map(|r| (r, g(&self.batch_flushes[r as usize]))),
            batch_replays: g(&self.batch_replays),
            batch_released: g(&self.batch_released),
        }
    }
}

/// A point-in-time copy of [`Stats`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// See [`Stats::handled`].
    pub handled: u64,
    /// See [`Stats::retry_scheduled`].
    pub retry_scheduled: u64,
    /// Dead letters per reason.
    pub dead_lettered: [(Reason, u64); Reason::ALL.len()],
    /// See [`Stats::stranded`].
    pub stranded: u64,
    /// See [`Stats::uncertain`].
    pub uncertain: u64,
    /// See [`Stats::requeued`].
    pub requeued: u64,
    /// See [`Stats::released`].
    pub released: u64,
    /// See [`Stats::ack_failures`].
    pub ack_failures: u64,
    /// See [`Stats::cascaded`].
    pub cascaded: u64,
    /// See [`Stats::faults`].
    pub faults: u64,
    /// Batches per size bucket: (inclusive upper bound, count).
    pub batch_sizes: [(u64, u64); BATCH_SIZE_BUCKETS.len()],
    /// See [`Stats::batch_members`].
    pub batch_members: u64,
    /// Batches per flush reason.
    pub batch_flushes: [(FlushReason, u64); FlushReason::ALL.len()],
    /// See [`Stats::batch_replays`].
    pub batch_replays: u64,
    /// See [`Stats::batch_released`].
    pub batch_released: u64,
}

impl Snapshot {
    /// All dead letters, whatever the reason.
    pub fn dead_lettered_total(&self) -> u64 {
        self.dead_lettered.iter().map(|(_, n)| n).sum()
    }

    /// Dead letters for one reason.
    pub fn dead_lettered(&self, reason: Reason) -> u64 {
        self.dead_lettered
            .iter()
            .find(|(r, _)| *r == reason)
            .map_or(0, |(_, n)| *n)
    }

    /// Batches handed to `handle-batch`.
    pub fn batches(&self) -> u64 {
        self.batch_sizes.iter().map(|(_, n)| n).sum()
    }

    /// Batches that ran for one reason.
    pub fn batch_flushes(&self, reason: FlushReason) -> u64 {
        self.batch_flushes
            .iter()
            .find(|(r, _)| *r == reason)
            .map_or(0, |(_, n)| *n)
    }

    /// Deliveries that reached a final state (handled or captured).
    pub fn finished(&self) -> u64 {
        self.handled + self.dead_lettered_total() + self.uncertain
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_sizes_land_in_their_bucket_and_flushes_by_reason() {
        assert_eq!([1, 2, 10, 11, 100, 101, 5000].map(size_bucket), [0, 1, 1, 2, 2, 3, 4]);
        let s = Stats::default();
        s.record_batch(100, FlushReason::Size);
        s.record_batch(3, FlushReason::Linger);
        let snap = s.snapshot();
        assert_eq!(snap.batches(), 2);
        assert_eq!(snap.batch_members, 103);
        assert_eq!(snap.batch_sizes[2], (100, 1));
        assert_eq!(snap.batch_flushes(FlushReason::Size), 1);
        assert_eq!(snap.batch_flushes(FlushReason::Boundary), 0);
    }
}
