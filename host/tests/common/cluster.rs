//! Clusters of real `weir run` processes for the multi-node tests: each node
//! gets its own config file, log file and journal (the cross-process ledger,
//! `weir::observe::journal`) in one scratch directory. Nodes are stopped with SIGTERM
//! (drain) or SIGKILL (crash); any node still running when the cluster is
//! dropped is killed, so a failing test leaves no process behind. The
//! cluster assertions every transport must pass live here too
//! ([`static_cluster_of_three`] and its red baseline).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use weir::envelope::Envelope;
use weir::observe::journal::{self, Report};
use weir::partition;
use weir::transport::Transport;

/// The `weir` binary the nodes run: `WEIR_TEST_BIN` when set (a copy of
/// this worktree's build: the shared target directory's `debug/weir` is
/// relinked by every worktree that builds), else Cargo's.
pub fn weir_bin() -> String {
    std::env::var("WEIR_TEST_BIN").unwrap_or_else(|_| package_bin("weir", option_env!("CARGO_BIN_EXE_weir")))
}

/// A binary of the `weir` package: `cargo` (its `CARGO_BIN_EXE_…`, set in the host's own
/// tests), else the one beside this test executable's directory (`target/<profile>/`), which
/// `cargo test --workspace` builds before it runs the end-to-end crate (`tests/`).
pub fn package_bin(name: &str, cargo: Option<&str>) -> String {
    if let Some(path) = cargo {
        return path.to_owned();
    }
    let exe = std::env::current_exe().expect("the test executable's path");
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(std::path::Path::parent)
        .expect("a test executable under target/");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: the end-to-end tests run the `{name}` binary of the weir package; \
         `cargo test --workspace` builds it first, or build it with `cargo build -p weir`",
        path.display()
    );
    path.display().to_string()
}

/// One `weir run` process.
pub struct NodeProc {
    /// Its `[node] name`.
    pub name: String,
    child: Option<Child>,
    log: PathBuf,
    /// Its journal file.
    pub journal: PathBuf,
}

impl NodeProc {
    /// The node's log so far (stderr and stdout).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Its process id (the node was started and not yet reaped).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("the node runs").id()
    }

    /// True while the process runs.
    pub fn alive(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| c.try_wait().unwrap().is_none())
    }

    fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            let pid = i32::try_from(c.id()).unwrap();
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(pid, sig) };
        }
    }

    /// Send `sig` and return at once (the test watches what follows).
    pub fn send_signal(&self, sig: i32) {
        self.signal(sig);
    }

    /// SIGTERM, then wait for a clean exit (the node drains first).
    pub fn terminate(&mut self, timeout: Duration) {
        self.signal(libc::SIGTERM);
        let status = self.wait(timeout);
        assert!(
            status.success(),
            "{} exited with {status} after SIGTERM; log:\n{}",
            self.name,
            self.log()
        );
    }

    /// SIGINT (Ctrl-C), then wait for a clean exit (the node drains first).
    pub fn interrupt(&mut self, timeout: Duration) {
        self.signal(libc::SIGINT);
        let status = self.wait(timeout);
        assert!(
            status.success(),
            "{} exited with {status} after SIGINT; log:\n{}",
            self.name,
            self.log()
        );
    }

    /// SIGKILL: a crash, nothing drained.
    pub fn kill(&mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.wait(Duration::from_secs(10));
    }

    /// Wait for the exit (panics with the log after `timeout`).
    pub fn wait(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let start = Instant::now();
        let child = self.child.as_mut().expect("the node was started");
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                self.child = None;
                return status;
            }
            assert!(
                start.elapsed() < timeout,
                "{} did not exit within {timeout:?}; log:\n{}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A scratch directory and the nodes started in it.
pub struct Cluster {
    dir: tempfile::TempDir,
    /// The nodes, in start order.
    pub nodes: Vec<NodeProc>,
}

impl Default for Cluster {
    fn default() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            nodes: Vec::new(),
        }
    }
}

impl Cluster {
    /// Start `weir run` with `config` (TOML) as node `name`, and wait until
    /// it logs that it started. Returns the node's index.
    pub fn start(&mut self, name: &str, config: &str) -> usize {
        self.start_with_env(name, config, &[])
    }

