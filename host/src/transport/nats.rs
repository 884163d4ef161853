//! NATS JetStream (async-nats). Owns the streams and consumers of a topology,
//! the one connection a node keeps (async-nats reconnects it by itself),
//! publishes that wait for the server's `PubAck`, slot and ingress pull
//! consumers (pull requests driven here, [`Puller`]), the in-progress ticker
//! that keeps a slow call from being redelivered mid-call, the ack-floor
//! pollers, the failure counts of retried messages, and the one function that
//! turns a [`Disposition`] into acks ([`NatsAcker::settle`]). Slots, lanes and
//! the ladder arithmetic are left to the layers above.
//!
//! Server objects of topology `T` (names fixed by DESIGN.md):
//! - stream `WEIR_T`, file storage, over `weir.T.slot.*` and `weir.T.ingress`
//!   (see "Subjects" below);
//! - a durable pull consumer `weir-T-n` per slot `n`, filter `weir.T.slot.n`,
//!   explicit ack, `MaxDeliver` -1 (unlimited: the host counts failures, see
//!   "Attempts"), no `BackOff`, `AckWait` = the first rung (30 s without a
//!   ladder), `MaxAckPending` = the node's prefetch. Created or updated by the
//!   node that consumes the slot; a differing consumer is updated and the old
//!   and new values are logged;
//! - a durable pull consumer `weir-T-ingress` on `weir.T.ingress`, whose
//!   messages the host forwards to their slot subject (`PubAck`, then ack),
//!   with `MaxAckPending` 1 so that forwarders on several nodes keep the
//!   ingress order (see "Ingress");
//! - stream `WEIR_T_DLQ` over `weir.T.dead-letter`;
//! - key-value bucket `WEIR_T_ATTEMPTS` (stream `KV_WEIR_T_ATTEMPTS`): the
//!   failures of each retried message (see "Attempts").
//!
//! Subjects: DESIGN.md says `WEIR_T` covers `weir.T.>`. nats-server 2.9
//! refuses two streams with overlapping subjects (error 10065, "subjects
//! overlap with an existing stream"), and `weir.T.>` contains
//! `weir.T.dead-letter`, so `WEIR_T_DLQ` could not exist beside it. `WEIR_T`
//! therefore lists the two subjects publishers use, `weir.T.slot.*` and
//! `weir.T.ingress`; every name of the contract is kept. An existing `WEIR_T`
//! over `weir.T.>` is narrowed to these subjects (logged, messages kept).
//!
//! Attempts: every JetStream redelivery counts against the server's delivery
//! count, also one that only returns a message a draining node never started
//! (`Nak`) or one lost on the wire at a handoff. So the server's count is not
//! the message's attempt, and a server-side `MaxDeliver` would drop messages
//! that never failed. The host counts failures itself: a retryable failure
//! (or a failed dead-letter capture) writes the attempt that failed to the
//! bucket under `<slot>.<stream sequence>` (confirmed by the server) and then
//! naks the delivery with the ladder's delay for the next attempt (the
//! server times it; a plain `Nak` would redeliver at once, LESSONS.md). A
//! redelivery (server count above 1) reads the key: attempt = failures + 1;
//! a first delivery reads nothing (a redelivery the server numbers 1, which
//! nats-server 2.9 was seen to do for a message it had sent into an
//! unsubscribed inbox, is then an extra attempt, never a false exhaustion).
//! Releases write nothing, so they are never
//! failures. The host dead-letters by this count ([`crate::retry::schedule`]);
//! the server never gives up on a message. If the bucket cannot be read, the
//! delivery counts as attempt 1 and if it cannot be written the failure is
//! not counted (both logged): a message may get extra attempts, it is never
//! dropped nor falsely `exhausted`. Entries expire after the bucket's
//! `max_age` (at least a week, twice the schedule's retention otherwise).
//!
//! Pulling: the host sends the pull requests itself
//! (`$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`, one open request of
//! short expiry, on an inbox of its own), so it can stop: at a drain,
//! [`Subscription::stop`] sends no more requests, and the subscription ends
//! once the open request has been fulfilled or has expired (the server's
//! 408). Nothing more is delivered into a draining node, nothing sent to it
//! is lost on the way, and no request of it is left on the server when it
//! releases: nats-server 2.9 still delivers into a waiting request whose
//! inbox was unsubscribed (counting a delivery, then requeueing the message
//! out of order), which is why the drain does not simply unsubscribe.
//!
//! Ingress: a message published to the ingress subject is forwarded to its
//! slot by whichever node the server hands it to. With one unacknowledged
//! ingress message at a time (`MaxAckPending` 1), the next is handed out only
//! after the previous one's forward was confirmed and acked, so forwarders on
//! several nodes keep the order of every group (a redelivery after `AckWait`
//! may still reorder, as any redelivery may).

use std::borrow::Cow;
use std::collections::HashMap;
use std::str::FromStr as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::{self, AckKind, ErrorCode, kv, stream};
use async_nats::{HeaderMap, Subject};
use async_trait::async_trait;
use bytes::Bytes;
use futures::{FutureExt as _, StreamExt as _};
use parking_lot::Mutex;

use super::limits::Limits;
use super::{
    Acker, Delivery, Disposition, ErrorKind, RetryFacts, RetryOwner, Subscription, TopologySpec, Transport,
    TransportError,
};
use crate::envelope::{self, Wire, header};
use crate::floor::{FloorMonitor, FloorState, StallClock};
use crate::retry::schedule::{NATS_DEFAULT_ACK_WAIT, Redelivery};

/// `messaging.system` of this transport.
const SYSTEM: &str = "nats";

/// `AckWait` of the ingress consumer (forwarding is quick; the ticker keeps
/// a slow one alive).
const INGRESS_ACK_WAIT: Duration = Duration::from_secs(30);
/// Expiry of one pull request. Short, because a drain waits for the open
/// request to end before it releases anything (module docs, "Pulling"); the
/// server's answer at expiry (408) is also the sign of life of an idle
/// consumer.
const PULL_EXPIRES: Duration = Duration::from_secs(1);
/// Messages asked for in one pull request, at most.
const MAX_PULL_BATCH: u32 = 1024;
/// A pull request the server neither fulfilled nor ended this long after its
/// expiry ends the subscription (the supervisor subscribes again).
const PULL_GRACE: Duration = Duration::from_secs(5);
/// Least time a failure count is kept (the bucket's `max_age`).
const ATTEMPTS_MIN_AGE: Duration = Duration::from_secs(7 * 24 * 3600);
/// Timeout of every JetStream API request (stream and consumer info,
/// publish acks, double acks).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// The server names of a topology (DESIGN.md, "Broker names").
pub mod names {
    /// The topology's work stream.
    pub fn stream(topology: &str) -> String {
        format!("WEIR_{topology}")
    }
    /// The subjects of the work stream: slots and ingress (module docs,
    /// "Subjects").
    pub fn stream_subjects(topology: &str) -> Vec<String> {
        vec![format!("weir.{topology}.slot.*"), ingress(topology)]
    }
    /// The subject of slot `n`.
    pub fn slot_subject(topology: &str, slot: u32) -> String {
        format!("weir.{topology}.slot.{slot}")
    }
    /// The durable pull consumer of slot `n`.
    pub fn slot_consumer(topology: &str, slot: u32) -> String {
        format!("weir-{topology}-{slot}")
    }
    /// The ingress subject.
    pub fn ingress(topology: &str) -> String {
        format!("weir.{topology}.ingress")
    }
    /// The durable pull consumer of the ingress.
    pub fn ingress_consumer(topology: &str) -> String {
        format!("weir-{topology}-ingress")
    }
    /// The dead-letter subject.
    pub fn dead_letter(topology: &str) -> String {
        format!("weir.{topology}.dead-letter")
    }
    /// The dead-letter stream.
    pub fn dead_letter_stream(topology: &str) -> String {
        format!("WEIR_{topology}_DLQ")
    }
    /// The key-value bucket of failure counts (module docs, "Attempts").
    pub fn attempts_bucket(topology: &str) -> String {
        format!("WEIR_{topology}_ATTEMPTS")
    }
    /// The stream behind [`attempts_bucket`] (the server's `KV_` prefix).
    pub fn attempts_stream(topology: &str) -> String {
        format!("KV_WEIR_{topology}_ATTEMPTS")
    }
    /// The key of a message's failure count: its slot and stream sequence.
    pub fn attempts_key(slot: u32, sequence: u64) -> String {
        format!("{slot}.{sequence}")
    }
}

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
}

