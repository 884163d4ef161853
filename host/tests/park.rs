//! `on_failure = "park"` (issue 21 item 1) on the memory broker, RabbitMQ and
//! NATS JetStream: a group whose third message fails twice (with `retry`)
//! is handled in exact order 1…10, its later messages waiting in the lane
//! while the head climbs the ladder, and the other groups of the same slot
//! are handled meanwhile. The red baseline is the same run with
//! `on_failure = "continue"`: message 3 is handled after 4…10. And a parked
//! group holds at most `topology.park_hold` messages: the rest are
//! dead-lettered `park-overflow`, the held ones still run in order.
//!
//! Real wasmtime and the faulty test guest: `flaky` with payload N fails
//! with `retry` while its attempt is at most N. Each broker test declares its
//! own topology and deletes it afterwards.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use weir::config::{self, Config, OnFailure, RetrySection, TransportKind};
use weir::envelope::{self, Envelope};
use weir::node::{Node, NodeOptions, bundled};
use weir::outcome::{Outcome, Reason, SettleObserver};
use weir::transport::Transport;
use weir::transport::memory::MemoryBroker;
use weir::transport::nats::Nats;
use weir::transport::rabbitmq::RabbitMq;

/// The ladder: each failure of the head parks its group this long.
const RUNG: Duration = Duration::from_secs(1);
const GROUP: &str = "parked";
const OTHERS: [&str; 4] = ["o0", "o1", "o2", "o3"];

/// A broker to run on; `_guard` deletes its objects on drop.
struct On {
    transport: Arc<dyn Transport>,
    kind: TransportKind,
    url: Option<String>,
    topology: String,
    _guard: Option<Box<dyn std::any::Any>>,
}

fn memory() -> On {
    On {
        transport: Arc::new(MemoryBroker::new()),
        kind: TransportKind::Memory,
        url: None,
        topology: "park".into(),
        _guard: None,
    }
}

fn rabbit() -> On {
    let topo = common::rabbit::Topo::new(1, &[RUNG]);
    On {
        transport: Arc::new(RabbitMq::new(common::rabbit::url(), format!("weir park-{}", topo.name))),
        kind: TransportKind::Rabbitmq,
        url: Some(common::rabbit::url()),
        topology: topo.name.clone(),
        _guard: Some(Box::new(topo)),
    }
}

fn nats() -> On {
    let topo = common::nats::Topo::new();
    On {
        transport: Arc::new(Nats::new(topo.url.clone(), format!("weir park-{}", topo.name))),
        kind: TransportKind::Nats,
        url: Some(topo.url.clone()),
        topology: topo.name.clone(),
        _guard: Some(Box::new(topo)),
    }
}

/// One slot (every group shares it), `flaky` bound with `on_failure`.
fn config(on: &On, on_failure: OnFailure, park_hold: Option<u32>) -> Config {
    let mut t = config::Topology::new(&on.topology, 1);
    t.retry = Some(RetrySection {
        ladder: Some(vec![RUNG]),
        max_deliver: Some(5),
        ..Default::default()
    });
    t.park_hold = park_hold;
    let mut h = config::Handler::new("faulty", bundled::FAULTY_PATH, &on.topology, vec!["flaky".into()]);
    h.on_failure = on_failure;
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
        origin: "<park test>".into(),
    }
}

/// Every settlement, in the order they happened.
#[derive(Default)]
struct Settled(Mutex<Vec<(String, Outcome)>>);

impl SettleObserver for Settled {
    fn settled(&self, id: &str, outcome: Outcome) {
        self.0.lock().push((id.to_owned(), outcome));
    }
}

impl Settled {
    fn final_outcomes(&self, ids: &[String]) -> usize {
        let log = self.0.lock();
        ids.iter()
            .filter(|id| {
                log.iter()
                    .any(|(x, o)| x == *id && matches!(o, Outcome::Handled | Outcome::DeadLettered(_)))
            })
            .count()
    }

    /// The position in the log of `id`'s first settlement `want`.
    fn position(&self, id: &str, want: Outcome) -> Option<usize> {
        self.0.lock().iter().position(|(x, o)| x == id && *o == want)
    }
}

