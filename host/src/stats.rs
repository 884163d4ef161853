//! Outcome counters of a node: every settled delivery lands in exactly one.
//! Read by the demo's summary, tests, and (later) the metrics endpoint.

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

    /// Deliveries that reached a final state (handled or captured).
    pub fn finished(&self) -> u64 {
        self.handled + self.dead_lettered_total() + self.uncertain
    }
}
