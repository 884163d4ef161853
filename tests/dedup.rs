//! `handler.dedup` against a kill -9 between a successful call and its ack,
//! many times over, with real `weir run` processes.
//!
//! Each round starts a node with `WEIR_FAULT_KILL_BEFORE_ACK=3` and
//! publishes five messages of one group: the node handles them and sends
//! itself SIGKILL right before its third ack, after the calls succeeded and
//! their dedup records were written. The next node (after
//! the dead one's lease ran out) is handed the unacked message again. With
//! dedup on, it is acked without a call: every message runs exactly once,
//! and each kill shows up as a `deduplicated` settlement. The red baseline
//! is the same run without dedup: every kill costs a second call.
//!
//! Issue 33: copies of one message queued together in one job run once
//! (items 1; the red baseline without dedup runs each twice), and a kill -9
//! in the middle of a job costs no second call of the calls before it
//! (item 2: each record is written as soon as its call succeeded, not after
//! the whole job; without dedup each such call runs again).
//!
//! On RabbitMQ with `cluster.mode = "postgres"` (records in `weir_dedup`)
//! and on NATS with `cluster.mode = "nats-kv"` (records in the bucket
//! beside the coordination bucket).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../host/tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::cluster::{self, Cluster};
use common::nats::Topo as NatsTopo;
use common::pg::TestDb;
use common::rabbit::{Topo, url};
use common::registry::{self, KvBucket, Registry};
use weir::envelope::Envelope;
use weir::observe::journal::Report;
use weir::partition;
use weir::runtime::fault::{KILL_BEFORE_ACK, KILL_BEFORE_CALL};
use weir::transport::nats::Nats;
use weir::transport::rabbitmq::RabbitMq;

const SLOTS: u32 = 2;
const LEASE: Duration = Duration::from_secs(1);
/// Nodes killed between a success and its ack.
const KILLS: usize = 8;
/// Messages published for each node.
const PER_ROUND: usize = 5;
/// The one group: one lane, so no other call can be between its end and
/// its record when the kill comes (that gap is not what dedup closes).
const GROUP: &str = "g0";

enum Broker {
    Rabbit(Topo),
    Nats(NatsTopo),
}

impl Broker {
    fn name(&self) -> &str {
        match self {
            Self::Rabbit(t) => &t.name,
            Self::Nats(t) => &t.name,
        }
    }

    fn config(&self, reg: &dyn Registry, node: &str, dedup: bool) -> String {
        let coordination = format!("{}lease = \"{}ms\"\n", registry::cluster(&reg.url()), LEASE.as_millis());
        let (kind, url, retry) = match self {
            Self::Rabbit(_) => ("rabbitmq", url(), ""),
            // JetStream redelivers what a dead node held after AckWait (the
            // first rung): keep it short.
            Self::Nats(t) => (
                "nats",
                t.url.clone(),
                "[topology.retry]\nladder = [\"1s\"]\nmax_deliver = 100\n",
            ),
        };
        let mut text = cluster::node_config(node, kind, &url, 8, &coordination, self.name(), SLOTS);
        if dedup {
            text.push_str("dedup = { window = \"10m\" }\n");
        }
        text + retry
    }

    fn publish(&self, msgs: &[Envelope]) {
        let slot = |m: &Envelope| partition::slot_for(m.group(), &m.id, SLOTS);
        match self {
            Self::Rabbit(t) => cluster::publish(
                || RabbitMq::new(url(), "weir dedup-test publisher"),
                &t.name,
                msgs,
                slot,
            ),
            Self::Nats(t) => cluster::publish(
                || Nats::new(t.url.clone(), "weir dedup-test publisher"),
                &t.name,
                msgs,
                slot,
            ),
        }
    }
}

/// What a run saw.
struct Seen {
    /// Messages called more than once.
    duplicates: usize,
    /// Calls beyond the first, over every message.
    extra_calls: usize,
    /// Settlements `deduplicated`.
    deduplicated: usize,
    /// Nodes that killed themselves before an ack.
    kills: usize,
}

