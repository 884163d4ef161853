//! The dead-letter tools' view of `weir.T.dead-letter`.
//!
//! AMQP has no browse, so a session reads the queue as an exclusive
//! consumer with manual acks and no prefetch limit: it takes as many
//! deliveries as the queue held ready when it opened, in queue order, and
//! holds them unacknowledged. Removing one is an ack followed by a
//! synchronous round trip on the same channel (`basic.qos`): the broker
//! handles a channel's frames in order, so once the answer is here the ack
//! is too. Closing the channel (on [`DeadLetterSession::close`], or when
//! the session is dropped, or when the process dies) returns every letter
//! not removed: RabbitMQ puts a returned message back in its own place in
//! a classic queue, so the order is kept, and marks it `redelivered`.
//!
//! What a read costs: every letter crosses the network once and is held by
//! the reader until it closes. Meanwhile no one else can consume the queue:
//! the consumer is exclusive, so a second dead-letter command on the same
//! topology is refused (`ACCESS_REFUSED`) instead of seeing an empty queue,
//! and a command is refused while any other consumer is attached. Quorum
//! queues (RabbitMQ 3.10) do not enforce `exclusive`: there a session that
//! finds another consumer attached once it is refuses itself. (Single
//! active consumer would not do: a waiting consumer is not counted, and it
//! would read an empty queue.) Captures
//! go on (a capture only publishes): letters captured during a session are
//! not read by it; the broker sends them to its consumer too, which holds
//! them until the close gives them back, at the tail, in their order.

