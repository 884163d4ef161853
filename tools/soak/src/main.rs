//! `weir-soak`: a chaos soak of a cluster of real `weir run` processes on
//! RabbitMQ or NATS, coordinated in `postgres` or `nats-kv` mode, with a
//! ledger of its own.
//!
//! It starts three nodes (each behind a fault proxy to the broker and, in
//! `postgres` mode, one to PostgreSQL), publishes `soak.call` messages at a steady rate over a set
//! of groups (call durations mostly short, some up to seconds, so faults
//! land mid-call with messages queued behind), and injects seeded, random
//! faults one at a time: kill -9 and restart, SIGTERM and restart, scale up
//! and down (2–4 nodes), a node's broker connections cut, a node's coordination
//! stalled (bytes held, shorter or longer than the lease: the latter must
//! fence), and a coordination outage (every node's coordination connections
//! cut: the shared server is not restarted, other work uses it). In
//! `nats-kv` mode the coordinator talks to the broker, so its stalls and
//! outages hold or cut the node's NATS connections, streams and bucket alike. The guest
//! reports each successful call's wall-clock interval as a cascade that the
//! soak reads off the broker itself; at the end it reads the dead letters
//! and prints published, handled, lost, intra-group overlaps, duplicates,
//! falsely dead-lettered, stuck slots and the longest time a slot was
//! without an owner. Exit 0 only when nothing was lost, no group
//! overlapped, nothing was dead-lettered and no slot was stuck; 1 when one
//! of those happened; 2 when the soak itself could not run.

mod broker;
mod bucket;
mod db;
mod ledger;
mod nodes;
mod proxy;
mod slots;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::{SocketAddr, ToSocketAddrs as _};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};

use broker::Broker;
use ledger::{DeadLetter, Ledger, Published};
use nodes::{Node, Store, Template};

/// How long a SIGTERMed node may take to drain and exit before it counts as
/// hung and is killed.
const TERM_TIMEOUT: Duration = Duration::from_secs(60);
/// Fewest and most nodes while faults run.
const MIN_NODES: usize = 2;
const MAX_NODES: usize = 4;