/// Wait until every id in `ids` was settled `handled` or `deduplicated`.
fn wait_settled(cluster: &Cluster, ids: &[String], timeout: Duration) -> Report {
    let start = Instant::now();
    loop {
        let report = cluster.report();
        let missing = ids
            .iter()
            .filter(|id| {
                !report
                    .settled
                    .get(id.as_str())
                    .is_some_and(|(_, o)| o == "handled" || o == "deduplicated")
            })
            .count();
        if missing == 0 {
            return report;
        }
        assert!(
            start.elapsed() < timeout,
            "{missing} of {} messages never settled within {timeout:?}; logs:\n{}",
            ids.len(),
            cluster
                .nodes
                .iter()
                .map(|n| format!("--- {}:\n{}", n.name, n.log()))
                .collect::<Vec<_>>()
                .join("\n")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn kill_between_success_and_ack(broker: &Broker, reg: &dyn Registry, dedup: bool) -> Seen {
    let mut msgs: Vec<Envelope> = Vec::new();
    let mut cluster = Cluster::default();
    let mut kills = 0;
    for round in 0..KILLS {
        let name = format!("node-{round}");
        cluster.start_with_env(&name, &broker.config(reg, &name, dedup), &[(KILL_BEFORE_ACK, "3")]);
        // Fresh messages each round (the first node declared the topology),
        // so the node reaches its third ack whatever dedup skips.
        let fresh: Vec<Envelope> = (0..PER_ROUND)
            .map(|_| common::message("slow", Some(GROUP), b"1"))
            .collect();
        broker.publish(&fresh);
        msgs.extend(fresh);
        let node = cluster.nodes.last_mut().unwrap();
        let status = node.wait(Duration::from_secs(60));
        assert!(
            std::os::unix::process::ExitStatusExt::signal(&status) == Some(libc::SIGKILL),
            "{name} did not kill itself before an ack ({status}); log:\n{}",
            node.log()
        );
        kills += 1;
    }
    let name = format!("node-{KILLS}");
    cluster.start(&name, &broker.config(reg, &name, dedup));
    let report = wait_settled(&cluster, &cluster::ids(&msgs), Duration::from_secs(90));
    let mut calls: HashMap<&str, usize> = HashMap::new();
    for c in &report.calls {
        *calls.entry(c.id.as_str()).or_default() += 1;
    }
    assert!(
        msgs.iter().all(|m| calls.contains_key(m.id.as_str())),
        "a message was settled without ever being called"
    );
    let seen = Seen {
        duplicates: calls.values().filter(|n| **n > 1).count(),
        extra_calls: calls.values().map(|n| n - 1).sum(),
        deduplicated: report.settled.values().filter(|(_, o)| o == "deduplicated").count(),
        kills,
    };
    cluster.nodes[KILLS].terminate(Duration::from_secs(30));
    eprintln!(
        "dedup {}: {} kills between a success and its ack, {} messages called again ({} extra calls), {} acked without a call",
        if dedup { "on" } else { "off" },
        seen.kills,
        seen.duplicates,
        seen.extra_calls,
        seen.deduplicated
    );
    seen
}

fn no_duplicates(broker: &Broker, reg: &dyn Registry) {
    let seen = kill_between_success_and_ack(broker, reg, true);
    assert_eq!(
        (seen.duplicates, seen.extra_calls),
        (0, 0),
        "with dedup on, a message ran twice"
    );
    assert!(
        seen.deduplicated >= seen.kills,
        "each kill leaves a handled message unacked, so at least {} must be acked without a call; saw {}",
        seen.kills,
        seen.deduplicated
    );
}

fn duplicates_without_dedup(broker: &Broker, reg: &dyn Registry) {
    let seen = kill_between_success_and_ack(broker, reg, false);
    // A message can be killed before its ack more than once, so count calls.
    assert!(
        seen.extra_calls >= seen.kills,
        "without dedup each kill should cost another call ({} kills), saw {} extra calls",
        seen.kills,
        seen.extra_calls
    );
    assert_eq!(seen.deduplicated, 0);
}

#[test]
fn no_duplicates_after_kills_before_the_ack_on_postgres() {
    no_duplicates(&Broker::Rabbit(Topo::new(SLOTS, &[])), &TestDb::new());
}

/// The red baseline of the test above.
#[test]
fn without_dedup_kills_before_the_ack_duplicate_on_postgres() {
    duplicates_without_dedup(&Broker::Rabbit(Topo::new(SLOTS, &[])), &TestDb::new());
}

#[test]
fn no_duplicates_after_kills_before_the_ack_on_nats_kv() {
    no_duplicates(&Broker::Nats(NatsTopo::new()), &KvBucket::new(LEASE));
}

/// The red baseline of the test above.
#[test]
fn without_dedup_kills_before_the_ack_duplicate_on_nats_kv() {
    duplicates_without_dedup(&Broker::Nats(NatsTopo::new()), &KvBucket::new(LEASE));
}

/// Calls per message id in `report`.
fn calls_per_id(report: &Report) -> HashMap<&str, usize> {
    let mut calls: HashMap<&str, usize> = HashMap::new();
    for c in &report.calls {
        *calls.entry(c.id.as_str()).or_default() += 1;
    }
    calls
}

/// Wait until `n` settlements are in the journals (each copy settles once).
fn wait_settlements(cluster: &Cluster, n: usize, timeout: Duration) {
    let start = Instant::now();
    loop {
        let settled: usize = cluster
            .nodes
            .iter()
            .map(|node| {
                std::fs::read_to_string(&node.journal)
                    .unwrap_or_default()
                    .lines()
                    .filter(|l| l.starts_with("settle\t"))
                    .count()
            })
            .sum();
        if settled >= n {
            return;
        }
        assert!(
            start.elapsed() < timeout,
            "{settled} of {n} settlements within {timeout:?}; logs:\n{}",
            cluster.nodes.iter().map(|n| n.log()).collect::<Vec<_>>().join("\n")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A node whose lane holds a slow call while `msgs` arrive behind it, so
/// its next jobs hold several of them: (calls per id, `deduplicated`
/// settlements). The node's prefetch lets every message in at once.
fn queued_together(
    broker: &Broker,
    reg: &dyn Registry,
    dedup: bool,
    msgs: &[Envelope],
) -> (HashMap<String, usize>, usize) {
    let mut cluster = Cluster::default();
    let config = broker
        .config(reg, "node-0", dedup)
        .replace("prefetch = 8", "prefetch = 256");
    cluster.start("node-0", &config);
    let gate = common::message("slow", Some(GROUP), b"1500");
    broker.publish(std::slice::from_ref(&gate));
    broker.publish(msgs);
    wait_settlements(&cluster, msgs.len() + 1, Duration::from_secs(90));
    let report = cluster.report();
    let calls = calls_per_id(&report)
        .into_iter()
        .map(|(id, n)| (id.to_owned(), n))
        .collect();
    let deduplicated = std::fs::read_to_string(&cluster.nodes[0].journal)
        .unwrap()
        .lines()
        .filter(|l| l.ends_with("\tdeduplicated"))
        .count();
    cluster.nodes[0].terminate(Duration::from_secs(30));
    (calls, deduplicated)
}

/// Copies back to back (X X) and spread (X Y X), 16 ids of each, in one group.
fn copies() -> (Vec<Envelope>, Vec<String>) {
    let mut msgs = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..16 {
        let x = common::message("ok", Some(GROUP), b"");
        ids.push(x.id.clone());
        msgs.push(x.clone());
        msgs.push(x);
    }
    for _ in 0..16 {
        let x = common::message("ok", Some(GROUP), b"");
        let y = common::message("ok", Some(GROUP), b"");
        ids.extend([x.id.clone(), y.id.clone()]);
        msgs.extend([x.clone(), y, x]);
    }
    (msgs, ids)
}

fn copies_in_one_job_run_once(broker: &Broker, reg: &dyn Registry) {
    let (msgs, ids) = copies();
    let (calls, deduplicated) = queued_together(broker, reg, true, &msgs);
    let twice: Vec<&String> = ids
        .iter()
        .filter(|id| calls.get(*id).copied().unwrap_or(0) != 1)
        .collect();
    eprintln!(
        "dedup on: {} of {} ids not called exactly once, {deduplicated} copies acked without a call",
        twice.len(),
        ids.len()
    );
    assert!(twice.is_empty(), "with dedup on, these ran other than once: {twice:?}");
    assert_eq!(
        deduplicated,
        msgs.len() - ids.len(),
        "every second copy is acked without a call"
    );
}

/// The red baseline: without dedup every copy runs.
fn copies_in_one_job_run_twice_without_dedup(broker: &Broker, reg: &dyn Registry) {
    let (msgs, ids) = copies();
    let (calls, deduplicated) = queued_together(broker, reg, false, &msgs);
    let twice = ids.iter().filter(|id| calls.get(*id).copied() == Some(2)).count();
    eprintln!("dedup off: {twice} of {} ids called twice", ids.len());
    assert_eq!(twice, 32, "without dedup both copies of the 32 copied ids run");
    assert_eq!(deduplicated, 0);
}

#[test]
fn copies_queued_together_run_once_on_postgres() {
    copies_in_one_job_run_once(&Broker::Rabbit(Topo::new(SLOTS, &[])), &TestDb::new());
}

#[test]
fn without_dedup_copies_queued_together_run_twice_on_postgres() {
    copies_in_one_job_run_twice_without_dedup(&Broker::Rabbit(Topo::new(SLOTS, &[])), &TestDb::new());
}

#[test]
fn copies_queued_together_run_once_on_nats_kv() {
    copies_in_one_job_run_once(&Broker::Nats(NatsTopo::new()), &KvBucket::new(LEASE));
}

#[test]
fn without_dedup_copies_queued_together_run_twice_on_nats_kv() {
    copies_in_one_job_run_twice_without_dedup(&Broker::Nats(NatsTopo::new()), &KvBucket::new(LEASE));
}

/// Issue 33 item 2: a node SIGKILLs itself right before the 4th call it
/// starts: the first is a slow call alone in its job, the 2nd and 3rd
/// succeeded in the next job (which holds the messages that arrived behind
/// the slow one) and are not acked yet. The next node gets them again:
/// (second calls, `deduplicated` settlements).
fn kill_in_the_middle_of_a_job(broker: &Broker, reg: &dyn Registry, dedup: bool) -> (usize, usize) {
    let mut cluster = Cluster::default();
    let config = |name: &str| {
        broker
            .config(reg, name, dedup)
            .replace("prefetch = 8", "prefetch = 256")
    };
    cluster.start_with_env("node-0", &config("node-0"), &[(KILL_BEFORE_CALL, "4")]);
    let gate = common::message("slow", Some(GROUP), b"1500");
    let msgs: Vec<Envelope> = (0..12).map(|_| common::message("ok", Some(GROUP), b"")).collect();
    broker.publish(std::slice::from_ref(&gate));
    broker.publish(&msgs);
    let status = cluster.nodes[0].wait(Duration::from_secs(60));
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL),
        "node-0 did not kill itself before its 4th call; log:\n{}",
        cluster.nodes[0].log()
    );
    let before = calls_per_id(&cluster.report()).values().sum::<usize>();
    assert_eq!(before, 3, "node-0 made 3 calls before the kill");
    cluster.start("node-1", &config("node-1"));
    let mut all = cluster::ids(&msgs);
    all.push(gate.id.clone());
    let report = wait_settled(&cluster, &all, Duration::from_secs(90));
    // Counted over the job's messages: whether the slow call's ack left
    // before the kill is not what this measures.
    let calls = calls_per_id(&report);
    let second: usize = msgs.iter().map(|m| calls.get(m.id.as_str()).map_or(0, |n| n - 1)).sum();
    let deduplicated = msgs
        .iter()
        .filter(|m| report.settled.get(&m.id).is_some_and(|(_, o)| o == "deduplicated"))
        .count();
    cluster.nodes[1].terminate(Duration::from_secs(30));
    eprintln!(
        "dedup {}: kill before the 4th call: {second} second calls, {deduplicated} acked without a call",
        if dedup { "on" } else { "off" }
    );
    (second, deduplicated)
}

#[test]
fn a_kill_in_the_middle_of_a_job_costs_no_second_call_on_postgres() {
    let (second, deduplicated) =
        kill_in_the_middle_of_a_job(&Broker::Rabbit(Topo::new(SLOTS, &[])), &TestDb::new(), true);
    assert_eq!(
        second, 0,
        "with dedup on, a call that succeeded before the kill ran again"
    );
    assert_eq!(
        deduplicated, 2,
        "the two calls before the kill are acked without a call"
    );
}

/// The red baseline of the test above.
#[test]
fn without_dedup_a_kill_in_the_middle_of_a_job_costs_second_calls_on_postgres() {
    let (second, deduplicated) =
        kill_in_the_middle_of_a_job(&Broker::Rabbit(Topo::new(SLOTS, &[])), &TestDb::new(), false);
    assert_eq!(second, 2, "without dedup the two unacked successes run again");
    assert_eq!(deduplicated, 0);
}

#[test]
fn a_kill_in_the_middle_of_a_job_costs_no_second_call_on_nats_kv() {
    let (second, deduplicated) =
        kill_in_the_middle_of_a_job(&Broker::Nats(NatsTopo::new()), &KvBucket::new(LEASE), true);
    assert_eq!(
        second, 0,
        "with dedup on, a call that succeeded before the kill ran again"
    );
    assert_eq!(
        deduplicated, 2,
        "the two calls before the kill are acked without a call"
    );
}

/// The red baseline of the test above.
#[test]
fn without_dedup_a_kill_in_the_middle_of_a_job_costs_second_calls_on_nats_kv() {
    let (second, deduplicated) =
        kill_in_the_middle_of_a_job(&Broker::Nats(NatsTopo::new()), &KvBucket::new(LEASE), false);
    assert_eq!(second, 2, "without dedup the two unacked successes run again");
    assert_eq!(deduplicated, 0);
}
