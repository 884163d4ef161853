//! The broker seam. A [`Transport`] declares a topology, subscribes to a slot,
//! and publishes with confirms; a [`Delivery`] is settled exactly once by one
//! [`Disposition`], which each broker turns into acks in one function
//! ([`Acker::settle`]). Everything above this module is broker-neutral.

pub mod connect;
pub mod dead_letters;
pub mod limits;
pub mod memory;
pub mod nats;
pub mod rabbitmq;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::envelope::{self, DecodeError, Envelope, Wire};
use crate::partition;

pub use crate::config::redact_url;

/// Negative control for the drain tests, never for production: with this
/// environment variable set to `1` a drained subscription and the node's
/// shutdown only put their acks on the wire (RabbitMQ: the frames written,
/// NATS: the connection flushed) and do not wait for the broker to confirm
/// that it has them, so a node can exit while its acks are still on the way.
pub const NEGATIVE_CONTROL_UNCONFIRMED_ACKS: &str = "WEIR_NEGATIVE_CONTROL_UNCONFIRMED_ACKS";

/// How long a drain waits for the broker to confirm the acks sent so far.
pub const ACK_CONFIRM_TIMEOUT: Duration = Duration::from_secs(5);

/// The log line (info) of a drain still waiting for that confirmation after
/// [`ACK_CONFIRM_PATIENCE`]: a stalled broker or network.
pub const ACK_CONFIRM_WAITING: &str = "waiting for the broker to confirm the acks sent so far";

/// After this long without the confirmation, [`ACK_CONFIRM_WAITING`] is logged.
pub const ACK_CONFIRM_PATIENCE: Duration = Duration::from_millis(100);

/// True when [`NEGATIVE_CONTROL_UNCONFIRMED_ACKS`] is set (read once).
pub fn unconfirmed_acks() -> bool {
    static SET: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SET.get_or_init(|| {
        let set = std::env::var(NEGATIVE_CONTROL_UNCONFIRMED_ACKS).is_ok_and(|v| v == "1");
        if set {
            tracing::error!(
                "{NEGATIVE_CONTROL_UNCONFIRMED_ACKS}=1: drains do NOT wait for the broker to confirm their acks (a test's negative control; never in production)"
            );
        }
        set
    })
}

/// Wait (up to [`ACK_CONFIRM_TIMEOUT`]) for `confirm`, the broker's answer
/// to something sent after every ack of `what`: once it is here, the broker
/// has every one of them. Logs [`ACK_CONFIRM_WAITING`] when it takes longer
/// than [`ACK_CONFIRM_PATIENCE`], and a warning when it never comes.
pub async fn confirm_acks<E: std::fmt::Display>(
    system: &'static str,
    what: &str,
    confirm: impl std::future::Future<Output = Result<(), E>>,
) {
    tokio::pin!(confirm);
    let started = std::time::Instant::now();
    let result = match tokio::time::timeout(ACK_CONFIRM_PATIENCE, &mut confirm).await {
        Ok(r) => Some(r),
        Err(_) => {
            tracing::info!(messaging.system = system, what, timeout = ?ACK_CONFIRM_TIMEOUT, "{ACK_CONFIRM_WAITING}");
            tokio::time::timeout(ACK_CONFIRM_TIMEOUT.saturating_sub(started.elapsed()), &mut confirm)
                .await
                .ok()
        }
    };
    match result {
        Some(Ok(())) => {
            tracing::debug!(
                messaging.system = system,
                what,
                waited_ms = started.elapsed().as_millis(),
                "the broker confirmed the acks"
            )
        }
        Some(Err(e)) => tracing::warn!(
            messaging.system = system, what, error = %e,
            "the broker did not confirm the acks sent so far; any it did not get are redelivered"
        ),
        None => tracing::warn!(
            messaging.system = system, what, timeout = ?ACK_CONFIRM_TIMEOUT,
            "no confirmation of the acks sent so far; any the broker did not get are redelivered"
        ),
    }
}

