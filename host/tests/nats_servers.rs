//! Weir on a real three-server JetStream cluster (issue 20, item 2): three
//! nats-server processes on loopback ports with their own stores, started
//! and stopped by the tests ([`common::nats_servers`]), and `weir run`
//! nodes whose `transport.url` lists all three.
//!
//! - `killing_the_stream_leader_loses_nothing`: R3 streams; two static nodes
//!   consume while the server that leads the work stream, and that both
//!   nodes are connected to, is killed with SIGKILL mid-stream. Every
//!   message published before and after the kill is handled, no group runs
//!   two calls at once across the nodes, the time to the first message after
//!   the kill is reported, the killed server catches up when it comes back,
//!   and the nodes still drain and exit 0.
//! - `a_stalled_server_is_left_for_a_live_one`: the same server hangs
//!   instead (SIGSTOP: sockets open, no answer, no refusal); the nodes ping
//!   it, give it up and move to a live server in seconds. Its red baseline,
//!   `with_default_pings_a_stalled_server_holds_the_nodes`, keeps the
//!   client's 60 s pings and stays stuck past the bound.
//! - `one_replica_is_unavailable_while_its_server_is_down`: the red
//!   baseline. The same kill with `transport.replicas = 1`: the messages
//!   stored on that server are out of reach until it comes back, so the
//!   wait for them must time out; after the restart they are handled.
//! - `nats_kv_rides_out_a_killed_and_restarted_server` and
//!   `nats_kv_rides_out_a_stalled_server`: two `cluster.mode = "nats-kv"`
//!   nodes, the bucket and the streams of 3 replicas, and the server that
//!   leads the bucket and the work stream killed (then restarted) or
//!   stalled: nothing lost, no overlap, balanced again afterwards, and the
//!   slots freed when the nodes leave.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::cluster::{self, Cluster};
use common::nats_servers::NatsServers;
use common::registry::KvBucket;
use weir::envelope::{self, Envelope};
use weir::observe::journal::{Report, monotonic_ns};
use weir::partition;
use weir::transport::Transport as _;
use weir::transport::nats::{Nats, NatsOptions, names};

const SLOTS: u32 = 4;

/// A node of `topology` owning `owned`, on every server of `urls`, with
/// `replicas` replicas per stream.
fn node_config(topology: &str, node: &str, urls: &[String], replicas: usize, owned: &[u32]) -> String {
    let list: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    cluster::node_config(node, "nats", "URLS", 32, &cluster::static_mode(owned), topology, SLOTS).replace(
        "url = \"URLS\"",
        &format!("url = [{}]\nreplicas = {replicas}", list.join(", ")),
    )
}

fn topology_name() -> String {
    format!("t-{}", &uuid::Uuid::new_v4().simple().to_string()[..8])
}

/// Publish `msgs` to their slots through any of `urls`, riding out a
/// failover: a publish that fails (no responders, no PubAck while a leader is
/// elected) is sent again until it is acknowledged, for at most a minute.
/// Returns the monotonic time each message's PubAck came.
fn publish(urls: &[String], topology: &str, msgs: &[Envelope]) -> HashMap<String, u64> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let t = Nats::with_urls(
            urls.to_vec(),
            "weir nats-servers test publisher",
            NatsOptions::default(),
        );
        let mut acked = HashMap::new();
        for m in msgs {
            let slot = partition::slot_for(m.group(), &m.id, SLOTS);
            let start = Instant::now();
            loop {
                match t.publish(topology, slot, envelope::encode(m)).await {
                    Ok(()) => break,
                    Err(e) if start.elapsed() < Duration::from_secs(60) => {
                        eprintln!("publish of {} failed ({e}); sending it again", m.id);
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => panic!("publish of {} failed for a minute: {e}", m.id),
                }
            }
            acked.insert(m.id.clone(), monotonic_ns());
        }
        acked
    })
}

