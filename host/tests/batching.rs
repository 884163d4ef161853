//! Batching inside the lanes (issue 6), on the memory broker and on RabbitMQ
//! (amqp://127.0.0.1:5672, override with WEIR_TEST_AMQP_URL; each RabbitMQ
//! test declares its own `t-<uuid8>` topology and deletes it afterwards).
//! Real wasmtime and the faulty test guest, whose `batch.X` types behave as
//! `X` and are bound to `handle-batch` here.
//!
//! Asserted: a batched and an unbatched type sharing group ids never overlap
//! within a group while groups run in parallel (and its red baseline: batches
//! outside their group's lane are caught by the ledger); tenants never merge;
//! a poison member dead-letters alone; a trapping batch is replayed member by
//! member, each settled once with its group, tenant and attempt; a backlog
//! larger than every internal bound with a slow handler finishes; the drain
//! returns the members of an unfinished batch.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use weir::config::{self, Config, RetrySection, TransportKind};
use weir::envelope::{self, Envelope};
use weir::node::{Node, NodeOptions, bundled};
use weir::observe::ledger::{Ledger, SEQ_HEADER};
use weir::observe::stats::FlushReason;
use weir::outcome::SettleObserver;
use weir::outcome::{Outcome, Reason};
use weir::runtime::CallObserver;
use weir::transport::Transport;
use weir::transport::memory::MemoryBroker;
use weir::transport::rabbitmq::RabbitMq;

use common::rabbit::{Topo, url};

const LADDER: [Duration; 1] = [Duration::from_millis(20)];

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
        topology: "batching".into(),
        _guard: None,
    }
}

fn rabbit() -> On {
    let topo = Topo::new(1, &LADDER);
    On {
        transport: Arc::new(RabbitMq::new(url(), format!("weir batching-{}", topo.name))),
        kind: TransportKind::Rabbitmq,
        url: Some(url()),
        topology: topo.name.clone(),
        _guard: Some(topo),
    }
}

/// One slot; `slow`/`ok` single, `batch.*` batched by `size` and `linger`.
fn config(on: &On, size: u32, linger: Duration, max_groups: u32, prefetch: u32) -> Config {
    let mut t = config::Topology::new(&on.topology, 1);
    t.max_concurrent_groups = max_groups;
    t.max_unordered = max_groups;
    t.retry = Some(RetrySection {
        ladder: Some(LADDER.to_vec()),
        max_deliver: Some(3),
        ..Default::default()
    });
    let mut h = config::Handler::new(
        "faulty",
        bundled::FAULTY_PATH,
        &on.topology,
        vec!["slow".into(), "ok".into()],
    );
    // The watch below holds a call up to its `hold` while it waits for a
    // second call of the group (the negative control's overlap); that wait
    // runs on the call's clock, so the timeout must be far longer than any
    // hold, or a partner that comes late turns the wait into timeouts,
    // retries and dead letters instead of an overlap.
    h.limits.timeout = Duration::from_secs(60);
    h.batch = Some(config::Batch {
        message_types: ["batch.slow", "batch.ok", "batch.reject", "batch.trap"]
            .map(String::from)
            .to_vec(),
        size,
        linger,
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
            prefetch,
            ..Default::default()
        },
        cluster: config::Cluster::default(),
        topology: vec![t],
        handler: vec![h],
        tenant: Vec::new(),
        telemetry: Default::default(),
        origin: "<batching test>".into(),
    }
}

