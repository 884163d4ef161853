//! Outcome counters of a node: every settled delivery lands in exactly one.
//! Read by the demo's summary, tests, and (later) the metrics endpoint.
//! Batches are counted too: sizes, why each ran, replays.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use crate::outcome::{Outcome, Reason};

/// (topology, slot).
pub type SlotKey = (Arc<str>, u32);

/// Settled deliveries by outcome, for one slot or one handler; for a slot
/// also its lane depth.
#[derive(Debug, Default)]
pub struct OutcomeCounters {
    counts: [AtomicU64; OUTCOMES.len()],
    /// Deliveries taken from the broker and waiting in the slot's lanes.
    queued: AtomicU64,
    /// Lanes (groups) with a call running or handed to a worker.
    running: AtomicU64,
    /// Groups parked behind a failed message (`on_failure = "park"`).
    parked: AtomicU64,
    /// Messages held by the slot's parked groups (at most
    /// `topology.park_hold_slot`, the heads on JetStream counted).
    held: AtomicU64,
}

/// The outcome labels, in counter order.
pub const OUTCOMES: [&str; 8] = [
    "handled",
    "retry-scheduled",
    "dead-lettered",
    "stranded",
    "uncertain",
    "requeued",
    "released",
    "deduplicated",
];

fn outcome_index(o: Outcome) -> usize {
    match o {
        Outcome::Handled => 0,
        Outcome::RetryScheduled => 1,
        Outcome::DeadLettered(_) => 2,
        Outcome::Stranded => 3,
        Outcome::Uncertain => 4,
        Outcome::Requeued => 5,
        Outcome::Released => 6,
        Outcome::Deduplicated => 7,
    }
}

impl OutcomeCounters {
    /// Count one settled delivery.
    pub fn record(&self, o: Outcome) {
        self.counts[outcome_index(o)].fetch_add(1, Ordering::Relaxed);
    }

    /// The slot's lane depth: deliveries waiting, lanes running.
    pub fn set_depth(&self, queued: usize, running: usize) {
        self.queued.store(queued as u64, Ordering::Relaxed);
        self.running.store(running as u64, Ordering::Relaxed);
    }

    /// Groups parked in the slot now.
    pub fn set_parked(&self, parked: usize) {
        self.parked.store(parked as u64, Ordering::Relaxed);
    }

    /// Messages the slot's parked groups hold now, their heads counted
    /// where the broker keeps them unacknowledged (JetStream).
    pub fn set_held(&self, held: usize) {
        self.held.store(held as u64, Ordering::Relaxed);
    }

    /// Messages the slot's parked groups held at the last look.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Groups parked in the slot at the last look.
    pub fn parked(&self) -> u64 {
        self.parked.load(Ordering::Relaxed)
    }

    /// (deliveries waiting in lanes, lanes running).
    pub fn depth(&self) -> (u64, u64) {
        (
            self.queued.load(Ordering::Relaxed),
            self.running.load(Ordering::Relaxed),
        )
    }

    /// Deliveries of this slot released to the broker by their jobs (not
    /// started: a drain, a fence; or interrupted).
    pub fn released(&self) -> u64 {
        self.counts[outcome_index(Outcome::Released)].load(Ordering::Relaxed)
    }

    /// (label, count) per outcome.
    pub fn snapshot(&self) -> [(&'static str, u64); OUTCOMES.len()] {
        std::array::from_fn(|i| (OUTCOMES[i], self.counts[i].load(Ordering::Relaxed)))
    }
}

/// Upper bounds of the call duration buckets, seconds; the last is open.
pub const CALL_BUCKETS: [f64; 12] = [
    0.000_01, 0.000_05, 0.000_1, 0.000_5, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0,
];

/// What one handler did: outcomes of its messages, how long its calls took,
/// how many run now. Shared by every version of the handler.
#[derive(Debug, Default)]
pub struct HandlerMetrics {
    /// Settled deliveries of the handler's messages.
    pub outcomes: OutcomeCounters,
    /// Calls per duration bucket (index as [`CALL_BUCKETS`], then +Inf).
    buckets: [AtomicU64; CALL_BUCKETS.len() + 1],
    /// Sum of call durations, nanoseconds.
    sum_ns: AtomicU64,
    /// Calls running now.
    in_flight: AtomicI64,
}

impl HandlerMetrics {
    /// A call starts.
    pub fn enter(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    /// A call ended after `d`.
    pub fn exit(&self, d: Duration) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.called(d);
    }

