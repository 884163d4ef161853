//! The RabbitMQ transport against the real broker (amqp://127.0.0.1:5672,
//! override with WEIR_TEST_AMQP_URL): a node with the faulty test guest, a
//! ledger of calls and settlements, and a recording wrapper around the
//! transport that notes which queue delivered each message. Every test uses
//! its own topology `t-<uuid8>` and deletes its queues and exchanges when it
//! ends, also when it fails, so the tests run in parallel and repeatedly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt as _;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use parking_lot::Mutex;
use weir::config::{self, Config, RetrySection, TransportKind};
use weir::envelope::{self, Envelope, Wire, header};
use weir::ledger::Ledger;
use weir::node::{Node, NodeOptions, bundled};
use weir::partition;
use weir::retry::capture::Outcome;
use weir::runtime::{CallObserver, RuntimeOptions};
use weir::transport::rabbitmq::{RabbitMq, names};
use weir::transport::{Delivery, RetryOwner, Subscription, TopologySpec, Transport, TransportError};

use common::rabbit::{Topo, url};

/// One delivery as the recording transport saw it.
#[derive(Debug, Clone)]
struct Seen {
    id: String,
    group: Option<String>,
    source: String,
}

/// Wraps the real transport and notes every delivery's id, group and queue.
struct Recording {
    inner: RabbitMq,
    seen: Arc<Mutex<Vec<Seen>>>,
    subscriptions: Arc<AtomicU32>,
}

struct RecordingSub {
    inner: Box<dyn Subscription>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl RecordingSub {
    fn note(&self, d: &Option<Result<Delivery, TransportError>>) {
        if let Some(Ok(d)) = d
            && let Ok(env) = &d.message
        {
            self.seen.lock().push(Seen {
                id: env.id.clone(),
                group: env.group_id.clone(),
                source: d.source.to_string(),
            });
        }
    }
}

#[async_trait]
impl Subscription for RecordingSub {
    async fn next(&mut self) -> Option<Result<Delivery, TransportError>> {
        let d = self.inner.next().await;
        self.note(&d);
        d
    }
    fn try_next(&mut self) -> Option<Result<Delivery, TransportError>> {
        let d = self.inner.try_next();
        self.note(&d);
        d
    }
}

#[async_trait]
impl Transport for Recording {
    fn system(&self) -> &'static str {
        self.inner.system()
    }
    fn retry_owner(&self) -> RetryOwner {
        self.inner.retry_owner()
    }
    async fn declare(&self, t: &TopologySpec) -> Result<(), TransportError> {
        self.inner.declare(t).await
    }
    async fn subscribe(&self, t: &str, slot: u32, prefetch: u32) -> Result<Box<dyn Subscription>, TransportError> {
        let inner = self.inner.subscribe(t, slot, prefetch).await?;
        self.subscriptions.fetch_add(1, Ordering::Relaxed);
        Ok(Box::new(RecordingSub {
            inner,
            seen: self.seen.clone(),
        }))
    }
    async fn subscribe_ingress(&self, t: &str, prefetch: u32) -> Result<Option<Box<dyn Subscription>>, TransportError> {
        self.inner.subscribe_ingress(t, prefetch).await
    }
    async fn publish(&self, t: &str, slot: u32, wire: Wire) -> Result<(), TransportError> {
        self.inner.publish(t, slot, wire).await
    }
    async fn publish_dead_letter(&self, t: &str, wire: Wire) -> Result<(), TransportError> {
        self.inner.publish_dead_letter(t, wire).await
    }
}

/// Ledger plus a timestamped call log.
#[derive(Default)]
struct Observer {
    ledger: Ledger,
    calls: common::CallLog,
}

impl CallObserver for Observer {
    fn before(&self, msg: &Envelope) {
        self.ledger.before(msg);
        self.calls.before(msg);
    }
    fn after(&self, msg: &Envelope) {
        self.calls.after(msg);
        self.ledger.after(msg);
    }
}

/// Fields drop in order: the node (its tasks aborted) before the topology's
/// objects are deleted, so a failing test cannot re-declare them afterwards.
struct Harness {
    node: Option<Node>,
    topo: Topo,
    obs: Arc<Observer>,
    ledger: Arc<LedgerSettle>,
    seen: Arc<Mutex<Vec<Seen>>>,
    subscriptions: Arc<AtomicU32>,
    node_name: String,
}

