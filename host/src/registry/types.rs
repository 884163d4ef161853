//! What the registry's callers see: grants, activations, deploy answers and
//! errors, and who is asking.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::observe::stats::HandlerMetrics;
use sha2::Digest as _;

/// Capabilities of one version beyond clocks and random.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grants {
    /// Host environment variables the guest sees (names; values are read at load).
    #[serde(default)]
    pub env: Vec<String>,
    /// Host directories the guest may read.
    #[serde(default)]
    pub dirs: Vec<DirGrant>,
}

/// A read-only directory grant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirGrant {
    /// The path the guest sees.
    pub guest: String,
    /// The host directory.
    pub host: PathBuf,
}

/// One deploy or rollback that made a version current.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Activation {
    /// Increasing per handler (per cluster in `postgres` and `nats-kv` modes).
    pub seq: i64,
    /// sha256 of the component, hex.
    pub digest: String,
    /// Component size in bytes.
    pub size: u64,
    /// Milliseconds since the Unix epoch.
    pub at_ms: i64,
    /// `config`, `admin`, `watch` or `rollback`.
    pub source: String,
    /// The node that made it.
    pub node: String,
    /// The activation it replaced.
    pub previous: Option<i64>,
    /// What the version was granted.
    #[serde(default)]
    pub grants: Grants,
}

/// Why a deploy or rollback was refused. The running version stays.
#[derive(Debug, thiserror::Error)]
pub enum DeployError {
    /// No `[[handler]]` of that name.
    #[error("no handler named `{0}` is configured on this node")]
    UnknownHandler(String),
    /// A tenant token asked for a handler that is not its tenant's, or for
    /// none at all: both answer alike (404, the same text).
    #[error("no handler named `{0}` is visible to this token (a tenant token sees only its own tenant's handlers)")]
    NotVisible(String),
    /// The caller may not change this handler, or asked for grants beyond its tenant's.
    #[error("{0}")]
    Forbidden(String),
    /// Larger than `node.max_component_size`.
    #[error("component is {size} bytes; node.max_component_size allows at most {max}")]
    TooLarge {
        /// Upload size.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// It does not compile, is not a component, exports another world or cannot instantiate.
    #[error("{0}")]
    Invalid(String),
    /// A rollback with nothing to roll back to, or a promote with no canary.
    #[error("{0}")]
    NoPrevious(String),
    /// The change clashes with the handler's state (a canary runs already).
    #[error("{0}")]
    Conflict(String),
    /// The data directory or the database failed; nothing was swapped.
    #[error("{0:#}")]
    Store(anyhow::Error),
}

/// The component a deploy brings.
#[derive(Debug)]
pub enum Upload {
    /// In memory.
    Bytes(Vec<u8>),
    /// In a file of `size` bytes (the admin listener's spooled upload).
    File {
        /// The file.
        path: PathBuf,
        /// Its length.
        size: usize,
    },
}

impl Upload {
    pub(super) fn size(&self) -> usize {
        match self {
            Upload::Bytes(b) => b.len(),
            Upload::File { size, .. } => *size,
        }
    }
}

/// What a deploy or rollback did.
#[derive(Debug, Clone, Serialize)]
pub struct Deployed {
    /// The handler.
    pub handler: String,
    /// The version now current.
    pub digest: String,
    /// The version it replaced.
    pub previous: Option<String>,
    /// False when the upload was the current version already.
    pub swapped: bool,
    /// Where the version is kept: `data-dir`, `database` or `memory` (lost at restart).
    pub kept_in: &'static str,
    /// Milliseconds from receiving the request to the swap (validation and compilation).
    pub took_ms: u64,
    /// Milliseconds spent compiling the component; `null` when it was not
    /// compiled (the compiled-code cache had it, or nothing was swapped).
    pub compiled_ms: Option<u64>,
}

/// A handler as `GET /v1/handlers` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct HandlerInfo {
    /// Its name.
    pub name: String,
    /// Its topology.
    pub topology: String,
    /// The tenant it is bound to (`null`: any tenant without a binding of its own).
    pub tenant: Option<String>,
    /// The current version.
    pub current: Activation,
    /// Earlier activations, newest first (what rollbacks would walk back to).
    pub history: Vec<Activation>,
    /// The canary running on some of its slots, with its live comparison.
    pub canary: Option<CanaryView>,
    /// How its last canary ended (as this node saw it).
    pub last_canary: Option<Ended>,
}

