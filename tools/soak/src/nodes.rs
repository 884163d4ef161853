//! The `weir run` processes of a soak: each gets its own config file and
//! log file in the run directory, and its own fault proxies: one to the
//! broker, and in `postgres` mode one to PostgreSQL (in `nats-kv` mode the
//! coordinator's connection goes to the broker, through the same proxy). Stopped with SIGTERM (drain) or SIGKILL
//! (crash); whatever still runs when the set is dropped is killed.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;

use crate::proxy::Proxy;

/// How long a node may take to log `node started`.
const START_TIMEOUT: Duration = Duration::from_secs(90);

/// A cluster's coordination store.
#[derive(Debug, Clone)]
pub enum Store {
    /// `cluster.mode = "postgres"`: the database URL with `{port}` where the proxy's port goes.
    Postgres { database_url: String },
    /// `cluster.mode = "nats-kv"`: the bucket, on the broker.
    NatsKv { bucket: String },
}

/// What a node's config needs to know, apart from its name and proxies.
#[derive(Debug, Clone)]
pub struct Template {
    /// `weir` binary.
    pub weir: PathBuf,
    /// Component of the soak handler (the faulty test guest).
    pub component: PathBuf,
    /// `rabbitmq` or `nats`.
    pub kind: &'static str,
    /// Broker URL with `{port}` where the proxy's port goes.
    pub broker_url: String,
    /// Where the cluster coordinates.
    pub store: Store,
    /// The coordinator lease.
    pub lease: Duration,
    /// Topology name.
    pub topology: String,
    /// Slots.
    pub slots: u32,
    /// `transport.prefetch`.
    pub prefetch: u32,
    /// `topology.retry.max_deliver`.
    pub max_deliver: i64,
    /// `handler.dedup.window` of the soak handler.
    pub dedup: Option<Duration>,
    /// Extra environment of every process (negative controls).
    pub env: Vec<(String, String)>,
    /// Run directory.
    pub dir: PathBuf,
}

impl Template {
    /// The TOML of node `name` whose broker goes through port `broker`, and
    /// its database (`postgres` mode) through port `db`.
    pub fn config(&self, name: &str, broker: u16, db: u16) -> String {
        let cluster = match &self.store {
            Store::Postgres { database_url } => format!(
                "mode = \"postgres\"\ndatabase_url = \"{}\"",
                database_url.replace("{port}", &db.to_string())
            ),
            Store::NatsKv { bucket } => format!("mode = \"nats-kv\"\nbucket = \"{bucket}\""),
        };
        format!(
            r#"# weir-soak node {name}: broker via proxy port {broker}
[node]
name = "{name}"
[transport]
kind = "{kind}"
url = "{broker_url}"
prefetch = {prefetch}
[cluster]
{cluster}
lease = "{lease}ms"
[[topology]]
name = "{topology}"
slots = {slots}
max_concurrent_groups = 64
[topology.retry]
ladder = ["1s"]
max_deliver = {max_deliver}
[[handler]]
name = "soak"
component = "{component}"
topology = "{topology}"
message_types = ["soak.call", "soak.interval"]
limits = {{ timeout = "60s" }}
config = {{ node = "{name}" }}
{dedup}"#,
            kind = self.kind,
            broker_url = self.broker_url.replace("{port}", &broker.to_string()),
            prefetch = self.prefetch,
            lease = self.lease.as_millis(),
            topology = self.topology,
            slots = self.slots,
            max_deliver = self.max_deliver,
            component = self.component.display(),
            dedup = self
                .dedup
                .map(|w| format!("dedup = {{ window = \"{}ms\" }}\n", w.as_millis()))
                .unwrap_or_default(),
        )
    }
}

/// One `weir run` process and its proxies.
pub struct Node {
    /// Its `[node] name` (unique per process in a run).
    pub name: String,
    child: Option<Child>,
    /// Its log file.
    pub log: PathBuf,
    /// The proxy to the broker.
    pub broker: Proxy,
    /// The proxy to PostgreSQL (`postgres` mode).
    db: Option<Proxy>,
}

impl Node {
    /// Start node `name`: proxies, config, process; wait (bounded) for `node started`.
    pub async fn start(t: &Template, name: &str, broker: SocketAddr, db: SocketAddr) -> anyhow::Result<Self> {
        let broker = Proxy::start(broker).await?;
        let db = match t.store {
            Store::Postgres { .. } => Some(Proxy::start(db).await?),
            Store::NatsKv { .. } => None,
        };
        let config = t.dir.join(format!("{name}.toml"));
        std::fs::write(&config, t.config(name, broker.port, db.as_ref().map_or(0, |p| p.port)))
            .with_context(|| format!("writing {}", config.display()))?;
        let log = t.dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out
            .try_clone()
            .with_context(|| format!("opening {} twice", log.display()))?;
        let child = Command::new(&t.weir)
            .args(["run", "--config"])
            .arg(&config)
            .env("RUST_LOG", "warn,weir=info")
            .env("NO_COLOR", "1")
            .envs(t.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {} run --config {}", t.weir.display(), config.display()))?;
        let mut node = Self {
            name: name.to_owned(),
            child: Some(child),
            log,
            broker,
            db,
        };
        let start = Instant::now();
        loop {
            if log_contains(&node.log, "node started") {
                return Ok(node);
            }
            if !node.alive() {
                anyhow::bail!("{name} exited during start; see {}", node.log.display());
            }
            if start.elapsed() > START_TIMEOUT {
                node.kill().await;
                anyhow::bail!(
                    "{name} did not log `node started` within {START_TIMEOUT:?}; see {}",
                    node.log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The proxy its coordinator's connections go through: PostgreSQL's in
    /// `postgres` mode, the broker's in `nats-kv` mode.
    pub fn store(&self) -> &Proxy {
        self.db.as_ref().unwrap_or(&self.broker)
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// True while the process runs.
    pub fn alive(&mut self) -> bool {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => true,
            Some(Ok(Some(_)) | Err(_)) => {
                self.child = None;
                false
            }
            None => false,
        }
    }

    fn signal(&self, sig: i32) {
        if let Some(pid) = self.pid().and_then(|p| i32::try_from(p).ok()) {
            // SAFETY: kill(2) on the pid of our own child, which we have not reaped yet.
            unsafe { libc::kill(pid, sig) };
        }
    }

    /// SIGKILL and reap.
    pub async fn kill(&mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.wait(Duration::from_secs(10)).await;
    }

    /// SIGTERM and wait up to `timeout` for the exit; `Some(status)` when it
    /// exited, `None` when it did not (the caller decides: kill it).
    pub async fn terminate(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        self.signal(libc::SIGTERM);
        self.wait(timeout).await
    }

    async fn wait(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        loop {
            let child = self.child.as_mut()?;
            match child.try_wait() {
                Ok(Some(status)) => {
                    self.child = None;
                    return Some(status);
                }
                Ok(None) if start.elapsed() < timeout => tokio::time::sleep(Duration::from_millis(20)).await,
                Ok(None) | Err(_) => return None,
            }
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// True when the file at `path` contains `needle` (read whole; used during
/// start only, while the log is short).
fn log_contains(path: &Path, needle: &str) -> bool {
    std::fs::read_to_string(path).is_ok_and(|s| s.contains(needle))
}
