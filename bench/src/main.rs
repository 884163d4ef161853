//! `weir-bench`: what one message costs the Weir host.
//!
//! Scenarios (pick one, a group, or `all`):
//!
//! * `bare-reuse`  — `Executor::call` in a loop on one thread, same engine
//!   config as a node, one prepared envelope, instance reused.
//! * `bare-fresh`  — the same with `InstanceMode::Fresh` (instantiate per call).
//! * `batch-1`, `batch-10`, `batch-100` — `Executor::call_batch` (reuse).
//! * `e2e-reuse`, `e2e-fresh` — a whole `Node` on a `MemoryBroker` with the
//!   bundled noop handler; N messages pre-published; wall time from the node
//!   being up until `Stats::handled` reaches N.
//! * `e2e-batch-1`, `e2e-batch-10`, `e2e-batch-100` — `e2e-reuse` with the
//!   message type configured as batched (`batch = { size, linger = 5ms }`), so
//!   every message goes through the lanes' batcher and `handle-batch`.
//!   Batches are per (tenant, group): a batch can only be as big as what one
//!   group has waiting inside the prefetch window, so pass few `--groups`
//!   and a large `--prefetch` to see large batches.
//!
//! * `rabbitmq-drain` — a backlog of N persistent messages on RabbitMQ
//!   (`--amqp URL`), drained by a bare lapin consumer (no-op, `multiple` ack
//!   every 128), by the same consumer calling the noop component inline
//!   through a plain wasmtime loop (`anchor.rs`), and by a Weir node with the
//!   noop guest, same prefetch, `--drain-runs` (5) interleaved runs; rows
//!   `rmq-bare`, `rmq-bare-wasm`, `rmq-weir`, and the medians of the per-run
//!   ratios. `--batch N` makes the Weir node deliver through `handle-batch`.
//! * `nats-drain` — the same on NATS JetStream (`--nats URL`): a backlog in
//!   the file-backed stream, drained by a bare async-nats pull consumer per
//!   slot (batches of 256, one explicit ack per message), with and without
//!   the inline Wasm call, and by a Weir node; rows `nats-bare`,
//!   `nats-bare-wasm`, `nats-weir`.
//! * `skew-zipf`, `skew-hot` — the memory broker, group ids Zipf-distributed
//!   (s = 1.1 over 10 000 groups; `skew-hot` sends a quarter of the messages
//!   to one hot group on top), the noop guest burning `--spin-us` (50) of CPU
//!   per message: throughput against the ideal, cores / work time.
//! * `rss-idle`, `rss-loaded` — resident memory of a node (in a child
//!   process): idle, and with 64 slots and 10 000 groups active.
//! * `latency` — publish-to-handled p50/p90/p99 at half the e2e-reuse peak;
//!   `latency-rabbitmq`, `latency-nats` the same at half that broker's Weir
//!   drain (20 000 msg/s when the run did not drain it).
//! * `payload-size` — `e2e-reuse` with 256 B, 16 KiB and 256 KiB payloads:
//!   ns per KiB and copies per payload byte (`payload.rs`).
//! * `instructions` — instructions per message by callgrind for `handle` and
//!   `handle-batch` of 100, default shape and full batches (`instructions.rs`;
//!   needs valgrind, runs this binary under it).
//!
//! Groups: `bare` (the five bare scenarios), `e2e` (the five e2e ones),
//! `all` (everything, brokers included; `--quick` for a smoke run).
//! Output: a table on stdout (each ratio against its anchor, with its
//! target), JSON in `target/bench/results.json` (`--out`), SVG charts in
//! `docs/bench/` (`--charts DIR`, `--no-charts`), one progress line per run
//! on stderr. A scenario that fails (a broker down) is reported and the
//! others still run; the exit status is then 1.
//! `weir-bench polyglot` compares the orders handler in Rust, Python and
//! JavaScript instead (see `polyglot.rs`); `weir-bench hostile` a good tenant's
//! throughput and the RSS next to each hostile guest of issue 15 (`hostile.rs`);
//! `weir-bench coordination` the PostgreSQL coordinator for many nodes in one
//! process against a real database (`coordination.rs`, issue 20 item 4);
//! `weir-bench dedup` what `handler.dedup` costs per message (`dedup.rs`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

use weir::config::{self, Config};
use weir::envelope::{self, Envelope};
use weir::node::{self, Node, NodeOptions};
use weir::runtime::{BatchOutcome, CallOutcome, Executor, HandlerSettings, InstanceMode, Runtime, RuntimeOptions};
use weir::transport::memory::MemoryBroker;
use weir::transport::{TopologySpec, Transport};

mod anchor;
mod charts;
mod coordination;
mod dedup;
mod hostile;
mod instructions;
mod natsb;
mod payload;
mod polyglot;
mod rabbit;
mod skew;

/// What one broker drain measured.
pub struct Drain {
    pub wall: Duration,
}

/// A fresh topology name for one drain (its objects are deleted afterwards).
pub(crate) fn drain_topology() -> String {
    format!("bench-{}", &uuid::Uuid::new_v4().simple().to_string()[..8])
}

/// Declare `topo` on `t` and publish `n` benchmark messages over `groups`
/// groups to it, each confirmed, 256 in flight.
async fn preload_on(t: &dyn Transport, topo: &str, slots: u32, n: u64, groups: u64) -> anyhow::Result<()> {
    use futures::StreamExt as _;
    t.declare(&TopologySpec::new(topo, slots))
        .await
        .map_err(|e| anyhow::anyhow!("declaring {topo}: {e}"))?;
    let mut results = futures::stream::iter(0..n)
        .map(|i| async move {
            let env = message(i, Some(format!("group-{}", i % groups)));
            node::publish(t, topo, slots, &env).await
        })
        .buffer_unordered(256);
    while let Some(r) = results.next().await {
        r.map_err(|e| anyhow::anyhow!("preloading {topo}: {e}"))?;
    }
    Ok(())
}