/// Settlements go to the observer's ledger.
struct LedgerSettle(Arc<Observer>);

impl weir::lanes::SettleObserver for LedgerSettle {
    fn settled(&self, id: &str, outcome: Outcome) {
        self.0.ledger.settled(id, outcome);
    }
}

fn config(topo: &Topo, ladder: &[Duration], max_deliver: i64, node_name: &str) -> Config {
    let mut t = config::Topology::new(&topo.name, topo.slots);
    t.max_concurrent_groups = 16;
    t.max_unordered = 16;
    t.retry = Some(RetrySection {
        ladder: Some(ladder.to_vec()),
        max_deliver: Some(max_deliver),
        ..Default::default()
    });
    let types = ["slow", "ok", "reject", "retry", "publish"].map(String::from).to_vec();
    let h = config::Handler::new("faulty", bundled::FAULTY_PATH, &topo.name, types);
    Config {
        node: config::Node {
            name: node_name.into(),
            admin: None,
        },
        transport: config::Transport {
            kind: TransportKind::Rabbitmq,
            url: Some(url()),
            prefetch: 64,
        },
        cluster: config::Cluster::default(),
        topology: vec![t],
        handler: vec![h],
        origin: "<rabbitmq test>".into(),
    }
}

impl Harness {
    async fn start(slots: u32, ladder: &[Duration], max_deliver: i64) -> Self {
        let topo = Topo::new(slots, ladder);
        let node_name = format!("node-{}", topo.name);
        let cfg = config(&topo, ladder, max_deliver, &node_name);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let subscriptions = Arc::new(AtomicU32::new(0));
        let transport = Arc::new(Recording {
            inner: RabbitMq::new(url(), format!("weir {node_name}")),
            seen: seen.clone(),
            subscriptions: subscriptions.clone(),
        });
        let obs = Arc::new(Observer::default());
        let ledger = Arc::new(LedgerSettle(obs.clone()));
        let opts = NodeOptions {
            workers: 2,
            runtime: common::cached(RuntimeOptions::default()),
            call_observer: Some(obs.clone()),
            settle_observer: Some(ledger.clone()),
            ..NodeOptions::default()
        };
        let node = Node::start(&cfg, transport, opts)
            .await
            .expect("node starts on RabbitMQ");
        Self {
            topo,
            node: Some(node),
            obs,
            ledger,
            seen,
            subscriptions,
            node_name,
        }
    }

    fn node(&self) -> &Node {
        self.node.as_ref().unwrap()
    }

    async fn publish(&self, env: &Envelope) {
        self.node()
            .publish(&self.topo.name, env)
            .await
            .expect("confirmed publish");
    }

