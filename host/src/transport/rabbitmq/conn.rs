//! The connection (made on first use, re-made after a fault, re-declaring
//! every topology), the transport's shared state, and confirmed publishes.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering as AtomicOrdering};
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{Confirmation, Connection, ConnectionProperties};
use parking_lot::Mutex;

use super::declare::{declare_on, rungs};
use super::names;
use super::queue_type::{self, QueueType, Version};
use super::wire::{SYSTEM, lapin_err, properties};
use crate::envelope::Wire;
use crate::transport::limits::Limits;
use crate::transport::{ErrorKind, TopologySpec, TransportError, redact_url};

/// Heartbeat asked for when the URL names none: a dead peer is noticed
/// within about two intervals.
const DEFAULT_HEARTBEAT_SECS: u16 = 10;

/// A live connection and the channel every host publish goes through.
pub(super) struct Conn {
    pub(super) connection: Connection,
    pub(super) publisher: lapin::Channel,
}

impl Conn {
    pub(super) fn alive(&self) -> bool {
        self.connection.status().connected() && self.publisher.status().connected()
    }
}

pub(super) struct Inner {
    /// The broker's URLs (a cluster's nodes), each with a heartbeat: tried
    /// in order on every connect.
    pub(super) urls: Vec<String>,
    /// The same with credentials hidden, joined for logs and errors.
    pub(super) shown_url: String,
    /// `transport.queue_type`: the type of every queue declared.
    pub(super) queue_type: QueueType,
    /// The server version read at the last connect (quorum queues only).
    pub(super) version: Mutex<Option<Version>>,
    pub(super) name: String,
    pub(super) conn: tokio::sync::Mutex<Option<Arc<Conn>>>,
    pub(super) topologies: Mutex<HashMap<String, TopologySpec>>,
    /// Deferred deliveries (failed captures) since the last confirmed dead
    /// letter: the backoff before the next is returned grows with it.
    pub(super) defers: AtomicU32,
    /// Deliveries (queue, message id) whose retry could not be published
    /// because it does not fit the broker's header rules, with why: the
    /// next delivery of each is handed up undecodable, so it is
    /// dead-lettered instead of returned for ever.
    pub(super) unsendable: Mutex<HashMap<(Arc<str>, String), String>>,
}

/// The first backoff before a delivery whose capture failed is returned.
pub const DEFER_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// The longest such backoff.
pub const DEFER_BACKOFF_MAX: Duration = Duration::from_secs(5);

impl Inner {
    /// The backoff for one more deferred delivery: doubles from
    /// [`DEFER_BACKOFF_MIN`] with each failed capture in a row, up to
    /// [`DEFER_BACKOFF_MAX`].
    pub(super) fn defer_delay(&self) -> Duration {
        let n = self.defers.fetch_add(1, AtomicOrdering::Relaxed).min(16);
        DEFER_BACKOFF_MIN.saturating_mul(1 << n).min(DEFER_BACKOFF_MAX)
    }
}

/// The RabbitMQ transport. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct RabbitMq {
    pub(super) inner: Arc<Inner>,
}

/// `url` with a heartbeat interval unless it names one.
pub(super) fn with_heartbeat(url: &str) -> String {
    if url.contains("heartbeat=") {
        return url.to_owned();
    }
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}heartbeat={DEFAULT_HEARTBEAT_SECS}")
}

impl RabbitMq {
    /// A transport for the broker at `url` (`amqp://…`); `name` is shown as
    /// the connection name. Nothing connects until first use.
    pub fn new(url: impl Into<String>, name: impl Into<String>) -> Self {
        Self::with_settings(vec![url.into()], name, QueueType::Classic)
    }

