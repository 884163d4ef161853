//! A cluster-wide ledger for tests that run several `weir` processes: each
//! process appends every guest call (group, message id, start and end on the
//! machine's monotonic clock) and every settlement to a journal file of its
//! own; [`check`] reads all the files and finds two calls of one group whose
//! intervals intersect, wherever they ran.
//!
//! Intervals instead of claim-and-release: processes share no memory, but
//! they share `CLOCK_MONOTONIC`. A call's interval is taken inside the
//! lane's exclusive section (after the lane admitted it, before it settles),
//! so two intervals of one group that intersect are two calls that ran at
//! once — the same fact the in-process [`Ledger`](crate::observe::ledger::Ledger)
//! detects with a claim.
//!
//! Enabled by `weir run` when the environment variable [`ENV`] names a file.
//! Every line is written with one `write` on an `O_APPEND` file, so a
//! process killed with SIGKILL leaves complete lines behind (at most the
//! call it was in is missing, which is the truth: it never finished).

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::Path;

use anyhow::Context as _;
use parking_lot::Mutex;

use super::CallObserver;
use crate::envelope::Envelope;
use crate::outcome::Outcome;
use crate::outcome::SettleObserver;

/// Environment variable naming the journal file of a `weir run` process.
pub const ENV: &str = "WEIR_JOURNAL";

/// Nanoseconds on `CLOCK_MONOTONIC`, comparable between processes on one machine.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec and CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

thread_local! {
    /// Start of the call running on this worker thread (calls are synchronous
    /// on a worker, so `before` and `after` of one call share the thread).
    static STARTED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Appends calls and settlements of one process to a file. See the module docs.
pub struct Journal {
    node: String,
    file: Mutex<File>,
}

impl Journal {
    /// Open (create, append) `path` for node `node`.
    pub fn open(path: &Path, node: &str) -> anyhow::Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("{ENV}={}: cannot open the journal", path.display()))?;
        Ok(Self {
            node: node.replace(['\t', '\n'], " "),
            file: Mutex::new(file),
        })
    }

    fn line(&self, line: &str) {
        if let Err(e) = self.file.lock().write_all(line.as_bytes()) {
            tracing::error!(error = %e, "journal: write failed; the cluster ledger is incomplete");
        }
    }
}

impl CallObserver for Journal {
    fn before(&self, _msg: &Envelope) {
        STARTED.with(|s| s.set(monotonic_ns()));
    }

    fn after(&self, msg: &Envelope) {
        let end = monotonic_ns();
        let start = STARTED.with(std::cell::Cell::get);
        let group = msg.group().unwrap_or("-");
        self.line(&format!("call\t{}\t{group}\t{}\t{start}\t{end}\n", self.node, msg.id));
    }
}

impl SettleObserver for Journal {
    fn settled(&self, id: &str, outcome: Outcome) {
        let label = match outcome {
            Outcome::Handled => "handled".to_owned(),
            Outcome::RetryScheduled => "retry-scheduled".to_owned(),
            Outcome::DeadLettered(r) => format!("dead-lettered:{}", r.as_str()),
            Outcome::Stranded => "stranded".to_owned(),
            Outcome::Uncertain => "uncertain".to_owned(),
            Outcome::Requeued => "requeued".to_owned(),
            Outcome::Released => "released".to_owned(),
            Outcome::Deduplicated => "deduplicated".to_owned(),
        };
        self.line(&format!("settle\t{}\t{id}\t{label}\n", self.node));
    }
}

/// One guest call read back from a journal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// The node that ran it.
    pub node: String,
    /// Its group (`None`: unordered).
    pub group: Option<String>,
    /// Message id.
    pub id: String,
    /// Monotonic start, ns.
    pub start: u64,
    /// Monotonic end, ns.
    pub end: u64,
}

/// Two calls of one group that ran at once.
#[derive(Debug, Clone)]
pub struct Overlap {
    /// The group.
    pub group: String,
    /// The call that started first.
    pub first: Call,
    /// The call that started while `first` ran.
    pub second: Call,
}

/// What the journals of a cluster run say.
#[derive(Debug, Default)]
pub struct Report {
    /// Every call, in file order.
    pub calls: Vec<Call>,
    /// Settlements: message id → (node, outcome label), last one wins.
    pub settled: HashMap<String, (String, String)>,
    /// Intra-group overlaps, anywhere in the cluster.
    pub overlaps: Vec<Overlap>,
}

impl Report {
    /// Nodes that ran at least one call.
    pub fn nodes(&self) -> HashSet<&str> {
        self.calls.iter().map(|c| c.node.as_str()).collect()
    }

    /// Message ids whose last settlement was `handled`.
    pub fn handled(&self) -> HashSet<&str> {
        self.settled
            .iter()
            .filter(|(_, (_, o))| o == "handled")
            .map(|(id, _)| id.as_str())
            .collect()
    }

    /// Group → the nodes that ran calls of it.
    pub fn nodes_per_group(&self) -> HashMap<&str, HashSet<&str>> {
        let mut m: HashMap<&str, HashSet<&str>> = HashMap::new();
        for c in &self.calls {
            if let Some(g) = &c.group {
                m.entry(g.as_str()).or_default().insert(c.node.as_str());
            }
        }
        m
    }
}

