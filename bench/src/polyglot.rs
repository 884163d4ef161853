//! `weir-bench polyglot`: the orders handler in Rust, Python and JavaScript side by side.
//!
//! Per language: the component's size; Cranelift compile time (`precompile_component`,
//! no cache; wall and process CPU); load time from the compiled-code cache (what a node
//! restart pays); instantiation time (one fresh instance, measured as `Fresh` minus
//! `Reuse` per call, and directly as the first call on a new worker); the bare
//! per-message cost of `Executor::call` with a reused instance; and the end-to-end cost
//! on a node over the memory broker (wall and process CPU per message). The bare figures
//! are CPU time, so a loaded machine inflates them less than wall time. The message is `order.paid` (decode, validate, log; no cascade), so
//! every message is exactly one call of the handler under test.
//!
//! Components: the Rust one is bundled; the Python and JavaScript ones are where
//! `host/build.rs` puts them (`target/guests/{python,js}/orders.wasm`), or `--python`
//! and `--js`. Output: a table on stdout, JSON in `target/bench/polyglot.json`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use serde_json::json;

use weir::config::{self, Config};
use weir::envelope::{self, Envelope};
use weir::node;
use weir::runtime::{CallOutcome, Executor, HandlerSettings, HandlerVersion, InstanceMode, Runtime, RuntimeOptions};
use weir::transport::memory::MemoryBroker;
use weir::transport::{TopologySpec, Transport};

const TOPOLOGY: &str = "polyglot";

struct Opts {
    messages: u64,
    fresh_messages: u64,
    e2e_messages: u64,
    runs: usize,
    groups: u64,
    workers: usize,
    python: PathBuf,
    js: PathBuf,
    out: PathBuf,
}

fn usage() -> String {
    "usage: weir-bench polyglot [--messages N] [--fresh-messages N] [--e2e-messages N] [--runs N] \
     [--groups N] [--workers N] [--python PATH] [--js PATH] [--out PATH]"
        .into()
}

fn parse(args: impl Iterator<Item = String>) -> anyhow::Result<Opts> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut o = Opts {
        messages: 20_000,
        fresh_messages: 300,
        e2e_messages: 50_000,
        runs: 3,
        groups: 64,
        workers: 0,
        python: root.join("target/guests/python/orders.wasm"),
        js: root.join("target/guests/js/orders.wasm"),
        out: root.join("target/bench/polyglot.json"),
    };
    let mut args = args;
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(usage);
        let mut num =
            |name: &str| -> anyhow::Result<u64> { value()?.parse().with_context(|| format!("{name} takes a number")) };
        match a.as_str() {
            "--messages" => o.messages = num("--messages")?.max(1),
            "--fresh-messages" => o.fresh_messages = num("--fresh-messages")?.max(1),
            "--e2e-messages" => o.e2e_messages = num("--e2e-messages")?.max(1),
            "--runs" => o.runs = usize::try_from(num("--runs")?)?.max(1),
            "--groups" => o.groups = num("--groups")?.max(1),
            "--workers" => o.workers = usize::try_from(num("--workers")?)?,
            "--python" => o.python = PathBuf::from(value()?),
            "--js" => o.js = PathBuf::from(value()?),
            "--out" => o.out = PathBuf::from(value()?),
            "-h" | "--help" => {
                println!("{}", usage());
                std::process::exit(0);
            }
            s => bail!("unknown argument {s:?}\n{}", usage()),
        }
    }
    Ok(o)
}

/// One language's handler: what a `[[handler]]` entry names, and its bytes.
struct Guest {
    lang: &'static str,
    component: PathBuf,
    bytes: Vec<u8>,
}

fn guests(o: &Opts) -> anyhow::Result<Vec<Guest>> {
    let read = |lang: &'static str, path: &Path| -> anyhow::Result<Guest> {
        let bytes = std::fs::read(path).with_context(|| {
            format!(
                "reading the {lang} orders handler at {} (host/build.rs builds it: run `cargo build` first)",
                path.display()
            )
        })?;
        Ok(Guest {
            lang,
            component: path.to_owned(),
            bytes,
        })
    };
    Ok(vec![
        Guest {
            lang: "rust",
            component: "bundled:orders".into(),
            bytes: weir::node::bundled::ORDERS.to_vec(),
        },
        read("python", &o.python)?,
        read("js", &o.js)?,
    ])
}

/// `order.paid` number `i` in group `group`: a valid order of one line.
fn paid(i: u64, group: String) -> Envelope {
    let payload = format!(
        r#"{{"order_id":"o-{i:010}","customer":"{group}","currency":"EUR","lines":[{{"sku":"sku-{}","qty":{},"unit_price_cents":{}}}]}}"#,
        i % 97,
        1 + i % 5,
        100 + i % 900
    );
    envelope::new_message(
        envelope::fresh_id(),
        "order.paid",
        Some(group),
        Some("acme".into()),
        vec![("content-type".into(), "application/json".into())],
        payload.into_bytes(),
    )
}

