//! The admin listener: binds `node.admin`, builds the routes, accepts at
//! most `node.admin_max_connections` connections, each with a header-read
//! timeout and a write timeout of the same length; at the stop, finishes
//! the open requests.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::routing::{get, post};
use tokio::sync::watch;

use super::dead_letters;
use super::limits::Limits;
use super::metrics::{metrics, open_metrics};
use super::routes::{deploy, handler, handlers, ready, rollback, slots};
use super::state::AdminState;
use super::write_timeout::WriteTimeout;

/// Serve until `stop` turns true.
pub async fn serve(
    addr: SocketAddr,
    state: Arc<AdminState>,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let listener = bind("node.admin", addr).await?;
    tracing::info!(%addr, "admin listener up");
    clear_spool(&state.limits);
    let limits = state.limits.clone();
    let app = Router::new()
        .route("/", get(super::dashboard::page))
        .route("/v1/whoami", get(super::dashboard::whoami))
        .route("/health", get(|| async { "ok\n" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/v1/slots", get(slots))
        .route("/v1/groups", get(super::routes::groups))
        .route("/v1/groups/{action}", post(super::routes::order_group))
        .route("/v1/handlers", get(handlers))
        .route("/v1/handlers/{name}", get(handler).put(deploy))
        .route("/v1/handlers/{name}/logs", get(super::routes::logs))
        .route("/v1/handlers/{name}/rollback", post(rollback))
        .route("/v1/handlers/{name}/promote", post(super::routes::promote))
        .route("/v1/topologies/{topology}/messages", post(super::messages::publish))
        .route("/v1/dead-letters", get(dead_letters::list))
        .route("/v1/dead-letters/redrive", post(dead_letters::redrive))
        .route("/v1/dead-letters/purge", post(dead_letters::purge))
        // Uploads are read by `deploy` itself, after the token is checked.
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(state);
    Ok(tokio::spawn(accept_loop(listener, app, limits, stop)))
}

/// Serve `node.metrics` until `stop` turns true: `GET /metrics` without a
/// token, `GET /health`, nothing else (404), with the admin listener's
/// connection bounds.
pub async fn serve_metrics(
    addr: SocketAddr,
    state: Arc<AdminState>,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let listener = bind("node.metrics", addr).await?;
    tracing::info!(%addr, "metrics listener up (no token: only /metrics and /health)");
    let limits = state.limits.clone();
    let app = Router::new()
        .route("/health", get(|| async { "ok\n" }))
        .route("/metrics", get(open_metrics))
        .with_state(state);
    Ok(tokio::spawn(accept_loop(listener, app, limits, stop)))
}

/// Listen on `addr`, the value of the config key `key`.
async fn bind(key: &str, addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("{key} = \"{addr}\": cannot listen there"))
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
    // A response the client does not read is given up after the same
    // limit as a request's headers.
    let tcp = WriteTimeout::new(tcp, header_timeout);
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