    /// A call that took `d` ended (a version's own tally: no in-flight gauge).
    pub fn called(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = CALL_BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(CALL_BUCKETS.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Calls running now.
    pub fn in_flight(&self) -> i64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// (sum of durations in seconds, calls, calls per bucket by upper bound; the last bound,
    /// `f64::MAX`, is +Inf). Counts are per bucket, not cumulative.
    pub fn durations(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let per_bucket: Vec<(f64, u64)> = self
            .buckets
            .iter()
            .enumerate()
            .map(|(i, b)| {
                (
                    CALL_BUCKETS.get(i).copied().unwrap_or(f64::MAX),
                    b.load(Ordering::Relaxed),
                )
            })
            .collect();
        let total = per_bucket.iter().map(|(_, n)| n).sum();
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        (sum, total, per_bucket)
    }
}

/// The last few messages one version retried and dead-lettered while a
/// canary of its handler ran: the ids a canary's rollback names. Written
/// only on a failure while the version is tallying.
#[derive(Debug, Default)]
pub struct RecentFailures(parking_lot::Mutex<(VecDeque<String>, VecDeque<String>)>);

impl RecentFailures {
    /// Ids kept of each kind.
    pub const KEEP: usize = 5;

    /// Remember `id` if `outcome` is a retry or a dead letter.
    pub fn note(&self, id: &str, outcome: Outcome) {
        let mut g = self.0.lock();
        let ring = match outcome {
            Outcome::RetryScheduled => &mut g.0,
            Outcome::DeadLettered(_) => &mut g.1,
            _ => return,
        };
        if ring.len() == Self::KEEP {
            ring.pop_front();
        }
        ring.push_back(id.to_owned());
    }

    /// The last ids retried (`retried`) or dead-lettered, oldest first.
    pub fn last(&self, retried: bool) -> Vec<String> {
        let g = self.0.lock();
        let ring = if retried { &g.0 } else { &g.1 };
        ring.iter().cloned().collect()
    }
}

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
    /// Already handled (`handler.dedup`): acked without a call.
    pub deduplicated: AtomicU64,
    /// `handler.dedup` records that could not be written (the message was
    /// acked all the same: a crash before that ack could run it again).
    pub dedup_record_failures: AtomicU64,
    /// `handler.dedup` lookups that failed (the messages went back to the
    /// broker unstarted, to be looked up again).
    pub dedup_lookup_failures: AtomicU64,
    /// Acks of handled messages whose confirmation failed (it may be redelivered).
    pub ack_failures: AtomicU64,
    /// Cascaded messages published.
    pub cascaded: AtomicU64,
    /// Cascade publishes whose confirm did not come in time: they may have
    /// landed (the cause is retried; the copy its rerun publishes carries the
    /// same id).
    pub cascades_uncertain: AtomicU64,
    /// Cascades the broker recognised by id as a copy of one it already held
    /// and dropped (JetStream's duplicate window).
    pub cascades_duplicate: AtomicU64,
    /// Guest calls that trapped, timed out or were cancelled.
    pub faults: AtomicU64,
    /// Deliveries whose `weir-*` headers carried no valid seal: moved under
    /// `untrusted-` names, their claimed attempt counted as one.
    pub untrusted_headers: AtomicU64,
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
    /// Outcomes per (topology, slot), handed to each slot's runner when it starts.
    slots: parking_lot::Mutex<BTreeMap<SlotKey, Arc<OutcomeCounters>>>,
    /// Slot runner jobs that panicked (caught; the runner restarted).
    pub runner_panics: AtomicU64,
    /// Slots whose runner failed recently, with why: `GET /ready` answers
    /// 503 while any is here. Cleared once a restarted runner has run for a
    /// while without failing again.
    failing: parking_lot::Mutex<BTreeMap<SlotKey, String>>,
    /// Groups parked in this node's slots, by (slot, lane key).
    parked_groups: parking_lot::Mutex<BTreeMap<(SlotKey, u64), ParkedGroup>>,
}

/// A group parked behind a failed message (`on_failure = "park"`), as
/// `GET /v1/groups` and `weir groups list` show it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParkedGroup {
    /// Topology.
    pub topology: String,
    /// Slot.
    pub slot: u32,
    /// Tenant (`None`: the messages have none).
    pub tenant: Option<String>,
    /// Group id.
    pub group: String,
    /// The failed head's message id.
    pub head: String,
    /// The head's failed attempts seen on this node (0: parked by the
    /// slot's previous owner, its head not back yet).
    pub failures: u32,
    /// When it was parked here, milliseconds since the Unix epoch.
    pub since_ms: u64,
}

impl Stats {
    /// Group `key` of `slot` is parked as `group` (`None`: released).
    pub fn set_parked_group(&self, slot: &SlotKey, key: u64, group: Option<ParkedGroup>) {
        let mut parked = self.parked_groups.lock();
        match group {
            Some(g) => {
                parked.insert((slot.clone(), key), g);
            }
            None => {
                parked.remove(&(slot.clone(), key));
            }
        }
    }

