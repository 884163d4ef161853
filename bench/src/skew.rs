//! Scenarios with a guest that works: key skew (`skew-zipf`, `skew-hot`),
//! node memory (`rss-idle`, `rss-loaded`, each in a child process of its
//! own so earlier scenarios do not count) and publish-to-handled latency
//! (`latency`). All on the memory broker with the noop guest, which burns
//! `spin_us` of CPU per message when its config says so.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

use weir::config::{self, Config};
use weir::node::{self, Node, NodeOptions};
use weir::outcome::Outcome;
use weir::outcome::SettleObserver;
use weir::transport::memory::MemoryBroker;
use weir::transport::{TopologySpec, Transport};

use crate::{Opts, Row, TOPOLOGY};

/// Groups of the skew scenarios.
pub const SKEW_GROUPS: u64 = 10_000;
/// Zipf exponent of the skew scenarios.
pub const ZIPF_S: f64 = 1.1;
/// Share of the messages that go to the one hot group in `skew-hot`.
pub const HOT_SHARE: f64 = 0.25;

/// splitmix64: a deterministic, well-mixed 64-bit value for `x`.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform value in [0, 1) derived from `x`.
fn unit(x: u64) -> f64 {
    (mix(x) >> 11) as f64 / (1u64 << 53) as f64
}

/// Zipf(s) over ranks 1..=n, sampled by inverting the cumulative weights.
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub fn new(n: u64, s: f64) -> Self {
        let mut cdf = Vec::with_capacity(usize::try_from(n).unwrap_or(0));
        let mut acc = 0.0;
        for k in 1..=n {
            acc += (k as f64).powf(-s);
            cdf.push(acc);
        }
        for c in &mut cdf {
            *c /= acc;
        }
        Self { cdf }
    }

    /// The rank (0-based) for the uniform value `u`.
    pub fn rank(&self, u: f64) -> usize {
        self.cdf
            .partition_point(|c| *c < u)
            .min(self.cdf.len().saturating_sub(1))
    }

    /// Probability of the most frequent rank.
    pub fn top_share(&self) -> f64 {
        self.cdf.first().copied().unwrap_or(0.0)
    }
}

/// The group of message `i`: Zipf over [`SKEW_GROUPS`], and with `hot_share`
/// of the messages in group `hot` instead.
fn skew_group(zipf: &Zipf, hot_share: f64, i: u64) -> Option<String> {
    if hot_share > 0.0 && unit(i ^ 0xA5A5_A5A5) < hot_share {
        return Some("hot".into());
    }
    Some(format!("zipf-{}", zipf.rank(unit(i))))
}

/// The e2e config with the guest burning `spin_us` per message.
pub fn spin_config(o: &Opts, slots: u32, spin_us: u64) -> Config {
    let mut c = crate::bench_config(slots, o.prefetch, config::InstanceMode::Reuse, None);
    for h in &mut c.handler {
        h.config.insert("spin_us".into(), spin_us.to_string());
    }
    c
}

