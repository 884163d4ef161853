//! RabbitMQ (AMQP 0-9-1, lapin). Owns the broker objects of a topology, the
//! one connection a node keeps, confirmed publishes, slot and ingress
//! consumers, and the one function that turns a [`Disposition`] into acks
//! ([`RabbitAcker::settle`]). Slots, lanes and the ladder arithmetic are left
//! to the layers above.
//!
//! Broker objects of topology `T` (names fixed by DESIGN.md):
//! - exchange `weir.T` (direct, durable);
//! - slot queues `weir.T.n`, durable, bound with key `n`, declared with
//!   `x-single-active-consumer = true` in every cluster mode;
//! - `weir.T.ingress` (durable, single active consumer, also bound with key
//!   `ingress`), `weir.T.dead-letter` (durable);
//! - one retry rung per distinct ladder delay: a fanout exchange and a queue,
//!   both `weir.T.retry.<ms>ms`, the queue with `x-message-ttl = ms` and
//!   `x-dead-letter-exchange = weir.T`. A retry is published to the rung
//!   exchange with the slot as routing key; a fanout keeps that key, and when
//!   the TTL expires RabbitMQ dead-letters the message to `weir.T` with its
//!   original routing key: back to its own slot queue.
//!
//! Connection faults: a lost connection ends every subscription with an
//! error; the next `subscribe`/`publish` reconnects and re-declares every
//! topology declared so far. An ack on a dead channel is an error, never
//! retried: the broker redelivers that message.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering as AtomicOrdering};
use std::time::Duration;

use async_trait::async_trait;
use futures::{FutureExt as _, StreamExt as _};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties, ExchangeKind};
use parking_lot::Mutex;

use super::limits::Limits;
use super::{
    Acker, Delivery, Disposition, ErrorKind, RetryOwner, Subscription, TopologySpec, Transport, TransportError,
};
use crate::envelope::{self, Wire, header};

mod coalesce;

use coalesce::Coalescer;

/// `messaging.system` of this transport.
const SYSTEM: &str = "rabbitmq";

/// Heartbeat asked for when the URL names none: a dead peer is noticed
/// within about two intervals.
const DEFAULT_HEARTBEAT_SECS: u16 = 10;

/// The broker names of a topology (DESIGN.md, "Broker names").
pub mod names {
    use std::time::Duration;

    /// The topology's direct exchange.
    pub fn exchange(topology: &str) -> String {
        format!("weir.{topology}")
    }
    /// The queue of slot `n`.
    pub fn slot_queue(topology: &str, slot: u32) -> String {
        format!("weir.{topology}.{slot}")
    }
    /// The ingress queue.
    pub fn ingress(topology: &str) -> String {
        format!("weir.{topology}.ingress")
    }
    /// The routing key that binds the ingress queue to the exchange.
    pub const INGRESS_KEY: &str = "ingress";
    /// The dead-letter queue.
    pub fn dead_letter(topology: &str) -> String {
        format!("weir.{topology}.dead-letter")
    }
    /// The retry rung (exchange and queue share the name) for `delay`.
    pub fn rung(topology: &str, delay: Duration) -> String {
        format!("weir.{topology}.retry.{}ms", delay.as_millis())
    }
    /// Every queue a topology of `slots` slots and these rungs has.
    pub fn queues(topology: &str, slots: u32, rungs: &[Duration]) -> Vec<String> {
        let mut q: Vec<String> = (0..slots).map(|n| slot_queue(topology, n)).collect();
        q.push(ingress(topology));
        q.push(dead_letter(topology));
        q.extend(rungs.iter().map(|d| rung(topology, *d)));
        q
    }
    /// Every exchange of such a topology.
    pub fn exchanges(topology: &str, rungs: &[Duration]) -> Vec<String> {
        let mut e = vec![exchange(topology)];
        e.extend(rungs.iter().map(|d| rung(topology, *d)));
        e
    }
}

/// The distinct non-zero delays of a ladder, in order: one rung each.
pub fn rungs(spec: &TopologySpec) -> Vec<Duration> {
    let set: BTreeSet<Duration> = spec.retry.ladder.iter().copied().filter(|d| !d.is_zero()).collect();
    set.into_iter().collect()
}

