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
//! token: 401; a tenant token on an operator route: 403; a tenant token on
//! a handler that is not its tenant's, whether it exists or not: 404 with
//! one and the same body; an upload over `node.max_component_size`: 413; a
//! component that fails validation: 400 with the reason. A refused deploy
//! leaves the running version serving.
//!
//! Hostile clients are bounded: the request line and headers must arrive
//! within `node.admin_header_timeout` (which also closes idle connections),
//! an upload within `node.admin_body_timeout` with no pause longer than
//! `node.admin_idle_timeout` (else 408), at most `node.admin_max_connections`
//! connections are held (more are closed at once). Uploads are streamed to
//! a file (`node.data_dir/uploads`, else the system's temporary directory),
//! never held in memory while they arrive; at most `node.admin_max_uploads`
//! run at once (more: 503), `node.admin_max_uploads_per_caller` of them for
//! one token (more: 429), both with `Retry-After`. Each caller's deploys
//! compile in its own queue (see [`crate::registry`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt as _;
use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry as Metrics;
use tokio::io::AsyncWriteExt as _;
use tokio::sync::watch;

use crate::cluster::postgres::{self, SlotStatus, Status};
use crate::cluster::slots::SlotSet;
use crate::registry::{Caller, DeployError, DirGrant, Grants, Upload};
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
    /// What the listener allows a client.
    pub limits: Limits,
    /// Who may do what.
    pub auth: Auth,
}

/// The admin listener's bounds (`node.admin_*`, `node.max_component_size`).
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest upload `PUT /v1/handlers/{name}` reads.
    pub max_upload: usize,
    /// Request line and headers must arrive within this.
    pub header_timeout: Duration,
    /// An upload's body must arrive within this.
    pub body_timeout: Duration,
    /// Longest pause while an upload's body arrives.
    pub idle_timeout: Duration,
    /// Connections held at once.
    pub max_connections: usize,
    /// Uploads at once, and per caller.
    pub max_uploads: usize,
    /// Uploads one caller may have at once.
    pub max_uploads_per_caller: usize,
    /// Where uploads are spooled.
    pub upload_dir: PathBuf,
    uploads: Arc<Mutex<HashMap<String, usize>>>,
}

impl Limits {
    /// From `[node]`.
    pub fn from_config(config: &crate::config::Config) -> Self {
        let n = &config.node;
        Self {
            max_upload: usize::try_from(n.max_component_size.bytes()).unwrap_or(usize::MAX),
            header_timeout: n.admin_header_timeout,
            body_timeout: n.admin_body_timeout,
            idle_timeout: n.admin_idle_timeout,
            max_connections: n.admin_max_connections.max(1) as usize,
            max_uploads: n.admin_max_uploads.max(1) as usize,
            max_uploads_per_caller: n.admin_max_uploads_per_caller.max(1) as usize,
            upload_dir: n
                .data_dir
                .as_ref()
                .map_or_else(std::env::temp_dir, |d| d.join("uploads")),
            uploads: Arc::default(),
        }
    }

    /// A place among the uploads running now, or why not (503: the node's
    /// cap, 429: this caller's share).
    fn admit(&self, caller: &Caller) -> Result<UploadPermit, Box<Response>> {
        let key = match caller {
            Caller::Operator => "operator".to_owned(),
            Caller::Tenant(t) => format!("tenant:{t}"),
        };
        let mut running = self.uploads.lock();
        let total: usize = running.values().sum();
        let mine = running.get(&key).copied().unwrap_or(0);
        let busy = |status: StatusCode, why: String| {
            Box::new((status, [(header::RETRY_AFTER, RETRY_AFTER_SECS)], error_body(&why)).into_response())
        };
        if total >= self.max_uploads {
            return Err(busy(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "{total} uploads are running on this node, node.admin_max_uploads allows {}; retry later (the running version stays)",
                    self.max_uploads
                ),
            ));
        }
        if mine >= self.max_uploads_per_caller {
            return Err(busy(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "this token has {mine} uploads running, node.admin_max_uploads_per_caller allows {}; retry later (the running version stays)",
                    self.max_uploads_per_caller
                ),
            ));
        }
        *running.entry(key.clone()).or_default() += 1;
        Ok(UploadPermit {
            running: self.uploads.clone(),
            key,
        })
    }
}

/// Seconds a client told 503/429 should wait before trying again.
const RETRY_AFTER_SECS: &str = "5";

/// One running upload; counted until dropped.
struct UploadPermit {
    running: Arc<Mutex<HashMap<String, usize>>>,
    key: String,
}

