//! Issue 14 items 4 and 4b and issue 15 item 4 in `postgres` mode, with
//! `weir run` processes, the real PostgreSQL and both brokers, made
//! deterministic with the fault proxy (`common/proxy.rs`):
//!
//! - `sigint_with_a_stalled_broker_reruns_nothing_*` (item 4): node-0's
//!   broker connection goes through a proxy the test freezes while node-0
//!   still handles what it holds, so the acks of those messages are on the
//!   way, not at the broker, when node-0 gets SIGINT. A node that exits
//!   there loses them (its network goes with it: the proxy is cut), and the
//!   next node runs those messages again. The drain must wait for the
//!   broker to confirm its acks (bounded); the test lifts the freeze once
//!   node-0 says it waits, and then nothing node-0 settled `handled` before
//!   it exited may be called again. Red baseline:
//!   `WEIR_NEGATIVE_CONTROL_UNCONFIRMED_ACKS=1` (acks only written, or
//!   flushed).
//! - `a_fence_releases_in_order_and_spends_no_attempt_on_nats` (item 4b):
//!   node-0's database freezes while it runs long calls with messages queued
//!   behind them; it fences. node-1's first call in each group must be the
//!   group's head, every call on attempt 1, nothing counted in
//!   `WEIR_T_ATTEMPTS`, nothing dead-lettered; then node-1 must exit within
//!   20 s of SIGTERM. Red baseline: `WEIR_NEGATIVE_CONTROL_CANCEL_FAILS=1`.
//! - `a_sleeping_call_cut_off_from_its_database_never_overlaps_on_nats`
//!   (issue 15 item 4, `postgres` mode): node-a's database freezes while its
//!   guest sleeps in WASI; node-b takes the slot. node-b's first call of the
//!   group must start after node-a's call ended. Red baseline:
//!   `WEIR_NEGATIVE_CONTROL_BLOCKING_IGNORES_CANCEL=1`.
//!
//! The fence tests measure calls with the soak guest's interval cascade
//! (`soak.call` reports each successful call's wall-clock interval, node and
//! attempt as a `soak.interval` message, read here off the stream), not with
//! Weir's journal. The SIGINT test needs calls that touch nothing but the
//! acks while the broker is frozen, so it reads the journals.
//!
//! Run against this worktree's own build with `WEIR_TEST_BIN` (see
//! `common::cluster::weir_bin`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../host/tests/common/mod.rs"]
mod common;
#[path = "../host/tests/common/proxy.rs"]
mod proxy;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt as _;
use weir::envelope::{Envelope, header};
use weir::observe::journal;
use weir::partition;
use weir::transport::Transport;
use weir::transport::nats::{Nats, names};
use weir::transport::rabbitmq::RabbitMq;

use common::cluster::{self, Cluster};
use common::pg::TestDb;
use proxy::FaultProxy;

const SLOTS: u32 = 6;
const LEASE: Duration = Duration::from_secs(2);

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// The broker a test runs on; its objects are deleted on drop.
enum Broker {
    Rabbit(common::rabbit::Topo),
    Nats(common::nats::Topo),
}

impl Broker {
    fn name(&self) -> &str {
        match self {
            Self::Rabbit(t) => &t.name,
            Self::Nats(t) => &t.name,
        }
    }

    /// The real broker's address (what a proxy forwards to).
    fn addr(&self) -> std::net::SocketAddr {
        match self {
            Self::Rabbit(_) => "127.0.0.1:5672".parse().unwrap(),
            Self::Nats(_) => "127.0.0.1:4222".parse().unwrap(),
        }
    }

    /// The broker's URL, through the proxy on `port` when given.
    fn url(&self, port: Option<u16>) -> String {
        let (url, real) = match self {
            Self::Rabbit(_) => (common::rabbit::url(), "127.0.0.1:5672"),
            Self::Nats(t) => (t.url.clone(), "127.0.0.1:4222"),
        };
        match port {
            Some(p) => {
                assert!(
                    url.contains(real),
                    "the broker URL {url} names {real}, so it can be proxied"
                );
                url.replace(real, &format!("127.0.0.1:{p}"))
            }
            None => url,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::Rabbit(_) => "rabbitmq",
            Self::Nats(_) => "nats",
        }
    }