/// A live connection and the channel every host publish goes through.
struct Conn {
    connection: Connection,
    publisher: lapin::Channel,
}

impl Conn {
    fn alive(&self) -> bool {
        self.connection.status().connected() && self.publisher.status().connected()
    }
}

struct Inner {
    url: String,
    shown_url: String,
    name: String,
    conn: tokio::sync::Mutex<Option<Arc<Conn>>>,
    topologies: Mutex<HashMap<String, TopologySpec>>,
    /// Deferred deliveries (failed captures) since the last confirmed dead
    /// letter: the backoff before the next is returned grows with it.
    defers: AtomicU32,
    /// Deliveries (queue, message id) whose retry could not be published
    /// because it does not fit the broker's header rules, with why: the
    /// next delivery of each is handed up undecodable, so it is
    /// dead-lettered instead of returned for ever.
    unsendable: Mutex<HashMap<(Arc<str>, String), String>>,
}

/// The first backoff before a delivery whose capture failed is returned.
pub const DEFER_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// The longest such backoff.
pub const DEFER_BACKOFF_MAX: Duration = Duration::from_secs(5);

impl Inner {
    /// The backoff for one more deferred delivery: doubles from
    /// [`DEFER_BACKOFF_MIN`] with each failed capture in a row, up to
    /// [`DEFER_BACKOFF_MAX`].
    fn defer_delay(&self) -> Duration {
        let n = self.defers.fetch_add(1, AtomicOrdering::Relaxed).min(16);
        DEFER_BACKOFF_MIN.saturating_mul(1 << n).min(DEFER_BACKOFF_MAX)
    }
}

/// The RabbitMQ transport. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct RabbitMq {
    inner: Arc<Inner>,
}

/// `url` with the credentials hidden, for logs and errors.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://***@{}", &url[..s], &url[at + 1..]),
        _ => url.to_owned(),
    }
}

/// `url` with a heartbeat interval unless it names one.
fn with_heartbeat(url: &str) -> String {
    if url.contains("heartbeat=") {
        return url.to_owned();
    }
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}heartbeat={DEFAULT_HEARTBEAT_SECS}")
}

fn kind_of(e: &lapin::Error) -> ErrorKind {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(_) => ErrorKind::Refused,
        _ => ErrorKind::Connection,
    }
}

fn lapin_err(what: impl std::fmt::Display, e: &lapin::Error) -> TransportError {
    TransportError::new(kind_of(e), format!("{what}: {e}"))
}

fn is_precondition_failed(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(amqp)
        if *amqp.kind() == AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED))
}

/// Turn a [`Wire`] into AMQP properties: persistent, every header a long
/// string, the message id also as the AMQP `message-id` (when it fits a
/// short string). Headers named in `weir-binary-headers` go out as the byte
/// arrays they arrived as (their hex decoded), and that list itself is not
/// written: it only stands for the AMQP field types in Weir's text headers.
/// An error (nothing sent) for a header name over 255 bytes; callers check
/// or fit the wire first ([`super::limits`]), so this is the last guard.
fn properties(wire: &Wire) -> Result<BasicProperties, String> {
    let binary = envelope::binary_headers(wire.header(header::BINARY_HEADERS));
    let mut table = FieldTable::default();
    for (k, v) in &wire.headers {
        if k == header::BINARY_HEADERS {
            continue;
        }
        let name = ShortString::try_new(k.as_str()).map_err(|e| format!("header name of {} bytes: {e}", k.len()))?;
        let value = match binary.contains(k) {
            true => hex::decode(v).map_or_else(
                |_| AMQPValue::LongString(v.as_str().into()),
                |b| AMQPValue::ByteArray(b.into()),
            ),
            false => AMQPValue::LongString(v.as_str().into()),
        };
        table.insert(name, value);
    }
    let mut props = BasicProperties::default().with_delivery_mode(2).with_headers(table);
    if let Some(id) = wire.header(header::MESSAGE_ID)
        && let Ok(id) = ShortString::try_new(id)
    {
        props = props.with_message_id(id);
    }
    Ok(props)
}

