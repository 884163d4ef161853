//! Multi-process clusters on the real RabbitMQ: separate `weir run`
//! processes, each writing a journal (the cross-process ledger,
//! `weir::observe::journal`), checked together for intra-group overlap anywhere in
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

#[path = "../host/tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::cluster::{self, Cluster, describe, ids, messages};
use common::rabbit::{Topo, url};
use weir::envelope::Envelope;
use weir::partition;
use weir::transport::rabbitmq::{self, RabbitMq};

const SLOTS: u32 = 6;

fn config(topo: &Topo, node: &str, cluster: &str) -> String {
    cluster::node_config(node, "rabbitmq", &url(), 32, cluster, &topo.name, SLOTS)
}

fn static_config(topo: &Topo, node: &str, owned: &[u32]) -> String {
    config(topo, node, &cluster::static_mode(owned))
}

/// Publish through the exchange; `slot_of` picks each message's slot.
fn publish(topo: &Topo, msgs: &[Envelope], slot_of: impl Fn(&Envelope) -> u32) {
    cluster::publish(
        || RabbitMq::new(url(), "weir cluster-test publisher"),
        &topo.name,
        msgs,
        slot_of,
    );
}

fn right_slot(m: &Envelope) -> u32 {
    partition::slot_for(m.group(), &m.id, SLOTS)
}

#[test]
fn static_cluster_of_three() {
    let topo = Topo::new(SLOTS, &[]);
    cluster::static_cluster_of_three(
        SLOTS,
        |node, owned| static_config(&topo, node, owned),
        |msgs| publish(&topo, msgs, right_slot),
    );
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
    // The red baseline: all 3 nodes consume all 6 slots, on queues
    // declared without single active consumer. The broker hands each
    // queue's messages round-robin to all three, so a group runs on three
    // nodes at once.
    let topo = Topo::new(SLOTS, &[]);
    cluster::nodes_sharing_every_slot_overlap(
        SLOTS,
        &[(rabbitmq::NEGATIVE_CONTROL_NO_SAC, "1")],
        |node, every| static_config(&topo, node, every),
        |msgs| publish(&topo, msgs, right_slot),
    );
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
                    common::publish_confirmed(&t, &name, right_slot(m), m).await;
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