    /// A publisher of the test's own.
    fn transport(&self) -> Box<dyn Transport> {
        match self {
            Self::Rabbit(_) => Box::new(RabbitMq::new(common::rabbit::url(), "weir drain-and-fence publisher")),
            Self::Nats(t) => Box::new(Nats::new(t.url.clone(), "weir drain-and-fence publisher")),
        }
    }
}

fn publish_all(broker: &Broker, msgs: &[Envelope]) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let t = broker.transport();
        for m in msgs {
            let slot = partition::slot_for(m.group(), &m.id, SLOTS);
            common::publish_confirmed(t.as_ref(), broker.name(), slot, m).await;
        }
    });
}

/// `[cluster]` of a `postgres` node.
fn postgres(db_url: &str) -> String {
    format!(
        "mode = \"postgres\"\ndatabase_url = \"{db_url}\"\nlease = \"{}ms\"\n",
        LEASE.as_millis()
    )
}

/// JetStream redelivers after AckWait, the first rung: keep it short.
const NATS_RETRY: &str = "[topology.retry]\nladder = [\"1s\"]\nmax_deliver = 100\n";

/// A node of the faulty guest's `ok` and `slow` types.
fn slow_config(broker: &Broker, broker_url: &str, db_url: &str, node: &str) -> String {
    let text = cluster::node_config(
        node,
        broker.kind(),
        broker_url,
        16,
        &postgres(db_url),
        broker.name(),
        SLOTS,
    );
    match broker {
        Broker::Nats(_) => text + NATS_RETRY,
        Broker::Rabbit(_) => text,
    }
}

/// A NATS node of the soak guest (`soak.call`, `soak.interval`), calls up
/// to 60 s (only an interruption stops a long one early), with an admin
/// listener on `admin` when given.
fn soak_config(topo: &common::nats::Topo, db_url: &str, node: &str, admin: Option<u16>) -> String {
    let admin = admin
        .map(|p| format!("admin = \"127.0.0.1:{p}\"\n"))
        .unwrap_or_default();
    format!(
        r#"
[node]
name = "{node}"
{admin}[transport]
kind = "nats"
url = "{url}"
prefetch = 16
[cluster]
{cluster}
[[topology]]
name = "{topology}"
slots = {SLOTS}
max_concurrent_groups = 16
{NATS_RETRY}
[[handler]]
name = "soak"
component = "{component}"
topology = "{topology}"
message_types = ["soak.call", "soak.interval"]
limits = {{ timeout = "60s" }}
config = {{ node = "{node}" }}
"#,
        url = topo.url,
        cluster = postgres(db_url),
        topology = topo.name,
        component = weir::node::bundled::FAULTY_PATH,
    )
}

/// Wait until `probe` holds, up to `timeout` (then panic with `what()`).
fn wait_for(timeout: Duration, probe: impl FnMut() -> bool, what: impl Fn() -> String) {
    poll(timeout, Duration::from_millis(10), probe, what);
}

/// [`wait_for`] for a costly probe (it reads a whole stream): every 200 ms.
fn wait_slowly(timeout: Duration, probe: impl FnMut() -> bool, what: impl Fn() -> String) {
    poll(timeout, Duration::from_millis(200), probe, what);
}

fn poll(timeout: Duration, every: Duration, mut probe: impl FnMut() -> bool, what: impl Fn() -> String) {
    let start = Instant::now();
    while !probe() {
        assert!(start.elapsed() < timeout, "timed out after {timeout:?}: {}", what());
        std::thread::sleep(every);
    }
}

/// Slot owners by node name, from the database (assigned slots only).
fn owners(db: &TestDb) -> HashMap<u32, String> {
    db.slot_owners()
}