fn flaky(group: &str, failing: u32) -> Envelope {
    envelope::new_message(
        envelope::fresh_id(),
        "flaky",
        Some(group.to_owned()),
        None,
        vec![],
        failing.to_string().into_bytes(),
    )
}

struct Run {
    /// The parked group's messages, in publish order.
    group: Vec<String>,
    /// The other groups' messages.
    others: Vec<String>,
    settled: Arc<Settled>,
}

impl Run {
    /// The parked group's message numbers (1-based) in the order they were handled.
    fn handled_order(&self) -> Vec<usize> {
        let log = self.settled.0.lock();
        log.iter()
            .filter(|(_, o)| *o == Outcome::Handled)
            .filter_map(|(id, _)| self.group.iter().position(|g| g == id).map(|i| i + 1))
            .collect()
    }
}

/// Ten messages of the group (the third fails twice) interleaved with five
/// of each other group, all in one slot; wait until each has ended.
async fn run(on: &On, on_failure: OnFailure) -> Run {
    let settled = Arc::new(Settled::default());
    let opts = NodeOptions {
        workers: 2,
        settle_observer: Some(settled.clone()),
        ..NodeOptions::default()
    };
    let node = Node::start(&config(on, on_failure, None), on.transport.clone(), opts)
        .await
        .unwrap();
    let mut group = Vec::new();
    let mut others = Vec::new();
    for i in 1..=10 {
        let m = flaky(GROUP, if i == 3 { 2 } else { 0 });
        group.push(m.id.clone());
        common::publish_confirmed(on.transport.as_ref(), &on.topology, 0, &m).await;
        if i <= 5 {
            for o in OTHERS {
                let m = flaky(o, 0);
                others.push(m.id.clone());
                common::publish_confirmed(on.transport.as_ref(), &on.topology, 0, &m).await;
            }
        }
    }
    let all: Vec<String> = group.iter().chain(&others).cloned().collect();
    let start = Instant::now();
    while settled.final_outcomes(&all) < all.len() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "only {} of {} messages ended within 60 s: {:?}",
            settled.final_outcomes(&all),
            all.len(),
            settled.0.lock()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    node.shutdown().await.unwrap();
    Run { group, others, settled }
}

async fn parks_in_order(on: On) {
    let r = run(&on, OnFailure::Park).await;
    assert_eq!(
        r.handled_order(),
        (1..=10).collect::<Vec<_>>(),
        "the parked group ran out of order: {:?}",
        r.settled.0.lock()
    );
    let head = &r.group[2];
    let retries = r
        .settled
        .0
        .lock()
        .iter()
        .filter(|(id, o)| id == head && *o == Outcome::RetryScheduled)
        .count();
    assert_eq!(retries, 2, "the head fails twice, on the ladder both times");
    // The other groups of the slot are not held behind the parked one:
    // each of their messages is handled before the head's third attempt
    // (the head waits two rungs, they take milliseconds).
    let head_done = r.settled.position(head, Outcome::Handled).unwrap();
    for id in &r.others {
        let done = r
            .settled
            .position(id, Outcome::Handled)
            .expect("every other message is handled");
        assert!(
            done < head_done,
            "a message of another group waited for the parked group: {:?}",
            r.settled.0.lock()
        );
    }
}

