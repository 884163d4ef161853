//! Multi-process clusters on the real RabbitMQ: separate `weir run`
//! processes, each writing a journal (the cross-process ledger,
//! `weir::journal`), checked together for intra-group overlap anywhere in
//! the cluster, at-least-once completeness, groups staying on one slot and
//! one owner, every slot used and every node working.
//!
//! - `static_cluster_of_three`: the compliance assertions over 3 nodes
//!   that own 2 of 6 slots each.
//! - `misrouted_sender_makes_the_ledger_report_overlaps`: the red baseline.
//!   The same cluster, but the sender computes slots with the wrong function
//!   (by message id, the classic mistake), so one group's messages reach
//!   every node and run at once. The ledger must see it.
//! - `nodes_sharing_slots_without_single_active_consumer_overlap`: the
//!   other red baseline. Every node consumes every slot and the queues are
//!   declared without single active consumer (a negative-control switch of
//!   the binary), so the ledger must report overlaps.
//! - `single_active_consumer_fails_over_on_crash_and_on_drain`:
//!   `rabbitmq-sac`, a crash (SIGKILL) of the active node mid-stream and a
//!   graceful stop of the next; the last node finishes everything.
//! - `single_active_consumer_is_a_safety_net_under_static_misconfiguration`:
//!   two static nodes that both claim every slot still never overlap,
//!   because every slot queue has a single active consumer.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::cluster::Cluster;
use common::rabbit::{Topo, url};
use weir::envelope::{self, Envelope};
use weir::journal::Report;
use weir::node::bundled;
use weir::partition;
use weir::transport::Transport as _;
use weir::transport::rabbitmq::{self, RabbitMq};

const SLOTS: u32 = 6;

fn config(topo: &Topo, node: &str, cluster: &str) -> String {
    format!(
        r#"
[node]
name = "{node}"
[transport]
kind = "rabbitmq"
url = "{url}"
prefetch = 32
[cluster]
{cluster}
[[topology]]
name = "{topo}"
slots = {SLOTS}
max_concurrent_groups = 16
[[handler]]
name = "faulty"
component = "{component}"
topology = "{topo}"
message_types = ["ok", "slow"]
"#,
        url = url(),
        topo = topo.name,
        component = bundled::FAULTY_PATH,
    )
}

fn static_config(topo: &Topo, node: &str, owned: &[u32]) -> String {
    config(topo, node, &format!("mode = \"static\"\nowned_slots = {owned:?}"))
}

/// `groups` × `per_group` messages of type `slow` (payload: ms of CPU).
fn messages(groups: usize, per_group: usize, ms: u32) -> Vec<Envelope> {
    let mut out = Vec::new();
    for _ in 0..per_group {
        for g in 0..groups {
            out.push(common::message(
                "slow",
                Some(&format!("g{g}")),
                ms.to_string().as_bytes(),
            ));
        }
    }
    out
}

/// Publish through the exchange; `slot_of` picks each message's slot.
fn publish(topo: &Topo, msgs: &[Envelope], slot_of: impl Fn(&Envelope) -> u32) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let t = RabbitMq::new(url(), "weir cluster-test publisher");
        for m in msgs {
            t.publish(&topo.name, slot_of(m), envelope::encode(m)).await.unwrap();
        }
    });
}

fn right_slot(m: &Envelope) -> u32 {
    partition::slot_for(m.group(), &m.id, SLOTS)
}

fn ids(msgs: &[Envelope]) -> Vec<String> {
    msgs.iter().map(|m| m.id.clone()).collect()
}

fn describe(r: &Report) -> String {
    let first: Vec<String> = r
        .overlaps
        .iter()
        .take(5)
        .map(|o| {
            format!(
                "group {}: {} on {} [{}..{}] and {} on {} [{}..{}]",
                o.group,
                o.first.id,
                o.first.node,
                o.first.start,
                o.first.end,
                o.second.id,
                o.second.node,
                o.second.start,
                o.second.end
            )
        })
        .collect();
    format!("{} overlaps, first: {first:#?}", r.overlaps.len())
}