/// Wait until every slot is assigned, only to `nodes`, balanced within one.
fn wait_balanced(db: &TestDb, nodes: &[&str], timeout: Duration) -> HashMap<u32, String> {
    let start = Instant::now();
    loop {
        let o = owners(db);
        if common::pg::balanced(&o, nodes, SLOTS) {
            return o;
        }
        assert!(
            start.elapsed() < timeout,
            "not balanced over {nodes:?} in {timeout:?}: {o:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A group whose slot is `slot`, not among `taken`.
fn group_on(slot: u32, taken: &[String]) -> String {
    (0..)
        .map(|i| format!("h{i}"))
        .find(|g| partition::slot_for(Some(g), "", SLOTS) == slot && !taken.contains(g))
        .unwrap()
}

/// Guest calls running now on the node whose admin listener is on `port`.
fn in_flight(port: u16) -> i64 {
    let (status, body) = common::http::call("GET", port, "/metrics", None, b"");
    assert_eq!(status, 200, "{body}");
    body.as_str()
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("handler_calls_in_flight{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<i64>().ok())
        .sum()
}

fn now_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

fn soak_call(group: &str, payload: &str) -> Envelope {
    common::message("soak.call", Some(group), payload.as_bytes())
}

/// One successful call, as the soak guest reported it (`soak.interval`).
#[derive(Debug, Clone)]
struct Interval {
    id: String,
    group: String,
    node: String,
    attempt: u32,
    /// Wall clock, ns since the epoch.
    start: u128,
    end: u128,
}

fn parse_interval(body: &[u8]) -> Option<Interval> {
    let text = std::str::from_utf8(body).ok()?;
    let f: Vec<&str> = text.split('\t').collect();
    let [id, group, _tenant, node, attempt, start, end] = f.as_slice() else {
        return None;
    };
    Some(Interval {
        id: (*id).to_owned(),
        group: (*group).to_owned(),
        node: (*node).to_owned(),
        attempt: attempt.parse().ok()?,
        start: start.parse().ok()?,
        end: end.parse().ok()?,
    })
}

/// Every interval reported so far: the `soak.interval` messages in the
/// topology's stream (kept after their ack: limits retention), in stream order.
fn intervals(topo: &common::nats::Topo) -> Vec<Interval> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let js = common::nats::js_at(&topo.url).await;
        let Ok(mut stream) = js.get_stream(names::stream(&topo.name)).await else {
            return Vec::new();
        };
        let state = stream.info().await.unwrap().state.clone();
        let mut out = Vec::new();
        for seq in state.first_sequence.max(1)..=state.last_sequence {
            let Ok(m) = stream.get_raw_message(seq).await else {
                continue;
            };
            if m.headers.get(header::MESSAGE_TYPE).map(|v| v.as_str()) == Some("soak.interval") {
                out.extend(parse_interval(&m.payload));
            }
        }
        out
    })
}

/// Keys in the topology's failure-count bucket, and the dead letters' count.
fn attempts_and_dead_letters(topo: &common::nats::Topo) -> (Vec<String>, u64) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let js = common::nats::js_at(&topo.url).await;
        let keys = match js.get_key_value(names::attempts_bucket(&topo.name)).await {
            Ok(kv) => match kv.keys().await {
                Ok(keys) => keys.filter_map(|k| async move { k.ok() }).collect().await,
                Err(_) => Vec::new(),
            },
            Err(_) => Vec::new(),
        };
        let dead = match js.get_stream(names::dead_letter_stream(&topo.name)).await {
            Ok(mut s) => s.info().await.unwrap().state.messages,
            Err(_) => 0,
        };
        (keys, dead)
    })
}

fn logs(cluster: &Cluster) -> String {
    cluster
        .nodes
        .iter()
        .map(|n| format!("--- {}:\n{}", n.name, n.log()))
        .collect::<Vec<_>>()
        .join("\n")
}

// ---------------------------------------------------------------- item 4

/// What a SIGINT with a stalled broker came to.
struct SigintVerdict {
    /// node-0 was still waiting for the broker's confirmation when the stall ended.
    waited: bool,
    /// Messages node-0 settled `handled` before it exited.
    before: usize,
    /// Those of them called again after it exited (first few).
    again: Vec<journal::Call>,
    again_count: usize,
}