impl Default for NatsOptions {
    fn default() -> Self {
        Self {
            floor_poll: Duration::from_secs(5),
            floor_warn_after: None,
        }
    }
}

/// A live connection. async-nats reconnects it by itself, so once made it is
/// kept for the transport's life.
#[derive(Clone)]
struct Conn {
    client: async_nats::Client,
    js: jetstream::Context,
}

struct Inner {
    url: String,
    name: String,
    options: NatsOptions,
    conn: tokio::sync::Mutex<Option<Conn>>,
    topologies: Mutex<HashMap<String, TopologySpec>>,
    /// The failure-count bucket of each declared topology.
    attempts: Mutex<HashMap<String, kv::Store>>,
    floor: Arc<FloorMonitor>,
}

/// The NATS JetStream transport. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct Nats {
    inner: Arc<Inner>,
}

/// `url` with the credentials hidden, for logs and errors.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://***@{}", &url[..s], &url[at + 1..]),
        _ => url.to_owned(),
    }
}

fn js_code(e: &async_nats::jetstream::Error) -> ErrorCode {
    e.error_code()
}

/// The NATS headers of a [`Wire`]; an error (nothing appended that
/// async-nats would panic on) for a name or value NATS cannot carry.
/// Callers check or fit the wire first ([`super::limits`]), so this is the
/// last guard.
fn headers_of(wire: &Wire) -> Result<HeaderMap, String> {
    let mut h = HeaderMap::new();
    for (k, v) in &wire.headers {
        let name = async_nats::HeaderName::from_str(k).map_err(|e| format!("header name {k:?}: {e}"))?;
        let value = async_nats::HeaderValue::from_str(v).map_err(|e| format!("header {k:?}: {e}"))?;
        h.append(name, value);
    }
    Ok(h)
}

/// The [`Wire`] form of a received message: every header value (in order),
/// and the payload (moved, not copied, when nothing else holds it).
fn wire_of(headers: Option<&HeaderMap>, payload: Bytes) -> Wire {
    let mut out = Vec::new();
    if let Some(h) = headers {
        for (name, values) in h.iter() {
            for v in values {
                out.push((AsRef::<str>::as_ref(name).to_owned(), v.as_str().to_owned()));
            }
        }
    }
    Wire {
        headers: out,
        body: Vec::from(payload),
    }
}

/// The desired config of slot `slot`'s consumer: unlimited deliveries and no
/// `BackOff`, since the host counts failures and times each retry with a
/// delayed `Nak` (module docs, "Attempts"); `AckWait` (the first rung) only
/// times the redelivery of a delivery nobody settled (a node that died).
fn slot_consumer_config(spec: &TopologySpec, slot: u32, prefetch: u32) -> pull::Config {
    let t = spec.name.as_str();
    pull::Config {
        durable_name: Some(names::slot_consumer(t, slot)),
        description: Some(format!("weir: slot {slot} of topology {t}")),
        filter_subject: names::slot_subject(t, slot),
        deliver_policy: DeliverPolicy::All,
        ack_policy: AckPolicy::Explicit,
        ack_wait: spec.retry.ladder.first().copied().unwrap_or(NATS_DEFAULT_ACK_WAIT),
        max_deliver: -1,
        backoff: Vec::new(),
        max_ack_pending: i64::from(prefetch.max(1)),
        ..pull::Config::default()
    }
}

/// The `max_age` of the failure-count bucket: twice the time the schedule
/// keeps a failing message, at least [`ATTEMPTS_MIN_AGE`].
fn attempts_max_age(spec: &TopologySpec) -> Duration {
    spec.retry
        .schedule(Redelivery::JETSTREAM)
        .retention_needed()
        .map_or(ATTEMPTS_MIN_AGE, |r| r.saturating_mul(2).max(ATTEMPTS_MIN_AGE))
}

/// The desired config of the ingress consumer: one unacknowledged message at
/// a time, whichever node holds it, so forwarding keeps the order (module
/// docs, "Ingress").
fn ingress_consumer_config(topology: &str) -> pull::Config {
    pull::Config {
        durable_name: Some(names::ingress_consumer(topology)),
        description: Some(format!("weir: ingress of topology {topology}, forwarded to the slots")),
        filter_subject: names::ingress(topology),
        deliver_policy: DeliverPolicy::All,
        ack_policy: AckPolicy::Explicit,
        ack_wait: INGRESS_ACK_WAIT,
        max_deliver: -1,
        max_ack_pending: 1,
        ..pull::Config::default()
    }
}

/// The settings Weir owns on a consumer, shown in logs when they change.
#[derive(Debug, PartialEq, Eq)]
struct Owned<'a> {
    filter_subject: &'a str,
    ack_wait: Duration,
    max_deliver: i64,
    backoff: &'a [Duration],
    max_ack_pending: i64,
}

fn owned_of_pull(c: &pull::Config) -> Owned<'_> {
    Owned {
        filter_subject: &c.filter_subject,
        ack_wait: c.ack_wait,
        max_deliver: c.max_deliver,
        backoff: &c.backoff,
        max_ack_pending: c.max_ack_pending,
    }
}

fn owned_of(c: &jetstream::consumer::Config) -> Owned<'_> {
    Owned {
        filter_subject: &c.filter_subject,
        ack_wait: c.ack_wait,
        max_deliver: c.max_deliver,
        backoff: &c.backoff,
        max_ack_pending: c.max_ack_pending,
    }
}

/// Stall age from which a topology's floor monitor warns by default.
fn default_warn_after(spec: &TopologySpec) -> Duration {
    let schedule = spec.retry.schedule(Redelivery::JETSTREAM);
    let ack_wait = spec.retry.ladder.first().copied().unwrap_or(NATS_DEFAULT_ACK_WAIT);
    let held = schedule
        .retention_needed()
        .unwrap_or_else(|| spec.retry.ladder.iter().sum());
    held.saturating_add(ack_wait).max(Duration::from_secs(60))
}