fn load(rt: &Runtime, g: &Guest, mode: InstanceMode) -> anyhow::Result<Arc<HandlerVersion>> {
    let mut settings = HandlerSettings::new(format!("orders-{}", g.lang));
    settings.instance_mode = mode;
    rt.load(&g.bytes, settings, &g.component.display().to_string())
}

/// Mean CPU time of one `handle` call over `n` calls on one executor, seconds: process
/// CPU time, unlike wall time not inflated by other processes on a loaded machine. Only
/// this thread and the epoch tickers (one 5 ms tick each) run meanwhile.
fn per_call(exec: &mut Executor, v: &Arc<HandlerVersion>, msg: &Envelope, n: u64) -> anyhow::Result<f64> {
    let t = super::process_cpu_ns();
    for _ in 0..n {
        match exec.call(v, msg, &None) {
            CallOutcome::Done { result: Ok(()), .. } => {}
            other => bail!("{}: unexpected outcome {other:?}", v.name()),
        }
    }
    Ok(super::process_cpu_ns().saturating_sub(t) as f64 / 1e9 / n as f64)
}

/// End to end: `n` `order.paid` pre-published over `groups` groups on a memory broker;
/// wall time and process CPU time from `Node::start` (the handler loaded from the code
/// cache, milliseconds) until all are handled.
fn e2e_once(o: &Opts, g: &Guest, cache: &Path) -> anyhow::Result<(Duration, Duration)> {
    let tokio_rt = weir::sched::async_runtime()?;
    let handler = config::Handler::new("orders", &g.component, TOPOLOGY, vec!["order.paid".into()]);
    let cfg = Config {
        node: config::Node {
            name: "bench-polyglot".into(),
            admin: None,
            ..config::Node::default()
        },
        transport: config::Transport::default(),
        cluster: config::Cluster::default(),
        topology: vec![config::Topology::new(TOPOLOGY, 4)],
        handler: vec![handler],
        tenant: Vec::new(),
        telemetry: Default::default(),
        origin: "<weir-bench polyglot>".into(),
    };
    let broker = MemoryBroker::new();
    let transport: Arc<dyn Transport> = Arc::new(broker.clone());
    let n = o.e2e_messages;
    tokio_rt.block_on(async {
        transport
            .declare(&TopologySpec::new(TOPOLOGY, 4))
            .await
            .map_err(|e| anyhow::anyhow!("declare: {e}"))?;
        for i in 0..n {
            node::publish(
                transport.as_ref(),
                TOPOLOGY,
                4,
                &paid(i, format!("customer-{}", i % o.groups)),
            )
            .await
            .map_err(|e| anyhow::anyhow!("publish {i}: {e}"))?;
        }
        Ok::<_, anyhow::Error>(())
    })?;
    let cpu = super::process_cpu_ns();
    let label = format!("e2e {}", g.lang);
    let wall = tokio_rt.block_on(super::drain_with_weir(
        &label,
        &cfg,
        transport,
        o.workers,
        Some(cache.to_owned()),
        n,
    ))?;
    let cpu = Duration::from_nanos(super::process_cpu_ns().saturating_sub(cpu));
    if broker.total_depth(TOPOLOGY) != 0 {
        bail!("e2e {}: messages left on the broker", g.lang);
    }
    Ok((wall, cpu))
}