/// sha256 of `bytes`, hex.
pub fn digest(bytes: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(bytes))
}

/// Who is asking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// The operator token: everything.
    Operator,
    /// A tenant token: that tenant's handlers only.
    Tenant(String),
}

// Canaries by slot (see [`super::canary`]): what is stored and shown.

/// Settled messages (on each side, in the default mode) before a threshold is judged, when not given.
pub const DEFAULT_MIN_MESSAGES: u64 = 20;

/// Standard errors by which the canary's rate must exceed the stable
/// version's before a threshold counts as crossed (a one-sided pooled
/// two-proportion z-test): a canary no worse than the stable version passes
/// it by chance about once in 740 looks.
pub const MIN_Z: f64 = 3.0;

/// How a canary's rates are judged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ThresholdMode {
    /// Against the stable version: the canary's rate must exceed the stable
    /// version's by more than the threshold, with at least `min_messages`
    /// settled on each side and the difference at least [`MIN_Z`] standard
    /// errors. Messages every version fails (poison) weigh on both sides alike.
    #[default]
    Relative,
    /// The canary's own rate alone, over at least `min_messages` of its
    /// messages (the rule before issue 32). Any publisher can trip it by
    /// sending messages every version fails to the canary's slots; for a
    /// stable version with too little traffic to compare with.
    Absolute,
}

impl ThresholdMode {
    /// `relative` or `absolute`.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "relative" => Ok(ThresholdMode::Relative),
            "absolute" => Ok(ThresholdMode::Absolute),
            other => Err(format!(
                "threshold mode {other:?}: accepted: relative (against the stable version, the default) or absolute"
            )),
        }
    }
}

/// When a canary rolls back by itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Thresholds {
    /// The canary's dead-letter rate (dead-lettered / settled) above the
    /// stable version's by more than this rolls back (0..=1).
    #[serde(default)]
    pub max_dead_letter_rate: Option<f64>,
    /// The canary's retry rate (sent to the retry ladder / settled) above
    /// the stable version's by more than this rolls back (0..=1).
    #[serde(default)]
    pub max_retry_rate: Option<f64>,
    /// Settled messages on each side (cluster-wide in `postgres` and
    /// `nats-kv` modes; the canary's alone in `absolute` mode) before a rate is judged.
    #[serde(default = "default_min_messages")]
    pub min_messages: u64,
    /// How the rates are judged; records written before it existed are `relative`.
    #[serde(default)]
    pub mode: ThresholdMode,
}

fn default_min_messages() -> u64 {
    DEFAULT_MIN_MESSAGES
}

impl Default for Thresholds {
    fn default() -> Self {
        Self {
            max_dead_letter_rate: None,
            max_retry_rate: None,
            min_messages: DEFAULT_MIN_MESSAGES,
            mode: ThresholdMode::default(),
        }
    }
}

/// A crossed threshold: which rate, and why, with the counts that decided it.
#[derive(Debug, Clone, PartialEq)]
pub struct Breach {
    /// The retry rate (`true`) or the dead-letter rate.
    pub retried: bool,
    /// The figures, for the rollback's reason.
    pub why: String,
}

impl Breach {
    /// The rollback's reason: the figures, and `ids`, the last canary
    /// messages of the breaching kind that node `node` saw fail.
    pub fn reason(&self, node: &str, ids: &[String]) -> String {
        let kind = if self.retried { "retried" } else { "dead-lettered" };
        let ids = if ids.is_empty() {
            format!("this node ({node}) saw none of the canary's {kind} messages itself")
        } else {
            format!(
                "the last {} messages the canary {kind} on this node ({node}): {}",
                ids.len(),
                ids.join(", ")
            )
        };
        format!("threshold: {}; {ids}", self.why)
    }
}

