//! Settling a RabbitMQ delivery: the one function that turns a
//! [`Disposition`] into acks ([`RabbitAcker::settle`]).

use std::sync::Arc;

use async_trait::async_trait;
use lapin::options::{BasicAckOptions, BasicNackOptions};

use super::coalesce::Coalescer;
use super::conn::RabbitMq;
use super::wire::{SYSTEM, lapin_err};
use crate::envelope;
use crate::transport::{Acker, Disposition, ErrorKind, TransportError};

/// Settles one RabbitMQ delivery.
pub(super) struct RabbitAcker {
    pub(super) acker: lapin::Acker,
    pub(super) transport: RabbitMq,
    pub(super) topology: Arc<str>,
    /// `None` for ingress deliveries (they are forwarded, never retried).
    pub(super) slot: Option<u32>,
    pub(super) queue: Arc<str>,
    pub(super) tag: u64,
    pub(super) acks: Arc<Coalescer>,
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
    fn ack_now(&self) -> Option<Result<(), TransportError>> {
        // Coalesced: the flusher sends it in a `multiple` ack.
        self.acks.finished(self.tag).then_some(Ok(()))
    }

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