/// A chaos soak of a Weir cluster (see the module docs).
#[derive(Parser, Debug)]
#[command(name = "weir-soak", version, about)]
struct Args {
    /// How long faults are injected and messages published (then a quiet period).
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// The broker.
    #[arg(long, value_enum, default_value_t = BrokerKind::Rabbitmq)]
    broker: BrokerKind,
    /// `cluster.mode` of the nodes (`nats-kv` needs `--broker nats`).
    #[arg(long, value_enum, default_value_t = ClusterKind::Postgres)]
    cluster: ClusterKind,
    /// Seed of the fault schedule and the publisher (printed; random when absent).
    #[arg(long)]
    seed: Option<u64>,
    /// Messages published per second (with `--burst N`, bursts per second).
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    /// Messages published back to back to one group at each tick, so that a
    /// lane's job holds many of them and calls finished early in a job wait
    /// for their acks behind the rest (the profile where `handler.dedup`
    /// has the most second calls to remove under kill -9).
    #[arg(long, default_value_t = 1)]
    burst: u32,
    /// Groups the messages are spread over (tenant `t0`/`t1` by group).
    #[arg(long, default_value_t = 16)]
    groups: u32,
    /// Slots of the topology.
    #[arg(long, default_value_t = 6)]
    slots: u32,
    /// The coordinator lease (`cluster.lease`).
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    lease: Duration,
    /// Shortest and longest ordinary call, ms (`MIN..MAX`).
    #[arg(long, default_value = "1..20", value_parser = parse_range)]
    short_ms: (u64, u64),
    /// Shortest and longest long call, ms (`MIN..MAX`).
    #[arg(long, default_value = "500..4000", value_parser = parse_range)]
    long_ms: (u64, u64),
    /// Share of long calls (0..1).
    #[arg(long, default_value_t = 0.02)]
    long_share: f64,
    /// Long calls sleep instead of spinning: no CPU, so many can run on a
    /// small machine, but a fence cannot interrupt them (use it for the
    /// negative control, not to judge fencing).
    #[arg(long)]
    sleep_calls: bool,
    /// Nodes at the start.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// `transport.prefetch` of every node.
    #[arg(long, default_value_t = 32)]
    prefetch: u32,
    /// `topology.retry.max_deliver` (the ladder is `["1s"]`).
    #[arg(long, default_value_t = 5)]
    max_deliver: i64,
    /// The faults to draw from (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    faults: Vec<FaultKind>,
    /// Pause between faults, seconds (`MIN..MAX`).
    #[arg(long, default_value = "1..4", value_parser = parse_range)]
    fault_gap: (u64, u64),
    /// Longest wait after the last publish for every message to be handled or dead-lettered.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    quiet: Duration,
    /// Publish to the topology's ingress (the nodes forward each message to
    /// its slot) instead of straight to the slots.
    #[arg(long)]
    ingress: bool,
    /// Progress line period on stderr.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    progress: Duration,
    /// The `weir` binary (default: `weir` next to this executable).
    #[arg(long)]
    weir: Option<PathBuf>,
    /// The soak handler component (default: the faulty test guest this binary was built with).
    #[arg(long)]
    component: Option<PathBuf>,
    /// Run directory for configs, logs and the summary (default: a new one under the temp dir).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// RabbitMQ URL (loopback only).
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    amqp_url: String,
    /// NATS URL (loopback only).
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// PostgreSQL server URL without a database (loopback only).
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432")]
    pg_url: String,
    /// `handler.dedup.window` of the soak handler (absent: no dedup), to
    /// measure how many second calls the faults cost with and without it.
    #[arg(long, value_parser = humantime::parse_duration)]
    dedup: Option<Duration>,
    /// A red baseline: `no-drain` gives slots up before their drain
    /// (`WEIR_NEGATIVE_CONTROL_NO_DRAIN=1`; on RabbitMQ also slot queues
    /// without single active consumer, which would hide it). Must report overlaps.
    #[arg(long, value_enum)]
    negative_control: Option<NegativeControl>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BrokerKind {
    Rabbitmq,
    Nats,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ClusterKind {
    Postgres,
    NatsKv,
}

impl ClusterKind {
    fn name(self) -> &'static str {
        match self {
            Self::Postgres => "postgres",
            Self::NatsKv => "nats-kv",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum NegativeControl {
    NoDrain,
}

/// The faults the schedule draws from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
enum FaultKind {
    /// SIGKILL a node, start a new one after a moment.
    #[value(name = "kill-9")]
    Kill9,
    /// SIGTERM a node, wait for its exit, start a new one.
    #[value(name = "sigterm-restart")]
    TermRestart,
    /// Start one more node (up to four).
    ScaleUp,
    /// SIGTERM a node for good (down to two).
    ScaleDown,
    /// Cut one node's broker connections for 0.5–5 s.
    BrokerCut,
    /// Hold one node's coordination bytes (PostgreSQL's, or in `nats-kv`
    /// mode all its NATS bytes) for 0.2–0.6 or 1.2–2.5 leases.
    #[value(name = "db-stall", alias = "kv-stall")]
    StoreStall,
    /// Cut every node's coordination connections for 0.5–2 leases.
    #[value(name = "db-outage", alias = "kv-outage")]
    StoreOutage,
}

impl FaultKind {
    const ALL: [Self; 7] = [
        Self::Kill9,
        Self::TermRestart,
        Self::ScaleUp,
        Self::ScaleDown,
        Self::BrokerCut,
        Self::StoreStall,
        Self::StoreOutage,
    ];

    /// Its name in a `cluster` soak (the coordination faults name their store).
    fn name(self, cluster: ClusterKind) -> &'static str {
        match (self, cluster) {
            (Self::Kill9, _) => "kill-9",
            (Self::TermRestart, _) => "sigterm-restart",
            (Self::ScaleUp, _) => "scale-up",
            (Self::ScaleDown, _) => "scale-down",
            (Self::BrokerCut, _) => "broker-cut",
            (Self::StoreStall, ClusterKind::Postgres) => "db-stall",
            (Self::StoreOutage, ClusterKind::Postgres) => "db-outage",
            (Self::StoreStall, ClusterKind::NatsKv) => "kv-stall",
            (Self::StoreOutage, ClusterKind::NatsKv) => "kv-outage",
        }
    }

    /// Whether the fault may spend a delivery of a message that never
    /// failed: a crash (what the node held is redelivered), a broker cut
    /// (JetStream redelivers after AckWait without the in-progress signal),
    /// a fence (its interrupted calls are retried).
    fn spends_deliveries(self) -> bool {
        matches!(
            self,
            Self::Kill9 | Self::BrokerCut | Self::StoreStall | Self::StoreOutage
        )
    }

    /// The preconditions: one node always stays healthy, and a fault that
    /// may spend deliveries only while every outstanding message has
    /// deliveries to spare (`exposure`: such faults it has seen; two of
    /// `max_deliver` are kept back, one of them Weir's capture reserve).
    fn allowed(self, nodes: usize, exposure: u32, max_deliver: i64) -> bool {
        if self.spends_deliveries() && max_deliver > 0 && i64::from(exposure) + 2 >= max_deliver {
            return false;
        }
        match self {
            Self::Kill9 | Self::TermRestart | Self::BrokerCut | Self::StoreStall => nodes >= MIN_NODES,
            Self::ScaleUp => nodes < MAX_NODES,
            Self::ScaleDown => nodes > MIN_NODES,
            Self::StoreOutage => nodes >= 1,
        }
    }
}

/// Now, in ns since the Unix epoch (the ledger's clock).
fn wall_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

fn parse_range(s: &str) -> Result<(u64, u64), String> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("{s:?} is not a range; expected MIN..MAX, e.g. 300..2000"))?;
    let a: u64 = a.trim().parse().map_err(|e| format!("{a:?} in {s:?}: {e}"))?;
    let b: u64 = b.trim().parse().map_err(|e| format!("{b:?} in {s:?}: {e}"))?;
    if a > b {
        return Err(format!("{s:?}: MIN is above MAX"));
    }
    Ok((a, b))
}

fn main() -> ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("weir-soak: cannot start a tokio runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match rt.block_on(run(args)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("weir-soak: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// A URL on a loopback host: the address it names, and the URL with its
/// host and port replaced by `127.0.0.1:{port}` (filled in per proxy).
fn loopback(url: &str, default_port: u16, what: &str) -> anyhow::Result<(SocketAddr, String)> {
    let scheme_end = url
        .find("://")
        .map(|i| i + 3)
        .with_context(|| format!("{what} {url:?} has no scheme (expected e.g. scheme://host:port)"))?;
    let rest = &url[scheme_end..];
    let auth_end = rest.find('/').unwrap_or(rest.len());
    let authority = &rest[..auth_end];
    let (userinfo, hostport) = match authority.rfind('@') {
        Some(i) => (&authority[..=i], &authority[i + 1..]),
        None => ("", authority),
    };
    let with_port = if hostport.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) {
        hostport.to_owned()
    } else {
        format!("{hostport}:{default_port}")
    };
    let addr = with_port
        .to_socket_addrs()
        .with_context(|| format!("{what}: resolving {with_port:?}"))?
        .find(|a| a.ip().is_loopback())
        .with_context(|| format!("{what} {hostport:?} is not a loopback address; the soak only uses 127.0.0.1/::1"))?;
    let template = format!(
        "{}{userinfo}127.0.0.1:{{port}}{}",
        &url[..scheme_end],
        &rest[auth_end..]
    );
    Ok((addr, template))
}

/// What the progress line shows.
#[derive(Default)]
struct Status {
    nodes: Vec<String>,
    faults: usize,
    last: String,
}

/// Writes a timestamped line to stderr and the run's `events.log`.
struct Events {
    t0: Instant,
    file: Mutex<std::fs::File>,
}

impl Events {
    fn say(&self, text: &str) {
        let line = format!("[{:7.1}s] {text}", self.t0.elapsed().as_secs_f64());
        eprintln!("weir-soak {line}");
        let _ = writeln!(self.file.lock(), "{line}");
    }
}

/// The faults and the nodes they act on.
struct Chaos {
    rng: StdRng,
    nodes: Vec<Node>,
    next: u32,
    template: Template,
    cluster: ClusterKind,
    broker_addr: SocketAddr,
    db_addr: SocketAddr,
    lease: Duration,
    counts: BTreeMap<&'static str, usize>,
    /// Nodes that did not exit within [`TERM_TIMEOUT`] of SIGTERM.
    hung: Vec<String>,
    /// Nodes that exited non-zero after SIGTERM.
    failed_exits: Vec<String>,
    /// Nodes that could not be started.
    start_failures: Vec<String>,
    slots: Arc<Mutex<slots::Slots>>,
    status: Arc<Mutex<Status>>,
    events: Arc<Events>,
    ledger: Arc<Mutex<Ledger>>,
    /// Calls at least this long are "long": faults prefer their owners.
    long_min: u64,
    /// `topology.retry.max_deliver`.
    max_deliver: i64,
    /// Faults skipped because a message had no deliveries to spare.
    held_back: usize,
}

impl Chaos {
    fn update_status(&self) {
        self.status.lock().nodes = self.nodes.iter().map(|n| n.name.clone()).collect();
    }