/// Run the comparison; `args` are those after `polyglot`.
pub fn main(args: impl Iterator<Item = String>) -> anyhow::Result<()> {
    let o = parse(args)?;
    let guests = guests(&o)?;
    let cache = o.out.parent().unwrap_or(Path::new(".")).join("polyglot-cache");
    let machine = super::machine();
    eprintln!(
        "[weir-bench] polyglot (runs {}, load {})",
        o.runs, machine["loadavg_at_start"]
    );
    let msg = paid(1, "customer-1".into());
    let mut rows = Vec::new();
    for g in &guests {
        // Compile: Cranelift on the whole component, nothing cached.
        let rt = Runtime::new(RuntimeOptions::default())?;
        let (t, cpu) = (Instant::now(), super::process_cpu_ns());
        let code = rt
            .engine()
            .precompile_component(&g.bytes)
            .map_err(|e| anyhow::anyhow!("compiling the {} handler: {e:#}", g.lang))?;
        let compile = t.elapsed().as_secs_f64();
        let compile_cpu = super::process_cpu_ns().saturating_sub(cpu) as f64 / 1e9;
        eprintln!(
            "[weir-bench] {:<6} compile {compile:.2} s, {compile_cpu:.2} CPU s ({} bytes of code)",
            g.lang,
            code.len()
        );

        // Load from the compiled-code cache (filled by the first load), as a restart does.
        let rt = Runtime::new(RuntimeOptions {
            cache_dir: Some(cache.clone()),
            ..RuntimeOptions::default()
        })?;
        load(&rt, g, InstanceMode::Reuse)?;
        let t = Instant::now();
        let reuse = load(&rt, g, InstanceMode::Reuse)?;
        let cached_load = t.elapsed().as_secs_f64();
        let fresh = load(&rt, g, InstanceMode::Fresh)?;

        let (mut first, mut bare, mut fresh_call) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..o.runs {
            // A new worker: its first call instantiates, the rest reuse.
            let mut exec = Executor::new(rt.clone());
            first.push(per_call(&mut exec, &reuse, &msg, 1)?);
            per_call(&mut exec, &reuse, &msg, o.messages / 10)?;
            bare.push(per_call(&mut exec, &reuse, &msg, o.messages)?);
            fresh_call.push(per_call(&mut exec, &fresh, &msg, o.fresh_messages)?);
            eprintln!(
                "[weir-bench] {:<6} run {}/{}: first call {:.0} µs, reuse {:.1} µs/msg, fresh {:.0} µs/msg",
                g.lang,
                r + 1,
                o.runs,
                first[r] * 1e6,
                bare[r] * 1e6,
                fresh_call[r] * 1e6
            );
        }
        let (mut e2e, mut e2e_cpu) = (Vec::new(), Vec::new());
        for r in 0..o.runs {
            let (wall, cpu) = e2e_once(&o, g, &cache)?;
            let us = wall.as_secs_f64() * 1e6 / o.e2e_messages as f64;
            let cpu_us = cpu.as_secs_f64() * 1e6 / o.e2e_messages as f64;
            eprintln!(
                "[weir-bench] {:<6} e2e run {}/{}: {} messages in {:.2} s = {us:.1} µs/msg, {cpu_us:.1} CPU µs/msg",
                g.lang,
                r + 1,
                o.runs,
                o.e2e_messages,
                wall.as_secs_f64()
            );
            e2e.push(us);
            e2e_cpu.push(cpu_us);
        }
        let us = |v: &[f64]| super::median(v) * 1e6;
        rows.push(json!({
            "language": g.lang,
            "component_bytes": g.bytes.len(),
            "compiled_bytes": code.len(),
            "compile_s": compile,
            "compile_cpu_s": compile_cpu,
            "cached_load_ms": cached_load * 1e3,
            "first_call_us": { "median": us(&first), "runs": first.iter().map(|s| s * 1e6).collect::<Vec<_>>() },
            "instantiate_us": us(&fresh_call) - us(&bare),
            "bare_reuse_us": { "median": us(&bare), "runs": bare.iter().map(|s| s * 1e6).collect::<Vec<_>>() },
            "bare_fresh_us": { "median": us(&fresh_call), "runs": fresh_call.iter().map(|s| s * 1e6).collect::<Vec<_>>() },
            "e2e_memory_us": { "median": super::median(&e2e), "runs": e2e },
            "e2e_memory_cpu_us": { "median": super::median(&e2e_cpu), "runs": e2e_cpu },
        }));
    }

    println!(
        "{:<7} {:>9} {:>10} {:>10} {:>12} {:>12} {:>12} {:>11} {:>11}",
        "handler",
        "size MiB",
        "compile s",
        "cached ms",
        "instant. µs",
        "1st call µs",
        "bare µs/msg",
        "e2e µs/msg",
        "e2e CPU µs"
    );
    for r in &rows {
        println!(
            "{:<7} {:>9.1} {:>10.2} {:>10.1} {:>12.0} {:>12.0} {:>12.1} {:>11.1} {:>11.1}",
            r["language"].as_str().unwrap_or("?"),
            r["component_bytes"].as_f64().unwrap_or(0.0) / f64::from(1u32 << 20),
            r["compile_s"].as_f64().unwrap_or(f64::NAN),
            r["cached_load_ms"].as_f64().unwrap_or(f64::NAN),
            r["instantiate_us"].as_f64().unwrap_or(f64::NAN),
            r["first_call_us"]["median"].as_f64().unwrap_or(f64::NAN),
            r["bare_reuse_us"]["median"].as_f64().unwrap_or(f64::NAN),
            r["e2e_memory_us"]["median"].as_f64().unwrap_or(f64::NAN),
            r["e2e_memory_cpu_us"]["median"].as_f64().unwrap_or(f64::NAN),
        );
    }
    let report = json!({
        "machine": machine,
        "message": "order.paid: decode, validate, log; no cascade",
        "options": {
            "messages": o.messages, "fresh_messages": o.fresh_messages, "e2e_messages": o.e2e_messages,
            "runs": o.runs, "groups": o.groups, "workers": o.workers,
        },
        "handlers": rows,
    });
    if let Some(dir) = o.out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(&o.out, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", o.out.display()))?;
    eprintln!("[weir-bench] wrote {}", o.out.display());
    Ok(())
}
