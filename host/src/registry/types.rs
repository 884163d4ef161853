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

/// Settled canary messages before a threshold is judged, when not given.
pub const DEFAULT_MIN_MESSAGES: u64 = 20;

/// When a canary rolls back by itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Thresholds {
    /// Dead-lettered / settled above this rolls back (0..=1).
    #[serde(default)]
    pub max_dead_letter_rate: Option<f64>,
    /// Sent to the retry ladder / settled above this rolls back (0..=1).
    #[serde(default)]
    pub max_retry_rate: Option<f64>,
    /// Settled canary messages (cluster-wide in `postgres` and `nats-kv` modes) before a rate is judged.
    #[serde(default = "default_min_messages")]
    pub min_messages: u64,
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
        }
    }
}

impl Thresholds {
    /// Why `t` breaks a threshold, if it does.
    pub fn breached(&self, t: &Tally) -> Option<String> {
        let settled = t.settled();
        if settled == 0 || settled < self.min_messages {
            return None;
        }
        let checks = [
            ("dead-letter", self.max_dead_letter_rate, t.dead_lettered),
            ("retry", self.max_retry_rate, t.retried),
        ];
        checks.into_iter().find_map(|(what, max, n)| {
            let max = max?;
            let rate = n as f64 / settled as f64;
            (rate > max).then(|| {
                format!("{what} rate {rate:.3} ({n} of {settled} settled messages) is above the threshold {max}")
            })
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

    #[test]
    fn thresholds_judge_only_after_enough_messages() {
        let t = Thresholds {
            max_retry_rate: Some(0.5),
            min_messages: 10,
            ..Thresholds::default()
        };
        let mut tally = Tally {
            retried: 9,
            ..Tally::default()
        };
        assert_eq!(t.breached(&tally), None, "9 settled: too few to judge");
        tally.retried = 10;
        assert!(t.breached(&tally).unwrap().contains("retry rate 1.000 (10 of 10"));
        tally.handled = 10;
        assert_eq!(t.breached(&tally), None, "0.5 is not above 0.5");
        let dl = Thresholds {
            max_dead_letter_rate: Some(0.0),
            min_messages: 1,
            ..Thresholds::default()
        };
        assert!(
            dl.breached(&Tally {
                dead_lettered: 1,
                ..Tally::default()
            })
            .unwrap()
            .contains("dead-letter")
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
}
