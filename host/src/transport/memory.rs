//! The embedded broker: per-slot queues with prefetch, ack, release,
//! delayed redelivery and a dead-letter list, behind the same [`Transport`]
//! trait as the real brokers. Like RabbitMQ, the host owns the retry ladder.
//! Fault injection ([`Faults`]) lets tests make a capture or an ack fail.
//! The dead-letter list numbers its letters in capture order and serves the
//! dead-letter tools ([`DeadLetterStore`]) like the real brokers' do.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::dead_letters::{DeadLetter, DeadLetterSession, DeadLetterStore};
use super::{
    Acker, Delivery, Disposition, ErrorKind, RetryOwner, Subscription, TopologySpec, Transport, TransportError,
};
use crate::envelope::{self, Wire};

/// Failures a test can ask the broker to produce; each counter is consumed
/// one failure at a time.
#[derive(Debug, Default)]
pub struct Faults {
    /// Refuse this many dead-letter publishes.
    pub refuse_dead_letters: AtomicU32,
    /// Refuse this many slot publishes.
    pub refuse_publishes: AtomicU32,
    /// Apply this many acks but report them as failed (lost confirmation).
    pub lose_ack_confirms: AtomicU32,
    /// Hold every dead-letter publish this many milliseconds before confirming.
    pub dead_letter_delay_ms: AtomicU64,
}

fn take(counter: &AtomicU32) -> bool {
    counter
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
        .is_ok()
}

/// A message in a queue: the broker's one copy of it, shared with the
/// unacked book while a consumer holds it (a delivery copies out only what
/// its envelope keeps).
#[derive(Debug)]
struct Stored {
    seq: u64,
    blob: Blob,
}

type IdMap<V> = HashMap<u64, V, nohash_hasher::BuildNoHashHasher<u64>>;

/// A delivered message the broker keeps until it is settled (to requeue it
/// on release or when its consumer goes away): the stored blob itself.
struct Held {
    consumer: u64,
    blob: Blob,
}

/// A [`Wire`] as one flat, shared buffer: the body first, then the headers.
/// Storing one costs one allocation, not one per header, and holding it
/// for a requeue costs a reference count. Only [`Blob::of`] makes one, so
/// every string in it is a `&str` it wrote, at the lengths it wrote.
#[derive(Debug, Clone)]
struct Blob(Arc<[u8]>);

impl Blob {
    fn of(w: &Wire) -> Self {
        let len = 8 + w.body.len() + w.headers.iter().map(|(k, v)| 8 + k.len() + v.len()).sum::<usize>();
        let mut b = Vec::with_capacity(len);
        b.extend_from_slice(&(w.body.len() as u32).to_le_bytes());
        b.extend_from_slice(&w.body);
        b.extend_from_slice(&(w.headers.len() as u32).to_le_bytes());
        for (k, v) in &w.headers {
            b.extend_from_slice(&(k.len() as u32).to_le_bytes());
            b.extend_from_slice(k.as_bytes());
            b.extend_from_slice(&(v.len() as u32).to_le_bytes());
            b.extend_from_slice(v.as_bytes());
        }
        Self(b.into())
    }

    /// The body, and the headers as borrowed pairs.
    fn parts(&self) -> (&[u8], impl Iterator<Item = (&str, &str)>) {
        let mut r = Reader(&self.0);
        let body_len = r.len();
        let body = r.bytes(body_len);
        let n = r.len();
        (body, (0..n).map(move |_| (r.str(), r.str())))
    }
}

/// Reads a [`Blob`] back, in the order [`Blob::of`] wrote it.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        head
    }
    fn len(&mut self) -> usize {
        u32::from_le_bytes(self.bytes(4).try_into().unwrap_or_default()) as usize
    }
    fn str(&mut self) -> &'a str {
        let n = self.len();
        let bytes = self.bytes(n);
        // SAFETY: a `Reader` reads only a `Blob`, and reads it in the order
        // and at the lengths `Blob::of` wrote it: these bytes are exactly
        // one `&str` it copied in, so UTF-8. (Validating them again was
        // 1 400 instructions a message, more than the rest of the decode.)
        unsafe { std::str::from_utf8_unchecked(bytes) }
    }
}

fn from_blob(b: &Blob) -> Wire {
    let (body, headers) = b.parts();
    Wire {
        headers: headers.map(|(k, v)| (k.to_owned(), v.to_owned())).collect(),
        body: body.to_vec(),
    }
}

/// Decode a delivery straight from the broker's blob: only what the
/// envelope keeps is copied ([`envelope::decode_pairs`]); one that does not
/// decode is rebuilt whole for [`envelope::decode`], which names why.
fn decode_blob(b: &Blob, seq: u64) -> Result<envelope::Envelope, (Wire, envelope::DecodeError)> {
    let fallback = || format!("memory-{seq}");
    let (body, headers) = b.parts();
    let pairs = headers.map(|(k, v)| (k, std::borrow::Cow::Borrowed(v)));
    match envelope::decode_pairs(pairs, fallback, None) {
        Some(mut env) => {
            env.payload = body.to_vec();
            Ok(env)
        }
        None => envelope::decode(from_blob(b), fallback, None),
    }
}

#[derive(Default)]
struct Queue {
    ready: VecDeque<Stored>,
    delayed: BinaryHeap<Reverse<(Instant, u64)>>,
    delayed_items: IdMap<Stored>,
    /// seq → the consumer holding it and the broker's copy
    unacked: IdMap<Held>,
    /// consumer → unacked count
    per_consumer: IdMap<u32>,
}