    async fn wait_outcomes(&self, ids: &HashSet<String>, timeout: Duration) -> HashMap<String, Outcome> {
        let start = Instant::now();
        loop {
            let outcomes = self.obs.ledger.outcomes();
            if ids.iter().all(|id| outcomes.contains_key(id)) {
                return outcomes;
            }
            assert!(
                start.elapsed() < timeout,
                "timed out: {} of {} messages settled",
                ids.iter().filter(|id| outcomes.contains_key(*id)).count(),
                ids.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn shutdown(&mut self) {
        if let Some(node) = self.node.take() {
            node.shutdown().await.expect("node drains");
        }
    }
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
    let mut h = Harness::start(4, &[Duration::from_millis(200)], 3).await;
    let groups: Vec<String> = (0..16).map(|g| format!("g-{g}")).collect();
    let mut ids = HashSet::new();
    for round in 0..5 {
        for g in &groups {
            let ms = if round % 2 == 0 { "5" } else { "1" };
            let m = msg("slow", Some(g), ms);
            ids.insert(m.id.clone());
            h.publish(&m).await;
        }
    }
    let outcomes = h.wait_outcomes(&ids, Duration::from_secs(60)).await;
    h.shutdown().await;

    assert!(
        ids.iter().all(|id| outcomes.get(id) == Some(&Outcome::Handled)),
        "every message handled"
    );
    assert_eq!(h.obs.ledger.overlaps(), 0, "two calls of one group ran at once");
    assert!(h.obs.ledger.peak_groups() >= 2, "groups ran in parallel");
    // Each group arrived only on the queue of its slot, and every slot was used.
    let mut sources: HashMap<String, HashSet<String>> = HashMap::new();
    for s in h.seen.lock().iter().filter(|s| ids.contains(&s.id)) {
        sources
            .entry(s.group.clone().unwrap())
            .or_default()
            .insert(s.source.clone());
    }
    assert_eq!(sources.len(), groups.len());
    let mut used = HashSet::new();
    for (g, queues) in &sources {
        let expected = names::slot_queue(&h.topo.name, partition::slot_for(Some(g), "", h.topo.slots));
        assert_eq!(queues, &HashSet::from([expected.clone()]), "group {g} straddled queues");
        used.insert(expected);
    }
    assert_eq!(used.len(), h.topo.slots as usize, "every slot used");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cascades_and_ingress_come_through_the_slot_queues() {
    let mut h = Harness::start(3, &[Duration::from_millis(200)], 3).await;
    // Cascades: the `publish` type publishes an `ok` of its group.
    let parents: Vec<Envelope> = (0..6).map(|i| msg("publish", Some(&format!("c-{i}")), "x")).collect();
    let mut ids: HashSet<String> = HashSet::new();
    for p in &parents {
        ids.insert(p.id.clone());
        ids.insert(envelope::cascade_id(&p.id, 0));
        h.publish(p).await;
    }
    // Ingress: a plain client sets only the group and type; one message lacks the type.
    let (conn, ch) = plain().await;
    ch.confirm_select(Default::default()).await.unwrap();
    let ingress = names::ingress(&h.topo.name);
    let mut ingress_ids = Vec::new();
    for i in 0..4 {
        let id = format!("in-{i}-{}", h.topo.name);
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
        let expected = partition::slot_for(s.group.as_deref(), id, h.topo.slots);
        assert_eq!(s.source, names::slot_queue(&h.topo.name, expected));
    }
    for (id, _) in &ingress_ids {
        assert!(called.contains(id), "ingress message {id} was forwarded and handled");
    }
    // The message without a type was dead-lettered `undecodable`, not dropped.
    let dead = read_queue(&names::dead_letter(&h.topo.name), 1, Duration::from_secs(10)).await;
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
    let mut h = Harness::start(2, &ladder, 3).await;
    let m = msg("retry", Some("r-1"), "x");
    h.publish(&m).await;
    let ids = HashSet::from([m.id.clone()]);
    let outcomes = h.wait_outcomes(&ids, Duration::from_secs(20)).await;
    assert!(matches!(outcomes.get(&m.id), Some(Outcome::DeadLettered(_))));
    let calls = h.obs.calls.of(&m.id);
    assert_eq!(calls.iter().map(|c| c.attempt).collect::<Vec<_>>(), vec![1, 2, 3]);
    for (i, rung) in ladder.iter().enumerate() {
        let gap = calls[i + 1].start - calls[i].end.unwrap();
        assert!(
            gap >= *rung && gap < *rung + Duration::from_millis(500),
            "gap before delivery {} was {gap:?}, rung {rung:?}",
            i + 2
        );
    }
    // A plain client reads the dead letter, with every provenance header.
    let dead = read_queue(&names::dead_letter(&h.topo.name), 1, Duration::from_secs(10)).await;
    let d = &dead[0];
    assert_eq!(d.properties.delivery_mode(), &Some(2));
    assert_eq!(header_text(d, header::MESSAGE_ID).as_deref(), Some(m.id.as_str()));
    assert_eq!(header_text(d, header::MESSAGE_TYPE).as_deref(), Some("retry"));
    assert_eq!(header_text(d, header::GROUP_ID).as_deref(), Some("r-1"));
    assert_eq!(header_text(d, header::ATTEMPT).as_deref(), Some("3"));
    assert_eq!(header_text(d, header::DEAD_LETTER_REASON).as_deref(), Some("exhausted"));
    assert_eq!(header_text(d, header::ERROR).as_deref(), Some("retry by test"));
    let slot = partition::slot_for(Some("r-1"), "", h.topo.slots);
    assert_eq!(
        header_text(d, header::SOURCE),
        Some(names::slot_queue(&h.topo.name, slot))
    );
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
    let mut h = Harness::start(4, &[Duration::from_millis(200)], 5).await;
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
        h.subscriptions.load(Ordering::Relaxed) > h.topo.slots,
        "the slots were subscribed again after the fault"
    );
    let _ = &h.ledger;
}