/// A header value as text; `None` for values that are not scalars (arrays and
/// tables such as RabbitMQ's own `x-death`), which Weir does not carry.
/// Borrowed where it already is text, so decoding copies only what it keeps.
/// Byte arrays (what pika sends for Python `bytes`) and long strings are
/// text when they are UTF-8; bytes that are not are `Err` (the caller
/// writes them as hex and names them in `weir-binary-headers`).
fn value_text(v: &AMQPValue) -> Option<Result<Cow<'_, str>, &[u8]>> {
    fn bytes(b: &[u8]) -> Result<Cow<'_, str>, &[u8]> {
        std::str::from_utf8(b).map(Cow::Borrowed).map_err(|_| b)
    }
    Some(Ok(match v {
        AMQPValue::LongString(s) => return Some(bytes(s.as_bytes())),
        AMQPValue::ByteArray(b) => return Some(bytes(b.as_slice())),
        AMQPValue::ShortString(s) => Cow::Borrowed(s.as_str()),
        AMQPValue::Boolean(b) => Cow::Owned(b.to_string()),
        AMQPValue::ShortShortInt(n) => Cow::Owned(n.to_string()),
        AMQPValue::ShortShortUInt(n) => Cow::Owned(n.to_string()),
        AMQPValue::ShortInt(n) => Cow::Owned(n.to_string()),
        AMQPValue::ShortUInt(n) => Cow::Owned(n.to_string()),
        AMQPValue::LongInt(n) => Cow::Owned(n.to_string()),
        AMQPValue::LongUInt(n) => Cow::Owned(n.to_string()),
        AMQPValue::LongLongInt(n) => Cow::Owned(n.to_string()),
        AMQPValue::Timestamp(n) => Cow::Owned(n.to_string()),
        AMQPValue::Float(n) => Cow::Owned(n.to_string()),
        AMQPValue::Double(n) => Cow::Owned(n.to_string()),
        _ => return None,
    }))
}

/// Every scalar header of `props` as text, in the table's order. Values
/// that are not UTF-8 come as hex, followed by one `weir-binary-headers`
/// naming them (any such header the publisher sent is replaced).
fn header_pairs(props: &BasicProperties) -> Vec<(&str, Cow<'_, str>)> {
    let mut binary = Vec::new();
    let mut pairs: Vec<(&str, Cow<'_, str>)> = props
        .headers()
        .as_ref()
        .into_iter()
        .flat_map(|t| t.inner().iter())
        .filter(|(k, _)| k.as_str() != header::BINARY_HEADERS)
        .filter_map(|(k, v)| {
            let text = match value_text(v)? {
                Ok(text) => text,
                Err(raw) => {
                    binary.push(k.as_str());
                    Cow::Owned(hex::encode(raw))
                }
            };
            Some((k.as_str(), text))
        })
        .collect();
    if !binary.is_empty() {
        pairs.push((
            header::BINARY_HEADERS,
            Cow::Owned(envelope::binary_headers_value(&binary)),
        ));
    }
    pairs
}

/// The [`Wire`] form of a received message.
fn wire_of(props: &BasicProperties, body: Vec<u8>) -> Wire {
    let headers = header_pairs(props)
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.into_owned()))
        .collect();
    Wire { headers, body }
}

