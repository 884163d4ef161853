//! A lane: the queue of one group's deliveries (or of one (tenant, handler)'s
//! ungrouped batched messages), run one job at a time in arrival order.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::envelope::Envelope;
use crate::observe::stats::Stats;
use crate::partition;
use crate::router::BatchRule;
use crate::transport::Delivery;

/// A delivery waiting in a lane.
pub struct Queued {
    pub d: Delivery,
    /// When the runner took it (a batch's linger counts from its oldest member).
    pub at: Instant,
    /// How it is batched, if it is.
    pub batch: Option<Arc<BatchRule>>,
    /// Its binding parks the group when it fails (`on_failure = "park"`):
    /// it runs alone in its job, so nothing of its group runs after it
    /// before its outcome is known.
    pub park: bool,
}

impl Queued {
    pub fn env(&self) -> Option<&Envelope> {
        self.d.message.as_ref().ok()
    }
}

#[derive(Default)]
pub struct Lane {
    pub queue: VecDeque<Queued>,
    /// Jobs of this lane in flight (at most one unless `loose`).
    pub running: usize,
    /// Waiting in the runner's ready queue.
    pub ready: bool,
    /// The head batch waits for more members until then.
    pub lingering: Option<Instant>,
    /// Ungrouped batched messages of one (tenant, handler): no order to keep,
    /// so several of its batches may run at once.
    pub loose: bool,
    /// The group is parked behind this failed message (`on_failure = "park"`).
    pub parked: Option<Parked>,
}

/// A parked group: its head failed and waits on the retry ladder; the rest
/// of the group waits in the lane, in order.
#[derive(Debug, Clone)]
pub struct Parked {
    /// The head's message id.
    pub id: String,
    /// Since when the group is parked (its head's first failure).
    pub since: Instant,
    /// The head's attempts that failed so far while parked here.
    pub failures: u32,
    /// The head came back from the ladder and is at the front of the queue
    /// (or running): the lane may run it, and only it.
    pub head_back: bool,
    /// Read from the store at the slot's start (parked by the previous
    /// owner): dropped as stale if its head is not back by then.
    pub deadline: Option<Instant>,
}

impl Lane {
    /// May the scheduler take another job from this lane now?
    pub fn can_start(&self) -> bool {
        !self.queue.is_empty()
            && (self.running == 0 || self.loose)
            && self.lingering.is_none()
            && self.parked.as_ref().is_none_or(|p| p.head_back)
    }

    /// Parked with its head away on the ladder.
    pub fn waiting(&self) -> bool {
        self.parked.as_ref().is_some_and(|p| !p.head_back)
    }
}

/// The key of a group's lane: the FNV-1a hash of (tenant, group id), so two
/// tenants' groups of the same name never share a lane (one tenant cannot
/// hold another's messages behind its own). Without a tenant it is the hash
/// of the group id alone (the same hash the slot function starts from). Two
/// keys that collide share a lane and are serialised together: slower,
/// never unsafe.
pub fn lane_key(tenant: Option<&str>, group: &str) -> u64 {
    match tenant {
        None => partition::fnv1a_64(group.as_bytes()),
        // A NUL cannot be part of the tenant's UTF-8 name, so ("a", "bc") and
        // ("ab", "c") hash different byte strings.
        Some(t) => partition::fnv1a_64_continue(
            partition::fnv1a_64_continue(partition::fnv1a_64(t.as_bytes()), b"\0"),
            group.as_bytes(),
        ),
    }
}

/// The lane of ungrouped batched messages of one (tenant, handler).
pub fn loose_key(tenant: Option<&str>, handler: &str) -> u64 {
    let key = format!("\0loose\0{}\0{handler}", tenant.unwrap_or_default());
    partition::fnv1a_64(key.as_bytes())
}

/// What `bypass_batch_lanes` mixes into a group's key to give its batches a
/// lane of their own (the negative control).
pub const BYPASS_SALT: u64 = 0x9e37_79b9_7f4a_7c15;

pub type LaneMap = HashMap<u64, Lane, nohash_hasher::BuildNoHashHasher<u64>>;

/// Take a lane's queue for release at a drain (its batch members counted).
pub fn take_queue(stats: &Stats, lane: &mut Lane) -> Vec<Delivery> {
    let members = lane.queue.iter().filter(|q| q.batch.is_some()).count() as u64;
    stats.batch_released.fetch_add(members, Ordering::Relaxed);
    lane.lingering = None;
    lane.queue.drain(..).map(|q| q.d).collect()
}
