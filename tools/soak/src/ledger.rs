//! The soak's ledger, which does not trust Weir's journal: what the
//! publisher had confirmed, and what the soak saw on the wire — the interval
//! each successful call reported through its `soak.interval` cascade, and the
//! dead letters read at the end. [`Ledger::verdict`] turns that into the
//! figures: lost, intra-group overlaps, duplicates, falsely dead-lettered.

use std::collections::{BTreeMap, HashMap, HashSet};

/// A message as the soak read it off the broker.
#[derive(Debug, Clone)]
pub struct WireMessage {
    /// Headers as text.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: Vec<u8>,
}

impl WireMessage {
    /// The first header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// One successful call, as its guest reported it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Interval {
    /// Message id.
    pub id: String,
    /// Group id.
    pub group: String,
    /// Tenant id.
    pub tenant: String,
    /// Node (handler `config.node`).
    pub node: String,
    /// Delivery attempt.
    pub attempt: u32,
    /// Wall-clock start, ns since the epoch.
    pub start: u128,
    /// Wall-clock end.
    pub end: u128,
}

impl Interval {
    fn parse(body: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(body).ok()?;
        let f: Vec<&str> = text.split('\t').collect();
        let [id, group, tenant, node, attempt, start, end] = f.as_slice() else {
            return None;
        };
        Some(Self {
            id: (*id).to_owned(),
            group: (*group).to_owned(),
            tenant: (*tenant).to_owned(),
            node: (*node).to_owned(),
            attempt: attempt.parse().ok()?,
            start: start.parse().ok()?,
            end: end.parse().ok()?,
        })
    }
}

/// A published message.
#[derive(Debug, Clone)]
pub struct Published {
    /// Group id.
    pub group: String,
    /// Call duration asked for.
    pub ms: u64,
    /// Its slot.
    pub slot: u32,
    /// Faults that may legitimately spend one of its deliveries (kill -9,
    /// broker cut, fence) while it was outstanding.
    pub exposure: u32,
    /// Wall clock when it was published (just before the publish), ns since
    /// the epoch, as the guest's interval reports.
    pub at: u128,
}

/// A dead letter of a soak message.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// Message id.
    pub id: String,
    /// Message type.
    pub message_type: String,
    /// `weir-dead-letter-reason`.
    pub reason: String,
    /// `weir-error`.
    pub error: String,
}

/// Everything the soak knows.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Wall-clock ns of each kill -9 the chaos loop made.
    pub kills: Vec<u128>,
    /// Confirmed publishes by id.
    pub published: HashMap<String, Published>,
    /// Publishes whose confirm never came (may or may not be on the broker).
    pub unconfirmed: HashSet<String>,
    intervals: HashSet<Interval>,
    /// Ids with at least one interval.
    pub handled: HashSet<String>,
    /// `soak.call` messages seen on slot subjects/keys (first deliveries and
    /// RabbitMQ retries).
    pub calls_seen: u64,
    /// Interval reports seen (with repeats of one report).
    pub reports_seen: u64,
    /// Malformed interval reports.
    pub malformed: u64,
    /// The live observer stopped (connection lost).
    pub observer_ended: bool,
}

impl Ledger {
    /// Record a message seen on a slot.
    pub fn saw(&mut self, m: WireMessage) {
        match m.header("weir-message-type") {
            Some("soak.call") => self.calls_seen += 1,
            Some("soak.interval") => {
                self.reports_seen += 1;
                self.add_interval(&m.body);
            }
            _ => {}
        }
    }

    /// Record a message re-read from a stream at the end (only intervals count).
    pub fn saw_backfill(&mut self, m: WireMessage) {
        if m.header("weir-message-type") == Some("soak.interval") {
            self.add_interval(&m.body);
        }
    }

    fn add_interval(&mut self, body: &[u8]) {
        match Interval::parse(body) {
            Some(i) => {
                self.handled.insert(i.id.clone());
                self.intervals.insert(i);
            }
            None => self.malformed += 1,
        }
    }

    /// Distinct intervals so far.
    pub fn interval_count(&self) -> usize {
        self.intervals.len()
    }

    /// Published and not handled yet.
    pub fn outstanding(&self) -> usize {
        self.published.keys().filter(|id| !self.handled.contains(*id)).count()
    }

    /// Slots of calls of at least `min_ms` published and not handled yet
    /// (running or queued: a fault aimed at their owner lands mid-call).
    pub fn long_outstanding(&self, min_ms: u64) -> Vec<u32> {
        self.published
            .iter()
            .filter(|(id, p)| p.ms >= min_ms && !self.handled.contains(*id))
            .map(|(_, p)| p.slot)
            .collect()
    }