impl Queue {
    fn promote_due(&mut self, now: Instant) {
        while let Some(Reverse((due, seq))) = self.delayed.peek().copied() {
            if due > now {
                break;
            }
            self.delayed.pop();
            if let Some(s) = self.delayed_items.remove(&seq) {
                self.ready.push_back(s);
            }
        }
    }

    fn next_due(&self) -> Option<Instant> {
        self.delayed.peek().map(|Reverse((d, _))| *d)
    }

    fn depth(&self) -> usize {
        self.ready.len() + self.delayed_items.len() + self.unacked.len()
    }
}

struct SlotQueue {
    name: Arc<str>,
    q: Mutex<Queue>,
    notify: Notify,
}

/// A topology's dead letters, numbered in capture order (from 1).
#[derive(Default)]
struct DeadList {
    next: u64,
    letters: Vec<(u64, Wire)>,
}

struct Topology {
    slots: Vec<Arc<SlotQueue>>,
    dead_letters: Mutex<DeadList>,
}

struct Shared {
    topologies: RwLock<HashMap<String, Arc<Topology>>>,
    next_seq: AtomicU64,
    next_consumer: AtomicU64,
    faults: Faults,
}

/// The in-memory broker. Cheap to clone; clones share the queues.
#[derive(Clone)]
pub struct MemoryBroker {
    shared: Arc<Shared>,
}

impl Default for MemoryBroker {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryBroker {
    /// An empty broker.
    pub fn new() -> Self {
        Self {
            shared: Arc::new(Shared {
                topologies: RwLock::new(HashMap::new()),
                next_seq: AtomicU64::new(1),
                next_consumer: AtomicU64::new(1),
                faults: Faults::default(),
            }),
        }
    }

    /// Failure injection for tests.
    pub fn faults(&self) -> &Faults {
        &self.shared.faults
    }

    fn topology(&self, name: &str) -> Result<Arc<Topology>, TransportError> {
        self.shared
            .topologies
            .read()
            .get(name)
            .cloned()
            .ok_or_else(|| TransportError::new(ErrorKind::Invalid, format!("topology `{name}` is not declared")))
    }

    fn slot(&self, topology: &str, slot: u32) -> Result<Arc<SlotQueue>, TransportError> {
        let t = self.topology(topology)?;
        t.slots.get(slot as usize).cloned().ok_or_else(|| {
            TransportError::new(
                ErrorKind::Invalid,
                format!(
                    "slot {slot} does not exist in topology `{topology}` ({} slots)",
                    t.slots.len()
                ),
            )
        })
    }

    /// Messages on the dead-letter list of `topology`.
    pub fn dead_letters(&self, topology: &str) -> Vec<Wire> {
        self.topology(topology)
            .map(|t| t.dead_letters.lock().letters.iter().map(|(_, w)| w.clone()).collect())
            .unwrap_or_default()
    }

    /// Messages ready, delayed or unacknowledged in one slot.
    pub fn depth(&self, topology: &str, slot: u32) -> usize {
        self.slot(topology, slot).map(|s| s.q.lock().depth()).unwrap_or(0)
    }

    /// Messages delivered to a consumer and not yet settled, in `topology`.
    pub fn unacked(&self, topology: &str) -> usize {
        self.topology(topology)
            .map(|t| t.slots.iter().map(|s| s.q.lock().unacked.len()).sum())
            .unwrap_or(0)
    }

    /// Messages anywhere in `topology`'s slot queues.
    pub fn total_depth(&self, topology: &str) -> usize {
        self.topology(topology)
            .map(|t| t.slots.iter().map(|s| s.q.lock().depth()).sum())
            .unwrap_or(0)
    }

    fn enqueue(&self, q: &SlotQueue, wire: Wire, delay: Duration) {
        let seq = self.shared.next_seq.fetch_add(1, Ordering::Relaxed);
        let stored = Stored {
            seq,
            blob: Blob::of(&wire),
        };
        {
            let mut g = q.q.lock();
            if delay.is_zero() {
                g.ready.push_back(stored);
            } else {
                g.delayed.push(Reverse((Instant::now() + delay, seq)));
                g.delayed_items.insert(seq, stored);
            }
        }
        q.notify.notify_waiters();
    }
}

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

struct MemorySubscription {
    broker: MemoryBroker,
    queue: Arc<SlotQueue>,
    consumer: u64,
    prefetch: u32,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_copy_round_trips_headers_and_body() {
        let w = Wire {
            headers: vec![
                ("weir-message-id".into(), "m-1".into()),
                ("x".into(), String::new()),
                ("ü".into(), "v".into()),
            ],
            body: vec![0, 1, 2, 255],
        };
        assert_eq!(from_blob(&Blob::of(&w)), w);
        assert_eq!(from_blob(&Blob::of(&Wire::default())), Wire::default());
    }

    #[test]
    fn a_delivery_decoded_from_the_blob_is_what_decode_makes() {
        let wire = |headers: &[(&str, &str)]| Wire {
            headers: headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            body: b"payload".to_vec(),
        };
        for w in [
            wire(&[
                ("weir-message-id", "m-1"),
                ("weir-message-type", "t"),
                ("weir-group-id", "g"),
                ("weir-attempt", "3"),
                ("x-trace", "ü"),
            ]),
            wire(&[("weir-message-type", "t")]),
            // Neither decodes: the error names why and keeps the wire whole.
            wire(&[("weir-message-id", "m-2")]),
            wire(&[("weir-message-type", "t"), ("weir-attempt", "zero")]),
        ] {
            // (The WIT record has no `PartialEq`; its `Debug` shows every field.)
            assert_eq!(
                format!("{:?}", decode_blob(&Blob::of(&w), 7)),
                format!("{:?}", envelope::decode(w.clone(), || "memory-7".to_owned(), None))
            );
        }
    }

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
