//! Guarantee 1 inside a node: no two messages of a group run at once, while
//! different groups do run in parallel; and the drain waits for every kind
//! of in-flight work. Real wasmtime, the real test guest, the memory broker.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use weir::config::{self, Config, RetrySection};
use weir::dispatch::LaneKind;
use weir::envelope::{self, Envelope, Wire};
use weir::node::{Node, NodeOptions, bundled};
use weir::observe::ledger::{Ledger, SEQ_HEADER};
use weir::outcome::{Outcome, Reason};
use weir::runtime::CallObserver;
use weir::transport::Transport;
use weir::transport::memory::MemoryBroker;

const TOPO: &str = "lanes";

fn config(slots: u32, max_groups: u32) -> Config {
    let mut t = config::Topology::new(TOPO, slots);
    t.max_concurrent_groups = max_groups;
    t.max_unordered = max_groups;
    t.retry = Some(RetrySection {
        ladder: Some(vec![Duration::from_millis(20)]),
        max_deliver: Some(3),
        ..Default::default()
    });
    let mut h = config::Handler::new("faulty", bundled::FAULTY_PATH, TOPO, vec!["slow".into(), "ok".into()]);
    h.batch = Some(config::Batch {
        message_types: vec!["batch.slow".into()],
        size: 10,
        linger: Duration::from_millis(1),
    });
    Config {
        node: config::Node {
            name: "lanes-test".into(),
            admin: None,
            ..config::Node::default()
        },
        transport: config::Transport::default(),
        cluster: config::Cluster::default(),
        topology: vec![t],
        handler: vec![h],
        tenant: Vec::new(),
        telemetry: Default::default(),
        origin: "<test>".into(),
    }
}

fn slow(group: Option<&str>, ms: u64, seq: u64) -> Envelope {
    envelope::new_message(
        envelope::fresh_id(),
        "slow",
        group.map(str::to_owned),
        None,
        vec![(SEQ_HEADER.into(), seq.to_string())],
        ms.to_string().into_bytes(),
    )
}

async fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Wraps the ledger: the first call of a group waits (up to `hold`) for a
/// second call of the same group to start. Without lanes that second call
/// does start, so the overlap is certain rather than a matter of timing;
/// with lanes it never can, and the wait just times out. Only a group's
/// first call waits: a later one could wait for a call that never comes
/// (its group's last), and on a loaded machine those waits added up past
/// the test's limit.
struct Rendezvous {
    ledger: Arc<Ledger>,
    running: Mutex<std::collections::HashMap<String, u32>>,
    waited: Mutex<std::collections::HashSet<String>>,
    arrived: Condvar,
    hold: Duration,
}

impl CallObserver for Rendezvous {
    fn before(&self, msg: &Envelope) {
        self.ledger.before(msg);
        let Some(g) = msg.group() else { return };
        let first = self.waited.lock().insert(g.to_owned());
        let mut running = self.running.lock();
        *running.entry(g.to_owned()).or_default() += 1;
        self.arrived.notify_all();
        if !first {
            return;
        }
        let deadline = Instant::now() + self.hold;
        while running.get(g).copied().unwrap_or(0) < 2 {
            if self.arrived.wait_until(&mut running, deadline).timed_out() {
                break;
            }
        }
    }

    fn after(&self, msg: &Envelope) {
        if let Some(g) = msg.group() {
            let mut running = self.running.lock();
            if let Some(n) = running.get_mut(g) {
                *n -= 1;
            }
        }
        self.ledger.after(msg);
    }
}

struct Run {
    overlaps: u64,
    peak_groups: usize,
    handled: u64,
}

