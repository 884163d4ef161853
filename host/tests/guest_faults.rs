#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Guest faults through a whole node on the in-memory broker, with the real
//! faulty guest: a trap, an endless loop, a memory hog and a stack overflow
//! each take the retry ladder and end on the dead-letter list with full
//! provenance, while the node keeps handling every other message. Also the
//! dispositions (`reject`, `retry`), held publishes, unroutable and
//! undecodable messages, and injected broker failures around the capture.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sha2::Digest as _;
use weir::config::{self, ByteSize, Config, RetrySection};
use weir::envelope::{self, Envelope, Wire, header};
use weir::node::{self, Node, NodeOptions};
use weir::observe::stats::{Snapshot, Stats};
use weir::outcome::SettleObserver;
use weir::outcome::{Outcome, Reason};
use weir::partition;
use weir::runtime::RuntimeOptions;
use weir::transport::Transport;
use weir::transport::memory::MemoryBroker;

use common::{Call, CallLog, message};

const TOPO: &str = "topo";
const SLOTS: u32 = 4;
const MAX_DELIVER: u32 = 3;
const LADDER: [Duration; 2] = [Duration::from_millis(20), Duration::from_millis(40)];
const TIMEOUT: Duration = Duration::from_millis(300);
const MEMORY_LIMIT: u64 = 16 << 20;
const HANDLER: &str = "faulty";
/// Longest any wait in these tests may take.
const PATIENCE: Duration = Duration::from_secs(20);
/// Message types bound to the faulty guest; anything else has no handler.
const BOUND: [&str; 12] = [
    "ok",
    "trap",
    "loop",
    "hog",
    "recurse",
    "slow",
    "reject",
    "retry",
    "publish",
    "publish-then-trap",
    "config",
    "env",
];

fn test_config() -> Config {
    let mut topology = config::Topology::new(TOPO, SLOTS);
    topology.retry = Some(RetrySection {
        ladder: Some(LADDER.to_vec()),
        max_deliver: Some(i64::from(MAX_DELIVER)),
        max_time_to_dead_letter: None,
    });
    let mut faulty = config::Handler::new(
        HANDLER,
        node::bundled::FAULTY_PATH,
        TOPO,
        BOUND.iter().map(|t| (*t).to_owned()).collect(),
    );
    faulty.limits.memory = ByteSize(MEMORY_LIMIT);
    faulty.limits.timeout = TIMEOUT;
    Config {
        node: config::Node {
            name: "guest-faults".into(),
            admin: None,
            ..config::Node::default()
        },
        transport: config::Transport::default(),
        cluster: config::Cluster::default(),
        topology: vec![topology],
        handler: vec![faulty],
        tenant: Vec::new(),
        telemetry: Default::default(),
        origin: "<guest_faults test>".into(),
    }
}

/// Every settlement, in order.
#[derive(Debug, Default)]
struct SettleLog {
    settled: Mutex<Vec<(String, Outcome)>>,
}

impl SettleLog {
    fn of(&self, id: &str) -> Vec<Outcome> {
        self.settled
            .lock()
            .iter()
            .filter(|(i, _)| i == id)
            .map(|(_, o)| *o)
            .collect()
    }
}

impl SettleObserver for SettleLog {
    fn settled(&self, id: &str, outcome: Outcome) {
        self.settled.lock().push((id.to_owned(), outcome));
    }
}

/// A node on its own broker, with a call log and a settlement log.
struct Harness {
    node: Node,
    broker: MemoryBroker,
    stats: Arc<Stats>,
    calls: Arc<CallLog>,
    settled: Arc<SettleLog>,
}

impl Harness {
    async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    /// Start a node; `prepare` runs on the broker first (fault injection).
    async fn start_with(prepare: impl FnOnce(&MemoryBroker)) -> Self {
        let broker = MemoryBroker::new();
        prepare(&broker);
        let calls = Arc::new(CallLog::default());
        let settled = Arc::new(SettleLog::default());
        let opts = NodeOptions {
            workers: 2,
            runtime: common::cached(RuntimeOptions {
                max_memory: 64 << 20,
                pool_instances: 16,
                ..RuntimeOptions::default()
            }),
            call_observer: Some(calls.clone()),
            settle_observer: Some(settled.clone()),
            ..NodeOptions::default()
        };
        let transport: Arc<dyn Transport> = Arc::new(broker.clone());
        let node = Node::start(&test_config(), transport, opts).await.expect("node starts");
        let stats = node.stats();
        Self {
            node,
            broker,
            stats,
            calls,
            settled,
        }
    }

