//! Replicated broker objects against the real local brokers (issue 20, item
//! 1): RabbitMQ quorum queues end to end, a queue of the other type refused
//! naming `transport.queue_type`, `transport.replicas = 3` refused on the
//! single local nats-server naming the key, and `transport.url` lists whose
//! first URL is dead. Every test uses its own topology `t-<uuid8>` and
//! deletes its broker objects when it ends.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use weir::config::{QueueType, TransportKind};
use weir::envelope::{self, Envelope, header};
use weir::outcome::Outcome;
use weir::transport::nats::{Nats, NatsOptions};
use weir::transport::rabbitmq::queue_type::{QUORUM_TTL_SINCE, Version};
use weir::transport::rabbitmq::{RabbitMq, names};
use weir::transport::{TopologySpec, Transport};

use common::compliance::{self, Harness, Subject};
use common::rabbit::{Topo, url};

const DEAD_AMQP: &str = "amqp://guest:secret-pw@127.0.0.1:1/%2f";
const DEAD_NATS: &str = "nats://127.0.0.1:1";

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A node on RabbitMQ with quorum queues for a fresh topology.
async fn start_quorum(slots: u32, ladder: &[Duration], max_deliver: i64, extra: &[&str]) -> Harness<Topo> {
    let topo = Topo::new(slots, ladder);
    let name = topo.name.clone();
    let subject = Subject {
        transport: Arc::new(RabbitMq::with_settings(
            vec![url()],
            format!("weir node-{name}"),
            QueueType::Quorum,
        )),
        kind: TransportKind::Rabbitmq,
        url: Some(url()),
    };
    Harness::start_typed(subject, &name, slots, ladder, max_deliver, topo, extra).await
}

/// Declare `queue` with `args` on a channel of its own: `Err` with the
/// broker's answer when it refuses.
async fn redeclare(queue: &str, args: FieldTable) -> Result<(), String> {
    let conn = Connection::connect(&url(), ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let opts = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let r = ch
        .queue_declare(queue.into(), opts, args)
        .await
        .map(drop)
        .map_err(|e| e.to_string());
    let _ = conn.close(200, "done".into()).await;
    r
}

fn classic_args() -> FieldTable {
    let mut a = FieldTable::default();
    a.insert("x-queue-type".into(), AMQPValue::LongString("classic".into()));
    a
}

async fn read_queue(queue: &str, n: usize, timeout: Duration) -> Vec<lapin::message::Delivery> {
    let conn = Connection::connect(&url(), ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
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
    while out.len() < n {
        let d = tokio::time::timeout(timeout, consumer.next())
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

/// The type of each queue of `topology`, as `rabbitmqctl` lists them.
fn queue_types(topology: &str) -> HashMap<String, String> {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["list_queues", "-q", "--no-table-headers", "name", "type"])
        .output()
        .expect("rabbitmqctl runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            Some((it.next()?.to_owned(), it.next()?.to_owned()))
        })
        .filter(|(n, _)| n.starts_with(&format!("weir.{topology}.")))
        .collect()
}

fn header_text(d: &lapin::message::Delivery, name: &str) -> Option<String> {
    match d.properties.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(s.to_string()),
        other => Some(format!("{other:?}")),
    }
}

/// The quorum-queue path end to end on the local broker: the server version
/// is read, every queue is a quorum queue, groups run in order without
/// overlap, a retry goes through a quorum rung (TTL, at-least-once
/// dead-lettering back to its slot) and then succeeds, and a rejected
/// message is captured on the quorum dead-letter queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_queues_end_to_end_order_retry_and_dead_letter() {
    let mut h = start_quorum(3, &[ms(300)], 3, &["wb.publish-retry-first"]).await;
    let name = h.name.clone();

    // Every queue the node declared is a quorum queue (as the broker lists
    // them), and a classic declaration of one is refused.
    let spec = {
        let mut s = TopologySpec::new(&name, 3);
        s.retry.ladder = vec![ms(300)];
        s
    };
    let types = queue_types(&name);
    let queues = names::queues(&name, 3, &weir::transport::rabbitmq::rungs(&spec));
    for q in &queues {
        assert_eq!(types.get(q).map(String::as_str), Some("quorum"), "{q}: {types:?}");
    }
    let e = redeclare(&queues[0], classic_args()).await.expect_err("a quorum queue");
    assert!(e.contains("PRECONDITION"), "{e}");

    // Groups in order: 6 groups × 5 messages, each group's in publish order.
    let mut order: HashMap<String, Vec<String>> = HashMap::new();
    let mut ids = HashSet::new();
    for round in 0..5 {
        for g in 0..6 {
            let group = format!("g-{g}");
            let m = common::message("slow", Some(&group), if round % 2 == 0 { b"3" } else { b"1" });
            order.entry(group).or_default().push(m.id.clone());
            ids.insert(m.id.clone());
            h.publish(&m).await;
        }
    }
    let retried = common::message("wb.publish-retry-first", Some("r-1"), b"x");
    let cascade = envelope::cascade_id(&retried, 0);
    let rejected: Envelope = common::message("reject", Some("d-1"), b"poison");
    h.publish(&retried).await;
    h.publish(&rejected).await;
    ids.extend([retried.id.clone(), rejected.id.clone()]);

    let outcomes = h.wait_outcomes(&ids, Duration::from_secs(60)).await;
    for id in order.values().flatten() {
        assert_eq!(outcomes.get(id), Some(&Outcome::Handled), "{id}");
    }
    assert_eq!(outcomes.get(&retried.id), Some(&Outcome::Handled));
    assert!(matches!(outcomes.get(&rejected.id), Some(Outcome::DeadLettered(_))));
    h.wait_for(&cascade, Outcome::Handled, Duration::from_secs(30)).await;

    assert_eq!(h.obs.ledger.overlaps(), 0, "two calls of one group ran at once");
    let calls = h.obs.calls.all();
    for (group, published) in &order {
        let ran: Vec<String> = calls
            .iter()
            .filter(|c| c.group.as_deref() == Some(group.as_str()))
            .map(|c| c.id.clone())
            .collect();
        assert_eq!(&ran, published, "group {group} ran out of order");
    }
    // The retry went through the quorum rung and came back after it.
    let r = h.obs.calls.of(&retried.id);
    assert_eq!(r.iter().map(|c| c.attempt).collect::<Vec<_>>(), vec![1, 2]);
    let gap = r[1].start - r[0].end.unwrap();
    assert!(gap >= ms(300) && gap < ms(300) + Duration::from_secs(3), "gap {gap:?}");

    // The dead letter is on the quorum dead-letter queue with its provenance.
    let dead = read_queue(&names::dead_letter(&name), 1, Duration::from_secs(10)).await;
    assert_eq!(header_text(&dead[0], header::MESSAGE_ID), Some(rejected.id.clone()));
    assert_eq!(
        header_text(&dead[0], header::DEAD_LETTER_REASON).as_deref(),
        Some("rejected")
    );
    assert_eq!(dead[0].data, b"poison");
    h.shutdown().await;
}

