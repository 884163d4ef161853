//! The memory broker's faces: [`Transport`] over its queues, and the
//! dead-letter tools' [`DeadLetterStore`] over its dead-letter lists.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::sync::Notify;

use super::subscription::MemorySubscription;
use super::{DeadList, MemoryBroker, Queue, SlotQueue, Topology, take};
use crate::envelope::Wire;
use crate::transport::dead_letters::{DeadLetter, DeadLetterSession, DeadLetterStore};
use crate::transport::{ErrorKind, RetryOwner, Subscription, TopologySpec, Transport, TransportError};

#[async_trait]
impl Transport for MemoryBroker {
    fn system(&self) -> &'static str {
        "memory"
    }

    fn retry_owner(&self) -> RetryOwner {
        RetryOwner::Host
    }

    async fn declare(&self, spec: &TopologySpec) -> Result<(), TransportError> {
        let mut map = self.shared.topologies.write();
        if let Some(existing) = map.get(&spec.name) {
            if existing.slots.len() != spec.slots as usize {
                return Err(TransportError::new(
                    ErrorKind::Invalid,
                    format!(
                        "topology `{}` exists with {} slots, not {}",
                        spec.name,
                        existing.slots.len(),
                        spec.slots
                    ),
                ));
            }
            return Ok(());
        }
        let slots = (0..spec.slots)
            .map(|n| {
                Arc::new(SlotQueue {
                    name: Arc::from(format!("weir.{}.{n}", spec.name)),
                    q: Mutex::new(Queue::default()),
                    notify: Notify::new(),
                })
            })
            .collect();
        map.insert(
            spec.name.clone(),
            Arc::new(Topology {
                slots,
                dead_letters: Mutex::new(DeadList::default()),
            }),
        );
        Ok(())
    }

    async fn subscribe(
        &self,
        topology: &str,
        slot: u32,
        prefetch: u32,
    ) -> Result<Box<dyn Subscription>, TransportError> {
        let queue = self.slot(topology, slot)?;
        let consumer = self.shared.next_consumer.fetch_add(1, Ordering::Relaxed);
        Ok(Box::new(MemorySubscription {
            broker: self.clone(),
            queue,
            consumer,
            prefetch: prefetch.max(1),
        }))
    }

    async fn publish(&self, topology: &str, slot: u32, wire: Wire) -> Result<(), TransportError> {
        let q = self.slot(topology, slot)?;
        if take(&self.shared.faults.refuse_publishes) {
            return Err(TransportError::new(
                ErrorKind::Refused,
                format!("{} refused the publish (injected)", q.name),
            ));
        }
        self.enqueue(&q, wire, Duration::ZERO);
        Ok(())
    }

    async fn publish_dead_letter(&self, topology: &str, wire: Wire) -> Result<(), TransportError> {
        let t = self.topology(topology)?;
        let delay = self.shared.faults.dead_letter_delay_ms.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if take(&self.shared.faults.refuse_dead_letters) {
            return Err(TransportError::new(
                ErrorKind::Refused,
                format!("weir.{topology}.dead-letter refused the capture (injected)"),
            ));
        }
        let mut list = t.dead_letters.lock();
        list.next += 1;
        let position = list.next;
        list.letters.push((position, wire));
        Ok(())
    }

    fn dead_letters(&self) -> Option<&dyn DeadLetterStore> {
        Some(self)
    }
}

#[async_trait]
impl DeadLetterStore for MemoryBroker {
    /// A copy of the list as it is now; removals take effect at once.
    async fn open(&self, topology: &str) -> Result<Box<dyn DeadLetterSession>, TransportError> {
        let t = self.topology(topology)?;
        let snapshot: VecDeque<DeadLetter> = t
            .dead_letters
            .lock()
            .letters
            .iter()
            .map(|(position, wire)| DeadLetter {
                position: *position,
                wire: wire.clone(),
            })
            .collect();
        Ok(Box::new(MemoryDeadLetters {
            topology: t,
            name: topology.to_owned(),
            expected: snapshot.len() as u64,
            snapshot,
        }))
    }

    fn topologies(&self) -> Vec<(String, u32)> {
        let mut all: Vec<(String, u32)> = self
            .shared
            .topologies
            .read()
            .iter()
            .map(|(name, t)| (name.clone(), u32::try_from(t.slots.len()).unwrap_or(u32::MAX)))
            .collect();
        all.sort();
        all
    }
}

/// A session over the memory broker's dead-letter list.
struct MemoryDeadLetters {
    topology: Arc<Topology>,
    name: String,
    expected: u64,
    snapshot: VecDeque<DeadLetter>,
}

#[async_trait]
impl DeadLetterSession for MemoryDeadLetters {
    fn expected(&self) -> Option<u64> {
        Some(self.expected)
    }

    async fn next(&mut self) -> Result<Option<DeadLetter>, TransportError> {
        Ok(self.snapshot.pop_front())
    }

    async fn remove(&mut self, position: u64) -> Result<(), TransportError> {
        let mut list = self.topology.dead_letters.lock();
        match list.letters.iter().position(|(p, _)| *p == position) {
            Some(i) => {
                list.letters.remove(i);
                Ok(())
            }
            None => Err(TransportError::new(
                ErrorKind::Invalid,
                format!(
                    "dead letter #{position} of topology `{}` is not there (already removed?)",
                    self.name
                ),
            )),
        }
    }

    async fn close(self: Box<Self>) -> Result<(), TransportError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn dead_letters_are_numbered_in_capture_order_and_removed_by_number() {
        let b = MemoryBroker::new();
        b.declare(&TopologySpec::new("t", 1)).await.unwrap();
        for n in ["a", "b", "c"] {
            let w = Wire {
                headers: vec![("weir-message-id".into(), n.into())],
                body: Vec::new(),
            };
            b.publish_dead_letter("t", w).await.unwrap();
        }
        let store = Transport::dead_letters(&b).unwrap();
        assert_eq!(store.topologies(), vec![("t".to_owned(), 1)]);
        let mut s = store.open("t").await.unwrap();
        assert_eq!(s.expected(), Some(3));
        let mut read = Vec::new();
        while let Some(l) = s.next().await.unwrap() {
            read.push((l.position, l.wire.header("weir-message-id").unwrap().to_owned()));
        }
        assert_eq!(read, vec![(1, "a".into()), (2, "b".into()), (3, "c".into())]);
        s.remove(2).await.unwrap();
        assert!(s.remove(2).await.is_err(), "a letter is removed once");
        s.close().await.unwrap();
        let left: Vec<_> = b
            .dead_letters("t")
            .iter()
            .map(|w| w.header("weir-message-id").unwrap().to_owned())
            .collect();
        assert_eq!(left, vec!["a", "c"]);
        // A later capture gets the next number, never a removed one's.
        b.publish_dead_letter("t", Wire::default()).await.unwrap();
        let mut s = store.open("t").await.unwrap();
        let mut last = 0;
        while let Some(l) = s.next().await.unwrap() {
            last = l.position;
        }
        assert_eq!(last, 4);
    }
}
