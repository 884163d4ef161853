//! The connection (made on first use, then kept: async-nats reconnects it
//! by itself), the transport's shared state, and publishing with `PubAck`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use parking_lot::Mutex;

use super::floor::FloorMonitor;
use super::wire::{headers_of, publish_err};
use crate::envelope::Wire;
use crate::transport::limits::Limits;
use crate::transport::{ErrorKind, Landed, TopologySpec, TransportError, redact_url};

/// JetStream's dedup header: a message whose id the stream saw within its
/// duplicate window is acknowledged (`duplicate: true`) and not stored.
pub(super) const NATS_MESSAGE_ID: &str = "Nats-Msg-Id";

/// `messaging.system` of this transport.
pub(super) const SYSTEM: &str = "nats";

/// `AckWait` of the ingress consumer: how long the ingress stalls when the
/// node holding its one unacknowledged message dies (the server then hands
/// it to another forwarder). Short, because a live forwarder keeps its hold
/// with in-progress signals every quarter of it while a forward is in
/// flight (module docs, "Ingress").
pub const INGRESS_ACK_WAIT: Duration = Duration::from_secs(5);
/// Expiry of one pull request. Short, because a drain waits for the open
/// request to end before it releases anything (module docs, "Pulling"); the
/// server's answer at expiry (408) is also the sign of life of an idle
/// consumer.
pub(super) const PULL_EXPIRES: Duration = Duration::from_secs(1);
/// Messages asked for in one pull request, at most.
pub(super) const MAX_PULL_BATCH: u32 = 1024;
/// A pull request the server neither fulfilled nor ended this long after its
/// expiry ends the subscription (the supervisor subscribes again).
pub(super) const PULL_GRACE: Duration = Duration::from_secs(5);
/// Least time a failure count is kept (the bucket's `max_age`).
pub(super) const ATTEMPTS_MIN_AGE: Duration = Duration::from_secs(7 * 24 * 3600);
/// How often the client pings the server when the server has sent
/// nothing; the connection is given up after three unanswered intervals
/// (async-nats: more than two pings pending), so a server that hangs with its
/// sockets open is left for another of the cluster in about 6 s, where the
/// client's default (60 s) takes three minutes. The RabbitMQ transport's
/// heartbeat is the same guard.
pub(super) const PING_INTERVAL: Duration = Duration::from_secs(2);
/// Negative control for the stalled-server test, never for production: with
/// this environment variable set to `1` the connection keeps async-nats's
/// default ping interval (60 s), so a hung server holds the node for minutes.
pub const NEGATIVE_CONTROL_DEFAULT_PINGS: &str = "WEIR_NEGATIVE_CONTROL_DEFAULT_PINGS";
/// Timeout of every JetStream API request (stream and consumer info,
/// publish acks, double acks).
pub(super) const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Knobs of the NATS transport that are not in the config file.
#[derive(Debug, Clone)]
pub struct NatsOptions {
    /// How often each slot consumer's ack floor is read.
    pub floor_poll: Duration,
    /// Stall age from which the floor monitor warns; `None`: derived from the
    /// topology's schedule (the time its last delivery comes after the first,
    /// plus `AckWait`, at least a minute), since a message on the ladder
    /// holds the floor legitimately that long.
    pub floor_warn_after: Option<Duration>,
    /// `transport.replicas`: the replicas of every stream Weir creates (the
    /// work and dead-letter streams, the failure-count bucket). Checked
    /// against the cluster's size before anything is created.
    pub replicas: usize,
    /// Whether cascades carry their id as `Nats-Msg-Id` (the server drops a
    /// rerun's copy within the stream's duplicate window). Always true but
    /// in a test's negative control, which shows the copy landing twice.
    pub cascade_msg_ids: bool,
    /// `AckWait` of the ingress consumer ([`INGRESS_ACK_WAIT`]); another
    /// value only in a test's negative control (the old 30 s).
    pub ingress_ack_wait: Duration,
}

impl Default for NatsOptions {
    fn default() -> Self {
        Self {
            floor_poll: Duration::from_secs(5),
            floor_warn_after: None,
            replicas: 1,
            cascade_msg_ids: true,
            ingress_ack_wait: INGRESS_ACK_WAIT,
        }
    }
}

/// `urls` with credentials hidden, for logs and errors.
fn shown(urls: &[String]) -> String {
    urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>().join(", ")
}

/// A client of the server at any of `urls` (the nodes of a cluster, tried in
/// the order given), as every part of Weir connects: pings every
/// [`PING_INTERVAL`], reconnects for ever with a short backoff, requests
/// bounded by [`REQUEST_TIMEOUT`]. `name` is the connection name the server
/// shows. One attempt: callers own the backoff of the first connect.
pub async fn connect(urls: &[String], name: &str) -> Result<async_nats::Client, TransportError> {
    let mut options = async_nats::ConnectOptions::new();
    if std::env::var(NEGATIVE_CONTROL_DEFAULT_PINGS).is_ok_and(|v| v == "1") {
        tracing::error!(
            "{NEGATIVE_CONTROL_DEFAULT_PINGS}=1: a hung server is noticed only after minutes (a test's negative control; never in production)"
        );
    } else {
        options = options.ping_interval(PING_INTERVAL);
    }
    options
        .name(name)
        .connection_timeout(REQUEST_TIMEOUT)
        .request_timeout(Some(REQUEST_TIMEOUT))
        .max_reconnects(None)
        .reconnect_delay_callback(|attempts| {
            Duration::from_millis(100u64.saturating_mul(1 << attempts.min(5)).min(2_000))
        })
        .event_callback(|event| async move {
            tracing::info!(messaging.system = SYSTEM, %event, "connection event");
        })
        .retain_servers_order()
        .connect(urls)
        .await
        .map_err(|e| TransportError::new(ErrorKind::Connection, format!("connecting to {}: {e}", shown(urls))))
}