/// `skew-zipf` / `skew-hot`: throughput with a guest spending `--spin-us`
/// of CPU per message, against the ideal `cores / spin`.
pub fn skew(o: &Opts, name: &'static str, hot_share: f64) -> anyhow::Result<Row> {
    let tokio_rt = weir::sched::async_runtime()?;
    let zipf = Zipf::new(SKEW_GROUPS, ZIPF_S);
    let config = spin_config(o, o.slots, o.spin_us);
    let n = o.skew_messages;
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2) as f64;
    let ideal = cores * 1e6 / o.spin_us.max(1) as f64;
    let group = |i: u64| skew_group(&zipf, hot_share, i);
    let w = crate::e2e_shaped(&tokio_rt, o, &config, o.slots, (n / 10).max(500), &group)?;
    eprintln!(
        "[weir-bench] {name:<10} warm-up: {:.0} msg/s (discarded)",
        (n / 10).max(500) as f64 / w.wall.as_secs_f64()
    );
    let (mut runs_ns, mut ratios, mut cpu, mut cpu_bound) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in 0..o.runs {
        let run = crate::e2e_shaped(&tokio_rt, o, &config, o.slots, n, &group)?;
        let timed = n.saturating_sub(run.handled_at_start).max(1) as f64;
        let ns = run.wall.as_nanos() as f64 / timed;
        let ratio = 1e9 / ns / ideal;
        eprintln!(
            "[weir-bench] {name:<10} run {}/{}: {:.0} msg/s, ideal {ideal:.0} ({cores} cores / {} µs), ratio {ratio:.2}",
            r + 1,
            o.runs,
            1e9 / ns,
            o.spin_us
        );
        runs_ns.push(ns);
        ratios.push(ratio);
        let cpu_ns = run.cpu_ns as f64 / timed;
        cpu.push(cpu_ns);
        // What the run's CPU per message allows on free cores, against the
        // ideal: guest work / process CPU per message. Independent of
        // whatever else the machine runs.
        cpu_bound.push(o.spin_us as f64 * 1e3 / cpu_ns);
    }
    Ok(Row {
        name,
        messages: n,
        runs_ns,
        extra: vec![
            ("ratio_to_ideal", ratios),
            ("cpu_bound_ratio", cpu_bound),
            ("ideal_msgs_per_s", vec![ideal]),
            ("cpu_ns_per_message", cpu),
            ("top_group_share", vec![hot_share.max(zipf.top_share())]),
        ],
        note: format!(
            "memory broker, {} slots, guest spins {} µs/msg, Zipf s={ZIPF_S} over {SKEW_GROUPS} groups{}; ideal = cores / work",
            o.slots,
            o.spin_us,
            if hot_share > 0.0 {
                format!(", plus one hot group with {:.0} % of the messages", hot_share * 100.0)
            } else {
                String::new()
            }
        ),
    })
}

// ------------------------------------------------------------- memory ---

