//! Hot swap under a steady stream on a real broker (RabbitMQ): v1 → v2 →
//! rollback to v1 while messages flow. Every message is handled exactly
//! once by exactly one version, none is lost, each group's order is kept,
//! no group ever runs two calls (or two versions) at once, and within a
//! group the versions follow the swaps: v1…, then v2…, then v1… again.
//! Also measured: deploy-to-first-message latency and the throughput dip.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::http::{call, digest, free_port, variant, wait_up};
use common::rabbit::{Topo, url};
use parking_lot::Mutex;
use weir::config::{self, Config};
use weir::envelope::{self, Envelope};
use weir::node::{Node, NodeOptions, bundled};
use weir::observe::ledger::{Ledger, SEQ_HEADER};
use weir::runtime::CallObserver;
use weir::transport::rabbitmq::RabbitMq;

const TOKEN: &str = "operator-secret-0123456789";
const GROUPS: u64 = 40;
/// Rounds of messages (one per group) published at least.
const MIN_PER_GROUP: u64 = 20;

/// One guest call: which message, which version, when.
#[derive(Debug, Clone)]
struct Call {
    id: String,
    group: String,
    seq: u64,
    digest: String,
    start: Instant,
}

/// The ledger (overlaps, order) plus the version of every call.
#[derive(Default)]
struct SwapLog {
    ledger: Ledger,
    calls: Mutex<Vec<Call>>,
}

impl CallObserver for SwapLog {
    fn version(&self, msg: &Envelope, digest: &str) {
        let seq = msg.header(SEQ_HEADER).and_then(|s| s.parse().ok()).unwrap_or(u64::MAX);
        self.calls.lock().push(Call {
            id: msg.id.clone(),
            group: msg.group().unwrap_or_default().to_owned(),
            seq,
            digest: digest.to_owned(),
            start: Instant::now(),
        });
    }
    fn before(&self, msg: &Envelope) {
        self.ledger.before(msg);
    }
    fn after(&self, msg: &Envelope) {
        self.ledger.after(msg);
    }
}

/// The versions each group ran, in its order, must be a run of `phases`
/// (each phase's version for zero or more messages, phases in order):
/// a group never goes back to a version it left unless a swap says so.
fn phase_violations(calls: &[Call], phases: &[&str]) -> Vec<String> {
    let mut by_group: HashMap<&str, Vec<&Call>> = HashMap::new();
    for c in calls {
        by_group.entry(&c.group).or_default().push(c);
    }
    let mut out = Vec::new();
    for (group, mut cs) in by_group {
        cs.sort_by_key(|c| c.seq);
        let mut phase = 0;
        for c in cs {
            while phase < phases.len() && phases[phase] != c.digest {
                phase += 1;
            }
            if phase == phases.len() {
                out.push(format!(
                    "group {group}: message {} (seq {}) ran on {} out of phase",
                    c.id,
                    c.seq,
                    c.digest.chars().take(12).collect::<String>()
                ));
                break;
            }
        }
    }
    out
}

#[test]
fn the_phase_check_catches_a_group_that_flips_between_versions() {
    let at = Instant::now();
    let call = |seq: u64, digest: &str| Call {
        id: format!("m{seq}"),
        group: "g".into(),
        seq,
        digest: digest.into(),
        start: at,
    };
    let good = [call(0, "a"), call(1, "b"), call(2, "b"), call(3, "a")];
    assert!(phase_violations(&good, &["a", "b", "a"]).is_empty());
    // Negative control: v2 ran before a v1 message that came later, then v2 again.
    let flipping = [call(0, "a"), call(1, "b"), call(2, "a"), call(3, "b")];
    assert_eq!(phase_violations(&flipping, &["a", "b", "a"]).len(), 1);
}

fn config(topology: &str, port: u16) -> Config {
    let text = format!(
        r#"
[node]
name = "hot-swap"
admin = "127.0.0.1:{port}"
admin_token = "{TOKEN}"
[transport]
kind = "rabbitmq"
url = "{url}"
prefetch = 64
[[topology]]
name = "{topology}"
slots = 4
max_concurrent_groups = 16
[topology.retry]
ladder = ["200ms"]
max_deliver = 3
[[handler]]
name = "swap"
component = "{faulty}"
topology = "{topology}"
message_types = ["ok"]
"#,
        url = url(),
        faulty = bundled::FAULTY_PATH,
    );
    config::parse(&text, "<hot swap test>").unwrap()
}