/// Four groups of four slow messages in one slot, two workers.
async fn run_groups(bypass_lanes: bool, hold: Duration) -> Run {
    let ledger = Arc::new(Ledger::new());
    let observer = Arc::new(Rendezvous {
        ledger: ledger.clone(),
        running: Mutex::default(),
        waited: Mutex::default(),
        arrived: Condvar::new(),
        hold,
    });
    let broker = MemoryBroker::new();
    let opts = NodeOptions {
        workers: 2,
        call_observer: Some(observer),
        settle_observer: Some(ledger.clone()),
        max_run: 1,
        bypass_lanes,
        ..NodeOptions::default()
    };
    let node = Node::start(&config(1, 8), Arc::new(broker.clone()), opts)
        .await
        .unwrap();
    let groups = ["g-a", "g-b", "g-c", "g-d"];
    let per_group = 4u64;
    // Group-major, so that without lanes two messages of one group are next
    // to each other and both workers take them together.
    for g in groups {
        for seq in 0..per_group {
            node.publish(TOPO, &slow(Some(g), 10, seq)).await.unwrap();
        }
    }
    let stats = node.stats();
    let total = per_group * groups.len() as u64;
    wait_until("every message handled", Duration::from_secs(60), || {
        stats.handled.load(Ordering::Relaxed) >= total
    })
    .await;
    node.shutdown().await.unwrap();
    Run {
        overlaps: ledger.overlaps(),
        peak_groups: ledger.peak_groups(),
        handled: stats.handled.load(Ordering::Relaxed),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_never_overlap_a_group_and_run_groups_in_parallel() {
    let run = run_groups(false, Duration::from_millis(30)).await;
    assert_eq!(run.handled, 16);
    assert_eq!(run.overlaps, 0, "two calls of one group ran at once");
    assert!(
        run.peak_groups >= 2,
        "different groups never ran in parallel (peak {})",
        run.peak_groups
    );
}

/// Red baseline: the same scenario with the lanes bypassed must make the
/// ledger report overlaps. If this ever passes with 0, the ledger is blind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_bypassing_lanes_is_caught_by_the_ledger() {
    let run = run_groups(true, Duration::from_secs(5)).await;
    assert_eq!(run.handled, 16);
    assert!(run.overlaps > 0, "lanes bypassed, yet the ledger saw no overlap");
}

/// The ledger's claim is compare-and-remove: a losing claimant's release
/// must not evict the holder.
#[test]
fn ledger_release_by_a_losing_claimant_keeps_the_holder() {
    let ledger = Arc::new(Ledger::new());
    let msg = slow(Some("g"), 0, 0);
    ledger.before(&msg); // holder: this thread
    let l2 = ledger.clone();
    let m2 = msg.clone();
    std::thread::spawn(move || {
        l2.before(&m2); // loses: overlap
        l2.after(&m2); // must not evict the holder
    })
    .join()
    .unwrap();
    assert_eq!(ledger.overlaps(), 1);
    let l3 = ledger.clone();
    let m3 = msg.clone();
    std::thread::spawn(move || l3.before(&m3)).join().unwrap();
    assert_eq!(ledger.overlaps(), 2, "the holder was evicted by the loser's release");
    ledger.after(&msg);
}

/// The drain waits for every kind of in-flight work. The match is
/// exhaustive on purpose: a new `LaneKind` does not compile until it has a
/// scenario here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_waits_for_every_lane_kind() {
    for kind in LaneKind::ALL {
        let ledger = Arc::new(Ledger::new());
        let broker = MemoryBroker::new();
        let opts = NodeOptions {
            workers: 2,
            call_observer: Some(ledger.clone()),
            settle_observer: Some(ledger.clone()),
            ..NodeOptions::default()
        };
        let node = Node::start(&config(1, 8), Arc::new(broker.clone()), opts)
            .await
            .unwrap();
        let work = Duration::from_millis(400);
        let id = match kind {
            LaneKind::Grouped => {
                let m = slow(Some("g"), work.as_millis() as u64, 0);
                node.publish(TOPO, &m).await.unwrap();
                m.id
            }
            LaneKind::Unordered => {
                let m = slow(None, work.as_millis() as u64, 0);
                node.publish(TOPO, &m).await.unwrap();
                m.id
            }
            LaneKind::Batch => {
                let mut m = slow(Some("g"), work.as_millis() as u64, 0);
                m.message_type = "batch.slow".into();
                node.publish(TOPO, &m).await.unwrap();
                m.id
            }
            LaneKind::Capture => {
                // An undecodable message whose capture takes `work`.
                broker
                    .faults()
                    .dead_letter_delay_ms
                    .store(work.as_millis() as u64, Ordering::Relaxed);
                let wire = Wire {
                    headers: vec![("weir-message-id".into(), "raw-1".into())],
                    body: b"?".to_vec(),
                };
                broker.publish(TOPO, 0, wire).await.unwrap();
                "raw-1".to_owned()
            }
        };
        wait_until("the message to be in flight", Duration::from_secs(10), || {
            broker.unacked(TOPO) == 1 && (kind == LaneKind::Capture || ledger.calls() == 1)
        })
        .await;
        let started = Instant::now();
        let reports = node.shutdown().await.unwrap();
        let took = started.elapsed();
        let drained: Vec<LaneKind> = reports.iter().flat_map(|r| r.drained.clone()).collect();
        assert!(
            drained.contains(&kind),
            "{kind:?}: the drain did not wait for it (drained {drained:?})"
        );
        let outcome = ledger.outcomes().get(&id).copied();
        let expected = match kind {
            LaneKind::Capture => Some(Outcome::DeadLettered(Reason::Undecodable)),
            LaneKind::Grouped | LaneKind::Unordered | LaneKind::Batch => Some(Outcome::Handled),
        };
        let wire_id = if kind == LaneKind::Capture {
            "raw-1"
        } else {
            id.as_str()
        };
        assert_eq!(
            outcome, expected,
            "{kind:?}: message {wire_id} not settled when the drain returned"
        );
        assert_eq!(broker.total_depth(TOPO), 0, "{kind:?}: left on the broker");
        // A bound for a hang (the lower bound above is the check): on two
        // cores held by other processes a drain can be a second or more late.
        assert!(took < work + Duration::from_secs(10), "{kind:?}: drain took {took:?}");
    }
}

