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
use weir::settle::fault::KILL_BEFORE_ACK;
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