impl Drop for UploadPermit {
    fn drop(&mut self) {
        let mut running = self.running.lock();
        if let Some(n) = running.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                running.remove(&self.key);
            }
        }
    }
}

/// An upload spooled to a file, removed when dropped.
struct Spooled {
    path: PathBuf,
    size: usize,
}

impl Drop for Spooled {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(file = %self.path.display(), error = %e, "cannot remove a spooled upload");
        }
    }
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
    stop: watch::Receiver<bool>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("node.admin = \"{addr}\": cannot listen there"))?;
    tracing::info!(%addr, "admin listener up");
    clear_spool(&state.limits);
    let limits = state.limits.clone();
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
    Ok(tokio::spawn(accept_loop(listener, app, limits, stop)))
}

/// Spooled uploads a crash left in `node.data_dir/uploads` (never in the
/// shared temporary directory, where they cannot be told from others').
fn clear_spool(limits: &Limits) {
    if limits.upload_dir == std::env::temp_dir() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(&limits.upload_dir) else {
        return;
    };
    for e in entries.filter_map(Result::ok) {
        if e.file_name().to_string_lossy().ends_with(".upload") {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    while !*stop.borrow() {
        if stop.changed().await.is_err() {
            return;
        }
    }
}

/// Accept connections, at most `limits.max_connections` at once (one more
/// is closed as soon as it is accepted: it holds no file descriptor), each
/// with hyper's header-read timeout. At `stop`: no new connections, the open
/// ones finish their request and close.
async fn accept_loop(listener: tokio::net::TcpListener, app: Router, limits: Limits, mut stop: watch::Receiver<bool>) {
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let refused = AtomicU64::new(0);
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, peer)) => {
                    let Ok(permit) = permits.clone().try_acquire_owned() else {
                        let n = refused.fetch_add(1, Ordering::Relaxed);
                        if n.is_power_of_two() || n == 0 {
                            tracing::warn!(%peer, refused = n + 1, max = limits.max_connections, "admin connection refused: node.admin_max_connections are open");
                        }
                        drop(tcp);
                        continue;
                    };
                    connections.spawn(connection(tcp, app.clone(), limits.header_timeout, stop.clone(), permit));
                }
                Err(e) => {
                    // Out of file descriptors, usually: wait for some to close.
                    tracing::warn!(error = %e, "admin listener cannot accept");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            () = stopped(&mut stop) => break,
        }
    }
    drop(listener);
    while connections.join_next().await.is_some() {}
}

async fn connection(
    tcp: tokio::net::TcpStream,
    app: Router,
    header_timeout: Duration,
    mut stop: watch::Receiver<bool>,
    _permit: tokio::sync::OwnedSemaphorePermit,
) {
    let service = hyper_util::service::TowerToHyperService::new(app);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_timeout);
    let conn = http.serve_connection(hyper_util::rt::TokioIo::new(tcp), service);
    tokio::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "admin connection closed");
            }
            return;
        }
        () = stopped(&mut stop) => conn.as_mut().graceful_shutdown(),
    }
    if let Err(e) = conn.await {
        tracing::debug!(error = %e, "admin connection closed");
    }
}

async fn ready(State(s): State<Arc<AdminState>>) -> Response {
    let failing = s.stats.failing();
    if !failing.is_empty() {
        let slots: Vec<String> = failing.iter().map(|((t, n), why)| format!("{t}/{n}: {why}")).collect();
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: slot runner failed, restarting: {}\n", slots.join("; ")),
        )
            .into_response();
    }
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
        Err(d) => return refuse(body, &s.limits, d.into_response()).await,
    };
    if let Err(e) = s.registry.access(&caller, &name) {
        return refuse(body, &s.limits, deploy_error(e)).await;
    }
    let grants = match parse_grants(query.as_deref()) {
        Ok(g) => g,
        Err(e) => {
            return refuse(
                body,
                &s.limits,
                (StatusCode::BAD_REQUEST, error_body(&e)).into_response(),
            )
            .await;
        }
    };
    let max = s.limits.max_upload;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(n) = declared.filter(|n| *n > max as u64) {
        let too_large = deploy_error(DeployError::TooLarge {
            size: usize::try_from(n).unwrap_or(usize::MAX),
            max,
        });
        return refuse(body, &s.limits, too_large).await;
    }
    let _permit = match s.limits.admit(&caller) {
        Ok(p) => p,
        Err(busy) => return refuse(body, &s.limits, *busy).await,
    };
    let spooled = match spool(body, &s.limits).await {
        Ok(f) => f,
        Err(refused) => return closing(refused),
    };
    let upload = Upload::File {
        path: spooled.path.clone(),
        size: spooled.size,
    };
    let result = s.registry.deploy_from(&caller, &name, upload, grants, "admin").await;
    drop(spooled);
    match result {
        Ok(d) => axum::Json(d).into_response(),
        Err(e) => {
            tracing::warn!(handler = %name, error = %e, "deploy refused; the running version stays");
            deploy_error(e)
        }
    }
}

