//! Drains, handoffs and ingress forwarding on NATS JetStream against the real
//! server (nats://127.0.0.1:4222, override with WEIR_TEST_NATS_URL): a drain
//! stops pulling before it waits, releases what it held in order, and a
//! release never counts as a failed attempt (the host counts failures in
//! the topology's `WEIR_T_ATTEMPTS` bucket; the server never gives up on a
//! message), so no number of drains loses a message, dead-letters it
//! `exhausted`, or shows the handler a later attempt; two nodes forwarding
//! the ingress keep its order. Every test uses its own topology `t-<uuid8>`
//! and deletes its streams and bucket when it ends.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::PullConsumer;
use futures::{FutureExt as _, StreamExt as _};
use weir::config::{ClusterMode, TransportKind};
use weir::envelope::{Envelope, header};
use weir::node::{Node, NodeOptions};
use weir::outcome::Outcome;
use weir::runtime::RuntimeOptions;
use weir::transport::nats::{Nats, names};

use common::compliance::{self, LedgerSettle, Observer, Subject};
use common::nats::{Topo, js_at};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// What several nodes started one after another share: the call log, the
/// ledger and every settlement in order.
struct Shared {
    obs: Arc<Observer>,
    settle: Arc<LedgerSettle>,
}

impl Shared {
    fn new() -> Self {
        let obs = Arc::new(Observer::default());
        let settle = Arc::new(LedgerSettle::new(obs.clone()));
        Self { obs, settle }
    }

    fn outcomes(&self) -> Vec<(String, Outcome)> {
        self.settle.all()
    }
}

/// A node of `topo` on its own connection, reporting to `shared`.
async fn node(topo: &Topo, shared: &Shared, slots: u32, ladder: &[Duration], max_deliver: i64, n: usize) -> Node {
    let subject = Subject {
        transport: Arc::new(Nats::new(topo.url.clone(), format!("weir drain {} #{n}", topo.name))),
        kind: TransportKind::Nats,
        url: Some(topo.url.clone()),
    };
    let cfg = compliance::config(&subject, &topo.name, slots, ladder, max_deliver, &format!("node-{n}"));
    let opts = NodeOptions {
        workers: 2,
        runtime: common::cached(RuntimeOptions::default()),
        call_observer: Some(shared.obs.clone()),
        settle_observer: Some(shared.settle.clone()),
        ..NodeOptions::default()
    };
    Node::start(&cfg, subject.transport, opts)
        .await
        .expect("the node starts")
}

/// Wait for `what` to hold, polling; fails after `timeout` with `why()`.
async fn until(timeout: Duration, mut what: impl FnMut() -> bool, why: impl Fn() -> String) {
    let start = Instant::now();
    while !what() {
        assert!(start.elapsed() < timeout, "timed out: {}", why());
        tokio::time::sleep(ms(10)).await;
    }
}

