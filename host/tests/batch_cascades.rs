//! The cascades of a batch belong to its members (issue 14, item 8) and
//! cascade ids are keyed by tenant and type (issue 15, item 9), on the memory
//! broker and on RabbitMQ (amqp://127.0.0.1:5672, override with
//! WEIR_TEST_AMQP_URL; each RabbitMQ test declares its own `t-<uuid8>`
//! topology and deletes it afterwards). Real wasmtime and the faulty test
//! guest, whose `wb.` types publish an `ok` in their own group and then
//! succeed, answer `retry` on their first attempt, or reject.
//!
//! Asserted: in one batch of a member that publishes and succeeds, one that
//! publishes and retries, and one that publishes and rejects, only the
//! succeeding member's cascade goes out; the retried member's goes out exactly
//! once, after its retry; the rejected member's never. A batch that publishes
//! for no member (the 0.1.0 way) and has a failing member is replayed member
//! by member, with the same result; so is a component built against
//! `weir:handler@0.1.0`, which has no `begin-member`. Two messages sharing a `weir-message-id`
//! across tenants or types cascade under distinct ids.
//!
//! "Exactly once" is checked without a sleep: every message of the scenario
//! is in one group, so once the retried member has settled (its cascade was
//! confirmed before its ack), a sentinel published after it runs only after
//! every cascade already on the slot queue has run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use weir::config::{self, Config, RetrySection, TransportKind};
use weir::envelope::{self, Envelope};
use weir::node::{Node, NodeOptions, bundled};
use weir::outcome::SettleObserver;
use weir::outcome::{Outcome, Reason};
use weir::runtime::CallObserver;
use weir::transport::Transport;
use weir::transport::memory::MemoryBroker;
use weir::transport::rabbitmq::RabbitMq;

use common::rabbit::{Topo, url};

const LADDER: [Duration; 1] = [Duration::from_millis(20)];
const TIMEOUT: Duration = Duration::from_secs(60);

/// A broker to run a scenario on; `guard` cleans up its objects on drop.
struct On {
    transport: Arc<dyn Transport>,
    kind: TransportKind,
    url: Option<String>,
    topology: String,
    _guard: Option<Topo>,
}

fn memory() -> On {
    On {
        transport: Arc::new(MemoryBroker::new()),
        kind: TransportKind::Memory,
        url: None,
        topology: "batch-cascades".into(),
        _guard: None,
    }
}

fn rabbit() -> On {
    let topo = Topo::new(1, &LADDER);
    On {
        transport: Arc::new(RabbitMq::new(url(), format!("weir batch-cascades-{}", topo.name))),
        kind: TransportKind::Rabbitmq,
        url: Some(url()),
        topology: topo.name.clone(),
        _guard: Some(topo),
    }
}

/// The test guest built against `weir:handler@0.1.0` (host/tests/guests/legacy,
/// built by host/build.rs beside the faulty guest).
fn legacy_path() -> String {
    std::path::Path::new(bundled::FAULTY_PATH)
        .with_file_name("weir_test_legacy.wasm")
        .display()
        .to_string()
}

/// Which guest runs a scenario.
#[derive(Clone, Copy)]
enum Guest {
    /// The faulty guest (0.2.0, the SDK).
    Faulty,
    /// The 0.1.0 guest: its `publish*` types batched, `ok` single.
    Legacy,
}

/// One slot; `ok` and `publish` single, the `wb.` types batched by three
/// (a lone member, such as a retry, runs after a linger of one second).
fn config(on: &On, guest: Guest) -> Config {
    let mut t = config::Topology::new(&on.topology, 1);
    t.retry = Some(RetrySection {
        ladder: Some(LADDER.to_vec()),
        max_deliver: Some(3),
        ..Default::default()
    });
    let (component, single, batched) = match guest {
        Guest::Faulty => (
            bundled::FAULTY_PATH.to_owned(),
            vec!["ok", "publish", "batch.publish"],
            vec![
                "wb.publish",
                "wb.publish-retry-first",
                "wb.publish-reject",
                "wb.legacy.publish",
                "wb.legacy.publish-retry-first",
                "wb.legacy.publish-reject",
            ],
        ),
        Guest::Legacy => (
            legacy_path(),
            vec!["ok"],
            vec!["publish", "publish-retry-first", "publish-reject"],
        ),
    };
    let mut h = config::Handler::new(
        "faulty",
        component,
        &on.topology,
        single.into_iter().map(String::from).collect(),
    );
    h.batch = Some(config::Batch {
        message_types: batched.into_iter().map(String::from).collect(),
        size: 3,
        linger: Duration::from_secs(1),
    });
    Config {
        node: config::Node {
            name: format!("node-{}", on.topology),
            admin: None,
            ..config::Node::default()
        },
        transport: config::Transport {
            kind: on.kind,
            url: on.url.clone().map(Into::into),
            prefetch: 64,
            ..Default::default()
        },
        cluster: config::Cluster::default(),
        topology: vec![t],
        handler: vec![h],
        tenant: Vec::new(),
        telemetry: Default::default(),
        origin: "<batch cascades test>".into(),
    }
}