#[test]
fn static_cluster_of_three() {
    let topo = Topo::new(SLOTS, &[]);
    let mut cluster = Cluster::default();
    let owned: [[u32; 2]; 3] = [[0, 1], [2, 3], [4, 5]];
    for (i, slots) in owned.iter().enumerate() {
        cluster.start(&format!("node-{i}"), &static_config(&topo, &format!("node-{i}"), slots));
    }
    // 60 groups × 10 messages of 2 ms each: every slot gets groups, every
    // node holds several lanes at once.
    let msgs = messages(60, 10, 2);
    publish(&topo, &msgs, right_slot);
    let report = cluster.wait_handled(&ids(&msgs), Duration::from_secs(120));

    assert!(report.overlaps.is_empty(), "{}", describe(&report));
    // Groups never straddle slots or owners: each group ran on exactly the
    // node that owns its slot.
    let owner_of = |slot: u32| format!("node-{}", slot / 2);
    for (group, nodes) in report.nodes_per_group() {
        let slot = partition::slot_for(Some(group), "", SLOTS);
        assert_eq!(
            nodes,
            HashSet::from([owner_of(slot).as_str()]),
            "group {group} (slot {slot}) ran on {nodes:?}"
        );
    }
    let used: HashSet<u32> = report
        .calls
        .iter()
        .filter_map(|c| c.group.as_deref())
        .map(|g| partition::slot_for(Some(g), "", SLOTS))
        .collect();
    assert_eq!(used.len(), SLOTS as usize, "every slot used: {used:?}");
    assert_eq!(report.nodes().len(), 3, "every node did work: {:?}", report.nodes());
    // Ownership still held at the end: every node is alive and drains cleanly.
    for n in &mut cluster.nodes {
        assert!(n.alive(), "{} died during the run; log:\n{}", n.name, n.log());
    }
    for n in &mut cluster.nodes {
        n.terminate(Duration::from_secs(30));
    }
}

#[test]
fn misrouted_sender_makes_the_ledger_report_overlaps() {
    let topo = Topo::new(SLOTS, &[]);
    let mut cluster = Cluster::default();
    for (i, slots) in [[0u32, 1], [2, 3], [4, 5]].iter().enumerate() {
        cluster.start(&format!("node-{i}"), &static_config(&topo, &format!("node-{i}"), slots));
    }
    // 3 groups × 12 messages of 40 ms, spread by message id: every group has
    // messages on (almost) every slot, so every node runs every group for
    // several hundred milliseconds, all at the same time.
    let msgs = messages(3, 12, 40);
    publish(&topo, &msgs, |m| partition::slot_for(None, &m.id, SLOTS));
    let report = cluster.wait_handled(&ids(&msgs), Duration::from_secs(120));

    let straddling = report.nodes_per_group().values().filter(|n| n.len() > 1).count();
    assert!(straddling > 0, "the misrouting must put a group on two nodes");
    assert!(
        !report.overlaps.is_empty(),
        "groups ran on several nodes ({straddling} straddle) yet the ledger saw no overlap: it is blind"
    );
    for n in &mut cluster.nodes {
        n.terminate(Duration::from_secs(30));
    }
}

