//! A queue's subscription: consumes with the prefetch, decodes, and hands
//! out deliveries with their ackers (handled acks coalesced).

use std::sync::Arc;

use async_trait::async_trait;
use futures::{FutureExt as _, StreamExt as _};
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;

use super::acker::RabbitAcker;
use super::coalesce::Coalescer;
use super::conn::RabbitMq;
use super::wire::{SYSTEM, header_pairs, lapin_err, wire_of};
use crate::envelope;
use crate::transport::{Delivery, Subscription, TransportError};

impl RabbitMq {
    pub(super) async fn subscribe_queue(
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

pub(super) struct RabbitSubscription {
    pub(super) transport: RabbitMq,
    pub(super) topology: Arc<str>,
    pub(super) slot: Option<u32>,
    pub(super) queue: Arc<str>,
    pub(super) consumer: lapin::Consumer,
    /// Acks of handled deliveries, coalesced (see [`coalesce`]).
    pub(super) acks: Arc<Coalescer>,
    /// Kept open while the subscription lives; once the consumer, the
    /// coalescer and every acker are gone the channel closes, which returns
    /// unsettled deliveries.
    pub(super) _channel: lapin::Channel,
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
