//! Issue 32 item 3: a publisher cannot roll an operator's canary back with
//! poison. The attacker publishes, to groups of the canary's slot and to
//! groups of the stable slots alike, 10 good messages and 15 that every
//! version rejects (0.6 against 0.6). The canary's threshold compares it with
//! the stable version, so it keeps running; the red baseline, the old rule
//! (`threshold_mode=absolute`: the canary's own rate alone), rolls it back.
//! A canary that is genuinely worse (it retries messages the stable version
//! handles) is still rolled back amid the same poison, and the reason names
//! both sides' counts and the canary messages that failed. On the memory
//! broker and on RabbitMQ.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::http::{call, digest, free_port, variant, wait_up};
use common::rabbit::{Topo, url};
use weir::config;
use weir::envelope;
use weir::node::{Node, NodeOptions, bundled};
use weir::partition::slot_of;
use weir::transport::Transport;
use weir::transport::memory::MemoryBroker;
use weir::transport::rabbitmq::RabbitMq;

const TOKEN: &str = "operator-secret-0123456789";
const SLOTS: u32 = 4;
const CANARY_SLOT: u32 = 1;
/// Per side: good messages, and poison that every version rejects.
const GOOD: usize = 10;
const POISON: usize = 15;
/// Per side: messages of type `canary`, which a version granted [`BREAKS`] retries.
const BROKEN: usize = 10;
/// The env var a version must be granted to break (the faulty guest's `canary` type).
const BREAKS: &str = "WEIR_TEST_CANARY_BREAKS";
const NODE: &str = "canary-poison";

#[derive(Debug, Clone, Copy)]
enum Broker {
    Memory,
    RabbitMq,
}

/// A node whose handler (the faulty guest) takes `ok`, `reject` and `canary`.
struct Bed {
    node: Node,
    port: u16,
    topology: String,
    _rabbit: Option<Topo>,
}

async fn bed(broker: Broker) -> Bed {
    // SAFETY: set before the node starts; read only by versions granted it.
    unsafe { std::env::set_var(BREAKS, "1") };
    let port = free_port();
    let (transport_toml, topology, rabbit) = match broker {
        Broker::Memory => (String::new(), "poison".to_owned(), None),
        Broker::RabbitMq => {
            let topo = Topo::new(SLOTS, &[Duration::from_secs(1)]);
            let toml = format!("[transport]\nkind = \"rabbitmq\"\nurl = \"{}\"\nprefetch = 64\n", url());
            (toml, topo.name.clone(), Some(topo))
        }
    };
    let text = format!(
        r#"
[node]
name = "{NODE}"
admin = "127.0.0.1:{port}"
admin_token = "{TOKEN}"
{transport_toml}
[[topology]]
name = "{topology}"
slots = {SLOTS}
[topology.retry]
ladder = ["1s"]
max_deliver = 5
[[handler]]
name = "orders"
component = "{faulty}"
topology = "{topology}"
message_types = ["ok", "reject", "canary"]
"#,
        faulty = bundled::FAULTY_PATH,
    );
    let cfg = config::parse(&text, "<canary poison test>").unwrap();
    let transport: Arc<dyn Transport> = match broker {
        Broker::Memory => Arc::new(MemoryBroker::new()),
        Broker::RabbitMq => Arc::new(RabbitMq::new(url(), format!("weir canary poison {topology}"))),
    };
    let opts = NodeOptions {
        workers: 2,
        runtime: common::cached(weir::runtime::RuntimeOptions::default()),
        ..NodeOptions::default()
    };
    let node = Node::start(&cfg, transport, opts).await.unwrap();
    wait_up(port);
    Bed {
        node,
        port,
        topology,
        _rabbit: rabbit,
    }
}

async fn http(method: &'static str, port: u16, path: String, body: Vec<u8>) -> (u16, serde_json::Value) {
    tokio::task::spawn_blocking(move || call(method, port, &path, Some(TOKEN), &body))
        .await
        .unwrap()
}

async fn handler(port: u16) -> serde_json::Value {
    http("GET", port, "/v1/handlers/orders".into(), vec![]).await.1
}