#[test]
fn nodes_sharing_slots_without_single_active_consumer_overlap() {
    // The issue's red baseline: all 3 nodes consume all 6 slots, on queues
    // declared without single active consumer. The broker hands each
    // queue's messages round-robin to all three, so a group runs on three
    // nodes at once.
    let topo = Topo::new(SLOTS, &[]);
    let mut cluster = Cluster::default();
    let every: Vec<u32> = (0..SLOTS).collect();
    let env = [(rabbitmq::NEGATIVE_CONTROL_NO_SAC, "1")];
    for i in 0..3 {
        cluster.start_with_env(
            &format!("node-{i}"),
            &static_config(&topo, &format!("node-{i}"), &every),
            &env,
        );
    }
    let msgs = messages(3, 12, 40);
    publish(&topo, &msgs, right_slot);
    let report = cluster.wait_handled(&ids(&msgs), Duration::from_secs(120));
    assert!(
        report.nodes_per_group().values().any(|n| n.len() > 1),
        "without single active consumer a group must reach several nodes"
    );
    assert!(!report.overlaps.is_empty(), "the ledger saw no overlap: it is blind");
    for n in &mut cluster.nodes {
        n.terminate(Duration::from_secs(30));
    }
}

#[test]
fn single_active_consumer_fails_over_on_crash_and_on_drain() {
    let topo = Topo::new(SLOTS, &[]);
    let mut cluster = Cluster::default();
    // The first node to subscribe is the active consumer of every slot.
    for i in 0..3 {
        cluster.start(
            &format!("node-{i}"),
            &config(&topo, &format!("node-{i}"), "mode = \"rabbitmq-sac\""),
        );
    }
    let msgs = messages(30, 40, 3);
    let all = ids(&msgs);
    let publisher = {
        let msgs = msgs.clone();
        let name = topo.name.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                let t = RabbitMq::new(url(), "weir cluster-test publisher");
                for m in &msgs {
                    t.publish(&name, right_slot(m), envelope::encode(m)).await.unwrap();
                }
            });
        })
    };

    // Crash the active node once it has handled some of the stream.
    let wait_for = |cluster: &Cluster, node: &str, n: usize| {
        let start = std::time::Instant::now();
        loop {
            let r = cluster.report();
            let by_node = r
                .settled
                .values()
                .filter(|(who, o)| who == node && o == "handled")
                .count();
            if by_node >= n {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{node} handled only {by_node}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    wait_for(&cluster, "node-0", 200);
    cluster.nodes[0].kill();
    // The broker activates the next consumer of every slot queue; stop that
    // one gracefully (drain, then cancel) once it has done some work.
    wait_for(&cluster, "node-1", 200);
    cluster.nodes[1].terminate(Duration::from_secs(30));
    publisher.join().unwrap();

    let report = cluster.wait_handled(&all, Duration::from_secs(120));
    assert!(report.overlaps.is_empty(), "{}", describe(&report));
    let mut per_node: HashMap<&str, usize> = HashMap::new();
    for (node, outcome) in report.settled.values() {
        if outcome == "handled" {
            *per_node.entry(node.as_str()).or_default() += 1;
        }
    }
    assert_eq!(per_node.len(), 3, "every node took over in turn: {per_node:?}");
    assert!(cluster.nodes[2].alive());
    cluster.nodes[2].terminate(Duration::from_secs(30));
}

#[test]
fn single_active_consumer_is_a_safety_net_under_static_misconfiguration() {
    let topo = Topo::new(SLOTS, &[]);
    let mut cluster = Cluster::default();
    let every: Vec<u32> = (0..SLOTS).collect();
    for i in 0..2 {
        cluster.start(
            &format!("node-{i}"),
            &static_config(&topo, &format!("node-{i}"), &every),
        );
    }
    // The same stream as the red baseline's shape, routed right: were both
    // nodes active on a slot, its groups would overlap.
    let msgs = messages(6, 12, 20);
    publish(&topo, &msgs, right_slot);
    let report = cluster.wait_handled(&ids(&msgs), Duration::from_secs(120));
    assert!(report.overlaps.is_empty(), "{}", describe(&report));
    // One active consumer per slot queue: no group ran on two nodes.
    for (group, nodes) in report.nodes_per_group() {
        assert_eq!(nodes.len(), 1, "group {group} ran on {nodes:?}");
    }
    for n in &mut cluster.nodes {
        n.terminate(Duration::from_secs(30));
    }
}