    /// [`Cluster::start`] with extra environment variables.
    pub fn start_with_env(&mut self, name: &str, config: &str, env: &[(&str, &str)]) -> usize {
        let dir = self.dir.path();
        let config_path = dir.join(format!("{name}.toml"));
        std::fs::write(&config_path, config).unwrap();
        let log = dir.join(format!("{name}.log"));
        let journal = dir.join(format!("{name}.journal"));
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(weir_bin())
            .args(["run", "--config"])
            .arg(&config_path)
            .env("RUST_LOG", "warn,weir=info")
            .env(journal::ENV, &journal)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        let mut node = NodeProc {
            name: name.to_owned(),
            child: Some(child),
            log,
            journal,
        };
        let start = Instant::now();
        while !node.log().contains("node started") {
            assert!(node.alive(), "{name} exited during start; log:\n{}", node.log());
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{name} did not start within 60s; log:\n{}",
                node.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// Every journal read and checked.
    pub fn report(&self) -> Report {
        let paths: Vec<&Path> = self.nodes.iter().map(|n| n.journal.as_path()).collect();
        journal::check(&paths).unwrap()
    }

    /// Wait until every id in `ids` was handled somewhere (or panic with the
    /// logs after `timeout`); returns the report at that moment.
    pub fn wait_handled(&self, ids: &[String], timeout: Duration) -> Report {
        self.try_wait_handled(ids, timeout)
            .unwrap_or_else(|why| panic!("{why}"))
    }

    /// [`Cluster::wait_handled`], with the timeout as an error: how many
    /// were never handled, then every node's log.
    pub fn try_wait_handled(&self, ids: &[String], timeout: Duration) -> Result<Report, String> {
        let start = Instant::now();
        loop {
            let report = self.report();
            let handled = report.handled();
            let missing = ids.iter().filter(|id| !handled.contains(id.as_str())).count();
            if missing == 0 {
                return Ok(report);
            }
            if start.elapsed() > timeout {
                let logs: Vec<String> = self
                    .nodes
                    .iter()
                    .map(|n| format!("--- {}:\n{}", n.name, n.log()))
                    .collect();
                return Err(format!(
                    "timed out after {timeout:?}: {missing} of {} messages never handled\n{}",
                    ids.len(),
                    logs.join("\n")
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The TOML of a cluster node: the faulty guest (types `ok` and `slow`) on
/// one topology of `slots` slots, on transport `kind` at `url` with
/// `prefetch`, and `cluster` as the body of its `[cluster]` section.
pub fn node_config(
    node: &str,
    kind: &str,
    url: &str,
    prefetch: u32,
    cluster: &str,
    topology: &str,
    slots: u32,
) -> String {
    format!(
        r#"
[node]
name = "{node}"
[transport]
kind = "{kind}"
url = "{url}"
prefetch = {prefetch}
[cluster]
{cluster}
[[topology]]
name = "{topology}"
slots = {slots}
max_concurrent_groups = 16
[[handler]]
name = "faulty"
component = "{component}"
topology = "{topology}"
message_types = ["ok", "slow"]
"#,
        component = weir::node::bundled::FAULTY_PATH,
    )
}

/// `cluster` body of a `static` node owning `owned`.
pub fn static_mode(owned: &[u32]) -> String {
    format!("mode = \"static\"\nowned_slots = {owned:?}")
}

/// `groups` × `per_group` messages of type `slow` (payload: ms of CPU), one
/// message of every group per round.
pub fn messages(groups: usize, per_group: usize, ms: u32) -> Vec<Envelope> {
    let mut out = Vec::new();
    for _ in 0..per_group {
        for g in 0..groups {
            out.push(super::message(
                "slow",
                Some(&format!("g{g}")),
                ms.to_string().as_bytes(),
            ));
        }
    }
    out
}

/// The messages' ids.
pub fn ids(msgs: &[Envelope]) -> Vec<String> {
    msgs.iter().map(|m| m.id.clone()).collect()
}

/// Publish `msgs` with a transport of the test's own (made by `connect`,
/// inside a runtime of this call); `slot_of` picks each message's slot.
pub fn publish<T: Transport>(
    connect: impl FnOnce() -> T,
    topology: &str,
    msgs: &[Envelope],
    slot_of: impl Fn(&Envelope) -> u32,
) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let t = connect();
        for m in msgs {
            super::publish_confirmed(&t, topology, slot_of(m), m).await;
        }
    });
}

/// The first overlaps of a report, for a failure message.
pub fn describe(r: &Report) -> String {
    let first: Vec<String> = r
        .overlaps
        .iter()
        .take(5)
        .map(|o| {
            format!(
                "group {}: {} on {} [{}..{}] and {} on {} [{}..{}]",
                o.group,
                o.first.id,
                o.first.node,
                o.first.start,
                o.first.end,
                o.second.id,
                o.second.node,
                o.second.start,
                o.second.end
            )
        })
        .collect();
    format!("{} overlaps, first: {first:#?}", r.overlaps.len())
}

/// The compliance assertions over a `static` cluster of three `weir run`
/// processes, `node-0..2`, that own a third of `slots` each (node `i` the
/// consecutive slots `i * slots / 3 ..`). `config(node, owned)` is a node's
/// TOML; `publish` sends the messages to the right slots. 60 groups × 10
/// messages of 2 ms: no overlap across the journals, everything handled,
/// each group only on its slot's owner, every slot and node used, every
/// node alive at the end and exiting 0 on SIGTERM.
pub fn static_cluster_of_three(slots: u32, config: impl Fn(&str, &[u32]) -> String, publish: impl FnOnce(&[Envelope])) {
    assert_eq!(slots % 3, 0, "three equal shares");
    let per = slots / 3;
    let mut cluster = Cluster::default();
    for i in 0..3 {
        let owned: Vec<u32> = (i * per..(i + 1) * per).collect();
        let name = format!("node-{i}");
        cluster.start(&name, &config(&name, &owned));
    }
    // Every slot gets groups, every node holds several lanes at once.
    let msgs = messages(60, 10, 2);
    publish(&msgs);
    let report = cluster.wait_handled(&ids(&msgs), Duration::from_secs(120));

    assert!(report.overlaps.is_empty(), "{}", describe(&report));
    // Groups never straddle slots or owners: each group ran on exactly the
    // node that owns its slot.
    let owner_of = |slot: u32| format!("node-{}", slot / per);
    for (group, nodes) in report.nodes_per_group() {
        let slot = partition::slot_for(Some(group), "", slots);
        assert_eq!(
            nodes,
            HashSet::from([owner_of(slot).as_str()]),
            "group {group} (slot {slot}) ran on {nodes:?}"
        );
    }
    let used: HashSet<u32> = report
        .calls
        .iter()
        .filter_map(|c| c.group.as_deref())
        .map(|g| partition::slot_for(Some(g), "", slots))
        .collect();
    assert_eq!(used.len(), slots as usize, "every slot used: {used:?}");
    assert_eq!(report.nodes().len(), 3, "every node did work: {:?}", report.nodes());
    // Ownership still held at the end: every node is alive and drains cleanly.
    for n in &mut cluster.nodes {
        assert!(n.alive(), "{} died during the run; log:\n{}", n.name, n.log());
    }
    for n in &mut cluster.nodes {
        n.terminate(Duration::from_secs(30));
    }
}

/// The red baseline of [`static_cluster_of_three`]: three nodes that each
/// consume every one of `slots` (`config(node, every_slot)`, started with
/// `env`), on a broker that hands one slot's messages to all of them. 3
/// groups × 12 messages of 40 ms, routed right: a group must reach several
/// nodes and the journals must report overlaps.
pub fn nodes_sharing_every_slot_overlap(
    slots: u32,
    env: &[(&str, &str)],
    config: impl Fn(&str, &[u32]) -> String,
    publish: impl FnOnce(&[Envelope]),
) {
    let mut cluster = Cluster::default();
    let every: Vec<u32> = (0..slots).collect();
    for i in 0..3 {
        let name = format!("node-{i}");
        cluster.start_with_env(&name, &config(&name, &every), env);
    }
    let msgs = messages(3, 12, 40);
    publish(&msgs);
    let report = cluster.wait_handled(&ids(&msgs), Duration::from_secs(120));
    assert!(
        report.nodes_per_group().values().any(|n| n.len() > 1),
        "with every node on every slot a group must reach several nodes"
    );
    assert!(!report.overlaps.is_empty(), "the ledger saw no overlap: it is blind");
    for n in &mut cluster.nodes {
        n.terminate(Duration::from_secs(30));
    }
}
