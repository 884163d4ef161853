//! The NATS JetStream transport against the real server (nats://127.0.0.1:4222
//! with JetStream, override with WEIR_TEST_NATS_URL) on the shared compliance
//! harness (`common/compliance.rs`): the same assertions as the RabbitMQ
//! suite (slot routing, ingress forwarding, lanes, dead-letter provenance),
//! plus what only JetStream has: the server-timed ladder (and
//! its negative control, a plain Nak that burns it), the capture reserve,
//! the schedule facts the server enforces, the ack-floor monitor, and a
//! server restart. Clusters of separate nodes are in `nats_cluster.rs`.
//! Every test uses its own topology `t-<uuid8>` and deletes
//! its streams when it ends, also when it fails, so the tests run in parallel
//! and repeatedly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind, consumer::pull, stream};
use futures::StreamExt as _;
use weir::config::TransportKind;
use weir::envelope::{self, Envelope, header};
use weir::node::{Node, NodeOptions};
use weir::outcome::Outcome;
use weir::partition;
use weir::runtime::RuntimeOptions;
use weir::transport::nats::{Nats, NatsOptions, names};
use weir::transport::{TopologySpec, Transport};

use common::compliance::{self, Harness, Subject};
use common::nats::{Topo, js_at, url};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// The harness's subject: a NATS transport with `options` on the server at `url`.
fn subject(url: &str, name: &str, options: NatsOptions) -> Subject {
    Subject {
        transport: Arc::new(Nats::with_options(url, format!("weir node-{name}"), options)),
        kind: TransportKind::Nats,
        url: Some(url.to_owned()),
    }
}

/// A node on NATS for `topo`, whose streams are deleted when the harness drops.
async fn start_on(
    topo: Topo,
    options: NatsOptions,
    slots: u32,
    ladder: &[Duration],
    max_deliver: i64,
) -> Harness<Topo> {
    let name = topo.name.clone();
    let subject = subject(&topo.url, &name, options);
    Harness::start(subject, &name, slots, ladder, max_deliver, topo).await
}

/// A node on the test server for a fresh topology.
async fn start(slots: u32, ladder: &[Duration], max_deliver: i64) -> Harness<Topo> {
    start_on(Topo::new(), NatsOptions::default(), slots, ladder, max_deliver).await
}

fn msg(t: &str, group: Option<&str>, payload: &str) -> Envelope {
    common::message(t, group, payload.as_bytes())
}

fn header_text(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name).map(|v| v.as_str().to_owned())
}

