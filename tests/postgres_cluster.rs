//! `cluster.mode = "postgres"` with separate `weir run` processes, the real
//! PostgreSQL (a database per test) and RabbitMQ (a topology per test). Every
//! node writes a journal (`weir::observe::journal`); the journals are checked
//! together for intra-group overlap and completeness. The failover and
//! handoff tests run on NATS JetStream too (`*_nats`), and the scale,
//! failover and handoff tests (with its red baseline) also with
//! `cluster.mode = "nats-kv"` (`*_nats_kv`: a KV bucket per test, no
//! database), through the same helpers ([`Registry`] reads either).
//!
//! - `scale_out_and_in_under_load`: 1 → 3 → 2 nodes while messages flow;
//!   balanced at each step; nothing lost, no overlap.
//! - `failover_after_kill_9_of_a_follower_then_of_the_leader`: the slots of
//!   a killed node land on exactly one survivor each; then the same for
//!   the leader. Prints the failover time (kill → first call of the new owner).
//! - `live_handoff_waits_for_running_calls` and its red baseline
//!   `handoff_without_drain_overlaps`: a slot moves while calls of 4 s run
//!   on it, and more messages of the same groups follow. The slot queues are declared without single active consumer in
//!   both, so only the drain keeps the groups apart.
//! - `losing_the_database_fences_before_the_lease_expires`: the node's
//!   database connection goes through a proxy the test cuts; the node stops
//!   every call before its lease can expire, and rejoins when it is back.
//! - Issue 14: `a_draining_node_keeps_its_lease_on_nats` (a stopping node
//!   renews while it drains), `the_drain_deadline_interrupts_and_releases`,
//!   `churn_every_slot_has_a_live_owner_after_each_change` (24 changes),
//!   `a_frozen_database_fences_before_the_lease_expires` and its negative
//!   control (a [`proxy::FaultProxy`] holds the database's bytes; the fence
//!   is timed against the lease expiry by the database's clock),
//!   `after_a_fence_and_a_takeover_both_nodes_exit_on_nats`, and
//!   `sigint_drain_reruns_nothing_*`.
//!
//! Run against this worktree's own build with `WEIR_TEST_BIN` (see
//! `common::cluster::weir_bin`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../host/tests/common/mod.rs"]
mod common;
#[path = "../host/tests/common/proxy.rs"]
mod proxy;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::cluster::{self, Cluster};
use common::nats::Topo as NatsTopo;
use common::pg::{Proxy, TestDb};
use common::rabbit::{Topo, url};
use common::registry::{self, KvBucket, Registry};
use weir::envelope::Envelope;
use weir::observe::journal::{self, Report};
use weir::partition;
use weir::transport::Transport;
use weir::transport::nats::Nats;
use weir::transport::rabbitmq::{self, RabbitMq};

const SLOTS: u32 = 6;
const LEASE: Duration = Duration::from_secs(2);
const NO_SAC: (&str, &str) = (rabbitmq::NEGATIVE_CONTROL_NO_SAC, "1");

/// The broker a test runs on; its objects are deleted on drop.
enum Broker {
    Rabbit(Topo),
    Nats(NatsTopo),
}

impl Broker {
    fn rabbit() -> Self {
        Self::Rabbit(Topo::new(SLOTS, &[]))
    }

    fn nats() -> Self {
        Self::Nats(NatsTopo::new())
    }

    fn name(&self) -> &str {
        match self {
            Self::Rabbit(t) => &t.name,
            Self::Nats(t) => &t.name,
        }
    }

    /// A publisher of the test's own.
    fn transport(&self) -> Box<dyn Transport> {
        match self {
            Self::Rabbit(_) => Box::new(RabbitMq::new(url(), "weir postgres-test publisher")),
            Self::Nats(t) => Box::new(Nats::new(t.url.clone(), "weir postgres-test publisher")),
        }
    }
}

fn config(broker: &Broker, db_url: &str, node: &str) -> String {
    config_with(broker, db_url, node, "", None)
}

/// [`config`] with `extra` lines in `[cluster]` and an admin listener on
/// `admin` (for `/metrics`).
fn config_with(broker: &Broker, db_url: &str, node: &str, extra: &str, admin: Option<u16>) -> String {
    let lease = LEASE.as_millis();
    let postgres = format!("{}lease = \"{lease}ms\"\n{extra}", registry::cluster(db_url));
    let text = config_body(broker, node, &postgres);
    match admin {
        Some(port) => text.replacen("[node]\n", &format!("[node]\nadmin = \"127.0.0.1:{port}\"\n"), 1),
        None => text,
    }
}

fn config_body(broker: &Broker, node: &str, postgres: &str) -> String {
    let postgres = postgres.to_owned();
    match broker {
        Broker::Rabbit(t) => cluster::node_config(node, "rabbitmq", &url(), 16, &postgres, &t.name, SLOTS),
        // JetStream redelivers what a dead node held after AckWait, the
        // first rung: keep it short so the test does not wait 30 s.
        Broker::Nats(t) => {
            cluster::node_config(node, "nats", &t.url, 16, &postgres, &t.name, SLOTS)
                + "[topology.retry]\nladder = [\"1s\"]\nmax_deliver = 100\n"
        }
    }
}

