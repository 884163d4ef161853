//! The admin HTTP listener (`[node] admin = "ADDR"`): `GET /health`,
//! `GET /ready`, `GET /metrics` (Prometheus text), `GET /v1/slots`,
//! `GET /v1/handlers`, `PUT /v1/handlers/{name}` (body: component bytes;
//! optional grants `?env=NAME&dir=GUEST:HOST`) and
//! `POST /v1/handlers/{name}/rollback`.
//!
//! Bearer tokens: `node.admin_token` (the operator) may do everything; a
//! `[[tenant]] token` sees and changes only that tenant's handlers. `/health`
//! and `/ready` are open (probes). With no token configured at all, the
//! read-only routes are open and deploys are refused. Missing or unknown
//! token: 401; a tenant token on another tenant's handler or an operator
//! route: 403; an upload over `node.max_component_size`: 413; a component
//! that fails validation: 400 with the reason. A refused deploy leaves the
//! running version serving.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context as _;
use axum::Router;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry as Metrics;
use tokio::sync::watch;

use crate::cluster::postgres::{self, SlotStatus, Status};
use crate::cluster::slots::SlotSet;
use crate::registry::{Caller, DeployError, DirGrant, Grants};
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
    /// Handler versions.
    pub registry: Arc<crate::registry::Registry>,
    /// Largest upload `PUT /v1/handlers/{name}` reads (`node.max_component_size`).
    pub max_upload: usize,
    /// Who may do what.
    pub auth: Auth,
}

/// The tokens, kept as sha256 digests and compared digest to digest, so a
/// comparison's time says nothing about the secret.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    operator: Option<[u8; 32]>,
    tenants: Vec<([u8; 32], String)>,
}

fn token_digest(token: &str) -> [u8; 32] {
    use sha2::Digest as _;
    sha2::Sha256::digest(token.as_bytes()).into()
}

/// Why a request is refused before it does anything.
enum Denied {
    /// No credentials, or unknown ones.
    Unauthorized(&'static str),
    /// Known caller, not allowed here.
    Forbidden(String),
}

impl IntoResponse for Denied {
    fn into_response(self) -> Response {
        match self {
            Denied::Unauthorized(why) => (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                error_body(why),
            )
                .into_response(),
            Denied::Forbidden(why) => (StatusCode::FORBIDDEN, error_body(&why)).into_response(),
        }
    }
}

fn error_body(message: &str) -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({ "error": message }))
}

impl Auth {
    /// The operator token and every tenant's.
    pub fn from_config(config: &crate::config::Config) -> Self {
        Self {
            operator: config.node.admin_token.as_deref().map(token_digest),
            tenants: config
                .tenant
                .iter()
                .filter_map(|t| Some((token_digest(t.token.as_deref()?), t.name.clone())))
                .collect(),
        }
    }

    fn configured(&self) -> bool {
        self.operator.is_some() || !self.tenants.is_empty()
    }

    /// Who presented `headers`' bearer token. `None` with no tokens configured at all.
    fn caller(&self, headers: &HeaderMap) -> Result<Option<Caller>, Denied> {
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim);
        let Some(token) = presented else {
            return if self.configured() {
                Err(Denied::Unauthorized(
                    "missing bearer token (Authorization: Bearer TOKEN)",
                ))
            } else {
                Ok(None)
            };
        };
        let d = token_digest(token);
        if self.operator == Some(d) {
            return Ok(Some(Caller::Operator));
        }
        match self.tenants.iter().find(|(t, _)| *t == d) {
            Some((_, name)) => Ok(Some(Caller::Tenant(name.clone()))),
            None => Err(Denied::Unauthorized("unknown token")),
        }
    }

    /// Operator routes (metrics, slots): open only when no token is configured.
    fn operator(&self, headers: &HeaderMap) -> Result<(), Denied> {
        match self.caller(headers)? {
            None | Some(Caller::Operator) => Ok(()),
            Some(Caller::Tenant(t)) => Err(Denied::Forbidden(format!(
                "a tenant token ({t}) may only see and change its own handlers"
            ))),
        }
    }

    /// Reading handlers: everyone configured sees what is theirs; with no tokens, all.
    fn reader(&self, headers: &HeaderMap) -> Result<Caller, Denied> {
        Ok(self.caller(headers)?.unwrap_or(Caller::Operator))
    }

    /// Changing handlers: a token is always needed.
    fn writer(&self, headers: &HeaderMap) -> Result<Caller, Denied> {
        self.caller(headers)?.ok_or(Denied::Unauthorized(
            "deploys need a bearer token, and this node has none configured (node.admin_token, tenant.token)",
        ))
    }
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
        .route("/v1/handlers", get(handlers))
        .route("/v1/handlers/{name}", get(handler).put(deploy))
        .route("/v1/handlers/{name}/rollback", post(rollback))
        // Uploads are read by `deploy` itself, after the token is checked.
        .layer(axum::extract::DefaultBodyLimit::disable())
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