impl RabbitMq {
    /// A transport for the broker at `url` (`amqp://…`); `name` is shown as
    /// the connection name. Nothing connects until first use.
    pub fn new(url: impl Into<String>, name: impl Into<String>) -> Self {
        let url = url.into();
        Self {
            inner: Arc::new(Inner {
                shown_url: redact(&url),
                url: with_heartbeat(&url),
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
    async fn conn(&self) -> Result<Arc<Conn>, TransportError> {
        let mut guard = self.inner.conn.lock().await;
        if let Some(c) = guard.as_ref()
            && c.alive()
        {
            return Ok(c.clone());
        }
        let reconnect = guard.is_some();
        *guard = None;
        let shown = &self.inner.shown_url;
        let props = ConnectionProperties::default().with_connection_name(self.inner.name.clone().into());
        let connection = Connection::connect(&self.inner.url, props)
            .await
            .map_err(|e| TransportError::new(ErrorKind::Connection, format!("connecting to {shown}: {e}")))?;
        let publisher = connection
            .create_channel()
            .await
            .map_err(|e| lapin_err(format!("opening the publish channel on {shown}"), &e))?;
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| lapin_err(format!("enabling publisher confirms on {shown}"), &e))?;
        let conn = Arc::new(Conn { connection, publisher });
        let specs: Vec<TopologySpec> = self.inner.topologies.lock().values().cloned().collect();
        for spec in &specs {
            declare_on(&conn.connection, spec).await?;
        }
        if reconnect {
            tracing::info!(messaging.system = SYSTEM, url = %shown, topologies = specs.len(), "reconnected and re-declared");
        } else {
            tracing::info!(messaging.system = SYSTEM, url = %shown, "connected");
        }
        *guard = Some(conn.clone());
        Ok(conn)
    }

    /// Close the connection (tests, shutdown). The next use reconnects.
    pub async fn close(&self) {
        if let Some(c) = self.inner.conn.lock().await.take() {
            let _ = c.connection.close(200, "weir: closing".into()).await;
        }
    }

    fn spec(&self, topology: &str) -> Option<TopologySpec> {
        self.inner.topologies.lock().get(topology).cloned()
    }

    /// Publish with `mandatory` and wait for the confirm: an unroutable
    /// message or a nack is an error.
    ///
    /// Nothing goes on the wire unless it fits the connection's header
    /// rules ([`limits`]): `fit` (dead letters) repairs and cuts what does
    /// not, otherwise it is an [`ErrorKind::Invalid`] error naming the header.
    async fn confirmed(
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
    async fn publish_retry(
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

    async fn publish_slot(&self, topology: &str, slot: u32, wire: &Wire) -> Result<(), TransportError> {
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

    async fn subscribe_queue(
        &self,
        topology: &str,
        queue: String,
        slot: Option<u32>,
        prefetch: u32,
    ) -> Result<Box<dyn Subscription>, TransportError> {
        let conn = self.conn().await?;
        let channel = conn
            .connection
            .create_channel()
            .await
            .map_err(|e| lapin_err(format!("opening a consumer channel for {queue}"), &e))?;
        let prefetch = u16::try_from(prefetch.max(1)).unwrap_or(u16::MAX);
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| lapin_err(format!("setting prefetch {prefetch} on {queue}"), &e))?;
        let tag = format!("{}.{}", queue, &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let consumer = channel
            .basic_consume(
                queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| lapin_err(format!("consuming {queue}"), &e))?;
        tracing::debug!(
            messaging.system = SYSTEM,
            topology,
            ?slot,
            queue,
            prefetch,
            "consumer started"
        );
        let queue: Arc<str> = Arc::from(queue.as_str());
        Ok(Box::new(RabbitSubscription {
            transport: self.clone(),
            topology: Arc::from(topology),
            slot,
            acks: Coalescer::start(channel.clone(), queue.clone()),
            queue,
            consumer,
            _channel: channel,
        }))
    }
}

fn declare_options() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

/// Negative control for the multi-process cluster tests, never for
/// production: when this environment variable is `1`, slot queues are
/// declared without single active consumer, so nodes that claim the same
/// slot really consume it at the same time. A broker that already has the
/// queues with the argument refuses the declaration.
pub const NEGATIVE_CONTROL_NO_SAC: &str = "WEIR_NEGATIVE_CONTROL_NO_SINGLE_ACTIVE_CONSUMER";

fn slot_queue_arguments(topology: &str) -> (FieldTable, &'static str) {
    if std::env::var(NEGATIVE_CONTROL_NO_SAC).is_ok_and(|v| v == "1") {
        tracing::error!(
            messaging.system = SYSTEM,
            topology,
            "{NEGATIVE_CONTROL_NO_SAC}=1: slot queues WITHOUT single active consumer (a test's negative control; never in production)"
        );
        return (FieldTable::default(), "durable, no arguments");
    }
    (single_active_consumer(), "durable, x-single-active-consumer = true")
}

fn single_active_consumer() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    args
}

/// Declare every broker object of `spec` on a channel of its own (a refused
/// declaration closes the channel it was made on).
async fn declare_on(connection: &Connection, spec: &TopologySpec) -> Result<(), TransportError> {
    let t = spec.name.as_str();
    let ch = connection
        .create_channel()
        .await
        .map_err(|e| lapin_err(format!("opening a channel to declare topology `{t}`"), &e))?;
    let durable_exchange = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    let exchange = names::exchange(t);
    ch.exchange_declare(
        exchange.as_str().into(),
        ExchangeKind::Direct,
        durable_exchange,
        FieldTable::default(),
    )
    .await
    .map_err(|e| declare_err("exchange", &exchange, "a durable direct exchange", &e))?;

    let queue = |name: String, args: FieldTable, shape: &'static str| {
        let ch = ch.clone();
        async move {
            ch.queue_declare(name.as_str().into(), declare_options(), args)
                .await
                .map(|_| ())
                .map_err(|e| declare_err("queue", &name, shape, &e))
        }
    };
    let bind = |name: String, source: String, key: String| {
        let ch = ch.clone();
        async move {
            ch.queue_bind(
                name.as_str().into(),
                source.as_str().into(),
                key.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| lapin_err(format!("binding queue {name} to {source} with key {key:?}"), &e))
        }
    };
    const SAC: &str = "durable, x-single-active-consumer = true";
    let (slot_args, slot_shape) = slot_queue_arguments(t);
    for n in 0..spec.slots {
        let q = names::slot_queue(t, n);
        queue(q.clone(), slot_args.clone(), slot_shape).await?;
        bind(q, exchange.clone(), n.to_string()).await?;
    }
    let ingress = names::ingress(t);
    queue(ingress.clone(), single_active_consumer(), SAC).await?;
    bind(ingress, exchange.clone(), names::INGRESS_KEY.to_owned()).await?;
    queue(names::dead_letter(t), FieldTable::default(), "durable, no arguments").await?;
    for delay in rungs(spec) {
        let rung = names::rung(t, delay);
        ch.exchange_declare(
            rung.as_str().into(),
            ExchangeKind::Fanout,
            durable_exchange,
            FieldTable::default(),
        )
        .await
        .map_err(|e| declare_err("exchange", &rung, "a durable fanout exchange", &e))?;
        let mut args = FieldTable::default();
        let ms = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
        args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ms));
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(exchange.as_str().into()),
        );
        queue(
            rung.clone(),
            args,
            "durable, x-message-ttl and x-dead-letter-exchange = the topology's exchange",
        )
        .await?;
        bind(rung.clone(), rung, String::new()).await?;
    }
    let _ = ch.close(200, "declared".into()).await;
    tracing::debug!(
        messaging.system = SYSTEM,
        topology = t,
        slots = spec.slots,
        "topology declared"
    );
    Ok(())
}

fn declare_err(what: &str, name: &str, shape: &str, e: &lapin::Error) -> TransportError {
    if is_precondition_failed(e) {
        return TransportError::new(
            ErrorKind::Invalid,
            format!(
                "{what} {name} already exists with different settings ({e}); Weir declares it as {shape}. \
                 Migrate it: stop the nodes, move or drain its messages, delete it \
                 (`rabbitmqctl delete_queue {name}` / delete the exchange), then start Weir, which declares it again \
                 (README, \"Migrating queues\")"
            ),
        );
    }
    lapin_err(format!("declaring {what} {name}"), e)
}

#[async_trait]
impl Transport for RabbitMq {
    fn system(&self) -> &'static str {
        SYSTEM
    }