/// `VmRSS` and `VmHWM` of this process, KiB.
fn rss_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Child-process side of `rss-idle` / `rss-loaded`: prints one JSON line.
pub fn rss_probe(o: &Opts, which: &str) -> anyhow::Result<()> {
    let tokio_rt = weir::sched::async_runtime()?;
    let broker = MemoryBroker::new();
    let transport: Arc<dyn Transport> = Arc::new(broker.clone());
    let cache = o.out.parent().map(|p| p.join("cache"));
    let opts = NodeOptions {
        workers: o.workers,
        runtime: crate::node_runtime(cache),
        ..NodeOptions::default()
    };
    let out = match which {
        "idle" => {
            let config = crate::bench_config(o.slots, o.prefetch, config::InstanceMode::Reuse, None);
            let (before, _) = rss_kib();
            let node = tokio_rt.block_on(Node::start(&config, transport, opts))?;
            std::thread::sleep(Duration::from_secs(1));
            let (rss, hwm) = rss_kib();
            tokio_rt.block_on(node.shutdown())?;
            json!({ "rss_kib": rss, "hwm_kib": hwm, "before_start_kib": before, "slots": o.slots })
        }
        "loaded" => {
            const SLOTS: u32 = 64;
            let groups = SKEW_GROUPS;
            let n = groups * 3;
            let config = spin_config(o, SLOTS, 20);
            crate::prepublish(&tokio_rt, transport.as_ref(), SLOTS, n, &|i| {
                Some(format!("group-{}", i % groups))
            })?;
            let (before, _) = rss_kib();
            let node = tokio_rt.block_on(Node::start(&config, transport, opts))?;
            let stats = node.stats();
            let t0 = Instant::now();
            let mut peak = 0;
            while stats.handled.load(Ordering::Relaxed) < n {
                peak = peak.max(rss_kib().0);
                if t0.elapsed() > Duration::from_secs(300) {
                    bail!("rss-loaded: not drained after 300 s");
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let (after, hwm) = rss_kib();
            tokio_rt.block_on(node.shutdown())?;
            json!({
                "rss_kib": peak, "hwm_kib": hwm, "before_start_kib": before, "after_drain_kib": after,
                "slots": SLOTS, "groups": groups, "messages": n,
            })
        }
        w => bail!("unknown rss probe {w:?}"),
    };
    println!("{out}");
    Ok(())
}

/// `rss-idle` / `rss-loaded`: run the probe in a child process (this
/// binary, `__rss-probe WHICH`) and report its figures.
pub fn rss(o: &Opts, name: &'static str, which: &str) -> anyhow::Result<Row> {
    let exe = std::env::current_exe().context("locating weir-bench for the RSS probe")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("__rss-probe")
        .arg(which)
        .args(["--slots", &o.slots.to_string(), "--workers", &o.workers.to_string()])
        .args(["--prefetch", &o.prefetch.to_string()])
        .arg("--out")
        .arg(&o.out)
        .stderr(std::process::Stdio::inherit());
    let (mut rss, mut hwm, mut before) = (Vec::new(), Vec::new(), Vec::new());
    let mut last = Value::Null;
    for r in 0..o.runs {
        let out = cmd.output().context("running the RSS probe")?;
        if !out.status.success() {
            bail!("{name}: the probe failed ({})", out.status);
        }
        let line = String::from_utf8_lossy(&out.stdout);
        let v: Value = serde_json::from_str(line.trim()).with_context(|| format!("{name}: probe said {line:?}"))?;
        let kib = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        eprintln!(
            "[weir-bench] {name:<10} run {}/{}: RSS {:.1} MiB (high-water {:.1} MiB, {:.1} MiB before Node::start)",
            r + 1,
            o.runs,
            kib("rss_kib") / 1024.0,
            kib("hwm_kib") / 1024.0,
            kib("before_start_kib") / 1024.0
        );
        rss.push(kib("rss_kib") / 1024.0);
        hwm.push(kib("hwm_kib") / 1024.0);
        before.push(kib("before_start_kib") / 1024.0);
        last = v;
    }
    Ok(Row {
        name,
        messages: 0,
        runs_ns: Vec::new(),
        extra: vec![("rss_mib", rss), ("hwm_mib", hwm), ("before_start_mib", before)],
        note: match which {
            "idle" => format!(
                "a node on the memory broker, {} slots, noop handler, 1 s after start, nothing to do; child process",
                o.slots
            ),
            _ => format!(
                "64 slots, {} groups x 3 messages pre-published on the in-process memory broker (its backlog counts in \
                 `before_start`), guest spins 20 µs/msg; peak RSS sampled every 5 ms while draining; child process; {last}",
                SKEW_GROUPS
            ),
        },
    })
}

// ------------------------------------------------------------ latency ---

/// Publish and settle times of every latency message, ns since `start`.
struct Latencies {
    start: Instant,
    published: Vec<AtomicU64>,
    latency: Vec<AtomicU64>,
    settled: AtomicU64,
    other: AtomicU64,
}

impl SettleObserver for Latencies {
    fn settled(&self, id: &str, outcome: Outcome) {
        let Some(i) = id.strip_prefix("lat-").and_then(|i| i.parse::<usize>().ok()) else {
            return;
        };
        if outcome != Outcome::Handled {
            self.other.fetch_add(1, Ordering::Relaxed);
        }
        let now = u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        if let (Some(p), Some(l)) = (self.published.get(i), self.latency.get(i)) {
            l.store(now.saturating_sub(p.load(Ordering::Acquire)).max(1), Ordering::Release);
        }
        self.settled.fetch_add(1, Ordering::Release);
    }
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)] as f64
}

/// The broker a latency run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LatencyBroker {
    Memory,
    Rabbitmq,
    Nats,
}

impl LatencyBroker {
    fn label(self) -> &'static str {
        match self {
            Self::Memory => "memory broker",
            Self::Rabbitmq => "RabbitMQ",
            Self::Nats => "NATS JetStream",
        }
    }
}