async fn wait_for(what: &str, limit: Duration, mut done: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !done().await {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Start a canary of a new version on [`CANARY_SLOT`] with `query` (thresholds, grants).
async fn start_canary(b: &Bed, query: &str) -> String {
    let v1 = std::fs::read(bundled::FAULTY_PATH).unwrap();
    let v2 = variant(&v1, &format!("poison-{}", uuid::Uuid::new_v4()));
    let path = format!("/v1/handlers/orders?canary_slots={CANARY_SLOT}{query}");
    let (code, body) = http("PUT", b.port, path, v2.clone()).await;
    assert_eq!(code, 200, "{body}");
    digest(&v2)
}

/// The attacker: `n` messages of type `kind`, each in a group of its own on
/// the canary's slot (`canary_side`) or on a stable slot, published to the
/// broker's slot queues as any publisher of the topology can. Their ids.
async fn publish(b: &Bed, kind: &str, n: usize, canary_side: bool) -> Vec<String> {
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let groups = (0..)
        .map(|i| format!("{kind}-{i}-{}", &tag[..8]))
        .filter(|g| (slot_of(g, SLOTS) == CANARY_SLOT) == canary_side)
        .take(n);
    let mut ids = Vec::new();
    for g in groups {
        let msg = envelope::new_message(envelope::fresh_id(), kind, Some(g), None, vec![], vec![]);
        b.node.publish(&b.topology, &msg).await.unwrap();
        ids.push(msg.id);
    }
    ids
}

/// Both sides' settled counts in the live comparison; `None` once the canary ended.
async fn settled(port: u16) -> Option<(u64, u64)> {
    let h = handler(port).await;
    let c = &h["canary"]["compare"];
    Some((c["canary"]["settled"].as_u64()?, c["stable"]["settled"].as_u64()?))
}

/// The ids a rollback's reason names.
fn named_ids(reason: &str) -> Vec<String> {
    let marker = format!("on this node ({NODE}): ");
    let (_, ids) = reason
        .split_once(&marker)
        .unwrap_or_else(|| panic!("no ids in {reason}"));
    ids.split(", ").map(str::to_owned).collect()
}

/// The attack: 10 good and 15 poison messages on each side, against a
/// canary with a dead-letter threshold of 0.2 judged after 25 messages (so
/// it is judged once, on the final counts). `mode`: a `threshold_mode`
/// query, or none. The handler at the end, and the canary side's poison ids.
async fn equal_rate_poison(broker: Broker, mode: &str) -> (serde_json::Value, Vec<String>) {
    let b = bed(broker).await;
    let per_side = (GOOD + POISON) as u64;
    start_canary(&b, &format!("&max_dead_letter_rate=0.2&min_messages={per_side}{mode}")).await;
    let mut poison_on_canary = Vec::new();
    for canary_side in [true, false] {
        publish(&b, "ok", GOOD, canary_side).await;
        let ids = publish(&b, "reject", POISON, canary_side).await;
        if canary_side {
            poison_on_canary = ids;
        }
    }
    wait_for(
        "every message counted, or the canary ended",
        Duration::from_secs(30),
        async || settled(b.port).await.is_none_or(|s| s == (per_side, per_side)),
    )
    .await;
    // A look at the final counts now (the guard's own timer looks too).
    b.node.registry().guard_once().await;
    let h = handler(b.port).await;
    b.node.shutdown().await.unwrap();
    (h, poison_on_canary)
}

async fn poison_keeps_the_canary(broker: Broker) {
    let (h, _) = equal_rate_poison(broker, "").await;
    assert!(!h["canary"].is_null(), "equal-rate poison rolled the canary back: {h}");
    assert!(h["last_canary"].is_null(), "{h}");
    let c = &h["canary"]["compare"];
    for side in ["canary", "stable"] {
        assert_eq!(c[side]["settled"], 25, "{h}");
        assert_eq!(c[side]["dead_lettered"], 15, "{h}");
        assert_eq!(c[side]["dead_letter_rate"], 0.6, "{h}");
    }
    assert_eq!(h["canary"]["thresholds"]["mode"], "relative");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_rate_poison_does_not_roll_a_canary_back_on_the_memory_broker() {
    poison_keeps_the_canary(Broker::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_rate_poison_does_not_roll_a_canary_back_on_rabbitmq() {
    poison_keeps_the_canary(Broker::RabbitMq).await;
}

/// Red baseline: the rule before the fix, the canary's own rate alone.
async fn absolute_rule_rolls_back(broker: Broker) {
    let (h, poison) = equal_rate_poison(broker, "&threshold_mode=absolute").await;
    assert!(h["canary"].is_null(), "the absolute rule kept the canary: {h}");
    let last = &h["last_canary"];
    assert_eq!(last["outcome"], "rolled-back", "{h}");
    let reason = last["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("threshold: dead-letter rate 0.600 (15 of 25 settled messages) is above the threshold 0.2"),
        "{reason}"
    );
    // The attacker's own messages decided it.
    let named = named_ids(reason);
    assert_eq!(named.len(), 5, "{reason}");
    assert!(named.iter().all(|id| poison.contains(id)), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_the_absolute_rule_lets_equal_rate_poison_roll_the_canary_back_on_the_memory_broker() {
    absolute_rule_rolls_back(Broker::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_the_absolute_rule_lets_equal_rate_poison_roll_the_canary_back_on_rabbitmq() {
    absolute_rule_rolls_back(Broker::RabbitMq).await;
}

/// A canary that retries what the stable version handles, amid the same
/// poison on both sides: rolled back by its retry rate, naming its messages.
async fn worse_canary_rolls_back(broker: Broker) {
    let b = bed(broker).await;
    let per_side = GOOD + POISON + BROKEN;
    let query = format!("&env={BREAKS}&max_dead_letter_rate=0.2&max_retry_rate=0.2&min_messages={per_side}");
    start_canary(&b, &query).await;
    let mut broken_on_canary = Vec::new();
    for canary_side in [true, false] {
        publish(&b, "ok", GOOD, canary_side).await;
        publish(&b, "reject", POISON, canary_side).await;
        let ids = publish(&b, "canary", BROKEN, canary_side).await;
        if canary_side {
            broken_on_canary = ids;
        }
    }
    wait_for("the worse canary rolled back", Duration::from_secs(30), async || {
        handler(b.port).await["canary"].is_null()
    })
    .await;
    let h = handler(b.port).await;
    let reason = h["last_canary"]["reason"].as_str().unwrap().to_owned();
    assert_eq!(h["last_canary"]["outcome"], "rolled-back", "{h}");
    // Its retry rate against the stable version's, with both sides' counts
    // (the stable version retried none of its 35); the dead-letter rates
    // (15 of 35 on each side) did not count against it.
    assert!(reason.starts_with("threshold: the canary's retry rate"), "{reason}");
    assert!(
        reason.contains("above the stable version's 0.000 (0 of 35)"),
        "{reason}"
    );
    assert!(reason.contains("more than the threshold 0.2, by"), "{reason}");
    let named = named_ids(&reason);
    assert_eq!(named.len(), 5, "{reason}");
    assert!(
        named.iter().all(|id| broken_on_canary.contains(id)),
        "{reason} names a message the canary did not retry"
    );
    // Nothing lost: the retried ones come back on the ladder to the stable version.
    let stats = b.node.stats();
    let total = (2 * per_side) as u64;
    wait_for("every message settled for good", Duration::from_secs(30), async || {
        let s = stats.snapshot();
        s.handled + s.dead_lettered.iter().map(|(_, n)| n).sum::<u64>() >= total
    })
    .await;
    let s = stats.snapshot();
    let dead: u64 = s.dead_lettered.iter().map(|(_, n)| n).sum();
    assert_eq!((s.handled, dead), ((2 * (GOOD + BROKEN)) as u64, (2 * POISON) as u64));
    let distinct: BTreeSet<&String> = named.iter().collect();
    assert_eq!(distinct.len(), named.len(), "{reason}");
    println!("worse canary on {broker:?}: {reason}");
    b.node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worse_canary_still_rolls_back_naming_its_messages_on_the_memory_broker() {
    worse_canary_rolls_back(Broker::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worse_canary_still_rolls_back_naming_its_messages_on_rabbitmq() {
    worse_canary_rolls_back(Broker::RabbitMq).await;
}
