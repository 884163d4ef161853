//! Ack-floor monitoring (JetStream): is a slot consumer stuck behind a
//! message it cannot settle? It owns the pure [`StallClock`] and the
//! [`FloorMonitor`] that keeps the latest [`FloorState`] of every watched
//! consumer; polling the server is the transport's (`transport::nats`).
//! Observe only: nothing here acts on a stall (LESSONS.md, "Ack-floor
//! monitoring").
//!
//! The floor standing still is a stall only while the consumer has delivered
//! past it. An idle consumer's floor stands still because nothing arrived, so
//! the clock runs only while `delivered > ack floor`, and it restarts whenever
//! the floor moves or the consumer catches up: a message that arrives after an
//! hour of quiet is not charged with that hour.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// The stall clock of one consumer. Pure: fed with observations and times.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StallClock {
    /// When the floor was first seen standing at its current value with
    /// deliveries past it; `None` while caught up.
    since: Option<Instant>,
    /// The floor at that time.
    floor: u64,
}

impl StallClock {
    /// A clock that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feed one observation of the consumer (stream sequences of the last
    /// delivered message and of the ack floor) made at `now`; returns how long
    /// the floor has stood still with deliveries past it, or `None` when the
    /// consumer is caught up (nothing delivered past the floor).
    pub fn observe(&mut self, delivered: u64, ack_floor: u64, now: Instant) -> Option<Duration> {
        if delivered <= ack_floor {
            self.since = None;
            self.floor = ack_floor;
            return None;
        }
        match self.since {
            Some(since) if self.floor == ack_floor => Some(now.saturating_duration_since(since)),
            _ => {
                self.since = Some(now);
                self.floor = ack_floor;
                Some(Duration::ZERO)
            }
        }
    }
}

/// The latest observation of one slot consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FloorState {
    /// Topology name.
    pub topology: String,
    /// Slot of the consumer.
    pub slot: u32,
    /// The consumer's name (`weir-T-n`).
    pub consumer: String,
    /// Stream sequence of the last message delivered to the consumer.
    pub delivered: u64,
    /// Stream sequence of the ack floor (every message up to it is settled).
    pub ack_floor: u64,
    /// How long the floor has stood still with deliveries past it; zero when
    /// caught up or just moved.
    pub stalled_for: Duration,
}

/// The latest [`FloorState`] per watched consumer, shared by the pollers and
/// read by whoever reports it (node, tests, metrics).
#[derive(Debug, Default)]
pub struct FloorMonitor {
    states: Mutex<BTreeMap<(String, u32), FloorState>>,
}

impl FloorMonitor {
    /// Record an observation.
    pub fn update(&self, state: FloorState) {
        self.states.lock().insert((state.topology.clone(), state.slot), state);
    }

    /// Forget a consumer (its subscription ended).
    pub fn forget(&self, topology: &str, slot: u32) {
        self.states.lock().remove(&(topology.to_owned(), slot));
    }

    /// Every consumer's latest state, by topology then slot.
    pub fn snapshot(&self) -> Vec<FloorState> {
        self.states.lock().values().cloned().collect()
    }

    /// The longest stall among the watched consumers.
    pub fn longest_stall(&self) -> Duration {
        self.states
            .lock()
            .values()
            .map(|s| s.stalled_for)
            .max()
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t0: Instant, secs: u64) -> Instant {
        t0 + Duration::from_secs(secs)
    }

    #[test]
    fn an_idle_consumer_never_stalls() {
        let t0 = Instant::now();
        let mut c = StallClock::new();
        for s in 0..100 {
            assert_eq!(c.observe(0, 0, at(t0, s)), None);
        }
        // caught up at a later position: still idle, still no stall
        for s in 100..200 {
            assert_eq!(c.observe(42, 42, at(t0, s)), None);
        }
    }

    #[test]
    fn the_clock_runs_while_delivered_past_a_standing_floor() {
        let t0 = Instant::now();
        let mut c = StallClock::new();
        assert_eq!(c.observe(10, 9, at(t0, 0)), Some(Duration::ZERO));
        assert_eq!(c.observe(12, 9, at(t0, 5)), Some(Duration::from_secs(5)));
        assert_eq!(c.observe(20, 9, at(t0, 30)), Some(Duration::from_secs(30)));
    }

    #[test]
    fn a_moving_floor_restarts_the_clock() {
        let t0 = Instant::now();
        let mut c = StallClock::new();
        c.observe(10, 5, at(t0, 0));
        assert_eq!(c.observe(10, 5, at(t0, 8)), Some(Duration::from_secs(8)));
        assert_eq!(c.observe(11, 7, at(t0, 9)), Some(Duration::ZERO));
        assert_eq!(c.observe(11, 7, at(t0, 12)), Some(Duration::from_secs(3)));
    }

    #[test]
    fn idle_time_is_not_charged_to_the_next_message() {
        let t0 = Instant::now();
        let mut c = StallClock::new();
        assert_eq!(c.observe(5, 5, at(t0, 0)), None);
        // an hour of quiet, then a message arrives and is in flight
        assert_eq!(c.observe(6, 5, at(t0, 3600)), Some(Duration::ZERO));
        assert_eq!(c.observe(6, 5, at(t0, 3601)), Some(Duration::from_secs(1)));
        // caught up again: the clock stops and starts afresh next time
        assert_eq!(c.observe(6, 6, at(t0, 3602)), None);
        assert_eq!(c.observe(7, 6, at(t0, 7000)), Some(Duration::ZERO));
    }

    #[test]
    fn monitor_keeps_the_latest_state_per_consumer() {
        let m = FloorMonitor::default();
        let state = |slot, stalled| FloorState {
            topology: "t".into(),
            slot,
            consumer: format!("weir-t-{slot}"),
            delivered: 3,
            ack_floor: 1,
            stalled_for: Duration::from_secs(stalled),
        };
        m.update(state(0, 1));
        m.update(state(1, 9));
        m.update(state(0, 4));
        assert_eq!(m.snapshot().len(), 2);
        assert_eq!(m.longest_stall(), Duration::from_secs(9));
        m.forget("t", 1);
        assert_eq!(m.longest_stall(), Duration::from_secs(4));
    }
}
