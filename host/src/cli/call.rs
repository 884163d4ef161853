//! `weir call`: run a handler component once per message, with no broker,
//! under the limits and budgets a node gives it, and print what happened:
//! the outcome (ok, retry, reject, or a fault, which a node retries), every
//! cascade it published, its log lines and the time each call took.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use tracing_subscriber::layer::Context;

use weir::config::{self, Config};
use weir::envelope::{self, Envelope};
use weir::runtime::bindings::weir::handler::types::Failure;
use weir::runtime::{BatchOutcome, CallOutcome, Executor, HandlerVersion, Outgoing, Runtime, RuntimeOptions};

/// What `weir call` was asked.
pub struct Request {
    pub component: PathBuf,
    pub message_type: String,
    pub group: Option<String>,
    pub tenant: Option<String>,
    pub headers: Vec<(String, String)>,
    /// One payload, or one per line of a JSONL file.
    pub payloads: Vec<Vec<u8>>,
    pub config: BTreeMap<String, String>,
    pub batch: bool,
    pub timeout: Option<Duration>,
}

/// `k=v` of `--config` / `--header`.
pub fn pair(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_owned(), v.to_owned()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

/// The payloads: `--payload` text or `@FILE`, or each non-empty line of `--each FILE`.
pub fn payloads(payload: Option<&str>, each: Option<&Path>) -> anyhow::Result<Vec<Vec<u8>>> {
    if let Some(file) = each {
        let text = std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
        let lines: Vec<Vec<u8>> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.as_bytes().to_vec())
            .collect();
        if lines.is_empty() {
            bail!("{} has no lines: nothing to call", file.display());
        }
        return Ok(lines);
    }
    Ok(vec![match payload {
        Some(p) if p.starts_with('@') => {
            std::fs::read(&p[1..]).with_context(|| format!("--payload {p}: cannot read {}", &p[1..]))?
        }
        Some(p) => p.as_bytes().to_vec(),
        None => Vec::new(),
    }])
}

/// A guest log line, as the capture layer saw it.
struct Line {
    level: tracing::Level,
    text: String,
}

/// Collects the `weir::guest` events (the guest's `log` calls) so they are
/// printed with the call they belong to.
#[derive(Clone, Default)]
pub struct GuestLog(Arc<Mutex<Vec<Line>>>);

impl GuestLog {
    fn take(&self) -> Vec<Line> {
        self.0.lock().map(|mut v| std::mem::take(&mut *v)).unwrap_or_default()
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for GuestLog {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        if event.metadata().target() != "weir::guest" {
            return;
        }
        struct Text(String);
        impl tracing::field::Visit for Text {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    let _ = write!(self.0, "{value:?}");
                }
            }
        }
        let mut text = Text(String::new());
        event.record(&mut text);
        if let Ok(mut v) = self.0.lock() {
            v.push(Line {
                level: *event.metadata().level(),
                text: text.0,
            });
        }
    }
}

/// `XDG_CACHE_HOME/weir` or `~/.cache/weir`: compiled code, by digest.
pub(crate) fn cache_dir() -> Option<PathBuf> {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .map(|d| d.join("weir"))
}

pub(crate) fn show_payload(bytes: &[u8]) -> String {
    const SHOWN: usize = 200;
    match std::str::from_utf8(bytes) {
        Ok(t) if t.len() <= SHOWN => t.to_owned(),
        Ok(t) => {
            let mut cut = SHOWN;
            while !t.is_char_boundary(cut) {
                cut -= 1;
            }
            format!("{}… ({} bytes)", &t[..cut], bytes.len())
        }
        Err(_) => format!("({} bytes, not UTF-8)", bytes.len()),
    }
}

fn print_cascades(published: &[Outgoing]) {
    for o in published {
        let e = &o.envelope;
        println!(
            "  cascade  {}  group {}  {}",
            e.message_type,
            e.group_id.as_deref().unwrap_or("-"),
            show_payload(&e.payload)
        );
    }
}

fn print_logs(log: &GuestLog) {
    for l in log.take() {
        println!("  log      {:<5}  {}", l.level.as_str().to_lowercase(), l.text);
    }
}

/// One message's outcome line; true for `ok`.
fn print_outcome(result: &Result<(), Failure>, took: Duration) -> bool {
    let ms = took.as_secs_f64() * 1e3;
    match result {
        Ok(()) => println!("  outcome  ok  ({ms:.2} ms)"),
        Err(Failure::Retry(why)) => println!("  outcome  retry: {why}  ({ms:.2} ms)"),
        Err(Failure::Reject(why)) => println!("  outcome  reject: {why}  ({ms:.2} ms)"),
    }
    result.is_ok()
}