/// What kind of failure a broker operation had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The connection or channel is gone.
    Connection,
    /// The broker refused (nack, negative confirm, an object it does not have).
    Refused,
    /// The stream a consumer is bound on does not exist (deleted, or a
    /// server that lost its store): declaring the topology again mends it.
    Missing,
    /// No answer in time.
    Timeout,
    /// Already settled, or the consumer that received it is gone.
    Settled,
    /// The caller asked for something that does not exist or is invalid.
    Invalid,
}

/// A broker operation that failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{kind:?}: {detail}")]
pub struct TransportError {
    /// The class of failure.
    pub kind: ErrorKind,
    /// What happened, naming the object.
    pub detail: String,
}

impl TransportError {
    /// Build an error of `kind`.
    pub fn new(kind: ErrorKind, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
        }
    }
}

/// What the host decided for a delivery; turned into broker acks by
/// [`Acker::settle`], once.
#[derive(Debug)]
pub enum Disposition {
    /// Done: handled (cascades confirmed) or forwarded. Brokers may coalesce
    /// these acks, never over a delivery that is not settled.
    Ack,
    /// Captured on the dead-letter destination (capture confirmed): ack now,
    /// on its own, and wait for whatever answer the broker gives, so that a
    /// lost ack is reported (`uncertain`) instead of assumed.
    AckCaptured,
    /// Retryable failure: deliver `envelope` (attempt already incremented)
    /// again after `delay`. Brokers that own the ladder ignore the delay.
    Retry {
        /// The message as it should be redelivered.
        envelope: Envelope,
        /// Wait before the next delivery.
        delay: Duration,
    },
    /// Not processed (drain, handoff): back to the queue unchanged, without
    /// counting as a delivery where the broker allows.
    Release,
    /// A dead-letter capture failed: deliver it again later so the capture
    /// can be retried. Brokers that time redeliveries themselves (JetStream)
    /// leave the delivery for their timer instead of redelivering at once,
    /// so the capture reserve is not burnt in milliseconds; the others treat
    /// it as [`Disposition::Release`].
    Defer,
}

/// Who times redeliveries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryOwner {
    /// The host republishes to a delay (memory, RabbitMQ).
    Host,
    /// The broker redelivers on its own schedule (JetStream `BackOff`).
    Broker,
}

/// Settles one delivery.
#[async_trait]
pub trait Acker: Send + Sync {
    /// The one function per broker that turns a disposition into acks.
    /// Consumes the acker: a delivery cannot be settled twice.
    async fn settle(self: Box<Self>, disposition: Disposition) -> Result<(), TransportError>;

    /// [`Disposition::Ack`] without awaiting, where the broker can take it
    /// so (the memory broker; RabbitMQ's coalesced acks): `Some` with the
    /// result, and the acker is spent (drop it, never settle it again).
    /// `None`: nothing was done; [`Acker::settle`] it. Saves the boxed
    /// future of `settle` on the path every handled message takes.
    fn ack_now(&self) -> Option<Result<(), TransportError>> {
        None
    }

    /// Deliveries the broker will still make of this message after this one
    /// (`None`: unbounded). `Some(0)` means a failed capture strands it.
    fn deliveries_left(&self) -> Option<u32> {
        None
    }

    /// Broker-specific provenance a dead letter of this delivery carries
    /// beside the common headers (JetStream: stream sequence and delivery
    /// count). Empty by default.
    fn provenance(&self) -> Vec<(&'static str, String)> {
        Vec::new()
    }
}

/// One received message.
pub struct Delivery {
    /// The decoded message, or the raw one and why it does not decode.
    pub message: Result<Envelope, (Wire, DecodeError)>,
    /// The queue or subject it came from (for `weir-source`).
    pub source: Arc<str>,
    /// Broker position for logs: delivery tag or stream sequence.
    pub tag: u64,
    /// Settles it.
    pub acker: Box<dyn Acker>,
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("source", &self.source)
            .field("tag", &self.tag)
            .finish()
    }
}

