//! Issue 33, item 3: a cascade whose `PubAck` was lost lands once. A node on
//! a nats-server of the test's own, through a NATS-aware proxy
//! ([`common::nats_proxy`]) that withholds the first `PubAck` of the work
//! stream from the node: the handler's cascade is stored, its publish times
//! out, the message that made it is retried (its cascade is *uncertain*, not
//! failed), and the rerun publishes the cascade again under the same
//! deterministic id. With the id in `Nats-Msg-Id` the server drops that
//! copy: the stream holds the cascade once and it runs once. The negative
//! control is the same run with the header suppressed (a test-only
//! transport option): the ghost copy lands, twice in the stream, two runs.
//!
//! Also: the work stream's duplicate window covers the retry ladder, and is
//! capped at the stream's `max_age` (nats-server refuses a longer window).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use bytes::Bytes;
use parking_lot::Mutex;
use weir::config::{self, Config, RetrySection, TransportKind};
use weir::envelope::{self, Envelope, header};
use weir::node::{Node, NodeOptions, bundled};
use weir::observe::stats::Snapshot;
use weir::outcome::{Outcome, SettleObserver};
use weir::transport::nats::{Nats, NatsOptions, names};

use common::nats::Topo;
use common::nats_proxy::NatsProxy;
use common::nats_servers::NatsServers;

/// The ladder: the cause is retried 4 s after its uncertain cascade; the
/// long second rung shows in the duplicate window. The first rung is also
/// the consumer's `ack_wait`: at 1 s, a loaded machine let a message's
/// progress beat or ack arrive late, the server redelivered it, and the
/// cascade ran twice from one copy (seen as `[Handled, Handled]`).
const LADDER: [Duration; 2] = [Duration::from_secs(4), Duration::from_secs(600)];
const MAX_DELIVER: i64 = 4;
const TIMEOUT: Duration = Duration::from_secs(60);

fn config(topology: &str, url: &str) -> Config {
    let mut t = config::Topology::new(topology, 1);
    t.retry = Some(RetrySection {
        ladder: Some(LADDER.to_vec()),
        max_deliver: Some(MAX_DELIVER),
        ..Default::default()
    });
    let h = config::Handler::new(
        "faulty",
        bundled::FAULTY_PATH,
        topology,
        vec!["publish".into(), "ok".into()],
    );
    Config {
        node: config::Node {
            name: format!("node-{topology}"),
            admin: None,
            ..config::Node::default()
        },
        transport: config::Transport {
            kind: TransportKind::Nats,
            url: Some(url.to_owned().into()),
            prefetch: 8,
            ..Default::default()
        },
        cluster: config::Cluster::default(),
        topology: vec![t],
        handler: vec![h],
        tenant: Vec::new(),
        telemetry: Default::default(),
        origin: "<cascade dedup test>".into(),
    }
}

/// Every settlement, per message id.
#[derive(Default)]
struct Settled(Mutex<HashMap<String, Vec<Outcome>>>);

impl SettleObserver for Settled {
    fn settled(&self, id: &str, outcome: Outcome) {
        self.0.lock().entry(id.to_owned()).or_default().push(outcome);
    }
}

impl Settled {
    fn of(&self, id: &str) -> Vec<Outcome> {
        self.0.lock().get(id).cloned().unwrap_or_default()
    }