impl Nats {
    /// A transport for the server at `url` (`nats://…`); `name` is the
    /// connection name the server shows. Nothing connects until first use.
    pub fn new(url: impl Into<String>, name: impl Into<String>) -> Self {
        Self::with_options(url, name, NatsOptions::default())
    }

    /// [`Nats::new`] with options.
    pub fn with_options(url: impl Into<String>, name: impl Into<String>, options: NatsOptions) -> Self {
        Self {
            inner: Arc::new(Inner {
                url: url.into(),
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
    async fn conn(&self) -> Result<Conn, TransportError> {
        let mut guard = self.inner.conn.lock().await;
        if let Some(c) = guard.as_ref() {
            return Ok(c.clone());
        }
        let shown = redact(&self.inner.url);
        let client = async_nats::ConnectOptions::new()
            .name(&self.inner.name)
            .connection_timeout(REQUEST_TIMEOUT)
            .request_timeout(Some(REQUEST_TIMEOUT))
            .max_reconnects(None)
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis(100u64.saturating_mul(1 << attempts.min(5)).min(2_000))
            })
            .event_callback(|event| async move {
                tracing::info!(messaging.system = SYSTEM, %event, "connection event");
            })
            .connect(self.inner.url.as_str())
            .await
            .map_err(|e| TransportError::new(ErrorKind::Connection, format!("connecting to {shown}: {e}")))?;
        let js = jetstream::new(client.clone());
        tracing::info!(messaging.system = SYSTEM, url = %shown, "connected");
        let conn = Conn { client, js };
        *guard = Some(conn.clone());
        Ok(conn)
    }

    fn spec(&self, topology: &str) -> Result<TopologySpec, TransportError> {
        self.inner.topologies.lock().get(topology).cloned().ok_or_else(|| {
            TransportError::new(
                ErrorKind::Invalid,
                format!("topology `{topology}` is not declared on this transport; declare it first"),
            )
        })
    }

    /// Create the stream `name` over `subjects`, or narrow/widen an existing
    /// one to exactly those subjects (its other settings, such as `max_age`,
    /// are the operator's and are kept).
    async fn ensure_stream(&self, conn: &Conn, name: &str, subjects: Vec<String>) -> Result<(), TransportError> {
        match conn.js.get_stream(name).await {
            Ok(stream) => {
                let info = stream.cached_info();
                let mut have = info.config.subjects.clone();
                let mut want = subjects.clone();
                have.sort();
                want.sort();
                if have != want {
                    let mut config = info.config.clone();
                    config.subjects = subjects.clone();
                    conn.js.update_stream(config).await.map_err(|e| {
                        TransportError::new(
                            ErrorKind::Refused,
                            format!("updating the subjects of stream {name} from {have:?} to {want:?}: {e}"),
                        )
                    })?;
                    tracing::warn!(messaging.system = SYSTEM, stream = name, old = ?have, new = ?want, "stream subjects updated");
                }
                Ok(())
            }
            Err(e) if is_stream_not_found(&e) => {
                conn.js
                    .create_stream(stream::Config {
                        name: name.to_owned(),
                        subjects: subjects.clone(),
                        storage: stream::StorageType::File,
                        ..stream::Config::default()
                    })
                    .await
                    .map_err(|e| {
                        TransportError::new(
                            ErrorKind::Refused,
                            format!("creating stream {name} over {subjects:?} (file storage): {e}"),
                        )
                    })?;
                tracing::info!(messaging.system = SYSTEM, stream = name, ?subjects, "stream created");
                Ok(())
            }
            Err(e) => Err(TransportError::new(
                ErrorKind::Connection,
                format!("reading stream {name}: {e}"),
            )),
        }
    }

    async fn declare_streams(&self, conn: &Conn, spec: &TopologySpec) -> Result<(), TransportError> {
        let t = spec.name.as_str();
        // The work stream first: an old one over `weir.T.>` overlaps the DLQ.
        self.ensure_stream(conn, &names::stream(t), names::stream_subjects(t))
            .await?;
        self.ensure_stream(conn, &names::dead_letter_stream(t), vec![names::dead_letter(t)])
            .await?;
        self.ensure_attempts(conn, spec).await.map(drop)
    }

    /// The failure-count bucket of `spec` (module docs, "Attempts"): bound
    /// when it exists (its settings are kept), created when missing.
    async fn ensure_attempts(&self, conn: &Conn, spec: &TopologySpec) -> Result<kv::Store, TransportError> {
        let bucket = names::attempts_bucket(&spec.name);
        if let Some(store) = self.inner.attempts.lock().get(&spec.name) {
            return Ok(store.clone());
        }
        let store = match conn.js.get_key_value(bucket.as_str()).await {
            Ok(store) => store,
            Err(e) if matches!(e.kind(), jetstream::context::KeyValueErrorKind::GetBucket) => {
                let max_age = attempts_max_age(spec);
                // The bucket's stream, as a key-value bucket is made (one
                // value per key, rollups, direct gets), created with the
                // plain stream API: async-nats's own bucket creation does
                // not parse nats-server 2.9's answer.
                let stream_name = names::attempts_stream(&spec.name);
                conn.js
                    .create_stream(stream::Config {
                        name: stream_name.clone(),
                        description: Some(format!("weir: failures of retried messages of topology {}", spec.name)),
                        subjects: vec![format!("$KV.{bucket}.>")],
                        max_messages_per_subject: 1,
                        max_age,
                        storage: stream::StorageType::File,
                        discard: stream::DiscardPolicy::New,
                        allow_rollup: true,
                        deny_delete: true,
                        allow_direct: true,
                        ..stream::Config::default()
                    })
                    .await
                    .map_err(|e| {
                        TransportError::new(
                            ErrorKind::Refused,
                            format!("creating stream {stream_name} of key-value bucket {bucket} (file storage, max_age {max_age:?}): {e}"),
                        )
                    })?;
                let store = conn.js.get_key_value(bucket.as_str()).await.map_err(|e| {
                    TransportError::new(ErrorKind::Connection, format!("reading key-value bucket {bucket}: {e}"))
                })?;
                tracing::info!(messaging.system = SYSTEM, bucket = %bucket, ?max_age, "failure-count bucket created");
                store
            }
            Err(e) => {
                return Err(TransportError::new(
                    ErrorKind::Connection,
                    format!("reading key-value bucket {bucket}: {e}"),
                ));
            }
        };
        self.inner.attempts.lock().insert(spec.name.clone(), store.clone());
        Ok(store)
    }

    /// The consumer `desired` on `stream`: created when missing, updated (with
    /// the old and new values logged) when a setting Weir owns differs, else
    /// bound as it is.
    async fn ensure_consumer(
        &self,
        conn: &Conn,
        stream: &str,
        desired: pull::Config,
    ) -> Result<PullConsumer, TransportError> {
        let name = desired.durable_name.clone().unwrap_or_default();
        match conn
            .js
            .get_consumer_from_stream::<pull::Config, _, _>(&name, stream)
            .await
        {
            Ok(existing) => {
                let have = owned_of(&existing.cached_info().config);
                let want = owned_of_pull(&desired);
                if have == want {
                    return Ok(existing);
                }
                tracing::warn!(
                    messaging.system = SYSTEM, stream, consumer = %name,
                    old = ?have, new = ?want,
                    "consumer settings differ from the config; updating"
                );
            }
            Err(e) if is_not_found(&e) => {}
            Err(e) => {
                return Err(TransportError::new(
                    ErrorKind::Connection,
                    format!("reading consumer {name} of stream {stream}: {e}"),
                ));
            }
        }
        let shown = format!("{:?}", owned_of_pull(&desired));
        conn.js.create_consumer_on_stream(desired, stream).await.map_err(|e| {
            let kind = match e.kind() {
                jetstream::stream::ConsumerErrorKind::JetStream(_) => ErrorKind::Refused,
                jetstream::stream::ConsumerErrorKind::TimedOut => ErrorKind::Timeout,
                _ => ErrorKind::Connection,
            };
            TransportError::new(
                kind,
                format!("creating or updating consumer {name} of stream {stream} as {shown}: {e}"),
            )
        })
    }

    /// Bind `desired`, re-declaring the topology's streams once if the work
    /// stream is gone (deleted, or a server that lost its store).
    async fn bind(
        &self,
        conn: &Conn,
        spec: &TopologySpec,
        desired: pull::Config,
    ) -> Result<PullConsumer, TransportError> {
        let stream = names::stream(&spec.name);
        match self.ensure_consumer(conn, &stream, desired.clone()).await {
            Err(e) if e.kind == ErrorKind::Refused && e.detail.contains("stream not found") => {
                tracing::warn!(messaging.system = SYSTEM, stream = %stream, "stream missing; declaring the topology again");
                self.declare_streams(conn, spec).await?;
                self.ensure_consumer(conn, &stream, desired).await
            }
            other => other,
        }
    }

    async fn subscribe_consumer(
        &self,
        spec: &TopologySpec,
        desired: pull::Config,
        slot: Option<u32>,
        prefetch: u32,
    ) -> Result<Box<dyn Subscription>, TransportError> {
        let conn = self.conn().await?;
        let consumer = self.bind(&conn, spec, desired).await?;
        let info = consumer.cached_info();
        let consumer_name: Arc<str> = Arc::from(info.name.as_str());
        let subject: Arc<str> = Arc::from(info.config.filter_subject.as_str());
        let ack_wait = info.config.ack_wait;
        let attempts = match slot {
            Some(_) => Some(self.ensure_attempts(&conn, spec).await?),
            None => None,
        };
        let puller = Puller::start(
            &conn.client,
            &info.stream_name,
            &info.name,
            prefetch.clamp(1, MAX_PULL_BATCH),
        )
        .await
        .map_err(|e| {
            TransportError::new(
                ErrorKind::Connection,
                format!(
                    "pulling from consumer {consumer_name} of stream {}: {e}",
                    info.stream_name
                ),
            )
        })?;
        // The delays of retries and deferred captures, served by delayed
        // Naks (module docs, "Attempts").
        let schedule = spec.retry.schedule(Redelivery::JetStream {
            ack_wait: Some(ack_wait),
            capture_reserve: crate::retry::schedule::DEFAULT_CAPTURE_RESERVE,
        });
        let progress = Arc::new(Progress::default());
        let period = (ack_wait / 4).max(Duration::from_millis(50));
        let mut tasks = Vec::new();
        tasks.push(tokio::spawn(progress_ticker(
            conn.client.clone(),
            progress.clone(),
            period,
        )));
        let topology: Arc<str> = Arc::from(spec.name.as_str());
        if let Some(slot) = slot {
            let warn_after = self
                .inner
                .options
                .floor_warn_after
                .unwrap_or_else(|| default_warn_after(spec));
            tasks.push(tokio::spawn(floor_poller(
                consumer.clone(),
                self.inner.floor.clone(),
                topology.clone(),
                slot,
                self.inner.options.floor_poll,
                warn_after,
            )));
        }
        tracing::debug!(messaging.system = SYSTEM, topology = %topology, ?slot, consumer = %consumer_name, prefetch, ?ack_wait, "consumer bound");
        Ok(Box::new(NatsSubscription {
            puller,
            js: conn.js.clone(),
            stash: None,
            shared: Arc::new(Shared {
                topology,
                slot,
                subject,
                stream: Arc::from(info.stream_name.as_str()),
                consumer: consumer_name,
                attempts,
                schedule,
                progress,
            }),
            floor: self.inner.floor.clone(),
            tasks,
        }))
    }

    /// Publish and wait for the stream's `PubAck`. Nothing goes out unless
    /// it fits NATS's header rules and the server's `max_payload`
    /// ([`limits`]): with `fit` (dead letters) what does not is repaired and
    /// cut with a marker, otherwise it is an [`ErrorKind::Invalid`] error
    /// naming the header.
    async fn publish_to(&self, subject: String, mut wire: Wire, target: &str, fit: bool) -> Result<(), TransportError> {
        let conn = self.conn().await?;
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
        pending.await.map_err(|e| publish_err(target, &e))?;
        Ok(())
    }
}

fn publish_err(target: &str, e: &jetstream::context::PublishError) -> TransportError {
    match e.kind() {
        PublishErrorKind::StreamNotFound => TransportError::new(
            ErrorKind::Refused,
            format!("publishing to {target}: no stream captures it (is the topology declared?): {e}"),
        ),
        PublishErrorKind::TimedOut => TransportError::new(
            ErrorKind::Timeout,
            format!("publishing to {target}: no PubAck in time: {e}"),
        ),
        PublishErrorKind::BrokenPipe => {
            TransportError::new(ErrorKind::Connection, format!("publishing to {target}: {e}"))
        }
        _ => TransportError::new(ErrorKind::Refused, format!("publishing to {target}: {e}")),
    }
}

fn is_stream_not_found(e: &jetstream::context::GetStreamError) -> bool {
    matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(j) if js_code(&j) == ErrorCode::STREAM_NOT_FOUND)
}

fn is_not_found(e: &jetstream::stream::ConsumerError) -> bool {
    matches!(e.kind(), jetstream::stream::ConsumerErrorKind::JetStream(j)
        if js_code(&j) == ErrorCode::CONSUMER_NOT_FOUND || js_code(&j) == ErrorCode::STREAM_NOT_FOUND)
}

#[async_trait]
impl Transport for Nats {
    fn system(&self) -> &'static str {
        SYSTEM
    }