/// `latency`, `latency-rabbitmq`, `latency-nats`: publish-to-handled
/// (settled) time at half of `peak` messages/s, paced by a publisher thread
/// of its own (its own connection on a real broker), against a running node.
/// Each tick publishes what is due concurrently, so a broker's confirm round
/// trip does not cap the rate.
pub fn latency(o: &Opts, name: &'static str, peak: f64, broker: LatencyBroker) -> anyhow::Result<Row> {
    let rate = o.latency_rate.unwrap_or(peak / 2.0);
    let n = ((rate * o.latency_seconds).round() as u64).max(1000);
    let tokio_rt = weir::sched::async_runtime()?;
    let memory = MemoryBroker::new();
    let (topo, config) = match broker {
        LatencyBroker::Memory => (
            TOPOLOGY.to_owned(),
            crate::bench_config(o.slots, o.prefetch, config::InstanceMode::Reuse, None),
        ),
        LatencyBroker::Rabbitmq => {
            let topo = crate::drain_topology();
            let cfg = crate::rabbit::weir_config(&o.amqp, &topo, o.slots, crate::prefetch_of(o), None);
            (topo, cfg)
        }
        LatencyBroker::Nats => {
            let topo = crate::drain_topology();
            let cfg = crate::natsb::weir_config(&o.nats, &topo, o.slots, crate::prefetch_of(o));
            (topo, cfg)
        }
    };
    let connect = {
        let (memory, amqp, nats) = (memory.clone(), o.amqp.clone(), o.nats.clone());
        move |who: &str| -> Arc<dyn Transport> {
            match broker {
                LatencyBroker::Memory => Arc::new(memory.clone()),
                LatencyBroker::Rabbitmq => Arc::new(weir::transport::rabbitmq::RabbitMq::new(&amqp, who)),
                LatencyBroker::Nats => Arc::new(weir::transport::nats::Nats::new(&nats, who)),
            }
        }
    };
    let transport = {
        let _enter = tokio_rt.enter();
        connect("weir-bench node")
    };
    let result = (|| {
        tokio_rt
            .block_on(transport.declare(&TopologySpec::new(&topo, o.slots)))
            .map_err(|e| anyhow::anyhow!("declare: {e}"))?;
        latency_run(o, name, &tokio_rt, &config, &topo, transport.clone(), &connect, rate, n)
    })();
    match broker {
        LatencyBroker::Memory => {}
        LatencyBroker::Rabbitmq => tokio_rt.block_on(crate::rabbit::cleanup(&o.amqp, &topo, o.slots)),
        LatencyBroker::Nats => tokio_rt.block_on(crate::natsb::cleanup(&o.nats, &topo)),
    }
    let mut row = result?;
    row.extra.push(("peak_msgs_per_s", vec![peak]));
    row.note = format!(
        "{}, {} slots, noop guest, {} groups; one publisher thread (own connection) paces at {} \
         (peak {peak:.0} msg/s), publishing what is due each 100 µs concurrently; latency = settle (ack) time - time \
         just before publish",
        broker.label(),
        match o.latency_rate {
            Some(r) => format!("{r:.0} msg/s (--latency-rate)"),
            None => "half the drain peak".to_owned(),
        },
        o.slots,
        o.groups
    );
    Ok(row)
}