    async fn start_node(&mut self) -> anyhow::Result<()> {
        let name = format!("n{}", self.next);
        self.next += 1;
        match Node::start(&self.template, &name, self.broker_addr, self.db_addr).await {
            Ok(n) => {
                self.events
                    .say(&format!("{name} started (pid {})", n.pid().unwrap_or(0)));
                self.nodes.push(n);
                self.update_status();
                Ok(())
            }
            Err(e) => {
                self.events.say(&format!("{name} failed to start: {e:#}"));
                self.start_failures.push(name);
                if self.nodes.is_empty() {
                    return Err(e.context("no node is running and a new one does not start"));
                }
                Ok(())
            }
        }
    }

    /// SIGTERM node `i` and wait (bounded); a hung node is killed and recorded.
    async fn terminate(&mut self, i: usize) {
        let mut node = self.nodes.remove(i);
        self.update_status();
        let started = Instant::now();
        match node.terminate(TERM_TIMEOUT).await {
            Some(status) if status.success() => self.events.say(&format!(
                "{} exited after SIGTERM in {:.1}s",
                node.name,
                started.elapsed().as_secs_f64()
            )),
            Some(status) => {
                self.events.say(&format!(
                    "{} exited with {status} after SIGTERM; see {}",
                    node.name,
                    node.log.display()
                ));
                self.failed_exits.push(node.name.clone());
            }
            None => {
                self.events.say(&format!(
                    "{} did not exit within {TERM_TIMEOUT:?} of SIGTERM: killed; see {}",
                    node.name,
                    node.log.display()
                ));
                self.hung.push(node.name.clone());
                node.kill().await;
            }
        }
    }

    /// The node a fault acts on: three times in four the owner of a slot
    /// with a long call running or queued (so the fault lands mid-call with
    /// messages behind it), else any node.
    fn pick_node(&mut self) -> usize {
        if self.rng.random_bool(0.75) {
            let long = self.ledger.lock().long_outstanding(self.long_min);
            let owners = self.slots.lock().owners.clone();
            let targets: Vec<usize> = self
                .nodes
                .iter()
                .enumerate()
                .filter(|(_, n)| long.iter().any(|s| owners.get(s) == Some(&n.name)))
                .map(|(i, _)| i)
                .collect();
            if !targets.is_empty() {
                return targets[self.rng.random_range(0..targets.len())];
            }
        }
        self.rng.random_range(0..self.nodes.len())
    }

    fn secs(&mut self, lo: f64, hi: f64) -> Duration {
        Duration::from_secs_f64(self.rng.random_range(lo..=hi))
    }

