//! The slot supervisor: runs a slot's [`SlotRunner`] until the node stops,
//! and starts a new one (after a [`Backoff`]) when a runner ends without a
//! stop or panics; marks the slot failing meanwhile.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::FutureExt as _;
use tokio::sync::watch;

use super::backoff::{Backoff, stopping};
use super::runner::SlotRunner;
use super::{Pipeline, RunnerReport, SlotSettings, panic_text};
use crate::runtime::Interrupt;

/// The running runner's cancel flag; replaced each time its supervisor
/// starts a new runner (after a connection fault).
pub type CancelCell = Arc<parking_lot::Mutex<Arc<Interrupt>>>;

/// A slot marked failing counts as healthy again after its restarted runner
/// ran this long without failing.
const HEALTHY_AFTER: Duration = Duration::from_secs(10);

fn merge(total: &mut RunnerReport, r: RunnerReport) {
    total.received += r.received;
    total.released += r.released;
    total.drained.extend(r.drained);
}

/// Run a slot until the node stops. A runner whose subscription ends without
/// a stop (connection lost, consumer cancelled) has drained already; it is
/// started again after a backoff, which reconnects and re-declares.
pub async fn supervise_slot(
    p: Arc<Pipeline>,
    settings: SlotSettings,
    mut stop: watch::Receiver<bool>,
    cancel: CancelCell,
) -> anyhow::Result<RunnerReport> {
    let mut total = RunnerReport::default();
    let mut backoff = Backoff::default();
    let system = p.transport.system();
    loop {
        let started = Instant::now();
        let runner = SlotRunner::new(p.clone(), settings.clone());
        let interrupt = runner.cancel_handle();
        *cancel.lock() = interrupt.clone();
        let run = std::panic::AssertUnwindSafe(runner.run(stop.clone())).catch_unwind();
        tokio::pin!(run);
        // A slot marked failing is healthy again once its new runner has
        // run this long without failing.
        let mut healthy_at = p
            .stats
            .failing()
            .iter()
            .any(|((t, s), _)| **t == *settings.topology && *s == settings.slot)
            .then(|| tokio::time::Instant::now() + HEALTHY_AFTER);
        let result = loop {
            tokio::select! {
                r = &mut run => break r,
                () = tokio::time::sleep_until(healthy_at.unwrap_or_else(tokio::time::Instant::now)), if healthy_at.is_some() => {
                    healthy_at = None;
                    p.stats.clear_failing(&settings.topology, settings.slot);
                    tracing::info!(messaging.system = system, topology = %settings.topology, slot = settings.slot, "slot runner healthy again");
                }
            }
        };
        let result = match result {
            Ok(r) => r,
            Err(panic) => {
                // The runner itself panicked (not one of its jobs, which it
                // catches): interrupt whatever it had handed to a worker, so
                // nothing of it runs beside the redelivery.
                interrupt.cancel();
                let text = panic_text(panic.as_ref());
                p.stats.runner_panics.fetch_add(1, Ordering::Relaxed);
                p.stats.mark_failing(&settings.topology, settings.slot, &text);
                tracing::error!(messaging.system = system, topology = %settings.topology, slot = settings.slot, panic = %text, "slot runner panicked; restarting it");
                Err(anyhow::anyhow!("slot runner panicked: {text}"))
            }
        };
        let error = match result {
            Ok(r) => {
                merge(&mut total, r);
                None
            }
            Err(e) if stopping(&stop) => return Err(e),
            Err(e) => Some(e),
        };
        if stopping(&stop) {
            return Ok(total);
        }
        if started.elapsed() > Duration::from_secs(30) {
            backoff.reset();
        }
        tracing::warn!(
            messaging.system = system, topology = %settings.topology, slot = settings.slot,
            error = error.map(|e| format!("{e:#}")).unwrap_or_else(|| "subscription ended".into()),
            backoff = ?backoff.delay(), "slot runner stopped without a stop request; restarting"
        );
        if backoff.wait(&mut stop).await {
            return Ok(total);
        }
    }
}
