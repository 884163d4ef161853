//! The embedded broker: per-slot queues with prefetch, ack, release,
//! delayed redelivery and a dead-letter list, behind the same [`Transport`]
//! trait as the real brokers. Like RabbitMQ, the host owns the retry ladder.
//! Fault injection ([`Faults`]) lets tests make a capture or an ack fail.
//! The dead-letter list numbers its letters in capture order and serves the
//! dead-letter tools ([`DeadLetterStore`]) like the real brokers' do.
//!
//! The files: this one holds the queues and the broker's own methods;
//! `blob` the flat copy of a message the queues keep, `subscription` the
//! consumers and their acks, `broker` the [`Transport`] and
//! [`DeadLetterStore`] faces built on them.
//!
//! [`Transport`]: super::Transport
//! [`DeadLetterStore`]: super::dead_letters::DeadLetterStore

mod blob;
mod broker;
mod subscription;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{ErrorKind, TransportError};
use crate::envelope::Wire;

use self::blob::Blob;

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