/// Read the first `n` dead letters of a topology (a plain client, as an
/// operator's tool would).
async fn read_dead_letters(topology: &str, n: usize, timeout: Duration) -> Vec<jetstream::message::StreamMessage> {
    let js = js_at(&url()).await;
    let deadline = Instant::now() + timeout;
    let stream = js.get_stream(names::dead_letter_stream(topology)).await.unwrap();
    let mut out = Vec::new();
    let mut seq = 1;
    while out.len() < n {
        match stream.get_raw_message(seq).await {
            Ok(m) => {
                out.push(m);
                seq += 1;
            }
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "timed out reading dead letters: {} of {n} ({e})",
                    out.len()
                );
                tokio::time::sleep(ms(50)).await;
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_of_groups_keeps_lanes_slots_and_parallelism() {
    let mut h = start(4, &[ms(500)], 3).await;
    let name = h.name.clone();
    compliance::burst_of_groups(&mut h, |slot| names::slot_subject(&name, slot)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cascades_and_ingress_come_through_the_slot_subjects() {
    let mut h = start(3, &[ms(500)], 3).await;
    let parents: Vec<Envelope> = (0..6).map(|i| msg("publish", Some(&format!("c-{i}")), "x")).collect();
    let mut ids: HashSet<String> = HashSet::new();
    for p in &parents {
        ids.insert(p.id.clone());
        ids.insert(envelope::cascade_id(p, 0));
        h.publish(p).await;
    }
    // Ingress: a plain client sets only id, type and group; one message lacks the type.
    let js = js_at(&url()).await;
    let ingress = names::ingress(&h.name);
    let mut ingress_ids = Vec::new();
    for i in 0..4 {
        let id = format!("in-{i}-{}", h.name);
        let mut headers = HeaderMap::new();
        headers.insert(header::MESSAGE_ID, id.as_str());
        headers.insert(header::MESSAGE_TYPE, "ok");
        headers.insert(header::GROUP_ID, format!("ig-{i}").as_str());
        js.publish_with_headers(ingress.clone(), headers, "hi".into())
            .await
            .unwrap()
            .await
            .unwrap();
        ids.insert(id.clone());
        ingress_ids.push(id);
    }
    let mut headers = HeaderMap::new();
    headers.insert(header::GROUP_ID, "no-type");
    js.publish_with_headers(ingress.clone(), headers, "?".into())
        .await
        .unwrap()
        .await
        .unwrap();

    let outcomes = h.wait_outcomes(&ids, secs(60)).await;
    assert!(ids.iter().all(|id| outcomes.get(id) == Some(&Outcome::Handled)));
    let seen = h.seen.lock().clone();
    let called: HashSet<String> = h.obs.calls.all().into_iter().map(|c| c.id).collect();
    for id in &called {
        let s = seen
            .iter()
            .find(|s| &s.id == id)
            .unwrap_or_else(|| panic!("{id} ran without a delivery"));
        let expected = partition::slot_for(s.group.as_deref(), id, 3);
        assert_eq!(s.source, names::slot_subject(&h.name, expected));
    }
    for id in &ingress_ids {
        assert!(called.contains(id), "ingress message {id} was forwarded and handled");
    }
    let dead = read_dead_letters(&h.name, 1, secs(10)).await;
    let d = &dead[0].headers;
    assert_eq!(
        header_text(d, header::DEAD_LETTER_REASON).as_deref(),
        Some("undecodable")
    );
    assert_eq!(header_text(d, header::SOURCE).as_deref(), Some(ingress.as_str()));
    assert_eq!(header_text(d, header::GROUP_ID).as_deref(), Some("no-type"));
    assert!(header_text(d, header::STREAM_SEQUENCE).is_some());
    h.shutdown().await;
}

/// The ladder times each failed attempt: a retrying message is naked with
/// its rung's delay (never a plain Nak) and the server redelivers it after
/// that rung (measured start to start). The handler runs on
/// `max_deliver - 1` deliveries (the capture reserve), then the message is
/// dead-lettered with every provenance header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_gaps_follow_the_backoff() {
    let ladder = [secs(1), secs(2), secs(3)];
    let mut h = start(2, &ladder, 5).await;
    let m = msg("retry", Some("r-1"), "x");
    h.publish(&m).await;
    h.wait_for(&m.id, Outcome::DeadLettered(weir::outcome::Reason::Exhausted), secs(30))
        .await;
    let calls = h.obs.calls.of(&m.id);
    assert_eq!(calls.iter().map(|c| c.attempt).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    for (i, rung) in ladder.iter().enumerate() {
        let gap = calls[i + 1].start - calls[i].start;
        assert!(
            gap + ms(50) >= *rung && gap < *rung + ms(700),
            "gap before delivery {} was {gap:?}, rung {rung:?} (a nak would make it ~0)",
            i + 2
        );
    }
    let dead = read_dead_letters(&h.name, 1, secs(10)).await;
    let d = &dead[0];
    let hd = &d.headers;
    assert_eq!(header_text(hd, header::MESSAGE_ID).as_deref(), Some(m.id.as_str()));
    assert_eq!(header_text(hd, header::MESSAGE_TYPE).as_deref(), Some("retry"));
    assert_eq!(header_text(hd, header::GROUP_ID).as_deref(), Some("r-1"));
    assert_eq!(header_text(hd, header::ATTEMPT).as_deref(), Some("4"));
    assert_eq!(
        header_text(hd, header::DEAD_LETTER_REASON).as_deref(),
        Some("exhausted")
    );
    assert_eq!(header_text(hd, header::ERROR).as_deref(), Some("retry by test"));
    let slot = partition::slot_for(Some("r-1"), "", 2);
    assert_eq!(
        header_text(hd, header::SOURCE),
        Some(names::slot_subject(&h.name, slot))
    );
    assert_eq!(header_text(hd, header::HANDLER).as_deref(), Some("faulty"));
    assert!(header_text(hd, header::HANDLER_VERSION).is_some_and(|v| !v.is_empty()));
    assert!(header_text(hd, header::FAILED_AT).is_some_and(|v| v.contains('T')));
    assert_eq!(header_text(hd, header::STREAM_SEQUENCE).as_deref(), Some("1"));
    assert_eq!(header_text(hd, header::DELIVERY_COUNT).as_deref(), Some("4"));
    assert_eq!(d.payload.as_ref(), b"x");
    assert_eq!(d.subject.as_str(), names::dead_letter(&h.name));
    // The capture was acked with a confirmed ack: the consumer caught up.
    let snap = h.node().stats().snapshot();
    assert_eq!((snap.stranded, snap.uncertain), (0, 0));
    h.shutdown().await;
}

/// Negative control for `retry_gaps_follow_the_backoff`: a consumer with the
/// ladder as its BackOff that answers each delivery with a plain Nak gets
/// every delivery at once. A host that naked a retry without the rung's
/// delay would fail the test above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_a_plain_nak_burns_the_ladder() {
    let topo = Topo::new();
    let js = js_at(&url()).await;
    let spec = TopologySpec {
        retry: weir::retry::schedule::RetryPolicy::new(vec![secs(1), secs(2), secs(3)], 5),
        ..TopologySpec::new(&topo.name, 1)
    };
    let transport = Nats::new(url(), "weir nak control");
    transport.declare(&spec).await.unwrap();
    // A consumer with the BackOff on the slot's subject (Weir's own has
    // none: it naks with the rung's delay).
    let consumer: jetstream::consumer::PullConsumer = js
        .create_consumer_on_stream(
            pull::Config {
                durable_name: Some("nak-control".into()),
                filter_subject: names::slot_subject(&topo.name, 0),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                max_deliver: 5,
                backoff: vec![secs(1), secs(2), secs(3)],
                ..Default::default()
            },
            names::stream(&topo.name),
        )
        .await
        .unwrap();
    assert_eq!(consumer.cached_info().config.backoff, vec![secs(1), secs(2), secs(3)]);
    transport
        .publish(&topo.name, 0, envelope::encode(&msg("retry", Some("n"), "x")))
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let mut times = Vec::new();
    while times.len() < 5 {
        let m = tokio::time::timeout(secs(10), messages.next())
            .await
            .expect("a delivery")
            .unwrap()
            .unwrap();
        times.push(Instant::now());
        m.ack_with(AckKind::Nak(None)).await.unwrap();
    }
    let spread = times[4] - times[0];
    assert!(
        spread < ms(900),
        "five deliveries took {spread:?}: a plain Nak should redeliver at once, well under the first rung"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_is_dead_lettered_at_once() {
    let mut h = start(2, &[secs(1)], 3).await;
    let m = msg("reject", Some("rj"), "bad");
    h.publish(&m).await;
    h.wait_for(&m.id, Outcome::DeadLettered(weir::outcome::Reason::Rejected), secs(20))
        .await;
    assert_eq!(h.obs.calls.of(&m.id).len(), 1, "a reject is not retried");
    let dead = read_dead_letters(&h.name, 1, secs(10)).await;
    let hd = &dead[0].headers;
    assert_eq!(header_text(hd, header::DEAD_LETTER_REASON).as_deref(), Some("rejected"));
    assert_eq!(header_text(hd, header::ERROR).as_deref(), Some("rejected by test"));
    assert_eq!(header_text(hd, header::DELIVERY_COUNT).as_deref(), Some("1"));
    h.shutdown().await;
}

/// The dead-letter stream is gone: the capture fails, the message is left for
/// a later delivery (`requeued`) rather than acked, the deliveries after the
/// handler's last retry only the capture (the handler does not run again),
/// and since the host counts failures and the server never gives up on a
/// message, it is never `stranded`: once the stream is back, the capture
/// succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_capture_is_retried_until_the_dead_letter_stream_is_back() {
    let mut h = start(1, &[ms(500), ms(500)], 3).await;
    let js = js_at(&url()).await;
    js.delete_stream(names::dead_letter_stream(&h.name)).await.unwrap();
    let m = msg("retry", Some("s"), "x");
    h.publish(&m).await;
    let start = Instant::now();
    while h.settled_of(&m.id).iter().filter(|o| **o == Outcome::Requeued).count() < 2 {
        assert!(start.elapsed() < secs(20), "settled so far: {:?}", h.settled_of(&m.id));
        tokio::time::sleep(ms(20)).await;
    }
    js.create_stream(stream::Config {
        name: names::dead_letter_stream(&h.name),
        subjects: vec![names::dead_letter(&h.name)],
        ..Default::default()
    })
    .await
    .unwrap();
    h.wait_for(&m.id, Outcome::DeadLettered(weir::outcome::Reason::Exhausted), secs(20))
        .await;
    let settled = h.settled_of(&m.id);
    assert_eq!(settled[0], Outcome::RetryScheduled);
    assert!(
        settled[1..settled.len() - 1].iter().all(|o| *o == Outcome::Requeued),
        "{settled:?}"
    );
    let attempts: Vec<u32> = h.obs.calls.of(&m.id).iter().map(|c| c.attempt).collect();
    assert_eq!(attempts, vec![1, 2], "later deliveries only retry the capture");
    let snap = h.node().stats().snapshot();
    assert_eq!(snap.stranded, 0);
    h.shutdown().await;
}

/// What nats-server 2.9 accepts: `len(BackOff) == MaxDeliver` is refused
/// (error 10116, stricter than LESSONS.md's "equal is fine"), one more
/// delivery is accepted, and `AckWait` is normalised to the first rung.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_refuses_a_backoff_as_long_as_max_deliver() {
    let topo = Topo::new();
    let transport = Nats::new(url(), "weir schedule facts");
    let mut spec = TopologySpec::new(&topo.name, 1);
    spec.retry = weir::retry::schedule::RetryPolicy::new(vec![secs(1), secs(2), secs(3)], 3);
    transport.declare(&spec).await.unwrap();
    // Weir writes no BackOff (the host times retries and counts failures),
    // so its consumer binds; the pure check still refuses the policy.
    drop(
        transport
            .subscribe(&topo.name, 0, 8)
            .await
            .expect("no BackOff, nothing to refuse"),
    );
    let check = spec
        .retry
        .schedule(weir::retry::schedule::Redelivery::JETSTREAM)
        .check(&weir::retry::schedule::CheckContext::new("topology[0].retry"));
    assert!(!check.is_ok());

    let js = js_at(&url()).await;
    // Longer than MaxDeliver: refused as well, of course.
    let longer = pull::Config {
        durable_name: Some("longer".into()),
        filter_subject: names::slot_subject(&topo.name, 0),
        max_deliver: 2,
        backoff: vec![secs(1), secs(2), secs(3)],
        ..Default::default()
    };
    let e = js
        .create_consumer_on_stream(longer, names::stream(&topo.name))
        .await
        .expect_err("refused");
    assert!(e.to_string().contains("10116"), "{e}");
    // Unlimited deliveries beside a BackOff are refused too (MaxDeliver -1);
    // Weir's consumer has no BackOff, so it is unlimited as it is.
    let unlimited = pull::Config {
        durable_name: Some("unlimited".into()),
        filter_subject: names::slot_subject(&topo.name, 0),
        max_deliver: -1,
        backoff: vec![secs(1)],
        ..Default::default()
    };
    let e = js
        .create_consumer_on_stream(unlimited, names::stream(&topo.name))
        .await
        .expect_err("refused");
    assert!(e.to_string().contains("10116"), "{e}");
    spec.retry = weir::retry::schedule::RetryPolicy::new(vec![secs(1), secs(2), secs(3)], 0);
    let other = Nats::new(url(), "weir unlimited");
    other.declare(&spec).await.unwrap();
    drop(
        other
            .subscribe(&topo.name, 0, 8)
            .await
            .expect("unlimited with a ladder binds"),
    );
    let c: jetstream::consumer::PullConsumer = js
        .get_consumer_from_stream(names::slot_consumer(&topo.name, 0), names::stream(&topo.name))
        .await
        .unwrap();
    assert_eq!(c.cached_info().config.max_deliver, -1);

    let cfg = pull::Config {
        durable_name: Some("normalised".into()),
        filter_subject: names::slot_subject(&topo.name, 0),
        ack_wait: secs(30),
        max_deliver: 4,
        backoff: vec![secs(1), secs(2), secs(3)],
        ..Default::default()
    };
    let c = js
        .create_consumer_on_stream(cfg, names::stream(&topo.name))
        .await
        .unwrap();
    assert_eq!(
        c.cached_info().config.ack_wait,
        secs(1),
        "AckWait normalised to the first rung"
    );
}

/// Two streams may not overlap on nats-server 2.9, so `WEIR_T` cannot cover
/// `weir.T.>` beside `WEIR_T_DLQ`: an existing `WEIR_T` over the whole
/// namespace is narrowed to the slot and ingress subjects, keeping its
/// retention, and then the dead-letter stream can be created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_over_the_whole_namespace_is_narrowed_and_keeps_max_age() {
    let topo = Topo::new();
    let js = js_at(&url()).await;
    js.create_stream(stream::Config {
        name: names::stream(&topo.name),
        subjects: vec![format!("weir.{}.>", topo.name)],
        max_age: secs(3600),
        ..Default::default()
    })
    .await
    .unwrap();
    let overlap = js
        .create_stream(stream::Config {
            name: names::dead_letter_stream(&topo.name),
            subjects: vec![names::dead_letter(&topo.name)],
            ..Default::default()
        })
        .await
        .expect_err("the server refuses overlapping streams");
    assert!(overlap.to_string().contains("overlap"), "{overlap}");

    let transport = Nats::new(url(), "weir narrow");
    transport.declare(&TopologySpec::new(&topo.name, 2)).await.unwrap();
    let mut s = js.get_stream(names::stream(&topo.name)).await.unwrap();
    let info = s.info().await.unwrap();
    assert_eq!(info.config.subjects, names::stream_subjects(&topo.name));
    assert_eq!(info.config.max_age, secs(3600));
    js.get_stream(names::dead_letter_stream(&topo.name)).await.unwrap();
    let facts = transport.retry_facts(&topo.name).await.unwrap().unwrap();
    assert_eq!(facts.stream_max_age, Some(secs(3600)));
}

/// The start-up check reads the stream's real `max_age` and refuses a ladder
/// whose last delivery comes after it (silent loss); a config with no retry
/// section is never refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_refuses_a_ladder_that_outlives_the_stream() {
    let topo = Topo::new();
    let js = js_at(&url()).await;
    js.create_stream(stream::Config {
        name: names::stream(&topo.name),
        subjects: names::stream_subjects(&topo.name),
        max_age: secs(5),
        ..Default::default()
    })
    .await
    .unwrap();
    // [1s, 2s, 3s] with max_deliver 5: the last delivery comes 9s after the first.
    let err = try_node(&topo, &[secs(1), secs(2), secs(3)], 5, true)
        .await
        .err()
        .expect("refused");
    let text = format!("{err:#}");
    assert!(text.contains("max_age = 5s"), "{text}");
    assert!(text.contains("topology[0].retry"), "{text}");
    // A ladder that fits starts.
    let node = try_node(&topo, &[ms(500)], 3, true)
        .await
        .expect("a fitting ladder starts");
    node.shutdown().await.unwrap();
    // No retry section: never refused, even though the default ladder outlives 5s.
    let node = try_node(&topo, &[ms(500)], 3, false)
        .await
        .expect("the default policy is never refused");
    node.shutdown().await.unwrap();
}

/// A bare node (no recording) on `topo` with the harness's config, with or
/// without its retry section, or the node's refusal to start.
async fn try_node(topo: &Topo, ladder: &[Duration], max_deliver: i64, retry: bool) -> anyhow::Result<Node> {
    let subject = subject(&topo.url, &topo.name, NatsOptions::default());
    let mut cfg = compliance::config(
        &subject,
        &topo.name,
        1,
        ladder,
        max_deliver,
        &format!("node-{}", topo.name),
    );
    if !retry {
        cfg.topology[0].retry = None;
    }
    let opts = NodeOptions {
        workers: 1,
        runtime: common::cached(RuntimeOptions::default()),
        ..NodeOptions::default()
    };
    Node::start(&cfg, subject.transport, opts).await
}

/// A call longer than AckWait is kept alive with in-progress signals (not
/// redelivered mid-call), and the floor monitor sees the blocked consumer
/// stall while an idle one reports none; it recovers once the call ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_call_is_kept_alive_and_the_floor_monitor_sees_the_stall() {
    let options = NatsOptions {
        floor_poll: ms(200),
        floor_warn_after: Some(secs(1)),
        ..NatsOptions::default()
    };
    let mut h = start_on(Topo::new(), options, 2, &[secs(1)], 3).await;
    // Both pollers have read their consumer: idle (nothing delivered past
    // the floor), so neither may report a stall.
    let start = Instant::now();
    while h.node().ack_floor().len() < 2 {
        assert!(start.elapsed() < secs(15), "both slot consumers polled");
        tokio::time::sleep(ms(50)).await;
    }
    let idle = h.node().ack_floor();
    assert_eq!(idle.len(), 2, "both slot consumers watched: {idle:?}");
    assert!(
        idle.iter().all(|f| f.stalled_for.is_zero()),
        "idle consumers never stall: {idle:?}"
    );

    let m = msg("slow", Some("blocked"), "3000");
    let slot = partition::slot_for(Some("blocked"), "", 2);
    h.publish(&m).await;
    let start = Instant::now();
    let mut longest = Duration::ZERO;
    while !h.obs.ledger.outcomes().contains_key(&m.id) {
        assert!(start.elapsed() < secs(15), "the slow call finished");
        for f in h.node().ack_floor() {
            if f.slot == slot {
                longest = longest.max(f.stalled_for);
            } else {
                assert!(f.stalled_for.is_zero(), "the other slot is idle: {f:?}");
            }
        }
        tokio::time::sleep(ms(100)).await;
    }
    assert_eq!(h.obs.ledger.outcomes().get(&m.id), Some(&Outcome::Handled));
    assert_eq!(
        h.obs.calls.of(&m.id).len(),
        1,
        "not redelivered mid-call (AckWait is 1s, the call 3s)"
    );
    assert!(longest >= ms(1500), "a blocked consumer stalls: longest {longest:?}");
    // Caught up: the next polls see the floor moved and report no stall.
    let start = Instant::now();
    while !h.node().ack_floor().iter().all(|f| f.stalled_for.is_zero()) {
        assert!(start.elapsed() < secs(15), "caught up: {:?}", h.node().ack_floor());
        tokio::time::sleep(ms(50)).await;
    }
    h.shutdown().await;
}

