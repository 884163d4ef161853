//! Clusters of real `weir run` processes for the multi-node tests: each node
//! gets its own config file, log file and journal (the cross-process ledger,
//! `weir::journal`) in one scratch directory. Nodes are stopped with SIGTERM
//! (drain) or SIGKILL (crash); any node still running when the cluster is
//! dropped is killed, so a failing test leaves no process behind.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use weir::journal::{self, Report};

const WEIR: &str = env!("CARGO_BIN_EXE_weir");

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

    /// SIGKILL: a crash, nothing drained.
    pub fn kill(&mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.wait(Duration::from_secs(10));
    }

    fn wait(&mut self, timeout: Duration) -> std::process::ExitStatus {
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
        let child = Command::new(WEIR)
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
        let start = Instant::now();
        loop {
            let report = self.report();
            let handled = report.handled();
            let missing = ids.iter().filter(|id| !handled.contains(id.as_str())).count();
            if missing == 0 {
                return report;
            }
            if start.elapsed() > timeout {
                let logs: Vec<String> = self
                    .nodes
                    .iter()
                    .map(|n| format!("--- {}:\n{}", n.name, n.log()))
                    .collect();
                panic!(
                    "timed out after {timeout:?}: {missing} of {} messages never handled\n{}",
                    ids.len(),
                    logs.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