/// The quorum transport reads the server's version at connect (the local
/// broker is 3.10 or later, so a topology with a ladder is accepted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_version_is_read_and_a_ladder_on_quorum_queues_is_accepted_on_3_10() {
    let topo = Topo::new(1, &[ms(500)]);
    let t = RabbitMq::with_settings(vec![url()], "replicated-version", QueueType::Quorum);
    let mut spec = TopologySpec::new(&topo.name, 1);
    spec.retry.ladder = vec![ms(500)];
    t.declare(&spec)
        .await
        .expect("quorum queues with a ladder on this server");
    let v = t.server_version().expect("the version is read");
    assert!(v >= QUORUM_TTL_SINCE, "the local broker is {v}");
    // The same check refuses the combination on an older server.
    let e = weir::transport::rabbitmq::queue_type::check(QueueType::Quorum, Some(Version(3, 9, 29)), &topo.name, 1)
        .unwrap_err();
    assert!(e.to_string().contains("transport.queue_type"), "{e}");
    t.close().await;
}

/// Queues that exist with the other type are refused, and the error names
/// `transport.queue_type` (both directions).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_of_the_other_type_is_refused_naming_the_key() {
    for (first, second) in [
        (QueueType::Classic, QueueType::Quorum),
        (QueueType::Quorum, QueueType::Classic),
    ] {
        let topo = Topo::new(2, &[ms(200)]);
        let mut spec = TopologySpec::new(&topo.name, 2);
        spec.retry.ladder = vec![ms(200)];
        let a = RabbitMq::with_settings(vec![url()], "replicated-first", first);
        a.declare(&spec).await.expect("first declaration");
        a.close().await;
        let b = RabbitMq::with_settings(vec![url()], "replicated-second", second);
        let e = b.declare(&spec).await.expect_err("the other type is refused");
        let text = e.to_string();
        assert!(
            text.contains(&format!("transport.queue_type = \"{second}\"")),
            "{first} then {second}: {text}"
        );
        b.close().await;
    }
}