/// See the module docs; `env` for every node (negative controls).
fn sigint_with_a_stalled_broker(broker: &Broker, env: &[(&str, &str)]) -> SigintVerdict {
    let db = TestDb::new();
    let stall = FaultProxy::start(broker.addr());
    let mut cluster = Cluster::default();
    let via = broker.url(Some(stall.port()));
    cluster.start_with_env("node-0", &slow_config(broker, &via, &db.url(), "node-0"), env);
    wait_balanced(&db, &["node-0"], secs(30));
    // Calls of 20 ms: node-0 holds a full prefetch window of every slot.
    let msgs: Vec<Envelope> = (0..1500)
        .map(|i| common::message("slow", Some(&format!("g{}", i % 48)), b"20"))
        .collect();
    publish_all(broker, &msgs);
    let handled_by_0 = |cluster: &Cluster| -> HashSet<String> {
        cluster
            .report()
            .settled
            .iter()
            .filter(|(_, (n, o))| n == "node-0" && o == "handled")
            .map(|(id, _)| id.clone())
            .collect()
    };
    wait_for(secs(60), || handled_by_0(&cluster).len() >= 100, || logs(&cluster));

    // Stall node-0's broker connection; node-0 goes on with what it holds.
    let frozen_at = journal::monotonic_ns();
    stall.freeze();
    let settled_while_frozen = |cluster: &Cluster| -> usize {
        let r = cluster.report();
        let handled = handled_by_0(cluster);
        r.calls
            .iter()
            .filter(|c| c.start > frozen_at && handled.contains(&c.id))
            .count()
    };
    wait_for(secs(30), || settled_while_frozen(&cluster) >= 20, || logs(&cluster));

    cluster.nodes[0].send_signal(libc::SIGINT);
    // Either node-0 waits for the broker to confirm its acks, or it exits.
    let start = Instant::now();
    while cluster.nodes[0].alive() && !cluster.nodes[0].log().contains(weir::transport::ACK_CONFIRM_WAITING) {
        assert!(
            start.elapsed() < secs(60),
            "node-0 neither exited nor waited: {}",
            logs(&cluster)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let waited = cluster.nodes[0].alive();
    if waited {
        // The stall ends; node-0 hears the confirmation and exits.
        stall.forward();
        let status = cluster.nodes[0].wait(secs(30));
        assert!(
            status.success(),
            "node-0 exited with {status}; log:\n{}",
            cluster.nodes[0].log()
        );
    } else {
        // node-0 exited with its acks on the way: its network goes with it.
        stall.cut();
    }
    let exited = journal::monotonic_ns();
    let before = handled_by_0(&cluster);
    let frozen_handled = settled_while_frozen(&cluster);
    eprintln!(
        "node-0 settled {} messages handled before it exited ({frozen_handled} of them while its broker was frozen); it {}",
        before.len(),
        if waited {
            "waited for the broker's confirmation"
        } else {
            "exited without the broker's confirmation"
        }
    );

    cluster.start_with_env(
        "node-0b",
        &slow_config(broker, &broker.url(None), &db.url(), "node-0b"),
        env,
    );
    let report = cluster.wait_handled(&cluster::ids(&msgs), secs(180));
    let again: Vec<journal::Call> = report
        .calls
        .iter()
        .filter(|c| c.start > exited && before.contains(&c.id))
        .cloned()
        .collect();
    assert!(report.overlaps.is_empty(), "{}", cluster::describe(&report));
    cluster.nodes[1].terminate(secs(30));
    SigintVerdict {
        waited,
        before: before.len(),
        again_count: again.len(),
        again: again.into_iter().take(3).collect(),
    }
}

fn assert_reruns_nothing(v: &SigintVerdict) {
    assert!(
        v.again_count == 0,
        "{} of the {} messages node-0 settled handled before it exited were called again after it \
         (node-0 {} the broker's confirmation), first {:?}",
        v.again_count,
        v.before,
        if v.waited { "waited for" } else { "exited without" },
        v.again
    );
    assert!(v.waited, "node-0 exited without waiting for the broker's confirmation");
}

/// The negative control must be caught: acks only written (or flushed) are
/// lost with the node's network, and the next node runs those messages again.
fn assert_reruns_caught(v: &SigintVerdict) {
    assert!(!v.waited, "with unconfirmed acks node-0 must not wait for the broker");
    assert!(
        v.again_count > 0,
        "the test cannot see lost acks: none of the {} messages node-0 handled ran again",
        v.before
    );
}

const UNCONFIRMED: (&str, &str) = (weir::transport::NEGATIVE_CONTROL_UNCONFIRMED_ACKS, "1");

#[test]
fn sigint_with_a_stalled_broker_reruns_nothing_on_nats() {
    assert_reruns_nothing(&sigint_with_a_stalled_broker(
        &Broker::Nats(common::nats::Topo::new()),
        &[],
    ));
}

#[test]
fn sigint_with_a_stalled_broker_reruns_nothing_on_rabbitmq() {
    assert_reruns_nothing(&sigint_with_a_stalled_broker(
        &Broker::Rabbit(common::rabbit::Topo::new(SLOTS, &[])),
        &[],
    ));
}

#[test]
fn unconfirmed_acks_rerun_on_nats() {
    assert_reruns_caught(&sigint_with_a_stalled_broker(
        &Broker::Nats(common::nats::Topo::new()),
        &[UNCONFIRMED],
    ));
}

#[test]
fn unconfirmed_acks_rerun_on_rabbitmq() {
    assert_reruns_caught(&sigint_with_a_stalled_broker(
        &Broker::Rabbit(common::rabbit::Topo::new(SLOTS, &[])),
        &[UNCONFIRMED],
    ));
}

// --------------------------------------------------------------- item 4b

/// What a fence and a takeover came to: the violations of item 4b found,
/// and how long the survivor took to exit after SIGTERM.
struct FenceVerdict {
    violations: Vec<String>,
    exit: Duration,
}

/// See the module docs; `env` for every node (negative controls).
fn fence_and_takeover(env: &[(&str, &str)]) -> FenceVerdict {
    let topo = common::nats::Topo::new();
    let db = TestDb::new();
    let pg = FaultProxy::start("127.0.0.1:5432".parse().unwrap());
    let via = format!("postgres://postgres@127.0.0.1:{}/{}", pg.port(), db.name);
    let mut cluster = Cluster::default();
    let admin = common::http::free_port();
    cluster.start_with_env("node-0", &soak_config(&topo, &via, "node-0", Some(admin)), env);
    wait_balanced(&db, &["node-0"], secs(30));
    cluster.start_with_env("node-1", &soak_config(&topo, &db.url(), "node-1", None), env);
    let owners = wait_balanced(&db, &["node-0", "node-1"], secs(30));
    // One group on each of two of node-0's slots (two workers: both heads run).
    let mut groups = Vec::new();
    for s in (0..SLOTS).filter(|s| owners[s] == "node-0").take(2) {
        let g = group_on(s, &groups);
        groups.push(g);
    }
    // Each group: a 4 s head (busy: interruptible), then 7 short calls queued behind it.
    let mut order: HashMap<String, Vec<String>> = HashMap::new();
    let mut msgs = Vec::new();
    for round in 0..8 {
        for g in &groups {
            let m = soak_call(g, if round == 0 { "4000" } else { "20" });
            order.entry(g.clone()).or_default().push(m.id.clone());
            msgs.push(m);
        }
    }
    {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let t = Nats::new(topo.url.clone(), "weir fence publisher");
            for m in &msgs {
                let slot = partition::slot_for(m.group(), &m.id, SLOTS);
                common::publish_confirmed(&t, &topo.name, slot, m).await;
            }
        });
    }
    wait_for(secs(30), || in_flight(admin) >= 2, || logs(&cluster));

    pg.freeze();
    wait_for(
        LEASE * 3,
        || cluster.nodes[0].log().contains("fenced: consuming nothing"),
        || logs(&cluster),
    );
    wait_balanced(&db, &["node-1"], LEASE * 5);
    let want: HashSet<&String> = msgs.iter().map(|m| &m.id).collect();
    wait_slowly(
        secs(60),
        || {
            let seen: HashSet<String> = intervals(&topo).into_iter().map(|i| i.id).collect();
            want.iter().all(|id| seen.contains(*id))
        },
        || logs(&cluster),
    );

    // The survivor leaves within 20 s of SIGTERM (the wait is longer, to measure).
    let term = Instant::now();
    cluster.nodes[1].terminate(secs(60));
    let exit = term.elapsed();
    eprintln!("node-1 (the survivor) exited {exit:?} after SIGTERM");
    pg.forward();
    cluster.nodes[0].terminate(secs(30));

    let ivs = intervals(&topo);
    let (attempts, dead) = attempts_and_dead_letters(&topo);
    let mut violations = Vec::new();
    for g in &groups {
        let mut on_1: Vec<&Interval> = ivs.iter().filter(|i| &i.group == g && i.node == "node-1").collect();
        on_1.sort_by_key(|i| i.start);
        let ran: Vec<(&str, u32)> = on_1.iter().map(|i| (i.id.as_str(), i.attempt)).collect();
        let head = &order[g][0];
        if ran.first().copied() != Some((head.as_str(), 1)) {
            violations.push(format!(
                "group {g}: node-1's first call is not the interrupted head on attempt 1; node-1 ran \
                 (position in the group, attempt) {:?}",
                ran.iter()
                    .map(|(id, a)| (order[g].iter().position(|x| x == id), *a))
                    .collect::<Vec<_>>()
            ));
        }
        let ids: Vec<&str> = ran.iter().map(|(id, _)| *id).collect();
        let published: Vec<&str> = order[g].iter().map(String::as_str).collect();
        if ids != published {
            violations.push(format!("group {g} did not run on node-1 in publish order, once each"));
        }
    }
    let late: Vec<(&str, u32)> = ivs
        .iter()
        .filter(|i| i.attempt != 1)
        .map(|i| (i.id.as_str(), i.attempt))
        .collect();
    if !late.is_empty() {
        violations.push(format!(
            "calls on a later attempt (a fence's releases are not attempts): {late:?}"
        ));
    }
    if !attempts.is_empty() {
        violations.push(format!(
            "failures counted in {}: {attempts:?}",
            names::attempts_bucket(&topo.name)
        ));
    }
    if dead != 0 {
        violations.push(format!("{dead} dead-lettered"));
    }
    FenceVerdict { violations, exit }
}

