//! Canary by slot (`PUT /v1/handlers/{name}?canary_slots=…`, `weir deploy
//! --canary-slots`): a version that fails everything, on one slot of four,
//! is rolled back by its retry-rate threshold; every message is handled in
//! the end (the ones it failed come back on the ladder and run on the stable
//! version), and no group of a stable slot ever runs it. The red baseline,
//! the same canary without a threshold, dead-letters its slot's messages.
//! In `postgres` mode a canary, its promotion and its rollback reach every
//! node, with a cluster-wide comparison. The CLI: deploy, status, promote.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::http::{call, current, digest, free_port, variant, wait_up};
use common::nats::Topo as NatsTopo;
use common::pg::TestDb;
use common::rabbit::{Topo, url};
use common::registry::{KvBucket, Registry as _};
use parking_lot::Mutex;
use weir::config;
use weir::envelope::{self, Envelope};
use weir::node::{Node, NodeOptions, bundled};
use weir::partition::slot_of;
use weir::runtime::CallObserver;
use weir::transport::memory::MemoryBroker;
use weir::transport::rabbitmq::RabbitMq;

const TOKEN: &str = "operator-secret-0123456789";
const SLOTS: u32 = 4;
const CANARY_SLOT: u32 = 1;
const GROUPS: u32 = 40;
const PER_GROUP: u32 = 5;
/// The env var a version must be granted to break (the faulty guest's `canary` type).
const BREAKS: &str = "WEIR_TEST_CANARY_BREAKS";

/// One guest call: which message of which group, on which version, when.
#[derive(Debug, Clone)]
struct Run {
    id: String,
    group: String,
    digest: String,
    at: Instant,
}

#[derive(Default)]
struct Versions(Mutex<Vec<Run>>);

impl CallObserver for Versions {
    fn version(&self, msg: &Envelope, digest: &str) {
        self.0.lock().push(Run {
            id: msg.id.clone(),
            group: msg.group().unwrap_or_default().to_owned(),
            digest: digest.to_owned(),
            at: Instant::now(),
        });
    }
    fn before(&self, _: &Envelope) {}
    fn after(&self, _: &Envelope) {}
}

/// Calls of `canary` by a group whose slot is not one of `slots`.
fn canary_on_stable_slots(runs: &[Run], canary: &str, slots: &[u32]) -> Vec<String> {
    runs.iter()
        .filter(|r| r.digest == canary && !slots.contains(&slot_of(&r.group, SLOTS)))
        .map(|r| format!("{} of group {} (slot {})", r.id, r.group, slot_of(&r.group, SLOTS)))
        .collect()
}

#[test]
fn the_slot_check_catches_a_canary_call_on_a_stable_slot() {
    let group = (0..)
        .map(|g| format!("g{g}"))
        .find(|g| slot_of(g, SLOTS) != CANARY_SLOT)
        .unwrap();
    let runs = vec![Run {
        id: "m1".into(),
        group,
        digest: "canary".into(),
        at: Instant::now(),
    }];
    assert_eq!(canary_on_stable_slots(&runs, "canary", &[CANARY_SLOT]).len(), 1);
    assert!(canary_on_stable_slots(&runs, "stable", &[CANARY_SLOT]).is_empty());
}