/// A consumer of one slot.
#[async_trait]
pub trait Subscription: Send {
    /// The next delivery; `None` when the subscription has ended. Must be
    /// cancel-safe: dropping the future loses no message.
    async fn next(&mut self) -> Option<Result<Delivery, TransportError>>;

    /// A delivery that is already here, without waiting; lets a runner take
    /// a burst in one go. The default never has one.
    fn try_next(&mut self) -> Option<Result<Delivery, TransportError>> {
        None
    }

    /// Put on the wire what the subscription still owes the broker (acks it
    /// coalesced) before it is dropped. Called after the drain; the default
    /// has nothing to do.
    async fn close(&mut self) {}

    /// Stop taking deliveries (the start of a drain): the broker delivers
    /// nothing more to this subscription. Returns true when [`next`] then
    /// yields the deliveries that had already reached the node and ends
    /// with `None` (JetStream, whose pull requests would otherwise keep
    /// delivering into a draining node); false (the default) when the
    /// subscription has no such end, and the caller simply stops reading.
    ///
    /// [`next`]: Subscription::next
    async fn stop(&mut self) -> bool {
        false
    }
}

/// A topology as the transport needs to know it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologySpec {
    /// Topology name (`T` in the broker names).
    pub name: String,
    /// Number of slots.
    pub slots: u32,
    /// The retry policy: brokers that time redeliveries themselves write it
    /// into their objects (JetStream `BackOff`/`MaxDeliver`; RabbitMQ rung
    /// queues). The memory broker ignores it.
    pub retry: crate::retry::schedule::RetryPolicy,
}

impl TopologySpec {
    /// A topology with the default retry policy.
    pub fn new(name: impl Into<String>, slots: u32) -> Self {
        Self {
            name: name.into(),
            slots,
            retry: crate::retry::schedule::RetryPolicy::default(),
        }
    }
}

/// What a broker knows that the retry schedule checks depend on
/// ([`crate::retry::schedule::Schedule::check`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RetryFacts {
    /// The stream's retention (`max_age`); `None`: unlimited or no stream yet.
    pub stream_max_age: Option<Duration>,
    /// The slot consumers' `AckWait` as the server reports it; `None`: no
    /// consumer yet.
    pub ack_wait: Option<Duration>,
}

/// What the broker did with a confirmed cascade.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Landed {
    /// Stored: a new message.
    Stored,
    /// Recognised by its id as a copy of one the broker already holds (an
    /// earlier attempt's publish whose confirm was lost) and dropped.
    Duplicate,
}

