//! The soak's record of slot ownership, fed by a watcher of the cluster's
//! coordination store (`db::watch` for `postgres` mode, `bucket::watch` for
//! `nats-kv`): how long each slot is without a live owner, and who owns it.
//! Windows in which no owner *can* exist (every node's coordination cut on
//! purpose) are paused: the clock of a slot that is ownerless then restarts
//! when the window ends.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How often the watchers read the store.
pub const POLL: Duration = Duration::from_millis(200);

/// One slot as a watcher read it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Row {
    /// Held (assigned or releasing) by a node whose lease has not expired.
    pub owned: bool,
    /// In `releasing`.
    pub releasing: bool,
    /// The live owner's node name.
    pub owner: Option<String>,
}

/// What the watcher found.
#[derive(Debug, Default)]
pub struct Slots {
    /// Per slot, since when it has been without a live owner (counted time only).
    since: HashMap<u32, Instant>,
    /// Longest completed or running ownerless stretch.
    pub longest: Duration,
    /// Its slot.
    pub longest_slot: Option<u32>,
    /// Ownerless stretches longer than the threshold (a slot counted once per stretch).
    pub stuck: Vec<(u32, Duration)>,
    /// Slots currently in a stuck stretch (to count each stretch once).
    stuck_now: HashMap<u32, bool>,
    /// Slots with a live owner at the last read.
    pub owned: usize,
    /// Each live owner's node name at the last read (slot → name), so faults can aim at it.
    pub owners: HashMap<u32, String>,
    /// Slots in `releasing` at the last read, and the longest such stretch.
    releasing_since: HashMap<u32, Instant>,
    /// Longest `releasing` stretch.
    pub longest_releasing: Duration,
    /// While true nothing is timed (every node's database is cut).
    pub paused: bool,
    /// Reads that failed.
    pub read_errors: u64,
}

impl Slots {
    /// Stop timing (a window in which no owner can exist).
    pub fn pause(&mut self) {
        self.paused = true;
        self.since.clear();
        self.stuck_now.clear();
    }

    /// Time again, from now.
    pub fn resume(&mut self) {
        self.paused = false;
    }

    /// Record one read of every slot at `now`: a slot absent from `rows`
    /// has no owner; one without a live owner longer than `threshold` is stuck.
    pub fn observe(&mut self, now: Instant, slots: u32, rows: &HashMap<u32, Row>, threshold: Duration) {
        self.owned = rows.values().filter(|r| r.owned).count();
        self.owners = rows
            .iter()
            .filter(|(_, r)| r.owned)
            .filter_map(|(slot, r)| Some((*slot, r.owner.clone()?)))
            .collect();
        for slot in 0..slots {
            let (owned, releasing) = rows.get(&slot).map_or((false, false), |r| (r.owned, r.releasing));
            if releasing {
                let since = *self.releasing_since.entry(slot).or_insert(now);
                self.longest_releasing = self.longest_releasing.max(now - since);
            } else {
                self.releasing_since.remove(&slot);
            }
            if self.paused {
                continue;
            }
            if owned {
                self.since.remove(&slot);
                self.stuck_now.remove(&slot);
                continue;
            }
            let since = *self.since.entry(slot).or_insert(now);
            let d = now - since;
            if d > self.longest {
                self.longest = d;
                self.longest_slot = Some(slot);
            }
            if d > threshold && !self.stuck_now.get(&slot).copied().unwrap_or(false) {
                self.stuck_now.insert(slot, true);
                self.stuck.push((slot, d));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ownerless_longer_than_the_threshold_is_stuck_once_and_pauses_restart_the_clock() {
        let mut s = Slots::default();
        let t0 = Instant::now();
        let threshold = Duration::from_secs(3);
        let none = HashMap::new();
        let owned: HashMap<u32, Row> = [(
            0,
            Row {
                owned: true,
                releasing: false,
                owner: Some("n0".into()),
            },
        )]
        .into();
        s.observe(t0, 1, &owned, threshold);
        s.observe(t0 + Duration::from_secs(1), 1, &none, threshold);
        s.observe(t0 + Duration::from_secs(5), 1, &none, threshold);
        s.observe(t0 + Duration::from_secs(6), 1, &none, threshold);
        assert_eq!(s.stuck.len(), 1);
        assert_eq!(s.longest, Duration::from_secs(5));
        assert!(s.owners.is_empty(), "an ownerless slot has no owner to aim at");
        s.observe(t0 + Duration::from_secs(7), 1, &owned, threshold);
        assert_eq!(s.owners.get(&0).map(String::as_str), Some("n0"));
        s.pause();
        s.observe(t0 + Duration::from_secs(8), 1, &none, threshold);
        s.observe(t0 + Duration::from_secs(20), 1, &none, threshold);
        s.resume();
        s.observe(t0 + Duration::from_secs(21), 1, &none, threshold);
        s.observe(t0 + Duration::from_secs(22), 1, &none, threshold);
        assert_eq!(s.stuck.len(), 1, "paused time is not counted");
    }
}