    /// The slot stopped running here: none of its groups is parked here.
    pub fn forget_parked_groups(&self, slot: &SlotKey) {
        self.parked_groups.lock().retain(|(s, _), _| s != slot);
    }

    /// Every group parked on this node.
    pub fn parked_groups(&self) -> Vec<ParkedGroup> {
        self.parked_groups.lock().values().cloned().collect()
    }
}

impl Stats {
    /// Mark a slot as failing (its runner panicked), with why.
    pub fn mark_failing(&self, topology: &str, slot: u32, why: &str) {
        self.failing.lock().insert((Arc::from(topology), slot), why.to_owned());
    }

    /// The slot runs well again.
    pub fn clear_failing(&self, topology: &str, slot: u32) {
        self.failing.lock().remove(&(Arc::from(topology), slot));
    }

    /// The slots marked failing, with why, in order.
    pub fn failing(&self) -> Vec<(SlotKey, String)> {
        self.failing
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
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
    /// The slot holds as many deliveries as its prefetch allows (in lanes or
    /// in calls): nothing more can arrive until something settles, so
    /// lingering would only hold the window.
    Window,
}

impl FlushReason {
    /// Every reason, in a fixed order.
    pub const ALL: [FlushReason; 4] = [
        FlushReason::Size,
        FlushReason::Linger,
        FlushReason::Boundary,
        FlushReason::Window,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            FlushReason::Size => "size",
            FlushReason::Linger => "linger",
            FlushReason::Boundary => "boundary",
            FlushReason::Window => "window",
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
            Outcome::Deduplicated => &self.deduplicated,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// The outcome counters of one slot (the same ones each time it runs here).
    pub fn slot(&self, topology: &Arc<str>, slot: u32) -> Arc<OutcomeCounters> {
        self.slots.lock().entry((topology.clone(), slot)).or_default().clone()
    }

    /// Every slot's outcome counters.
    pub fn slots(&self) -> Vec<(SlotKey, Arc<OutcomeCounters>)> {
        self.slots.lock().iter().map(|(k, v)| (k.clone(), v.clone())).collect()
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
            deduplicated: g(&self.deduplicated),
            dedup_record_failures: g(&self.dedup_record_failures),
            dedup_lookup_failures: g(&self.dedup_lookup_failures),
            ack_failures: g(&self.ack_failures),
            cascaded: g(&self.cascaded),
            cascades_uncertain: g(&self.cascades_uncertain),
            cascades_duplicate: g(&self.cascades_duplicate),
            faults: g(&self.faults),
            untrusted_headers: g(&self.untrusted_headers),
            runner_panics: g(&self.runner_panics),
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
    /// See [`Stats::deduplicated`].
    pub deduplicated: u64,
    /// See [`Stats::dedup_record_failures`].
    pub dedup_record_failures: u64,
    /// See [`Stats::dedup_lookup_failures`].
    pub dedup_lookup_failures: u64,
    /// See [`Stats::ack_failures`].
    pub ack_failures: u64,
    /// See [`Stats::cascaded`].
    pub cascaded: u64,
    /// See [`Stats::cascades_uncertain`].
    pub cascades_uncertain: u64,
    /// See [`Stats::cascades_duplicate`].
    pub cascades_duplicate: u64,
    /// See [`Stats::faults`].
    pub faults: u64,
    /// See [`Stats::untrusted_headers`].
    pub untrusted_headers: u64,
    /// See [`Stats::runner_panics`].
    pub runner_panics: u64,
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
    fn call_durations_land_in_their_bucket_and_in_flight_returns_to_zero() {
        let m = HandlerMetrics::default();
        for d in [
            Duration::from_micros(3),
            Duration::from_millis(3),
            Duration::from_secs(9),
        ] {
            m.enter();
            assert_eq!(m.in_flight(), 1);
            m.exit(d);
        }
        assert_eq!(m.in_flight(), 0);
        let (sum, count, buckets) = m.durations();
        assert_eq!(count, 3);
        assert!((sum - 9.003_003).abs() < 1e-9, "{sum}");
        let at = |bound: f64| buckets.iter().find(|(b, _)| *b == bound).map(|(_, n)| *n);
        assert_eq!(at(0.000_01), Some(1), "3 µs: first bucket");
        assert_eq!(at(0.005), Some(1), "3 ms");
        assert_eq!(at(f64::MAX), Some(1), "9 s: +Inf");
        assert_eq!(
            buckets.iter().map(|(_, n)| n).sum::<u64>(),
            3,
            "per bucket, not cumulative"
        );
        let slot = OutcomeCounters::default();
        slot.record(Outcome::DeadLettered(Reason::NoHandler));
        slot.record(Outcome::Handled);
        assert_eq!(
            &slot.snapshot()[..3],
            &[("handled", 1), ("retry-scheduled", 0), ("dead-lettered", 1)]
        );
    }

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