    /// A transport for a broker reachable at any of `urls` (the nodes of a
    /// cluster, tried in order on every connect and reconnect), declaring
    /// queues of `queue_type` (`transport.queue_type`).
    pub fn with_settings(urls: Vec<String>, name: impl Into<String>, queue_type: QueueType) -> Self {
        Self {
            inner: Arc::new(Inner {
                shown_url: urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>().join(", "),
                urls: urls.iter().map(|u| with_heartbeat(u)).collect(),
                queue_type,
                version: Mutex::new(None),
                name: name.into(),
                conn: tokio::sync::Mutex::new(None),
                topologies: Mutex::new(HashMap::new()),
                defers: AtomicU32::new(0),
                unsendable: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The current connection, reconnecting (and re-declaring every known
    /// topology) when it is gone. One attempt: callers own the backoff.
    pub(super) async fn conn(&self) -> Result<Arc<Conn>, TransportError> {
        let mut guard = self.inner.conn.lock().await;
        if let Some(c) = guard.as_ref()
            && c.alive()
        {
            return Ok(c.clone());
        }
        let reconnect = guard.is_some();
        *guard = None;
        let (connection, url) = self.connect_any().await?;
        let shown = &redact_url(&url);
        let publisher = connection
            .create_channel()
            .await
            .map_err(|e| lapin_err(format!("opening the publish channel on {shown}"), &e))?;
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| lapin_err(format!("enabling publisher confirms on {shown}"), &e))?;
        if self.inner.queue_type == QueueType::Quorum {
            let version = queue_type::server_version(&url).await;
            if version.is_none() {
                tracing::warn!(
                    messaging.system = SYSTEM,
                    url = %shown,
                    "could not read the server version; transport.queue_type = \"quorum\" is checked by the declarations alone"
                );
            }
            *self.inner.version.lock() = version;
        }
        let conn = Arc::new(Conn { connection, publisher });
        let specs: Vec<TopologySpec> = self.inner.topologies.lock().values().cloned().collect();
        for spec in &specs {
            self.check_server(spec)?;
            declare_on(&conn.connection, spec, self.inner.queue_type).await?;
        }
        if reconnect {
            tracing::info!(messaging.system = SYSTEM, url = %shown, topologies = specs.len(), "reconnected and re-declared");
        } else {
            tracing::info!(messaging.system = SYSTEM, url = %shown, "connected");
        }
        *guard = Some(conn.clone());
        Ok(conn)
    }

    /// Connect to the first of the URLs that answers, in order; the error
    /// lists every URL tried (credentials hidden) and what each answered.
    async fn connect_any(&self) -> Result<(Connection, String), TransportError> {
        let mut failures = Vec::new();
        for url in &self.inner.urls {
            let props = ConnectionProperties::default().with_connection_name(self.inner.name.clone().into());
            match Connection::connect(url, props).await {
                Ok(c) => {
                    if !failures.is_empty() {
                        tracing::warn!(messaging.system = SYSTEM, url = %redact_url(url), failed = %failures.join("; "), "connected to a later URL of transport.url");
                    }
                    return Ok((c, url.clone()));
                }
                Err(e) => failures.push(format!("{}: {e}", redact_url(url))),
            }
        }
        Err(TransportError::new(
            ErrorKind::Connection,
            format!("connecting to {}: {}", self.inner.shown_url, failures.join("; ")),
        ))
    }

    /// Refuse `spec` when the server cannot honour `transport.queue_type`
    /// for it ([`queue_type::check`]).
    pub(super) fn check_server(&self, spec: &TopologySpec) -> Result<(), TransportError> {
        let version = *self.inner.version.lock();
        queue_type::check(self.inner.queue_type, version, &spec.name, rungs(spec).len())
    }

    /// The server version read at the last connect (only read when
    /// `transport.queue_type = "quorum"`).
    pub fn server_version(&self) -> Option<Version> {
        *self.inner.version.lock()
    }

    /// Close the connection (tests, shutdown). The next use reconnects.
    pub async fn close(&self) {
        if let Some(c) = self.inner.conn.lock().await.take() {
            let _ = c.connection.close(200, "weir: closing".into()).await;
        }
    }

    pub(super) fn spec(&self, topology: &str) -> Option<TopologySpec> {
        self.inner.topologies.lock().get(topology).cloned()
    }

    /// Publish with `mandatory` and wait for the confirm: an unroutable
    /// message or a nack is an error.
    ///
    /// Nothing goes on the wire unless it fits the connection's header
    /// rules ([`limits`]): `fit` (dead letters) repairs and cuts what does
    /// not, otherwise it is an [`ErrorKind::Invalid`] error naming the header.
    pub(super) async fn confirmed(
        &self,
        exchange: &str,
        routing_key: &str,
        wire: &Wire,
        target: &str,
        fit: bool,
    ) -> Result<(), TransportError> {
        let conn = self.conn().await?;
        let limits = Limits::amqp(usize::try_from(conn.connection.configuration().frame_max()).unwrap_or(usize::MAX));
        let mut fitted;
        let mut wire = wire;
        if fit {
            fitted = wire.clone();
            for note in limits.fit(&mut fitted) {
                tracing::warn!(
                    messaging.system = SYSTEM,
                    target,
                    change = note,
                    "a dead letter did not fit the broker's header rules; written with a marker"
                );
            }
            wire = &fitted;
        }
        let invalid = |e: String| TransportError::new(ErrorKind::Invalid, format!("not published to {target}: {e}"));
        limits.check(wire).map_err(invalid)?;
        let props = properties(wire).map_err(invalid)?;
        let confirm = conn
            .publisher
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &wire.body,
                props,
            )
            .await
            .map_err(|e| lapin_err(format!("publishing to {target}"), &e))?
            .await
            .map_err(|e| lapin_err(format!("waiting for the confirm of a publish to {target}"), &e))?;
        match confirm {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(returned)) => Err(TransportError::new(
                ErrorKind::Refused,
                format!(
                    "{target} is unroutable ({} {}): is the topology declared?",
                    returned.reply_code, returned.reply_text
                ),
            )),
            Confirmation::Nack(_) => Err(TransportError::new(
                ErrorKind::Refused,
                format!("the broker nacked a publish to {target}"),
            )),
            Confirmation::NotRequested => Err(TransportError::new(
                ErrorKind::Refused,
                format!("publish to {target} was not confirmed (confirms not enabled)"),
            )),
        }
    }

    /// Publish a retry to the rung of `delay` (or straight to the slot when
    /// the delay is zero); the rung dead-letters it to its slot when due.
    pub(super) async fn publish_retry(
        &self,
        topology: &str,
        slot: u32,
        wire: &Wire,
        delay: Duration,
    ) -> Result<(), TransportError> {
        if delay.is_zero() {
            return self.publish_slot(topology, slot, wire).await;
        }
        let declared = self.spec(topology).is_some_and(|s| rungs(&s).contains(&delay));
        if !declared {
            return Err(TransportError::new(
                ErrorKind::Invalid,
                format!(
                    "no retry rung for {delay:?} in topology `{topology}`: rungs are declared from the topology's retry ladder"
                ),
            ));
        }
        let rung = names::rung(topology, delay);
        let target = format!("retry rung {rung} (slot {slot})");
        self.confirmed(&rung, &slot.to_string(), wire, &target, false).await
    }

    pub(super) async fn publish_slot(&self, topology: &str, slot: u32, wire: &Wire) -> Result<(), TransportError> {
        if let Some(spec) = self.spec(topology)
            && slot >= spec.slots
        {
            return Err(TransportError::new(
                ErrorKind::Invalid,
                format!(
                    "slot {slot} does not exist in topology `{topology}` ({} slots)",
                    spec.slots
                ),
            ));
        }
        let exchange = names::exchange(topology);
        let target = format!("exchange {exchange} key {slot}");
        self.confirmed(&exchange, &slot.to_string(), wire, &target, false).await
    }
}