use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt as _;
use lapin::options::{BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;

use super::conn::RabbitMq;
use super::names;
use super::wire::{SYSTEM, lapin_err, wire_of};
use crate::transport::dead_letters::{DeadLetter, DeadLetterSession, DeadLetterStore};
use crate::transport::{ErrorKind, TransportError};

/// How long a session waits for the next delivery it expects before it
/// takes the queue as read (a letter removed by someone else meanwhile).
const READ_PATIENCE: Duration = Duration::from_secs(10);

#[async_trait]
impl DeadLetterStore for RabbitMq {
    async fn open(&self, topology: &str) -> Result<Box<dyn DeadLetterSession>, TransportError> {
        let queue = names::dead_letter(topology);
        let conn = self.conn().await?;
        let channel = conn
            .connection
            .create_channel()
            .await
            .map_err(|e| lapin_err(format!("opening a channel to read {queue}"), &e))?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let ready = channel
            .queue_declare(queue.as_str().into(), passive, FieldTable::default())
            .await
            .map_err(|e| {
                TransportError::new(
                    ErrorKind::Invalid,
                    format!("the dead-letter queue {queue} cannot be read (is topology `{topology}` declared?): {e}"),
                )
            })?
            .message_count();
        // No prefetch limit: every letter is held at once until the close.
        channel
            .basic_qos(0, BasicQosOptions::default())
            .await
            .map_err(|e| lapin_err(format!("setting no prefetch limit to read {queue}"), &e))?;
        let tag = format!("weir-dead-letters.{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let consumer = channel
            .basic_consume(
                queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions {
                    exclusive: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                TransportError::new(
                    ErrorKind::Refused,
                    format!(
                        "cannot read {queue} as its only consumer ({e}): another `weir dead-letters` command \
                         (or another consumer) is reading it; try again when it is done"
                    ),
                )
            })?;
        // Quorum queues do not enforce an exclusive consumer (RabbitMQ 3.10
        // accepts a second one), so the session also counts the queue's
        // consumers once it is attached: anyone else there refuses this
        // session, which gives back what it may have been sent (letters
        // captured since the first reader attached). Two sessions that
        // start together may both refuse: it fails closed.
        let consumers = channel
            .queue_declare(queue.as_str().into(), passive, FieldTable::default())
            .await
            .map_err(|e| lapin_err(format!("counting the consumers of {queue}"), &e))?
            .consumer_count();
        if consumers > 1 {
            let _ = channel
                .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
                .await;
            let _ = channel.close(200, "another reader".into()).await;
            return Err(TransportError::new(
                ErrorKind::Refused,
                format!(
                    "cannot read {queue} as its only consumer ({consumers} consumers attached): another \
                     `weir dead-letters` command (or another consumer) is reading it; try again when it is done"
                ),
            ));
        }
        tracing::debug!(messaging.system = SYSTEM, queue, ready, "reading dead letters");
        Ok(Box::new(RabbitDeadLetters {
            queue,
            channel,
            consumer: Some(consumer),
            tag,
            expected: u64::from(ready),
            tags: Vec::new(),
        }))
    }

    fn topologies(&self) -> Vec<(String, u32)> {
        let mut all: Vec<(String, u32)> = self
            .inner
            .topologies
            .lock()
            .values()
            .map(|s| (s.name.clone(), s.slots))
            .collect();
        all.sort();
        all
    }
}

/// A session over `weir.T.dead-letter` (module docs).
struct RabbitDeadLetters {
    queue: String,
    channel: lapin::Channel,
    /// Kept until the close, so the queue stays this session's alone.
    /// Letters captured during the session reach it too and are held (not
    /// read) until the close returns them, at the tail, in order.
    consumer: Option<lapin::Consumer>,
    tag: String,
    expected: u64,
    /// The delivery tag of each letter read, by position (1-based).
    tags: Vec<u64>,
}

impl RabbitDeadLetters {
    /// Take no more deliveries (those already sent stay held until the close).
    async fn stop_consuming(&mut self) {
        if self.consumer.take().is_some() {
            let _ = self
                .channel
                .basic_cancel(self.tag.as_str().into(), BasicCancelOptions::default())
                .await;
        }
    }

    fn tag_of(&self, position: u64) -> Result<u64, TransportError> {
        usize::try_from(position)
            .ok()
            .and_then(|p| p.checked_sub(1))
            .and_then(|i| self.tags.get(i).copied())
            .ok_or_else(|| {
                TransportError::new(
                    ErrorKind::Invalid,
                    format!(
                        "no dead letter #{position} was read from {} by this session",
                        self.queue
                    ),
                )
            })
    }

    /// The broker handled every ack sent before this on the channel.
    async fn barrier(&self) -> Result<(), TransportError> {
        self.channel
            .basic_qos(0, BasicQosOptions::default())
            .await
            .map_err(|e| lapin_err(format!("confirming removals from {}", self.queue), &e))
    }

    async fn ack(&self, tag: u64) -> Result<(), TransportError> {
        self.channel
            .basic_ack(tag, BasicAckOptions::default())
            .await
            .map_err(|e| lapin_err(format!("removing a dead letter from {}", self.queue), &e))
    }
}

#[async_trait]
impl DeadLetterSession for RabbitDeadLetters {
    fn expected(&self) -> Option<u64> {
        Some(self.expected)
    }

    async fn next(&mut self) -> Result<Option<DeadLetter>, TransportError> {
        if self.tags.len() as u64 >= self.expected {
            // The consumer stays until the close: while it is there, no other
            // command can take the queue (and see it empty).
            return Ok(None);
        }
        let Some(consumer) = self.consumer.as_mut() else {
            return Ok(None);
        };
        let delivery = match tokio::time::timeout(READ_PATIENCE, consumer.next()).await {
            Ok(Some(Ok(d))) => d,
            Ok(Some(Err(e))) => return Err(lapin_err(format!("reading {}", self.queue), &e)),
            Ok(None) => {
                return Err(TransportError::new(
                    ErrorKind::Connection,
                    format!("the broker ended the read of {}", self.queue),
                ));
            }
            Err(_) => {
                tracing::warn!(
                    messaging.system = SYSTEM, queue = %self.queue, read = self.tags.len(), expected = self.expected,
                    "fewer dead letters arrived than the queue held when the read began (removed meanwhile?)"
                );
                self.expected = self.tags.len() as u64;
                return Ok(None);
            }
        };
        self.tags.push(delivery.delivery_tag);
        let wire = wire_of(&delivery.properties, delivery.data);
        Ok(Some(DeadLetter {
            position: self.tags.len() as u64,
            wire,
        }))
    }

    async fn remove(&mut self, position: u64) -> Result<(), TransportError> {
        let tag = self.tag_of(position)?;
        self.ack(tag).await?;
        self.barrier().await
    }

    async fn remove_all(&mut self, positions: &[u64]) -> Result<(), TransportError> {
        for p in positions {
            let tag = self.tag_of(*p)?;
            self.ack(tag).await?;
        }
        self.barrier().await
    }

    async fn close(mut self: Box<Self>) -> Result<(), TransportError> {
        self.stop_consuming().await;
        if !self.channel.status().connected() {
            // A closed channel already gave every unacked letter back.
            return Ok(());
        }
        self.channel
            .close(200, "weir: dead letters read".into())
            .await
            .map_err(|e| lapin_err(format!("returning the unremoved dead letters to {}", self.queue), &e))
    }
}
