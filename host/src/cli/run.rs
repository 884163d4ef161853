//! `weir run`: one node until SIGTERM or SIGINT, then a drain.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;

use weir::config;
use weir::node::{Node, NodeOptions};
use weir::observe::journal::{self, Journal};

use super::{call, runtime};

/// Start the node of the config at `config`, and drain it on the first signal.
pub fn run(config: &Path) -> anyhow::Result<ExitCode> {
    let cfg = config::load(config)?;
    for w in cfg.validate().unwrap_or_default() {
        tracing::warn!(key = %w.key, "{}", w.message);
    }
    // Spans queued when the node stops are flushed when this drops,
    // after the drain.
    let _traces = weir::telemetry::init(&cfg.telemetry, &cfg.node.name)?;
    runtime()?.block_on(async {
        // Caught from here on: a SIGTERM while the node starts (its
        // slots may already be consuming) is answered with a drain
        // once it has started, never with the default exit.
        let late = std::env::var(NEGATIVE_CONTROL_LATE_SIGNALS).is_ok_and(|v| v == "1");
        let mut signals = if late {
            tracing::error!("{NEGATIVE_CONTROL_LATE_SIGNALS}=1: signals are caught only once the node has started (a test's negative control; never in production)");
            None
        } else {
            Some(Signals::install()?)
        };
        if std::env::var_os(HOLD_START).is_some() {
            tracing::info!("{HOLD_START}: holding the start until a line arrives on standard input");
            tokio::task::spawn_blocking(|| {
                let mut line = String::new();
                let _ = std::io::stdin().read_line(&mut line);
            })
            .await?;
        }
        let transport = weir::transport::connect::for_config(&cfg)?;
        let mut opts = NodeOptions::default();
        // Without a data directory, compiled code is kept where `weir call`
        // keeps it (the user's cache), so a restart does not compile again.
        if cfg.node.data_dir.is_none() {
            opts.runtime.cache_dir = call::cache_dir();
        }
        // A cluster-wide ledger for multi-process tests (see weir::observe::journal).
        if let Some(path) = std::env::var_os(journal::ENV) {
            let j = Arc::new(Journal::open(std::path::Path::new(&path), &cfg.node.name)?);
            opts.call_observer = Some(j.clone());
            opts.settle_observer = Some(j);
        }
        let node = Node::start(&cfg, transport.clone(), opts).await?;
        warn_unconsumed_static_slots(&cfg, transport.as_ref()).await;
        match signals.as_mut() {
            Some(signals) => signals.recv().await,
            None => wait_for_signal().await?,
        }
        drain(node).await
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Static mode: the slots of this node's topologies that it does not own
/// and that no consumer reads now are named at start (the config warning
/// already said another node must own them; this says none does yet).
async fn warn_unconsumed_static_slots(cfg: &config::Config, transport: &dyn weir::transport::Transport) {
    if cfg.cluster.mode != config::ClusterMode::Static {
        return;
    }
    let owned = cfg.cluster.owned_slots.clone().unwrap_or_default();
    for t in &cfg.topology {
        let mut idle = Vec::new();
        for slot in (0..t.slots).filter(|n| !owned.contains(n)) {
            match transport.consumers(&t.name, slot).await {
                Ok(Some(0)) => idle.push(slot),
                Ok(_) => {}
                Err(_) => return,
            }
        }
        if !idle.is_empty() {
            tracing::warn!(
                topology = %t.name,
                slots = ?idle,
                "no node consumes these slots now: their messages wait until a node with them in cluster.owned_slots starts"
            );
        }
    }
}

/// Leave: stop taking messages, let the calls in flight finish (saying
/// which, every second), start no other call (the rest of a job holding
/// several messages is released with what was queued), and exit. So the
/// drain lasts as long as the calls that were running when it began. A
/// second SIGINT or SIGTERM interrupts the calls still running: they go
/// back to the broker unfinished, like everything not started, and nothing
/// is lost.
async fn drain(node: Node) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let draining = node.draining();
    let running: i64 = draining.in_flight().iter().map(|(_, n)| n).sum();
    tracing::info!(
        running,
        "signal received: draining: {running} call(s) running finish, no other call starts, the rest goes back to \
         the broker (a second Ctrl-C interrupts the calls)"
    );
    let progress = {
        let draining = draining.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
            tick.tick().await;
            loop {
                tick.tick().await;
                let calls = draining.in_flight();
                let total: i64 = calls.iter().map(|(_, n)| n).sum();
                if total > 0 {
                    let each: Vec<String> = calls.iter().map(|(h, n)| format!("{h} ×{n}")).collect();
                    tracing::info!(
                        waited_s = started.elapsed().as_secs(),
                        "waiting for {total} call(s): {}",
                        each.join(", ")
                    );
                } else {
                    tracing::info!(
                        waited_s = started.elapsed().as_secs(),
                        "no call running; releasing the slots"
                    );
                }
            }
        })
    };
    let forced = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let force = {
        let (draining, forced) = (draining.clone(), forced.clone());
        tokio::spawn(async move {
            if wait_for_signal().await.is_ok() {
                forced.store(true, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(
                    "second signal: interrupting the calls still running; they go back to the broker unfinished \
                     (redelivered, not lost)"
                );
                draining.interrupt();
            }
        })
    };
    let reports = node.shutdown().await?;
    progress.abort();
    force.abort();
    let released: u64 = reports.iter().map(|r| r.released).sum();
    let finished: usize = reports.iter().map(|r| r.drained.len()).sum();
    tracing::info!(
        slots = reports.len(),
        finished,
        released,
        interrupted = forced.load(std::sync::atomic::Ordering::Relaxed),
        took_ms = started.elapsed().as_millis() as u64,
        "stopped: {} slot(s) drained, {finished} job(s) in flight finished{}, {released} message(s) this node held \
         but had not started went back to the broker; everything not acknowledged is delivered again",
        reports.len(),
        if forced.load(std::sync::atomic::Ordering::Relaxed) {
            " or were interrupted"
        } else {
            ""
        },
    );
    Ok(())
}

/// A test's barrier, never for production: with this variable set, `weir
/// run` holds its start (signals already caught) until a line arrives on
/// standard input.
const HOLD_START: &str = "WEIR_TEST_HOLD_START";

/// Negative control for that test, never for production: with this set to
/// `1`, signals are caught only once the node has started (as before the
/// fix), and a SIGTERM during the start ends the process without a drain.
const NEGATIVE_CONTROL_LATE_SIGNALS: &str = "WEIR_NEGATIVE_CONTROL_LATE_SIGNALS";

/// SIGTERM and SIGINT, caught from the moment this is made (until then a
/// SIGTERM ends the process at once, without a drain).
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
        })
    }

    /// The next SIGTERM or SIGINT (one that came since `install` counts).
    async fn recv(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

async fn wait_for_signal() -> anyhow::Result<()> {
    Signals::install()?.recv().await;
    Ok(())
}