    /// One fault from `kinds` whose precondition holds; returns when it is over.
    async fn step(&mut self, kinds: &[FaultKind]) -> anyhow::Result<()> {
        // Drop nodes that died on their own (recorded as such).
        let mut i = 0;
        while i < self.nodes.len() {
            if self.nodes[i].alive() {
                i += 1;
            } else {
                let n = self.nodes.remove(i);
                self.events
                    .say(&format!("{} exited on its own; see {}", n.name, n.log.display()));
                self.failed_exits.push(n.name.clone());
            }
        }
        if self.nodes.len() < MIN_NODES {
            return self.start_node().await;
        }
        let exposure = self.ledger.lock().max_exposure();
        let allowed: Vec<FaultKind> = kinds
            .iter()
            .copied()
            .filter(|k| k.allowed(self.nodes.len(), exposure, self.max_deliver))
            .collect();
        if allowed.len() < kinds.iter().filter(|k| k.allowed(self.nodes.len(), 0, 0)).count() {
            self.held_back += 1;
        }
        if allowed.is_empty() {
            return Ok(());
        }
        let kind = allowed[self.rng.random_range(0..allowed.len())];
        if kind.spends_deliveries() {
            self.ledger.lock().expose_outstanding();
        }
        let name = kind.name(self.cluster);
        *self.counts.entry(name).or_default() += 1;
        {
            let mut s = self.status.lock();
            s.faults += 1;
            s.last = name.to_owned();
        }
        let store = match self.cluster {
            ClusterKind::Postgres => "database",
            ClusterKind::NatsKv => "NATS (stream and bucket)",
        };
        let lease = self.lease.as_secs_f64();
        match kind {
            FaultKind::Kill9 => {
                let i = self.pick_node();
                let mut n = self.nodes.remove(i);
                self.update_status();
                self.events.say(&format!("fault kill-9 {}", n.name));
                n.kill().await;
                self.ledger.lock().kills.push(wall_ns());
                let pause = self.secs(0.2, 3.0);
                tokio::time::sleep(pause).await;
                self.start_node().await?;
            }
            FaultKind::TermRestart => {
                let i = self.pick_node();
                self.events
                    .say(&format!("fault sigterm-restart {}", self.nodes[i].name));
                self.terminate(i).await;
                self.start_node().await?;
            }
            FaultKind::ScaleUp => {
                self.events.say("fault scale-up");
                self.start_node().await?;
            }
            FaultKind::ScaleDown => {
                let i = self.pick_node();
                self.events.say(&format!("fault scale-down {}", self.nodes[i].name));
                self.terminate(i).await;
            }
            FaultKind::BrokerCut => {
                let i = self.pick_node();
                let d = self.secs(0.5, 5.0);
                self.events.say(&format!(
                    "fault broker-cut {} for {:.1}s",
                    self.nodes[i].name,
                    d.as_secs_f64()
                ));
                self.nodes[i].broker.cut();
                tokio::time::sleep(d).await;
                self.nodes[i].broker.restore();
            }
            FaultKind::StoreStall => {
                let i = self.pick_node();
                let long = self.rng.random_bool(0.5);
                let d = if long {
                    self.secs(1.2 * lease, 2.5 * lease)
                } else {
                    self.secs(0.2 * lease, 0.6 * lease)
                };
                self.events.say(&format!(
                    "fault {name} {} ({store} bytes held) for {:.1}s ({} than the lease{})",
                    self.nodes[i].name,
                    d.as_secs_f64(),
                    if long { "longer" } else { "shorter" },
                    if long { ": it must fence" } else { "" }
                ));
                self.nodes[i].store().stall();
                tokio::time::sleep(d).await;
                self.nodes[i].store().restore();
            }
            FaultKind::StoreOutage => {
                let d = self.secs(0.5 * lease, 2.0 * lease);
                self.events.say(&format!(
                    "fault {name}: every node's {store} connections cut for {:.1}s (slot clock paused)",
                    d.as_secs_f64()
                ));
                self.slots.lock().pause();
                for n in &self.nodes {
                    n.store().cut();
                }
                tokio::time::sleep(d).await;
                for n in &self.nodes {
                    n.store().restore();
                }
                self.slots.lock().resume();
            }
        }
        Ok(())
    }
}

/// The publisher's call-duration distribution.
#[derive(Debug, Clone, Copy)]
struct Calls {
    short: (u64, u64),
    long: (u64, u64),
    long_share: f64,
    sleep: bool,
}

#[allow(clippy::too_many_arguments, reason = "one task's inputs, spelled out")]
async fn publish_loop(
    broker: Arc<Broker>,
    ledger: Arc<Mutex<Ledger>>,
    topology: String,
    slots: u32,
    groups: u32,
    rate: f64,
    burst: u32,
    calls: Calls,
    seed: u64,
    ingress: bool,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x005e_ed0f_9ab1_15e5);
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !*stop.borrow() {
        tick.tick().await;
        let g = rng.random_range(0..groups);
        let group = format!("g{g}");
        let tenant = format!("t{}", g % 2);
        for _ in 0..burst {
            let long = rng.random_bool(calls.long_share);
            let ms = if long {
                rng.random_range(calls.long.0..=calls.long.1)
            } else {
                rng.random_range(calls.short.0..=calls.short.1)
            };
            let id = weir::envelope::fresh_id();
            let slot = weir::partition::slot_for(Some(&group), &id, slots);
            let body = if long && calls.sleep {
                format!("{ms} sleep")
            } else {
                ms.to_string()
            };
            let headers = [
                ("weir-message-id", id.as_str()),
                ("weir-message-type", "soak.call"),
                ("weir-group-id", group.as_str()),
                ("weir-tenant-id", tenant.as_str()),
                ("weir-attempt", "1"),
            ];
            let at = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            let mut confirmed = false;
            for _ in 0..5 {
                let sent = if ingress {
                    broker.publish_ingress(&topology, &headers, body.as_bytes()).await
                } else {
                    broker.publish(&topology, slot, &headers, body.as_bytes()).await
                };
                if sent.is_ok() {
                    confirmed = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let mut l = ledger.lock();
            if confirmed {
                l.published.insert(
                    id,
                    Published {
                        group: group.clone(),
                        ms,
                        slot,
                        exposure: 0,
                        at,
                    },
                );
            } else {
                l.unconfirmed.insert(id);
            }
        }
    }
}

fn progress_line(t: Duration, ledger: &Ledger, slots: &slots::Slots, status: &Status, total: u32) -> String {
    format!(
        "[{:7.1}s] published {} handled {} outstanding {} calls {} | nodes {} ({}) | slots owned {}/{total}, longest ownerless {:.1}s, stuck {} | faults {} (last {})",
        t.as_secs_f64(),
        ledger.published.len(),
        ledger.handled.len(),
        ledger.outstanding(),
        ledger.interval_count(),
        status.nodes.len(),
        status.nodes.join(" "),
        slots.owned,
        slots.longest.as_secs_f64(),
        slots.stuck.len(),
        status.faults,
        if status.last.is_empty() { "-" } else { &status.last },
    )
}

async fn run(args: Args) -> anyhow::Result<bool> {
    anyhow::ensure!(
        args.rate > 0.0 && args.rate <= 1000.0,
        "--rate {} is outside (0, 1000]",
        args.rate
    );
    anyhow::ensure!(args.groups >= 1, "--groups must be at least 1");
    anyhow::ensure!(args.burst >= 1, "--burst must be at least 1");
    anyhow::ensure!(
        (1..=1024).contains(&args.slots),
        "--slots {} is outside 1..=1024",
        args.slots
    );
    anyhow::ensure!(
        (0.0..=1.0).contains(&args.long_share),
        "--long-share {} is outside 0..1",
        args.long_share
    );
    anyhow::ensure!(
        (MIN_NODES..=MAX_NODES).contains(&args.nodes),
        "--nodes {} is outside {MIN_NODES}..={MAX_NODES}",
        args.nodes
    );
    anyhow::ensure!(
        args.lease >= Duration::from_millis(500),
        "--lease must be at least 500ms"
    );
    anyhow::ensure!(
        args.cluster != ClusterKind::NatsKv || args.broker == BrokerKind::Nats,
        "--cluster nats-kv coordinates on the NATS broker: it needs --broker nats"
    );
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let kinds: Vec<FaultKind> = if args.faults.is_empty() {
        FaultKind::ALL.to_vec()
    } else {
        args.faults.clone()
    };
    let weir = match &args.weir {
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .context("locating this executable (pass --weir PATH)")?
            .parent()
            .context("this executable has no directory (pass --weir PATH)")?
            .join("weir"),
    };
    anyhow::ensure!(
        weir.is_file(),
        "--weir {}: no such file (pass the weir binary)",
        weir.display()
    );
    let component = args
        .component
        .clone()
        .unwrap_or_else(|| PathBuf::from(weir::node::bundled::FAULTY_PATH));
    anyhow::ensure!(
        component.is_file(),
        "--component {}: no such file (the faulty test guest, built by host/build.rs)",
        component.display()
    );
    let broker_name = match args.broker {
        BrokerKind::Rabbitmq => "rabbitmq",
        BrokerKind::Nats => "nats",
    };
    let tag = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("weir-soak-{broker_name}-{seed}-{tag}")));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating the run directory {}", dir.display()))?;
    let events = Arc::new(Events {
        t0: Instant::now(),
        file: Mutex::new(
            std::fs::File::create(dir.join("events.log"))
                .with_context(|| format!("creating {}", dir.join("events.log").display()))?,
        ),
    });
    eprintln!(
        "weir-soak: seed {seed} (rerun with --seed {seed}); broker {broker_name}; cluster {}; run directory {}",
        args.cluster.name(),
        dir.display()
    );
    println!("run directory: {}", dir.display());