    fn retry_owner(&self) -> RetryOwner {
        RetryOwner::Broker
    }

    async fn declare(&self, spec: &TopologySpec) -> Result<(), TransportError> {
        if let Some(existing) = self.inner.topologies.lock().get(&spec.name)
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
        self.declare_streams(&conn, spec).await?;
        self.inner.topologies.lock().insert(spec.name.clone(), spec.clone());
        tracing::debug!(messaging.system = SYSTEM, topology = %spec.name, slots = spec.slots, "topology declared");
        Ok(())
    }

    async fn subscribe(
        &self,
        topology: &str,
        slot: u32,
        prefetch: u32,
    ) -> Result<Box<dyn Subscription>, TransportError> {
        let spec = self.spec(topology)?;
        if slot >= spec.slots {
            return Err(TransportError::new(
                ErrorKind::Invalid,
                format!(
                    "slot {slot} does not exist in topology `{topology}` ({} slots)",
                    spec.slots
                ),
            ));
        }
        let desired = slot_consumer_config(&spec, slot, prefetch);
        self.subscribe_consumer(&spec, desired, Some(slot), prefetch).await
    }

    async fn subscribe_ingress(
        &self,
        topology: &str,
        prefetch: u32,
    ) -> Result<Option<Box<dyn Subscription>>, TransportError> {
        let spec = self.spec(topology)?;
        let _ = prefetch;
        let desired = ingress_consumer_config(topology);
        self.subscribe_consumer(&spec, desired, None, 1).await.map(Some)
    }