    /// The highest exposure of a message still outstanding.
    pub fn max_exposure(&self) -> u32 {
        self.published
            .iter()
            .filter(|(id, _)| !self.handled.contains(*id))
            .map(|(_, p)| p.exposure)
            .max()
            .unwrap_or(0)
    }

    /// A fault that may spend a delivery of every outstanding message happened.
    pub fn expose_outstanding(&mut self) {
        let handled = &self.handled;
        for (_, p) in self.published.iter_mut().filter(|(id, _)| !handled.contains(*id)) {
            p.exposure += 1;
        }
    }

    /// The figures, given the dead letters read at the end.
    pub fn verdict(&self, dead: &[DeadLetter]) -> Verdict {
        let dead_ids: HashSet<&str> = dead.iter().map(|d| d.id.as_str()).collect();
        let mut lost: Vec<String> = self
            .published
            .keys()
            .filter(|id| !self.handled.contains(*id) && !dead_ids.contains(id.as_str()))
            .cloned()
            .collect();
        lost.sort();
        let mut per_id: HashMap<&str, usize> = HashMap::new();
        for i in &self.intervals {
            *per_id.entry(i.id.as_str()).or_default() += 1;
        }
        let duplicates = per_id.values().filter(|n| **n > 1).count();
        let extra_calls = per_id.values().map(|n| n.saturating_sub(1)).sum();
        // Intra-group overlap: per (tenant, group), sorted by start, a call
        // that starts before an earlier call of the group ended.
        let mut by_group: BTreeMap<(&str, &str), Vec<&Interval>> = BTreeMap::new();
        for i in &self.intervals {
            by_group
                .entry((i.tenant.as_str(), i.group.as_str()))
                .or_default()
                .push(i);
        }
        let mut overlaps = Vec::new();
        for calls in by_group.values_mut() {
            calls.sort_by_key(|c| (c.start, c.end));
            let mut latest: Option<&Interval> = None;
            for c in calls.iter() {
                if let Some(l) = latest {
                    if c.start < l.end {
                        overlaps.push(Overlap {
                            first: l.clone(),
                            second: (*c).clone(),
                        });
                    }
                    if c.end > l.end {
                        latest = Some(c);
                    }
                } else {
                    latest = Some(c);
                }
            }
        }
        let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
        for d in dead {
            *reasons.entry(d.reason.clone()).or_default() += 1;
        }
        let unconfirmed_handled = self.unconfirmed.iter().filter(|id| self.handled.contains(*id)).count();
        let mut first: HashMap<&str, u128> = HashMap::new();
        for i in &self.intervals {
            let e = first.entry(i.id.as_str()).or_insert(i.start);
            *e = (*e).min(i.start);
        }
        let latency = Latency::of(
            self.published
                .iter()
                .filter_map(|(id, p)| first.get(id.as_str()).map(|s| s.saturating_sub(p.at)))
                .collect(),
        );
        // The messages published in the AFTER_KILL after a kill -9: what a
        // publisher meets while the cluster takes over the dead node's share.
        let after_kill = Latency::of(
            self.published
                .iter()
                .filter(|(_, p)| {
                    self.kills
                        .iter()
                        .any(|k| p.at >= *k && p.at - *k < AFTER_KILL.as_nanos())
                })
                .filter_map(|(id, p)| first.get(id.as_str()).map(|s| s.saturating_sub(p.at)))
                .collect(),
        );
        Verdict {
            published: self.published.len(),
            handled: self.published.keys().filter(|id| self.handled.contains(*id)).count(),
            calls: self.intervals.len(),
            lost,
            overlaps,
            duplicates,
            extra_calls,
            dead_letters: dead.to_vec(),
            dead_reasons: reasons,
            unconfirmed: self.unconfirmed.len(),
            unconfirmed_handled,
            malformed: self.malformed,
            latency,
            after_kill,
        }
    }
}

/// Two calls of one group that ran at once.
#[derive(Debug, Clone)]
pub struct Overlap {
    /// The earlier one (the one with the latest end so far).
    pub first: Interval,
    /// The one that started before it ended.
    pub second: Interval,
}

/// The figures of a run.
#[derive(Debug)]
pub struct Verdict {
    /// Confirmed publishes.
    pub published: usize,
    /// Of those, handled at least once.
    pub handled: usize,
    /// Distinct successful calls.
    pub calls: usize,
    /// Published, never handled, not dead-lettered.
    pub lost: Vec<String>,
    /// Intra-group overlaps.
    pub overlaps: Vec<Overlap>,
    /// Messages handled more than once.
    pub duplicates: usize,
    /// Calls beyond the first of each message.
    pub extra_calls: usize,
    /// Dead letters of soak messages (all false: the soak guest never fails).
    pub dead_letters: Vec<DeadLetter>,
    /// Their reasons.
    pub dead_reasons: BTreeMap<String, usize>,
    /// Publishes without a confirm.
    pub unconfirmed: usize,
    /// Of those, handled anyway.
    pub unconfirmed_handled: usize,
    /// Interval reports that did not parse.
    pub malformed: u64,
    /// Publish → first call start, over the handled messages.
    pub latency: Option<Latency>,
    /// The same, over the messages published within [`AFTER_KILL`] after a kill -9.
    pub after_kill: Option<Latency>,
}