    fn retry_owner(&self) -> RetryOwner {
        RetryOwner::Host
    }

    async fn declare(&self, spec: &TopologySpec) -> Result<(), TransportError> {
        if let Some(existing) = self.spec(&spec.name)
            && existing.slots != spec.slots
        {
            return Err(TransportError::new(
                ErrorKind::Invalid,
                format!(
                    "topology `{}` is declared with {} slots, not {}",
                    spec.name, existing.slots, spec.slots
                ),
            ));
        }
        let conn = self.conn().await?;
        declare_on(&conn.connection, spec).await?;
        self.inner.topologies.lock().insert(spec.name.clone(), spec.clone());
        Ok(())
    }

    async fn subscribe(
        &self,
        topology: &str,
        slot: u32,
        prefetch: u32,
    ) -> Result<Box<dyn Subscription>, TransportError> {
        self.subscribe_queue(topology, names::slot_queue(topology, slot), Some(slot), prefetch)
            .await
    }

    async fn subscribe_ingress(
        &self,
        topology: &str,
        prefetch: u32,
    ) -> Result<Option<Box<dyn Subscription>>, TransportError> {
        self.subscribe_queue(topology, names::ingress(topology), None, prefetch)
            .await
            .map(Some)
    }

    async fn publish(&self, topology: &str, slot: u32, wire: Wire) -> Result<(), TransportError> {
        self.publish_slot(topology, slot, &wire).await
    }