fn rabbit_config(topology: &str, port: u16) -> config::Config {
    let text = format!(
        r#"
[node]
name = "canary"
admin = "127.0.0.1:{port}"
admin_token = "{TOKEN}"
[transport]
kind = "rabbitmq"
url = "{url}"
prefetch = 64
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
message_types = ["canary"]
"#,
        url = url(),
        faulty = bundled::FAULTY_PATH,
    );
    config::parse(&text, "<canary test>").unwrap()
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

/// What a canary run did.
struct Outcome {
    published: u64,
    handled: u64,
    dead_lettered: u64,
    runs: Vec<Run>,
    canary: String,
    /// `GET /v1/handlers/orders` at the end.
    handler: serde_json::Value,
    /// When the canary stopped (rolled back), if it did.
    rolled_back_at: Option<Instant>,
}

/// A node on RabbitMQ; a canary that retries everything on slot 1 (with
/// `thresholds`, a query string, or none); 40 groups × 5 messages; wait
/// until every message is handled or dead-lettered.
async fn canary_run(thresholds: &str) -> Outcome {
    // SAFETY: set before the node starts; read only by versions granted it.
    unsafe { std::env::set_var(BREAKS, "1") };
    let topo = Topo::new(SLOTS, &[Duration::from_secs(1)]);
    let port = free_port();
    let versions = Arc::new(Versions::default());
    let opts = NodeOptions {
        workers: 2,
        runtime: common::cached(weir::runtime::RuntimeOptions::default()),
        call_observer: Some(versions.clone()),
        ..NodeOptions::default()
    };
    let transport = Arc::new(RabbitMq::new(url(), format!("weir canary {}", topo.name)));
    let node = Node::start(&rabbit_config(&topo.name, port), transport, opts)
        .await
        .unwrap();
    wait_up(port);
    let v1 = std::fs::read(bundled::FAULTY_PATH).unwrap();
    let v2 = variant(&v1, &format!("canary-{}", uuid::Uuid::new_v4()));
    let path = format!("/v1/handlers/orders?canary_slots={CANARY_SLOT}&env={BREAKS}{thresholds}");
    let (code, started) = http("PUT", port, path, v2.clone()).await;
    assert_eq!(code, 200, "{started}");
    assert_eq!(started["slots"], serde_json::json!([CANARY_SLOT]));
    assert_eq!(started["stable"], digest(&v1));
    assert_eq!(
        current(port, Some(TOKEN), "orders"),
        digest(&v1),
        "a canary leaves the current version"
    );

    let mut published = 0;
    for seq in 0..PER_GROUP {
        for g in 0..GROUPS {
            let msg = envelope::new_message(
                envelope::fresh_id(),
                "canary",
                Some(format!("g{g}")),
                None,
                vec![("seq".into(), seq.to_string())],
                vec![],
            );
            node.publish(&topo.name, &msg).await.unwrap();
            published += 1;
        }
    }
    let stats = node.stats();
    let mut rolled_back_at = None;
    wait_for("every message settled for good", Duration::from_secs(60), async || {
        if rolled_back_at.is_none() && handler(port).await["canary"].is_null() {
            rolled_back_at = Some(Instant::now());
        }
        let s = stats.snapshot();
        let dead: u64 = s.dead_lettered.iter().map(|(_, n)| n).sum();
        s.handled + dead >= published
    })
    .await;
    let s = stats.snapshot();
    let handler = handler(port).await;
    node.shutdown().await.unwrap();
    Outcome {
        published,
        handled: s.handled,
        dead_lettered: s.dead_lettered.iter().map(|(_, n)| n).sum(),
        runs: versions.0.lock().clone(),
        canary: digest(&v2),
        handler,
        rolled_back_at,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_that_fails_everything_is_rolled_back_by_its_threshold_and_nothing_is_lost() {
    let o = canary_run("&max_retry_rate=0.5&min_messages=10").await;
    // Nothing lost: every message handled, none dead-lettered.
    assert_eq!((o.handled, o.dead_lettered), (o.published, 0), "{}", o.handler);
    // Rolled back by the threshold, and says so.
    let last = &o.handler["last_canary"];
    assert!(o.handler["canary"].is_null(), "{}", o.handler);
    assert_eq!(last["outcome"], "rolled-back", "{}", o.handler);
    let reason = last["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("threshold: the canary's retry rate 1.000"),
        "{reason}"
    );
    assert!(reason.contains("above the stable version's 0.000"), "{reason}");
    assert_eq!(last["compare"]["canary"]["handled"], 0);
    assert!(last["compare"]["canary"]["retried"].as_u64().unwrap() >= 10);
    assert_eq!(last["compare"]["stable"]["retried"], 0);
    assert!(last["compare"]["stable"]["handled"].as_u64().unwrap() > 0);
    // Groups on stable slots never ran it; it did run on its slot.
    let wrong = canary_on_stable_slots(&o.runs, &o.canary, &[CANARY_SLOT]);
    assert!(wrong.is_empty(), "canary calls on stable slots: {wrong:?}");
    let on_canary: BTreeSet<&str> = o
        .runs
        .iter()
        .filter(|r| r.digest == o.canary)
        .map(|r| r.group.as_str())
        .collect();
    assert!(!on_canary.is_empty(), "the canary never ran");
    // After the rollback was seen, no canary call started (beyond the ones
    // already handed to a worker then: none here, a call takes microseconds).
    let after = o.rolled_back_at.unwrap();
    let late: Vec<&Run> = o
        .runs
        .iter()
        .filter(|r| r.digest == o.canary && r.at > after + Duration::from_millis(100))
        .collect();
    assert!(late.is_empty(), "canary calls after its rollback: {late:?}");
    // Every message's last call was on the stable version.
    let mut last_run: BTreeMap<&str, &str> = BTreeMap::new();
    for r in &o.runs {
        last_run.insert(&r.id, &r.digest);
    }
    assert!(
        last_run.values().all(|d| *d != o.canary),
        "a message ended on the canary"
    );
    println!(
        "canary: {} canary calls on {} groups of slot {CANARY_SLOT}, rolled back: {reason}",
        o.runs.iter().filter(|r| r.digest == o.canary).count(),
        on_canary.len()
    );
}

/// Red baseline: the same canary without a threshold keeps failing its
/// slot's messages until the ladder dead-letters them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_without_a_threshold_the_canary_dead_letters_its_slot() {
    let o = canary_run("").await;
    assert!(
        o.dead_lettered > 0,
        "without a threshold the canary must cost messages: {}",
        o.handler
    );
    assert!(o.handled < o.published);
    assert!(!o.handler["canary"].is_null(), "nothing rolled it back");
    let wrong = canary_on_stable_slots(&o.runs, &o.canary, &[CANARY_SLOT]);
    assert!(wrong.is_empty(), "canary calls on stable slots: {wrong:?}");
}

/// Where a cluster's nodes keep versions, and the broker they share.
enum Cluster {
    /// `postgres` mode, on the in-memory broker.
    Postgres(TestDb, Arc<MemoryBroker>),
    /// `nats-kv` mode, on NATS.
    NatsKv(KvBucket, NatsTopo),
}

impl Cluster {
    /// The canaries' rows (`postgres`), or the handler's record (`nats-kv`):
    /// how each ended canary ended, oldest first.
    fn ended(&self) -> Vec<(String, String)> {
        match self {
            Cluster::Postgres(db, _) => db
                .query("SELECT outcome, reason FROM weir_handler_canaries WHERE ended_at IS NOT NULL ORDER BY id")
                .into_iter()
                .map(|r| (r[0].clone().unwrap(), r[1].clone().unwrap()))
                .collect(),
            // The bucket keeps only the last one.
            Cluster::NatsKv(..) => Vec::new(),
        }
    }
}

/// A node's config in `cluster`, its admin listener on `port`.
fn cluster_config(cluster: &Cluster, name: &str, port: u16) -> String {
    let (lines, topology) = match cluster {
        Cluster::Postgres(db, _) => (common::registry::cluster(&db.url()), "canary-cluster".to_owned()),
        Cluster::NatsKv(bucket, topo) => (common::registry::cluster(&bucket.url()), topo.name.clone()),
    };
    let transport = match cluster {
        Cluster::Postgres(..) => String::new(),
        Cluster::NatsKv(..) => format!("[transport]\nkind = \"nats\"\nurl = \"{}\"\n", common::nats::url()),
    };
    format!(
        r#"
[node]
name = "{name}"
admin = "127.0.0.1:{port}"
admin_token = "{TOKEN}"
{transport}
[cluster]
{lines}
lease = "2s"
[[topology]]
name = "{topology}"
slots = {SLOTS}
[[handler]]
name = "orders"
component = "{faulty}"
topology = "{topology}"
message_types = ["canary"]
"#,
        faulty = bundled::FAULTY_PATH,
    )
}

async fn cluster_node(cluster: &Cluster, name: &str) -> (Node, u16) {
    let port = free_port();
    let text = cluster_config(cluster, name, port);
    let cfg = config::parse(&text, "<canary cluster test>").unwrap();
    let opts = NodeOptions {
        workers: 1,
        runtime: common::cached(weir::runtime::RuntimeOptions::default()),
        ..NodeOptions::default()
    };
    let t: Arc<dyn weir::transport::Transport> = match cluster {
        Cluster::Postgres(_, mem) => mem.clone(),
        Cluster::NatsKv(..) => Arc::new(weir::transport::nats::Nats::new(
            common::nats::url(),
            format!("weir canary {name}"),
        )),
    };
    let n = Node::start(&cfg, t, opts).await.unwrap();
    wait_up(port);
    (n, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_postgres_mode_a_canary_its_promotion_and_its_rollback_reach_every_node() {
    reaches_every_node(
        Cluster::Postgres(TestDb::new(), Arc::new(MemoryBroker::new())),
        "database",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_nats_kv_mode_a_canary_its_promotion_and_its_rollback_reach_every_node() {
    reaches_every_node(
        Cluster::NatsKv(KvBucket::new(Duration::from_secs(2)), NatsTopo::new()),
        "bucket",
    )
    .await;
}

async fn reaches_every_node(cluster: Cluster, kept_in: &str) {
    let (a, port_a) = cluster_node(&cluster, "canary-a").await;
    let (b, port_b) = cluster_node(&cluster, "canary-b").await;
    let v1 = std::fs::read(bundled::FAULTY_PATH).unwrap();
    let v2 = variant(&v1, "canary-cluster-2");
    let v3 = variant(&v1, "canary-cluster-3");

    // A canary started on A runs on B too.
    let (code, body) = http("PUT", port_a, "/v1/handlers/orders?canary_slots=0,2".into(), v2.clone()).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["kept_in"], kept_in);
    for port in [port_a, port_b] {
        wait_for("the canary on every node", Duration::from_secs(15), async || {
            handler(port).await["canary"]["digest"] == digest(&v2)
        })
        .await;
        let h = handler(port).await;
        assert_eq!(h["canary"]["slots"], serde_json::json!([0, 2]));
        assert_eq!(h["current"]["digest"], digest(&v1), "the stable version stays current");
    }
    // A second canary while one runs is refused, and so is a plain deploy
    // (it would change what the canary is compared with), and a canary on
    // every slot.
    let (code, body) = http("PUT", port_b, "/v1/handlers/orders?canary_slots=1".into(), v3.clone()).await;
    assert_eq!(code, 409, "{body}");
    let (code, body) = http("PUT", port_b, "/v1/handlers/orders".into(), v3.clone()).await;
    assert_eq!(code, 409, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("promote it or roll it back"),
        "{body}"
    );
    let (code, body) = http("PUT", port_b, "/v1/handlers/orders?canary_slots=0-3".into(), v3.clone()).await;
    assert_eq!(code, 400, "{body}");
    assert!(body["error"].as_str().unwrap().contains("every slot"), "{body}");

    // The comparison is the cluster's: both nodes write their tallies.
    wait_for("a cluster-wide comparison", Duration::from_secs(15), async || {
        handler(port_a).await["canary"]["compare"]["scope"] == "cluster"
    })
    .await;

    // weir status --config reads the canary and the cluster's comparison
    // from the store, without asking a node.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("weir.toml");
    std::fs::write(&file, cluster_config(&cluster, "status", free_port())).unwrap();
    let path = file.to_str().unwrap().to_owned();
    let (code, out, err) = tokio::task::spawn_blocking(move || weir(&["status", "--config", &path]))
        .await
        .unwrap();
    assert_eq!(code, 0, "{err}");
    let short: String = digest(&v2).chars().take(12).collect();
    assert!(
        out.lines()
            .any(|l| l.starts_with("orders") && l.contains("canary") && l.contains(&short) && l.contains("0,2")),
        "{out}"
    );
    assert!(out.contains("scope cluster"), "{out}");

    // A node that joins now runs the canary too.
    let (c, port_c) = cluster_node(&cluster, "canary-c").await;
    assert_eq!(handler(port_c).await["canary"]["digest"], digest(&v2));

    // Promoted through B: the canary's version is current everywhere.
    let (code, body) = http("POST", port_b, "/v1/handlers/orders/promote".into(), vec![]).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["digest"], digest(&v2));
    for port in [port_a, port_b, port_c] {
        wait_for("the promotion on every node", Duration::from_secs(15), async || {
            let h = handler(port).await;
            h["current"]["digest"] == digest(&v2) && h["canary"].is_null()
        })
        .await;
    }
    assert_eq!(handler(port_a).await["current"]["source"], "promote");
    let (code, body) = http("POST", port_a, "/v1/handlers/orders/promote".into(), vec![]).await;
    assert_eq!(code, 409, "no canary to promote: {body}");

    // Another canary, rolled back through A: B and C drop it and say why.
    let (code, body) = http("PUT", port_c, "/v1/handlers/orders?canary_slots=25%".into(), v3.clone()).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["slots"], serde_json::json!([0]));
    wait_for("the second canary on A", Duration::from_secs(15), async || {
        handler(port_a).await["canary"]["digest"] == digest(&v3)
    })
    .await;
    let (code, body) = http("POST", port_a, "/v1/handlers/orders/rollback".into(), vec![]).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["digest"], digest(&v2), "the stable version stays");
    for port in [port_a, port_b, port_c] {
        wait_for("the rollback on every node", Duration::from_secs(15), async || {
            let h = handler(port).await;
            h["canary"].is_null() && h["last_canary"]["outcome"] == "rolled-back"
        })
        .await;
        assert_eq!(handler(port).await["current"]["digest"], digest(&v2));
    }
    let ended = cluster.ended();
    if matches!(cluster, Cluster::Postgres(..)) {
        let want = [("promoted", "operator"), ("rolled-back", "operator")];
        let want: Vec<(String, String)> = want.iter().map(|(o, r)| ((*o).into(), (*r).into())).collect();
        assert_eq!(ended, want);
    }
    for n in [a, b, c] {
        n.shutdown().await.unwrap();
    }
    // The bucket's reader owns a runtime of its own: dropped off this one.
    tokio::task::spawn_blocking(move || drop(cluster)).await.unwrap();
}

fn weir(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_deploys_a_canary_shows_it_in_status_and_promotes_it() {
    let port = free_port();
    let text = format!(
        r#"
[node]
name = "canary-cli"
admin = "127.0.0.1:{port}"
admin_token = "{TOKEN}"
[[topology]]
name = "canary-cli"
slots = {SLOTS}
[[handler]]
name = "orders"
component = "{faulty}"
topology = "canary-cli"
message_types = ["canary"]
"#,
        faulty = bundled::FAULTY_PATH,
    );
    let cfg = config::parse(&text, "<canary cli test>").unwrap();
    let opts = NodeOptions {
        workers: 1,
        runtime: common::cached(weir::runtime::RuntimeOptions::default()),
        ..NodeOptions::default()
    };
    let node = Node::start(&cfg, Arc::new(MemoryBroker::new()), opts).await.unwrap();
    wait_up(port);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("v2.wasm");
    let v2 = variant(&std::fs::read(bundled::FAULTY_PATH).unwrap(), "canary-cli-2");
    std::fs::write(&file, &v2).unwrap();
    let admin = format!("http://127.0.0.1:{port}");
    let (admin, file) = (admin.as_str(), file.to_str().unwrap());
    let base = ["--admin", admin, "--token", TOKEN, "--handler", "orders"];
    let run = |args: Vec<&str>| {
        let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
        tokio::task::spawn_blocking(move || weir(&args.iter().map(String::as_str).collect::<Vec<_>>()))
    };

    let mut args = vec!["deploy"];
    args.extend(base);
    args.extend(["--canary-slots", "50%", "--max-retry-rate", "0.2", file]);
    let (code, out, err) = run(args).await.unwrap();
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("canary: `orders` runs") && out.contains("on slots 0,1 of 4"),
        "{out}"
    );
    assert!(
        out.contains("rolls back by itself on a retry rate more than 0.2 above the stable version's"),
        "{out}"
    );

    let (code, out, err) = run(vec!["status", "--admin", admin, "--token", TOKEN]).await.unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("canaries"), "{out}");
    let short: String = digest(&v2).chars().take(12).collect();
    assert!(
        out.lines()
            .any(|l| l.starts_with("orders") && l.contains("canary") && l.contains(&short)),
        "{out}"
    );
    assert!(out.contains("retry rate > stable's + 0.2"), "{out}");
    // And in the metrics, for Prometheus.
    let (code, text) = http("GET", port, "/metrics".into(), vec![]).await;
    assert_eq!(code, 200);
    let text = text.as_str().unwrap().to_owned();
    assert!(
        text.lines()
            .any(|l| l.starts_with("weir_canary_messages{") && l.contains("side=\"canary\"")),
        "{text}"
    );

    let mut args = vec!["promote"];
    args.extend(base);
    let (code, out, err) = run(args.clone()).await.unwrap();
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("promoted: `orders` now runs"), "{out}");
    assert_eq!(current(port, Some(TOKEN), "orders"), digest(&v2));
    // Nothing left to promote: refused, exit 3, saying why.
    let (code, _, err) = run(args).await.unwrap();
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("runs no canary"), "{err}");
    node.shutdown().await.unwrap();
}