    async fn publish(&self, topology: &str, slot: u32, wire: Wire) -> Result<(), TransportError> {
        let slots = self.inner.topologies.lock().get(topology).map(|t| t.slots);
        if let Some(slots) = slots
            && slot >= slots
        {
            return Err(TransportError::new(
                ErrorKind::Invalid,
                format!("slot {slot} does not exist in topology `{topology}` ({slots} slots)"),
            ));
        }
        let subject = names::slot_subject(topology, slot);
        let target = format!("subject {subject} (stream {})", names::stream(topology));
        self.publish_to(subject, wire, &target, false).await
    }

    async fn publish_dead_letter(&self, topology: &str, wire: Wire) -> Result<(), TransportError> {
        let subject = names::dead_letter(topology);
        let target = format!(
            "dead-letter subject {subject} (stream {})",
            names::dead_letter_stream(topology)
        );
        self.publish_to(subject, wire, &target, true).await
    }

    async fn retry_facts(&self, topology: &str) -> Result<Option<RetryFacts>, TransportError> {
        let conn = self.conn().await?;
        let name = names::stream(topology);
        let stream = match conn.js.get_stream(&name).await {
            Ok(s) => s,
            Err(e) if is_stream_not_found(&e) => return Ok(Some(RetryFacts::default())),
            Err(e) => {
                return Err(TransportError::new(
                    ErrorKind::Connection,
                    format!("reading stream {name}: {e}"),
                ));
            }
        };
        let max_age = Some(stream.cached_info().config.max_age).filter(|a| !a.is_zero());
        let consumer = names::slot_consumer(topology, 0);
        let ack_wait = match conn
            .js
            .get_consumer_from_stream::<pull::Config, _, _>(&consumer, &name)
            .await
        {
            Ok(c) => Some(c.cached_info().config.ack_wait),
            Err(e) if is_not_found(&e) => None,
            Err(e) => {
                return Err(TransportError::new(
                    ErrorKind::Connection,
                    format!("reading consumer {consumer} of stream {name}: {e}"),
                ));
            }
        };
        Ok(Some(RetryFacts {
            stream_max_age: max_age,
            ack_wait,
        }))
    }

    async fn backlog(&self, topology: &str, slot: u32) -> Result<Option<u64>, TransportError> {
        let conn = self.conn().await?;
        let (stream, consumer) = (names::stream(topology), names::slot_consumer(topology, slot));
        match conn
            .js
            .get_consumer_from_stream::<pull::Config, _, _>(&consumer, &stream)
            .await
        {
            Ok(c) => Ok(Some(c.cached_info().num_pending)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(TransportError::new(
                ErrorKind::Connection,
                format!("reading consumer {consumer} of stream {stream}: {e}"),
            )),
        }
    }

    fn ack_floor(&self) -> Vec<FloorState> {
        self.inner.floor.snapshot()
    }

    /// Acks and naks are published without an answer, so when the node
    /// stops they may still sit in the client's buffer, or in a socket or a
    /// network that stalls: flush the connection, then wait for the answer
    /// to a request sent after them (the server reads a connection in
    /// order, so once it answers it has every ack). Bounded: see
    /// [`super::confirm_acks`].
    async fn close(&self) {
        let conn = self.inner.conn.lock().await.clone();
        let Some(conn) = conn else { return };
        if super::unconfirmed_acks() {
            if let Err(e) = tokio::time::timeout(REQUEST_TIMEOUT, conn.client.flush())
                .await
                .map_err(|_| "timed out".to_owned())
                .and_then(|r| r.map_err(|e| e.to_string()))
            {
                tracing::warn!(messaging.system = SYSTEM, error = %e, "flushing the connection at shutdown failed; acks not yet sent are redelivered");
            }
            return;
        }
        let confirm = async {
            conn.client.flush().await.map_err(|e| format!("flushing: {e}"))?;
            conn.js
                .query_account()
                .await
                .map(drop)
                .map_err(|e| format!("the round trip after the acks ($JS.API.INFO): {e}"))
        };
        super::confirm_acks(SYSTEM, "every ack and release of this connection", confirm).await;
    }
}

/// Deliveries in flight on one subscription, kept alive with `+WPI` by the
/// ticker until they are settled (or dropped unsettled).
#[derive(Default)]
struct Progress {
    inflight: Mutex<HashMap<u64, (Subject, Instant), nohash_hasher::BuildNoHashHasher<u64>>>,
    next: AtomicU64,
}

impl Progress {
    fn track(&self, reply: Subject) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.inflight.lock().insert(id, (reply, Instant::now()));
        id
    }

    fn untrack(&self, id: u64) {
        self.inflight.lock().remove(&id);
    }

    /// The deliveries held for at least `period` since their last sign of
    /// life; their clocks restart now.
    fn due(&self, period: Duration) -> Vec<Subject> {
        let now = Instant::now();
        let mut due = Vec::new();
        for (reply, since) in self.inflight.lock().values_mut() {
            if now.saturating_duration_since(*since) >= period {
                *since = now;
                due.push(reply.clone());
            }
        }
        due
    }
}

/// Every `period` (a quarter of `AckWait`), tell the server that each
/// delivery held longer than that is still being worked on (`+WPI`), so a
/// slow call, or a message queued behind its group's lane, is not redelivered
/// while this node still holds it. Settling a delivery stops it.
async fn progress_ticker(client: async_nats::Client, progress: Arc<Progress>, period: Duration) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        for reply in progress.due(period) {
            let body: Bytes = AckKind::Progress.into();
            if let Err(e) = client.publish(reply, body).await {
                tracing::debug!(messaging.system = SYSTEM, error = %e, "in-progress signal not sent");
            }
        }
    }
}