/// Issue 14, item 1. One node, one slot, four groups of 24 slow calls
/// (300 ms each, so each group's later messages wait in its lane),
/// `max_deliver = 3`: the node is shut down (drained) ten times while calls
/// run and messages are held, and started again each time. Every message is
/// handled, in its group's order, on attempt 1; nothing is dead-lettered;
/// the server drops nothing (no MAX_DELIVERIES advisory, the consumer ends
/// with nothing pending). Before the fix, each drain Nak'd the held messages
/// (a delivery each, counted as an attempt), the pull kept delivering into
/// the draining node, and the server's `MaxDeliver` dropped them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_drains_of_held_messages_lose_nothing_and_spend_no_attempt() {
    let topo = Topo::new();
    let shared = Shared::new();
    let js = js_at(&topo.url).await;
    let stream = names::stream(&topo.name);
    let consumer = names::slot_consumer(&topo.name, 0);
    let mut advisories = async_nats::connect(topo.url.as_str())
        .await
        .unwrap()
        .subscribe(format!(
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}"
        ))
        .await
        .unwrap();

    let first = node(&topo, &shared, 1, &[secs(1)], 3, 0).await;
    let groups: Vec<String> = (0..4).map(|g| format!("held-{g}")).collect();
    let mut order: HashMap<String, Vec<String>> = HashMap::new();
    let mut ids = HashSet::new();
    // Enough that every one of the ten drains still holds messages: a drain
    // settles the calls in flight, and under two busy loops (slow restarts)
    // a cycle handled up to five a group, leaving 3 of 48 at cycle 9.
    for _ in 0..24 {
        for g in &groups {
            let m: Envelope = common::message("slow", Some(g), b"300");
            ids.insert(m.id.clone());
            order.entry(g.clone()).or_default().push(m.id.clone());
            first.publish(&topo.name, &m).await.unwrap();
        }
    }
    let mut current = first;
    for cycle in 1..=10 {
        // Drain while calls run and messages wait behind them.
        let started = shared.obs.calls.all().len();
        until(
            secs(30),
            || shared.obs.calls.all().len() > started,
            || format!("cycle {cycle}: no call started"),
        )
        .await;
        let held: usize = ids.len() - shared.obs.ledger.outcomes().len();
        assert!(
            held > 4,
            "cycle {cycle}: messages are held at the drain ({held} unsettled)"
        );
        current.shutdown().await.expect("the node drains");
        current = node(&topo, &shared, 1, &[secs(1)], 3, cycle).await;
    }
    until(
        secs(120),
        || {
            let o = shared.obs.ledger.outcomes();
            ids.iter().all(|id| o.contains_key(id))
        },
        || {
            format!(
                "{} of {} settled: {:?}",
                shared.obs.ledger.outcomes().len(),
                ids.len(),
                shared.outcomes().iter().filter(|(_, o)| *o != Outcome::Handled).count()
            )
        },
    )
    .await;
    current.shutdown().await.expect("the node drains");

    let outcomes = shared.obs.ledger.outcomes();
    let not_handled: Vec<_> = outcomes.iter().filter(|(_, o)| **o != Outcome::Handled).collect();
    assert!(not_handled.is_empty(), "every message handled: {not_handled:?}");
    let dead: Vec<_> = shared
        .outcomes()
        .into_iter()
        .filter(|(_, o)| matches!(o, Outcome::DeadLettered(_) | Outcome::Stranded))
        .collect();
    assert!(dead.is_empty(), "nothing dead-lettered: {dead:?}");
    let calls = shared.obs.calls.all();
    let late: Vec<_> = calls
        .iter()
        .filter(|c| c.attempt != 1)
        .map(|c| (&c.id, c.attempt))
        .collect();
    assert!(late.is_empty(), "releases are not attempts: {late:?}");
    for (g, want) in &order {
        let mut seen: Vec<String> = Vec::new();
        for c in calls.iter().filter(|c| c.group.as_deref() == Some(g)) {
            if !seen.contains(&c.id) {
                seen.push(c.id.clone());
            }
        }
        assert_eq!(&seen, want, "group {g} ran in publish order across the drains");
    }
    assert_eq!(shared.obs.ledger.overlaps(), 0);
    let dlq = js.get_stream(names::dead_letter_stream(&topo.name)).await.unwrap();
    assert_eq!(dlq.cached_info().state.messages, 0, "the dead-letter stream is empty");
    let mut c: PullConsumer = js.get_consumer_from_stream(&consumer, &stream).await.unwrap();
    let info = c.info().await.unwrap();
    assert_eq!(
        (info.num_pending, info.num_ack_pending, info.ack_floor.stream_sequence),
        (0, 0, ids.len() as u64),
        "the server delivered and saw acked every message: {info:?}"
    );
    assert_eq!(info.config.max_deliver, -1, "the server never gives up on a message");
    assert!(advisories.next().now_or_never().is_none(), "no MAX_DELIVERIES advisory");
}

