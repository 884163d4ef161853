//! The transport-agnostic compliance harness: a node with the faulty test
//! guest on any [`Transport`], a ledger of calls and settlements, and a
//! recording wrapper that notes which queue or subject delivered each
//! message; [`burst_of_groups`] holds the assertions every transport must
//! pass (memory, RabbitMQ, NATS).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use parking_lot::Mutex;
use weir::config::{self, Config, RetrySection, TransportKind};
use weir::envelope::{Envelope, Wire};
use weir::node::{Node, NodeOptions, bundled};
use weir::observe::ledger::Ledger;
use weir::outcome::Outcome;
use weir::partition;
use weir::runtime::{CallObserver, RuntimeOptions};
use weir::transport::nats::floor::FloorState;
use weir::transport::{Delivery, RetryFacts, RetryOwner, Subscription, TopologySpec, Transport, TransportError};

/// One delivery as the recording transport saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Message id.
    pub id: String,
    /// Group id.
    pub group: Option<String>,
    /// Queue or subject that delivered it.
    pub source: String,
}

/// Wraps the real transport and notes every delivery's id, group and queue;
/// everything else (closing, the broker's retry facts, the ack floor) is
/// passed through untouched.
pub struct Recording {
    inner: Arc<dyn Transport>,
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
    async fn close(&mut self) {
        self.inner.close().await;
    }
    async fn stop(&mut self) -> bool {
        self.inner.stop().await
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
    async fn retry_facts(&self, t: &str) -> Result<Option<RetryFacts>, TransportError> {
        self.inner.retry_facts(t).await
    }
    fn ack_floor(&self) -> Vec<FloorState> {
        self.inner.ack_floor()
    }
    async fn close(&self) {
        self.inner.close().await;
    }
}

/// Ledger plus a timestamped call log.
#[derive(Default)]
pub struct Observer {
    /// Claims, order and outcomes.
    pub ledger: Ledger,
    /// Timestamped calls.
    pub calls: super::CallLog,
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

/// A node on a real (or memory) transport with the faulty guest, a ledger,
/// and a record of which queue or subject delivered each message. Fields
/// drop in order: the node (its tasks aborted) before `guard`, which
/// deletes the topology's broker objects, so a failing test cannot
/// re-declare them afterwards.
pub struct Harness<G> {
    /// The node, until `shutdown`.
    pub node: Option<Node>,
    /// Topology name.
    pub name: String,
    /// Its slot count.
    pub slots: u32,
    /// Cleans up the broker objects when dropped.
    pub guard: G,
    /// Calls and outcomes.
    pub obs: Arc<Observer>,
    ledger: Arc<LedgerSettle>,
    /// Every delivery the node received.
    pub seen: Arc<Mutex<Vec<Seen>>>,
    /// Subscriptions made (resubscriptions after a fault count too).
    pub subscriptions: Arc<AtomicU32>,
    /// The node's name (also in its broker connection name).
    pub node_name: String,
}

/// What the harness needs to know of the transport under test.
pub struct Subject {
    /// The transport, unwrapped.
    pub transport: Arc<dyn Transport>,
    /// Its config kind.
    pub kind: TransportKind,
    /// Its URL, if it has one.
    pub url: Option<String>,
}

/// Settlements go to the observer's ledger, and every outcome is kept in
/// order (the ledger keeps only the last of each message).
pub struct LedgerSettle(Arc<Observer>, Mutex<Vec<(String, Outcome)>>);

impl LedgerSettle {
    /// Settlements of nodes that report to `obs`.
    pub fn new(obs: Arc<Observer>) -> Self {
        Self(obs, Mutex::new(Vec::new()))
    }

    /// Every settlement so far, in order.
    pub fn all(&self) -> Vec<(String, Outcome)> {
        self.1.lock().clone()
    }
}

impl weir::outcome::SettleObserver for LedgerSettle {
    fn settled(&self, id: &str, outcome: Outcome) {
        self.0.ledger.settled(id, outcome);
        self.1.lock().push((id.to_owned(), outcome));
    }
}

/// The config the harness gives its node: the faulty guest on topology
/// `name` with this ladder and `max_deliver`, as node `node_name`.
pub fn config(
    subject: &Subject,
    name: &str,
    slots: u32,
    ladder: &[Duration],
    max_deliver: i64,
    node_name: &str,
) -> Config {
    config_typed(subject, name, slots, ladder, max_deliver, node_name, &[])
}

/// [`config`] with more message types bound to the faulty guest.
pub fn config_typed(
    subject: &Subject,
    name: &str,
    slots: u32,
    ladder: &[Duration],
    max_deliver: i64,
    node_name: &str,
    extra_types: &[&str],
) -> Config {
    let mut t = config::Topology::new(name, slots);
    t.max_concurrent_groups = 16;
    t.max_unordered = 16;
    t.retry = Some(RetrySection {
        ladder: Some(ladder.to_vec()),
        max_deliver: Some(max_deliver),
        ..Default::default()
    });
    let mut types = ["slow", "ok", "reject", "retry", "publish"].map(String::from).to_vec();
    types.extend(extra_types.iter().map(|t| (*t).to_owned()));
    let h = config::Handler::new("faulty", bundled::FAULTY_PATH, name, types);
    Config {
        node: config::Node {
            name: node_name.into(),
            admin: None,
            ..config::Node::default()
        },
        transport: config::Transport {
            kind: subject.kind,
            url: subject.url.clone().map(Into::into),
            prefetch: 64,
            ..Default::default()
        },
        cluster: config::Cluster::default(),
        topology: vec![t],
        handler: vec![h],
        tenant: Vec::new(),
        telemetry: Default::default(),
        origin: "<compliance test>".into(),
    }
}

impl<G> Harness<G> {
    /// Start a node on `subject` for topology `name` (declared by the node).
    pub async fn start(
        subject: Subject,
        name: &str,
        slots: u32,
        ladder: &[Duration],
        max_deliver: i64,
        guard: G,
    ) -> Self {
        Self::start_typed(subject, name, slots, ladder, max_deliver, guard, &[]).await
    }