impl Thresholds {
    /// The threshold `canary` crosses against `stable`, if any (see [`ThresholdMode`]).
    pub fn breached(&self, canary: &Tally, stable: &Tally) -> Option<Breach> {
        let checks = [
            (
                false,
                "dead-letter",
                self.max_dead_letter_rate,
                canary.dead_lettered,
                stable.dead_lettered,
            ),
            (true, "retry", self.max_retry_rate, canary.retried, stable.retried),
        ];
        let (nc, ns) = (canary.settled(), stable.settled());
        let enough = |n: u64| n > 0 && n >= self.min_messages;
        checks.into_iter().find_map(|(retried, what, max, xc, xs)| {
            let max = max?;
            let why = match self.mode {
                ThresholdMode::Absolute => absolute(what, max, xc, nc, enough(nc))?,
                ThresholdMode::Relative if enough(nc) && enough(ns) => relative(what, max, (xc, nc), (xs, ns))?,
                ThresholdMode::Relative => return None,
            };
            Some(Breach { retried, why })
        })
    }

    /// Rates must be within 0..=1.
    pub fn check(&self) -> Result<(), String> {
        for (key, v) in [
            ("max_dead_letter_rate", self.max_dead_letter_rate),
            ("max_retry_rate", self.max_retry_rate),
        ] {
            if let Some(v) = v
                && !(0.0..=1.0).contains(&v)
            {
                return Err(format!("{key} = {v}: accepted: a rate from 0 to 1, e.g. 0.05"));
            }
        }
        Ok(())
    }
}

/// The old rule: the canary's rate `x / n` above `max`.
fn absolute(what: &str, max: f64, x: u64, n: u64, enough: bool) -> Option<String> {
    let rate = x as f64 / n as f64;
    (enough && rate > max).then(|| {
        format!(
            "{what} rate {rate:.3} ({x} of {n} settled messages) is above the threshold {max} \
             (threshold mode absolute: the stable version's rate is not compared)"
        )
    })
}

/// The canary's rate `xc / nc` above the stable version's `xs / ns` by more
/// than `max`, and by at least [`MIN_Z`] standard errors of the difference.
fn relative(what: &str, max: f64, (xc, nc): (u64, u64), (xs, ns): (u64, u64)) -> Option<String> {
    let (pc, ps) = (xc as f64 / nc as f64, xs as f64 / ns as f64);
    let diff = pc - ps;
    if diff <= max {
        return None;
    }
    // diff > 0, so the rates differ and the pooled rate is inside (0, 1).
    let pooled = (xc + xs) as f64 / (nc + ns) as f64;
    let se = (pooled * (1.0 - pooled) * (1.0 / nc as f64 + 1.0 / ns as f64)).sqrt();
    let z = if se > 0.0 { diff / se } else { f64::INFINITY };
    (z >= MIN_Z).then(|| {
        format!(
            "the canary's {what} rate {pc:.3} ({xc} of {nc} settled messages) is {diff:.3} above the stable \
             version's {ps:.3} ({xs} of {ns}): more than the threshold {max}, by {z:.1} standard errors \
             (at least {MIN_Z} are needed)"
        )
    })
}

/// A canary as stored and shown.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Canary {
    /// Increasing (per handler in a coordinated cluster): tells one canary from the next.
    pub id: i64,
    /// sha256 of the component, hex.
    pub digest: String,
    /// The slots of the handler's topology it runs on, ascending.
    pub slots: Vec<u32>,
    /// What the version was granted.
    #[serde(default)]
    pub grants: Grants,
    /// When it rolls back by itself.
    #[serde(default)]
    pub thresholds: Thresholds,
    /// Milliseconds since the Unix epoch.
    pub started_ms: i64,
    /// The node that started it.
    pub node: String,
}

/// What one version's calls did, as counted since a canary began.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Tally {
    /// Handled (success, acked).
    pub handled: u64,
    /// Sent to the retry ladder.
    pub retried: u64,
    /// Dead-lettered.
    pub dead_lettered: u64,
    /// Other outcomes (released, requeued, deduplicated, …).
    pub other: u64,
    /// Calls (a batch is one).
    pub calls: u64,
    /// Their durations, summed, seconds.
    pub call_seconds: f64,
}

impl Tally {
    /// What `m` counted so far.
    pub fn of(m: &HandlerMetrics) -> Self {
        let mut t = Tally::default();
        for (label, n) in m.outcomes.snapshot() {
            match label {
                "handled" => t.handled += n,
                "retry-scheduled" => t.retried += n,
                "dead-lettered" => t.dead_lettered += n,
                _ => t.other += n,
            }
        }
        let (sum, calls, _) = m.durations();
        t.calls = calls;
        t.call_seconds = sum;
        t
    }