/// The failure count is the host's: a message released by several drains
/// and then failing is retried on attempts 1, 2 (the first rung timing the
/// gap, not a later one) and dead-lettered after the handler's last attempt
/// (`max_deliver - 1`, the capture reserve), with the server's delivery
/// count in its provenance being larger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_counted_by_the_host_after_releases() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let topo = Topo::new();
    let shared = Shared::new();
    // A slow head holds the group's retrying message in its lane at each
    // drain: three heads, three drains.
    let mut current = node(&topo, &shared, 1, &[ms(500)], 3, 0).await;
    let heads: Vec<Envelope> = (0..3).map(|_| common::message("slow", Some("r"), b"300")).collect();
    let retry = common::message("retry", Some("r"), b"x");
    for m in heads.iter().chain([&retry]) {
        current.publish(&topo.name, m).await.unwrap();
    }
    for (cycle, head) in heads.iter().enumerate() {
        until(
            secs(20),
            || !shared.obs.calls.of(&head.id).is_empty(),
            || format!("head {cycle} started"),
        )
        .await;
        current.shutdown().await.unwrap();
        current = node(&topo, &shared, 1, &[ms(500)], 3, cycle + 1).await;
    }
    until(
        secs(30),
        || shared.obs.ledger.outcomes().contains_key(&retry.id),
        || format!("settled: {:?}", shared.outcomes()),
    )
    .await;
    current.shutdown().await.unwrap();
    let attempts: Vec<u32> = shared.obs.calls.of(&retry.id).iter().map(|c| c.attempt).collect();
    assert_eq!(attempts, vec![1, 2], "the handler's attempts count failures only");
    let calls = shared.obs.calls.of(&retry.id);
    let gap = calls[1].start - calls[0].start;
    assert!(
        gap + ms(50) >= ms(500) && gap < ms(1500),
        "the first rung timed the retry: {gap:?}"
    );
    assert_eq!(
        shared.obs.ledger.outcomes().get(&retry.id),
        Some(&Outcome::DeadLettered(weir::outcome::Reason::Exhausted))
    );
}

/// Issue 14, item 9. Two nodes forward one topology's ingress (neither
/// consumes a slot, so the forwarded messages stay in the stream to be
/// read): the slot subject holds every group's messages in the order they
/// were published to the ingress. Before the fix the ingress consumer let
/// each node hold a batch, and the two interleaved their forwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_forwarders_keep_the_ingress_order() {
    let topo = Topo::new();
    let shared = Shared::new();
    let mut nodes = Vec::new();
    for n in 0..2 {
        let subject = Subject {
            transport: Arc::new(Nats::new(
                topo.url.clone(),
                format!("weir forwarder {} #{n}", topo.name),
            )),
            kind: TransportKind::Nats,
            url: Some(topo.url.clone()),
        };
        let mut cfg = compliance::config(&subject, &topo.name, 1, &[secs(1)], 3, &format!("fwd-{n}"));
        cfg.cluster.mode = ClusterMode::Static;
        cfg.cluster.owned_slots = Some(Vec::new());
        let opts = NodeOptions {
            workers: 1,
            runtime: common::cached(RuntimeOptions::default()),
            settle_observer: Some(shared.settle.clone()),
            ..NodeOptions::default()
        };
        nodes.push(
            Node::start(&cfg, subject.transport, opts)
                .await
                .expect("the node starts"),
        );
    }
    let js = js_at(&topo.url).await;
    let ingress = names::ingress(&topo.name);
    let total = 300;
    let mut acks = Vec::new();
    for i in 0..total {
        let mut headers = HeaderMap::new();
        headers.insert(header::MESSAGE_ID, format!("in-{i:04}").as_str());
        headers.insert(header::MESSAGE_TYPE, "ok");
        headers.insert(header::GROUP_ID, format!("g-{}", i % 3).as_str());
        acks.push(
            js.publish_with_headers(ingress.clone(), headers, "x".into())
                .await
                .unwrap(),
        );
    }
    for a in acks {
        a.await.unwrap();
    }
    let stream = js.get_stream(names::stream(&topo.name)).await.unwrap();
    let slot = names::slot_subject(&topo.name, 0);
    let mut forwarded = Vec::new();
    let mut seq = 1;
    let start = Instant::now();
    while forwarded.len() < total {
        match stream.get_raw_message(seq).await {
            Ok(m) => {
                if m.subject.as_str() == slot {
                    forwarded.push(m.headers.get(header::MESSAGE_ID).unwrap().as_str().to_owned());
                }
                seq += 1;
            }
            Err(_) => {
                assert!(start.elapsed() < secs(60), "{} of {total} forwarded", forwarded.len());
                tokio::time::sleep(ms(20)).await;
            }
        }
    }
    for n in nodes {
        n.shutdown().await.unwrap();
    }
    for g in 0..3 {
        let of_group: Vec<&String> = forwarded
            .iter()
            .filter(|id| id[3..].parse::<usize>().unwrap() % 3 == g)
            .collect();
        let mut sorted = of_group.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(of_group, sorted, "group g-{g} forwarded in ingress order, once each");
    }
}