fn msg(id: &str, t: &str, group: &str, tenant: Option<&str>) -> Envelope {
    envelope::new_message(
        id.to_owned(),
        t,
        Some(group.to_owned()),
        tenant.map(str::to_owned),
        Vec::new(),
        id.as_bytes().to_vec(),
    )
}

/// One guest call: whether it was `handle-batch`, and its members' (id, tenant).
type Seen = (bool, Vec<(String, Option<String>)>);

/// Every call (single or batch, with its members' ids) and every settlement.
#[derive(Default)]
struct Watch {
    calls: Mutex<Vec<Seen>>,
    settled: Mutex<HashMap<String, Vec<Outcome>>>,
}

impl Watch {
    fn note(&self, batch: bool, msgs: &[Envelope]) {
        let members = msgs.iter().map(|m| (m.id.clone(), m.tenant_id.clone())).collect();
        self.calls.lock().push((batch, members));
    }

    /// Single calls of message `id` (every delivery of a cascade is one).
    fn single_calls(&self, id: &str) -> usize {
        self.calls
            .lock()
            .iter()
            .filter(|(batch, m)| !batch && m[0].0 == id)
            .count()
    }

    fn batches(&self) -> Vec<Vec<String>> {
        self.calls
            .lock()
            .iter()
            .filter(|(batch, _)| *batch)
            .map(|(_, m)| m.iter().map(|(id, _)| id.clone()).collect())
            .collect()
    }

    fn settlements(&self, id: &str) -> Vec<Outcome> {
        self.settled.lock().get(id).cloned().unwrap_or_default()
    }