fn msg(t: &str, group: Option<&str>, tenant: Option<&str>, payload: &str, seq: u64) -> Envelope {
    envelope::new_message(
        envelope::fresh_id(),
        t,
        group.map(str::to_owned),
        tenant.map(str::to_owned),
        vec![(SEQ_HEADER.into(), seq.to_string())],
        payload.as_bytes().to_vec(),
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

/// One guest call as seen from outside: single or batch, and its members.
#[derive(Debug, Clone)]
struct Seen {
    batch: bool,
    members: Vec<(String, Option<String>, Option<String>, u32)>,
}

/// The ledger, every settlement per id, every call, and a rendezvous: the
/// first call of a group waits (up to `hold`) for a second call of the same
/// group to start, so an overlap that can happen does happen.
struct Watch {
    ledger: Ledger,
    settled: Mutex<HashMap<String, Vec<Outcome>>>,
    calls: Mutex<Vec<Seen>>,
    running: Mutex<HashMap<String, u32>>,
    arrived: Condvar,
    hold: Duration,
}

impl Watch {
    fn new(hold: Duration) -> Arc<Self> {
        Arc::new(Self {
            ledger: Ledger::new(),
            settled: Mutex::default(),
            calls: Mutex::default(),
            running: Mutex::default(),
            arrived: Condvar::new(),
            hold,
        })
    }

    fn enter(&self, group: Option<&str>) {
        let Some(g) = group else { return };
        let mut running = self.running.lock();
        *running.entry(g.to_owned()).or_default() += 1;
        self.arrived.notify_all();
        let deadline = Instant::now() + self.hold;
        while running.get(g).copied().unwrap_or(0) < 2 {
            if self.arrived.wait_until(&mut running, deadline).timed_out() {
                break;
            }
        }
    }

    fn leave(&self, group: Option<&str>) {
        if let Some(g) = group
            && let Some(n) = self.running.lock().get_mut(g)
        {
            *n -= 1;
        }
    }

    fn note(&self, batch: bool, msgs: &[Envelope]) {
        let members = msgs
            .iter()
            .map(|m| (m.id.clone(), m.group_id.clone(), m.tenant_id.clone(), m.attempt))
            .collect();
        self.calls.lock().push(Seen { batch, members });
    }

    fn settlements(&self, id: &str) -> Vec<Outcome> {
        self.settled.lock().get(id).cloned().unwrap_or_default()
    }

    fn settled_total(&self) -> usize {
        self.settled.lock().values().map(Vec::len).sum()
    }
}

impl CallObserver for Watch {
    fn before(&self, msg: &Envelope) {
        self.note(false, std::slice::from_ref(msg));
        self.ledger.before(msg);
        self.enter(msg.group());
    }
    fn after(&self, msg: &Envelope) {
        self.leave(msg.group());
        self.ledger.after(msg);
    }
    fn before_batch(&self, batch: &[Envelope]) {
        self.note(true, batch);
        self.ledger.before_batch(batch);
        self.enter(batch[0].group());
    }
    fn after_batch(&self, batch: &[Envelope]) {
        self.leave(batch[0].group());
        self.ledger.after_batch(batch);
    }
}

impl SettleObserver for Watch {
    fn settled(&self, id: &str, outcome: Outcome) {
        self.ledger.settled(id, outcome);
        self.settled.lock().entry(id.to_owned()).or_default().push(outcome);
    }
}

async fn start(on: &On, cfg: &Config, watch: &Arc<Watch>, workers: usize, bypass_batch_lanes: bool) -> Node {
    let opts = NodeOptions {
        workers,
        call_observer: Some(watch.clone()),
        settle_observer: Some(watch.clone()),
        max_run: 1,
        bypass_batch_lanes,
        ..NodeOptions::default()
    };
    Node::start(cfg, on.transport.clone(), opts).await.unwrap()
}

// ---------------------------------------------------------------- scenarios

/// Four groups, each a mix of single `slow` and batched `batch.slow`
/// messages: no two calls of a group at once, groups in parallel, batches
/// formed, order kept within each group.
async fn shared_groups_never_overlap(on: On) {
    let watch = Watch::new(Duration::from_millis(30));
    let cfg = config(&on, 4, Duration::from_millis(20), 8, 64);
    let node = start(&on, &cfg, &watch, 2, false).await;
    let groups = ["g-a", "g-b", "g-c", "g-d"];
    let mut total = 0;
    for g in groups {
        for seq in 0..8u64 {
            let t = if seq % 3 == 0 { "slow" } else { "batch.slow" };
            node.publish(&on.topology, &msg(t, Some(g), None, "5", seq))
                .await
                .unwrap();
            total += 1;
        }
    }
    let stats = node.stats();
    wait_until("every message handled", Duration::from_secs(60), || {
        stats.handled.load(Ordering::Relaxed) >= total
    })
    .await;
    node.shutdown().await.unwrap();
    let snap = stats.snapshot();
    assert_eq!(snap.handled, total);
    assert_eq!(watch.ledger.overlaps(), 0, "two calls of one group ran at once");
    assert_eq!(watch.ledger.out_of_order(), 0, "a group's messages ran out of order");
    assert!(
        watch.ledger.peak_groups() >= 2,
        "groups never ran in parallel (peak {})",
        watch.ledger.peak_groups()
    );
    assert!(watch.ledger.batches() > 0, "no batch was formed");
    assert!(
        snap.batch_members > snap.batches(),
        "batches never held more than one member ({snap:?})"
    );
    assert_eq!(watch.ledger.mixed_batches(), 0);
}

/// Red baseline: with batches run in a lane of their own (beside their
/// group's lane), one group's single message and batch run at once, and the
/// ledger must see it. Deterministic: one group, two workers, and the
/// rendezvous holds the first call until the second starts.
async fn negative_control_batches_outside_their_lane(on: On) {
    let watch = Watch::new(Duration::from_secs(5));
    let cfg = config(&on, 2, Duration::from_millis(1), 8, 64);
    let node = start(&on, &cfg, &watch, 2, true).await;
    node.publish(&on.topology, &msg("slow", Some("g"), None, "1", 0))
        .await
        .unwrap();
    node.publish(&on.topology, &msg("batch.slow", Some("g"), None, "1", 1))
        .await
        .unwrap();
    node.publish(&on.topology, &msg("batch.slow", Some("g"), None, "1", 2))
        .await
        .unwrap();
    let stats = node.stats();
    wait_until("every message handled", Duration::from_secs(60), || {
        stats.handled.load(Ordering::Relaxed) >= 3
    })
    .await;
    node.shutdown().await.unwrap();
    assert!(
        watch.ledger.overlaps() > 0,
        "batches ran outside their group's lane, yet the ledger saw no overlap"
    );
}

/// Two tenants share a group and publish ungrouped messages too: no batch
/// ever holds members of two tenants (or two groups), and batching happened.
async fn tenants_never_merge(on: On) {
    let watch = Watch::new(Duration::ZERO);
    let cfg = config(&on, 10, Duration::from_millis(30), 8, 256);
    let node = start(&on, &cfg, &watch, 2, false).await;
    let mut total = 0;
    for round in 0..4u64 {
        for (k, tenant) in ["acme", "globex"].into_iter().enumerate() {
            for i in 0..3u64 {
                let seq = round * 6 + k as u64 * 3 + i;
                node.publish(&on.topology, &msg("batch.ok", Some("shared"), Some(tenant), "", seq))
                    .await
                    .unwrap();
                node.publish(&on.topology, &msg("batch.ok", None, Some(tenant), "", 0))
                    .await
                    .unwrap();
                total += 2;
            }
        }
    }
    let stats = node.stats();
    wait_until("every message handled", Duration::from_secs(30), || {
        stats.handled.load(Ordering::Relaxed) >= total
    })
    .await;
    node.shutdown().await.unwrap();
    assert_eq!(watch.ledger.mixed_batches(), 0, "a batch mixed tenants or groups");
    let calls = watch.calls.lock().clone();
    let batches: Vec<&Seen> = calls.iter().filter(|c| c.batch).collect();
    assert!(!batches.is_empty());
    for b in &batches {
        let (_, group, tenant, _) = &b.members[0];
        assert!(
            b.members.iter().all(|(_, g, t, _)| g == group && t == tenant),
            "mixed batch: {b:?}"
        );
    }
    assert!(
        batches.iter().any(|b| b.members.len() > 1),
        "no batch held more than one member"
    );
    assert_eq!(watch.ledger.out_of_order(), 0);
}

/// A batch of four with one rejecting member: that member alone is
/// dead-lettered, the others are handled, each settled exactly once, and
/// nothing is replayed.
async fn poison_member_dead_letters_alone(on: On) {
    let watch = Watch::new(Duration::ZERO);
    let cfg = config(&on, 4, Duration::from_secs(5), 8, 64);
    let node = start(&on, &cfg, &watch, 2, false).await;
    let members: Vec<Envelope> = ["batch.ok", "batch.ok", "batch.reject", "batch.ok"]
        .iter()
        .enumerate()
        .map(|(i, t)| msg(t, Some("g"), Some("acme"), "", i as u64))
        .collect();
    for m in &members {
        node.publish(&on.topology, m).await.unwrap();
    }
    wait_until("every member settled", Duration::from_secs(30), || {
        watch.settled_total() >= 4
    })
    .await;
    let stats = node.stats();
    node.shutdown().await.unwrap();
    let snap = stats.snapshot();
    for m in &members {
        let expected = if m.message_type == "batch.reject" {
            Outcome::DeadLettered(Reason::Rejected)
        } else {
            Outcome::Handled
        };
        assert_eq!(watch.settlements(&m.id), vec![expected], "{}", m.message_type);
    }
    assert_eq!(snap.batches(), 1, "{snap:?}");
    assert_eq!(snap.batch_flushes(FlushReason::Size), 1);
    assert_eq!(snap.batch_replays, 0);
    assert_eq!(snap.dead_lettered(Reason::Rejected), 1);
}

/// A batch whose call traps: every member is replayed alone through
/// `handle` with its group, tenant and attempt, and settled once; the
/// trapping member then follows the retry ladder to its dead letter.
async fn trap_replays_each_member_once(on: On) {
    let watch = Watch::new(Duration::ZERO);
    let cfg = config(&on, 4, Duration::from_millis(50), 8, 64);
    let node = start(&on, &cfg, &watch, 2, false).await;
    let members: Vec<Envelope> = ["batch.ok", "batch.trap", "batch.ok", "batch.ok"]
        .iter()
        .enumerate()
        .map(|(i, t)| msg(t, Some("g"), Some("acme"), "", i as u64))
        .collect();
    for m in &members {
        node.publish(&on.topology, m).await.unwrap();
    }
    let trap = &members[1];
    wait_until("the trapping member dead-lettered", Duration::from_secs(30), || {
        watch
            .settlements(&trap.id)
            .contains(&Outcome::DeadLettered(Reason::Trap))
    })
    .await;
    let stats = node.stats();
    node.shutdown().await.unwrap();
    let snap = stats.snapshot();
    let calls = watch.calls.lock().clone();
    for m in members.iter().filter(|m| m.message_type == "batch.ok") {
        assert_eq!(watch.settlements(&m.id), vec![Outcome::Handled], "member {}", m.id);
        let singles: Vec<_> = calls
            .iter()
            .filter(|c| !c.batch && c.members[0].0 == m.id)
            .map(|c| c.members[0].clone())
            .collect();
        assert_eq!(
            singles,
            vec![(m.id.clone(), Some("g".into()), Some("acme".into()), 1)],
            "the replay must call handle once with the member as delivered"
        );
    }
    // The trapping member: one settlement per delivery, the last its dead letter.
    assert_eq!(
        watch.settlements(&trap.id),
        vec![
            Outcome::RetryScheduled,
            Outcome::RetryScheduled,
            Outcome::DeadLettered(Reason::Trap)
        ]
    );
    assert_eq!(
        snap.batch_replays, 3,
        "one replay per delivery of the trapping member ({snap:?})"
    );
    assert_eq!(snap.handled, 3);
}

/// More messages than every bound (prefetch 8, two lanes at once, batches
/// of 4, one worker) with a slow handler, batched and single types mixed in
/// the same groups plus ungrouped batches: it all finishes.
async fn saturation_finishes(on: On) {
    let watch = Watch::new(Duration::ZERO);
    let cfg = config(&on, 4, Duration::from_millis(5), 2, 8);
    let node = start(&on, &cfg, &watch, 1, false).await;
    let mut total = 0;
    for seq in 0..300u64 {
        let g = format!("g-{}", seq % 6);
        let t = if seq % 5 == 0 { "slow" } else { "batch.slow" };
        node.publish(&on.topology, &msg(t, Some(&g), None, "1", seq))
            .await
            .unwrap();
        node.publish(&on.topology, &msg("batch.slow", None, None, "1", 0))
            .await
            .unwrap();
        total += 2;
    }
    let stats = node.stats();
    wait_until("the whole backlog handled", Duration::from_secs(120), || {
        stats.handled.load(Ordering::Relaxed) >= total
    })
    .await;
    node.shutdown().await.unwrap();
    assert_eq!(stats.snapshot().handled, total);
    assert_eq!(watch.ledger.overlaps(), 0);
    assert_eq!(watch.ledger.out_of_order(), 0);
}

/// A batch that cannot grow does not hold the window: once the slot holds
/// every delivery its prefetch allows, nothing more can arrive until
/// something settles, so partial batches run at once (reason `window`)
/// instead of lingering. Four groups of one message each, prefetch 4, a
/// linger of ten minutes: without the rule nothing runs for ten minutes.
/// (A window with room still lingers: `memory_linger_flushes_a_partial_batch_…`.)
async fn a_full_window_runs_partial_batches_without_their_linger(on: On) {
    let watch = Watch::new(Duration::ZERO);
    let cfg = config(&on, 100, Duration::from_secs(600), 8, 4);
    let node = start(&on, &cfg, &watch, 2, false).await;
    for (seq, g) in ["g0", "g1", "g2", "g3"].into_iter().enumerate() {
        node.publish(&on.topology, &msg("batch.ok", Some(g), None, "", seq as u64))
            .await
            .unwrap();
    }
    let stats = node.stats();
    wait_until("the four partial batches handled", Duration::from_secs(30), || {
        stats.handled.load(Ordering::Relaxed) == 4
    })
    .await;
    let snap = stats.snapshot();
    assert_eq!(
        (
            snap.batches(),
            snap.batch_flushes(FlushReason::Window),
            snap.batch_members
        ),
        (4, 4, 4),
        "one batch of one per group, each run because the window was full: {snap:?}"
    );
    node.shutdown().await.unwrap();
}

// ------------------------------------------------------------------- memory

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_batched_and_single_types_share_groups_without_overlap() {
    shared_groups_never_overlap(memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_negative_control_batches_outside_their_lane_are_caught() {
    negative_control_batches_outside_their_lane(memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_tenants_never_merge() {
    tenants_never_merge(memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_poison_member_dead_letters_alone() {
    poison_member_dead_letters_alone(memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_trap_replays_each_member_once() {
    trap_replays_each_member_once(memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_full_window_runs_partial_batches_without_their_linger() {
    a_full_window_runs_partial_batches_without_their_linger(memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_saturation_finishes() {
    saturation_finishes(memory()).await;
}

/// Linger: a partial batch runs once its oldest member has waited `linger`
/// (not before, not much after); the drain returns an unfinished batch's
/// members to the broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_linger_flushes_a_partial_batch_and_the_drain_releases_one() {
    let mem = MemoryBroker::new();
    let on = On {
        transport: Arc::new(mem.clone()),
        ..memory()
    };
    let watch = Watch::new(Duration::ZERO);
    let linger = Duration::from_millis(300);
    let cfg = config(&on, 100, linger, 8, 64);
    let node = start(&on, &cfg, &watch, 2, false).await;
    let started = Instant::now();
    node.publish(&on.topology, &msg("batch.ok", Some("g"), None, "", 0))
        .await
        .unwrap();
    node.publish(&on.topology, &msg("batch.ok", Some("g"), None, "", 1))
        .await
        .unwrap();
    let stats = node.stats();
    wait_until("the partial batch handled", Duration::from_secs(10), || {
        stats.handled.load(Ordering::Relaxed) == 2
    })
    .await;
    let took = started.elapsed();
    assert!(took >= linger, "ran after {took:?}, before the linger of {linger:?}");
    assert!(
        took < linger * 3,
        "ran after {took:?}, long past the linger of {linger:?}"
    );
    let snap = stats.snapshot();
    assert_eq!((snap.batches(), snap.batch_flushes(FlushReason::Linger)), (1, 1));
    node.shutdown().await.unwrap();

    // An unfinished batch at the drain goes back to the broker.
    let cfg = config(&on, 100, Duration::from_secs(60), 8, 64);
    let node = start(&on, &cfg, &watch, 2, false).await;
    for seq in 0..3 {
        node.publish(&on.topology, &msg("batch.ok", Some("g"), None, "", seq))
            .await
            .unwrap();
    }
    wait_until("all three delivered", Duration::from_secs(10), || {
        mem.unacked(&on.topology) == 3
    })
    .await;
    let stats = node.stats();
    let reports = node.shutdown().await.unwrap();
    assert_eq!(reports.iter().map(|r| r.released).sum::<u64>(), 3);
    assert_eq!(stats.snapshot().batch_released, 3);
    assert_eq!(
        mem.total_depth(&on.topology),
        3,
        "released members must stay on the broker"
    );
}

// ----------------------------------------------------------------- RabbitMQ

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_batched_and_single_types_share_groups_without_overlap() {
    shared_groups_never_overlap(rabbit()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_negative_control_batches_outside_their_lane_are_caught() {
    negative_control_batches_outside_their_lane(rabbit()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_tenants_never_merge() {
    tenants_never_merge(rabbit()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_poison_member_dead_letters_alone() {
    poison_member_dead_letters_alone(rabbit()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_trap_replays_each_member_once() {
    trap_replays_each_member_once(rabbit()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_a_full_window_runs_partial_batches_without_their_linger() {
    a_full_window_runs_partial_batches_without_their_linger(rabbit()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_saturation_finishes() {
    saturation_finishes(rabbit()).await;
}