    let (broker_addr, broker_template, broker_url) = match args.broker {
        BrokerKind::Rabbitmq => {
            let (a, t) = loopback(&args.amqp_url, 5672, "--amqp-url")?;
            (a, t, args.amqp_url.clone())
        }
        BrokerKind::Nats => {
            let (a, t) = loopback(&args.nats_url, 4222, "--nats-url")?;
            (a, t, args.nats_url.clone())
        }
    };
    let (db_addr, db_template) = loopback(&args.pg_url, 5432, "--pg-url")?;
    let topology = format!("soak-{tag}");
    let store = match args.cluster {
        ClusterKind::Postgres => {
            let db_name = format!("weir_soak_{tag}");
            db::create(&args.pg_url, &db_name).await?;
            events.say(&format!("database {db_name} created; topology {topology}"));
            Store::Postgres {
                database_url: format!("{db_template}/{db_name}"),
            }
        }
        ClusterKind::NatsKv => {
            let bucket = format!("soak-{tag}");
            events.say(&format!(
                "bucket {bucket} (made by the first node); topology {topology}"
            ));
            Store::NatsKv { bucket }
        }
    };

    let mut env = Vec::new();
    if args.negative_control == Some(NegativeControl::NoDrain) {
        env.push((
            weir::cluster::leased::NEGATIVE_CONTROL_NO_DRAIN.to_owned(),
            "1".to_owned(),
        ));
        if args.broker == BrokerKind::Rabbitmq {
            env.push((
                weir::transport::rabbitmq::NEGATIVE_CONTROL_NO_SAC.to_owned(),
                "1".to_owned(),
            ));
        }
        events.say("NEGATIVE CONTROL no-drain: slots are given up before their drain; overlaps are expected");
    }
    let template = Template {
        weir,
        component,
        kind: broker_name,
        broker_url: broker_template,
        store: store.clone(),
        lease: args.lease,
        topology: topology.clone(),
        slots: args.slots,
        prefetch: args.prefetch,
        max_deliver: args.max_deliver,
        dedup: args.dedup,
        env,
        dir: dir.clone(),
    };
    // The topology's broker objects, for the cleanup (the nodes declare them).
    let spec = {
        let cfg = weir::config::parse(&template.config("spec", 1, 1), "the soak's node config")
            .map_err(|e| anyhow::anyhow!("the soak's own node config does not parse: {e}"))?;
        let t = cfg.topology.first().context("the soak's node config has no topology")?;
        let mut spec = weir::transport::TopologySpec::new(&topology, args.slots);
        spec.retry = t.retry_policy(cfg.transport.kind);
        spec
    };