/// `transport.replicas = 3` on the single local nats-server stops the start
/// with the key at fault, through the config → transport path; nothing is
/// created. One replica on the same server is accepted (the control).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_on_a_single_nats_server_are_refused_naming_the_key() {
    let topo = common::nats::Topo::new();
    let subject = Subject {
        transport: Arc::new(Nats::new(topo.url.clone(), "unused")),
        kind: TransportKind::Nats,
        url: Some(topo.url.clone()),
    };
    let mut cfg = compliance::config(&subject, &topo.name, 2, &[ms(500)], 3, "replicas-node");
    cfg.transport.replicas = Some(3);
    cfg.validate().expect("valid as a config: the server decides");
    let t = weir::transport::connect::for_config(&cfg).unwrap();
    let spec = TopologySpec::new(&topo.name, 2);
    let e = t.declare(&spec).await.expect_err("R3 on one server");
    let text = e.to_string();
    assert!(text.contains("transport.replicas = 3"), "{text}");
    assert!(text.contains("single server"), "{text}");
    let js = common::nats::js_at(&topo.url).await;
    assert!(
        js.get_stream(weir::transport::nats::names::stream(&topo.name))
            .await
            .is_err(),
        "nothing was created"
    );

    cfg.transport.replicas = Some(1);
    let t = weir::transport::connect::for_config(&cfg).unwrap();
    t.declare(&spec).await.expect("one replica on one server");
    let info = js
        .get_stream(weir::transport::nats::names::stream(&topo.name))
        .await
        .unwrap()
        .cached_info()
        .clone();
    assert_eq!(info.config.num_replicas, 1);
}

/// Several RabbitMQ URLs whose first is dead: the transport connects to the
/// second and works; when all are dead the error lists each without its
/// password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_urls_are_tried_in_order_and_passwords_stay_hidden() {
    let topo = Topo::new(1, &[]);
    let toml_urls = vec![DEAD_AMQP.to_owned(), url()];
    let t = RabbitMq::with_settings(toml_urls, "replicated-urls", QueueType::Classic);
    let spec = TopologySpec::new(&topo.name, 1);
    t.declare(&spec).await.expect("the second URL answers");
    let m = common::message("ok", Some("u-1"), b"x");
    weir::transport::publish_to_slot(&t, &topo.name, 1, &m)
        .await
        .expect("published");
    assert_eq!(t.backlog(&topo.name, 0).await.unwrap(), Some(1));
    t.close().await;

    let dead = RabbitMq::with_settings(
        vec![DEAD_AMQP.to_owned(), "amqp://guest:other-pw@127.0.0.1:2/%2f".to_owned()],
        "replicated-dead",
        QueueType::Classic,
    );
    let e = dead.declare(&spec).await.expect_err("nothing answers");
    let text = e.to_string();
    assert!(text.contains("127.0.0.1:1") && text.contains("127.0.0.1:2"), "{text}");
    assert!(!text.contains("secret-pw") && !text.contains("other-pw"), "{text}");
}

/// Several NATS URLs whose first is dead: async-nats connects to the second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_urls_fail_over_to_the_live_server() {
    let topo = common::nats::Topo::new();
    let t = Nats::with_urls(
        vec![DEAD_NATS.to_owned(), topo.url.clone()],
        "replicated-urls",
        NatsOptions::default(),
    );
    let spec = TopologySpec::new(&topo.name, 1);
    t.declare(&spec).await.expect("the second URL answers");
    let m = common::message("ok", Some("u-1"), b"x");
    weir::transport::publish_to_slot(&t, &topo.name, 1, &m)
        .await
        .expect("published");
}

/// The config keys reach the transports: a TOML `url` list whose first URL
/// is dead and `queue_type = "quorum"` give a RabbitMQ transport that
/// declares quorum queues on the live broker; a NATS list the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_url_lists_and_queue_type_reach_the_transports() {
    let topo = Topo::new(1, &[ms(400)]);
    let text = format!(
        r#"
[transport]
kind = "rabbitmq"
url = ["{DEAD_AMQP}", "{live}"]
queue_type = "quorum"
[[topology]]
name = "{name}"
slots = 1
[topology.retry]
ladder = ["400ms"]
max_deliver = 3
"#,
        live = url(),
        name = topo.name,
    );
    let cfg = weir::config::parse(&text, "<replicated test>").expect("valid");
    let t = weir::transport::connect::for_config(&cfg).unwrap();
    let mut spec = TopologySpec::new(&topo.name, 1);
    spec.retry.ladder = vec![ms(400)];
    t.declare(&spec).await.expect("declared through the second URL");
    let types = queue_types(&topo.name);
    assert_eq!(types.len(), 4, "{types:?}");
    assert!(types.values().all(|t| t == "quorum"), "{types:?}");

    let nats = common::nats::Topo::new();
    let text = format!(
        "[transport]\nkind = \"nats\"\nurl = [\"{DEAD_NATS}\", \"{live}\"]\n[[topology]]\nname = \"{name}\"\nslots = 1\n",
        live = nats.url,
        name = nats.name,
    );
    let cfg = weir::config::parse(&text, "<replicated test>").expect("valid");
    let t = weir::transport::connect::for_config(&cfg).unwrap();
    t.declare(&TopologySpec::new(&nats.name, 1))
        .await
        .expect("declared through the second URL");
}
