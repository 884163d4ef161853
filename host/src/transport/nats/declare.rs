//! Declaring a topology's server objects: the work and dead-letter streams,
//! the failure-count bucket, and the slot and ingress consumers (created,
//! or updated with the old and new values logged).

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, ErrorCode, kv, stream};

use super::conn::{ATTEMPTS_MIN_AGE, Conn, Nats, SYSTEM};
use super::names;
use super::wire::{is_not_found, is_stream_not_found, js_code};
use crate::retry::schedule::{NATS_DEFAULT_ACK_WAIT, Redelivery};
use crate::transport::{ErrorKind, TopologySpec, TransportError};

/// The desired config of slot `slot`'s consumer: unlimited deliveries and no
/// `BackOff`, since the host counts failures and times each retry with a
/// delayed `Nak` (module docs, "Attempts"); `AckWait` (the first rung) only
/// times the redelivery of a delivery nobody settled (a node that died).
pub(super) fn slot_consumer_config(spec: &TopologySpec, slot: u32, prefetch: u32) -> pull::Config {
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
pub(super) fn attempts_max_age(spec: &TopologySpec) -> Duration {
    spec.retry
        .schedule(Redelivery::JETSTREAM)
        .retention_needed()
        .map_or(ATTEMPTS_MIN_AGE, |r| r.saturating_mul(2).max(ATTEMPTS_MIN_AGE))
}

/// The server's duplicate window when a stream names none (nats-server's
/// `StreamDefaultDuplicatesWindow`).
pub(super) const SERVER_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
/// Time allowed per handler delivery, beside the ladder's delays, in the
/// duplicate window: a call and the confirms of its cascades (each publish
/// waits at most 5 s for its `PubAck`).
pub(super) const DUPLICATE_PER_ATTEMPT: Duration = Duration::from_secs(30);
/// The window when `max_deliver` is unlimited (no last try to cover).
pub(super) const DUPLICATE_WINDOW_UNLIMITED: Duration = Duration::from_secs(24 * 3600);

/// The work stream's duplicate window: how long the server remembers a
/// cascade's `Nats-Msg-Id` (its deterministic cascade id) to drop the copy a
/// retry of its cause publishes after a lost `PubAck`. It covers the retry
/// ladder: from the first delivery to the handler's last try
/// ([`crate::retry::schedule::Schedule::time_to_dead_letter`]) plus
/// [`DUPLICATE_PER_ATTEMPT`] per handler delivery, at least the server's
/// default; [`DUPLICATE_WINDOW_UNLIMITED`] when `max_deliver` is unlimited.
/// nats-server refuses a window longer than the stream's `max_age` ("duplicates
/// window can not be larger then max age"), so it is capped there.
pub(super) fn duplicate_window(spec: &TopologySpec, max_age: Duration) -> Duration {
    let schedule = spec.retry.schedule(Redelivery::JETSTREAM);
    let window = match (schedule.time_to_dead_letter(), schedule.handler_deliveries()) {
        (Some(ladder), Some(tries)) => ladder.saturating_add(DUPLICATE_PER_ATTEMPT.saturating_mul(tries)),
        _ => DUPLICATE_WINDOW_UNLIMITED,
    };
    let window = window.max(SERVER_DUPLICATE_WINDOW);
    if max_age.is_zero() { window } else { window.min(max_age) }
}

/// The desired config of the ingress consumer: one unacknowledged message at
/// a time, whichever node holds it, so forwarding keeps the order, and a
/// short `AckWait` kept alive by in-progress signals while a forward is in
/// flight, so a forwarder that dies stalls the ingress for `ack_wait` only
/// (module docs, "Ingress").
pub(super) fn ingress_consumer_config(topology: &str, ack_wait: Duration) -> pull::Config {
    pull::Config {
        durable_name: Some(names::ingress_consumer(topology)),
        description: Some(format!("weir: ingress of topology {topology}, forwarded to the slots")),
        filter_subject: names::ingress(topology),
        deliver_policy: DeliverPolicy::All,
        ack_policy: AckPolicy::Explicit,
        ack_wait,
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
pub(super) fn default_warn_after(spec: &TopologySpec) -> Duration {
    let schedule = spec.retry.schedule(Redelivery::JETSTREAM);
    let ack_wait = spec.retry.ladder.first().copied().unwrap_or(NATS_DEFAULT_ACK_WAIT);
    let held = schedule
        .retention_needed()
        .unwrap_or_else(|| spec.retry.ladder.iter().sum());
    held.saturating_add(ack_wait).max(Duration::from_secs(60))
}

impl Nats {
    /// Create the stream `name` over `subjects`, or narrow/widen an existing
    /// one to exactly those subjects (its other settings, such as `max_age`,
    /// are the operator's and are kept). With `dedup` (the work stream's
    /// topology) its duplicate window is [`duplicate_window`], set on an
    /// existing stream too (the old and new values logged).
    pub(super) async fn ensure_stream(
        &self,
        conn: &Conn,
        name: &str,
        subjects: Vec<String>,
        dedup: Option<&TopologySpec>,
    ) -> Result<(), TransportError> {
        match conn.js.get_stream(name).await {
            Ok(stream) => {
                let info = stream.cached_info();
                let replicas = self.inner.options.replicas;
                if info.config.num_replicas != replicas {
                    tracing::warn!(
                        messaging.system = SYSTEM,
                        stream = name,
                        have = info.config.num_replicas,
                        want = replicas,
                        "transport.replicas differs from the existing stream's replicas, which are kept (the operator's: \
                         `nats stream edit {name} --replicas {replicas}` changes them)"
                    );
                }
                let mut have = info.config.subjects.clone();
                let mut want = subjects.clone();
                have.sort();
                want.sort();
                let window = dedup.map(|spec| duplicate_window(spec, info.config.max_age));
                let old_window = info.config.duplicate_window;
                let new_window = window.filter(|w| *w != old_window);
                if have != want || new_window.is_some() {
                    let mut config = info.config.clone();
                    config.subjects = subjects.clone();
                    if let Some(w) = new_window {
                        config.duplicate_window = w;
                    }
                    conn.js.update_stream(config).await.map_err(|e| {
                        TransportError::new(
                            ErrorKind::Refused,
                            format!(
                                "updating stream {name} (subjects {have:?} to {want:?}, duplicate window {} to {}): {e}",
                                humantime::format_duration(old_window),
                                humantime::format_duration(window.unwrap_or(old_window)),
                            ),
                        )
                    })?;
                    if have != want {
                        tracing::warn!(messaging.system = SYSTEM, stream = name, old = ?have, new = ?want, "stream subjects updated");
                    }
                    if let Some(w) = new_window {
                        tracing::info!(
                            messaging.system = SYSTEM, stream = name,
                            old = %humantime::format_duration(old_window), new = %humantime::format_duration(w),
                            "stream duplicate window set to cover the retry ladder"
                        );
                    }
                }
                Ok(())
            }
            Err(e) if is_stream_not_found(&e) => {
                // A new stream has no max_age (unlimited retention).
                let window = dedup.map(|spec| duplicate_window(spec, Duration::ZERO));
                conn.js
                    .create_stream(stream::Config {
                        name: name.to_owned(),
                        subjects: subjects.clone(),
                        storage: stream::StorageType::File,
                        num_replicas: self.inner.options.replicas,
                        duplicate_window: window.unwrap_or_default(),
                        ..stream::Config::default()
                    })
                    .await
                    .map_err(|e| {
                        TransportError::new(
                            ErrorKind::Refused,
                            format!(
                                "creating stream {name} over {subjects:?} (file storage, transport.replicas = {}{}): {e}",
                                self.inner.options.replicas,
                                window.map(|w| format!(", duplicate window {}", humantime::format_duration(w))).unwrap_or_default(),
                            ),
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

    /// Refuse `transport.replicas` above what the server can hold: a server
    /// outside a cluster holds one replica; a cluster member tells its
    /// cluster's client URLs, one per server unless the cluster hides them
    /// (then the server's own refusal of the stream names the key).
    pub(super) fn check_replicas(&self, conn: &Conn) -> Result<(), TransportError> {
        let replicas = self.inner.options.replicas;
        if replicas <= 1 {
            return Ok(());
        }
        let info = conn.client.server_info();
        let servers = match info.cluster.as_deref() {
            None | Some("") => Some(1),
            Some(_) if info.connect_urls.is_empty() => None,
            Some(_) => Some(info.connect_urls.len()),
        };
        match servers {
            Some(n) if replicas > n => Err(TransportError::new(
                ErrorKind::Invalid,
                format!(
                    "transport.replicas = {replicas} needs a JetStream cluster of at least {replicas} servers, but {} \
                     (server {}) {}; accepted here: replicas = {}",
                    self.shown_urls(),
                    info.server_name,
                    match info.cluster.as_deref() {
                        None | Some("") => "is a single server, in no cluster".to_owned(),
                        Some(c) => format!("is in cluster {c:?} of {n} servers"),
                    },
                    n.min(5),
                ),
            )),
            _ => Ok(()),
        }
    }

    pub(super) async fn declare_streams(&self, conn: &Conn, spec: &TopologySpec) -> Result<(), TransportError> {
        self.check_replicas(conn)?;
        let t = spec.name.as_str();
        // The work stream first: an old one over `weir.T.>` overlaps the DLQ.
        self.ensure_stream(conn, &names::stream(t), names::stream_subjects(t), Some(spec))
            .await?;
        self.ensure_stream(conn, &names::dead_letter_stream(t), vec![names::dead_letter(t)], None)
            .await?;
        self.ensure_attempts(conn, spec).await.map(drop)
    }

    /// The failure-count bucket of `spec` (module docs, "Attempts"): bound
    /// when it exists (its settings are kept), created when missing.
    pub(super) async fn ensure_attempts(&self, conn: &Conn, spec: &TopologySpec) -> Result<kv::Store, TransportError> {
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
                        num_replicas: self.inner.options.replicas,
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
    pub(super) async fn ensure_consumer(
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
                jetstream::stream::ConsumerErrorKind::JetStream(j) if js_code(&j) == ErrorCode::STREAM_NOT_FOUND => {
                    ErrorKind::Missing
                }
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
    pub(super) async fn bind(
        &self,
        conn: &Conn,
        spec: &TopologySpec,
        desired: pull::Config,
    ) -> Result<PullConsumer, TransportError> {
        let stream = names::stream(&spec.name);
        match self.ensure_consumer(conn, &stream, desired.clone()).await {
            Err(e) if e.kind == ErrorKind::Missing => {
                tracing::warn!(messaging.system = SYSTEM, stream = %stream, "stream missing; declaring the topology again");
                self.declare_streams(conn, spec).await?;
                self.ensure_consumer(conn, &stream, desired).await
            }
            other => other,
        }
    }
}