/// Poll a slot consumer's ack floor every `poll` and report its stall age to
/// `monitor` and, from `warn_after` on, as a warning. Observe only.
async fn floor_poller(
    consumer: PullConsumer,
    monitor: Arc<FloorMonitor>,
    topology: Arc<str>,
    slot: u32,
    poll: Duration,
    warn_after: Duration,
) {
    let mut clock = StallClock::new();
    let mut warned = false;
    let name = consumer.cached_info().name.clone();
    loop {
        tokio::time::sleep(poll).await;
        let info = match consumer.get_info().await {
            Ok(info) => info,
            Err(e) => {
                tracing::debug!(messaging.system = SYSTEM, topology = %topology, slot, consumer = %name, error = %e, "ack floor not read");
                continue;
            }
        };
        let delivered = info.delivered.stream_sequence;
        // Nothing awaiting an ack: caught up, whatever the floor says (a
        // filtered consumer's delivered position moves past the stream's
        // other subjects at each pull request, its ack floor does not).
        let ack_floor = if info.num_ack_pending == 0 {
            delivered
        } else {
            info.ack_floor.stream_sequence
        };
        let stalled_for = clock.observe(delivered, ack_floor, Instant::now()).unwrap_or_default();
        monitor.update(FloorState {
            topology: topology.to_string(),
            slot,
            consumer: name.clone(),
            delivered,
            ack_floor,
            stalled_for,
        });
        if stalled_for >= warn_after {
            tracing::warn!(
                messaging.system = SYSTEM, topology = %topology, slot, consumer = %name,
                delivered, ack_floor, stalled_secs = stalled_for.as_secs(),
                pending = info.num_ack_pending, redelivered = info.num_redelivered,
                "ack floor stalled: the consumer delivered past stream sequence {ack_floor} but has not \
                 settled it for {stalled_for:?}; a message there is still being retried or held (observe only)"
            );
            warned = true;
        } else if warned {
            tracing::info!(messaging.system = SYSTEM, topology = %topology, slot, consumer = %name, ack_floor, "ack floor moving again");
            warned = false;
        }
    }
}

/// The pull requests of one consumer, sent by the host on an inbox of its
/// own (module docs, "Pulling"): one open request at a time, for up to
/// `batch` messages, expiring after [`PULL_EXPIRES`]; the next is sent when
/// it is fulfilled, expires (408) or ends (409), so the server's
/// `MaxAckPending` alone bounds what the node holds. A request that neither
/// brings its batch nor ends within [`PULL_GRACE`] of its expiry ends the
/// subscription (the supervisor subscribes again).
struct Puller {
    client: async_nats::Client,
    inbox: async_nats::Subscriber,
    reply: Subject,
    request: Subject,
    body: Bytes,
    batch: u32,
    /// The open request: messages it may still bring, and when the server
    /// forgets it.
    open: Option<(u32, Instant)>,
    /// Set by [`Puller::stop`]: no more requests.
    stopped: bool,
    ended: bool,
}

/// What one message on the inbox means.
enum Heard {
    Message(async_nats::Message),
    Nothing,
    Ended(String),
}

impl Puller {
    async fn start(
        client: &async_nats::Client,
        stream: &str,
        consumer: &str,
        batch: u32,
    ) -> Result<Self, async_nats::SubscribeError> {
        let reply = Subject::from(client.new_inbox());
        let inbox = client.subscribe(reply.clone()).await?;
        let body = format!("{{\"batch\":{batch},\"expires\":{}}}", PULL_EXPIRES.as_nanos(),);
        Ok(Self {
            client: client.clone(),
            inbox,
            reply,
            request: Subject::from(format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}")),
            body: Bytes::from(body),
            batch,
            open: None,
            stopped: false,
            ended: false,
        })
    }

    /// Sort one inbox message: a delivery, a status that needs nothing, or
    /// one that ends the subscription.
    fn hear(&mut self, m: async_nats::Message) -> Heard {
        match m.status {
            None => {
                if let Some((left, _)) = &mut self.open {
                    *left = left.saturating_sub(1);
                    if *left == 0 {
                        self.open = None;
                    }
                }
                if m.reply.is_some() {
                    Heard::Message(m)
                } else {
                    Heard::Nothing
                }
            }
            Some(async_nats::StatusCode::IDLE_HEARTBEAT) => Heard::Nothing,
            // The request expired, or found nothing: send another.
            Some(async_nats::StatusCode::TIMEOUT | async_nats::StatusCode::NOT_FOUND) => {
                self.open = None;
                Heard::Nothing
            }
            Some(code) => {
                let what = m.description.unwrap_or_default();
                if code == async_nats::StatusCode::REQUEST_TERMINATED && !what.to_ascii_lowercase().contains("deleted")
                {
                    // Exceeded MaxWaiting or MaxBytes, a leadership change:
                    // this request is over, the consumer is not.
                    tracing::debug!(messaging.system = SYSTEM, status = %code, description = %what, "pull request ended");
                    self.open = None;
                    Heard::Nothing
                } else {
                    Heard::Ended(format!("the server answered {code} {what}"))
                }
            }
        }
    }

    /// The next delivery; `None` once stopped and the open request ended.
    /// Cancel-safe: a request sent twice is harmless, and no message is
    /// held across an await.
    async fn next(&mut self) -> Option<Result<async_nats::Message, String>> {
        loop {
            if self.ended {
                return None;
            }
            if self.open.is_none() {
                if self.stopped {
                    self.ended = true;
                    return None;
                }
                if let Err(e) = self
                    .client
                    .publish_with_reply(self.request.clone(), self.reply.clone(), self.body.clone())
                    .await
                {
                    self.ended = true;
                    return Some(Err(format!("sending a pull request: {e}")));
                }
                self.open = Some((self.batch, Instant::now() + PULL_EXPIRES));
            }
            let deadline = self.open.map_or_else(Instant::now, |(_, expires)| expires + PULL_GRACE);
            match tokio::time::timeout_at(deadline.into(), self.inbox.next()).await {
                Ok(Some(m)) => match self.hear(m) {
                    Heard::Message(m) => return Some(Ok(m)),
                    Heard::Nothing => {}
                    Heard::Ended(why) => {
                        self.ended = true;
                        return Some(Err(why));
                    }
                },
                Ok(None) => {
                    self.ended = true;
                    return Some(Err("the inbox subscription closed".to_owned()));
                }
                Err(_) if self.stopped => {
                    tracing::warn!(messaging.system = SYSTEM, inbox = %self.reply, "the open pull request did not end in time; what it brings later is redelivered after AckWait");
                    self.ended = true;
                    return None;
                }
                Err(_) => {
                    self.ended = true;
                    return Some(Err(format!(
                        "no answer to a pull request {PULL_GRACE:?} after its expiry ({PULL_EXPIRES:?})"
                    )));
                }
            }
        }
    }

    /// A delivery already on the inbox, without waiting or asking for more.
    fn try_next(&mut self) -> Option<Result<async_nats::Message, String>> {
        while !self.ended {
            let m = self.inbox.next().now_or_never()?;
            let Some(m) = m else {
                self.ended = true;
                return Some(Err("the inbox subscription closed".to_owned()));
            };
            match self.hear(m) {
                Heard::Message(m) => return Some(Ok(m)),
                Heard::Nothing => {}
                Heard::Ended(why) => {
                    self.ended = true;
                    return Some(Err(why));
                }
            }
        }
        None
    }

    /// Send no more pull requests: [`Puller::next`] yields what the open
    /// request still brings and ends when it is fulfilled or expires (the
    /// server's 408, which comes after every message of that request). Only
    /// then is anything released, so no waiting request of this node is left
    /// on the server to take a released message, or a new one, into an inbox
    /// that is gone.
    fn stop(&mut self) {
        self.stopped = true;
    }
}