    /// What was counted after `base`.
    pub fn since(self, base: Tally) -> Self {
        Tally {
            handled: self.handled.saturating_sub(base.handled),
            retried: self.retried.saturating_sub(base.retried),
            dead_lettered: self.dead_lettered.saturating_sub(base.dead_lettered),
            other: self.other.saturating_sub(base.other),
            calls: self.calls.saturating_sub(base.calls),
            call_seconds: (self.call_seconds - base.call_seconds).max(0.0),
        }
    }

    /// The sum of two tallies (two nodes').
    pub fn plus(self, o: Tally) -> Self {
        Tally {
            handled: self.handled + o.handled,
            retried: self.retried + o.retried,
            dead_lettered: self.dead_lettered + o.dead_lettered,
            other: self.other + o.other,
            calls: self.calls + o.calls,
            call_seconds: self.call_seconds + o.call_seconds,
        }
    }

    /// Handled, retried or dead-lettered.
    pub fn settled(&self) -> u64 {
        self.handled + self.retried + self.dead_lettered
    }

    /// The figures people compare.
    pub fn rates(&self) -> Rates {
        let settled = self.settled();
        let rate = |n: u64| (settled > 0).then(|| n as f64 / settled as f64);
        Rates {
            settled,
            handled_rate: rate(self.handled),
            retry_rate: rate(self.retried),
            dead_letter_rate: rate(self.dead_lettered),
            mean_call_ms: (self.calls > 0).then(|| self.call_seconds * 1e3 / self.calls as f64),
        }
    }
}

/// A tally's rates.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Rates {
    /// Handled + retried + dead-lettered.
    pub settled: u64,
    /// Of `settled`; `null` before any.
    pub handled_rate: Option<f64>,
    /// Of `settled`.
    pub retry_rate: Option<f64>,
    /// Of `settled`.
    pub dead_letter_rate: Option<f64>,
    /// Mean call duration, ms; `null` before any call.
    pub mean_call_ms: Option<f64>,
}

/// One side of the comparison.
#[derive(Debug, Clone, Serialize)]
pub struct Side {
    /// The version.
    pub digest: String,
    /// Its counts.
    #[serde(flatten)]
    pub tally: Tally,
    /// Its rates.
    #[serde(flatten)]
    pub rates: Rates,
}

impl Side {
    pub(super) fn new(digest: &str, tally: Tally) -> Self {
        Self {
            digest: digest.to_owned(),
            tally,
            rates: tally.rates(),
        }
    }
}

/// The canary against the stable version since it began.
#[derive(Debug, Clone, Serialize)]
pub struct Compare {
    /// The canary's calls.
    pub canary: Side,
    /// The stable version's calls (on the other slots).
    pub stable: Side,
    /// Whose counts these are: `cluster` (every node's, `postgres` and `nats-kv` modes) or `node`.
    pub scope: &'static str,
}

/// A running canary, as `GET /v1/handlers/{name}` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct CanaryView {
    /// The canary.
    #[serde(flatten)]
    pub canary: Canary,
    /// Slots in the handler's topology.
    pub topology_slots: u32,
    /// Live comparison.
    pub compare: Compare,
}

/// How the last canary of a handler ended.
#[derive(Debug, Clone, Serialize)]
pub struct Ended {
    /// The canary's version.
    pub digest: String,
    /// The slots it ran on.
    pub slots: Vec<u32>,
    /// `promoted` or `rolled-back`.
    pub outcome: &'static str,
    /// `operator`, or the threshold that was crossed.
    pub reason: String,
    /// Milliseconds since the Unix epoch.
    pub at_ms: i64,
    /// The comparison when it ended.
    pub compare: Option<Compare>,
}

/// What a canary deploy did.
#[derive(Debug, Clone, Serialize)]
pub struct CanaryStarted {
    /// The handler.
    pub handler: String,
    /// The canary's version.
    pub digest: String,
    /// The stable version the other slots keep.
    pub stable: String,
    /// Its slots.
    pub slots: Vec<u32>,
    /// Slots in the handler's topology.
    pub topology_slots: u32,
    /// Its thresholds.
    pub thresholds: Thresholds,
    /// Where it is kept: `data-dir`, `database` or `memory`.
    pub kept_in: &'static str,
    /// Milliseconds from the request to the swap.
    pub took_ms: u64,
    /// Milliseconds compiling; `null` from the compiled-code cache.
    pub compiled_ms: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tally(handled: u64, retried: u64, dead_lettered: u64) -> Tally {
        Tally {
            handled,
            retried,
            dead_lettered,
            ..Tally::default()
        }
    }

