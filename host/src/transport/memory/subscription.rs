//! The memory broker's consumers: a subscription takes messages from its
//! slot's queue within its prefetch, and each delivery's acker settles it
//! there (ack, retry after a delay, release).

use std::cmp::Reverse;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::time::Instant;

use super::blob::decode_blob;
use super::{Held, MemoryBroker, SlotQueue, Stored, take};
use crate::envelope;
use crate::transport::{Acker, Delivery, Disposition, ErrorKind, Subscription, TransportError};

/// One consumer of a slot's queue.
pub(super) struct MemorySubscription {
    pub(super) broker: MemoryBroker,
    pub(super) queue: Arc<SlotQueue>,
    pub(super) consumer: u64,
    pub(super) prefetch: u32,
}

impl MemorySubscription {
    /// Take one deliverable message, if any; the time to wake otherwise.
    fn try_take(&self) -> Result<Stored, Option<Instant>> {
        let mut g = self.queue.q.lock();
        g.promote_due(Instant::now());
        let held = g.per_consumer.get(&self.consumer).copied().unwrap_or(0);
        if held >= self.prefetch {
            return Err(None);
        }
        match g.ready.pop_front() {
            Some(s) => {
                let held = Held {
                    consumer: self.consumer,
                    blob: s.blob.clone(),
                };
                g.unacked.insert(s.seq, held);
                *g.per_consumer.entry(self.consumer).or_default() += 1;
                Ok(s)
            }
            None => Err(g.next_due()),
        }
    }
}

#[async_trait]
impl Subscription for MemorySubscription {
    async fn next(&mut self) -> Option<Result<Delivery, TransportError>> {
        loop {
            let notified = self.queue.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.try_take() {
                Ok(stored) => return Some(Ok(self.delivery(stored))),
                Err(Some(due)) => {
                    tokio::select! {
                        _ = &mut notified => {}
                        _ = tokio::time::sleep_until(due) => {}
                    }
                }
                Err(None) => notified.await,
            }
        }
    }

    fn try_next(&mut self) -> Option<Result<Delivery, TransportError>> {
        self.try_take().ok().map(|stored| Ok(self.delivery(stored)))
    }
}

impl MemorySubscription {
    fn delivery(&self, stored: Stored) -> Delivery {
        let seq = stored.seq;
        let message = decode_blob(&stored.blob, seq);
        Delivery {
            message,
            source: self.queue.name.clone(),
            tag: seq,
            acker: Box::new(MemoryAcker {
                broker: self.broker.clone(),
                queue: self.queue.clone(),
                seq,
            }),
        }
    }
}

impl Drop for MemorySubscription {
    /// A consumer that goes away returns what it held, like a closed channel.
    fn drop(&mut self) {
        {
            let mut g = self.queue.q.lock();
            let mine: Vec<u64> = g
                .unacked
                .iter()
                .filter(|(_, h)| h.consumer == self.consumer)
                .map(|(s, _)| *s)
                .collect();
            let mut back: Vec<Stored> = mine
                .iter()
                .filter_map(|s| g.unacked.remove(s).map(|h| Stored { seq: *s, blob: h.blob }))
                .collect();
            back.sort_by_key(|s| Reverse(s.seq));
            for s in back {
                g.ready.push_front(s);
            }
            g.per_consumer.remove(&self.consumer);
        }
        self.queue.notify.notify_waiters();
    }
}

struct MemoryAcker {
    broker: MemoryBroker,
    queue: Arc<SlotQueue>,
    seq: u64,
}

impl MemoryAcker {
    /// Take the delivery out of the unacked book (once).
    fn take(&self) -> Result<Held, TransportError> {
        let taken = {
            let mut g = self.queue.q.lock();
            let taken = g.unacked.remove(&self.seq);
            if let Some(held) = &taken
                && let Some(n) = g.per_consumer.get_mut(&held.consumer)
            {
                *n = n.saturating_sub(1);
            }
            taken
        };
        taken.ok_or_else(|| {
            TransportError::new(
                ErrorKind::Settled,
                format!(
                    "delivery {} on {} was already settled or returned",
                    self.seq, self.queue.name
                ),
            )
        })
    }

    /// An ack, once the delivery is taken: its place in the window is free.
    fn acked(&self) -> Result<(), TransportError> {
        self.queue.notify.notify_waiters();
        if take(&self.broker.shared.faults.lose_ack_confirms) {
            return Err(TransportError::new(
                ErrorKind::Timeout,
                format!(
                    "ack of delivery {} on {}: confirmation lost (injected)",
                    self.seq, self.queue.name
                ),
            ));
        }
        Ok(())
    }
}

#[async_trait]
impl Acker for MemoryAcker {
    fn ack_now(&self) -> Option<Result<(), TransportError>> {
        Some(self.take().and_then(|_| self.acked()))
    }

    async fn settle(self: Box<Self>, disposition: Disposition) -> Result<(), TransportError> {
        let held = self.take()?;
        match disposition {
            Disposition::Ack | Disposition::AckCaptured => return self.acked(),
            Disposition::Retry { envelope, delay } => {
                self.broker.enqueue(&self.queue, envelope::encode(&envelope), delay);
            }
            Disposition::Release | Disposition::Defer => {
                let stored = Stored {
                    seq: self.seq,
                    blob: held.blob,
                };
                self.queue.q.lock().ready.push_front(stored);
                self.queue.notify.notify_waiters();
            }
        }
        Ok(())
    }
}