/// What a subscription's ackers share.
struct Shared {
    topology: Arc<str>,
    /// `None` for the ingress.
    slot: Option<u32>,
    subject: Arc<str>,
    stream: Arc<str>,
    consumer: Arc<str>,
    /// The failure-count bucket (slots only).
    attempts: Option<kv::Store>,
    /// The ladder, for the delay of a deferred capture.
    schedule: crate::retry::schedule::Schedule,
    progress: Arc<Progress>,
}

struct NatsSubscription {
    puller: Puller,
    js: jetstream::Context,
    /// A redelivery whose failure count is being read: kept here across the
    /// read so that a cancelled `next` loses nothing.
    stash: Option<jetstream::Message>,
    shared: Arc<Shared>,
    floor: Arc<FloorMonitor>,
    /// The in-progress ticker and the floor poller: they end with the
    /// subscription.
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for NatsSubscription {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        if let Some(slot) = self.shared.slot {
            self.floor.forget(&self.shared.topology, slot);
        }
    }
}

/// Stream sequence and server delivery count of a delivery.
fn position(m: &jetstream::Message) -> (u64, u32) {
    match m.info() {
        Ok(i) => (i.stream_sequence, u32::try_from(i.delivered).unwrap_or(1).max(1)),
        Err(_) => (0, 1),
    }
}

impl NatsSubscription {
    fn error(&self, e: &str) -> TransportError {
        let s = &self.shared;
        tracing::warn!(messaging.system = SYSTEM, topology = %s.topology, slot = ?s.slot, consumer = %s.consumer, error = %e, "consumer ended");
        TransportError::new(
            ErrorKind::Connection,
            format!("consumer {} of stream {}: {e}", s.consumer, s.stream),
        )
    }

    fn wrap(&self, message: async_nats::Message) -> jetstream::Message {
        jetstream::Message {
            message,
            context: self.js.clone(),
        }
    }

    /// Does this delivery need its failure count read first?
    fn needs_count(&self, m: &jetstream::Message) -> bool {
        self.shared.attempts.is_some() && position(m).1 > 1
    }

    /// Failures of a redelivered message so far (module docs, "Attempts"):
    /// 0 when none was recorded, or when the bucket cannot be read.
    async fn failures(&self, sequence: u64, delivered: u32) -> u32 {
        let s = &self.shared;
        let (Some(kv), Some(slot)) = (&s.attempts, s.slot) else {
            return 0;
        };
        let key = names::attempts_key(slot, sequence);
        let read = kv.get(key.as_str()).await;
        tracing::debug!(messaging.system = SYSTEM, topology = %s.topology, slot, key, delivered, read = ?read, "failure count read");
        match read {
            Ok(Some(v)) => std::str::from_utf8(&v).ok().and_then(|t| t.parse().ok()).unwrap_or_else(|| {
                tracing::warn!(messaging.system = SYSTEM, topology = %s.topology, slot, key, "failure count does not parse; counted as none");
                0
            }),
            Ok(None) => 0,
            Err(e) => {
                tracing::warn!(
                    messaging.system = SYSTEM, topology = %s.topology, slot, sequence, delivered, error = %e,
                    "failure count not read; the delivery counts as attempt 1 (it may get extra attempts, never a false exhausted)"
                );
                0
            }
        }
    }

    fn delivery(&self, m: jetstream::Message, failures: u32) -> Delivery {
        let s = &self.shared;
        let (sequence, delivered) = position(&m);
        let reply = m.reply.clone();
        let (message, acker) = m.split();
        let stream = &s.stream;
        let fallback = || {
            message
                .headers
                .as_ref()
                .and_then(|h| h.get("Nats-Msg-Id"))
                .map_or_else(|| format!("{stream}-{sequence}"), |v| v.as_str().to_owned())
        };
        // Slot deliveries count attempts by the host's failure count (the
        // stored message is never republished); ingress keeps the header.
        let attempt = failures.saturating_add(1);
        tracing::trace!(messaging.system = SYSTEM, consumer = %s.consumer, sequence, delivered, attempt, reply = ?reply, "delivery");
        let counted = s.slot.map(|_| attempt);
        // Straight from the header map; through a `Wire` only when it does
        // not decode, so the capture gets the message as it came.
        let fast = message.headers.as_ref().and_then(|h| {
            let pairs = h.iter().flat_map(|(name, values)| {
                values
                    .iter()
                    .map(move |v| (AsRef::<str>::as_ref(name), Cow::Borrowed(v.as_str())))
            });
            envelope::decode_pairs(pairs, fallback, counted)
        });
        let decoded = match fast {
            Some(mut env) => {
                env.payload = Vec::from(message.payload);
                Ok(env)
            }
            None => envelope::decode(wire_of(message.headers.as_ref(), message.payload), fallback, counted),
        };
        let track = reply.map(|r| s.progress.track(r));
        Delivery {
            message: decoded,
            source: s.subject.clone(),
            tag: sequence,
            acker: Box::new(NatsAcker {
                acker,
                shared: s.clone(),
                track,
                sequence,
                delivered,
                attempt,
            }),
        }
    }
}

#[async_trait]
impl Subscription for NatsSubscription {
    async fn next(&mut self) -> Option<Result<Delivery, TransportError>> {
        let m = match self.stash.take() {
            Some(m) => m,
            None => match self.puller.next().await? {
                Ok(m) => self.wrap(m),
                Err(e) => return Some(Err(self.error(&e))),
            },
        };
        if !self.needs_count(&m) {
            return Some(Ok(self.delivery(m, 0)));
        }
        // Kept in the stash while the count is read (cancel safety).
        let (sequence, delivered) = position(&m);
        self.stash = Some(m);
        let failures = self.failures(sequence, delivered).await;
        let m = self.stash.take()?;
        Some(Ok(self.delivery(m, failures)))
    }

    fn try_next(&mut self) -> Option<Result<Delivery, TransportError>> {
        if self.stash.is_some() {
            return None;
        }
        let m = match self.puller.try_next()? {
            Ok(m) => self.wrap(m),
            Err(e) => return Some(Err(self.error(&e))),
        };
        if self.needs_count(&m) {
            // `next` reads its count; nothing after it is taken before it.
            self.stash = Some(m);
            return None;
        }
        Some(Ok(self.delivery(m, 0)))
    }

    async fn stop(&mut self) -> bool {
        self.puller.stop();
        true
    }
}

/// Settles one JetStream delivery.
struct NatsAcker {
    acker: jetstream::message::Acker,
    shared: Arc<Shared>,
    /// Its entry in the in-progress ticker.
    track: Option<u64>,
    sequence: u64,
    delivered: u32,
    /// The host's attempt: failures so far + 1 (module docs, "Attempts").
    attempt: u32,
}

impl Drop for NatsAcker {
    fn drop(&mut self) {
        // Settled or not: the ticker stops vouching for it.
        if let Some(id) = self.track.take() {
            self.shared.progress.untrack(id);
        }
    }
}

