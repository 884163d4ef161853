//! RabbitMQ (AMQP 0-9-1, lapin). Owns the broker objects of a topology, the
//! one connection a node keeps, confirmed publishes, slot and ingress
//! consumers, the one function that turns a [`Disposition`] into acks
//! ([`acker`]), and the dead-letter tools' reads of the dead-letter queue
//! ([`dead_letters`]). Slots, lanes and the ladder arithmetic are left
//! to the layers above.
//!
//! Broker objects of topology `T` (names fixed by DESIGN.md):
//! - exchange `weir.T` (direct, durable);
//! - every queue classic or quorum after `transport.queue_type` (the
//!   arguments of each, and why, in [`queue_type`]);
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

pub mod acker;
mod coalesce;
pub mod conn;
pub mod dead_letters;
pub mod declare;
pub mod names;
pub mod queue_type;
pub mod subscription;
pub mod wire;

use std::sync::atomic::Ordering as AtomicOrdering;

use async_trait::async_trait;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;

pub use conn::{DEFER_BACKOFF_MAX, DEFER_BACKOFF_MIN, RabbitMq};
pub use declare::{NEGATIVE_CONTROL_NO_SAC, rungs};
pub use queue_type::QueueType;

use crate::envelope::Wire;
use crate::transport::{ErrorKind, RetryOwner, Subscription, TopologySpec, Transport, TransportError};
use declare::declare_on;
use wire::{SYSTEM, lapin_err};

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
        self.check_server(spec)?;
        declare_on(&conn.connection, spec, self.inner.queue_type).await?;
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
        Ok(self
            .inspect(topology, slot)
            .await?
            .map(|(messages, _)| u64::from(messages)))
    }

    async fn consumers(&self, topology: &str, slot: u32) -> Result<Option<u32>, TransportError> {
        Ok(self.inspect(topology, slot).await?.map(|(_, consumers)| consumers))
    }

    fn dead_letters(&self) -> Option<&dyn crate::transport::dead_letters::DeadLetterStore> {
        Some(self)
    }
}

impl RabbitMq {
    /// The slot queue's ready messages and consumers (`None`: no such queue).
    async fn inspect(&self, topology: &str, slot: u32) -> Result<Option<(u32, u32)>, TransportError> {
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
            Ok(q) => Some((q.message_count(), q.consumer_count())),
            Err(_) => None,
        };
        let _ = ch.close(200, "inspected".into()).await;
        Ok(depth)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::conn::with_heartbeat;
    use super::wire::{properties, wire_of};
    use super::*;
    use crate::envelope::header;
    use crate::transport::redact_url as redact;

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