/// Publish `msgs` at `rate` from this thread, through a connection of its own.
fn publish_paced(
    lat: &Latencies,
    connect: &(dyn Fn(&str) -> Arc<dyn Transport> + Send + Sync),
    topo: &str,
    slots: u32,
    msgs: &[weir::envelope::Envelope],
    rate: f64,
) -> anyhow::Result<Duration> {
    let n = msgs.len() as u64;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let _enter = rt.enter();
    let publisher = connect("weir-bench publisher");
    let t0 = Instant::now();
    let mut sent = 0u64;
    while sent < n {
        let due = ((t0.elapsed().as_secs_f64() * rate) as u64).min(n);
        if due <= sent {
            std::thread::sleep(Duration::from_micros(100));
            continue;
        }
        let batch = (sent..due).map(|i| {
            let at = u64::try_from(lat.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
            lat.published[i as usize].store(at, Ordering::Release);
            node::publish(publisher.as_ref(), topo, slots, &msgs[i as usize])
        });
        for (k, r) in rt.block_on(futures::future::join_all(batch)).into_iter().enumerate() {
            r.map_err(|e| anyhow::anyhow!("publish {}: {e}", sent + k as u64))?;
        }
        sent = due;
    }
    Ok(t0.elapsed())
}

#[allow(clippy::too_many_arguments)]
fn latency_run(
    o: &Opts,
    name: &'static str,
    tokio_rt: &tokio::runtime::Runtime,
    config: &Config,
    topo: &str,
    transport: Arc<dyn Transport>,
    connect: &(dyn Fn(&str) -> Arc<dyn Transport> + Send + Sync),
    rate: f64,
    n: u64,
) -> anyhow::Result<Row> {
    let lat = Arc::new(Latencies {
        start: Instant::now(),
        published: (0..n).map(|_| AtomicU64::new(0)).collect(),
        latency: (0..n).map(|_| AtomicU64::new(0)).collect(),
        settled: AtomicU64::new(0),
        other: AtomicU64::new(0),
    });
    let opts = NodeOptions {
        workers: o.workers,
        runtime: crate::node_runtime(o.out.parent().map(|p| p.join("cache"))),
        settle_observer: Some(lat.clone()),
        ..NodeOptions::default()
    };
    let node = tokio_rt.block_on(Node::start(config, transport, opts))?;
    // Prepare the messages first so the publisher only paces and publishes.
    let msgs: Vec<_> = (0..n)
        .map(|i| {
            let mut m = crate::message(i, crate::default_group(o, i));
            m.id = format!("lat-{i}");
            m
        })
        .collect();
    let slots = o.slots;
    let failed = std::sync::atomic::AtomicBool::new(false);
    let published_in = std::thread::scope(|scope| {
        let publisher = std::thread::Builder::new()
            .name("bench-publisher".into())
            .spawn_scoped(scope, || {
                let r = publish_paced(&lat, connect, topo, slots, &msgs, rate);
                if r.is_err() {
                    failed.store(true, Ordering::Release);
                }
                r
            })?;
        let t0 = Instant::now();
        while lat.settled.load(Ordering::Acquire) < n
            && !failed.load(Ordering::Acquire)
            && t0.elapsed() < Duration::from_secs(600)
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        publisher
            .join()
            .map_err(|_| anyhow::anyhow!("{name}: the publisher thread panicked"))?
    });
    let settled = lat.settled.load(Ordering::Acquire);
    tokio_rt.block_on(node.shutdown())?;
    let published_in = published_in?;
    if settled < n {
        bail!("{name}: only {settled} of {n} settled after 600 s");
    }
    if lat.other.load(Ordering::Relaxed) > 0 {
        bail!(
            "{name}: {} messages were not handled",
            lat.other.load(Ordering::Relaxed)
        );
    }
    let mut v: Vec<u64> = lat.latency.iter().map(|l| l.load(Ordering::Acquire)).collect();
    v.sort_unstable();
    let us = |p: f64| percentile(&v, p) / 1e3;
    let achieved = n as f64 / published_in.as_secs_f64();
    eprintln!(
        "[weir-bench] {name:<10} {n} msgs at {achieved:.0} msg/s (asked {rate:.0}): p50 {:.0} µs, p90 {:.0} µs, p99 {:.0} µs, p99.9 {:.0} µs, max {:.0} µs",
        us(0.5),
        us(0.9),
        us(0.99),
        us(0.999),
        us(1.0)
    );
    Ok(Row {
        name,
        messages: n,
        runs_ns: vec![1e9 / achieved],
        extra: vec![
            ("p50_us", vec![us(0.5)]),
            ("p90_us", vec![us(0.9)]),
            ("p99_us", vec![us(0.99)]),
            ("p999_us", vec![us(0.999)]),
            ("max_us", vec![us(1.0)]),
            ("rate_msgs_per_s", vec![achieved]),
        ],
        note: String::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_puts_most_weight_on_low_ranks() {
        let z = Zipf::new(SKEW_GROUPS, ZIPF_S);
        assert!(z.top_share() > 0.1 && z.top_share() < 0.2);
        assert_eq!(z.rank(0.0), 0);
        assert_eq!(z.rank(1.0), 9_999);
        let low = (0..10_000u64).filter(|i| z.rank(unit(*i)) < 10).count();
        assert!(low > 3_000, "{low}");
    }
}