    /// [`Harness::start`] with more message types bound to the faulty guest.
    pub async fn start_typed(
        subject: Subject,
        name: &str,
        slots: u32,
        ladder: &[Duration],
        max_deliver: i64,
        guard: G,
        extra_types: &[&str],
    ) -> Self {
        let node_name = format!("node-{name}");
        let cfg = config_typed(&subject, name, slots, ladder, max_deliver, &node_name, extra_types);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let subscriptions = Arc::new(AtomicU32::new(0));
        let transport = Arc::new(Recording {
            inner: subject.transport,
            seen: seen.clone(),
            subscriptions: subscriptions.clone(),
        });
        let obs = Arc::new(Observer::default());
        let ledger = Arc::new(LedgerSettle(obs.clone(), Mutex::new(Vec::new())));
        let opts = NodeOptions {
            workers: 2,
            runtime: super::cached(RuntimeOptions::default()),
            call_observer: Some(obs.clone()),
            settle_observer: Some(ledger.clone()),
            ..NodeOptions::default()
        };
        let node = Node::start(&cfg, transport, opts).await.expect("the node starts");
        Self {
            node: Some(node),
            name: name.to_owned(),
            slots,
            guard,
            obs,
            ledger,
            seen,
            subscriptions,
            node_name,
        }
    }

    /// The running node.
    pub fn node(&self) -> &Node {
        self.node.as_ref().unwrap()
    }

    /// Publish through the broker to the slot of its group.
    pub async fn publish(&self, env: &Envelope) {
        self.node().publish(&self.name, env).await.expect("confirmed publish");
    }

    /// Wait until every id has a final outcome.
    pub async fn wait_outcomes(&self, ids: &HashSet<String>, timeout: Duration) -> HashMap<String, Outcome> {
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

    /// Every outcome `id` was settled with so far, in order.
    pub fn settled_of(&self, id: &str) -> Vec<Outcome> {
        self.ledger
            .1
            .lock()
            .iter()
            .filter(|(i, _)| i == id)
            .map(|(_, o)| *o)
            .collect()
    }

    /// Wait until `id` has been settled with `outcome`.
    pub async fn wait_for(&self, id: &str, outcome: Outcome, timeout: Duration) {
        let start = Instant::now();
        while !self.settled_of(id).contains(&outcome) {
            assert!(
                start.elapsed() < timeout,
                "timed out waiting for {outcome:?} of {id}; settled so far: {:?}",
                self.ledger.1.lock()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Drain and stop the node.
    pub async fn shutdown(&mut self) {
        if let Some(node) = self.node.take() {
            node.shutdown().await.expect("node drains");
        }
    }
}

/// The compliance assertions over a burst of grouped messages (16 groups ×
/// 5, slow calls of 1–5 ms): every message handled, no intra-group
/// overlap, groups in parallel, each group delivered only by the source of
/// its slot (`slot_source(n)`), and every slot used.
pub async fn burst_of_groups<G>(h: &mut Harness<G>, slot_source: impl Fn(u32) -> String) {
    let groups: Vec<String> = (0..16).map(|g| format!("g-{g}")).collect();
    let mut ids = HashSet::new();
    for round in 0..5 {
        for g in &groups {
            let ms = if round % 2 == 0 { "5" } else { "1" };
            let m = super::message("slow", Some(g), ms.as_bytes());
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
    let mut sources: HashMap<String, HashSet<String>> = HashMap::new();
    for s in h.seen.lock().iter().filter(|s| ids.contains(&s.id)) {
        sources
            .entry(s.group.clone().unwrap())
            .or_default()
            .insert(s.source.clone());
    }
    assert_eq!(sources.len(), groups.len());
    let mut used = HashSet::new();
    for (g, from) in &sources {
        let expected = slot_source(partition::slot_for(Some(g), "", h.slots));
        assert_eq!(from, &HashSet::from([expected.clone()]), "group {g} straddled slots");
        used.insert(expected);
    }
    assert_eq!(used.len(), h.slots as usize, "every slot used");
}