    async fn wait(&self, what: &str, f: impl Fn(&Self) -> bool) {
        let start = Instant::now();
        while !f(self) {
            assert!(
                start.elapsed() < TIMEOUT,
                "timed out after {TIMEOUT:?} waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl CallObserver for Watch {
    fn before(&self, msg: &Envelope) {
        self.note(false, std::slice::from_ref(msg));
    }
    fn after(&self, _: &Envelope) {}
    fn before_batch(&self, batch: &[Envelope]) {
        self.note(true, batch);
    }
    fn after_batch(&self, _: &[Envelope]) {}
}

impl SettleObserver for Watch {
    fn settled(&self, id: &str, outcome: Outcome) {
        self.settled.lock().entry(id.to_owned()).or_default().push(outcome);
    }
}

async fn start(on: &On, watch: &Arc<Watch>, guest: Guest) -> Node {
    let opts = NodeOptions {
        workers: 2,
        call_observer: Some(watch.clone()),
        settle_observer: Some(watch.clone()),
        ..NodeOptions::default()
    };
    Node::start(&config(on, guest), on.transport.clone(), opts)
        .await
        .unwrap()
}

/// Publish the three members of one batch (`prefix` `wb.` or `wb.legacy.`)
/// in group `g`, wait until each has settled as it should (the retried one
/// twice), then run a sentinel through the group's lane. Returns the members
/// (succeeds, retries first, rejects) and the node's batch replays.
async fn one_batch_of_three(on: &On, watch: &Arc<Watch>, guest: Guest, prefix: &str) -> ([Envelope; 3], u64) {
    let node = start(on, watch, guest).await;
    let tag = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let members = [
        msg(&format!("ok-{tag}"), &format!("{prefix}publish"), "g", Some("acme")),
        msg(
            &format!("retry-{tag}"),
            &format!("{prefix}publish-retry-first"),
            "g",
            Some("acme"),
        ),
        msg(
            &format!("reject-{tag}"),
            &format!("{prefix}publish-reject"),
            "g",
            Some("acme"),
        ),
    ];
    for m in &members {
        node.publish(&on.topology, m).await.unwrap();
    }
    let [ok, retry, reject] = &members;
    watch
        .wait("every member settled", |w| {
            w.settlements(&ok.id) == [Outcome::Handled]
                && w.settlements(&retry.id) == [Outcome::RetryScheduled, Outcome::Handled]
                && w.settlements(&reject.id) == [Outcome::DeadLettered(Reason::Rejected)]
        })
        .await;
    let sentinel = msg(&format!("sentinel-{tag}"), "ok", "g", Some("acme"));
    node.publish(&on.topology, &sentinel).await.unwrap();
    watch
        .wait("the sentinel handled", |w| {
            w.settlements(&sentinel.id) == [Outcome::Handled]
        })
        .await;
    let replays = node.stats().snapshot().batch_replays;
    node.shutdown().await.unwrap();
    let batches = watch.batches();
    assert_eq!(
        batches.first(),
        Some(&members.iter().map(|m| m.id.clone()).collect::<Vec<_>>()),
        "the three members must have formed one batch (all batch calls: {batches:?})"
    );
    (members, replays)
}

// ---------------------------------------------------------------- scenarios

/// 0.2.0, `begin-member` (the SDK's loop): each member's cascade goes out
/// only with that member's success, once.
async fn only_succeeding_members_cascade(on: On) {
    let watch = Arc::new(Watch::default());
    let ([ok, retry, reject], replays) = one_batch_of_three(&on, &watch, Guest::Faulty, "wb.").await;
    let calls = |m: &Envelope| watch.single_calls(&envelope::cascade_id(m, 0));
    assert_eq!(calls(&ok), 1, "the succeeding member's cascade goes out once");
    assert_eq!(
        calls(&retry),
        1,
        "the retried member's cascade goes out once, after its retry (not also with the first batch)"
    );
    assert_eq!(calls(&reject), 0, "the rejected member's cascade never goes out");
    assert_eq!(replays, 0, "a batch that named its members is settled from its results");
}

/// Publishes for no member (the 0.1.0 way) and a failing member: the call's
/// cascades are dropped and each member replayed through `handle`, so again
/// only what succeeded cascades, once. The retried member later runs in a
/// batch of its own that succeeds, so its cascade then has a batch id.
async fn unattributed_publishes_replay_a_mixed_batch(on: On, guest: Guest) {
    let watch = Arc::new(Watch::default());
    let prefix = match guest {
        Guest::Faulty => "wb.legacy.",
        Guest::Legacy => "",
    };
    let ([ok, retry, reject], replays) = one_batch_of_three(&on, &watch, guest, prefix).await;
    assert_eq!(replays, 1, "the mixed batch is replayed once");
    let calls = |id: String| watch.single_calls(&id);
    assert_eq!(
        calls(envelope::cascade_id(&ok, 0)),
        1,
        "the replay's cascade of the succeeding member"
    );
    assert_eq!(
        calls(envelope::batch_cascade_id(&ok, 0)),
        0,
        "nothing of the mixed batch call goes out"
    );
    assert_eq!(
        calls(envelope::cascade_id(&retry, 0)),
        0,
        "the replay's retry publishes nothing"
    );
    assert_eq!(
        calls(envelope::batch_cascade_id(&retry, 0)),
        1,
        "the retried member's own batch succeeds and cascades once"
    );
    assert_eq!(calls(envelope::cascade_id(&reject, 0)), 0);
}

/// One `weir-message-id` from two tenants, and of two types: each parent's
/// cascade is delivered, with its parent's tenant, under an id of its own.
async fn cascade_ids_are_keyed_by_tenant_and_type(on: On) {
    let watch = Arc::new(Watch::default());
    let node = start(&on, &watch, Guest::Faulty).await;
    let id = format!("same-{}", uuid::Uuid::new_v4().simple());
    let parents = [
        msg(&id, "publish", "g-acme", Some("acme")),
        msg(&id, "publish", "g-globex", Some("globex")),
        msg(&id, "batch.publish", "g-type", Some("acme")),
    ];
    for p in &parents {
        node.publish(&on.topology, p).await.unwrap();
    }
    let children: Vec<String> = parents.iter().map(|p| envelope::cascade_id(p, 0)).collect();
    watch
        .wait("every cascade handled", |w| {
            children.iter().all(|c| w.settlements(c).contains(&Outcome::Handled))
                && w.settlements(&id).len() == parents.len()
        })
        .await;
    node.shutdown().await.unwrap();
    let distinct: std::collections::HashSet<&String> = children.iter().collect();
    assert_eq!(distinct.len(), parents.len(), "cascade ids collide: {children:?}");
    let calls = watch.calls.lock().clone();
    for (parent, child) in parents.iter().zip(&children) {
        let tenants: Vec<Option<String>> = calls
            .iter()
            .filter(|(batch, m)| !batch && &m[0].0 == child)
            .map(|(_, m)| m[0].1.clone())
            .collect();
        assert_eq!(
            tenants,
            std::slice::from_ref(&parent.tenant_id),
            "cascade {child} of {parent:?}"
        );
    }
}

// ------------------------------------------------------------------- memory

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_only_succeeding_batch_members_cascade_once() {
    only_succeeding_members_cascade(memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_unattributed_batch_publishes_replay_a_mixed_batch() {
    unattributed_publishes_replay_a_mixed_batch(memory(), Guest::Faulty).await;
}

/// A component built against 0.1.0 loads and is settled by the same rule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_0_1_0_component_runs_and_its_mixed_batch_is_replayed() {
    unattributed_publishes_replay_a_mixed_batch(memory(), Guest::Legacy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_cascade_ids_are_keyed_by_tenant_and_type() {
    cascade_ids_are_keyed_by_tenant_and_type(memory()).await;
}

// ----------------------------------------------------------------- RabbitMQ

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_only_succeeding_batch_members_cascade_once() {
    only_succeeding_members_cascade(rabbit()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_unattributed_batch_publishes_replay_a_mixed_batch() {
    unattributed_publishes_replay_a_mixed_batch(rabbit(), Guest::Faulty).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_a_0_1_0_component_runs_and_its_mixed_batch_is_replayed() {
    unattributed_publishes_replay_a_mixed_batch(rabbit(), Guest::Legacy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_cascade_ids_are_keyed_by_tenant_and_type() {
    cascade_ids_are_keyed_by_tenant_and_type(rabbit()).await;
}