/// Poll `f` on a runtime of its own until it returns `Some`, for at most `timeout`.
fn wait_for<T>(what: &str, timeout: Duration, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let start = Instant::now();
        loop {
            if let Some(v) = f().await {
                return v;
            }
            assert!(start.elapsed() < timeout, "{what}: not within {timeout:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// Make `want` the leader of `stream` by asking the current leader to step
/// down until the election lands there (each election picks among the
/// current replicas, so this ends quickly).
fn move_leader(urls: &[String], stream: &str, want: &str) {
    for _ in 0..40 {
        let leader = wait_for("the stream has a leader", Duration::from_secs(30), async || {
            NatsServers::stream_leader(urls, stream).await.ok()
        });
        if leader == want {
            return;
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let client = common::nats_servers::connect(urls).await.unwrap();
            let subject = format!("$JS.API.STREAM.LEADER.STEPDOWN.{stream}");
            let _ = client.request(subject, "".into()).await;
        });
        wait_for(
            "a new leader after the step-down",
            Duration::from_secs(30),
            async || {
                NatsServers::stream_leader(urls, stream)
                    .await
                    .ok()
                    .filter(|l| *l != leader)
            },
        );
    }
    panic!("{want} never became the leader of {stream}");
}

/// How many replicas of `stream` are current (the leader counts).
async fn current_replicas(urls: &[String], stream: &str) -> Option<usize> {
    let client = common::nats_servers::connect(urls).await.ok()?;
    let js = async_nats::jetstream::new(client);
    let mut s = js.get_stream(stream).await.ok()?;
    let info = s.info().await.ok()?;
    let cluster = info.cluster.as_ref()?;
    cluster.leader.as_ref()?;
    Some(1 + cluster.replicas.iter().filter(|r| r.current && !r.offline).count())
}

/// When the first call of any of `msgs` started (monotonic ns).
fn first_call_of(report: &Report, msgs: &[Envelope]) -> u64 {
    let ids: std::collections::HashSet<&str> = msgs.iter().map(|m| m.id.as_str()).collect();
    report
        .calls
        .iter()
        .filter(|c| ids.contains(c.id.as_str()))
        .map(|c| c.start)
        .min()
        .expect("a call of those messages")
}

fn handled_count(c: &Cluster) -> usize {
    c.report().handled().len()
}

fn calls_per_id(r: &Report) -> HashMap<&str, usize> {
    let mut m = HashMap::new();
    for c in &r.calls {
        *m.entry(c.id.as_str()).or_insert(0) += 1;
    }
    m
}

#[test]
fn killing_the_stream_leader_loses_nothing() {
    let mut servers = NatsServers::start(3);
    let urls = servers.urls();
    let topology = topology_name();
    let mut nodes = Cluster::default();
    nodes.start("node-0", &node_config(&topology, "node-0", &urls, 3, &[0, 1]));
    nodes.start("node-1", &node_config(&topology, "node-1", &urls, 3, &[2, 3]));
    let stream = names::stream(&topology);
    // Both nodes are connected to n0 (the first URL of their lists); make it
    // the stream's leader too, so its death takes both at once.
    move_leader(&urls, &stream, "n0");
    // transport.replicas reached every stream Weir made.
    wait_for("the streams' replicas read", Duration::from_secs(30), async || {
        let js = async_nats::jetstream::new(common::nats_servers::connect(&urls).await.ok()?);
        for name in [
            stream.clone(),
            names::dead_letter_stream(&topology),
            names::attempts_stream(&topology),
        ] {
            let mut s = js.get_stream(&name).await.ok()?;
            let replicas = s.info().await.ok()?.config.num_replicas;
            assert_eq!(
                replicas, 3,
                "stream {name} has {replicas} replicas, transport.replicas = 3"
            );
        }
        Some(())
    });

    let before = cluster::messages(30, 20, 10);
    publish(&urls, &topology, &before);
    // Mid-stream: some handled, most still stored.
    wait_for(
        "100 messages handled before the kill",
        Duration::from_secs(60),
        async || (handled_count(&nodes) >= 100).then_some(()),
    );
    let killed_at = monotonic_ns();
    let killed_wall = common::nats_servers::utc_time_of_day();
    servers.kill("n0");
    let handled_at_kill = handled_count(&nodes);

    // New messages go in through the survivors while they elect a leader.
    let after = cluster::messages(30, 5, 10);
    let acked = publish(&urls[1..], &topology, &after);
    let first_ack_ms = acked.values().min().map(|t| (t - killed_at) / 1_000_000).unwrap();

    let mut all = cluster::ids(&before);
    all.extend(cluster::ids(&after));
    let report = nodes.wait_handled(&all, Duration::from_secs(120));
    assert!(report.overlaps.is_empty(), "{}", cluster::describe(&report));

    let first_new = first_call_of(&report, &after);
    let first_any = report
        .calls
        .iter()
        .map(|c| c.start)
        .filter(|s| *s > killed_at)
        .min()
        .unwrap();
    // The election is the servers' part of the pause: when a survivor
    // logged the stream's new leader.
    let elected_ms = servers.servers[1..]
        .iter()
        .filter_map(|s| s.logged_after(&format!("new stream leader for '$G > {stream}'"), killed_wall))
        .reduce(f64::min)
        .map_or_else(|| "?".to_owned(), |t| format!("{:.0}", (t - killed_wall) * 1000.0));
    let per_id = calls_per_id(&report);
    let again = per_id.values().filter(|n| **n > 1).count();
    println!(
        "stream leader n0 killed with {handled_at_kill} of {} handled: first call after the kill at +{} ms, \
         new stream leader elected at +{elected_ms} ms, first PubAck through the survivors at +{first_ack_ms} ms, first call of a message published after \
         the kill at +{} ms; {} messages handled, {again} of them more than once (at-least-once), 0 overlaps",
        before.len(),
        (first_any - killed_at) / 1_000_000,
        (first_new - killed_at) / 1_000_000,
        all.len(),
    );
    assert!(
        report.nodes().len() == 2,
        "both nodes worked through the failover: {:?}",
        report.nodes()
    );

    // The killed server comes back on its store and catches up.
    servers.restart("n0");
    wait_for(
        "n0 current again after its restart",
        Duration::from_secs(60),
        async || (current_replicas(&urls[1..], &stream).await == Some(3)).then_some(()),
    );
    for n in &mut nodes.nodes {
        assert!(n.alive(), "{} died during the failover; log:\n{}", n.name, n.log());
    }
    for n in &mut nodes.nodes {
        n.terminate(Duration::from_secs(60));
    }
}

/// A server that hangs (SIGSTOP: its sockets stay open, it neither answers
/// nor refuses) while it leads the stream and holds both nodes' connections,
/// with the nodes started with `env`. The survivors elect a leader; the nodes
/// must notice the silence and move to a live server by themselves. Returns
/// when the first message published after the stall was called (ms after
/// the stall), or why none was within [`STALL_BOUND_SECS`].
fn stall_the_leader(env: &[(&str, &str)]) -> Result<u64, String> {
    let mut servers = NatsServers::start(3);
    let urls = servers.urls();
    let topology = topology_name();
    let mut nodes = Cluster::default();
    nodes.start_with_env("node-0", &node_config(&topology, "node-0", &urls, 3, &[0, 1]), env);
    nodes.start_with_env("node-1", &node_config(&topology, "node-1", &urls, 3, &[2, 3]), env);
    let stream = names::stream(&topology);
    move_leader(&urls, &stream, "n0");

    let before = cluster::messages(30, 10, 5);
    publish(&urls, &topology, &before);
    nodes.wait_handled(&cluster::ids(&before), Duration::from_secs(60));
    let stalled_at = monotonic_ns();
    servers.stall("n0");
    let after = cluster::messages(30, 5, 5);
    publish(&urls[1..], &topology, &after);
    let waited = nodes.try_wait_handled(&cluster::ids(&after), Duration::from_secs(STALL_BOUND_SECS));
    servers.resume("n0");
    let report = waited.map_err(|why| why.lines().next().unwrap_or_default().to_owned())?;
    assert!(report.overlaps.is_empty(), "{}", cluster::describe(&report));
    let first_new = first_call_of(&report, &after);
    for n in &mut nodes.nodes {
        n.terminate(Duration::from_secs(60));
    }
    Ok((first_new - stalled_at) / 1_000_000)
}

/// How long the nodes may take to leave a stalled server for a live one
/// (the election takes 5–7 s of it).
const STALL_BOUND_SECS: u64 = 30;

#[test]
fn a_stalled_server_is_left_for_a_live_one() {
    match stall_the_leader(&[]) {
        Ok(ms) => {
            println!("server n0 stalled (SIGSTOP): first call of a message published after the stall at +{ms} ms")
        }
        Err(why) => panic!("the nodes did not leave the stalled server within {STALL_BOUND_SECS} s: {why}"),
    }
}

/// The red baseline: with the client's default pings (60 s) the nodes stay
/// on the hung server past the bound.
#[test]
fn with_default_pings_a_stalled_server_holds_the_nodes() {
    let env = [(weir::transport::nats::conn::NEGATIVE_CONTROL_DEFAULT_PINGS, "1")];
    match stall_the_leader(&env) {
        Ok(ms) => panic!("with 60 s pings the nodes left the stalled server after {ms} ms: the test cannot tell"),
        Err(why) => println!("red baseline, default pings: {why}"),
    }
}

#[test]
fn one_replica_is_unavailable_while_its_server_is_down() {
    let mut servers = NatsServers::start(3);
    let urls = servers.urls();
    let topology = topology_name();
    let mut nodes = Cluster::default();
    nodes.start("node-0", &node_config(&topology, "node-0", &urls, 1, &[0, 1, 2, 3]));
    let stream = names::stream(&topology);
    let holder = wait_for("the stream has a leader", Duration::from_secs(30), async || {
        NatsServers::stream_leader(&urls, &stream).await.ok()
    });

    let before = cluster::messages(30, 20, 10);
    publish(&urls, &topology, &before);
    wait_for(
        "100 messages handled before the kill",
        Duration::from_secs(60),
        async || (handled_count(&nodes) >= 100).then_some(()),
    );
    servers.kill(&holder);
    let ids = cluster::ids(&before);
    // What the node holds (at most its window: 4 slots × prefetch 32) still
    // finishes; the rest sits on the dead server.
    let Err(text) = nodes.try_wait_handled(&ids, Duration::from_secs(15)) else {
        panic!("with one replica on a dead server the messages cannot all be handled");
    };
    assert!(text.contains("never handled"), "{text}");
    println!(
        "red baseline: with replicas = 1 and {holder} down, {}",
        text.lines().next().unwrap()
    );

    // Unavailable, not lost: the server's file store brings them back.
    servers.restart(&holder);
    nodes.wait_handled(&ids, Duration::from_secs(120));
    for n in &mut nodes.nodes {
        n.terminate(Duration::from_secs(60));
    }
}

/// `cluster.mode = "nats-kv"` on the three servers: the lease, long enough
/// to ride out a RAFT election of the bucket's stream (5–7 s on nats 2.9).
const KV_LEASE: Duration = Duration::from_secs(10);

/// A `nats-kv` node of `topology` on every server of `urls`, bucket and
/// streams of 3 replicas.
fn kv_node_config(topology: &str, node: &str, urls: &[String], bucket: &KvBucket) -> String {
    use common::registry::Registry as _;
    let list: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    let lines = format!(
        "{}lease = \"{}s\"\n",
        common::registry::cluster(&bucket.url()),
        KV_LEASE.as_secs()
    );
    cluster::node_config(node, "nats", "URLS", 32, &lines, topology, SLOTS)
        .replace("url = \"URLS\"", &format!("url = [{}]\nreplicas = 3", list.join(", ")))
}

/// Two `nats-kv` nodes, balanced, with the bucket's stream and the work
/// stream led by n0 (which both nodes are connected to); then `fault` is
/// done to n0 mid-stream. Every message published before and after is
/// handled with no overlap, and the slots end balanced over both nodes
/// again. Returns the ms from the fault to the first call of a message
/// published after it, and the fences the nodes logged.
fn kv_fault(fault: impl FnOnce(&mut NatsServers), undo: impl FnOnce(&mut NatsServers)) -> (u64, usize) {
    use common::registry::Registry as _;
    let mut servers = NatsServers::start(3);
    let urls = servers.urls();
    let topology = topology_name();
    let bucket = KvBucket::on(urls.clone(), KV_LEASE);
    let mut nodes = Cluster::default();
    for n in ["node-0", "node-1"] {
        nodes.start(n, &kv_node_config(&topology, n, &urls, &bucket));
    }
    // Polled from this thread: the bucket reader has a runtime of its own.
    let balanced = |what: &str| {
        let start = Instant::now();
        while !common::pg::balanced(&bucket.slot_owners(), &["node-0", "node-1"], SLOTS) {
            assert!(start.elapsed() < Duration::from_secs(60), "{what}: not within 60 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    balanced("balanced over both nodes");
    move_leader(&urls, &format!("KV_{}", bucket.bucket), "n0");
    move_leader(&urls, &names::stream(&topology), "n0");

    let before = cluster::messages(30, 20, 10);
    publish(&urls, &topology, &before);
    wait_for("100 handled before the fault", Duration::from_secs(60), async || {
        (handled_count(&nodes) >= 100).then_some(())
    });
    let at = monotonic_ns();
    fault(&mut servers);
    let after = cluster::messages(30, 5, 10);
    publish(&urls[1..], &topology, &after);
    let mut all = cluster::ids(&before);
    all.extend(cluster::ids(&after));
    let report = nodes.wait_handled(&all, Duration::from_secs(120));
    assert!(report.overlaps.is_empty(), "{}", cluster::describe(&report));
    let first_new = first_call_of(&report, &after);
    undo(&mut servers);
    balanced("balanced over both nodes after the fault");
    let fences = nodes
        .nodes
        .iter()
        .map(|n| n.log().matches("fenced: consuming nothing").count())
        .sum();
    for n in &mut nodes.nodes {
        assert!(n.alive(), "{} died; log:\n{}", n.name, n.log());
        n.terminate(Duration::from_secs(60));
    }
    assert!(
        bucket.slot_owners().is_empty(),
        "the nodes left and freed their slots: {:?}",
        bucket.slot_owners()
    );
    ((first_new - at) / 1_000_000, fences)
}

/// The server that leads the bucket and the work stream is killed, and
/// comes back later on its store.
#[test]
fn nats_kv_rides_out_a_killed_and_restarted_server() {
    let (ms, fences) = kv_fault(|s| s.kill("n0"), |s| s.restart("n0"));
    println!(
        "nats-kv, server n0 (bucket and stream leader) killed: first call of a message published after the kill at +{ms} ms; {fences} fences (lease {KV_LEASE:?})"
    );
}

/// The same server hangs instead (SIGSTOP), and is resumed later.
#[test]
fn nats_kv_rides_out_a_stalled_server() {
    let (ms, fences) = kv_fault(|s| s.stall("n0"), |s| s.resume("n0"));
    println!(
        "nats-kv, server n0 (bucket and stream leader) stalled: first call of a message published after the stall at +{ms} ms; {fences} fences (lease {KV_LEASE:?})"
    );
}