/// Start a Weir node on `transport` with `cfg` and wait until it handled
/// `n` messages; the wall time from `Node::start` (handler load included).
/// Fails if anything but `handled` happens. The node is drained afterwards.
async fn drain_with_weir(
    label: &str,
    cfg: &Config,
    transport: Arc<dyn Transport>,
    workers: usize,
    cache: Option<PathBuf>,
    n: u64,
) -> anyhow::Result<Duration> {
    let opts = NodeOptions {
        workers,
        runtime: crate::node_runtime(cache),
        ..NodeOptions::default()
    };
    let t0 = Instant::now();
    let node = Node::start(cfg, transport, opts).await?;
    let stats = node.stats();
    loop {
        let s = stats.snapshot();
        if s.handled >= n {
            break;
        }
        if s.finished() + s.retry_scheduled + s.faults > s.handled {
            bail!("{label}: something other than `handled` happened: {s:?}");
        }
        if t0.elapsed() > Duration::from_secs(600) {
            bail!("{label}: only {} of {n} handled after 600 s", s.handled);
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let wall = t0.elapsed();
    node.shutdown().await?;
    Ok(wall)
}

/// Runtime options of every engine the bench makes: the node's defaults, the
/// compiled-code cache in `cache`, and, when `WEIR_BENCH_POOL_INSTANCES` is
/// set, a pooling allocator that small with 64 MiB memories (valgrind cannot
/// reserve the address space of the default pool).
fn node_runtime(cache: Option<PathBuf>) -> RuntimeOptions {
    let mut r = RuntimeOptions {
        cache_dir: cache,
        ..RuntimeOptions::default()
    };
    if let Some(n) = bench_pool_instances() {
        r.pool_instances = n;
        r.max_memory = 64 << 20;
    }
    r
}

/// `WEIR_BENCH_POOL_INSTANCES`, when set to a number.
fn bench_pool_instances() -> Option<u32> {
    std::env::var("WEIR_BENCH_POOL_INSTANCES")
        .ok()
        .and_then(|v| v.parse().ok())
}

/// The same allocator as the `weir` binary, so the figures are the shipped
/// host's, counting its large allocations for `payload-size`.
#[global_allocator]
static GLOBAL: payload::Counting = payload::Counting;

const TOPOLOGY: &str = "bench";
const MESSAGE_TYPE: &str = "bench.noop";
const ALL: [&str; 10] = [
    "bare-reuse",
    "bare-fresh",
    "batch-1",
    "batch-10",
    "batch-100",
    "e2e-reuse",
    "e2e-fresh",
    "e2e-batch-1",
    "e2e-batch-10",
    "e2e-batch-100",
];
/// Scenarios beyond the host-cost ones; `all` runs these too.
const SUITE: [&str; 11] = [
    "rabbitmq-drain",
    "nats-drain",
    "skew-zipf",
    "skew-hot",
    "rss-idle",
    "rss-loaded",
    "latency",
    "latency-rabbitmq",
    "latency-nats",
    "payload-size",
    "instructions",
];

/// Peak assumed by `latency-rabbitmq` / `latency-nats` when this run did not
/// drain that broker, msg/s.
const DEFAULT_BROKER_PEAK: f64 = 20_000.0;

/// How long a partial batch waits in the batch scenarios (`--linger-ms`, default 5).
static LINGER: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();

fn bench_linger() -> Duration {
    *LINGER.get_or_init(|| Duration::from_millis(5))
}

#[derive(Debug, Clone)]
struct Opts {
    scenarios: Vec<&'static str>,
    /// Messages per e2e reuse run.
    messages: u64,
    /// Messages per broker drain (RabbitMQ, NATS).
    drain_messages: u64,
    /// Messages per e2e fresh run.
    fresh_messages: u64,
    /// Calls (messages) per bare reuse / batch run.
    bare_messages: u64,
    /// Calls per bare fresh run.
    bare_fresh_messages: u64,
    runs: usize,
    /// Interleaved runs of each broker drain (the ratios are their medians).
    drain_runs: usize,
    groups: u64,
    /// Every k-th message has no group id.
    ungrouped_every: u64,
    slots: u32,
    workers: usize,
    /// `transport.prefetch` (0 = the config default).
    prefetch: u32,
    /// `rabbitmq-drain`: deliver through `handle-batch` of this size (0 = `handle`).
    batch: u32,
    /// RabbitMQ for `rabbitmq-drain`.
    amqp: String,
    /// NATS for `nats-drain`.
    nats: String,
    out: PathBuf,
    /// Where the SVG charts go (`None`: no charts).
    charts: Option<PathBuf>,
    /// CPU the guest burns per message in the skew scenarios, µs.
    spin_us: u64,
    /// Messages per skew run.
    skew_messages: u64,
    /// Length of the latency run at half the peak rate, seconds.
    latency_seconds: f64,
    /// Publish at this rate in the latency scenarios instead of half the peak (msg/s).
    latency_rate: Option<f64>,
    /// `__rss-probe WHICH`: this process is the child of an RSS scenario.
    rss_probe: Option<String>,
}

fn usage() -> String {
    format!(
        "usage: weir-bench [SCENARIO|bare|e2e|all]... [--quick] [--messages N] [--drain-messages N] [--fresh-messages N] [--bare-messages N] \
         [--bare-fresh-messages N] [--skew-messages N] [--spin-us US] [--latency-seconds S] [--latency-rate R] [--runs R] [--drain-runs R] [--groups G] \
         [--ungrouped-every K] [--slots S] [--workers W] [--prefetch P] [--batch N] [--linger-ms MS] [--amqp URL] \
         [--nats URL] [--out PATH] [--charts DIR|--no-charts]\n\
         scenarios: {}, {}\n\
         --quick (put it first): 20 000 messages (5 000 fresh, 50 000 bare), 1 run, 1 s of latency: a smoke run of `all` in under a minute",
        ALL.join(", "),
        SUITE.join(", ")
    )
}

fn parse_args() -> anyhow::Result<Opts> {
    let mut o = Opts {
        scenarios: Vec::new(),
        messages: 200_000,
        drain_messages: 100_000,
        fresh_messages: 50_000,
        bare_messages: 200_000,
        bare_fresh_messages: 20_000,
        runs: 3,
        drain_runs: 5,
        groups: 1_000,
        ungrouped_every: 10,
        slots: 4,
        workers: 0,
        prefetch: 0,
        batch: 0,
        amqp: std::env::var("WEIR_BENCH_AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
        nats: std::env::var("WEIR_BENCH_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into()),
        out: PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/bench/results.json")),
        charts: Some(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/bench"))),
        spin_us: 50,
        skew_messages: 40_000,
        latency_seconds: 3.0,
        latency_rate: None,
        rss_probe: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> anyhow::Result<u64> {
            let v = args
                .next()
                .with_context(|| format!("{name} needs a value\n{}", usage()))?;
            v.replace('_', "")
                .parse::<u64>()
                .with_context(|| format!("{name} {v:?}: not a whole number"))
        };
        match a.as_str() {
            "--messages" => o.messages = num("--messages")?,
            "--drain-messages" => o.drain_messages = num("--drain-messages")?.max(1),
            "--fresh-messages" => o.fresh_messages = num("--fresh-messages")?,
            "--bare-messages" => o.bare_messages = num("--bare-messages")?,
            "--bare-fresh-messages" => o.bare_fresh_messages = num("--bare-fresh-messages")?,
            "--runs" => o.runs = usize::try_from(num("--runs")?)?.max(1),
            "--drain-runs" => o.drain_runs = usize::try_from(num("--drain-runs")?)?.max(1),
            "--groups" => o.groups = num("--groups")?.max(1),
            "--ungrouped-every" => o.ungrouped_every = num("--ungrouped-every")?,
            "--slots" => o.slots = u32::try_from(num("--slots")?)?.max(1),
            "--workers" => o.workers = usize::try_from(num("--workers")?)?,
            "--prefetch" => o.prefetch = u32::try_from(num("--prefetch")?)?,
            "--batch" => o.batch = u32::try_from(num("--batch")?)?,
            "--linger-ms" => {
                let ms = num("--linger-ms")?;
                let _ = LINGER.set(Duration::from_millis(ms));
            }
            "--out" => o.out = PathBuf::from(args.next().with_context(usage)?),
            "--charts" => o.charts = Some(PathBuf::from(args.next().with_context(usage)?)),
            "--no-charts" => o.charts = None,
            "--spin-us" => o.spin_us = num("--spin-us")?.max(1),
            "--skew-messages" => o.skew_messages = num("--skew-messages")?.max(1),
            "--latency-seconds" => o.latency_seconds = num("--latency-seconds")?.max(1) as f64,
            "--latency-rate" => o.latency_rate = Some(num("--latency-rate")?.max(1) as f64),
            "--quick" => {
                o.messages = 20_000;
                o.drain_messages = 20_000;
                o.fresh_messages = 5_000;
                o.bare_messages = 50_000;
                o.bare_fresh_messages = 5_000;
                o.skew_messages = 10_000;
                o.latency_seconds = 1.0;
                o.runs = 1;
                o.drain_runs = 1;
            }
            "__rss-probe" => o.rss_probe = Some(args.next().with_context(usage)?),
            "--amqp" => o.amqp = args.next().with_context(usage)?,
            "--nats" => o.nats = args.next().with_context(usage)?,
            "-h" | "--help" => {
                println!("{}", usage());
                std::process::exit(0);
            }
            "all" => {
                o.scenarios.extend(ALL);
                o.scenarios.extend(SUITE);
            }
            "bare" => o.scenarios.extend(&ALL[..5]),
            "e2e" => o.scenarios.extend(&ALL[5..]),
            s => match ALL.iter().chain(SUITE.iter()).find(|n| **n == s) {
                Some(n) => o.scenarios.push(n),
                None => bail!("unknown argument {s:?}\n{}", usage()),
            },
        }
    }
    if o.scenarios.is_empty() {
        o.scenarios.extend(ALL);
    }
    let mut seen = std::collections::HashSet::new();
    o.scenarios.retain(|s| seen.insert(*s));
    Ok(o)
}

/// CPU time of the whole process (every thread), nanoseconds.
fn process_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// The benchmark message: ~256-byte payload, a uuid id, a group, a tenant
/// and two user headers.
fn message(i: u64, group: Option<String>) -> Envelope {
    let mut payload = format!(
        r#"{{"order_id":"o-{i:010}","customer":"customer-{}","currency":"EUR","lines":[{{"sku":"sku-{}","qty":{},"unit_price_cents":{}}}],"note":""#,
        i % 1000,
        i % 97,
        1 + i % 5,
        100 + i % 900
    )
    .into_bytes();
    payload.resize(
        payload::PAYLOAD_BYTES
            .load(std::sync::atomic::Ordering::Relaxed)
            .max(32)
            - 2,
        b'x',
    );
    payload.extend_from_slice(b"\"}");
    envelope::new_message(
        envelope::fresh_id(),
        MESSAGE_TYPE,
        group,
        Some("acme".into()),
        vec![
            ("x-trace-id".into(), format!("trace-{i:016x}")),
            ("content-type".into(), "application/json".into()),
        ],
        payload,
    )
}

/// One scenario's result: per-run ns/message and extra per-run metrics.
struct Row {
    name: &'static str,
    messages: u64,
    runs_ns: Vec<f64>,
    extra: Vec<(&'static str, Vec<f64>)>,
    note: String,
}

impl Row {
    fn ns(&self) -> f64 {
        median(&self.runs_ns)
    }
    fn extra(&self, key: &str) -> Option<f64> {
        self.extra.iter().find(|(k, _)| *k == key).map(|(_, v)| median(v))
    }
    fn json(&self) -> Value {
        let mut extra = serde_json::Map::new();
        for (k, v) in &self.extra {
            extra.insert((*k).to_owned(), json!({ "median": median(v), "runs": v }));
        }
        json!({
            "scenario": self.name,
            "messages_per_run": self.messages,
            "ns_per_message": { "median": self.ns(), "runs": self.runs_ns },
            "messages_per_second": 1e9 / self.ns(),
            "extra": extra,
            "note": self.note,
        })
    }
}

// ---------------------------------------------------------------- bare ---

fn load_noop(rt: &Arc<Runtime>, mode: InstanceMode) -> anyhow::Result<Arc<weir::runtime::HandlerVersion>> {
    let mut settings = HandlerSettings::new("noop");
    settings.instance_mode = mode;
    rt.load(weir::node::bundled::NOOP, settings, "bundled:noop")
}

fn bare_call(
    rt: &Arc<Runtime>,
    mode: InstanceMode,
    calls: u64,
    runs: usize,
    name: &'static str,
) -> anyhow::Result<Row> {
    let version = load_noop(rt, mode)?;
    let mut exec = Executor::new(rt.clone());
    let msg = message(7, Some("group-7".into()));
    let once = |exec: &mut Executor, n: u64| -> anyhow::Result<Duration> {
        let t = Instant::now();
        for _ in 0..n {
            match exec.call(&version, std::hint::black_box(&msg), &None) {
                CallOutcome::Done {
                    result: Ok(()),
                    published,
                } if published.is_empty() => {}
                other => bail!("{name}: unexpected outcome {other:?}"),
            }
        }
        Ok(t.elapsed())
    };
    // Warm-up: instance creation, caches, branch predictors.
    once(&mut exec, (calls / 10).max(100))?;
    let mut runs_ns = Vec::new();
    for r in 0..runs {
        let d = once(&mut exec, calls)?;
        let ns = d.as_nanos() as f64 / calls as f64;
        eprintln!(
            "[weir-bench] {name:<10} run {}/{runs}: {calls} calls in {:.3} s = {ns:.0} ns/msg",
            r + 1,
            d.as_secs_f64()
        );
        runs_ns.push(ns);
    }
    Ok(Row {
        name,
        messages: calls,
        runs_ns,
        extra: Vec::new(),
        note: "one thread, Executor::call".into(),
    })
}

fn bare_batch(rt: &Arc<Runtime>, size: usize, messages: u64, runs: usize, name: &'static str) -> anyhow::Result<Row> {
    let version = load_noop(rt, InstanceMode::Reuse)?;
    let mut exec = Executor::new(rt.clone());
    let batch: Vec<Envelope> = (0..size as u64).map(|i| message(i, Some("group-7".into()))).collect();
    let calls = (messages / size as u64).max(1);
    let once = |exec: &mut Executor, n: u64| -> anyhow::Result<Duration> {
        let t = Instant::now();
        for _ in 0..n {
            match exec.call_batch(&version, std::hint::black_box(&batch), &None) {
                BatchOutcome::Done { results, .. } if results.iter().all(Result::is_ok) => {}
                other => bail!("{name}: unexpected outcome {other:?}"),
            }
        }
        Ok(t.elapsed())
    };
    once(&mut exec, (calls / 10).max(10))?;
    let mut runs_ns = Vec::new();
    let mut per_call = Vec::new();
    for r in 0..runs {
        let d = once(&mut exec, calls)?;
        let ns = d.as_nanos() as f64 / (calls * size as u64) as f64;
        eprintln!(
            "[weir-bench] {name:<10} run {}/{runs}: {calls} calls x {size} in {:.3} s = {ns:.0} ns/msg",
            r + 1,
            d.as_secs_f64()
        );
        runs_ns.push(ns);
        per_call.push(d.as_nanos() as f64 / calls as f64);
    }
    Ok(Row {
        name,
        messages: calls * size as u64,
        runs_ns,
        extra: vec![("ns_per_call", per_call)],
        note: format!("one thread, Executor::call_batch, {size} messages per call"),
    })
}

// ----------------------------------------------------------------- e2e ---

/// The noop handler's component: the file `WEIR_BENCH_NOOP` names (a noop
/// built against an older WIT, to compare two worlds through one host
/// binary), else the bundled one.
fn noop_component() -> String {
    std::env::var("WEIR_BENCH_NOOP").unwrap_or_else(|_| "bundled:noop".into())
}

fn bench_config(slots: u32, prefetch: u32, mode: config::InstanceMode, batch: Option<u32>) -> Config {
    let noop = noop_component();
    let mut handler = match batch {
        None => config::Handler::new("noop", &noop, TOPOLOGY, vec![MESSAGE_TYPE.into()]),
        Some(size) => {
            let mut h = config::Handler::new("noop", &noop, TOPOLOGY, Vec::new());
            h.batch = Some(config::Batch {
                message_types: vec![MESSAGE_TYPE.into()],
                size,
                linger: bench_linger(),
            });
            h
        }
    };
    handler.instance_mode = mode;
    Config {
        node: config::Node {
            name: "bench".into(),
            admin: None,
            // The node sizes its pool from workers x handlers unless told:
            // under valgrind it must stay as small as `node_runtime` made it.
            instance_pool: bench_pool_instances(),
            ..config::Node::default()
        },
        transport: match prefetch {
            0 => config::Transport::default(),
            p => config::Transport {
                prefetch: p,
                ..config::Transport::default()
            },
        },
        cluster: config::Cluster::default(),
        topology: vec![config::Topology::new(TOPOLOGY, slots)],
        handler: vec![handler],
        tenant: Vec::new(),
        telemetry: Default::default(),
        origin: "<weir-bench>".into(),
    }
}

struct E2eRun {
    wall: Duration,
    cpu_ns: u64,
    startup: Duration,
    handled_at_start: u64,
    publish: Duration,
    /// Mean members per `handle-batch` call (0 without batching).
    mean_batch: f64,
    /// Bytes the process allocated in blocks of 4 KiB or more while timed.
    large_alloc_bytes: u64,
}

/// The group id of the `i`-th message in the default shape: `--groups`
/// groups round robin, every `--ungrouped-every`-th message without one.
fn default_group(o: &Opts, i: u64) -> Option<String> {
    match o.ungrouped_every {
        k if k > 0 && i % k == k - 1 => None,
        _ => Some(format!("group-{}", i % o.groups)),
    }
}

fn e2e_once(
    tokio_rt: &tokio::runtime::Runtime,
    o: &Opts,
    mode: config::InstanceMode,
    n: u64,
    batch: Option<u32>,
) -> anyhow::Result<E2eRun> {
    let config = bench_config(o.slots, o.prefetch, mode, batch);
    e2e_shaped(tokio_rt, o, &config, o.slots, n, &|i| default_group(o, i))
}

/// Declare [`TOPOLOGY`] with `slots` slots on `transport` and publish `n`
/// benchmark messages to it, one after the other, with the group ids
/// `group_of` gives. Never inlined: `instructions` subtracts its cost.
#[inline(never)]
fn prepublish(
    tokio_rt: &tokio::runtime::Runtime,
    transport: &dyn Transport,
    slots: u32,
    n: u64,
    group_of: &dyn Fn(u64) -> Option<String>,
) -> anyhow::Result<()> {
    tokio_rt.block_on(async {
        transport
            .declare(&TopologySpec::new(TOPOLOGY, slots))
            .await
            .map_err(|e| anyhow::anyhow!("declare: {e}"))?;
        for i in 0..n {
            node::publish(transport, TOPOLOGY, slots, &message(i, group_of(i)))
                .await
                .map_err(|e| anyhow::anyhow!("publish {i}: {e}"))?;
        }
        Ok(())
    })
}

/// One end-to-end run of `config` (topology [`TOPOLOGY`] with `slots`
/// slots) on a fresh memory broker: `n` messages pre-published with the
/// group ids `group_of` gives, then timed from `Node::start` returning until
/// all are handled.
fn e2e_shaped(
    tokio_rt: &tokio::runtime::Runtime,
    o: &Opts,
    config: &Config,
    slots: u32,
    n: u64,
    group_of: &dyn Fn(u64) -> Option<String>,
) -> anyhow::Result<E2eRun> {
    let broker = MemoryBroker::new();
    let transport: Arc<dyn Transport> = Arc::new(broker.clone());
    let cache = o.out.parent().map(|p| p.join("cache"));

    // Pre-publish every message through the broker (not timed).
    let tp = Instant::now();
    prepublish(tokio_rt, transport.as_ref(), slots, n, group_of)?;
    let publish = tp.elapsed();

    let opts = NodeOptions {
        workers: o.workers,
        runtime: crate::node_runtime(cache),
        ..NodeOptions::default()
    };
    let t0 = Instant::now();
    let node = tokio_rt.block_on(Node::start(config, transport, opts))?;
    // Runners are spawned at the very end of `start`; time from here.
    let t1 = Instant::now();
    let cpu1 = process_cpu_ns();
    let large1 = payload::LARGE_BYTES.load(std::sync::atomic::Ordering::Relaxed);
    let stats = node.stats();
    let handled_at_start = stats.handled.load(std::sync::atomic::Ordering::Relaxed);
    // Poll from this (non-runtime) thread so the runtime's own threads are
    // not disturbed beyond one atomic load every 200 µs.
    let deadline = Duration::from_secs(600);
    loop {
        let s = stats.snapshot();
        if s.handled >= n {
            break;
        }
        if s.finished() + s.retry_scheduled + s.faults > s.handled {
            bail!("e2e: something other than `handled` happened: {s:?}");
        }
        if t1.elapsed() > deadline {
            bail!("e2e: only {} of {n} handled after {deadline:?}", s.handled);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let wall = t1.elapsed();
    let cpu_ns = process_cpu_ns().saturating_sub(cpu1);
    let large_alloc_bytes = payload::LARGE_BYTES
        .load(std::sync::atomic::Ordering::Relaxed)
        .saturating_sub(large1);
    let snap = stats.snapshot();
    let mean_batch = snap.batch_members as f64 / snap.batches().max(1) as f64;
    tokio_rt.block_on(node.shutdown())?;
    let left = broker.total_depth(TOPOLOGY);
    if left != 0 {
        bail!("e2e: {left} messages left on the broker after all were handled");
    }
    Ok(E2eRun {
        wall,
        cpu_ns,
        startup: t1 - t0,
        handled_at_start,
        publish,
        mean_batch,
        large_alloc_bytes,
    })
}

fn e2e(o: &Opts, mode: config::InstanceMode, name: &'static str, batch: Option<u32>) -> anyhow::Result<Row> {
    // The same runtime `weir run` builds: multi-thread, one worker per core.
    let tokio_rt = weir::sched::async_runtime()?;
    let n = if mode == config::InstanceMode::Fresh {
        o.fresh_messages
    } else {
        o.messages
    };
    let workers = match o.workers {
        0 => std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2),
        w => w,
    };
    // Warm-up run (also fills the compiled-code cache), discarded.
    let w = e2e_once(&tokio_rt, o, mode, (n / 10).max(1000), batch)?;
    eprintln!(
        "[weir-bench] {name:<10} warm-up: {:.0} ns/msg (discarded)",
        w.wall.as_nanos() as f64 / (n / 10).max(1000) as f64
    );
    let mut runs_ns = Vec::new();
    let (mut x_workers, mut cpu, mut startup, mut at_start, mut publish) = (vec![], vec![], vec![], vec![], vec![]);
    for r in 0..o.runs {
        let run = e2e_once(&tokio_rt, o, mode, n, batch)?;
        // Messages handled before `start` returned (the runners start at its
        // very end) are outside the timed window: leave them out.
        let timed = n.saturating_sub(run.handled_at_start).max(1) as f64;
        let ns = run.wall.as_nanos() as f64 / timed;
        let cpu_ns = run.cpu_ns as f64 / timed;
        eprintln!(
            "[weir-bench] {name:<10} run {}/{}: {n} msgs in {:.3} s = {ns:.0} ns/msg wall, {:.0} msg/s, {cpu_ns:.0} CPU-ns/msg (startup {:.0} ms, {} handled before timing, mean batch {:.1})",
            r + 1,
            o.runs,
            run.wall.as_secs_f64(),
            1e9 / ns,
            run.startup.as_secs_f64() * 1e3,
            run.handled_at_start,
            run.mean_batch
        );
        runs_ns.push(ns);
        x_workers.push(ns * workers as f64);
        cpu.push(cpu_ns);
        startup.push(run.startup.as_secs_f64() * 1e3);
        at_start.push(run.handled_at_start as f64);
        publish.push(run.publish.as_secs_f64() * 1e3);
    }
    Ok(Row {
        name,
        messages: n,
        runs_ns,
        extra: vec![
            ("wall_ns_x_workers", x_workers),
            ("cpu_ns_per_message", cpu),
            ("workers", vec![workers as f64]),
            ("node_start_ms", startup),
            ("handled_before_timing", at_start),
            ("prepublish_ms", publish),
        ],
        note: format!(
            "Node on MemoryBroker, {} slots, {} groups, every {}th message ungrouped, {workers} wasm workers{}",
            o.slots,
            o.groups,
            o.ungrouped_every,
            batch.map_or_else(String::new, |b| format!(
                ", handle-batch size {b}, linger {:?}",
                bench_linger()
            ))
        ),
    })
}

// -------------------------------------------------------------- drains ---

/// Interleaved drain runs of one broker: per run, the bare client with a
/// native no-op, the bare client calling the noop component inline
/// ([`anchor`]), then Weir; rows `{prefix}-bare`, `{prefix}-bare-wasm` and
/// `{prefix}-weir`, the Weir row carrying the per-run ratios (the target
/// is the median of those, not a ratio of medians).
fn drain_rows(
    o: &Opts,
    label: &str,
    names: [&'static str; 3],
    note: &str,
    bare: impl AsyncFn(u64, Option<&anchor::Anchor>) -> anyhow::Result<Drain>,
    weir: impl AsyncFn(u64) -> anyhow::Result<Drain>,
) -> anyhow::Result<Vec<Row>> {
    let tokio_rt = weir::sched::async_runtime()?;
    let n = o.drain_messages;
    let wasm = anchor::Anchor::new()?;
    // Warm-up (compiles the guest into the cache), discarded.
    tokio_rt.block_on(weir((n / 10).max(1000)))?;
    let (mut bare_ns, mut wasm_ns, mut weir_ns) = (Vec::new(), Vec::new(), Vec::new());
    let (mut to_bare, mut to_wasm) = (Vec::new(), Vec::new());
    for r in 0..o.drain_runs {
        let b = tokio_rt.block_on(bare(n, None))?.wall.as_nanos() as f64 / n as f64;
        let a = tokio_rt.block_on(bare(n, Some(&wasm)))?.wall.as_nanos() as f64 / n as f64;
        let w = tokio_rt.block_on(weir(n))?.wall.as_nanos() as f64 / n as f64;
        eprintln!(
            "[weir-bench] {label} run {}/{}: bare {:.0} msg/s, bare+wasm {:.0} msg/s, weir {:.0} msg/s; \
             weir/bare {:.2}, weir/bare+wasm {:.2}",
            r + 1,
            o.drain_runs,
            1e9 / b,
            1e9 / a,
            1e9 / w,
            b / w,
            a / w
        );
        bare_ns.push(b);
        wasm_ns.push(a);
        weir_ns.push(w);
        to_bare.push(b / w);
        to_wasm.push(a / w);
    }
    let row = |name, runs_ns, extra, what: &str| Row {
        name,
        messages: n,
        runs_ns,
        extra,
        note: format!("{what}; {note}"),
    };
    Ok(vec![
        row(names[0], bare_ns, vec![], "bare client, native no-op"),
        row(
            names[1],
            wasm_ns,
            vec![],
            "bare client calling the noop component inline (plain wasmtime loop, one store per consumer)",
        ),
        row(
            names[2],
            weir_ns,
            vec![("ratio_to_bare", to_bare), ("ratio_to_bare_wasm", to_wasm)],
            "Weir node, noop guest (timed from Node::start)",
        ),
    ])
}

pub(crate) fn prefetch_of(o: &Opts) -> u32 {
    match o.prefetch {
        0 => config::Transport::default().prefetch,
        p => p,
    }
}

fn rabbitmq_drain(o: &Opts) -> anyhow::Result<Vec<Row>> {
    let prefetch = prefetch_of(o);
    let prefetch16 = u16::try_from(prefetch).context("--prefetch must fit in 16 bits for RabbitMQ")?;
    let cache = o.out.parent().map(|p| p.join("cache"));
    let batch = (o.batch > 0).then_some(o.batch);
    let note = format!(
        "{} persistent msgs preloaded on {} slot queues, prefetch {prefetch}, {} groups, multiple ack every 128 (bare){}",
        o.drain_messages,
        o.slots,
        o.groups,
        match o.batch {
            0 => String::new(),
            b => format!(", weir through handle-batch size {b}, linger {:?}", bench_linger()),
        }
    );
    drain_rows(
        o,
        "rabbitmq-drain",
        ["rmq-bare", "rmq-bare-wasm", "rmq-weir"],
        &note,
        async |n, wasm| rabbit::bare(&o.amqp, o.slots, n, o.groups, prefetch16, wasm).await,
        async |n| {
            rabbit::weir(
                &o.amqp,
                o.slots,
                n,
                o.groups,
                prefetch16,
                o.workers,
                cache.clone(),
                batch,
            )
            .await
        },
    )
}

fn nats_drain(o: &Opts) -> anyhow::Result<Vec<Row>> {
    let prefetch = prefetch_of(o);
    let cache = o.out.parent().map(|p| p.join("cache"));
    let note = format!(
        "{} msgs preloaded into a file-backed stream over {} slot subjects, max-ack-pending {prefetch}, {} groups, \
         pull batches of 256 and one ack per message (bare)",
        o.drain_messages, o.slots, o.groups
    );
    drain_rows(
        o,
        "nats-drain",
        ["nats-bare", "nats-bare-wasm", "nats-weir"],
        &note,
        async |n, wasm| natsb::bare(&o.nats, o.slots, n, o.groups, prefetch, wasm).await,
        async |n| natsb::weir(&o.nats, o.slots, n, o.groups, prefetch, o.workers, cache.clone()).await,
    )
}

// ---------------------------------------------------------------- main ---

fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    json!({
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu_model": model,
        "loadavg_at_start": load.trim(),
    })
}

/// A ratio of two medians, `None` when either row is missing.
fn ratio(rows: &[Row], num: &str, den: &str) -> Option<f64> {
    let f = |n: &str| rows.iter().find(|r| r.name == n).map(Row::ns);
    // Rows hold ns/message: throughput ratio num/den = den ns / num ns.
    Some(f(den)? / f(num)?).filter(|r| r.is_finite())
}

/// One figure of the suite against its target.
struct Check {
    key: &'static str,
    label: &'static str,
    value: f64,
    target: Option<f64>,
    /// The target is a floor (throughput ratios) rather than a ceiling.
    higher_is_better: bool,
}

impl Check {
    fn met(&self) -> Option<bool> {
        self.target.map(|t| match self.higher_is_better {
            true => self.value >= t,
            false => self.value <= t,
        })
    }
}

/// Every figure of the suite with its target (issue 17's among them); rows
/// this run did not produce are left out.
fn ratios(rows: &[Row]) -> Vec<Check> {
    let row = |n: &str| rows.iter().find(|r| r.name == n);
    let extra = |n: &str, k: &str| row(n).and_then(|r| r.extra(k));
    let instr = |n: &str| extra(n, "instructions_per_message");
    let quotient = |a: Option<f64>, b: Option<f64>| Some(a? / b?).filter(|v| v.is_finite());
    let up = |key, label, value, target| (key, label, value, target, true);
    let down = |key, label, value, target| (key, label, value, target, false);
    let all = [
        up(
            "rabbitmq_drain_wasm",
            "RabbitMQ drain: Weir / lapin+Wasm",
            extra("rmq-weir", "ratio_to_bare_wasm"),
            Some(0.95),
        ),
        up(
            "rabbitmq_drain",
            "RabbitMQ drain: Weir / bare lapin",
            extra("rmq-weir", "ratio_to_bare"),
            Some(0.95),
        ),
        up(
            "nats_drain_wasm",
            "NATS drain: Weir / pull+Wasm",
            extra("nats-weir", "ratio_to_bare_wasm"),
            Some(0.95),
        ),
        up(
            "nats_drain",
            "NATS drain: Weir / bare pull",
            extra("nats-weir", "ratio_to_bare"),
            Some(0.85),
        ),
        up(
            "skew_zipf",
            "Zipf skew: msg/s / ideal",
            extra("skew-zipf", "ratio_to_ideal"),
            Some(0.8),
        ),
        up(
            "skew_hot",
            "Zipf + hot group / ideal",
            extra("skew-hot", "ratio_to_ideal"),
            Some(0.8),
        ),
        up(
            "skew_zipf_cpu_bound",
            "Zipf skew: work / CPU per msg",
            extra("skew-zipf", "cpu_bound_ratio"),
            Some(0.8),
        ),
        up(
            "memory_e2e",
            "memory e2e / bare call loop",
            ratio(rows, "e2e-reuse", "bare-reuse"),
            None,
        ),
        up(
            "fresh_vs_reuse",
            "e2e fresh / e2e reuse",
            ratio(rows, "e2e-fresh", "e2e-reuse"),
            None,
        ),
        up(
            "batch_1",
            "e2e handle-batch 1 / handle",
            ratio(rows, "e2e-batch-1", "e2e-reuse"),
            None,
        ),
        up(
            "batch_10",
            "e2e handle-batch 10 / handle",
            ratio(rows, "e2e-batch-10", "e2e-reuse"),
            None,
        ),
        up(
            "batch_100",
            "e2e handle-batch 100 / handle",
            ratio(rows, "e2e-batch-100", "e2e-reuse"),
            None,
        ),
        down(
            "instructions_per_message",
            "instructions/msg, e2e-reuse",
            instr("instr-handle"),
            Some(6000.0),
        ),
        down(
            "batch_instructions_default",
            "instr. batch-100 / handle, default",
            quotient(instr("instr-batch-100"), instr("instr-handle")),
            Some(1.05),
        ),
        down(
            "batch_instructions_full",
            "instr. batch-100 / handle, full",
            quotient(instr("instr-batch-full"), instr("instr-handle-full")),
            Some(0.5),
        ),
        down(
            "fresh_us_per_message",
            "e2e fresh: µs per message",
            row("e2e-fresh").map(|r| r.ns() / 1e3),
            Some(30.0),
        ),
        down(
            "latency_p99_ms",
            "p99 latency, memory, ms",
            extra("latency", "p99_us").map(|v| v / 1e3),
            Some(5.0),
        ),
        down(
            "latency_rabbitmq_p99_ms",
            "p99 latency, RabbitMQ, ms",
            extra("latency-rabbitmq", "p99_us").map(|v| v / 1e3),
            None,
        ),
        down(
            "latency_nats_p99_ms",
            "p99 latency, NATS, ms",
            extra("latency-nats", "p99_us").map(|v| v / 1e3),
            None,
        ),
        down(
            "payload_copies_16k",
            "copies per byte, 16 KiB payload",
            extra("payload-16k", "copies_per_byte"),
            Some(1.0),
        ),
        down(
            "payload_copies_256k",
            "copies per byte, 256 KiB payload",
            extra("payload-256k", "copies_per_byte"),
            Some(1.0),
        ),
    ];
    all.into_iter()
        .filter_map(|(key, label, value, target, higher_is_better)| {
            value.map(|value| Check {
                key,
                label,
                value,
                target,
                higher_is_better,
            })
        })
        .collect()
}

fn draw_charts(dir: &std::path::Path, rows: &[Row], machine: &Value) -> anyhow::Result<Vec<String>> {
    use charts::Bar;
    let mut written = Vec::new();
    let when = format!(
        "{} cores, load at start {}",
        machine["cpus"],
        machine["loadavg_at_start"].as_str().unwrap_or("?")
    );
    // The chart holds the throughput ratios (higher is better) only.
    let r: Vec<Check> = ratios(rows).into_iter().filter(|c| c.higher_is_better).collect();
    if !r.is_empty() {
        let bars: Vec<Bar> = r.iter().map(|c| Bar::new(c.label, c.value, c.target)).collect();
        charts::write(
            dir,
            "ratios.svg",
            &charts::bars(
                "Weir against its anchors (throughput ratio, higher is better)",
                &format!("weir-bench all, anchors measured in the same run; {when}"),
                "x",
                &bars,
            ),
        )?;
        written.push("ratios.svg".to_owned());
    }
    if let Some(l) = rows.iter().find(|r| r.name == "latency") {
        let bars: Vec<Bar> = [
            ("p50", "p50_us"),
            ("p90", "p90_us"),
            ("p99", "p99_us"),
            ("p99.9", "p999_us"),
            ("max", "max_us"),
        ]
        .iter()
        .filter_map(|(label, k)| l.extra(k).map(|v| Bar::new(*label, v, None)))
        .collect();
        charts::write(
            dir,
            "latency.svg",
            &charts::bars(
                "Publish-to-handled latency, memory broker, µs",
                &format!(
                    "{:.0} msg/s = half the e2e-reuse peak; {when}",
                    l.extra("rate_msgs_per_s").unwrap_or(f64::NAN)
                ),
                " µs",
                &bars,
            ),
        )?;
        written.push("latency.svg".to_owned());
    }
    let mem: Vec<Bar> = [
        ("idle node (4 slots)", "rss-idle", "rss_mib"),
        ("64 slots, 10k groups: peak", "rss-loaded", "rss_mib"),
        ("... before Node::start", "rss-loaded", "before_start_mib"),
    ]
    .iter()
    .filter_map(|(label, row, k)| {
        rows.iter()
            .find(|r| r.name == *row)
            .and_then(|r| r.extra(k))
            .map(|v| Bar::new(*label, v, None))
    })
    .collect();
    if !mem.is_empty() {
        charts::write(
            dir,
            "memory.svg",
            &charts::bars("Resident memory of a node, MiB", &when, " MiB", &mem),
        )?;
        written.push("memory.svg".to_owned());
    }
    let tput: Vec<Bar> = rows
        .iter()
        .filter(|r| !r.runs_ns.is_empty() && r.name != "latency")
        .map(|r| Bar::new(r.name, 1e9 / r.ns() / 1e3, None))
        .collect();
    if !tput.is_empty() {
        charts::write(
            dir,
            "throughput.svg",
            &charts::bars("Throughput per scenario, thousand messages/s", &when, "k", &tput),
        )?;
        written.push("throughput.svg".to_owned());
    }
    Ok(written)
}

fn run_scenario(s: &'static str, o: &Opts, rt: Option<&Arc<Runtime>>, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let row = match (s, rt) {
        ("bare-reuse", Some(rt)) => bare_call(rt, InstanceMode::Reuse, o.bare_messages, o.runs, s)?,
        ("bare-fresh", Some(rt)) => bare_call(rt, InstanceMode::Fresh, o.bare_fresh_messages, o.runs, s)?,
        ("batch-1", Some(rt)) => bare_batch(rt, 1, o.bare_messages, o.runs, s)?,
        ("batch-10", Some(rt)) => bare_batch(rt, 10, o.bare_messages, o.runs, s)?,
        ("batch-100", Some(rt)) => bare_batch(rt, 100, o.bare_messages, o.runs, s)?,
        ("e2e-reuse", _) => e2e(o, config::InstanceMode::Reuse, s, None)?,
        ("e2e-fresh", _) => e2e(o, config::InstanceMode::Fresh, s, None)?,
        ("e2e-batch-1", _) => e2e(o, config::InstanceMode::Reuse, s, Some(1))?,
        ("e2e-batch-10", _) => e2e(o, config::InstanceMode::Reuse, s, Some(10))?,
        ("e2e-batch-100", _) => e2e(o, config::InstanceMode::Reuse, s, Some(100))?,
        ("rabbitmq-drain", _) => {
            let mut r = rabbitmq_drain(o)?;
            let weir = r.pop().context("no rows")?;
            rows.extend(r);
            weir
        }
        ("nats-drain", _) => {
            let mut r = nats_drain(o)?;
            let weir = r.pop().context("no rows")?;
            rows.extend(r);
            weir
        }
        ("skew-zipf", _) => skew::skew(o, s, 0.0)?,
        ("skew-hot", _) => skew::skew(o, s, skew::HOT_SHARE)?,
        ("rss-idle", _) => skew::rss(o, s, "idle")?,
        ("rss-loaded", _) => skew::rss(o, s, "loaded")?,
        ("latency", _) => {
            // Half the peak of this run's e2e-reuse, or of a short one of its own.
            let peak = match rows.iter().find(|r| r.name == "e2e-reuse") {
                Some(r) => 1e9 / r.ns(),
                None => {
                    let tokio_rt = weir::sched::async_runtime()?;
                    let n = o.messages.min(100_000);
                    let run = e2e_once(&tokio_rt, o, config::InstanceMode::Reuse, n, None)?;
                    n as f64 / run.wall.as_secs_f64()
                }
            };
            skew::latency(o, s, peak, skew::LatencyBroker::Memory)?
        }
        ("latency-rabbitmq" | "latency-nats", _) => {
            let (drained, broker) = match s {
                "latency-rabbitmq" => ("rmq-weir", skew::LatencyBroker::Rabbitmq),
                _ => ("nats-weir", skew::LatencyBroker::Nats),
            };
            let peak = rows
                .iter()
                .find(|r| r.name == drained)
                .map_or(DEFAULT_BROKER_PEAK, |r| 1e9 / r.ns());
            skew::latency(o, s, peak, broker)?
        }
        ("payload-size", _) => {
            let mut r = payload::payload_size(o)?;
            let last = r.pop().context("no rows")?;
            rows.extend(r);
            last
        }
        ("instructions", _) => {
            let mut r = instructions::instructions(o)?;
            let last = r.pop().context("no rows")?;
            rows.extend(r);
            last
        }
        _ => bail!("scenario {s} has no runner"),
    };
    rows.push(row);
    Ok(())
}

fn main() -> anyhow::Result<()> {
    // `weir-bench polyglot ...`: the orders handler per language (bench/src/polyglot.rs).
    if std::env::args().nth(1).as_deref() == Some("polyglot") {
        return polyglot::main(std::env::args().skip(2));
    }
    // `weir-bench coordination ...`: the PostgreSQL coordinator for many nodes (bench/src/coordination.rs).
    if std::env::args().nth(1).as_deref() == Some("coordination") {
        return coordination::main(std::env::args().skip(2));
    }
    // `weir-bench dedup ...`: what handler.dedup costs per message (bench/src/dedup.rs).
    if std::env::args().nth(1).as_deref() == Some("dedup") {
        return dedup::main(std::env::args().skip(2));
    }
    // `weir-bench hostile ...`: a good tenant next to each hostile guest (bench/src/hostile.rs).
    if std::env::args().nth(1).as_deref() == Some("hostile") {
        return hostile::main(std::env::args().skip(2));
    }
    let o = parse_args()?;
    if let Some(which) = &o.rss_probe {
        return skew::rss_probe(&o, which);
    }
    let started = Instant::now();
    let machine = machine();
    eprintln!(
        "[weir-bench] scenarios: {} (runs {}, load {})",
        o.scenarios.join(" "),
        o.runs,
        machine["loadavg_at_start"]
    );

    let mut rows: Vec<Row> = Vec::new();
    let mut errors: Vec<Value> = Vec::new();
    let needs_bare = o.scenarios.iter().any(|s| ALL[..5].contains(s));
    let rt = if needs_bare {
        Some(Runtime::new(node_runtime(None))?)
    } else {
        None
    };
    for s in o.scenarios.clone() {
        // One failing scenario (a broker that is down) does not lose the rest.
        if let Err(e) = run_scenario(s, &o, rt.as_ref(), &mut rows) {
            eprintln!("[weir-bench] {s}: FAILED: {e:#}");
            errors.push(json!({ "scenario": s, "error": format!("{e:#}") }));
        }
    }
    drop(rt);

    // Table.
    println!();
    println!(
        "{:<14} {:>9} {:>12} {:>13} {:>15} {:>13}  other",
        "scenario", "msgs/run", "ns/msg", "msg/s", "wall ns x wkrs", "CPU ns/msg"
    );
    for r in &rows {
        let opt = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |x| format!("{x:.0}"));
        let other: Vec<String> = r
            .extra
            .iter()
            .filter(|(k, _)| {
                matches!(
                    *k,
                    "ratio_to_ideal"
                        | "cpu_bound_ratio"
                        | "rss_mib"
                        | "hwm_mib"
                        | "before_start_mib"
                        | "p50_us"
                        | "p99_us"
                        | "p999_us"
                        | "ns_per_kib"
                        | "copies_per_byte"
                        | "instructions_per_message"
                        | "ratio_to_bare"
                        | "ratio_to_bare_wasm"
                )
            })
            .map(|(k, v)| format!("{k}={:.2}", median(v)))
            .collect();
        let (ns, rate) = if r.runs_ns.is_empty() {
            ("-".to_owned(), "-".to_owned())
        } else {
            (format!("{:.0}", r.ns()), format!("{:.0}", 1e9 / r.ns()))
        };
        println!(
            "{:<14} {:>9} {:>12} {:>13} {:>15} {:>13}  {}",
            r.name,
            r.messages,
            ns,
            rate,
            opt(r.extra("wall_ns_x_workers")),
            opt(r.extra("cpu_ns_per_message")),
            other.join(" "),
        );
    }
    // Host overhead.
    let find = |n: &str| rows.iter().find(|r| r.name == n);
    let mut overhead = Vec::new();
    for (e2e_name, bare_name) in [("e2e-reuse", "bare-reuse"), ("e2e-fresh", "bare-fresh")] {
        if let (Some(e), Some(b)) = (find(e2e_name), find(bare_name)) {
            let raw = e.ns() - b.ns();
            let per_core = e.extra("wall_ns_x_workers").unwrap_or(f64::NAN) - b.ns();
            let cpu = e.extra("cpu_ns_per_message").unwrap_or(f64::NAN) - b.ns();
            overhead.push(json!({
                "e2e": e2e_name,
                "bare": bare_name,
                "raw_wall_ns": raw,
                "per_core_normalised_ns": per_core,
                "cpu_time_ns": cpu,
                "target_ns": 1500.0,
                "meets_target_per_core_normalised": per_core <= 1500.0,
            }));
        }
    }
    let suite_ratios = ratios(&rows);
    if !suite_ratios.is_empty() {
        println!();
        println!("{:<36} {:>9} {:>10}", "figure against its target", "value", "target");
        for c in &suite_ratios {
            let target = c.target.map_or_else(
                || "-".to_owned(),
                |t| format!("{}{t:.2}", if c.higher_is_better { ">=" } else { "<=" }),
            );
            let verdict = match c.met() {
                Some(true) => "met",
                Some(false) => "MISSED",
                None => "",
            };
            let value = match c.value.abs() >= 100.0 {
                true => format!("{:.0}", c.value),
                false => format!("{:.2}", c.value),
            };
            println!("{:<36} {value:>9} {target:>10} {verdict}", c.label);
        }
    }
    let ratio_json: serde_json::Map<String, Value> = suite_ratios
        .iter()
        .map(|c| {
            (
                c.key.to_owned(),
                json!({
                    "label": c.label,
                    "value": c.value,
                    "target": c.target,
                    "higher_is_better": c.higher_is_better,
                    "meets_target": c.met(),
                }),
            )
        })
        .collect();
    if !overhead.is_empty() {
        println!();
        println!("host overhead = e2e − bare (target ≤ 1500 ns/msg, compare the per-core column)");
        println!(
            "{:<11} {:>14} {:>20} {:>16}",
            "e2e", "raw wall ns", "per-core (wall x W)", "CPU-time ns"
        );
        for v in &overhead {
            println!(
                "{:<11} {:>14.0} {:>20.0} {:>16.0}",
                v["e2e"].as_str().unwrap_or(""),
                v["raw_wall_ns"].as_f64().unwrap_or(f64::NAN),
                v["per_core_normalised_ns"].as_f64().unwrap_or(f64::NAN),
                v["cpu_time_ns"].as_f64().unwrap_or(f64::NAN),
            );
        }
    }

    let charts_written = match &o.charts {
        Some(dir) => match draw_charts(dir, &rows, &machine) {
            Ok(w) => {
                eprintln!("[weir-bench] charts in {}: {}", dir.display(), w.join(", "));
                w
            }
            Err(e) => {
                errors.push(json!({ "scenario": "charts", "error": format!("{e:#}") }));
                Vec::new()
            }
        },
        None => Vec::new(),
    };

    let doc = json!({
        "tool": "weir-bench",
        "machine": machine,
        "loadavg_at_end": std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim(),
        "runs_per_scenario": o.runs,
        "statistic": "median of runs, after one discarded warm-up",
        "elapsed_s": started.elapsed().as_secs_f64(),
        "results": rows.iter().map(Row::json).collect::<Vec<_>>(),
        "ratios": ratio_json,
        "host_overhead": overhead,
        "charts": charts_written,
        "errors": errors,
    });
    if let Some(dir) = o.out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(&o.out, serde_json::to_string_pretty(&doc)?)
        .with_context(|| format!("writing {}", o.out.display()))?;
    eprintln!(
        "[weir-bench] wrote {} ({:.1} s total)",
        o.out.display(),
        started.elapsed().as_secs_f64()
    );
    if !errors.is_empty() {
        bail!(
            "{} scenario(s) failed: {}",
            errors.len(),
            serde_json::to_string(&errors)?
        );
    }
    Ok(())
}
