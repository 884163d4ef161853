//! A parked group (`on_failure = "park"`) moves with its slot: node A parks
//! a group behind its failed third message, then is stopped (SIGTERM, a
//! drain and a handoff) while the head waits on the ladder; node B gets the
//! slot, reads the parked group from the coordinator's store and holds the
//! group's later messages until the head comes back. The group is handled
//! in exact order 1…10 across the two nodes. The red baseline is the same
//! handoff with `WEIR_NEGATIVE_CONTROL_PARK_NOT_CARRIED=1` (B does not read
//! the parked groups): B runs 4…10 before 3.
//!
//! On RabbitMQ with `cluster.mode = "postgres"` and on NATS with
//! `cluster.mode = "nats-kv"`, separate `weir run` processes, order read
//! from their journals.
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
use weir::envelope::{self, Envelope};
use weir::parked::NEGATIVE_CONTROL_NOT_CARRIED;
use weir::transport::nats::Nats;
use weir::transport::rabbitmq::RabbitMq;

const LEASE: Duration = Duration::from_secs(2);
/// The ladder's one rung: the head is away this long, long enough for the
/// handoff to finish first.
const RUNG: Duration = Duration::from_secs(6);

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

    fn config(&self, reg: &dyn Registry, node: &str) -> String {
        let (kind, url) = match self {
            Self::Rabbit(_) => ("rabbitmq", url()),
            Self::Nats(t) => ("nats", t.url.clone()),
        };
        format!(
            r#"
[node]
name = "{node}"
[transport]
kind = "{kind}"
url = "{url}"
prefetch = 32
[cluster]
{cluster}lease = "{lease}ms"
[[topology]]
name = "{topology}"
slots = 1
[topology.retry]
ladder = ["{rung}s"]
max_deliver = 5
[[handler]]
name = "faulty"
component = "{component}"
topology = "{topology}"
message_types = ["flaky"]
on_failure = "park"
"#,
            cluster = registry::cluster(&reg.url()),
            lease = LEASE.as_millis(),
            topology = self.name(),
            rung = RUNG.as_secs(),
            component = weir::node::bundled::FAULTY_PATH,
        )
    }

    fn publish(&self, msgs: &[Envelope]) {
        match self {
            Self::Rabbit(t) => cluster::publish(
                || RabbitMq::new(url(), "weir park-test publisher"),
                &t.name,
                msgs,
                |_| 0,
            ),
            Self::Nats(t) => cluster::publish(
                || Nats::new(t.url.clone(), "weir park-test publisher"),
                &t.name,
                msgs,
                |_| 0,
            ),
        }
    }
}

fn flaky(failing: u32) -> Envelope {
    envelope::new_message(
        envelope::fresh_id(),
        "flaky",
        Some("g".to_owned()),
        None,
        vec![],
        failing.to_string().into_bytes(),
    )
}

/// The group's message numbers (1-based) in the order of their last call.
fn handoff(broker: &Broker, reg: &dyn Registry, carried: bool) -> Vec<usize> {
    let env: Vec<(&str, &str)> = if carried {
        Vec::new()
    } else {
        vec![(NEGATIVE_CONTROL_NOT_CARRIED, "1")]
    };
    let mut cluster = Cluster::default();
    cluster.start_with_env("node-a", &broker.config(reg, "node-a"), &env);
    let start = Instant::now();
    while reg.slot_owners().get(&0).map(String::as_str) != Some("node-a") {
        assert!(start.elapsed() < Duration::from_secs(30), "node-a never owned the slot");
        std::thread::sleep(Duration::from_millis(50));
    }
    let msgs: Vec<Envelope> = (1..=10).map(|i| flaky(u32::from(i == 3))).collect();
    broker.publish(&msgs[..3]);
    // The head failed once on node-a: the group is parked there.
    let head = &msgs[2].id;
    while cluster
        .report()
        .settled
        .get(head.as_str())
        .is_none_or(|(_, o)| o != "retry-scheduled")
    {
        assert!(start.elapsed() < Duration::from_secs(60), "the head never failed");
        std::thread::sleep(Duration::from_millis(20));
    }
    broker.publish(&msgs[3..]);
    // node-b joins; node-a leaves (drain, handoff) while the head is away.
    cluster.start_with_env("node-b", &broker.config(reg, "node-b"), &env);
    cluster.nodes[0].terminate(Duration::from_secs(30));
    let report = cluster.wait_handled(&cluster::ids(&msgs), Duration::from_secs(90));
    let b_calls = report.calls.iter().filter(|c| c.node == "node-b").count();
    assert!(b_calls > 0, "node-b never ran the group: the handoff did not happen");
    let mut last: HashMap<&str, u64> = HashMap::new();
    for c in &report.calls {
        let t = last.entry(c.id.as_str()).or_default();
        *t = (*t).max(c.start);
    }
    let mut order: Vec<(u64, usize)> = msgs
        .iter()
        .enumerate()
        .map(|(i, m)| (last[m.id.as_str()], i + 1))
        .collect();
    order.sort_unstable();
    if std::env::var("WEIR_TEST_VERBOSE").is_ok() {
        for c in &report.calls {
            let n = msgs.iter().position(|m| m.id == c.id).map_or(0, |i| i + 1);
            eprintln!("call {n} on {} at {}", c.node, c.start);
        }
        for n in &cluster.nodes {
            eprintln!("--- {}:\n{}", n.name, n.log());
        }
    }
    cluster.nodes[1].terminate(Duration::from_secs(30));
    order.into_iter().map(|(_, i)| i).collect()
}

fn keeps_order(broker: &Broker, reg: &dyn Registry) {
    let order = handoff(broker, reg, true);
    assert_eq!(
        order,
        (1..=10).collect::<Vec<_>>(),
        "the parked group ran out of order across the handoff"
    );
}

fn loses_order_when_not_carried(broker: &Broker, reg: &dyn Registry) {
    let order = handoff(broker, reg, false);
    assert_eq!(
        order.last(),
        Some(&3),
        "without the parked groups carried over, node-b runs 4..10 before the head: {order:?}"
    );
}

#[test]
fn a_parked_group_stays_parked_across_a_handoff_on_postgres() {
    keeps_order(&Broker::Rabbit(Topo::new(1, &[RUNG])), &TestDb::new());
}

/// The red baseline of the test above.
#[test]
fn not_carried_a_parked_group_reorders_across_a_handoff_on_postgres() {
    loses_order_when_not_carried(&Broker::Rabbit(Topo::new(1, &[RUNG])), &TestDb::new());
}

#[test]
fn a_parked_group_stays_parked_across_a_handoff_on_nats_kv() {
    keeps_order(&Broker::Nats(NatsTopo::new()), &KvBucket::new(LEASE));
}

/// The red baseline of the test above.
#[test]
fn not_carried_a_parked_group_reorders_across_a_handoff_on_nats_kv() {
    loses_order_when_not_carried(&Broker::Nats(NatsTopo::new()), &KvBucket::new(LEASE));
}