    async fn publish_dead_letter(&self, topology: &str, wire: Wire) -> Result<(), TransportError> {
        let queue = names::dead_letter(topology);
        self.confirmed("", &queue, &wire, &format!("dead-letter queue {queue}"), true)
            .await?;
        self.inner.defers.store(0, AtomicOrdering::Relaxed);
        Ok(())
    }

    async fn backlog(&self, topology: &str, slot: u32) -> Result<Option<u64>, TransportError> {
        let conn = self.conn().await?;
        let queue = names::slot_queue(topology, slot);
        // A passive declare on a channel of its own: a missing queue closes
        // the channel it was asked on.
        let ch = conn
            .connection
            .create_channel()
            .await
            .map_err(|e| lapin_err(format!("opening a channel to inspect {queue}"), &e))?;
        let opts = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let depth = match ch
            .queue_declare(queue.as_str().into(), opts, FieldTable::default())
            .await
        {
            Ok(q) => Some(u64::from(q.message_count())),
            Err(_) => None,
        };
        let _ = ch.close(200, "inspected".into()).await;
        Ok(depth)
    }
}

struct RabbitSubscription {
    transport: RabbitMq,
    topology: Arc<str>,
    slot: Option<u32>,
    queue: Arc<str>,
    consumer: lapin::Consumer,
    /// Acks of handled deliveries, coalesced (see [`coalesce`]).
    acks: Arc<Coalescer>,
    /// Kept open while the subscription lives; once the consumer, the
    /// coalescer and every acker are gone the channel closes, which returns
    /// unsettled deliveries.
    _channel: lapin::Channel,
}

impl Drop for RabbitSubscription {
    fn drop(&mut self) {
        // After `close` this is a no-op; without it (an error path) the
        // finished deliveries not yet acked are redelivered.
        self.acks.close();
    }
}

impl RabbitSubscription {
    fn map(&self, item: Option<lapin::Result<lapin::message::Delivery>>) -> Option<Result<Delivery, TransportError>> {
        match item? {
            Ok(d) => Some(Ok(self.delivery(d))),
            Err(e) => {
                tracing::warn!(messaging.system = SYSTEM, topology = %self.topology, slot = ?self.slot, queue = %self.queue, error = %e, "consumer ended");
                Some(Err(lapin_err(format!("consumer of {}", self.queue), &e)))
            }
        }
    }