fn slow(group: &str, ms: u32) -> Envelope {
    common::message("slow", Some(group), ms.to_string().as_bytes())
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

/// Publish `msgs` evenly over `over` on a thread.
fn stream(broker: &Broker, msgs: Vec<Envelope>, over: Duration) -> std::thread::JoinHandle<()> {
    let name = broker.name().to_owned();
    let t = broker.transport();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let gap = over / u32::try_from(msgs.len().max(1)).unwrap();
            for m in &msgs {
                let slot = partition::slot_for(m.group(), &m.id, SLOTS);
                common::publish_confirmed(t.as_ref(), &name, slot, m).await;
                tokio::time::sleep(gap).await;
            }
        });
    })
}

/// Slot owners by node name, from the database or bucket (assigned slots only).
fn owners(db: &dyn Registry) -> HashMap<u32, String> {
    db.slot_owners()
}

fn leader(db: &dyn Registry) -> Option<String> {
    db.leader()
}

/// Wait until every slot is assigned, only to `nodes`, balanced within one.
fn wait_balanced(db: &dyn Registry, cluster: &Cluster, nodes: &[&str], timeout: Duration) -> HashMap<u32, String> {
    let start = Instant::now();
    loop {
        let o = owners(db);
        if common::pg::balanced(&o, nodes, SLOTS) {
            return o;
        }
        if start.elapsed() > timeout {
            let logs: Vec<String> = cluster
                .nodes
                .iter()
                .map(|n| format!("--- {}:\n{}", n.name, n.log()))
                .collect();
            panic!(
                "not balanced over {nodes:?} after {timeout:?}: {o:?}\n{}",
                logs.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn ids(msgs: &[Envelope]) -> Vec<String> {
    msgs.iter().map(|m| m.id.clone()).collect()
}

fn handled_by(report: &Report, node: &str) -> usize {
    report
        .settled
        .values()
        .filter(|(n, o)| n == node && o == "handled")
        .count()
}

fn wait_handled_by(cluster: &Cluster, node: &str, n: usize) {
    let start = Instant::now();
    while handled_by(&cluster.report(), node) < n {
        assert!(start.elapsed() < Duration::from_secs(60), "{node} never handled {n}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Per slot, the gaps where consecutive calls ran on different nodes, sorted.
fn handoff_pauses(r: &Report) -> Vec<Duration> {
    let mut by_slot: HashMap<u32, Vec<&journal::Call>> = HashMap::new();
    for c in &r.calls {
        if let Some(g) = &c.group {
            by_slot
                .entry(partition::slot_for(Some(g), "", SLOTS))
                .or_default()
                .push(c);
        }
    }
    let mut pauses = Vec::new();
    for calls in by_slot.values_mut() {
        calls.sort_by_key(|c| c.start);
        for w in calls.windows(2) {
            if w[0].node != w[1].node {
                pauses.push(Duration::from_nanos(w[1].start.saturating_sub(w[0].end)));
            }
        }
    }
    pauses.sort();
    pauses
}

fn no_overlap(r: &Report) {
    assert!(
        r.overlaps.is_empty(),
        "{} overlaps, first: {:?}",
        r.overlaps.len(),
        r.overlaps.first()
    );
}

/// `weir status` (table and JSON) shows the nodes, the leader, every slot
/// with its owner and epoch, and the broker's lag per slot.
fn status_shows(topo: &Broker, db: &dyn Registry, owners: &HashMap<u32, String>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("status.toml");
    std::fs::write(&path, config(topo, &db.url(), "status")).unwrap();
    let run = |json: bool| {
        let mut cmd = std::process::Command::new(cluster::weir_bin());
        cmd.args(["status", "--config"]).arg(&path);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let table = run(false);
    for n in ["node-0", "node-1", "node-2", "leader"] {
        assert!(table.contains(n), "{table}");
    }
    let json: serde_json::Value = serde_json::from_str(&run(true)).unwrap();
    let slots = json["slots"].as_array().unwrap();
    assert_eq!(slots.len(), SLOTS as usize, "{json}");
    for s in slots {
        let slot = u32::try_from(s["slot"].as_u64().unwrap()).unwrap();
        if s["state"] == "assigned" {
            assert_eq!(s["owner"].as_str(), Some(owners[&slot].as_str()), "{json}");
        }
        assert!(s["epoch"].as_i64().unwrap() >= 1, "{json}");
        assert!(s["lag"].is_u64(), "lag read from the broker: {json}");
    }
    assert_eq!(
        json["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| n["leader"] == true)
            .count(),
        1
    );
}

#[test]
fn scale_out_and_in_under_load() {
    scale_out_and_in(&Broker::rabbit(), &TestDb::new());
}

/// The same on NATS with `cluster.mode = "nats-kv"`: no database.
#[test]
fn scale_out_and_in_under_load_on_nats_kv() {
    scale_out_and_in(&Broker::nats(), &KvBucket::new(LEASE));
}

fn scale_out_and_in(topo: &Broker, db: &dyn Registry) {
    let mut cluster = Cluster::default();
    let names = ["node-0", "node-1", "node-2"];
    cluster.start(names[0], &config(topo, &db.url(), names[0]));
    wait_balanced(db, &cluster, &names[..1], Duration::from_secs(20));

    let msgs: Vec<Envelope> = (0..1200).map(|i| slow(&format!("g{}", i % 40), 2)).collect();
    let publisher = stream(topo, msgs.clone(), Duration::from_secs(8));
    cluster.start(names[1], &config(topo, &db.url(), names[1]));
    wait_balanced(db, &cluster, &names[..2], Duration::from_secs(20));
    cluster.start(names[2], &config(topo, &db.url(), names[2]));
    let balanced = wait_balanced(db, &cluster, &names, Duration::from_secs(20));
    status_shows(topo, db, &balanced);
    cluster.nodes[1].terminate(Duration::from_secs(30));
    wait_balanced(db, &cluster, &[names[0], names[2]], Duration::from_secs(20));
    publisher.join().unwrap();

    let report = cluster.wait_handled(&ids(&msgs), Duration::from_secs(120));
    no_overlap(&report);
    for n in names {
        assert!(handled_by(&report, n) > 0, "{n} did no work");
    }
    let pauses = handoff_pauses(&report);
    assert!(!pauses.is_empty(), "slots moved between nodes");
    eprintln!(
        "live handoff pause (last call of the old owner → first call of the new one, per moved slot; messages arrive every ~40 ms per slot): median {:?}, max {:?}, {} moves",
        pauses[pauses.len() / 2],
        pauses[pauses.len() - 1],
        pauses.len()
    );
    for i in [0, 2] {
        cluster.nodes[i].terminate(Duration::from_secs(30));
    }
    // Leaving frees the slots: nothing is assigned to a stopped node.
    assert!(owners(db).is_empty(), "{:?}", owners(db));
}

#[test]
fn failover_after_kill_9_of_a_follower_then_of_the_leader() {
    failover(&Broker::rabbit());
}

#[test]
fn failover_on_nats() {
    failover(&Broker::nats());
}

/// `cluster.mode = "nats-kv"`: the lease runs out by the bucket's clock.
#[test]
fn failover_on_nats_kv() {
    failover_with(&Broker::nats(), &KvBucket::new(LEASE));
}

fn failover(topo: &Broker) {
    failover_with(topo, &TestDb::new());
}

fn failover_with(topo: &Broker, db: &dyn Registry) {
    let mut cluster = Cluster::default();
    let names = ["node-0", "node-1", "node-2"];
    for n in names {
        cluster.start(n, &config(topo, &db.url(), n));
    }
    let before = wait_balanced(db, &cluster, &names, Duration::from_secs(20));
    let lead = leader(db).expect("a leader");
    let follower = *names.iter().find(|n| **n != lead).unwrap();

    // Published faster than the cluster handles them (4 ms of CPU each on 2
    // cores), so a backlog of a thousand and more waits at each kill.
    let msgs: Vec<Envelope> = (0..3000).map(|i| slow(&format!("g{}", i % 60), 4)).collect();
    let publisher = stream(topo, msgs.clone(), Duration::from_secs(3));
    let mut failovers = Vec::new();
    let mut alive: Vec<&str> = names.to_vec();
    for victim in [follower, lead.as_str()] {
        wait_handled_by(&cluster, victim, 50);
        let owned: HashSet<u32> = owners(db)
            .into_iter()
            .filter(|(_, n)| n == victim)
            .map(|(s, _)| s)
            .collect();
        let i = names.iter().position(|n| *n == victim).unwrap();
        let killed_at = journal::monotonic_ns();
        cluster.nodes[i].kill();
        alive.retain(|n| *n != victim);
        let after = wait_balanced(db, &cluster, &alive, LEASE * 5);
        // Each of the victim's slots has exactly one owner, a survivor.
        for s in &owned {
            assert!(alive.contains(&after[s].as_str()), "slot {s} → {}", after[s]);
        }
        // Failover time: kill → first call of a new owner on one of the slots.
        let start = Instant::now();
        let first = loop {
            let r = cluster.report();
            let first = r
                .calls
                .iter()
                .filter(|c| c.start > killed_at && c.node != victim)
                .filter(|c| {
                    c.group
                        .as_deref()
                        .is_some_and(|g| owned.contains(&partition::slot_for(Some(g), "", SLOTS)))
                })
                .map(|c| c.start)
                .min();
            if let Some(f) = first {
                break f;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no survivor ran {victim}'s slots"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        failovers.push(Duration::from_nanos(first - killed_at));
    }
    publisher.join().unwrap();
    let report = cluster.wait_handled(&ids(&msgs), Duration::from_secs(120));
    no_overlap(&report);
    eprintln!(
        "failover (kill -9 → first call of the new owner), lease {LEASE:?}: follower {:?}, leader {:?}; owners before {before:?}",
        failovers[0], failovers[1]
    );
    for f in &failovers {
        assert!(*f <= LEASE * 3, "failover took {f:?}");
    }
    let last = names.iter().position(|n| alive.contains(n)).unwrap();
    cluster.nodes[last].terminate(Duration::from_secs(30));
}

/// Groups whose slot is among `slots`, one per slot.
fn groups_on(slots: &[u32]) -> Vec<String> {
    let mut out = Vec::new();
    for &want in slots {
        let g = (0..)
            .map(|i| format!("h{i}"))
            .find(|g| partition::slot_for(Some(g), "", SLOTS) == want)
            .unwrap();
        out.push(g);
    }
    out
}

/// node-0 alone owns every slot and runs calls of 4 s on groups of slots
/// 3, 4, 5 — the slots it gives up when node-1 joins (the assignment keeps
/// a node's lowest slots). Once node-1 consumes those slots, more messages
/// of the same groups arrive; with the drain they can only start after
/// node-0's calls ended. Returns the journals' report.
fn handoff(topo: &Broker, no_drain: bool) -> Report {
    handoff_with(topo, no_drain, &TestDb::new())
}

fn handoff_with(topo: &Broker, no_drain: bool, db: &dyn Registry) -> Report {
    let mut cluster = Cluster::default();
    let mut env0 = vec![NO_SAC];
    if no_drain {
        env0.push((weir::cluster::postgres::NEGATIVE_CONTROL_NO_DRAIN, "1"));
    }
    let admin = common::http::free_port();
    cluster.start_with_env(
        "node-0",
        &config_with(topo, &db.url(), "node-0", "", Some(admin)),
        &env0,
    );
    wait_balanced(db, &cluster, &["node-0"], Duration::from_secs(20));
    let groups = groups_on(&[3, 4, 5]);
    let first: Vec<Envelope> = groups.iter().map(|g| slow(g, 4000)).collect();
    publish_all(topo, &first);
    // The long calls run (two at least: a 2-core machine has two workers).
    wait_for("node-0 runs the long calls", Duration::from_secs(20), || {
        in_flight(admin) >= 2
    });
    cluster.start_with_env("node-1", &config(topo, &db.url(), "node-1"), &[NO_SAC]);
    let moved = wait_balanced(db, &cluster, &["node-0", "node-1"], Duration::from_secs(30));
    for s in [3, 4, 5] {
        assert_eq!(moved[&s], "node-1", "slot {s} moved to the new node: {moved:?}");
    }
    let start = Instant::now();
    while cluster.nodes[1]
        .log()
        .matches("slot assigned to this node; consuming")
        .count()
        < 3
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "node-1 never consumed its slots"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Published now, the second messages wait in the slot queues for
    // node-1's consumers (or are returned by node-0's draining ones).
    let second: Vec<Envelope> = (0..4).flat_map(|_| groups.iter().map(|g| slow(g, 100))).collect();
    publish_all(topo, &second);
    let all: Vec<Envelope> = first.into_iter().chain(second).collect();
    let report = cluster.wait_handled(&ids(&all), Duration::from_secs(120));
    assert!(handled_by(&report, "node-1") > 0, "node-1 took over work");
    for n in &mut cluster.nodes {
        n.terminate(Duration::from_secs(30));
    }
    report
}

#[test]
fn live_handoff_waits_for_running_calls() {
    no_overlap(&handoff(&Broker::rabbit(), false));
}

/// JetStream has no single active consumer: only the drain keeps a moving
/// slot's groups apart.
#[test]
fn live_handoff_waits_for_running_calls_on_nats() {
    no_overlap(&handoff(&Broker::nats(), false));
}

#[test]
fn handoff_without_drain_overlaps_on_nats() {
    assert!(
        !handoff(&Broker::nats(), true).overlaps.is_empty(),
        "the ledger saw no overlap"
    );
}

/// `cluster.mode = "nats-kv"`: the drain comes before the release in the
/// bucket as in the database.
#[test]
fn live_handoff_waits_for_running_calls_on_nats_kv() {
    no_overlap(&handoff_with(&Broker::nats(), false, &KvBucket::new(LEASE)));
}

/// The red baseline of the test above.
#[test]
fn handoff_without_drain_overlaps_on_nats_kv() {
    assert!(
        !handoff_with(&Broker::nats(), true, &KvBucket::new(LEASE))
            .overlaps
            .is_empty(),
        "the ledger saw no overlap"
    );
}

#[test]
fn handoff_without_drain_overlaps() {
    let report = handoff(&Broker::rabbit(), true);
    assert!(
        !report.overlaps.is_empty(),
        "a slot given up before its calls finished must let the next owner overlap them; the ledger saw none"
    );
}

#[test]
fn losing_the_database_fences_before_the_lease_expires() {
    let db = TestDb::new();
    let proxy = Proxy::start();
    let topo = Broker::rabbit();
    let mut cluster = Cluster::default();
    let admin = common::http::free_port();
    cluster.start(
        "node-0",
        &config_with(&topo, &db.url_via(&proxy), "node-0", "", Some(admin)),
    );
    wait_balanced(&db, &cluster, &["node-0"], Duration::from_secs(20));
    let msgs: Vec<Envelope> = (0..400).map(|i| slow(&format!("g{}", i % 12), 40)).collect();
    let publisher = stream(&topo, msgs.clone(), Duration::from_secs(4));
    wait_handled_by(&cluster, "node-0", 10);

    let cut_at = journal::monotonic_ns();
    proxy.cut();
    let start = Instant::now();
    while !cluster.nodes[0].log().contains("fenced: consuming nothing") {
        assert!(
            start.elapsed() < LEASE * 3,
            "never fenced; log:\n{}",
            cluster.nodes[0].log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Every call ended before the lease could expire: the last renewal was
    // sent before the cut, so the lease runs at least until cut + lease −
    // one tick (and the renewal's round trip, bounded here by another tick).
    let deadline = cut_at + u64::try_from((LEASE - 2 * weir::cluster::postgres::TICK).as_nanos()).unwrap();
    // Read the journals once the lease expired (database clock) and no
    // call runs on node-0: any call past the bound would be in them.
    wait_for("node-0's lease expired", LEASE * 3, || {
        db.query("SELECT (lease_until < now())::text FROM weir_nodes WHERE name = 'node-0'")
            .iter()
            .all(|r| r[0].as_deref() == Some("true"))
    });
    assert_eq!(in_flight(admin), 0, "a fenced node runs no call");
    let report = cluster.report();
    let last_end = report.calls.iter().map(|c| c.end).max().unwrap();
    assert!(
        last_end < deadline,
        "a call ended {:?} after the cut, past the lease bound {:?}",
        Duration::from_nanos(last_end - cut_at),
        Duration::from_nanos(deadline - cut_at)
    );
    assert!(
        report.calls.iter().any(|c| c.end > cut_at),
        "calls were running at the cut"
    );

    proxy.restore();
    publisher.join().unwrap();
    let report = cluster.wait_handled(&ids(&msgs), Duration::from_secs(120));
    no_overlap(&report);
    assert!(
        cluster.nodes[0].log().contains("registered again"),
        "{}",
        cluster.nodes[0].log()
    );
    cluster.nodes[0].terminate(Duration::from_secs(30));
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

/// Wait until `probe` holds, up to `timeout` (then panic with `what`).
fn wait_for(what: &str, timeout: Duration, mut probe: impl FnMut() -> bool) {
    assert!(proxy::wait_until(timeout, &mut probe), "{what}: not within {timeout:?}");
}

/// The slots without a live owner (no owner, or one whose lease expired or
/// whose row is gone), by the database.
fn ownerless(db: &TestDb) -> Vec<u32> {
    db.query(
        "SELECT s.slot::text FROM weir_slots s LEFT JOIN weir_nodes n ON n.node_id = s.owner \
         WHERE n.node_id IS NULL OR n.lease_until <= now() ORDER BY s.slot",
    )
    .into_iter()
    .map(|r| r[0].as_ref().unwrap().parse().unwrap())
    .collect()
}

/// Issue 14 item 2: a node that stops keeps renewing its lease while it
/// drains, so nobody gets its slots while its calls run. node-0 runs 4 s
/// calls (two lease lengths; the handler timeout is 5 s) on two of its slots with three messages
/// queued behind each when it gets SIGTERM; node-1 takes the slots over only
/// after those calls ended. JetStream has no single active consumer: a lease
/// freed early lets node-1 run the queued messages beside the running calls.
#[test]
fn a_draining_node_keeps_its_lease_on_nats() {
    let db = TestDb::new();
    let topo = Broker::nats();
    let mut cluster = Cluster::default();
    let admin = common::http::free_port();
    cluster.start("node-0", &config_with(&topo, &db.url(), "node-0", "", Some(admin)));
    wait_balanced(&db, &cluster, &["node-0"], Duration::from_secs(20));
    cluster.start("node-1", &config(&topo, &db.url(), "node-1"));
    let owners = wait_balanced(&db, &cluster, &["node-0", "node-1"], Duration::from_secs(30));
    let mine: Vec<u32> = (0..SLOTS).filter(|s| owners[s] == "node-0").take(2).collect();
    let groups = groups_on(&mine);
    let long: Vec<Envelope> = groups.iter().map(|g| slow(g, 4000)).collect();
    let queued: Vec<Envelope> = (0..3).flat_map(|_| groups.iter().map(|g| slow(g, 50))).collect();
    publish_all(&topo, &long.iter().chain(&queued).cloned().collect::<Vec<_>>());
    wait_for("node-0 runs both long calls", Duration::from_secs(20), || {
        in_flight(admin) >= 2
    });
    cluster.nodes[0].terminate(Duration::from_secs(30));
    let all: Vec<Envelope> = long.iter().chain(&queued).cloned().collect();
    let report = cluster.wait_handled(&ids(&all), Duration::from_secs(60));
    assert!(
        report.overlaps.is_empty(),
        "the slots moved while node-0 still ran calls: {}",
        cluster::describe(&report)
    );
    for m in &long {
        assert_eq!(
            report.settled[&m.id],
            ("node-0".to_owned(), "handled".to_owned()),
            "the drain let the long call finish"
        );
    }
    let leader_log = cluster.nodes[1].log() + &cluster.nodes[0].log();
    assert!(
        !leader_log.contains("nodes whose lease expired"),
        "node-0's lease expired during its drain:\n{leader_log}"
    );
    assert!(
        cluster.nodes[0].log().contains("left the cluster"),
        "{}",
        cluster.nodes[0].log()
    );
    cluster.nodes[1].terminate(Duration::from_secs(30));
}

/// The drain deadline: a leaving node interrupts the calls still running at
/// `cluster.drain_deadline` (here the lease, 2 s, against 4.5 s calls), and
/// they are released, not failed: the next owner handles them on their next
/// delivery, nothing is dead-lettered, and node-0 exits long before its
/// calls would have ended.
#[test]
fn the_drain_deadline_interrupts_and_releases() {
    let db = TestDb::new();
    let topo = Broker::rabbit();
    let mut cluster = Cluster::default();
    let admin = common::http::free_port();
    let extra = format!("drain_deadline = \"{}ms\"", LEASE.as_millis());
    cluster.start("node-0", &config_with(&topo, &db.url(), "node-0", &extra, Some(admin)));
    wait_balanced(&db, &cluster, &["node-0"], Duration::from_secs(20));
    cluster.start("node-1", &config(&topo, &db.url(), "node-1"));
    let owners = wait_balanced(&db, &cluster, &["node-0", "node-1"], Duration::from_secs(30));
    let mine: Vec<u32> = (0..SLOTS).filter(|s| owners[s] == "node-0").take(2).collect();
    let groups = groups_on(&mine);
    // Under the handler timeout (5 s): the calls end on node-1.
    let long: Vec<Envelope> = groups.iter().map(|g| slow(g, 4500)).collect();
    publish_all(&topo, &long);
    wait_for("node-0 runs both long calls", Duration::from_secs(20), || {
        in_flight(admin) >= 2
    });
    let stopped = Instant::now();
    cluster.nodes[0].terminate(Duration::from_secs(30));
    let journal = cluster.report();
    let ended_on_0 = journal.calls.iter().filter(|c| c.node == "node-0").count();
    assert!(ended_on_0 >= 2, "the interrupted calls ended on node-0 before it left");
    let took = stopped.elapsed();
    eprintln!("node-0 left {took:?} after SIGTERM (drain deadline {LEASE:?}, calls of 4.5 s)");
    let log = cluster.nodes[0].log();
    assert!(log.contains("drain deadline: interrupting"), "{log}");
    let report = cluster.wait_handled(&ids(&long), Duration::from_secs(60));
    no_overlap(&report);
    for m in &long {
        assert_eq!(
            report.settled[&m.id].0, "node-1",
            "the interrupted call ran again on node-1"
        );
    }
    let dead: Vec<&(String, String)> = report
        .settled
        .values()
        .filter(|(_, o)| o.starts_with("dead-lettered"))
        .collect();
    assert!(dead.is_empty(), "interrupted calls are released, not failed: {dead:?}");
    cluster.nodes[1].terminate(Duration::from_secs(60));
}

/// Issue 14 item 3: churn. Three nodes; 24 membership changes (a node stops
/// with SIGTERM, a new one starts; every third change both at once) while
/// messages flow. After each change every slot has a live owner within
/// lease + 1 s, no slot is ever assigned to a node that is leaving, and the
/// journals show no overlap and nothing lost.
#[test]
fn churn_every_slot_has_a_live_owner_after_each_change() {
    let db = TestDb::new();
    let topo = Broker::rabbit();
    let mut cluster = Cluster::default();
    let mut alive: Vec<String> = Vec::new();
    for i in 0..3 {
        let name = format!("n{i}");
        cluster.start(&name, &config(&topo, &db.url(), &name));
        alive.push(name);
    }
    let names: Vec<&str> = alive.iter().map(String::as_str).collect();
    wait_balanced(&db, &cluster, &names, Duration::from_secs(30));
    let msgs: Vec<Envelope> = (0..2400).map(|i| slow(&format!("g{}", i % 48), 5)).collect();
    let publisher = stream(&topo, msgs.clone(), Duration::from_secs(40));
    let bound = LEASE + Duration::from_secs(1);
    let mut worst = Duration::ZERO;
    for change in 0..24 {
        let victim = alive.remove(change % alive.len().max(1));
        let i = cluster.nodes.iter().position(|n| n.name == victim).unwrap();
        let newcomer = format!("n{}", change + 3);
        if change % 3 == 2 {
            // Stop and start at once.
            let mut node = cluster.nodes.remove(i);
            let stopping = std::thread::spawn(move || {
                node.terminate(Duration::from_secs(30));
                node
            });
            cluster.start(&newcomer, &config(&topo, &db.url(), &newcomer));
            let node = stopping.join().unwrap();
            cluster.nodes.push(node);
        } else {
            cluster.nodes[i].terminate(Duration::from_secs(30));
            let since = Instant::now();
            wait_for(
                &format!(
                    "change {change}: every slot owned after {victim} left: {:?}",
                    ownerless(&db)
                ),
                bound,
                || ownerless(&db).is_empty(),
            );
            worst = worst.max(since.elapsed());
            cluster.start(&newcomer, &config(&topo, &db.url(), &newcomer));
        }
        alive.push(newcomer);
        let since = Instant::now();
        wait_for(
            &format!(
                "change {change}: every slot owned after the start: {:?}",
                ownerless(&db)
            ),
            bound,
            || ownerless(&db).is_empty(),
        );
        worst = worst.max(since.elapsed());
    }
    let names: Vec<&str> = alive.iter().map(String::as_str).collect();
    wait_balanced(&db, &cluster, &names, Duration::from_secs(30));
    publisher.join().unwrap();
    let report = cluster.wait_handled(&ids(&msgs), Duration::from_secs(180));
    no_overlap(&report);
    eprintln!("churn: 24 changes, longest wait for every slot to have a live owner {worst:?}");
    for n in &mut cluster.nodes {
        if n.alive() {
            n.terminate(Duration::from_secs(30));
        }
    }
    assert!(owners(&db).is_empty(), "{:?}", owners(&db));
}

/// Issue 14 item 5: the fencing deadline is a timer of its own. node-0's
/// database connection goes through a proxy the test freezes (bytes held,
/// connections open: every step waits its full timeout). node-0 must finish
/// fencing — every call ended, "fenced" logged — before its lease expires by
/// the database's clock. The negative control moves the fence past the
/// expiry and must be caught by the same measurement.
#[test]
fn a_frozen_database_fences_before_the_lease_expires() {
    let (after, by) = frozen_database(false);
    assert!(!after, "node-0 finished fencing {by:?} after its lease expired");
}

#[test]
fn a_fence_after_the_lease_expired_is_measured_late() {
    let (after, by) = frozen_database(true);
    assert!(
        after,
        "the measurement cannot see a late fence: it says {by:?} before the expiry"
    );
}

/// Whether node-0 finished fencing after its lease expired (database
/// clock), and by how much (before or after).
fn frozen_database(late: bool) -> (bool, Duration) {
    let db = TestDb::new();
    let pg = proxy::FaultProxy::start("127.0.0.1:5432".parse().unwrap());
    let url = format!("postgres://postgres@127.0.0.1:{}/{}", pg.port(), db.name);
    let topo = Broker::rabbit();
    let mut cluster = Cluster::default();
    let admin = common::http::free_port();
    let env: Vec<(&str, &str)> = if late {
        vec![(weir::cluster::postgres::NEGATIVE_CONTROL_LATE_FENCE, "1")]
    } else {
        Vec::new()
    };
    cluster.start_with_env("node-0", &config_with(&topo, &url, "node-0", "", Some(admin)), &env);
    wait_balanced(&db, &cluster, &["node-0"], Duration::from_secs(20));
    let groups = groups_on(&[0, 1]);
    let long: Vec<Envelope> = groups.iter().map(|g| slow(g, 8000)).collect();
    publish_all(&topo, &long);
    wait_for("node-0 runs both calls", Duration::from_secs(20), || {
        in_flight(admin) >= 2
    });

    pg.freeze();
    let start = Instant::now();
    let line = loop {
        if let Some(l) = cluster.nodes[0]
            .log()
            .lines()
            .find(|l| l.contains("fenced: consuming nothing"))
        {
            break l.to_owned();
        }
        assert!(
            start.elapsed() < LEASE * 4,
            "never fenced; log:\n{}",
            cluster.nodes[0].log()
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(in_flight(admin), 0, "fencing ended every call");
    // Both ends on this machine's clock, neither through this test's own
    // (possibly starved) timing: the node stamps the fence line when the
    // fence ended, and the database holds the lease's end, which the frozen
    // proxy keeps from moving (a renewal already inside the database when
    // the proxy froze has committed long before now).
    let stamp = log_stamp(&line);
    let late_by: f64 = db.query(&format!(
        "SELECT extract(epoch FROM '{stamp}'::timestamptz - lease_until)::float8::text FROM weir_nodes WHERE name = 'node-0'"
    ))[0][0]
        .as_ref()
        .unwrap()
        .parse()
        .unwrap();
    pg.forward();
    let after = late_by >= 0.0;
    let by = Duration::from_secs_f64(late_by.abs());
    eprintln!(
        "fence finished {by:?} {} the lease expired (late control: {late})",
        if after { "after" } else { "before" }
    );
    if after != late || std::env::var_os("WEIR_TEST_SHOW_LOG").is_some() {
        eprintln!("node-0's log:\n{}", cluster.nodes[0].log());
    }
    for n in &mut cluster.nodes {
        n.terminate(Duration::from_secs(30));
    }
    (after, by)
}

/// Issue 14 item 4b: a fence and a takeover, then SIGTERM. node-0's
/// database connection freezes while it runs 4 s calls with messages
/// queued behind them; it fences (interrupting them: released, not
/// failed); node-1 takes every slot and handles everything; then node-1
/// must leave within 20 s of its SIGTERM, and node-0 too once its database
/// is back.
#[test]
fn after_a_fence_and_a_takeover_both_nodes_exit_on_nats() {
    let db = TestDb::new();
    let pg = proxy::FaultProxy::start("127.0.0.1:5432".parse().unwrap());
    let via = format!("postgres://postgres@127.0.0.1:{}/{}", pg.port(), db.name);
    let topo = Broker::nats();
    let mut cluster = Cluster::default();
    let admin = common::http::free_port();
    cluster.start("node-0", &config_with(&topo, &via, "node-0", "", Some(admin)));
    wait_balanced(&db, &cluster, &["node-0"], Duration::from_secs(20));
    cluster.start("node-1", &config(&topo, &db.url(), "node-1"));
    let owners = wait_balanced(&db, &cluster, &["node-0", "node-1"], Duration::from_secs(30));
    let mine: Vec<u32> = (0..SLOTS).filter(|s| owners[s] == "node-0").take(2).collect();
    let groups = groups_on(&mine);
    let long: Vec<Envelope> = groups.iter().map(|g| slow(g, 4000)).collect();
    let queued: Vec<Envelope> = (0..3).flat_map(|_| groups.iter().map(|g| slow(g, 50))).collect();
    let all: Vec<Envelope> = long.iter().chain(&queued).cloned().collect();
    publish_all(&topo, &all);
    wait_for("node-0 runs both long calls", Duration::from_secs(20), || {
        in_flight(admin) >= 2
    });
    pg.freeze();
    wait_for("node-0 fences", LEASE * 3, || {
        cluster.nodes[0].log().contains("fenced: consuming nothing")
    });
    wait_balanced(&db, &cluster, &["node-1"], LEASE * 5);
    let report = cluster.wait_handled(&ids(&all), Duration::from_secs(60));
    no_overlap(&report);
    let dead: Vec<&(String, String)> = report
        .settled
        .values()
        .filter(|(_, o)| o.starts_with("dead-lettered"))
        .collect();
    assert!(
        dead.is_empty(),
        "interrupted and queued messages are released, not failed: {dead:?}"
    );
    cluster.nodes[1].terminate(Duration::from_secs(20));
    pg.forward();
    cluster.nodes[0].terminate(Duration::from_secs(30));
}

/// Issue 14 item 4: a SIGINT drain in `postgres` mode settles for good what
/// it handled: no message node-0 handled before it exited is called again
/// after (by node-1 or by node-0's next incarnation).
fn sigint_drain_reruns_nothing(topo: &Broker) {
    let db = TestDb::new();
    let mut cluster = Cluster::default();
    cluster.start("node-0", &config(topo, &db.url(), "node-0"));
    cluster.start("node-1", &config(topo, &db.url(), "node-1"));
    wait_balanced(&db, &cluster, &["node-0", "node-1"], Duration::from_secs(30));
    let msgs: Vec<Envelope> = (0..900).map(|i| slow(&format!("g{}", i % 24), 5)).collect();
    let publisher = stream(topo, msgs.clone(), Duration::from_secs(6));
    wait_handled_by(&cluster, "node-0", 100);
    cluster.nodes[0].interrupt(Duration::from_secs(30));
    let exited = journal::monotonic_ns();
    let before: HashSet<String> = cluster
        .report()
        .settled
        .iter()
        .filter(|(_, (n, o))| n == "node-0" && o == "handled")
        .map(|(id, _)| id.clone())
        .collect();
    cluster.start("node-0b", &config(topo, &db.url(), "node-0b"));
    publisher.join().unwrap();
    let report = cluster.wait_handled(&ids(&msgs), Duration::from_secs(120));
    no_overlap(&report);
    let again: Vec<&journal::Call> = report
        .calls
        .iter()
        .filter(|c| c.start > exited && before.contains(&c.id))
        .collect();
    assert!(
        again.is_empty(),
        "{} of the {} messages node-0 handled before its exit were called again after it, first {:?}",
        again.len(),
        before.len(),
        again.first()
    );
    for n in &mut cluster.nodes {
        if n.alive() {
            n.terminate(Duration::from_secs(30));
        }
    }
}

#[test]
fn sigint_drain_reruns_nothing_on_rabbitmq() {
    sigint_drain_reruns_nothing(&Broker::rabbit());
}

#[test]
fn sigint_drain_reruns_nothing_on_nats() {
    sigint_drain_reruns_nothing(&Broker::nats());
}

/// The timestamp that opens a log line (RFC 3339, UTC), without colour codes.
fn log_stamp(line: &str) -> String {
    let mut plain = String::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // An escape sequence: up to its final letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
            continue;
        }
        plain.push(c);
    }
    let stamp = plain.split_whitespace().next().unwrap_or_default().to_owned();
    assert!(
        !stamp.is_empty() && stamp.chars().all(|c| c.is_ascii_digit() || "-T:.Z".contains(c)),
        "no timestamp at the start of the log line {line:?}"
    );
    stamp
}