    #[test]
    fn thresholds_judge_only_after_enough_messages_on_both_sides() {
        let t = Thresholds {
            max_retry_rate: Some(0.5),
            min_messages: 10,
            ..Thresholds::default()
        };
        let stable = tally(30, 0, 0);
        assert_eq!(
            t.breached(&tally(0, 9, 0), &stable),
            None,
            "9 settled: too few to judge"
        );
        let b = t.breached(&tally(0, 10, 0), &stable).unwrap();
        assert!(b.retried);
        assert!(
            b.why.contains(
                "retry rate 1.000 (10 of 10 settled messages) is 1.000 above the stable version's 0.000 (0 of 30)"
            ),
            "{}",
            b.why
        );
        assert_eq!(
            t.breached(&tally(0, 10, 0), &tally(9, 0, 0)),
            None,
            "the stable side: too few"
        );
        assert_eq!(
            t.breached(&tally(10, 10, 0), &stable),
            None,
            "0.5 above is not above 0.5"
        );
        let dl = Thresholds {
            max_dead_letter_rate: Some(0.0),
            min_messages: 1,
            ..Thresholds::default()
        };
        let b = dl.breached(&tally(0, 0, 10), &tally(10, 0, 0)).unwrap();
        assert!(!b.retried && b.why.contains("dead-letter"), "{}", b.why);
        assert!(
            b.reason("n1", &["m-1".into(), "m-2".into()])
                .ends_with("the last 2 messages the canary dead-lettered on this node (n1): m-1, m-2")
        );
        assert!(
            Thresholds {
                max_retry_rate: Some(1.5),
                ..Thresholds::default()
            }
            .check()
            .is_err()
        );
    }

    #[test]
    fn equal_rates_never_roll_back_and_the_old_absolute_rule_does() {
        // Issue 32: 15 poison messages of 25 on each side (0.6 against 0.6).
        let (canary, stable) = (tally(10, 0, 15), tally(10, 0, 15));
        let mut t = Thresholds {
            max_dead_letter_rate: Some(0.2),
            min_messages: 10,
            ..Thresholds::default()
        };
        assert_eq!(t.breached(&canary, &stable), None);
        t.mode = ThresholdMode::Absolute;
        let b = t.breached(&canary, &stable).unwrap();
        assert!(
            b.why.contains("dead-letter rate 0.600 (15 of 25 settled messages)"),
            "{}",
            b.why
        );
    }

    #[test]
    fn a_difference_must_be_significant_as_well_as_above_the_threshold() {
        let t = Thresholds {
            max_dead_letter_rate: Some(0.1),
            min_messages: 5,
            ..Thresholds::default()
        };
        // 3 of 5 against 1 of 5: 0.4 above, but z = 1.3.
        assert_eq!(t.breached(&tally(2, 0, 3), &tally(4, 0, 1)), None);
        // 30 of 50 against 10 of 50: 0.4 above, z = 4.1.
        let b = t.breached(&tally(20, 0, 30), &tally(40, 0, 10)).unwrap();
        assert!(b.why.contains("by 4.1 standard errors"), "{}", b.why);
        // Every canary message failed, none of the stable version's.
        assert!(t.breached(&tally(0, 0, 20), &tally(20, 0, 0)).is_some());
    }

    #[test]
    fn old_records_read_as_relative_and_modes_parse() {
        let old: Thresholds = serde_json::from_str(r#"{"max_retry_rate":0.2,"min_messages":5}"#).unwrap();
        assert_eq!(old.mode, ThresholdMode::Relative);
        assert_eq!(ThresholdMode::parse("absolute"), Ok(ThresholdMode::Absolute));
        assert!(ThresholdMode::parse("abs").unwrap_err().contains("accepted: relative"));
        assert_eq!(serde_json::to_value(ThresholdMode::Absolute).unwrap(), "absolute");
    }
}