/// Read journals and find every intra-group overlap.
pub fn check(paths: &[impl AsRef<Path>]) -> anyhow::Result<Report> {
    let mut report = Report::default();
    for path in paths {
        let path = path.as_ref();
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("reading journal {}", path.display())),
        };
        // A last line without its newline is still being written (a read
        // racing a write can see part of it) or was cut by kill -9: not
        // a line yet. Every complete line must parse.
        let complete = text.rfind('\n').map_or("", |end| &text[..=end]);
        for (n, line) in complete.lines().enumerate() {
            let f: Vec<&str> = line.split('\t').collect();
            let bad = || anyhow::anyhow!("{}:{}: not a journal line: {line:?}", path.display(), n + 1);
            match f.as_slice() {
                ["call", node, group, id, start, end] => report.calls.push(Call {
                    node: (*node).to_owned(),
                    group: (*group != "-").then(|| (*group).to_owned()),
                    id: (*id).to_owned(),
                    start: start.parse().map_err(|_| bad())?,
                    end: end.parse().map_err(|_| bad())?,
                }),
                ["settle", node, id, outcome] => {
                    report
                        .settled
                        .insert((*id).to_owned(), ((*node).to_owned(), (*outcome).to_owned()));
                }
                _ => return Err(bad()),
            }
        }
    }
    report.overlaps = overlaps(&report.calls);
    Ok(report)
}

/// Calls of one group whose intervals intersect: sort each group's calls by
/// start; a call that starts before the latest end so far overlaps the call
/// that holds that end.
pub fn overlaps(calls: &[Call]) -> Vec<Overlap> {
    let mut by_group: HashMap<&str, Vec<&Call>> = HashMap::new();
    for c in calls {
        if let Some(g) = &c.group {
            by_group.entry(g.as_str()).or_default().push(c);
        }
    }
    let mut found = Vec::new();
    for (group, mut cs) in by_group {
        cs.sort_by_key(|c| (c.start, c.end));
        let mut holder: Option<&Call> = None;
        for c in cs {
            match holder {
                Some(h) if c.start < h.end => {
                    found.push(Overlap {
                        group: group.to_owned(),
                        first: h.clone(),
                        second: c.clone(),
                    });
                    if c.end > h.end {
                        holder = Some(c);
                    }
                }
                _ => holder = Some(c),
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(node: &str, group: &str, start: u64, end: u64) -> Call {
        Call {
            node: node.into(),
            group: Some(group.into()),
            id: format!("{node}-{start}"),
            start,
            end,
        }
    }

    #[test]
    fn back_to_back_calls_do_not_overlap() {
        let calls = [call("a", "g", 0, 10), call("b", "g", 10, 20), call("a", "g", 20, 30)];
        assert!(overlaps(&calls).is_empty());
    }

    #[test]
    fn intersecting_calls_of_one_group_overlap_across_nodes() {
        let calls = [call("a", "g", 0, 10), call("b", "g", 9, 20), call("a", "h", 0, 30)];
        let o = overlaps(&calls);
        assert_eq!(o.len(), 1);
        assert_eq!((o[0].first.node.as_str(), o[0].second.node.as_str()), ("a", "b"));
    }

    #[test]
    fn a_long_call_overlaps_every_call_inside_it() {
        let calls = [call("a", "g", 0, 100), call("b", "g", 10, 20), call("c", "g", 30, 40)];
        assert_eq!(overlaps(&calls).len(), 2);
    }

    /// A reader racing a write sees part of the last line (a cluster test
    /// failed on `"settle\tnode-1\t01a23c18-…"`): that part is not read;
    /// a complete line that does not parse still is an error.
    #[test]
    fn a_last_line_still_being_written_is_not_read_yet() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.journal");
        let j = Journal::open(&path, "node-a").unwrap();
        j.settled("m1", Outcome::Handled);
        let whole = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, format!("{whole}settle\tnode-a\tm2")).unwrap();
        assert_eq!(check(&[&path]).unwrap().handled(), HashSet::from(["m1"]));
        std::fs::write(&path, format!("{whole}settle\tnode-a\tm2\n")).unwrap();
        assert!(check(&[&path]).is_err(), "a complete line that does not parse");
    }

    #[test]
    fn journal_round_trips_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.journal");
        let j = Journal::open(&path, "node-a").unwrap();
        let mut msg = Envelope {
            id: "m1".into(),
            message_type: "ok".into(),
            group_id: Some("g1".into()),
            tenant_id: None,
            attempt: 1,
            headers: vec![],
            payload: vec![],
        };
        j.before(&msg);
        j.after(&msg);
        msg.id = "m2".into();
        msg.group_id = None;
        j.before(&msg);
        j.after(&msg);
        j.settled("m1", Outcome::Handled);
        let r = check(&[&path, &dir.path().join("missing")]).unwrap();
        assert_eq!(r.calls.len(), 2);
        assert_eq!(r.calls[0].group.as_deref(), Some("g1"));
        assert!(r.calls[0].start <= r.calls[0].end && r.calls[0].start > 0);
        assert_eq!(r.calls[1].group, None);
        assert_eq!(r.handled(), HashSet::from(["m1"]));
        assert!(r.overlaps.is_empty());
    }
}