    fn snap(&self) -> Snapshot {
        self.stats.snapshot()
    }

    fn dead_letters(&self) -> Vec<Wire> {
        self.broker.dead_letters(TOPO)
    }

    async fn publish(&self, env: &Envelope) {
        self.node.publish(TOPO, env).await.expect("publish is confirmed");
    }

    /// Poll every 10 ms until `cond` holds; fail with the state after [`PATIENCE`].
    async fn wait(&self, what: &str, cond: impl Fn(&Self) -> bool) {
        let deadline = Instant::now() + PATIENCE;
        while !cond(self) {
            if Instant::now() > deadline {
                let reasons: Vec<_> = self
                    .dead_letters()
                    .iter()
                    .map(|w| w.header(header::DEAD_LETTER_REASON).map(str::to_owned))
                    .collect();
                panic!(
                    "waited {PATIENCE:?} for {what}; stats {:?}; dead letters {reasons:?}; depth {}",
                    self.snap(),
                    self.broker.total_depth(TOPO)
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Wait until the broker holds nothing for `TOPO` (every delivery settled).
    async fn wait_drained(&self) {
        self.wait("the topology's queues to be empty", |h| h.broker.total_depth(TOPO) == 0)
            .await;
    }

    async fn shutdown(self) {
        self.node.shutdown().await.expect("node shuts down cleanly");
    }
}

fn faulty_digest() -> String {
    hex::encode(sha2::Sha256::digest(common::faulty_bytes()))
}

fn slot_of_group(group: &str) -> u32 {
    partition::slot_for(Some(group), "", SLOTS)
}

/// `n` group ids that share a slot with `group`, and `n` that do not.
fn neighbours(group: &str, n: usize) -> (Vec<String>, Vec<String>) {
    let slot = slot_of_group(group);
    let (mut same, mut other) = (Vec::new(), Vec::new());
    for i in 0.. {
        let g = format!("g-{i}");
        if slot_of_group(&g) == slot {
            if same.len() < n {
                same.push(g);
            }
        } else if other.len() < n {
            other.push(g);
        }
        if same.len() == n && other.len() == n {
            break;
        }
    }
    (same, other)
}

/// Checks the provenance of a dead letter of `original`, delivered `attempt` times.
fn assert_provenance(dl: &Wire, original: &Envelope, reason: Reason, attempt: u32, with_handler: bool) {
    let h = |name: &str| {
        dl.header(name)
            .unwrap_or_else(|| panic!("dead letter lacks `{name}`: {:?}", dl.headers))
    };
    assert_eq!(h(header::DEAD_LETTER_REASON), reason.as_str());
    assert!(!h(header::ERROR).is_empty(), "weir-error is empty");
    let slot = partition::slot_for(original.group(), &original.id, SLOTS);
    assert_eq!(h(header::SOURCE), format!("weir.{TOPO}.{slot}"));
    let failed_at = h(header::FAILED_AT);
    assert!(
        failed_at.len() >= 20 && failed_at.as_bytes()[4] == b'-' && failed_at.contains('T') && failed_at.ends_with('Z'),
        "weir-failed-at is not RFC 3339 UTC: {failed_at:?}"
    );
    if with_handler {
        assert_eq!(h(header::HANDLER), HANDLER);
        let version = h(header::HANDLER_VERSION);
        assert!(
            version.len() == 64 && version.bytes().all(|b| b.is_ascii_hexdigit()),
            "weir-handler-version {version:?}"
        );
        assert_eq!(
            version,
            faulty_digest(),
            "weir-handler-version is the component's sha256"
        );
    } else {
        assert_eq!(dl.header(header::HANDLER), None, "no handler was involved");
        assert_eq!(dl.header(header::HANDLER_VERSION), None, "no handler was involved");
    }
    assert_eq!(h(header::MESSAGE_ID), original.id);
    assert_eq!(h(header::MESSAGE_TYPE), original.message_type);
    assert_eq!(dl.header(header::GROUP_ID), original.group_id.as_deref());
    assert_eq!(h(header::ATTEMPT), attempt.to_string());
    assert_eq!(dl.body, original.payload, "the dead letter keeps the original body");
}

/// The one dead letter of the harness (there must be exactly one).
fn only_dead_letter(h: &Harness) -> Wire {
    let mut dls = h.dead_letters();
    assert_eq!(dls.len(), 1, "exactly one dead letter: {dls:?}");
    dls.remove(0)
}

/// Publish one message of `kind` in group "bad" while a stream of `ok`
/// messages (groups in the same slot, in other slots, in "bad" itself, and
/// without a group) flows; then a last wave of `ok` after the dead letter.
/// Asserts everything common to the faults and returns the bad calls and its
/// dead letter for fault-specific checks.
async fn fault_scenario(kind: &str, reason: Reason, error_starts: &str) -> (Vec<Call>, Vec<Call>, Wire) {
    let h = Harness::start().await;
    let bad = message(kind, Some("bad"), format!("{kind} payload").as_bytes());
    h.publish(&bad).await;

    // A stream of ok messages, every 10 ms, until the bad message is dead-lettered.
    let (same, other) = neighbours("bad", 2);
    let mut groups: Vec<Option<String>> = same.into_iter().chain(other).map(Some).collect();
    groups.push(Some("bad".into()));
    groups.push(None);
    let stop = Arc::new(AtomicBool::new(false));
    let stream = {
        let (broker, stop, groups) = (h.broker.clone(), stop.clone(), groups.clone());
        tokio::spawn(async move {
            let mut ids = Vec::new();
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let env = message("ok", groups[i % groups.len()].as_deref(), b"fine");
                node::publish(&broker, TOPO, SLOTS, &env)
                    .await
                    .expect("ok message published");
                ids.push(env.id);
                i += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            ids
        })
    };
    h.wait("the faulting message to be dead-lettered", |h| {
        !h.dead_letters().is_empty()
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let mut ok_ids = stream.await.expect("the ok stream ran");
    assert!(
        !ok_ids.is_empty(),
        "the ok stream published something while the fault ran"
    );

    // After the fault: the node still serves every group.
    let fault_over = Instant::now();
    for i in 0..20 {
        let env = message("ok", groups[i % groups.len()].as_deref(), b"after");
        h.publish(&env).await;
        ok_ids.push(env.id);
    }
    let total = ok_ids.len() as u64;
    h.wait("every ok message to be handled", |h| h.snap().handled >= total)
        .await;
    h.wait_drained().await;

    let s = h.snap();
    assert_eq!(
        s.handled, total,
        "every ok message handled exactly once, nothing else: {s:?}"
    );
    for id in &ok_ids {
        assert_eq!(h.settled.of(id), vec![Outcome::Handled], "ok message {id}");
    }
    let after = h
        .calls
        .of_type("ok")
        .into_iter()
        .filter(|c| c.start > fault_over)
        .count();
    assert!(after >= 20, "ok messages ran after the fault: {after}");

    // The faulting message: every delivery faulted, retried on the ladder, then captured.
    let bad_calls = h.calls.of(&bad.id);
    let attempts: Vec<u32> = bad_calls.iter().map(|c| c.attempt).collect();
    assert_eq!(attempts, (1..=MAX_DELIVER).collect::<Vec<_>>(), "one call per delivery");
    for (n, pair) in bad_calls.windows(2).enumerate() {
        let gap = pair[1].start - pair[0].end.expect("call ended");
        assert!(
            gap >= LADDER[n],
            "delivery {} came {gap:?} after the previous, before rung {:?}",
            n + 2,
            LADDER[n]
        );
    }
    assert_eq!(s.retry_scheduled, u64::from(MAX_DELIVER - 1), "{s:?}");
    assert_eq!(s.faults, u64::from(MAX_DELIVER), "{s:?}");
    assert_eq!(s.dead_lettered(reason), 1, "{s:?}");
    assert_eq!(s.dead_lettered_total(), 1, "{s:?}");
    assert_eq!(
        (s.cascaded, s.requeued, s.stranded, s.uncertain, s.released),
        (0, 0, 0, 0, 0),
        "{s:?}"
    );
    let mut expected = vec![Outcome::RetryScheduled; (MAX_DELIVER - 1) as usize];
    expected.push(Outcome::DeadLettered(reason));
    assert_eq!(h.settled.of(&bad.id), expected);

    let dl = only_dead_letter(&h);
    assert_provenance(&dl, &bad, reason, MAX_DELIVER, true);
    let error = dl.header(header::ERROR).unwrap_or_default();
    assert!(
        error.starts_with(error_starts),
        "weir-error {error:?} should start with {error_starts:?}"
    );

    let ok_calls = h.calls.of_type("ok");
    h.shutdown().await;
    (bad_calls, ok_calls, dl)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trap_is_retried_then_dead_lettered_while_others_are_served() {
    let (calls, _, dl) = fault_scenario("trap", Reason::Trap, "handler trapped").await;
    // The guest's panic message travels into the dead letter's error text,
    // first (issue 18 item 7): where it panicked and why, then the trap, then
    // the guest's own frames, without Rust's RUST_BACKTRACE advice.
    let error = dl.header("weir-error").unwrap_or_default();
    let after = error.split_once(": ").map_or("", |(_, rest)| rest);
    assert!(
        after.starts_with("panicked at ") && after.contains("faulty/src/lib.rs:"),
        "{error}"
    );
    let (panic, rest) = after.split_once(" [").unwrap_or_default();
    assert!(panic.ends_with(": trap requested by test"), "{error}");
    assert!(rest.starts_with("wasm trap"), "{error}");
    assert!(
        !error.contains("RUST_BACKTRACE") && !error.contains("__rust"),
        "{error}"
    );
    assert!(
        error.contains("\nwasm backtrace: <weir_test_faulty::Faulty as weir_guest::Handler>::handle <- "),
        "{error}"
    );
    assert!(
        calls.iter().all(|c| c.duration() < TIMEOUT),
        "a trap ends the call at once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_loop_is_interrupted_at_its_timeout_and_dead_lettered_as_timeout() {
    let (calls, ok_calls, dl) = fault_scenario("loop", Reason::Timeout, "handler timed out").await;
    for c in &calls {
        let d = c.duration();
        assert!(
            d >= TIMEOUT,
            "attempt {} interrupted after {d:?}, before its timeout {TIMEOUT:?}",
            c.attempt
        );
        // Upper bound for a hang, not a timing: on two cores held by other
        // processes the epoch ticker can be late by a second or more.
        assert!(
            d < TIMEOUT + Duration::from_secs(10),
            "attempt {} interrupted only after {d:?} (timeout {TIMEOUT:?})",
            c.attempt
        );
    }
    // The other worker kept handling messages while the loop spun.
    let during = ok_calls
        .iter()
        .filter(|o| o.group.as_deref() != Some("bad"))
        .filter(|o| {
            calls
                .iter()
                .any(|b| o.start > b.start && o.start < b.end.expect("ended"))
        })
        .count();
    assert!(during > 0, "no ok message ran while the loop was spinning");
    assert!(
        dl.header(header::ERROR).is_some_and(|e| e.contains("300ms")),
        "the error names the timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_hog_hits_its_limit_and_is_dead_lettered_as_trap() {
    let (_, _, dl) = fault_scenario("hog", Reason::Trap, "handler exceeded its memory limit").await;
    let error = dl.header(header::ERROR).unwrap_or_default();
    assert!(
        error.contains(&MEMORY_LIMIT.to_string()),
        "the error names the limit: {error:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runaway_recursion_traps_and_is_dead_lettered_as_trap() {
    fault_scenario("recurse", Reason::Trap, "handler trapped").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_is_dead_lettered_at_once_without_retry() {
    let h = Harness::start().await;
    let msg = message("reject", Some("r"), b"poison");
    h.publish(&msg).await;
    h.wait("the rejection to be captured", |h| {
        h.snap().dead_lettered(Reason::Rejected) == 1
    })
    .await;
    h.wait_drained().await;
    let s = h.snap();
    assert_eq!(
        (s.retry_scheduled, s.faults, s.handled, s.dead_lettered_total()),
        (0, 0, 0, 1),
        "{s:?}"
    );
    assert_eq!(h.calls.of(&msg.id).len(), 1, "one delivery");
    assert_eq!(h.settled.of(&msg.id), vec![Outcome::DeadLettered(Reason::Rejected)]);
    let dl = only_dead_letter(&h);
    assert_provenance(&dl, &msg, Reason::Rejected, 1, true);
    assert_eq!(
        dl.header(header::ERROR),
        Some("rejected by test"),
        "the guest's reason is kept"
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_exhausts_after_exactly_max_deliver_deliveries() {
    let h = Harness::start().await;
    let msg = message("retry", Some("r"), b"again");
    h.publish(&msg).await;
    h.wait("the exhausted message to be captured", |h| {
        h.snap().dead_lettered(Reason::Exhausted) == 1
    })
    .await;
    h.wait_drained().await;
    let s = h.snap();
    let attempts: Vec<u32> = h.calls.of(&msg.id).iter().map(|c| c.attempt).collect();
    assert_eq!(
        attempts,
        (1..=MAX_DELIVER).collect::<Vec<_>>(),
        "exactly max_deliver deliveries"
    );
    assert_eq!(s.retry_scheduled, u64::from(MAX_DELIVER - 1), "{s:?}");
    assert_eq!(
        (s.faults, s.handled, s.dead_lettered_total()),
        (0, 0, 1),
        "a retry answer is not a fault: {s:?}"
    );
    let dl = only_dead_letter(&h);
    assert_provenance(&dl, &msg, Reason::Exhausted, MAX_DELIVER, true);
    assert_eq!(
        dl.header(header::ERROR),
        Some("retry by test"),
        "the last error is kept"
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_then_trap_drops_the_held_publish() {
    let h = Harness::start().await;
    let msg = message("publish-then-trap", Some("p"), b"cascade?");
    h.publish(&msg).await;
    h.wait("the trapping publisher to be captured", |h| {
        h.snap().dead_lettered(Reason::Trap) == 1
    })
    .await;
    h.wait_drained().await;
    let s = h.snap();
    assert_eq!(h.calls.of(&msg.id).len(), MAX_DELIVER as usize);
    assert_eq!(
        (s.cascaded, s.handled, s.faults),
        (0, 0, u64::from(MAX_DELIVER)),
        "{s:?}"
    );
    assert!(
        h.calls.of_type("ok").is_empty(),
        "a publish held by a trapping call never reaches the broker"
    );
    assert_provenance(&only_dead_letter(&h), &msg, Reason::Trap, MAX_DELIVER, true);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_cascades_one_message_that_is_handled() {
    let h = Harness::start().await;
    let msg = message("publish", Some("p"), b"cascade!");
    h.publish(&msg).await;
    h.wait("the parent and its cascade to be handled", |h| h.snap().handled == 2)
        .await;
    h.wait_drained().await;
    let s = h.snap();
    assert_eq!(
        (s.cascaded, s.handled, s.dead_lettered_total(), s.faults),
        (1, 2, 0, 0),
        "{s:?}"
    );
    let child = envelope::cascade_id(&msg, 0);
    let ok = h.calls.of_type("ok");
    assert_eq!(ok.len(), 1, "one cascaded call: {ok:?}");
    assert_eq!(ok[0].id, child, "the cascade has the deterministic id");
    assert_eq!(
        ok[0].group.as_deref(),
        Some("p"),
        "the cascade keeps the group the guest gave it"
    );
    assert_eq!(h.settled.of(&child), vec![Outcome::Handled]);
    assert!(h.dead_letters().is_empty());
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_type_is_dead_lettered_as_no_handler() {
    let h = Harness::start().await;
    let msg = message("nobody.listens", Some("u"), b"lost?");
    h.publish(&msg).await;
    h.wait("the unroutable message to be captured", |h| {
        h.snap().dead_lettered(Reason::NoHandler) == 1
    })
    .await;
    h.wait_drained().await;
    assert!(h.calls.all().is_empty(), "no guest was called");
    let dl = only_dead_letter(&h);
    assert_provenance(&dl, &msg, Reason::NoHandler, 1, false);
    assert!(
        dl.header(header::ERROR).is_some_and(|e| e.contains("nobody.listens")),
        "the error names the type"
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_wire_is_dead_lettered_with_its_original_body() {
    let h = Harness::start().await;
    let body = b"\x00\xff not a weir message".to_vec();
    let wire = Wire {
        headers: vec![
            (header::MESSAGE_ID.into(), "raw-1".into()),
            ("x-custom".into(), "kept".into()),
        ],
        body: body.clone(),
    };
    Transport::publish(&h.broker, TOPO, 1, wire)
        .await
        .expect("raw publish confirmed");
    h.wait("the undecodable message to be captured", |h| {
        h.snap().dead_lettered(Reason::Undecodable) == 1
    })
    .await;
    h.wait_drained().await;
    assert!(h.calls.all().is_empty(), "no guest was called");
    let dl = only_dead_letter(&h);
    let hd = |n: &str| dl.header(n).map(str::to_owned);
    assert_eq!(dl.body, body, "the dead letter keeps the original bytes");
    assert_eq!(hd(header::DEAD_LETTER_REASON).as_deref(), Some("undecodable"));
    assert!(
        hd(header::ERROR).is_some_and(|e| e.contains(header::MESSAGE_TYPE)),
        "the error names the missing header"
    );
    assert_eq!(hd(header::SOURCE), Some(format!("weir.{TOPO}.1")));
    assert!(hd(header::FAILED_AT).is_some_and(|t| !t.is_empty()));
    assert_eq!(
        hd(header::MESSAGE_ID).as_deref(),
        Some("raw-1"),
        "original headers are kept"
    );
    assert_eq!(hd("x-custom").as_deref(), Some("kept"), "original headers are kept");
    assert_eq!(hd(header::HANDLER), None);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_capture_requeues_and_the_next_try_captures() {
    let h = Harness::start_with(|b| b.faults().refuse_dead_letters.store(1, Ordering::Relaxed)).await;
    let msg = message("reject", Some("r"), b"poison");
    h.publish(&msg).await;
    h.wait("the second capture to succeed", |h| {
        h.snap().dead_lettered(Reason::Rejected) == 1
    })
    .await;
    h.wait_drained().await;
    let s = h.snap();
    assert_eq!(
        (s.requeued, s.stranded, s.uncertain, s.retry_scheduled),
        (1, 0, 0, 0),
        "{s:?}"
    );
    // Not acked after the refused capture: the broker delivered it again.
    assert_eq!(
        h.settled.of(&msg.id),
        vec![Outcome::Requeued, Outcome::DeadLettered(Reason::Rejected)]
    );
    assert_eq!(
        h.calls.of(&msg.id).len(),
        2,
        "delivered again after the refused capture"
    );
    assert_eq!(
        h.broker.faults().refuse_dead_letters.load(Ordering::Relaxed),
        0,
        "the injected refusal was used"
    );
    assert_provenance(&only_dead_letter(&h), &msg, Reason::Rejected, 1, true);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_ack_confirm_after_capture_is_counted_uncertain() {
    let h = Harness::start_with(|b| b.faults().lose_ack_confirms.store(1, Ordering::Relaxed)).await;
    let msg = message("reject", Some("r"), b"poison");
    h.publish(&msg).await;
    h.wait("the uncertain outcome", |h| h.snap().uncertain == 1).await;
    h.wait_drained().await;
    let s = h.snap();
    assert_eq!(
        (s.uncertain, s.dead_lettered_total(), s.requeued, s.stranded),
        (1, 0, 0, 0),
        "{s:?}"
    );
    assert_eq!(h.settled.of(&msg.id), vec![Outcome::Uncertain]);
    assert_eq!(
        h.broker.faults().lose_ack_confirms.load(Ordering::Relaxed),
        0,
        "the injected loss was used"
    );
    assert_provenance(&only_dead_letter(&h), &msg, Reason::Rejected, 1, true);
    h.shutdown().await;
}
