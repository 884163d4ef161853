//! `weir-bench hostile`: a well-behaved tenant's throughput next to each hostile guest of
//! issue 15, against its solo throughput, and the process's peak resident memory.
//!
//! The runtime as a node runs it (worker pool sized to the cores, fair share on, the node's
//! default per-call budgets, a log subscriber writing to a sink so log floods cost what
//! formatting costs), without a broker: the good tenant keeps `2 × workers` lanes busy with
//! 1 ms calls of the faulty guest (`slow 1`); two hostile lanes keep resubmitting one hostile
//! behaviour each, with a 2 s timeout. Rows: `solo`, then one per behaviour with the ratio to
//! `solo` (target ≥ 0.8) and the resident-memory peak sampled every 10 ms (bound: 512 MiB
//! above the solo run's).
//!
//! Usage: `weir-bench hostile [--seconds S] [--workers N]`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use weir::envelope::{self, Envelope};
use weir::runtime::pool::WorkerPool;
use weir::runtime::{HandlerSettings, HandlerVersion, Runtime, RuntimeOptions};

/// (row, message type, payload) of every hostile behaviour.
const HOSTILE: &[(&str, &str, &str)] = &[
    ("sleep-30s", "hostile.sleep", "30000"),
    ("spin-loop", "loop", ""),
    ("cascade-50MiB", "hostile.publish-ok", "1048576 50"),
    ("log-10MiB-line", "hostile.log-bytes", "10485760"),
    ("log-1M-lines", "hostile.log-lines", "1000000"),
    ("reject-1MiB", "hostile.reject-bytes", "1048576"),
    ("trap-100KiB", "hostile.panic-bytes", "102400"),
];

/// Resident memory of this process, bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn msg(message_type: &str, group: &str, payload: &str) -> Envelope {
    envelope::new_message(
        envelope::fresh_id(),
        message_type,
        Some(group.to_owned()),
        Some("tenant".to_owned()),
        Vec::new(),
        payload.as_bytes().to_vec(),
    )
}

/// Good calls per second with `hostile` running alongside (or alone), and the RSS peak.
fn run(
    pool: &Arc<WorkerPool>,
    good: &Arc<HandlerVersion>,
    bad: &Arc<HandlerVersion>,
    hostile: Option<(&str, &str)>,
    seconds: u64,
) -> anyhow::Result<(f64, u64)> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let stop = Arc::new(AtomicBool::new(false));
    let handled = Arc::new(AtomicU64::new(0));
    let peak = Arc::new(AtomicU64::new(rss()));
    let sampler = {
        let (stop, peak) = (stop.clone(), peak.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(rss(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let lanes = pool.size() * 2;
    let elapsed = rt.block_on(async {
        let mut tasks = Vec::new();
        for lane in 0..lanes {
            let (pool, good, stop, handled) = (pool.clone(), good.clone(), stop.clone(), handled.clone());
            tasks.push(tokio::spawn(async move {
                let group = format!("good-{lane}");
                while !stop.load(Ordering::Relaxed) {
                    if pool
                        .run_each(vec![(good.clone(), msg("slow", &group, "1"))], None)
                        .await
                        .is_ok()
                    {
                        handled.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
        if let Some((message_type, payload)) = hostile {
            for lane in 0..2 {
                let (pool, bad, stop) = (pool.clone(), bad.clone(), stop.clone());
                let (message_type, payload) = (message_type.to_owned(), payload.to_owned());
                tasks.push(tokio::spawn(async move {
                    let group = format!("bad-{lane}");
                    while !stop.load(Ordering::Relaxed) {
                        let _ = pool
                            .run_each(vec![(bad.clone(), msg(&message_type, &group, &payload))], None)
                            .await;
                    }
                }));
            }
        }
        let started = Instant::now();
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        let n = handled.load(Ordering::Relaxed);
        stop.store(true, Ordering::Relaxed);
        let elapsed = started.elapsed();
        for t in tasks {
            let _ = t.await;
        }
        (n, elapsed)
    });
    let _ = sampler.join();
    let (n, elapsed) = elapsed;
    Ok((n as f64 / elapsed.as_secs_f64(), peak.load(Ordering::Relaxed)))
}

/// `weir-bench hostile ...`.
pub fn main(mut args: impl Iterator<Item = String>) -> anyhow::Result<()> {
    let (mut seconds, mut workers) = (5u64, 0usize);
    while let Some(a) = args.next() {
        let mut value = |name: &str| -> anyhow::Result<u64> {
            let v = args.next().with_context(|| format!("{name} needs a value"))?;
            v.parse().with_context(|| format!("{name} {v:?} is not a number"))
        };
        match a.as_str() {
            "--seconds" => seconds = value("--seconds")?.max(1),
            "--workers" => workers = usize::try_from(value("--workers")?)?,
            other => bail!("unknown argument {other:?}; usage: weir-bench hostile [--seconds S] [--workers N]"),
        }
    }
    // Log floods are formatted and written, as on a node, but to a sink.
    tracing::subscriber::set_global_default(tracing_subscriber_sink()).context("installing the log sink")?;

    let bytes = std::fs::read(weir::node::bundled::FAULTY_PATH)
        .with_context(|| format!("reading the faulty guest at {}", weir::node::bundled::FAULTY_PATH))?;
    let runtime = Runtime::new(RuntimeOptions::default())?;
    let good = runtime.load(&bytes, HandlerSettings::new("good"), "faulty guest")?;
    let mut bad_settings = HandlerSettings::new("hostile");
    bad_settings.timeout = Duration::from_secs(2);
    let bad = runtime.load(&bytes, bad_settings, "faulty guest")?;
    let pool = Arc::new(WorkerPool::new(runtime, workers)?);

    let (solo, solo_rss) = run(&pool, &good, &bad, None, seconds)?;
    println!(
        "{:<16} {:>12} {:>7} {:>10}",
        "scenario", "good calls/s", "ratio", "peak RSS"
    );
    println!("{:<16} {:>12.0} {:>7} {:>7} MiB", "solo", solo, "1.00", solo_rss >> 20);
    let mut failed = Vec::new();
    for (row, message_type, payload) in HOSTILE {
        let (rate, peak) = run(&pool, &good, &bad, Some((message_type, payload)), seconds)?;
        let ratio = rate / solo;
        let ok = ratio >= 0.8 && peak <= solo_rss + (512 << 20);
        println!(
            "{row:<16} {rate:>12.0} {ratio:>7.2} {:>7} MiB{}",
            peak >> 20,
            if ok { "" } else { "  (below target)" }
        );
        if !ok {
            failed.push(*row);
        }
    }
    println!(
        "targets: ratio >= 0.80, peak RSS <= solo + 512 MiB; demoted calls {}, failing jobs backgrounded {}",
        pool.demoted(),
        pool.backgrounded()
    );
    if !failed.is_empty() {
        bail!("below target: {}", failed.join(", "));
    }
    Ok(())
}

fn tracing_subscriber_sink() -> impl tracing::Subscriber + Send + Sync {
    tracing_subscriber::fmt()
        .with_writer(std::io::sink)
        .with_max_level(tracing::Level::INFO)
        .finish()
}