async fn slots(State(s): State<Arc<AdminState>>, headers: HeaderMap) -> Response {
    if let Err(d) = s.auth.operator(&headers) {
        return d.into_response();
    }
    match slot_status(&s).await {
        Ok(status) => axum::Json(status).into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("cannot read the slots: {e:#}\n"),
        )
            .into_response(),
    }
}

async fn handlers(State(s): State<Arc<AdminState>>, headers: HeaderMap) -> Response {
    match s.auth.reader(&headers) {
        Ok(caller) => axum::Json(serde_json::json!({ "handlers": s.registry.list(&caller) })).into_response(),
        Err(d) => d.into_response(),
    }
}

async fn handler(State(s): State<Arc<AdminState>>, Path(name): Path<String>, headers: HeaderMap) -> Response {
    let caller = match s.auth.reader(&headers) {
        Ok(c) => c,
        Err(d) => return d.into_response(),
    };
    if let Err(e) = s.registry.access(&caller, &name) {
        return deploy_error(e);
    }
    match s.registry.list(&caller).into_iter().find(|h| h.name == name) {
        Some(h) => axum::Json(h).into_response(),
        None => deploy_error(DeployError::UnknownHandler(name)),
    }
}

fn deploy_error(e: DeployError) -> Response {
    let status = match &e {
        DeployError::UnknownHandler(_) | DeployError::NotVisible(_) => StatusCode::NOT_FOUND,
        DeployError::Forbidden(_) => StatusCode::FORBIDDEN,
        DeployError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        DeployError::Invalid(_) => StatusCode::BAD_REQUEST,
        DeployError::NoPrevious(_) => StatusCode::CONFLICT,
        DeployError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    (status, error_body(&e.to_string())).into_response()
}

/// `?env=NAME&dir=GUEST:HOST`, repeatable; `None` when neither is given.
fn parse_grants(query: Option<&str>) -> Result<Option<Grants>, String> {
    let Some(q) = query.filter(|q| !q.is_empty()) else {
        return Ok(None);
    };
    let mut g = Grants::default();
    let mut any = false;
    for (k, v) in form_urlencoded::parse(q.as_bytes()) {
        match &*k {
            "env" => {
                any = true;
                g.env.push(v.into_owned());
            }
            "dir" => {
                any = true;
                let (guest, host) = v
                    .split_once(':')
                    .ok_or_else(|| format!("dir={v:?}: accepted: GUEST:HOST, e.g. /data:/srv/acme/data"))?;
                g.dirs.push(DirGrant {
                    guest: guest.to_owned(),
                    host: host.into(),
                });
            }
            "grants" if v == "none" => any = true,
            other => {
                return Err(format!(
                    "unknown query parameter {other:?}; accepted: env, dir, grants=none"
                ));
            }
        }
    }
    Ok(any.then_some(g))
}

async fn deploy(
    State(s): State<Arc<AdminState>>,
    Path(name): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let caller = match s.auth.writer(&headers) {
        Ok(c) => c,
        Err(d) => return d.into_response(),
    };
    if let Err(e) = s.registry.access(&caller, &name) {
        return deploy_error(e);
    }
    let grants = match parse_grants(query.as_deref()) {
        Ok(g) => g,
        Err(e) => return (StatusCode::BAD_REQUEST, error_body(&e)).into_response(),
    };
    let max = s.max_upload;
    let bytes = match axum::body::to_bytes(body, max).await {
        Ok(b) => b,
        Err(e) => {
            let mut too_large = false;
            let mut src: Option<&dyn std::error::Error> = Some(&e);
            while let Some(x) = src {
                too_large |= x.to_string().contains("length limit exceeded");
                src = x.source();
            }
            return if too_large {
                deploy_error(DeployError::TooLarge { size: max + 1, max })
            } else {
                (StatusCode::BAD_REQUEST, error_body(&format!("reading the upload: {e}"))).into_response()
            };
        }
    };
    match s.registry.deploy(&caller, &name, bytes.to_vec(), grants, "admin").await {
        Ok(d) => axum::Json(d).into_response(),
        Err(e) => {
            tracing::warn!(handler = %name, error = %e, "deploy refused; the running version stays");
            deploy_error(e)
        }
    }
}

async fn rollback(State(s): State<Arc<AdminState>>, Path(name): Path<String>, headers: HeaderMap) -> Response {
    let caller = match s.auth.writer(&headers) {
        Ok(c) => c,
        Err(d) => return d.into_response(),
    };
    match s.registry.rollback(&caller, &name).await {
        Ok(d) => axum::Json(d).into_response(),
        Err(e) => deploy_error(e),
    }
}

async fn metrics(State(s): State<Arc<AdminState>>, headers: HeaderMap) -> Response {
    if let Err(d) = s.auth.operator(&headers) {
        return d.into_response();
    }
    let mut registry = Metrics::with_prefix("weir");
    registry.register_collector(Box::new(Scrape {
        handlers: s.registry.clone(),
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
    handlers: Arc<crate::registry::Registry>,
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
        {
            let probe = ConstGauge::new(1i64);
            let mut m = encoder.encode_descriptor(
                "handler_version_info",
                "The version each handler runs now (sha256 of the component).",
                None,
                probe.metric_type(),
            )?;
            for h in self.handlers.list(&Caller::Operator) {
                let tenant = h.tenant.clone().unwrap_or_default();
                let labels = [
                    ("handler", h.name.as_str()),
                    ("tenant", tenant.as_str()),
                    ("digest", h.current.digest.as_str()),
                    ("source", h.current.source.as_str()),
                ];
                ConstGauge::new(1i64).encode(m.encode_family(&labels)?)?;
            }
        }
        let handler_metrics = self.handlers.metrics();
        {
            let probe = ConstCounter::new(0u64);
            let mut m = encoder.encode_descriptor(
                "handler_messages",
                "Settled deliveries by handler, tenant and outcome.",
                None,
                probe.metric_type(),
            )?;
            for (name, tenant, hm) in &handler_metrics {
                for (outcome, n) in hm.outcomes.snapshot() {
                    let labels = [
                        ("handler", *name),
                        ("tenant", tenant.unwrap_or("")),
                        ("outcome", outcome),
                    ];
                    ConstCounter::new(n).encode(m.encode_family(&labels)?)?;
                }
            }
        }
        {
            let probe = ConstCounter::new(0u64);
            let mut m = encoder.encode_descriptor(
                "slot_messages",
                "Settled deliveries by topology, slot and outcome.",
                None,
                probe.metric_type(),
            )?;
            for ((topology, slot), counters) in self.stats.slots() {
                let slot = slot.to_string();
                for (outcome, n) in counters.snapshot() {
                    let labels = [("topology", &*topology), ("slot", slot.as_str()), ("outcome", outcome)];
                    ConstCounter::new(n).encode(m.encode_family(&labels)?)?;
                }
            }
        }
        for (name, help, pick) in [
            (
                "lane_depth",
                "Deliveries taken from the broker and waiting in a slot's lanes.",
                0usize,
            ),
            (
                "lanes_running",
                "Lanes (groups) of a slot with a call running or queued for a worker.",
                1,
            ),
        ] {
            let probe = ConstGauge::new(0i64);
            let mut m = encoder.encode_descriptor(name, help, None, probe.metric_type())?;
            for ((topology, slot), counters) in self.stats.slots() {
                let slot = slot.to_string();
                let (queued, running) = counters.depth();
                let v = if pick == 0 { queued } else { running };
                let labels = [("topology", &*topology), ("slot", slot.as_str())];
                ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX)).encode(m.encode_family(&labels)?)?;
            }
        }
        {
            let probe = ConstGauge::new(0i64);
            let mut m = encoder.encode_descriptor(
                "handler_calls_in_flight",
                "Guest calls running now, by handler.",
                None,
                probe.metric_type(),
            )?;
            for (name, tenant, hm) in &handler_metrics {
                let labels = [("handler", *name), ("tenant", tenant.unwrap_or(""))];
                ConstGauge::new(hm.in_flight()).encode(m.encode_family(&labels)?)?;
            }
        }
        {
            let mut m = encoder.encode_descriptor(
                "handler_call_duration_seconds",
                "Guest call durations (handle and handle-batch), by handler.",
                None,
                prometheus_client::metrics::MetricType::Histogram,
            )?;
            for (name, tenant, hm) in &handler_metrics {
                let labels = [("handler", *name), ("tenant", tenant.unwrap_or(""))];
                let (sum, count, buckets) = hm.durations();
                let mut family = m.encode_family(&labels)?;
                family.encode_histogram::<prometheus_client::encoding::NoLabelSet>(sum, count, &buckets, None)?;
            }
        }
        let swaps = ConstCounter::new(self.handlers.swaps());
        swaps.encode(encoder.encode_descriptor(
            "handler_swaps",
            "Deploys and rollbacks that changed a handler's version on this node.",
            None,
            swaps.metric_type(),
        )?)?;
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