/// `response`, and close the connection after it (the rest of a request
/// body is not read).
fn closing(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::CONNECTION, axum::http::HeaderValue::from_static("close"));
    response
}

/// Of a refused upload, the bytes read and thrown away before answering.
const DRAIN_MAX: usize = 4 << 20;
/// The longest a refused upload is drained.
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// Answer a refused upload with `response` after reading and discarding
/// up to [`DRAIN_MAX`] bytes of its body for at most [`DRAIN_TIME`], so a
/// client that sends a small body before it reads sees the answer, not a
/// reset; what is left of a larger or slower body is not read (the
/// connection closes).
async fn refuse(body: axum::body::Body, limits: &Limits, response: Response) -> Response {
    let mut stream = body.into_data_stream();
    let deadline = tokio::time::Instant::now() + DRAIN_TIME.min(limits.idle_timeout);
    let mut seen = 0usize;
    loop {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(None) => return response,
            Ok(Some(Ok(chunk))) if seen + chunk.len() <= DRAIN_MAX => seen += chunk.len(),
            _ => return closing(response),
        }
    }
}

/// Stream an upload's body to a file in `limits.upload_dir`, within the
/// size cap and the body timeouts.
async fn spool(body: axum::body::Body, limits: &Limits) -> Result<Spooled, Response> {
    let store_error = |e: std::io::Error, path: &std::path::Path| {
        tracing::error!(file = %path.display(), error = %e, "cannot spool an upload");
        (
            StatusCode::SERVICE_UNAVAILABLE,
            error_body(&format!("cannot spool the upload to {}: {e}", path.display())),
        )
            .into_response()
    };
    if let Err(e) = tokio::fs::create_dir_all(&limits.upload_dir).await {
        return Err(store_error(e, &limits.upload_dir));
    }
    let mut spooled = Spooled {
        path: limits.upload_dir.join(format!("weir-{}.upload", uuid::Uuid::new_v4())),
        size: 0,
    };
    let mut file = match tokio::fs::File::create(&spooled.path).await {
        Ok(f) => f,
        Err(e) => return Err(store_error(e, &spooled.path)),
    };
    let timed_out = |why: String| (StatusCode::REQUEST_TIMEOUT, error_body(&why)).into_response();
    let deadline = tokio::time::Instant::now() + limits.body_timeout;
    let mut stream = body.into_data_stream();
    loop {
        let pause = tokio::time::Instant::now() + limits.idle_timeout;
        let next = match tokio::time::timeout_at(pause.min(deadline), stream.next()).await {
            Ok(next) => next,
            Err(_) if tokio::time::Instant::now() >= deadline => {
                return Err(timed_out(format!(
                    "the upload did not arrive within node.admin_body_timeout ({:?}); {} bytes came",
                    limits.body_timeout, spooled.size
                )));
            }
            Err(_) => {
                return Err(timed_out(format!(
                    "the upload paused longer than node.admin_idle_timeout ({:?}) after {} bytes",
                    limits.idle_timeout, spooled.size
                )));
            }
        };
        let chunk = match next {
            None => break,
            Some(Ok(chunk)) => chunk,
            Some(Err(e)) => {
                return Err((StatusCode::BAD_REQUEST, error_body(&format!("reading the upload: {e}"))).into_response());
            }
        };
        spooled.size += chunk.len();
        if spooled.size > limits.max_upload {
            let too_large = deploy_error(DeployError::TooLarge {
                size: spooled.size,
                max: limits.max_upload,
            });
            return Err(refuse(axum::body::Body::new(stream), limits, too_large).await);
        }
        if let Err(e) = file.write_all(&chunk).await {
            return Err(store_error(e, &spooled.path));
        }
    }
    if let Err(e) = file.flush().await {
        return Err(store_error(e, &spooled.path));
    }
    Ok(spooled)
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
            (
                "runner_panics",
                "Slot runner jobs that panicked (caught; the runner restarted).",
                s.runner_panics,
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
        let refused = ConstCounter::new(self.handlers.refused());
        refused.encode(encoder.encode_descriptor(
            "handler_deploys_refused",
            "Deploys refused (invalid, too large, grants refused, store failed); the running version stayed.",
            None,
            refused.metric_type(),
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
