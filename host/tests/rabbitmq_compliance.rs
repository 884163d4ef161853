//! The RabbitMQ transport against the real broker (amqp://127.0.0.1:5672,
//! override with WEIR_TEST_AMQP_URL): a node with the faulty test guest, a
//! ledger of calls and settlements, and a recording wrapper around the
//! transport that notes which queue delivered each message. Every test uses
//! its own topology `t-<uuid8>` and deletes its queues and exchanges when it
//! ends, also when it fails, so the tests run in parallel and repeatedly.
//! `WEIR_TEST_QUEUE_TYPE=quorum` runs the suite on quorum queues.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use weir::config::TransportKind;
use weir::envelope::{self, Envelope, header};
use weir::outcome::Outcome;
use weir::partition;
use weir::transport::rabbitmq::names;

use common::compliance::{self, Harness, Subject};
use common::rabbit::{Topo, url};

/// A node on RabbitMQ for a fresh topology, deleted when the harness drops.
async fn start(slots: u32, ladder: &[Duration], max_deliver: i64) -> Harness<Topo> {
    let topo = Topo::new(slots, ladder);
    let name = topo.name.clone();
    let subject = Subject {
        transport: Arc::new(common::rabbit::transport(format!("weir node-{name}"))),
        kind: TransportKind::Rabbitmq,
        url: Some(url()),
    };
    Harness::start(subject, &name, slots, ladder, max_deliver, topo).await
}

fn msg(t: &str, group: Option<&str>, payload: &str) -> Envelope {
    common::message(t, group, payload.as_bytes())
}

/// A plain AMQP client, as a publisher or consumer outside Weir would be.
async fn plain() -> (Connection, lapin::Channel) {
    let conn = Connection::connect(&url(), ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    (conn, ch)
}

/// Read `n` messages from a queue with a plain consumer (acking them).
async fn read_queue(queue: &str, n: usize, timeout: Duration) -> Vec<lapin::message::Delivery> {
    let (conn, ch) = plain().await;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut out = Vec::new();
    let deadline = Instant::now() + timeout;
    while out.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        let d = tokio::time::timeout(left, consumer.next())
            .await
            .unwrap_or_else(|_| panic!("timed out reading {queue}: {} of {n}", out.len()))
            .unwrap()
            .unwrap();
        d.ack(BasicAckOptions::default()).await.unwrap();
        out.push(d);
    }
    let _ = conn.close(200, "done".into()).await;
    out
}