/// A live connection. async-nats reconnects it by itself, so once made it is
/// kept for the transport's life.
#[derive(Clone)]
pub(super) struct Conn {
    pub(super) client: async_nats::Client,
    pub(super) js: jetstream::Context,
}

pub(super) struct Inner {
    /// The servers (a cluster's nodes); async-nats fails over between them.
    pub(super) urls: Vec<String>,
    pub(super) name: String,
    pub(super) options: NatsOptions,
    pub(super) conn: tokio::sync::Mutex<Option<Conn>>,
    pub(super) topologies: Mutex<HashMap<String, TopologySpec>>,
    /// The failure-count bucket of each declared topology.
    pub(super) attempts: Mutex<HashMap<String, kv::Store>>,
    pub(super) floor: Arc<FloorMonitor>,
}

/// The NATS JetStream transport. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct Nats {
    pub(super) inner: Arc<Inner>,
}

impl Nats {
    /// A transport for the server at `url` (`nats://…`); `name` is the
    /// connection name the server shows. Nothing connects until first use.
    pub fn new(url: impl Into<String>, name: impl Into<String>) -> Self {
        Self::with_options(url, name, NatsOptions::default())
    }

    /// [`Nats::new`] with options.
    pub fn with_options(url: impl Into<String>, name: impl Into<String>, options: NatsOptions) -> Self {
        Self::with_urls(vec![url.into()], name, options)
    }

    /// A transport for a server reachable at any of `urls` (the nodes of a
    /// cluster, tried in the order given; async-nats then reconnects to any
    /// of them, and to the servers the cluster tells it about).
    pub fn with_urls(urls: Vec<String>, name: impl Into<String>, options: NatsOptions) -> Self {
        Self {
            inner: Arc::new(Inner {
                urls,
                name: name.into(),
                options,
                conn: tokio::sync::Mutex::new(None),
                topologies: Mutex::new(HashMap::new()),
                attempts: Mutex::new(HashMap::new()),
                floor: Arc::new(FloorMonitor::default()),
            }),
        }
    }

    /// The floor monitor fed by this transport's pollers.
    pub fn floor(&self) -> Arc<FloorMonitor> {
        self.inner.floor.clone()
    }

    /// The connection, made on first use. One attempt: callers own the
    /// backoff. Later outages are ridden out by async-nats's own reconnect.
    pub(super) async fn conn(&self) -> Result<Conn, TransportError> {
        let mut guard = self.inner.conn.lock().await;
        if let Some(c) = guard.as_ref() {
            return Ok(c.clone());
        }
        let shown = self.shown_urls();
        let client = connect(&self.inner.urls, &self.inner.name).await?;
        let js = jetstream::new(client.clone());
        tracing::info!(messaging.system = SYSTEM, url = %shown, "connected");
        let conn = Conn { client, js };
        *guard = Some(conn.clone());
        Ok(conn)
    }

    /// The URLs with credentials hidden, for logs and errors.
    pub(super) fn shown_urls(&self) -> String {
        shown(&self.inner.urls)
    }

    pub(super) fn spec(&self, topology: &str) -> Result<TopologySpec, TransportError> {
        self.inner.topologies.lock().get(topology).cloned().ok_or_else(|| {
            TransportError::new(
                ErrorKind::Invalid,
                format!("topology `{topology}` is not declared on this transport; declare it first"),
            )
        })
    }

    /// Publish and wait for the stream's `PubAck`. Nothing goes out unless
    /// it fits NATS's header rules and the server's `max_payload`
    /// ([`limits`]): with `fit` (dead letters) what does not is repaired and
    /// cut with a marker, otherwise it is an [`ErrorKind::Invalid`] error
    /// naming the header. With `msg_id` the message carries it as
    /// `Nats-Msg-Id` (replacing any such header it had), and a `PubAck` that
    /// reports a duplicate is [`Landed::Duplicate`].
    pub(super) async fn publish_to(
        &self,
        subject: String,
        mut wire: Wire,
        target: &str,
        fit: bool,
        msg_id: Option<&str>,
    ) -> Result<Landed, TransportError> {
        let conn = self.conn().await?;
        if let Some(id) = msg_id {
            wire.headers.retain(|(k, _)| !k.eq_ignore_ascii_case(NATS_MESSAGE_ID));
            wire.headers.push((NATS_MESSAGE_ID.to_owned(), id.to_owned()));
        }
        let limits = Limits::nats(conn.client.max_payload());
        if fit {
            for note in limits.fit(&mut wire) {
                tracing::warn!(
                    messaging.system = SYSTEM,
                    target,
                    change = note,
                    "a dead letter did not fit the server's header rules; written with a marker"
                );
            }
        }
        let invalid = |e: String| TransportError::new(ErrorKind::Invalid, format!("not published to {target}: {e}"));
        limits.check(&wire).map_err(invalid)?;
        let headers = headers_of(&wire).map_err(invalid)?;
        let pending = conn
            .js
            .publish_with_headers(subject, headers, Bytes::from(wire.body))
            .await
            .map_err(|e| publish_err(target, &e))?;
        let ack = pending.await.map_err(|e| publish_err(target, &e))?;
        Ok(if ack.duplicate {
            Landed::Duplicate
        } else {
            Landed::Stored
        })
    }
}