impl NatsAcker {
    /// The retry path on JetStream: count this attempt as failed (confirmed
    /// by the server before anything else), then `Nak` with the ladder's
    /// delay, which the server waits before it redelivers. A plain `Nak`
    /// would redeliver at once and burn the ladder in milliseconds
    /// (LESSONS.md); the gaps are pinned by
    /// `nats_compliance::retry_gaps_follow_the_backoff`. If the count cannot
    /// be written the failure is not counted (an extra attempt, logged); if
    /// the `Nak` cannot be sent the server redelivers after `AckWait`.
    async fn fail(mut self: Box<Self>, delay: Duration) -> Result<(), TransportError> {
        if let Some(id) = self.track.take() {
            self.shared.progress.untrack(id);
        }
        let s = &self.shared;
        if let (Some(kv), Some(slot)) = (&s.attempts, s.slot) {
            let key = names::attempts_key(slot, self.sequence);
            if let Err(e) = kv.put(key.as_str(), Bytes::from(self.attempt.to_string())).await {
                tracing::warn!(
                    messaging.system = SYSTEM, topology = %s.topology, slot, sequence = self.sequence,
                    attempt = self.attempt, error = %e,
                    "failure count not written; the next delivery repeats this attempt"
                );
            }
        }
        self.acker
            .ack_with(AckKind::Nak(Some(delay)))
            .await
            .map_err(|e| self.err("delayed nak", &e))
    }

    fn err(&self, what: &str, e: &async_nats::Error) -> TransportError {
        TransportError::new(
            ErrorKind::Connection,
            format!(
                "{what} of stream sequence {} on consumer {}: {e}; the server redelivers it",
                self.sequence, self.shared.consumer
            ),
        )
    }
}

#[async_trait]
impl Acker for NatsAcker {
    async fn settle(self: Box<Self>, disposition: Disposition) -> Result<(), TransportError> {
        match disposition {
            Disposition::Ack => self.acker.ack().await.map_err(|e| self.err("ack", &e)),
            Disposition::AckCaptured => self.acker.double_ack().await.map_err(|e| {
                TransportError::new(
                    ErrorKind::Timeout,
                    format!(
                        "ack of stream sequence {seq} on consumer {c} (stream {s}) was not confirmed: {e}. \
                         It may have landed: check whether the consumer's ack floor passed stream sequence {seq} \
                         (`nats consumer info {s} {c}`); if not, it is delivered and captured again",
                        seq = self.sequence,
                        c = self.shared.consumer,
                        s = self.shared.stream,
                    ),
                )
            }),
            Disposition::Retry { delay, .. } => self.fail(delay).await,
            Disposition::Defer => {
                let delay = self
                    .shared
                    .schedule
                    .delay_before(self.attempt.saturating_add(1))
                    .unwrap_or(NATS_DEFAULT_ACK_WAIT);
                self.fail(delay).await
            }
            // Not a failure: nothing is counted, and the message is handed
            // out again at once (the draining node pulls no more).
            Disposition::Release => self
                .acker
                .ack_with(AckKind::Nak(None))
                .await
                .map_err(|e| self.err("nak", &e)),
        }
    }

    /// `None`: the server never gives up on a slot message (`MaxDeliver`
    /// -1), so a failed capture is always retried on a later delivery.
    fn deliveries_left(&self) -> Option<u32> {
        None
    }

    fn provenance(&self) -> Vec<(&'static str, String)> {
        vec![
            (header::STREAM_SEQUENCE, self.sequence.to_string()),
            (header::DELIVERY_COUNT, self.delivered.to_string()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::schedule::RetryPolicy;

    #[test]
    fn names_follow_the_contract() {
        assert_eq!(names::stream("orders"), "WEIR_orders");
        assert_eq!(names::slot_subject("orders", 3), "weir.orders.slot.3");
        assert_eq!(names::slot_consumer("orders", 3), "weir-orders-3");
        assert_eq!(names::ingress("orders"), "weir.orders.ingress");
        assert_eq!(names::dead_letter("orders"), "weir.orders.dead-letter");
        assert_eq!(names::dead_letter_stream("orders"), "WEIR_orders_DLQ");
        // the work stream does not cover the dead-letter subject (module docs)
        assert!(!names::stream_subjects("orders").iter().any(|s| s.ends_with('>')));
    }

    #[test]
    fn slot_consumer_leaves_the_ladder_to_the_host() {
        let mut spec = TopologySpec::new("t", 2);
        spec.retry = RetryPolicy::new(vec![Duration::from_secs(1), Duration::from_secs(2)], 4);
        let c = slot_consumer_config(&spec, 1, 64);
        assert_eq!(c.durable_name.as_deref(), Some("weir-t-1"));
        assert_eq!(c.filter_subject, "weir.t.slot.1");
        assert_eq!(c.ack_wait, Duration::from_secs(1));
        // The host counts failures and times retries: the server never gives up.
        assert_eq!(c.max_deliver, -1);
        assert!(c.backoff.is_empty());
        assert_eq!(c.max_ack_pending, 64);
        assert_eq!(c.ack_policy, AckPolicy::Explicit);
        spec.retry = RetryPolicy::new(vec![Duration::from_secs(1)], 0);
        assert_eq!(slot_consumer_config(&spec, 0, 1).max_deliver, -1);
        spec.retry = RetryPolicy::new(vec![], 0);
        let c = slot_consumer_config(&spec, 0, 0);
        assert_eq!(c.ack_wait, NATS_DEFAULT_ACK_WAIT);
        assert_eq!(c.max_deliver, -1);
        assert_eq!(c.max_ack_pending, 1);
    }

    #[test]
    fn headers_round_trip() {
        let wire = Wire {
            headers: vec![
                (header::MESSAGE_ID.into(), "m-1".into()),
                (header::MESSAGE_TYPE.into(), "ok".into()),
            ],
            body: b"x".to_vec(),
        };
        let h = headers_of(&wire).unwrap();
        let back = wire_of(Some(&h), Bytes::from_static(b"x"));
        assert_eq!(back.header(header::MESSAGE_ID), Some("m-1"));
        assert_eq!(back.header(header::MESSAGE_TYPE), Some("ok"));
        assert_eq!(back.body, b"x");
    }

    #[test]
    fn floor_warning_waits_for_the_ladder() {
        let mut spec = TopologySpec::new("t", 1);
        spec.retry = RetryPolicy::new(vec![Duration::from_secs(10), Duration::from_secs(100)], 4);
        // last delivery at 10 + 100 + 100 = 210s, plus AckWait 10s
        assert_eq!(default_warn_after(&spec), Duration::from_secs(220));
        spec.retry = RetryPolicy::new(vec![Duration::from_secs(1)], 2);
        assert_eq!(default_warn_after(&spec), Duration::from_secs(60));
    }

    #[test]
    fn progress_reports_only_deliveries_held_long_enough() {
        let p = Progress::default();
        let a = p.track(Subject::from("a"));
        assert!(p.due(Duration::from_secs(60)).is_empty());
        assert_eq!(p.due(Duration::ZERO).len(), 1);
        p.untrack(a);
        assert!(p.due(Duration::ZERO).is_empty());
    }
}