/// Messages not yet started at the drain go back to the broker unchanged
/// (not acked, not counted as a delivery), and a new runner takes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_releases_unstarted_messages_to_the_next_owner() {
    let broker = MemoryBroker::new();
    let ledger = Arc::new(Ledger::new());
    let opts = NodeOptions {
        workers: 1,
        call_observer: Some(ledger.clone()),
        settle_observer: Some(ledger.clone()),
        max_run: 1,
        ..NodeOptions::default()
    };
    let node = Node::start(&config(1, 1), Arc::new(broker.clone()), opts.clone())
        .await
        .unwrap();
    for seq in 0..5 {
        node.publish(TOPO, &slow(Some("g"), 200, seq)).await.unwrap();
    }
    wait_until(
        "the first call, with all five delivered to the runner",
        Duration::from_secs(10),
        || ledger.calls() == 1 && broker.unacked(TOPO) == 5,
    )
    .await;
    let reports = node.shutdown().await.unwrap();
    let released: u64 = reports.iter().map(|r| r.released).sum();
    assert_eq!(released, 4);
    assert_eq!(broker.total_depth(TOPO), 4, "released messages must stay on the broker");
    assert_eq!(broker.unacked(TOPO), 0);

    let node = Node::start(&config(1, 1), Arc::new(broker.clone()), opts)
        .await
        .unwrap();
    let stats = node.stats();
    wait_until("the rest handled by the next owner", Duration::from_secs(20), || {
        stats.handled.load(Ordering::Relaxed) == 4
    })
    .await;
    node.shutdown().await.unwrap();
    assert_eq!(ledger.overlaps(), 0);
    assert_eq!(broker.total_depth(TOPO), 0);
}

/// `limits.instances` bounds the calls of a handler running at once, even
/// when lanes and workers would allow more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_instances_limit_bounds_parallel_calls() {
    for (instances, expect_peak) in [(1u32, 1usize), (2, 2)] {
        let mut cfg = config(1, 8);
        cfg.handler[0].limits.instances = instances;
        let ledger = Arc::new(Ledger::new());
        let broker = MemoryBroker::new();
        let opts = NodeOptions {
            workers: 2,
            call_observer: Some(ledger.clone()),
            settle_observer: Some(ledger.clone()),
            max_run: 1,
            ..NodeOptions::default()
        };
        let node = Node::start(&cfg, Arc::new(broker.clone()), opts).await.unwrap();
        for seq in 0..3 {
            for g in ["a", "b", "c", "d"] {
                node.publish(TOPO, &slow(Some(g), 30, seq)).await.unwrap();
            }
        }
        let stats = node.stats();
        wait_until("all handled", Duration::from_secs(30), || {
            stats.handled.load(Ordering::Relaxed) == 12
        })
        .await;
        node.shutdown().await.unwrap();
        assert_eq!(ledger.peak_groups(), expect_peak, "instances = {instances}");
    }
}