    fn delivery(&self, d: lapin::message::Delivery) -> Delivery {
        let lapin::message::Delivery {
            delivery_tag,
            properties,
            data,
            acker,
            ..
        } = d;
        // The AMQP message id names it only when `weir-message-id` is absent.
        let fallback = || {
            properties
                .message_id()
                .as_ref()
                .map_or_else(envelope::fresh_id, |s| s.as_str().to_owned())
        };
        // Straight from the header table; through a `Wire` only when it does
        // not decode, so the capture gets the message as it came.
        let message = match envelope::decode_pairs(header_pairs(&properties), fallback, None) {
            Some(mut env) => {
                env.payload = data;
                Ok(env)
            }
            None => envelope::decode(wire_of(&properties, data), fallback, None),
        };
        let message = match message {
            Ok(env) if !self.transport.inner.unsendable.lock().is_empty() => {
                let why = self
                    .transport
                    .inner
                    .unsendable
                    .lock()
                    .remove(&(self.queue.clone(), env.id.clone()));
                match why {
                    Some(why) => Err((envelope::encode(&env), envelope::DecodeError::Unsendable(why))),
                    None => Ok(env),
                }
            }
            other => other,
        };
        self.acks.received(delivery_tag);
        Delivery {
            message,
            source: self.queue.clone(),
            tag: delivery_tag,
            acker: Box::new(RabbitAcker {
                acker,
                transport: self.transport.clone(),
                topology: self.topology.clone(),
                slot: self.slot,
                queue: self.queue.clone(),
                tag: delivery_tag,
                acks: self.acks.clone(),
            }),
        }
    }
}

#[async_trait]
impl Subscription for RabbitSubscription {
    async fn next(&mut self) -> Option<Result<Delivery, TransportError>> {
        let item = self.consumer.next().await;
        self.map(item)
    }

    fn try_next(&mut self) -> Option<Result<Delivery, TransportError>> {
        let item = self.consumer.next().now_or_never()?;
        self.map(item)
    }

    /// Put the coalesced acks on the wire, then close the channel and wait
    /// for the broker's `close-ok`: the broker handles a channel's frames in
    /// order, so once it answers it has every ack and release of this
    /// subscription (frames only written may still be lost with the node's
    /// connection, and their deliveries run again). Bounded: see
    /// [`crate::transport::confirm_acks`].
    async fn close(&mut self) {
        self.acks.flush_all().await;
        if crate::transport::unconfirmed_acks() || !self._channel.status().connected() {
            return;
        }
        let what = format!("the subscription to {}", self.queue);
        let close = self._channel.close(200, "weir: drained".into());
        crate::transport::confirm_acks(SYSTEM, &what, close).await;
    }
}

/// Settles one RabbitMQ delivery.
struct RabbitAcker {
    acker: lapin::Acker,
    transport: RabbitMq,
    topology: Arc<str>,
    /// `None` for ingress deliveries (they are forwarded, never retried).
    slot: Option<u32>,
    queue: Arc<str>,
    tag: u64,
    acks: Arc<Coalescer>,
}

impl RabbitAcker {
    async fn ack(&self) -> Result<(), TransportError> {
        match self.acker.ack(BasicAckOptions::default()).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.gone("ack")),
            Err(e) => Err(lapin_err(format!("ack of delivery {} on {}", self.tag, self.queue), &e)),
        }
    }

    async fn release(&self) -> Result<(), TransportError> {
        let opts = BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        };
        match self.acker.nack(opts).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.gone("release")),
            Err(e) => Err(lapin_err(
                format!("release of delivery {} on {}", self.tag, self.queue),
                &e,
            )),
        }
    }

    fn gone(&self, what: &str) -> TransportError {
        TransportError::new(
            ErrorKind::Settled,
            format!(
                "{what} of delivery {} on {}: its channel is closed (or it was settled); the broker redelivers it",
                self.tag, self.queue
            ),
        )
    }
}

#[async_trait]
impl Acker for RabbitAcker {
    async fn settle(self: Box<Self>, disposition: Disposition) -> Result<(), TransportError> {
        if matches!(disposition, Disposition::Ack) && self.acks.finished(self.tag) {
            return Ok(());
        }
        if matches!(disposition, Disposition::Defer) {
            // A dead-letter capture failed: return the message only after a
            // backoff that grows while captures keep failing, so a
            // dead-letter outage does not turn into a hot loop of
            // redeliveries. Held meanwhile (it stays in the book: no
            // `multiple` ack passes over it); the lane goes on.
            let delay = self.transport.inner.defer_delay();
            tracing::debug!(messaging.system = SYSTEM, topology = %self.topology, tag = self.tag, ?delay, "returning a message whose capture failed after a backoff");
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                if let Err(e) = self.release().await {
                    tracing::warn!(messaging.system = SYSTEM, topology = %self.topology, tag = self.tag, error = %e, "returning a message after a failed capture failed; the broker redelivers it");
                }
                self.acks.settled(self.tag);
            });
            return Ok(());
        }
        let result = self.settle_now(disposition).await;
        // Only now, with its frame handed to the channel, may a coalesced
        // `multiple` ack pass over this delivery.
        self.acks.settled(self.tag);
        result
    }
}