/// The red baseline: with `continue` the group runs on past its failed third message.
async fn continue_reorders(on: On) {
    let r = run(&on, OnFailure::Continue).await;
    let order = r.handled_order();
    assert_eq!(order.len(), 10);
    assert_ne!(
        order,
        (1..=10).collect::<Vec<_>>(),
        "with continue, message 3 should be handled after 4..10"
    );
    assert_eq!(order.last(), Some(&3), "{order:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn park_keeps_order_on_memory() {
    parks_in_order(memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continue_reorders_on_memory() {
    continue_reorders(memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn park_keeps_order_on_rabbitmq() {
    parks_in_order(rabbit()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continue_reorders_on_rabbitmq() {
    continue_reorders(rabbit()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn park_keeps_order_on_nats() {
    parks_in_order(nats()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continue_reorders_on_nats() {
    continue_reorders(nats()).await;
}

/// A parked group holds at most `park_hold` messages; the ones beyond are
/// dead-lettered `park-overflow`, and what it held still runs in order
/// after the head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_group_holds_at_most_park_hold() {
    let on = memory();
    let settled = Arc::new(Settled::default());
    let opts = NodeOptions {
        workers: 2,
        settle_observer: Some(settled.clone()),
        ..NodeOptions::default()
    };
    let node = Node::start(&config(&on, OnFailure::Park, Some(3)), on.transport.clone(), opts)
        .await
        .unwrap();
    // The head fails once; wait until it is parked, then send eight more.
    let head = flaky(GROUP, 1);
    common::publish_confirmed(on.transport.as_ref(), &on.topology, 0, &head).await;
    let start = Instant::now();
    while settled.position(&head.id, Outcome::RetryScheduled).is_none() {
        assert!(start.elapsed() < Duration::from_secs(30), "the head never failed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let later: Vec<Envelope> = (0..8).map(|_| flaky(GROUP, 0)).collect();
    for m in &later {
        common::publish_confirmed(on.transport.as_ref(), &on.topology, 0, m).await;
    }
    let all: Vec<String> = std::iter::once(&head).chain(&later).map(|m| m.id.clone()).collect();
    while settled.final_outcomes(&all) < all.len() {
        assert!(start.elapsed() < Duration::from_secs(60), "{:?}", settled.0.lock());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    node.shutdown().await.unwrap();
    let overflow = Outcome::DeadLettered(Reason::ParkOverflow);
    let held: Vec<usize> = (0..8)
        .filter(|i| settled.position(&later[*i].id, Outcome::Handled).is_some())
        .collect();
    let dropped: Vec<usize> = (0..8)
        .filter(|i| settled.position(&later[*i].id, overflow).is_some())
        .collect();
    assert_eq!(held, [0, 1, 2], "the first three are held: {:?}", settled.0.lock());
    assert_eq!(dropped, [3, 4, 5, 6, 7], "the rest are dead-lettered park-overflow");
    let head_done = settled.position(&head.id, Outcome::Handled).unwrap();
    let positions: Vec<usize> = held
        .iter()
        .map(|i| settled.position(&later[*i].id, Outcome::Handled).unwrap())
        .collect();
    assert!(
        positions.iter().all(|p| *p > head_done) && positions.windows(2).all(|w| w[0] < w[1]),
        "the held messages run after the head, in order: {:?}",
        settled.0.lock()
    );
}

/// A parked group shows in `GET /v1/groups` and `weir groups list` while it
/// waits, and is gone once its head is handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_groups_are_listed_by_the_admin_api_and_the_cli() {
    let on = memory();
    let port = common::http::free_port();
    let mut cfg = config(&on, OnFailure::Park, None);
    cfg.node.admin = Some(format!("127.0.0.1:{port}").parse().unwrap());
    let settled = Arc::new(Settled::default());
    let opts = NodeOptions {
        workers: 2,
        settle_observer: Some(settled.clone()),
        ..NodeOptions::default()
    };
    let node = Node::start(&cfg, on.transport.clone(), opts).await.unwrap();
    // Four failures: parked for four rungs.
    let head = flaky(GROUP, 4);
    common::publish_confirmed(on.transport.as_ref(), &on.topology, 0, &head).await;
    let start = Instant::now();
    while settled.position(&head.id, Outcome::RetryScheduled).is_none() {
        assert!(start.elapsed() < Duration::from_secs(30), "the head never failed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (status, body) = tokio::task::spawn_blocking(move || common::http::call("GET", port, "/v1/groups", None, b""))
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let parked = body["parked"].as_array().unwrap();
    assert_eq!(parked.len(), 1, "{body}");
    assert_eq!(parked[0]["group"], GROUP);
    assert_eq!(parked[0]["head"], head.id.as_str());
    assert_eq!(parked[0]["slot"], 0);
    let (_, slots) = tokio::task::spawn_blocking(move || common::http::call("GET", port, "/v1/slots", None, b""))
        .await
        .unwrap();
    assert_eq!(
        slots["slots"][0]["parked"], 1,
        "GET /v1/slots counts the slot's parked groups: {slots}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(["groups", "list", "--admin", &format!("http://127.0.0.1:{port}")])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        text.contains(GROUP) && text.contains(&head.id) && text.contains("1 group(s) parked"),
        "{text}"
    );
    while settled.position(&head.id, Outcome::Handled).is_none() {
        assert!(start.elapsed() < Duration::from_secs(60), "{:?}", settled.0.lock());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, body) = tokio::task::spawn_blocking(move || common::http::call("GET", port, "/v1/groups", None, b""))
        .await
        .unwrap();
    assert_eq!(body["parked"].as_array().map(Vec::len), Some(0), "{body}");
    node.shutdown().await.unwrap();
}

/// `weir groups skip` releases a parked group at once (its held messages
/// run before the head is back) and dead-letters the head `skipped` when it
/// comes back; `POST /v1/groups/unpark` releases another, whose head then
/// runs late. A group that is not parked is refused with 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_skips_or_unparks_a_parked_group() {
    let on = memory();
    let port = common::http::free_port();
    let mut cfg = config(&on, OnFailure::Park, None);
    cfg.node.admin = Some(format!("127.0.0.1:{port}").parse().unwrap());
    cfg.node.admin_token = Some("op-token".into());
    let settled = Arc::new(Settled::default());
    let opts = NodeOptions {
        workers: 2,
        settle_observer: Some(settled.clone()),
        ..NodeOptions::default()
    };
    let node = Node::start(&cfg, on.transport.clone(), opts).await.unwrap();
    let wait_for = |id: String, want: Outcome| {
        let settled = settled.clone();
        async move {
            let start = Instant::now();
            while settled.position(&id, want).is_none() {
                assert!(
                    start.elapsed() < Duration::from_secs(60),
                    "{id} never {want:?}: {:?}",
                    settled.0.lock()
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    for (group, skip) in [("to-skip", true), ("to-unpark", false)] {
        let head = flaky(group, 4);
        common::publish_confirmed(on.transport.as_ref(), &on.topology, 0, &head).await;
        wait_for(head.id.clone(), Outcome::RetryScheduled).await;
        let held: Vec<Envelope> = (0..3).map(|_| flaky(group, 0)).collect();
        for m in &held {
            common::publish_confirmed(on.transport.as_ref(), &on.topology, 0, m).await;
        }
        if skip {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_weir"))
                .args([
                    "groups",
                    "skip",
                    "--admin",
                    &format!("127.0.0.1:{port}"),
                    "--token",
                    "op-token",
                ])
                .args(["--topology", &on.topology, "--group", group])
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
            assert!(text.contains("skipped"), "{text}");
        } else {
            let body = serde_json::json!({ "topology": on.topology, "group": group }).to_string();
            let (status, answer) = tokio::task::spawn_blocking(move || {
                common::http::call("POST", port, "/v1/groups/unpark", Some("op-token"), body.as_bytes())
            })
            .await
            .unwrap();
            assert_eq!(status, 200, "{answer}");
            assert_eq!(answer["head"], head.id.as_str());
        }
        // The held messages run at once, before the head is back.
        for m in &held {
            wait_for(m.id.clone(), Outcome::Handled).await;
        }
        let end = if skip {
            Outcome::DeadLettered(Reason::Skipped)
        } else {
            Outcome::Handled
        };
        wait_for(head.id.clone(), end).await;
        let head_end = settled.position(&head.id, end).unwrap();
        assert!(
            held.iter()
                .all(|m| settled.position(&m.id, Outcome::Handled).unwrap() < head_end),
            "{:?}",
            settled.0.lock()
        );
    }
    let body = serde_json::json!({ "topology": on.topology, "group": "never-parked" }).to_string();
    let (status, answer) = tokio::task::spawn_blocking(move || {
        common::http::call("POST", port, "/v1/groups/skip", Some("op-token"), body.as_bytes())
    })
    .await
    .unwrap();
    assert_eq!(status, 404, "{answer}");
    node.shutdown().await.unwrap();
}
