//! A slot's (or the ingress's) subscription: binds the consumer, pulls,
//! reads the failure count of each redelivery, decodes, and hands out
//! deliveries with their ackers; the ack-floor poller beside it.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use async_nats::jetstream::consumer::{PullConsumer, pull};
use async_trait::async_trait;

use super::acker::{NatsAcker, Progress, Shared, progress_ticker};
use super::conn::{MAX_PULL_BATCH, Nats, SYSTEM};
use super::declare::default_warn_after;
use super::floor::{FloorMonitor, FloorState, StallClock};
use super::names;
use super::pull::Puller;
use super::wire::wire_of;
use crate::envelope;
use crate::retry::schedule::Redelivery;
use crate::transport::{Delivery, ErrorKind, Subscription, TopologySpec, TransportError};

impl Nats {
    pub(super) async fn subscribe_consumer(
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

pub(super) struct NatsSubscription {
    pub(super) puller: Puller,
    pub(super) js: jetstream::Context,
    /// A redelivery whose failure count is being read: kept here across the
    /// read so that a cancelled `next` loses nothing.
    pub(super) stash: Option<jetstream::Message>,
    pub(super) shared: Arc<Shared>,
    pub(super) floor: Arc<FloorMonitor>,
    /// The in-progress ticker and the floor poller: they end with the
    /// subscription.
    pub(super) tasks: Vec<tokio::task::JoinHandle<()>>,
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