#[test]
fn a_fence_releases_in_order_and_spends_no_attempt_on_nats() {
    let v = fence_and_takeover(&[]);
    assert!(v.violations.is_empty(), "{}", v.violations.join("\n"));
    assert!(v.exit < secs(20), "node-1 took {:?} to exit after SIGTERM", v.exit);
}

/// The negative control must be caught: a fence whose cancelled calls count
/// as failures reorders the groups and spends attempts.
#[test]
fn a_fence_that_fails_its_calls_is_caught_on_nats() {
    let v = fence_and_takeover(&[(weir::settle::decide::NEGATIVE_CONTROL_CANCEL_FAILS, "1")]);
    assert!(
        !v.violations.is_empty(),
        "the test cannot see a fence that fails its interrupted and queued calls"
    );
    eprintln!("caught: {}", v.violations.join("; "));
}

// ------------------------------------------------------ issue 15 item 4

/// When node-a's sleeping call ended and when node-b's first call of its
/// group started (wall clock, ns), and the group's intervals.
fn sleeping_call_cut_off(env: &[(&str, &str)]) -> (u128, Interval, Vec<Interval>) {
    let topo = common::nats::Topo::new();
    let db = TestDb::new();
    let pg = FaultProxy::start("127.0.0.1:5432".parse().unwrap());
    let via = format!("postgres://postgres@127.0.0.1:{}/{}", pg.port(), db.name);
    let mut cluster = Cluster::default();
    let admin = common::http::free_port();
    cluster.start_with_env("node-a", &soak_config(&topo, &via, "node-a", Some(admin)), env);
    wait_balanced(&db, &["node-a"], secs(30));
    cluster.start_with_env("node-b", &soak_config(&topo, &db.url(), "node-b", None), env);
    let balanced = wait_balanced(&db, &["node-a", "node-b"], secs(30));
    let slot = (0..SLOTS).find(|s| balanced[s] == "node-a").unwrap();
    let g = group_on(slot, &[]);
    let t = Nats::new(topo.url.clone(), "weir sleeper publisher");
    let rt = tokio::runtime::Runtime::new().unwrap();
    // 8 s of WASI sleep under a 60 s timeout: only an interruption ends it early.
    let sleeper = soak_call(&g, "8000 sleep");
    rt.block_on(common::publish_confirmed(&t, &topo.name, slot, &sleeper));
    wait_for(secs(30), || in_flight(admin) >= 1, || logs(&cluster));

    pg.freeze();
    // node-a's call ends (interrupted by its fence, or when its sleep does);
    // node-b takes the slot, and more of the group arrives then.
    let next = soak_call(&g, "50");
    let mut a_ended = None;
    let mut b_owns = false;
    let start = Instant::now();
    while a_ended.is_none() || !b_owns {
        if a_ended.is_none() && in_flight(admin) == 0 {
            a_ended = Some(now_ns());
        }
        if !b_owns && owners(&db).get(&slot).is_some_and(|o| o == "node-b") {
            b_owns = true;
            rt.block_on(common::publish_confirmed(&t, &topo.name, slot, &next));
        }
        assert!(
            start.elapsed() < secs(30),
            "a_ended {a_ended:?}, b owns {b_owns}; {}",
            logs(&cluster)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let a_ended = a_ended.unwrap();
    // Both messages of the group have run to the end somewhere.
    wait_slowly(
        secs(60),
        || {
            let seen: HashSet<String> = intervals(&topo).into_iter().map(|i| i.id).collect();
            seen.contains(&sleeper.id) && seen.contains(&next.id)
        },
        || format!("{:?}\n{}", intervals(&topo), logs(&cluster)),
    );
    let ivs: Vec<Interval> = intervals(&topo).into_iter().filter(|i| i.group == g).collect();
    for n in &mut cluster.nodes {
        if n.alive() {
            n.kill();
        }
    }
    drop(pg);
    // node-a's end: its own report if its call ran to the end, else when
    // its in-flight gauge fell to 0 (later than the end itself).
    let a_end = ivs
        .iter()
        .filter(|i| i.node == "node-a")
        .map(|i| i.end)
        .max()
        .map_or(a_ended, |e| e.max(a_ended));
    let b_first = ivs
        .iter()
        .filter(|i| i.node == "node-b")
        .min_by_key(|i| i.start)
        .cloned()
        .unwrap();
    let origin = ivs.iter().map(|i| i.start).min().unwrap_or(a_end).min(a_end);
    let ms = |d: u128| d as f64 / 1e6;
    eprintln!(
        "node-a's call ended by +{:.0} ms; node-b's first call of {g} started at +{:.0} ms (from the first reported start)",
        ms(a_end - origin),
        ms(b_first.start - origin)
    );
    (a_end, b_first, ivs)
}

#[test]
fn a_sleeping_call_cut_off_from_its_database_never_overlaps_on_nats() {
    let (a_end, b_first, ivs) = sleeping_call_cut_off(&[]);
    assert!(
        b_first.start > a_end,
        "node-b's first call of the group ({} on attempt {}) started {:.0} ms before node-a's sleeping call ended: {ivs:#?}",
        b_first.id,
        b_first.attempt,
        (a_end - b_first.start) as f64 / 1e6
    );
}

/// The negative control must be caught: a sleep that ignores the fence's
/// cancellation runs on beside node-b's calls.
#[test]
fn a_sleep_that_ignores_the_fence_is_caught_on_nats() {
    let (a_end, b_first, _) = sleeping_call_cut_off(&[("WEIR_NEGATIVE_CONTROL_BLOCKING_IGNORES_CANCEL", "1")]);
    assert!(
        b_first.start < a_end,
        "the test cannot see a sleeping call that outlives its node's fence"
    );
}

// ------------------------------------- a node stalled inside its leader pass

/// The leader's name, by the database (a live leader lease only).
fn leader(db: &TestDb) -> Option<String> {
    db.query("SELECT n.name FROM weir_leader l JOIN weir_nodes n ON n.node_id = l.node_id WHERE l.lease_until > now()")
        .into_iter()
        .next()
        .and_then(|r| r[0].clone())
}

/// node-0, the leader, stalls inside its leader pass: its database
/// connection freezes (the fault proxy's `freeze_after`) three statements
/// after its `BEGIN`, with the leader row and whatever else it locked held by
/// its session. node-1 must still take every slot over within five leases,
/// and then leave within 20 s of SIGTERM. `Err`: no takeover.
fn stalled_inside_the_leader_pass(env: &[(&str, &str)]) -> Result<Duration, String> {
    let topo = common::nats::Topo::new();
    let db = TestDb::new();
    let pg = FaultProxy::start("127.0.0.1:5432".parse().unwrap());
    let via = format!("postgres://postgres@127.0.0.1:{}/{}", pg.port(), db.name);
    let mut cluster = Cluster::default();
    cluster.start_with_env("node-0", &soak_config(&topo, &via, "node-0", None), env);
    wait_balanced(&db, &["node-0"], secs(30));
    cluster.start_with_env("node-1", &soak_config(&topo, &db.url(), "node-1", None), env);
    wait_balanced(&db, &["node-0", "node-1"], secs(30));
    assert_eq!(leader(&db).as_deref(), Some("node-0"), "the first node leads");

    pg.freeze_after(b"BEGIN", 3);
    wait_for(
        secs(10),
        || !pg.armed(),
        || format!("node-0 began no transaction\n{}", logs(&cluster)),
    );
    let frozen = Instant::now();
    wait_for(
        LEASE * 3,
        || cluster.nodes[0].log().contains("fenced: consuming nothing"),
        || logs(&cluster),
    );
    let takeover = Instant::now();
    let mut took_over = false;
    while takeover.elapsed() < LEASE * 5 {
        let o = owners(&db);
        if o.len() == SLOTS as usize && o.values().all(|n| n == "node-1") {
            took_over = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let result = if took_over {
        eprintln!("node-1 owned every slot {:?} after node-0 froze", frozen.elapsed());
        let term = Instant::now();
        cluster.nodes[1].terminate(secs(60));
        let exit = term.elapsed();
        eprintln!("node-1 (the survivor) exited {exit:?} after SIGTERM");
        Ok(exit)
    } else {
        Err(format!(
            "no takeover {:?} after node-0 froze inside its leader pass: owners {:?}, leader {:?}; node-1's log:\n{}",
            frozen.elapsed(),
            owners(&db),
            leader(&db),
            cluster.nodes[1].log()
        ))
    };
    pg.forward();
    for n in &mut cluster.nodes {
        if n.alive() {
            n.terminate(secs(30));
        }
    }
    result
}

#[test]
fn a_node_stalled_inside_its_leader_pass_blocks_nobody_on_nats() {
    let exit = stalled_inside_the_leader_pass(&[]).unwrap_or_else(|e| panic!("{e}"));
    assert!(exit < secs(20), "node-1 took {exit:?} to exit after SIGTERM");
}

/// The negative control must be caught: without the transaction timeout
/// the stalled session keeps the leader row locked, and nobody takes over.
#[test]
fn a_stalled_leader_without_a_transaction_timeout_is_caught_on_nats() {
    let r = stalled_inside_the_leader_pass(&[(weir::cluster::postgres::NEGATIVE_CONTROL_NO_TX_TIMEOUT, "1")]);
    assert!(
        r.is_err(),
        "the test cannot see a stalled leader's locks: node-1 took over"
    );
}