fn header_text(d: &lapin::message::Delivery, name: &str) -> Option<String> {
    match d.properties.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        other => Some(format!("{other:?}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_of_groups_keeps_lanes_slots_and_parallelism() {
    let mut h = start(4, &[Duration::from_millis(200)], 3).await;
    let name = h.name.clone();
    compliance::burst_of_groups(&mut h, |slot| names::slot_queue(&name, slot)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cascades_and_ingress_come_through_the_slot_queues() {
    let mut h = start(3, &[Duration::from_millis(200)], 3).await;
    // Cascades: the `publish` type publishes an `ok` of its group.
    let parents: Vec<Envelope> = (0..6).map(|i| msg("publish", Some(&format!("c-{i}")), "x")).collect();
    let mut ids: HashSet<String> = HashSet::new();
    for p in &parents {
        ids.insert(p.id.clone());
        ids.insert(envelope::cascade_id(p, 0));
        h.publish(p).await;
    }
    // Ingress: a plain client sets only the group and type; one message lacks the type.
    let (conn, ch) = plain().await;
    ch.confirm_select(Default::default()).await.unwrap();
    let ingress = names::ingress(&h.name);
    let mut ingress_ids = Vec::new();
    for i in 0..4 {
        let id = format!("in-{i}-{}", h.name);
        let mut headers = FieldTable::default();
        headers.insert(header::MESSAGE_ID.into(), AMQPValue::LongString(id.as_str().into()));
        headers.insert(header::MESSAGE_TYPE.into(), AMQPValue::LongString("ok".into()));
        headers.insert(header::GROUP_ID.into(), AMQPValue::LongString(format!("ig-{i}").into()));
        ch.basic_publish(
            "".into(),
            ingress.as_str().into(),
            BasicPublishOptions::default(),
            b"hi",
            BasicProperties::default().with_headers(headers).with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
        ids.insert(id.clone());
        ingress_ids.push((id, format!("ig-{i}")));
    }
    let mut headers = FieldTable::default();
    headers.insert(header::GROUP_ID.into(), AMQPValue::LongString("no-type".into()));
    ch.basic_publish(
        "".into(),
        ingress.as_str().into(),
        BasicPublishOptions::default(),
        b"?",
        BasicProperties::default().with_headers(headers),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let _ = conn.close(200, "done".into()).await;

    let outcomes = h.wait_outcomes(&ids, Duration::from_secs(60)).await;
    assert!(ids.iter().all(|id| outcomes.get(id) == Some(&Outcome::Handled)));
    // Every executed message was delivered by its slot queue: cascades and
    // ingress included, although this node owns every slot.
    let seen = h.seen.lock().clone();
    let called: HashSet<String> = h.obs.calls.all().into_iter().map(|c| c.id).collect();
    for id in &called {
        let s = seen
            .iter()
            .find(|s| &s.id == id)
            .unwrap_or_else(|| panic!("{id} ran without a delivery"));
        let expected = partition::slot_for(s.group.as_deref(), id, h.slots);
        assert_eq!(s.source, names::slot_queue(&h.name, expected));
    }
    for (id, _) in &ingress_ids {
        assert!(called.contains(id), "ingress message {id} was forwarded and handled");
    }
    // The message without a type was dead-lettered `undecodable`, not dropped.
    let dead = read_queue(&names::dead_letter(&h.name), 1, Duration::from_secs(10)).await;
    assert_eq!(
        header_text(&dead[0], header::DEAD_LETTER_REASON).as_deref(),
        Some("undecodable")
    );
    assert_eq!(header_text(&dead[0], header::SOURCE).as_deref(), Some(ingress.as_str()));
    assert_eq!(header_text(&dead[0], header::GROUP_ID).as_deref(), Some("no-type"));
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_gaps_follow_the_ladder_and_exhaustion_dead_letters() {
    let ladder = [Duration::from_millis(300), Duration::from_millis(600)];
    let mut h = start(2, &ladder, 3).await;
    let m = msg("retry", Some("r-1"), "x");
    h.publish(&m).await;
    let ids = HashSet::from([m.id.clone()]);
    let outcomes = h.wait_outcomes(&ids, Duration::from_secs(20)).await;
    assert!(matches!(outcomes.get(&m.id), Some(Outcome::DeadLettered(_))));
    let calls = h.obs.calls.of(&m.id);
    assert_eq!(calls.iter().map(|c| c.attempt).collect::<Vec<_>>(), vec![1, 2, 3]);
    for (i, rung) in ladder.iter().enumerate() {
        let gap = calls[i + 1].start - calls[i].end.unwrap();
        // Never early (the rung is served); late only by scheduling, which a
        // loaded machine stretches: the bound says "this rung, not a stall".
        assert!(
            gap >= *rung && gap < *rung + Duration::from_secs(3),
            "gap before delivery {} was {gap:?}, rung {rung:?}",
            i + 2
        );
    }
    // A plain client reads the dead letter, with every provenance header.
    let dead = read_queue(&names::dead_letter(&h.name), 1, Duration::from_secs(10)).await;
    let d = &dead[0];
    assert_eq!(d.properties.delivery_mode(), &Some(2));
    assert_eq!(header_text(d, header::MESSAGE_ID).as_deref(), Some(m.id.as_str()));
    assert_eq!(header_text(d, header::MESSAGE_TYPE).as_deref(), Some("retry"));
    assert_eq!(header_text(d, header::GROUP_ID).as_deref(), Some("r-1"));
    assert_eq!(header_text(d, header::ATTEMPT).as_deref(), Some("3"));
    assert_eq!(header_text(d, header::DEAD_LETTER_REASON).as_deref(), Some("exhausted"));
    assert_eq!(header_text(d, header::ERROR).as_deref(), Some("retry by test"));
    let slot = partition::slot_for(Some("r-1"), "", h.slots);
    assert_eq!(header_text(d, header::SOURCE), Some(names::slot_queue(&h.name, slot)));
    assert_eq!(header_text(d, header::HANDLER).as_deref(), Some("faulty"));
    assert!(header_text(d, header::HANDLER_VERSION).is_some_and(|v| !v.is_empty()));
    assert!(header_text(d, header::FAILED_AT).is_some_and(|v| v.contains('T')));
    assert_eq!(d.data, b"x");
    h.shutdown().await;
}

/// The broker's pid for the connection this test's node named itself with.
fn connection_pids(name: &str) -> Vec<String> {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["list_connections", "-q", "pid", "client_properties"])
        .output()
        .expect("rabbitmqctl runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(name))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_closed_by_the_broker_resumes_without_loss_or_overlap() {
    let mut h = start(4, &[Duration::from_millis(200)], 5).await;
    // Found before the stream starts: rabbitmqctl takes a second or two.
    let pids = connection_pids(&format!("weir {}", h.node_name));
    assert_eq!(pids.len(), 1, "the node has one connection");
    let mut ids = HashSet::new();
    for _round in 0..40 {
        for g in 0..8 {
            let m = msg("slow", Some(&format!("cl-{g}")), "25");
            ids.insert(m.id.clone());
            h.publish(&m).await;
        }
    }
    let start = Instant::now();
    while h.obs.ledger.outcomes().len() < ids.len() / 4 {
        assert!(start.elapsed() < Duration::from_secs(30), "progress before the fault");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let status = std::process::Command::new("rabbitmqctl")
        .args(["close_connection", &pids[0], "test: closed by the broker"])
        .status()
        .unwrap();
    assert!(status.success());
    let before = h.obs.ledger.outcomes().len();
    assert!(before < ids.len(), "the fault hit mid-stream");

    let outcomes = h.wait_outcomes(&ids, Duration::from_secs(90)).await;
    h.shutdown().await;
    assert!(
        ids.iter().all(|id| outcomes.get(id) == Some(&Outcome::Handled)),
        "nothing lost"
    );
    assert_eq!(h.obs.ledger.overlaps(), 0, "no overlap across the reconnect");
    assert!(
        h.subscriptions.load(Ordering::Relaxed) > h.slots,
        "the slots were subscribed again after the fault"
    );
}