/// A message broker.
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// `messaging.system` for logs and metrics: `memory`, `rabbitmq`, `nats`.
    fn system(&self) -> &'static str;

    /// Who times redeliveries on this broker.
    fn retry_owner(&self) -> RetryOwner;

    /// Create the topology's broker objects; idempotent.
    async fn declare(&self, topology: &TopologySpec) -> Result<(), TransportError>;

    /// Consume one slot with at most `prefetch` unsettled deliveries.
    async fn subscribe(
        &self,
        topology: &str,
        slot: u32,
        prefetch: u32,
    ) -> Result<Box<dyn Subscription>, TransportError>;

    /// Consume the topology's ingress (messages published without a slot,
    /// which the host forwards to their slot). `None`: this broker has none.
    async fn subscribe_ingress(
        &self,
        _topology: &str,
        _prefetch: u32,
    ) -> Result<Option<Box<dyn Subscription>>, TransportError> {
        Ok(None)
    }

    /// Publish to a slot and wait for the broker's confirm.
    async fn publish(&self, topology: &str, slot: u32, wire: Wire) -> Result<(), TransportError>;

    /// Publish a cascade to a slot, as [`Transport::publish`], under `id`
    /// (its deterministic cascade id) in the broker's own dedup field where
    /// it has one: JetStream's `Nats-Msg-Id`, so the copy a rerun publishes
    /// after a lost confirm is dropped by the server. Brokers without one
    /// publish plainly ([`Landed::Stored`]); consumers deduplicate by
    /// `weir-message-id` (`handler.dedup`).
    async fn publish_cascade(&self, topology: &str, slot: u32, wire: Wire, id: &str) -> Result<Landed, TransportError> {
        let _ = id;
        self.publish(topology, slot, wire).await.map(|()| Landed::Stored)
    }

    /// Publish to the dead-letter destination and wait for the confirm.
    async fn publish_dead_letter(&self, topology: &str, wire: Wire) -> Result<(), TransportError>;

    /// The broker's facts for the schedule checks of `topology` (stream
    /// retention, consumer `AckWait`), read without changing anything.
    /// `None`: this broker has none to offer (memory, RabbitMQ).
    async fn retry_facts(&self, _topology: &str) -> Result<Option<RetryFacts>, TransportError> {
        Ok(None)
    }

    /// Messages of `slot` waiting to be delivered (RabbitMQ: ready messages
    /// of the slot queue; JetStream: the slot consumer's pending count).
    /// `None`: this broker cannot say. Read-only; for `weir status`.
    async fn backlog(&self, _topology: &str, _slot: u32) -> Result<Option<u64>, TransportError> {
        Ok(None)
    }

    /// How many consumers `slot` has now (RabbitMQ: the slot queue's
    /// consumer count; JetStream: pull requests waiting on the slot's
    /// consumer, so a node that just stopped counts until its requests
    /// expire). `None`: this broker cannot say. Read-only; for
    /// `weir status` and `weir publish`'s warning about an unconsumed slot.
    async fn consumers(&self, _topology: &str, _slot: u32) -> Result<Option<u32>, TransportError> {
        Ok(None)
    }

    /// The ack floor of every slot consumer this transport watches
    /// (JetStream); empty for brokers without one. Observe only.
    fn ack_floor(&self) -> Vec<crate::transport::nats::floor::FloorState> {
        Vec::new()
    }

    /// Put on the wire everything this transport has accepted but not yet
    /// sent (acks that are published without an answer, on NATS), before
    /// the process exits. Called last by `Node::shutdown`; the default has
    /// nothing to do.
    async fn close(&self) {}

    /// The dead-letter destinations, for the dead-letter tools (list,
    /// redrive, purge). `None`: this transport offers none (a wrapper).
    fn dead_letters(&self) -> Option<&dyn dead_letters::DeadLetterStore> {
        None
    }
}

/// The slot of `env` in a topology of `slots` slots: that of its group, or
/// of its id when it has none.
pub fn slot_of(env: &Envelope, slots: u32) -> u32 {
    partition::slot_for(env.group(), &env.id, slots)
}

/// Publish `env` through `transport` to the slot of its group (or of its id
/// when it has none), waiting for the broker's confirm: the one place a
/// message is placed on a slot (ingress, cascades, `Node::publish`).
pub async fn publish_to_slot(
    transport: &dyn Transport,
    topology: &str,
    slots: u32,
    env: &Envelope,
) -> Result<(), TransportError> {
    transport
        .publish(topology, slot_of(env, slots), envelope::encode(env))
        .await
}

/// [`publish_to_slot`] for a handler's cascade: under its id in the broker's
/// dedup field ([`Transport::publish_cascade`]).
pub async fn publish_cascade_to_slot(
    transport: &dyn Transport,
    topology: &str,
    slots: u32,
    env: &Envelope,
) -> Result<Landed, TransportError> {
    transport
        .publish_cascade(topology, slot_of(env, slots), envelope::encode(env), &env.id)
        .await
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn redaction_hides_the_user_information_only() {
        assert_eq!(redact_url("amqp://guest:pw@host:5672/%2f"), "amqp://***@host:5672/%2f");
        assert_eq!(redact_url("postgres://u:p@ss@db/weir"), "postgres://***@db/weir");
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(redact_url("nats://host:4222/a@b"), "nats://host:4222/a@b");
        assert_eq!(redact_url("amqp://host/vhost?x=a@b"), "amqp://host/vhost?x=a@b");
        assert_eq!(redact_url("no scheme u:p@host"), "no scheme u:p@host");
    }
}
