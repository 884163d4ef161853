//! Multi-process clusters on the real NATS JetStream server: separate
//! `weir run` processes, each writing a journal (the cross-process ledger,
//! `weir::observe::journal`), checked together with the same cluster assertions as
//! the RabbitMQ suite (`common/cluster.rs`).
//!
//! - `static_cluster_of_three`: 3 nodes that own 2 of 6 slots each; no
//!   overlap anywhere, everything handled, each group only on its slot's
//!   owner, every slot and node used, every node alive and draining cleanly.
//! - `nodes_sharing_every_slot_overlap`: the red baseline. All 3 nodes own
//!   every slot. A JetStream pull consumer has no single active consumer,
//!   so the three really share each slot's durable consumer and the server
//!   hands one group's messages to all of them: with slow calls the
//!   journals must report overlaps.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::cluster;
use common::nats::Topo;
use weir::envelope::Envelope;
use weir::partition;
use weir::transport::nats::Nats;

const SLOTS: u32 = 6;

fn static_config(topo: &Topo, node: &str, owned: &[u32]) -> String {
    let static_mode = cluster::static_mode(owned);
    cluster::node_config(node, "nats", &topo.url, 32, &static_mode, &topo.name, SLOTS)
}

/// Publish to each message's right slot subject (with PubAck).
fn publish(topo: &Topo, msgs: &[Envelope]) {
    cluster::publish(
        || Nats::new(topo.url.clone(), "weir cluster-test publisher"),
        &topo.name,
        msgs,
        |m| partition::slot_for(m.group(), &m.id, SLOTS),
    );
}

#[test]
fn static_cluster_of_three() {
    let topo = Topo::new();
    cluster::static_cluster_of_three(
        SLOTS,
        |node, owned| static_config(&topo, node, owned),
        |msgs| publish(&topo, msgs),
    );
}

#[test]
fn nodes_sharing_every_slot_overlap() {
    let topo = Topo::new();
    cluster::nodes_sharing_every_slot_overlap(
        SLOTS,
        &[],
        |node, every| static_config(&topo, node, every),
        |msgs| publish(&topo, msgs),
    );
}