fn size(n: usize) -> String {
    match n {
        n if n < 1 << 20 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{:.1} MiB", n as f64 / (1 << 20) as f64),
    }
}

/// Run the calls; exit 0 when every message answered `ok`, 1 otherwise.
pub fn run(req: Request, log: &GuestLog) -> anyhow::Result<ExitCode> {
    let bytes = std::fs::read(&req.component).with_context(|| format!("cannot read {}", req.component.display()))?;
    let name = req
        .component
        .file_stem()
        .map_or_else(|| "handler".to_owned(), |s| s.to_string_lossy().into_owned());
    let mut handler = config::Handler::new(&name, &req.component, "call", vec![req.message_type.clone()]);
    handler.config = req.config.clone();
    handler.tenant = req.tenant.clone();
    if let Some(t) = req.timeout {
        handler.limits.timeout = t;
    }
    let cfg = Config {
        handler: vec![handler.clone()],
        telemetry: Default::default(),
        origin: "<weir call>".into(),
        ..Config::default()
    };
    let settings = weir::registry::handler_settings(&handler, &cfg);
    let rt = Runtime::new(RuntimeOptions {
        cache_dir: cache_dir(),
        max_memory: RuntimeOptions::default().max_memory.max(settings.memory_limit),
        budgets: cfg.node.budgets.to_runtime(),
        pool_instances: 4,
        ..RuntimeOptions::default()
    })?;
    eprintln!("loading {} ({}) …", req.component.display(), size(bytes.len()));
    let loaded = Instant::now();
    let version = rt.load(&bytes, settings, &req.component.display().to_string())?;
    eprintln!(
        "loaded `{name}` {} in {:.2} s (limits: memory {} MiB, timeout {:?})",
        &version.digest[..12],
        loaded.elapsed().as_secs_f64(),
        version.settings.memory_limit >> 20,
        version.settings.timeout
    );
    let messages: Vec<Envelope> = req
        .payloads
        .iter()
        .enumerate()
        .map(|(i, p)| {
            envelope::new_message(
                format!("call-{}", i + 1),
                req.message_type.clone(),
                req.group.clone(),
                req.tenant.clone(),
                req.headers.clone(),
                p.clone(),
            )
        })
        .collect();
    let mut exec = Executor::new(rt.clone());
    let all_ok = if req.batch {
        call_batch(&mut exec, &version, &messages, &req, log)
    } else {
        call_each(&mut exec, &version, &messages, log)
    };
    Ok(if all_ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `weir call --batch`: every message in one `handle-batch` call; whether all answered ok.
fn call_batch(
    exec: &mut Executor,
    version: &Arc<HandlerVersion>,
    messages: &[Envelope],
    req: &Request,
    log: &GuestLog,
) -> bool {
    let mut all_ok = true;
    println!(
        "batch of {}  {}  group {}",
        messages.len(),
        req.message_type,
        req.group.as_deref().unwrap_or("-")
    );
    let started = Instant::now();
    let outcome = exec.call_batch(version, messages, &None);
    let took = started.elapsed();
    print_logs(log);
    match outcome {
        BatchOutcome::Done {
            results,
            published,
            unattributed,
        } => {
            for (i, (m, r)) in messages.iter().zip(&results).enumerate() {
                println!("member {}  {}", i + 1, m.id);
                if let Some(p) = published.get(i) {
                    print_cascades(p);
                }
                all_ok &= print_outcome(r, took);
            }
            if !unattributed.is_empty() {
                println!("whole batch (published before any begin-member):");
                print_cascades(&unattributed);
            }
        }
        BatchOutcome::Fault(f) => {
            println!(
                "  outcome  fault (a node retries every member, one by one): {f}  ({:.2} ms)",
                took.as_secs_f64() * 1e3
            );
            all_ok = false;
        }
    }
    all_ok
}

/// `weir call`: each message in a call of its own; whether all answered ok.
fn call_each(exec: &mut Executor, version: &Arc<HandlerVersion>, messages: &[Envelope], log: &GuestLog) -> bool {
    let mut all_ok = true;
    for m in messages {
        println!(
            "message {}  {}  group {}",
            m.id,
            m.message_type,
            m.group_id.as_deref().unwrap_or("-")
        );
        let started = Instant::now();
        let outcome = exec.call(version, m, &None);
        let took = started.elapsed();
        print_logs(log);
        match outcome {
            CallOutcome::Done { result, published } => {
                print_cascades(&published);
                all_ok &= print_outcome(&result, took);
            }
            CallOutcome::Fault(f) => {
                println!(
                    "  outcome  fault (a node retries it): {f}  ({:.2} ms)",
                    took.as_secs_f64() * 1e3
                );
                all_ok = false;
            }
        }
    }
    all_ok
}