impl RabbitAcker {
    /// Settle on the wire, on its own.
    async fn settle_now(&self, disposition: Disposition) -> Result<(), TransportError> {
        match disposition {
            Disposition::Ack | Disposition::AckCaptured => self.ack().await,
            Disposition::Release | Disposition::Defer => self.release().await,
            Disposition::Retry { envelope, delay } => {
                let Some(slot) = self.slot else {
                    let _ = self.release().await;
                    return Err(TransportError::new(
                        ErrorKind::Invalid,
                        format!(
                            "delivery {} on {} cannot be retried: not a slot queue",
                            self.tag, self.queue
                        ),
                    ));
                };
                let wire = envelope::encode(&envelope);
                if let Err(e) = self.transport.publish_retry(&self.topology, slot, &wire, delay).await {
                    if e.kind == ErrorKind::Invalid {
                        // It will never fit: dead-letter it at its next delivery.
                        self.transport
                            .inner
                            .unsendable
                            .lock()
                            .insert((self.queue.clone(), envelope.id.clone()), e.detail.clone());
                    }
                    // Not scheduled: return the original so it is not held
                    // until the channel closes. It comes back at once, with
                    // its attempt unchanged.
                    if let Err(re) = self.release().await {
                        tracing::warn!(messaging.system = SYSTEM, topology = %self.topology, slot, tag = self.tag, error = %re, "release after a failed retry publish failed");
                    }
                    return Err(e);
                }
                self.ack().await
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_contract() {
        assert_eq!(names::exchange("orders"), "weir.orders");
        assert_eq!(names::slot_queue("orders", 3), "weir.orders.3");
        assert_eq!(names::ingress("orders"), "weir.orders.ingress");
        assert_eq!(names::dead_letter("orders"), "weir.orders.dead-letter");
        assert!(names::rung("orders", Duration::from_millis(1500)).starts_with("weir.orders.retry."));
    }

    #[test]
    fn rungs_are_distinct_non_zero_delays() {
        let mut spec = TopologySpec::new("t", 2);
        spec.retry.ladder = vec![
            Duration::from_secs(1),
            Duration::ZERO,
            Duration::from_secs(5),
            Duration::from_secs(1),
        ];
        assert_eq!(rungs(&spec), vec![Duration::from_secs(1), Duration::from_secs(5)]);
    }

    #[test]
    fn url_credentials_are_hidden_and_heartbeat_added() {
        assert_eq!(redact("amqp://guest:pw@host:5672/%2f"), "amqp://***@host:5672/%2f");
        assert_eq!(with_heartbeat("amqp://h/%2f"), "amqp://h/%2f?heartbeat=10");
        assert_eq!(with_heartbeat("amqp://h/%2f?heartbeat=3"), "amqp://h/%2f?heartbeat=3");
    }

    #[test]
    fn headers_round_trip_through_properties() {
        let wire = Wire {
            headers: vec![
                (header::MESSAGE_ID.into(), "m-1".into()),
                (header::MESSAGE_TYPE.into(), "ok".into()),
            ],
            body: b"x".to_vec(),
        };
        let props = properties(&wire).unwrap();
        assert_eq!(props.delivery_mode(), &Some(2));
        assert_eq!(props.message_id().as_ref().map(|s| s.as_str()), Some("m-1"));
        let back = wire_of(&props, wire.body.clone());
        assert_eq!(back.header(header::MESSAGE_ID), Some("m-1"));
        assert_eq!(back.header(header::MESSAGE_TYPE), Some("ok"));
    }
}