/// How long after a kill -9 a publish counts as "after a kill".
pub const AFTER_KILL: std::time::Duration = std::time::Duration::from_secs(10);

/// A distribution of publish → first call start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Latency {
    /// Messages measured.
    pub count: usize,
    /// Median, seconds.
    pub p50: f64,
    /// 99th percentile, seconds.
    pub p99: f64,
    /// Longest, seconds.
    pub max: f64,
}

impl Latency {
    /// The distribution of `ns` (nanoseconds); `None` when empty.
    pub fn of(mut ns: Vec<u128>) -> Option<Self> {
        if ns.is_empty() {
            return None;
        }
        ns.sort_unstable();
        let at = |q: f64| {
            let i = ((ns.len() as f64 * q).ceil() as usize).clamp(1, ns.len()) - 1;
            ns[i] as f64 / 1e9
        };
        Some(Self {
            count: ns.len(),
            p50: at(0.5),
            p99: at(0.99),
            max: at(1.0),
        })
    }
}

impl Overlap {
    /// One line for the report.
    pub fn describe(&self) -> String {
        let (a, b) = (&self.first, &self.second);
        format!(
            "tenant {} group {}: {} on {} (attempt {}) [{}..{}] and {} on {} (attempt {}) [{}..{}], {:.1} ms together",
            a.tenant,
            a.group,
            a.id,
            a.node,
            a.attempt,
            a.start,
            a.end,
            b.id,
            b.node,
            b.attempt,
            b.start,
            b.end,
            (a.end.min(b.end).saturating_sub(b.start)) as f64 / 1e6
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(id: &str, group: &str, node: &str, start: u128, end: u128) -> String {
        format!("{id}\t{group}\tt0\t{node}\t1\t{start}\t{end}")
    }

    fn ledger(calls: &[String]) -> Ledger {
        let mut l = Ledger::default();
        for c in calls {
            l.saw(WireMessage {
                headers: vec![("weir-message-type".into(), "soak.interval".into())],
                body: c.as_bytes().to_vec(),
            });
        }
        l
    }

    #[test]
    fn overlap_is_found_across_nodes_and_touching_calls_are_not_one() {
        let l = ledger(&[
            call("a", "g", "n0", 0, 100),
            call("b", "g", "n1", 100, 200), // touches: no overlap
            call("c", "g", "n0", 150, 160), // inside b
            call("d", "h", "n1", 150, 160), // another group
        ]);
        let v = l.verdict(&[]);
        assert_eq!(v.overlaps.len(), 1, "{:?}", v.overlaps);
        assert_eq!(v.overlaps[0].second.id, "c");
    }

    #[test]
    fn a_call_inside_a_long_one_after_a_short_one_overlaps() {
        // The long call keeps the latest end: the third starts inside it.
        let l = ledger(&[
            call("a", "g", "n0", 0, 1000),
            call("b", "g", "n1", 10, 20),
            call("c", "g", "n1", 500, 600),
        ]);
        assert_eq!(l.verdict(&[]).overlaps.len(), 2);
    }

    #[test]
    fn lost_duplicates_and_dead_letters() {
        let mut l = ledger(&[call("a", "g", "n0", 0, 1), call("a", "g", "n1", 5, 6)]);
        for id in ["a", "b", "c"] {
            l.published.insert(
                id.into(),
                Published {
                    group: "g".into(),
                    ms: 1,
                    slot: 0,
                    exposure: 0,
                    at: 0,
                },
            );
        }
        let dead = [DeadLetter {
            id: "c".into(),
            message_type: "soak.call".into(),
            reason: "exhausted".into(),
            error: String::new(),
        }];
        let v = l.verdict(&dead);
        assert_eq!(v.lost, vec!["b".to_owned()]);
        assert_eq!(v.duplicates, 1);
        assert_eq!(v.handled, 1);
        assert_eq!(v.dead_reasons.get("exhausted"), Some(&1));
        // "a" was published at 0 and first called at 0.
        assert_eq!(v.latency.map(|l| (l.count, l.max)), Some((1, 0.0)));
    }

    #[test]
    fn latency_percentiles() {
        let l = Latency::of((1..=100u128).map(|s| s * 1_000_000_000).collect()).unwrap();
        assert_eq!((l.count, l.p50, l.p99, l.max), (100, 50.0, 99.0, 100.0));
        assert!(Latency::of(Vec::new()).is_none());
    }
}