/// A nats-server of this test's own, on a free port with its own store.
struct OwnServer {
    child: Option<std::process::Child>,
    port: u16,
    dir: tempfile::TempDir,
}

impl OwnServer {
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut s = Self {
            child: None,
            port,
            dir: tempfile::tempdir().unwrap(),
        };
        s.spawn();
        s
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn spawn(&mut self) {
        let child = std::process::Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js", "-sd"])
            .arg(self.dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("nats-server runs");
        self.child = Some(child);
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(start.elapsed() < secs(10), "nats-server listens");
            std::thread::sleep(ms(50));
        }
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The server stops mid-stream and comes back: the node reconnects, binds its
/// consumers again and finishes; nothing is lost, no group overlaps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_mid_stream_loses_nothing() {
    let mut server = OwnServer::start();
    let topo = Topo::at(server.url());
    let mut h = start_on(topo, NatsOptions::default(), 4, &[ms(500)], 0).await;
    let mut ids = HashSet::new();
    for _round in 0..30 {
        for g in 0..8 {
            let m = msg("slow", Some(&format!("rs-{g}")), "20");
            ids.insert(m.id.clone());
            h.publish(&m).await;
        }
    }
    let start = Instant::now();
    while h.obs.ledger.outcomes().len() < ids.len() / 4 {
        assert!(start.elapsed() < secs(30), "progress before the fault");
        tokio::time::sleep(ms(10)).await;
    }
    server.stop();
    let before = h.obs.ledger.outcomes().len();
    tokio::time::sleep(ms(1500)).await;
    server.spawn();
    assert!(before < ids.len(), "the fault hit mid-stream");

    let outcomes = h.wait_outcomes(&ids, secs(120)).await;
    let handled = ids
        .iter()
        .filter(|id| outcomes.get(*id) == Some(&Outcome::Handled))
        .count();
    assert_eq!(handled, ids.len(), "nothing lost");
    assert_eq!(h.obs.ledger.overlaps(), 0, "no overlap across the restart");
    assert!(h.subscriptions.load(Ordering::Relaxed) >= 4, "every slot subscribed");
    h.shutdown().await;
}

/// `weir schedule check` reads the stream's real `max_age` and refuses a
/// ladder that outlives it, exit 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedule_check_reads_the_stream_max_age() {
    let topo = Topo::new();
    let js = js_at(&url()).await;
    js.create_stream(stream::Config {
        name: names::stream(&topo.name),
        subjects: names::stream_subjects(&topo.name),
        max_age: secs(5),
        ..Default::default()
    })
    .await
    .unwrap();
    let text = format!(
        "[transport]\nkind = \"nats\"\nurl = \"{}\"\n[[topology]]\nname = \"{}\"\nslots = 2\n\
         [topology.retry]\nladder = [\"1s\", \"2s\", \"3s\"]\nmax_deliver = 5\n\
         [[handler]]\nname = \"orders\"\ncomponent = \"bundled:orders\"\ntopology = \"{}\"\n\
         message_types = [\"order.placed\"]\n",
        url(),
        topo.name,
        topo.name
    );
    let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    std::io::Write::write_all(&mut f, text.as_bytes()).unwrap();
    let path = f.path().to_owned();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_weir"))
            .args(["schedule", "check", "--config"])
            .arg(path)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("broker: stream max_age 5s"), "{stdout}");
    assert!(stdout.contains("max_age = 5s"), "{stdout}");
    assert!(stdout.contains("topology[0].retry"), "{stdout}");
}