    let outcome = soak(
        &args,
        seed,
        &kinds,
        template,
        broker_addr,
        db_addr,
        &broker_url,
        &topology,
        &dir,
        &events,
    )
    .await;

    // Cleanup, whatever happened.
    let cleanup = async {
        if let Ok(b) = connect(args.broker, &broker_url).await {
            for e in b.delete_topology(&spec).await {
                events.say(&format!("cleanup: {e}"));
            }
            b.close().await;
        }
        let dropped = match &store {
            Store::Postgres { .. } => db::drop(&args.pg_url, &format!("weir_soak_{tag}")).await,
            Store::NatsKv { bucket } => bucket::delete(&broker_url, bucket).await,
        };
        if let Err(e) = dropped {
            events.say(&format!("cleanup: {e:#}"));
        }
    };
    if tokio::time::timeout(Duration::from_secs(60), cleanup).await.is_err() {
        events.say("cleanup did not finish within 60s");
    }
    outcome
}

async fn connect(kind: BrokerKind, url: &str) -> anyhow::Result<Broker> {
    match kind {
        BrokerKind::Rabbitmq => Broker::rabbit(url).await,
        BrokerKind::Nats => Broker::nats(url).await,
    }
}

#[allow(clippy::too_many_arguments, reason = "the run's resolved inputs, spelled out")]
async fn soak(
    args: &Args,
    seed: u64,
    kinds: &[FaultKind],
    template: Template,
    broker_addr: SocketAddr,
    db_addr: SocketAddr,
    broker_url: &str,
    topology: &str,
    dir: &std::path::Path,
    events: &Arc<Events>,
) -> anyhow::Result<bool> {
    let slots = Arc::new(Mutex::new(slots::Slots::default()));
    let status = Arc::new(Mutex::new(Status::default()));
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let mut chaos = Chaos {
        rng: StdRng::seed_from_u64(seed),
        nodes: Vec::new(),
        next: 0,
        template,
        cluster: args.cluster,
        broker_addr,
        db_addr,
        lease: args.lease,
        counts: BTreeMap::new(),
        hung: Vec::new(),
        failed_exits: Vec::new(),
        start_failures: Vec::new(),
        slots: slots.clone(),
        status: status.clone(),
        events: events.clone(),
        ledger: ledger.clone(),
        long_min: args.long_ms.0,
        max_deliver: args.max_deliver,
        held_back: 0,
    };
    for _ in 0..args.nodes {
        chaos.start_node().await?;
    }
    anyhow::ensure!(
        !chaos.nodes.is_empty(),
        "no node started; see the logs in {}",
        dir.display()
    );

    // The soak's own view of the broker (the first node declared the topology).
    let broker = Arc::new(connect(args.broker, broker_url).await?);
    let observer = broker.observe(topology, args.slots, ledger.clone()).await?;

    // Every slot owned before the clock starts.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let threshold = args.lease + Duration::from_secs(1);
    let watcher = match &chaos.template.store {
        Store::Postgres { database_url } => {
            let (_, db) = database_url
                .rsplit_once('/')
                .context("the database URL names no database")?;
            tokio::spawn(db::watch(
                format!("{}/{db}", args.pg_url),
                topology.to_owned(),
                args.slots,
                threshold,
                slots.clone(),
                stop_rx.clone(),
            ))
        }
        Store::NatsKv { bucket } => tokio::spawn(bucket::watch(
            broker_url.to_owned(),
            bucket.clone(),
            args.lease,
            topology.to_owned(),
            args.slots,
            threshold,
            slots.clone(),
            stop_rx.clone(),
        )),
    };
    slots.lock().pause();
    let start = Instant::now();
    loop {
        if slots.lock().owned == args.slots as usize {
            break;
        }
        if start.elapsed() > Duration::from_secs(60) {
            anyhow::bail!(
                "the cluster did not own every slot within 60s of starting; see the logs in {}",
                dir.display()
            );
        }
        tokio::time::sleep(slots::POLL).await;
    }
    slots.lock().resume();
    events.say(&format!(
        "every slot owned; publishing and injecting faults for {:?}",
        args.duration
    ));

    let (pub_stop_tx, pub_stop_rx) = tokio::sync::watch::channel(false);
    let publisher = tokio::spawn(publish_loop(
        broker.clone(),
        ledger.clone(),
        topology.to_owned(),
        args.slots,
        args.groups,
        args.rate,
        args.burst,
        Calls {
            short: args.short_ms,
            long: args.long_ms,
            long_share: args.long_share,
            sleep: args.sleep_calls,
        },
        seed,
        args.ingress,
        pub_stop_rx,
    ));
    let progress = {
        let (ledger, slots, status) = (ledger.clone(), slots.clone(), status.clone());
        let (t0, period, total, mut stop) = (events.t0, args.progress, args.slots, stop_rx.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = tokio::time::sleep(period) => {}
                    _ = stop.changed() => return,
                }
                let line = progress_line(t0.elapsed(), &ledger.lock(), &slots.lock(), &status.lock(), total);
                eprintln!("weir-soak {line}");
            }
        })
    };

    let faults_start = Instant::now();
    let mut fault_error = None;
    while faults_start.elapsed() < args.duration {
        let gap = Duration::from_secs_f64(
            chaos
                .rng
                .random_range(args.fault_gap.0 as f64..=args.fault_gap.1 as f64),
        );
        let left = args.duration.saturating_sub(faults_start.elapsed());
        tokio::time::sleep(gap.min(left)).await;
        if faults_start.elapsed() >= args.duration {
            break;
        }
        if let Err(e) = chaos.step(kinds).await {
            fault_error = Some(e);
            break;
        }
    }
    let _ = pub_stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(30), publisher).await;
    events.say("faults and publishing stopped; quiet period");

    // Quiet: every proxy forwards; wait for each message to be handled or dead-lettered.
    for n in &chaos.nodes {
        n.broker.restore();
        n.store().restore();
    }
    let quiet_start = Instant::now();
    let min_quiet = args.lease * 2 + Duration::from_secs(2);
    loop {
        let outstanding = ledger.lock().outstanding() as u64;
        let dead = broker.dead_letter_depth(topology).await.unwrap_or(0);
        let elapsed = quiet_start.elapsed();
        if elapsed >= min_quiet && outstanding <= dead {
            break;
        }
        if elapsed >= args.quiet.max(min_quiet) {
            events.say(&format!(
                "quiet period over: {outstanding} messages still unhandled ({dead} dead letters)"
            ));
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(10), watcher).await;
    let _ = tokio::time::timeout(Duration::from_secs(10), progress).await;

    // Stop every node (drain), bounded; a hung one is killed.
    let mut stopping = Vec::new();
    while !chaos.nodes.is_empty() {
        stopping.push(chaos.nodes.remove(0));
    }
    let exits = futures::future::join_all(stopping.iter_mut().map(|n| async {
        let t = Instant::now();
        let s = n.terminate(TERM_TIMEOUT).await;
        (n.name.clone(), s, t.elapsed())
    }))
    .await;
    for (name, s, took) in exits {
        match s {
            Some(s) if s.success() => events.say(&format!("{name} exited after SIGTERM in {:.1}s", took.as_secs_f64())),
            Some(s) => {
                events.say(&format!("{name} exited with {s} after SIGTERM"));
                chaos.failed_exits.push(name);
            }
            None => {
                events.say(&format!(
                    "{name} did not exit within {TERM_TIMEOUT:?} of SIGTERM: killed"
                ));
                chaos.hung.push(name);
            }
        }
    }
    drop(stopping);
    // Cascades confirmed just before the exits reach the observer.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let backfilled = match broker.backfill(topology, &ledger).await {
        Ok(n) => n,
        Err(e) => {
            events.say(&format!("backfill from the stream failed: {e:#}"));
            0
        }
    };
    let dead: Vec<DeadLetter> = broker
        .dead_letters(topology)
        .await?
        .into_iter()
        .map(|m| DeadLetter {
            id: m.header("weir-message-id").unwrap_or("").to_owned(),
            message_type: m.header("weir-message-type").unwrap_or("").to_owned(),
            reason: m.header("weir-dead-letter-reason").unwrap_or("").to_owned(),
            error: m.header("weir-error").unwrap_or("").to_owned(),
        })
        .collect();
    observer.abort();
    if let Ok(b) = Arc::try_unwrap(broker) {
        b.close().await;
    }

    let l = ledger.lock();
    let v = l.verdict(&dead);
    let s = slots.lock();
    let stuck = s.stuck.len();
    let pass = v.lost.is_empty() && v.overlaps.is_empty() && v.dead_letters.is_empty() && stuck == 0 && v.handled > 0;
    let faults: Vec<String> = chaos.counts.iter().map(|(k, n)| format!("{k} {n}")).collect();
    let mut out = String::new();
    out.push_str(&format!(
        "weir-soak summary: broker {}, cluster {}, seed {seed}, {:?} of faults, {} nodes at the start, lease {:?}, rate {}/s{}, {} groups, {} slots, published to the {}{}\n",
        template_kind(args.broker),
        args.cluster.name(),
        args.duration,
        args.nodes,
        args.lease,
        args.rate,
        if args.burst > 1 { format!(" in bursts of {}", args.burst) } else { String::new() },
        args.groups,
        args.slots,
        if args.ingress { "ingress" } else { "slots" },
        match (args.negative_control.is_some(), args.dedup) {
            (true, _) => ", NEGATIVE CONTROL no-drain".to_owned(),
            (false, Some(w)) => format!(", dedup window {w:?}"),
            (false, None) => String::new(),
        }
    ));
    out.push_str(&format!("  published                      {}\n", v.published));
    out.push_str(&format!(
        "  handled                        {} ({} successful calls)\n",
        v.handled, v.calls
    ));
    if let Some(l) = v.latency {
        out.push_str(&format!(
            "  publish -> first call          p50 {:.3}s, p99 {:.3}s, max {:.3}s ({} messages)\n",
            l.p50, l.p99, l.max, l.count
        ));
    }
    if let Some(l) = v.after_kill {
        out.push_str(&format!(
            "    within {}s after a kill -9   p50 {:.3}s, p99 {:.3}s, max {:.3}s ({} messages)\n",
            ledger::AFTER_KILL.as_secs(),
            l.p50,
            l.p99,
            l.max,
            l.count
        ));
    }
    out.push_str(&format!("  lost                           {}\n", v.lost.len()));
    out.push_str(&format!("  intra-group overlaps           {}\n", v.overlaps.len()));
    out.push_str(&format!(
        "  duplicates                     {} (messages handled more than once; {} extra calls)\n",
        v.duplicates, v.extra_calls
    ));
    out.push_str(&format!(
        "  falsely dead-lettered          {} {:?}\n",
        v.dead_letters.len(),
        v.dead_reasons
    ));
    out.push_str(&format!(
        "  stuck slots                    {stuck} (without a live owner for more than {threshold:?})\n"
    ));
    out.push_str(&format!(
        "  longest slot without an owner  {:.2}s{}\n",
        s.longest.as_secs_f64(),
        s.longest_slot.map(|x| format!(" (slot {x})")).unwrap_or_default()
    ));
    out.push_str(&format!(
        "  longest slot in `releasing`    {:.2}s\n",
        s.longest_releasing.as_secs_f64()
    ));
    out.push_str(&format!(
        "  faults                         {} ({} draws held back a fault that could spend deliveries)\n",
        faults.join(", "),
        chaos.held_back
    ));
    out.push_str(&format!(
        "  nodes hung on SIGTERM          {} {:?}; exited non-zero {:?}; failed to start {:?}\n",
        chaos.hung.len(),
        chaos.hung,
        chaos.failed_exits,
        chaos.start_failures
    ));
    out.push_str(&format!(
        "  ledger                         {} calls seen, {} interval reports ({} only in the stream backfill), {} malformed, {} unconfirmed publishes ({} handled anyway){}\n",
        l.calls_seen,
        l.reports_seen,
        backfilled,
        v.malformed,
        v.unconfirmed,
        v.unconfirmed_handled,
        if l.observer_ended { "; the live observer's connection ENDED early" } else { "" }
    ));
    for o in v.overlaps.iter().take(10) {
        out.push_str(&format!("  overlap: {}\n", o.describe()));
    }
    for id in v.lost.iter().take(10) {
        let p = l.published.get(id);
        out.push_str(&format!(
            "  lost: {id} (group {}, {} ms)\n",
            p.map(|p| p.group.as_str()).unwrap_or("?"),
            p.map(|p| p.ms).unwrap_or(0)
        ));
    }
    for d in v.dead_letters.iter().take(10) {
        out.push_str(&format!(
            "  dead letter: {} ({}) reason {}: {}\n",
            d.id, d.message_type, d.reason, d.error
        ));
    }
    for (slot, d) in s.stuck.iter().take(10) {
        out.push_str(&format!(
            "  stuck: slot {slot} without an owner for {:.1}s at least\n",
            d.as_secs_f64()
        ));
    }
    if let Some(e) = &fault_error {
        out.push_str(&format!("  the fault loop stopped early: {e:#}\n"));
    }
    out.push_str(&format!("  run directory                  {}\n", dir.display()));
    out.push_str(if pass { "result: PASS\n" } else { "result: FAIL\n" });
    print!("{out}");
    let _ = std::fs::write(dir.join("summary.txt"), &out);
    let json = serde_json::json!({
        "broker": template_kind(args.broker),
        "cluster": args.cluster.name(),
        "seed": seed,
        "duration_s": args.duration.as_secs_f64(),
        "negative_control": args.negative_control.is_some(),
        "ingress": args.ingress,
        "first_call_p50_s": v.latency.map(|l| l.p50),
        "first_call_p99_s": v.latency.map(|l| l.p99),
        "first_call_max_s": v.latency.map(|l| l.max),
        "after_kill_first_call_p99_s": v.after_kill.map(|l| l.p99),
        "after_kill_first_call_max_s": v.after_kill.map(|l| l.max),
        "published": v.published,
        "handled": v.handled,
        "lost": v.lost.len(),
        "overlaps": v.overlaps.len(),
        "duplicates": v.duplicates,
        "falsely_dead_lettered": v.dead_letters.len(),
        "dead_letter_reasons": v.dead_reasons,
        "stuck_slots": stuck,
        "longest_ownerless_s": s.longest.as_secs_f64(),
        "longest_releasing_s": s.longest_releasing.as_secs_f64(),
        "faults": chaos.counts,
        "hung_on_sigterm": chaos.hung,
        "exited_non_zero": chaos.failed_exits,
        "pass": pass,
    });
    let _ = std::fs::write(dir.join("summary.json"), json.to_string());
    if let Some(e) = fault_error {
        return Err(e);
    }
    Ok(pass)
}

fn template_kind(b: BrokerKind) -> &'static str {
    match b {
        BrokerKind::Rabbitmq => "rabbitmq",
        BrokerKind::Nats => "nats",
    }
}