async fn admin(
    method: &'static str,
    port: u16,
    path: &'static str,
    body: Vec<u8>,
) -> (u16, serde_json::Value, Instant) {
    let sent = Instant::now();
    let (code, json) = tokio::task::spawn_blocking(move || call(method, port, path, Some(TOKEN), &body))
        .await
        .unwrap();
    (code, json, sent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swap_and_rollback_under_a_steady_stream_on_rabbitmq() {
    let topo = Topo::new(4, &[Duration::from_millis(200)]);
    let port = free_port();
    let cfg = config(&topo.name, port);
    let log = Arc::new(SwapLog::default());
    let opts = NodeOptions {
        workers: 2,
        runtime: common::cached(weir::runtime::RuntimeOptions::default()),
        call_observer: Some(log.clone()),
        settle_observer: None,
        ..NodeOptions::default()
    };
    let transport = Arc::new(RabbitMq::new(url(), format!("weir hot-swap {}", topo.name)));
    let node = Arc::new(Node::start(&cfg, transport, opts).await.unwrap());
    wait_up(port);
    let v1 = std::fs::read(bundled::FAULTY_PATH).unwrap();
    // A new variant every run: the deploy compiles for real (no cache hit).
    let v2 = variant(&v1, &format!("hot-swap-{}", uuid::Uuid::new_v4()));
    let (d1, d2) = (digest(&v1), digest(&v2));

    // A steady stream: every group's messages in order, ~500 a second,
    // until the swaps below have each been seen serving calls.
    let stop = Arc::new(AtomicBool::new(false));
    let publisher = {
        let node = node.clone();
        let topology = topo.name.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut ids = Vec::new();
            for seq in 0.. {
                if seq >= MIN_PER_GROUP && stop.load(Ordering::Relaxed) {
                    break;
                }
                for g in 0..GROUPS {
                    let msg = envelope::new_message(
                        envelope::fresh_id(),
                        "ok",
                        Some(format!("g{g}")),
                        None,
                        vec![(SEQ_HEADER.into(), seq.to_string())],
                        vec![],
                    );
                    node.publish(&topology, &msg).await.unwrap();
                    ids.push(msg.id);
                }
                tokio::time::sleep(Duration::from_millis(80)).await;
            }
            ids
        })
    };
    let stream_start = Instant::now();
    // Each step waits until the version before it has served calls, however
    // slow the machine: the swaps land mid-stream by construction.
    let calls_on = |digest: &str, after: Option<Instant>| {
        log.calls
            .lock()
            .iter()
            .filter(|c| c.digest == digest && after.is_none_or(|t| c.start > t))
            .count()
    };
    wait_until("200 calls on v1 before the deploy", || calls_on(&d1, None) >= 200).await;
    let (code, body, deployed_at) = admin("PUT", port, "/v1/handlers/swap", v2.clone()).await;
    let deploy_took = deployed_at.elapsed();
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["digest"], d2.as_str());
    wait_until("200 calls on v2 before the rollback", || calls_on(&d2, None) >= 200).await;
    let (code, body, rolled_back_at) = admin("POST", port, "/v1/handlers/swap/rollback", vec![]).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["digest"], d1.as_str());
    wait_until("200 calls on v1 after the rollback", || {
        calls_on(&d1, Some(rolled_back_at)) >= 200
    })
    .await;
    stop.store(true, Ordering::Relaxed);

    let ids = publisher.await.unwrap();
    let total = ids.len();
    let stats = node.stats();
    let start = Instant::now();
    while (stats.snapshot().handled as usize) < total {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "only {} of {total} handled",
            stats.snapshot().handled
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Drained: no call can start after this, so a message that ran twice
    // is in the log by now.
    match Arc::try_unwrap(node) {
        Ok(node) => {
            node.shutdown().await.unwrap();
        }
        Err(_) => panic!("node still shared"),
    }
    let calls = log.calls.lock().clone();

    // Exactly once, by exactly one version, nothing lost.
    let mut per_id: HashMap<&str, Vec<&Call>> = HashMap::new();
    for c in &calls {
        per_id.entry(&c.id).or_default().push(c);
    }
    let lost: Vec<&String> = ids.iter().filter(|id| !per_id.contains_key(id.as_str())).collect();
    assert!(
        lost.is_empty(),
        "{} messages never ran: {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
    let repeated: Vec<_> = per_id.iter().filter(|(_, cs)| cs.len() > 1).collect();
    assert!(repeated.is_empty(), "messages that ran twice: {repeated:?}");
    assert_eq!(stats.snapshot().handled as usize, total);
    assert_eq!(log.ledger.overlaps(), 0, "two calls of one group at once");
    assert_eq!(log.ledger.out_of_order(), 0, "a group's order was broken");
    let violations = phase_violations(&calls, &[&d1, &d2, &d1]);
    assert!(violations.is_empty(), "{violations:#?}");

    // The swaps really happened mid-stream.
    let on_v2 = calls.iter().filter(|c| c.digest == d2).count();
    let after_rollback = calls
        .iter()
        .filter(|c| c.digest == d1 && c.start > rolled_back_at)
        .count();
    assert!(on_v2 > 100, "only {on_v2} calls on v2");
    assert!(
        after_rollback > 100,
        "only {after_rollback} calls on v1 after the rollback"
    );

    // Figures for BENCHMARKS.md.
    let first_v2 = calls.iter().filter(|c| c.digest == d2).map(|c| c.start).min().unwrap();
    let first_back = calls
        .iter()
        .filter(|c| c.digest == d1 && c.start > rolled_back_at)
        .map(|c| c.start)
        .min()
        .unwrap();
    // Calls in the second after each swap against the stream's steady rate.
    let end = calls.iter().map(|c| c.start).max().unwrap();
    let in_window = |from: Instant| {
        calls
            .iter()
            .filter(|c| c.start >= from && c.start < from + Duration::from_secs(1))
            .count()
    };
    let steady_from = stream_start + Duration::from_millis(200);
    let steady = (calls.iter().filter(|c| c.start >= steady_from).count() as f64) / (end - steady_from).as_secs_f64();
    println!(
        "hot swap: {total} messages over {:?}; deploy answered in {:?}, first v2 call {:?} after the request; \
         rollback first v1 call {:?} after the request; calls in the second after the deploy {} and after the rollback {} \
         against a steady {steady:.0}/s",
        end - stream_start,
        deploy_took,
        first_v2 - deployed_at,
        first_back - rolled_back_at,
        in_window(deployed_at),
        in_window(rolled_back_at),
    );
}

/// Poll `cond` until it holds; fail naming `what` after a minute.
async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(60), "{what}: not within a minute");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
