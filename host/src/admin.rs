//! The admin HTTP listener (`[node] admin = "ADDR"`): `GET /health`,
//! `GET /ready`, `GET /metrics` (Prometheus text) and `GET /v1/slots`.
//! Read-only so far; deploys, rollbacks and tokens come with the handler
//! registry. Bind it to an address only operators reach.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context as _;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use crate::cluster::postgres::{self, SlotStatus, Status};
use crate::cluster::slots::SlotSet;
use crate::retry::capture::Reason;
use crate::stats::Stats;
use crate::transport::Transport;

/// What the admin routes read.
pub struct AdminState {
    /// This node's name.
    pub node: String,
    /// Outcome counters.
    pub stats: Arc<Stats>,
    /// The slots this node runs.
    pub slots: Arc<SlotSet>,
    /// The broker (lag per slot, ack floors).
    pub transport: Arc<dyn Transport>,
    /// The coordinator database, in `postgres` mode.
    pub coordinator: Option<sqlx::PgPool>,
    /// False while the node cannot take work (starting, fenced, stopping).
    pub ready: Arc<AtomicBool>,
}

/// Serve until `stop` turns true.
pub async fn serve(
    addr: SocketAddr,
    state: Arc<AdminState>,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("node.admin = \"{addr}\": cannot listen there"))?;
    tracing::info!(%addr, "admin listener up");
    let app = Router::new()
        .route("/health", get(|| async { "ok\n" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/v1/slots", get(slots))
        .with_state(state);
    Ok(tokio::spawn(async move {
        let shutdown = async move {
            while !*stop.borrow() {
                if stop.changed().await.is_err() {
                    break;
                }
            }
        };
        if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
            tracing::error!(error = %e, "admin listener failed");
        }
    }))
}

async fn ready(State(s): State<Arc<AdminState>>) -> Response {
    if s.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: starting, fenced or stopping\n",
        )
            .into_response()
    }
}

/// The slots as `weir status --json` shows them: the coordinator's view in
/// `postgres` mode, else this node's own slots; lag from the broker.
pub async fn slot_status(s: &AdminState) -> anyhow::Result<Status> {
    let mut status = match &s.coordinator {
        Some(pool) => postgres::status(pool).await?,
        None => Status {
            nodes: Vec::new(),
            slots: s
                .slots
                .running()
                .into_iter()
                .map(|(topology, slot)| SlotStatus {
                    topology,
                    slot,
                    owner: Some(s.node.clone()),
                    epoch: 0,
                    state: "assigned".into(),
                    lag: None,
                })
                .collect(),
        },
    };
    for slot in &mut status.slots {
        match s.transport.backlog(&slot.topology, slot.slot).await {
            Ok(lag) => slot.lag = lag,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read slot backlogs");
                break;
            }
        }
    }
    Ok(status)
}

async fn slots(State(s): State<Arc<AdminState>>) -> Response {
    match slot_status(&s).await {
        Ok(status) => axum::Json(status).into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("cannot read the slots: {e:#}\n"),
        )
            .into_response(),
    }
}

async fn metrics(State(s): State<Arc<AdminState>>) -> Response {
    let mut registry = Registry::with_prefix("weir");
    registry.register_collector(Box::new(Scrape {
        stats: s.stats.clone(),
        slots: s.slots.clone(),
        transport: s.transport.clone(),
    }));
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("encoding metrics: {e}\n")).into_response(),
    }
}

/// Reads the counters at scrape time.
struct Scrape {
    stats: Arc<Stats>,
    slots: Arc<SlotSet>,
    transport: Arc<dyn Transport>,
}

impl std::fmt::Debug for Scrape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Scrape")
    }
}

fn counter(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    labels: &[(&str, &str, u64)],
) -> std::fmt::Result {
    let probe = ConstCounter::new(0u64);
    let mut m = encoder.encode_descriptor(name, help, None, probe.metric_type())?;
    for (key, value, n) in labels {
        let labels = [(*key, *value)];
        ConstCounter::new(*n).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let s = self.stats.snapshot();
        counter(
            &mut encoder,
            "messages",
            "Settled deliveries by outcome.",
            &[
                ("outcome", "handled", s.handled),
                ("outcome", "retry-scheduled", s.retry_scheduled),
                ("outcome", "dead-lettered", s.dead_lettered.iter().map(|(_, n)| n).sum()),
                ("outcome", "stranded", s.stranded),
                ("outcome", "uncertain", s.uncertain),
                ("outcome", "requeued", s.requeued),
                ("outcome", "released", s.released),
            ],
        )?;
        let reasons: Vec<(Reason, u64)> = s.dead_lettered.to_vec();
        let by_reason: Vec<(&str, &str, u64)> = reasons.iter().map(|(r, n)| ("reason", r.as_str(), *n)).collect();
        counter(
            &mut encoder,
            "dead_letters",
            "Dead-letter captures by reason.",
            &by_reason,
        )?;
        let flushes: Vec<(&str, &str, u64)> = s
            .batch_flushes
            .iter()
            .map(|(r, n)| ("reason", r.as_str(), *n))
            .collect();
        counter(
            &mut encoder,
            "batches",
            "Batches handed to handle-batch, by why they ran.",
            &flushes,
        )?;
        let bounds: Vec<String> = s
            .batch_sizes
            .iter()
            .map(|(b, _)| {
                if *b == u64::MAX {
                    "+Inf".to_owned()
                } else {
                    b.to_string()
                }
            })
            .collect();
        let sizes: Vec<(&str, &str, u64)> = s
            .batch_sizes
            .iter()
            .zip(&bounds)
            .map(|((_, n), b)| ("size_at_most", b.as_str(), *n))
            .collect();
        counter(
            &mut encoder,
            "batches_by_size",
            "Batches by size bucket (members, inclusive upper bound; not cumulative).",
            &sizes,
        )?;
        for (name, help, n) in [
            (
                "batch_members",
                "Members of every batch handed to handle-batch.",
                s.batch_members,
            ),
            (
                "batch_replays",
                "Batches whose call trapped or timed out, replayed member by member.",
                s.batch_replays,
            ),
            (
                "batch_released",
                "Members of unstarted batches returned to the broker by a drain.",
                s.batch_released,
            ),
            (
                "ack_failures",
                "Acks whose confirmation failed (the message may come again).",
                s.ack_failures,
            ),
            ("cascaded", "Messages published by handlers, confirmed.", s.cascaded),
            (
                "guest_faults",
                "Guest calls that trapped, timed out or were interrupted.",
                s.faults,
            ),
        ] {
            let c = ConstCounter::new(n);
            c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        let owned = ConstGauge::new(i64::try_from(self.slots.running().len()).unwrap_or(i64::MAX));
        owned.encode(encoder.encode_descriptor(
            "slots_owned",
            "Slots this node consumes now.",
            None,
            owned.metric_type(),
        )?)?;
        let floors = self.transport.ack_floor();
        if !floors.is_empty() {
            let probe = ConstGauge::new(0.0f64);
            let mut m = encoder.encode_descriptor(
                "ack_floor_stall_seconds",
                "How long a JetStream slot consumer's ack floor has stood still while it had delivered past it (0: not stalled).",
                None,
                probe.metric_type(),
            )?;
            for f in floors {
                let slot = f.slot.to_string();
                let labels = [("topology", f.topology.as_str()), ("slot", slot.as_str())];
                ConstGauge::new(f.stalled_for.as_secs_f64()).encode(m.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}