    async fn wait(&self, what: &str, f: impl Fn(&Self) -> bool) {
        let start = Instant::now();
        while !f(self) {
            assert!(
                start.elapsed() < TIMEOUT,
                "timed out after {TIMEOUT:?} waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// The messages of `stream` whose `weir-message-id` is `id`.
async fn copies_in_stream(js: &jetstream::Context, stream: &str, id: &str) -> usize {
    let mut s = js.get_stream(stream).await.unwrap();
    let last = s.info().await.unwrap().state.last_sequence;
    let mut n = 0;
    for seq in 1..=last {
        let Ok(m) = s.get_raw_message(seq).await else { continue };
        if m.headers.get(header::MESSAGE_ID).map(|v| v.as_str()) == Some(id) {
            n += 1;
        }
    }
    n
}

/// What one run saw.
struct Run {
    /// Copies of the cascade in the work stream.
    copies: usize,
    /// Runs of the cascade (its settlements).
    cascade_runs: usize,
    /// Those settlements, for the failure message.
    cascade_outcomes: Vec<Outcome>,
    stats: Snapshot,
    /// The work stream's duplicate window as the server holds it.
    window: Duration,
}

/// A `publish` message whose cascade's `PubAck` the proxy withholds, on a
/// node whose transport sets `Nats-Msg-Id` on cascades or not.
async fn lost_confirm_then_retry(servers: &NatsServers, msg_ids: bool) -> Run {
    let server_url = servers.urls()[0].clone();
    let target: SocketAddr = server_url.trim_start_matches("nats://").parse().unwrap();
    let proxy = NatsProxy::start(target);
    let topo = Topo::at(server_url.clone());
    let options = NatsOptions {
        cascade_msg_ids: msg_ids,
        ..NatsOptions::default()
    };
    let transport = Arc::new(Nats::with_options(
        proxy.url(),
        format!("weir dedup-{}", topo.name),
        options,
    ));
    let settled = Arc::new(Settled::default());
    let opts = NodeOptions {
        workers: 2,
        settle_observer: Some(settled.clone()),
        ..NodeOptions::default()
    };
    let node = Node::start(&config(&topo.name, &proxy.url()), transport, opts)
        .await
        .unwrap();

    // From here on, the node's first PubAck of the work stream is lost.
    let stream = names::stream(&topo.name);
    proxy.withhold(format!("\"stream\":\"{stream}\"").as_bytes(), 1);

    // The cause, published by a client of its own (not through the proxy).
    let cause: Envelope = envelope::new_message(
        envelope::fresh_id(),
        "publish",
        Some("g".into()),
        None,
        Vec::new(),
        b"cause".to_vec(),
    );
    let cascade_id = envelope::cascade_id(&cause, 0);
    let js = common::nats::js_at(&server_url).await;
    let wire = envelope::encode(&cause);
    let mut headers = async_nats::HeaderMap::new();
    for (k, v) in &wire.headers {
        headers.insert(k.as_str(), v.as_str());
    }
    js.publish_with_headers(names::slot_subject(&topo.name, 0), headers, Bytes::from(wire.body))
        .await
        .unwrap()
        .await
        .unwrap();

    settled
        .wait("the cause retried once (its cascade uncertain), then handled", |s| {
            s.of(&cause.id) == [Outcome::RetryScheduled, Outcome::Handled]
        })
        .await;
    assert_eq!(proxy.withheld(), 1, "the proxy withheld the cascade's PubAck");
    // Every copy the node published is in the stream before the cause's ack.
    let copies = copies_in_stream(&js, &stream, &cascade_id).await;
    settled
        .wait("every copy of the cascade handled", |s| {
            s.of(&cascade_id).len() >= copies
        })
        .await;
    let stats = node.stats().snapshot();
    node.shutdown().await.unwrap();
    let cascade_outcomes = settled.of(&cascade_id);
    let cascade_runs = cascade_outcomes.len();
    let window = js
        .get_stream(&stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .config
        .duplicate_window;
    Run {
        copies,
        cascade_runs,
        cascade_outcomes,
        stats,
        window,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cascade_whose_puback_was_lost_lands_once_with_its_message_id() {
    let servers = tokio::task::spawn_blocking(NatsServers::single).await.unwrap();
    let run = lost_confirm_then_retry(&servers, true).await;
    assert_eq!(run.copies, 1, "the rerun's copy must be dropped by the server");
    assert_eq!(
        run.cascade_runs, 1,
        "the cascade must run once: {:?}",
        run.cascade_outcomes
    );
    assert_eq!(run.stats.cascades_uncertain, 1, "the lost PubAck is counted uncertain");
    assert_eq!(
        run.stats.cascades_duplicate, 1,
        "the server reported the rerun's copy a duplicate"
    );
    // From the first delivery to the handler's last try (4 s + 600 s), plus
    // 30 s for each of its 3 deliveries.
    assert_eq!(run.window, Duration::from_secs(4 + 600 + 3 * 30));
}

/// Negative control: the same run with `Nats-Msg-Id` suppressed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_control_without_a_message_id_the_ghost_cascade_lands_twice() {
    let servers = tokio::task::spawn_blocking(NatsServers::single).await.unwrap();
    let run = lost_confirm_then_retry(&servers, false).await;
    assert_eq!(
        run.copies, 2,
        "without a message id the rerun's copy lands beside the first"
    );
    assert_eq!(
        run.cascade_runs, 2,
        "and the cascade runs twice: {:?}",
        run.cascade_outcomes
    );
    assert_eq!(run.stats.cascades_uncertain, 1);
    assert_eq!(run.stats.cascades_duplicate, 0);
}

/// An operator's `max_age` below the ladder caps the window (nats-server
/// refuses a window longer than `max_age`); the topology still declares.
#[tokio::test]
async fn the_duplicate_window_is_capped_at_the_streams_max_age() {
    let topo = Topo::new();
    let js = common::nats::js_at(&topo.url).await;
    let stream = names::stream(&topo.name);
    js.create_stream(jetstream::stream::Config {
        name: stream.clone(),
        subjects: names::stream_subjects(&topo.name),
        max_age: Duration::from_secs(300),
        ..Default::default()
    })
    .await
    .unwrap();
    let nats = Nats::new(topo.url.clone(), format!("weir dedup-cap-{}", topo.name));
    let mut spec = weir::transport::TopologySpec::new(&topo.name, 1);
    spec.retry = weir::retry::schedule::RetryPolicy::new(LADDER.to_vec(), MAX_DELIVER);
    weir::transport::Transport::declare(&nats, &spec).await.unwrap();
    let info = js
        .get_stream(&stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .config
        .clone();
    assert_eq!(info.max_age, Duration::from_secs(300), "the operator's max_age is kept");
    assert_eq!(
        info.duplicate_window,
        Duration::from_secs(300),
        "the window is capped at max_age"
    );
}
