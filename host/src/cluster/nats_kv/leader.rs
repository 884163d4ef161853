//! The leader on a KV bucket: the `leader` key taken and kept by
//! compare-and-set, and the pass that removes expired nodes, assigns free
//! slots and asks owners to release, each write at the revision read.
//!
//! Without a transaction to re-check the lease in, the leader lease is
//! fenced on this node's clock: [`lead`] writes nothing once `lease −
//! margin` has passed since the newest leader write that succeeded was
//! sent, and another node takes the key only when its entry is older than
//! `lease +` [`REASSIGN_MARGIN`] on the server's clock.

use std::collections::HashSet;
use std::time::Instant;

use futures::StreamExt as _;
use uuid::Uuid;

use super::cache::View;
use super::{Bucket, LEADER_KEY, LeaderValue, Leadership, SlotValue, decode, encode, node_key, slot_key};
use crate::cluster::assign;
use crate::cluster::leased::renewals::interval;
use crate::cluster::leased::{REASSIGN_MARGIN, fence_margin};
use crate::cluster::slots::SlotKey;

impl Bucket {
    /// The instant this node must stop leading (none: it does not lead).
    fn leader_until(&self, id: Uuid) -> Option<Instant> {
        self.leader
            .lock()
            .filter(|l| l.id == id)
            .map(|l| l.sent + self.lease.saturating_sub(fence_margin(self.lease)))
    }

    pub(super) fn leads(&self, id: Uuid) -> bool {
        self.leader_until(id).is_some_and(|u| Instant::now() < u)
    }
}

impl Bucket {
    /// Take or keep the leader key.
    pub(super) async fn try_lead(&self, id: Uuid) -> anyhow::Result<bool> {
        let b = self;
        // The leader entry and its age, read without copying the view.
        let (entry, age) = b.read(|v| {
            let e = v.entries.get(LEADER_KEY).cloned();
            let age = e.as_ref().map(|e| v.age(e));
            (e, age)
        })?;
        let held = *b.leader.lock();
        let sent = Instant::now();
        let (revision, term) = match (held.filter(|l| l.id == id), entry) {
            // Ours: rewritten every renewal interval, at our own revision.
            (Some(l), _) => {
                if l.sent.elapsed() < interval(b.lease) && b.leads(id) {
                    return Ok(true);
                }
                match b
                    .kv
                    .update(LEADER_KEY, encode(&LeaderValue { node: id, term: l.term }), l.revision)
                    .await
                {
                    Ok(r) => (r, l.term),
                    Err(e) => {
                        // Taken by another (our lease ran out), or the write's
                        // fate is unknown: either way, not ours to use.
                        *b.leader.lock() = None;
                        tracing::warn!(error = %e, "the leader key could not be renewed; leading no more");
                        return Ok(false);
                    }
                }
            }
            (None, None) => match b
                .kv
                .create(LEADER_KEY, encode(&LeaderValue { node: id, term: 1 }))
                .await
            {
                Ok(r) => (r, 1),
                Err(_) => return Ok(false),
            },
            (None, Some(e)) => {
                // Another node's, or ours from a write whose fate was unknown:
                // taken only once it ran out by the server's clock.
                let other = decode::<LeaderValue>(&e.value);
                if age.is_none_or(|a| a <= b.lease + REASSIGN_MARGIN) {
                    return Ok(false);
                }
                let term = other.map_or(0, |o| o.term) + 1;
                match b
                    .kv
                    .update(LEADER_KEY, encode(&LeaderValue { node: id, term }), e.revision)
                    .await
                {
                    Ok(r) => (r, term),
                    Err(_) => return Ok(false),
                }
            }
        };
        *b.leader.lock() = Some(Leadership {
            id,
            revision,
            term,
            sent,
        });
        Ok(true)
    }

    /// One leader pass over the cached view; every write is at the revision
    /// read, and none goes out once the leader lease's own deadline passed.
    /// What to write is worked out under the view's lock, without copying
    /// it; the writes go out after.
    pub(super) async fn lead(&self, id: Uuid) -> anyhow::Result<()> {
        let b = self;
        if !b.leads(id) {
            return Ok(());
        }
        let may_write = || b.leads(id);
        // Every slot of the config has its key; nodes expired by more than
        // the margin are removed, at the revision read (a node that renewed
        // meanwhile stays).
        let (missing, expired) = b.read(|v| {
            let missing: Vec<SlotKey> = b
                .all_slots
                .iter()
                .filter(|k| !v.slots.contains_key(*k))
                .cloned()
                .collect();
            let expired: Vec<(Uuid, u64)> = v
                .nodes
                .iter()
                .filter(|(_, n)| v.age_of(n.created) > b.lease + REASSIGN_MARGIN)
                .map(|(id, n)| (*id, n.revision))
                .collect();
            (missing, expired)
        })?;
        // Writes go out WRITES_IN_FLIGHT at a time: one at a time, the
        // 1 024 creates and assignments of a first pass took longer than a
        // step may (measured: docs/SCALE.md).
        futures::stream::iter(missing)
            .for_each_concurrent(WRITES_IN_FLIGHT, |key| async move {
                if may_write() {
                    let _ = b.kv.create(slot_key(&key), encode(&SlotValue::free(0))).await;
                }
            })
            .await;
        let removed: HashSet<Uuid> = futures::stream::iter(expired)
            .map(|(node, revision)| async move {
                if !may_write() {
                    return None;
                }
                match b.kv.delete_expect_revision(node_key(node), Some(revision)).await {
                    Ok(()) => Some(node),
                    Err(e) => {
                        tracing::debug!(node = %node, error = %e, "an expired node changed before its removal");
                        None
                    }
                }
            })
            .buffer_unordered(WRITES_IN_FLIGHT)
            .filter_map(std::future::ready)
            .collect()
            .await;
        if !removed.is_empty() {
            tracing::warn!(nodes = ?removed, "leader: nodes whose lease expired were removed; their slots are free");
        }
        let plan = b.read(|v| plan(v, b.lease, &removed))?;
        futures::stream::iter(plan)
            .for_each_concurrent(WRITES_IN_FLIGHT, |step| async move {
                if may_write() {
                    apply(b, step, may_write).await;
                }
            })
            .await;
        Ok(())
    }
}

/// Write one step of a pass (unless the leader lease's deadline passed).
async fn apply(b: &Bucket, step: Step, may_write: impl Fn() -> bool) {
    let (key, row, revision) = (&step.key, &step.row, step.revision);
    let next = match step.change {
        Change::Reassign { gone, to } => {
            // Its owner left (after draining) or was removed (after
            // fencing): nothing of it runs. Unless the view merely lacks
            // its key (a watch catching up): asked of the server first.
            if still_registered(b, gone).await {
                return;
            }
            tracing::warn!(topology = %key.0, slot = key.1, gone = %gone, owner = %to.map_or_else(|| "none".to_owned(), |u| u.to_string()), "leader: the slot's owner is no longer registered; slot reassigned");
            match to {
                Some(n) => assigned(n, row.epoch + 1),
                None => SlotValue::free(row.epoch),
            }
        }
        Change::Assign(n) => {
            tracing::info!(topology = %key.0, slot = key.1, owner = %n, "leader: slot assigned");
            assigned(n, row.epoch + 1)
        }
        Change::Release(n) => {
            tracing::info!(topology = %key.0, slot = key.1, from = %row.owner.map_or_else(|| "none".to_owned(), |u| u.to_string()), to = %n, "leader: asked the owner to release the slot");
            SlotValue {
                state: "releasing".into(),
                target: Some(n),
                ..row.clone()
            }
        }
    };
    if !may_write() {
        return;
    }
    if let Err(e) = b.kv.update(slot_key(key), encode(&next), revision).await {
        tracing::debug!(topology = %key.0, slot = key.1, error = %e, "leader: the slot changed since it was read; next pass");
    }
}

/// Writes of a pass in flight at once.
const WRITES_IN_FLIGHT: usize = 32;

/// What a pass does to one slot.
enum Change {
    /// Its owner is not registered: to another (or free).
    Reassign { gone: Uuid, to: Option<Uuid> },
    /// A free slot to a node.
    Assign(Uuid),
    /// Its owner is asked to release it to a node.
    Release(Uuid),
}

struct Step {
    key: SlotKey,
    row: SlotValue,
    revision: u64,
    change: Change,
}

/// The changes a pass makes, from the view (nodes in `removed` were just
/// deleted): the balanced assignment ([`assign::assign`]) over the live
/// nodes, leaving alone a slot whose owner's lease ran out by less than the
/// margin (it may be fencing itself).
fn plan(v: &View, lease: std::time::Duration, removed: &HashSet<Uuid>) -> Vec<Step> {
    let registered = |n: &Uuid| v.nodes.contains_key(n) && !removed.contains(n);
    let live: Vec<Uuid> = v
        .nodes
        .iter()
        .filter(|(id, n)| registered(id) && v.age_of(n.created) <= lease && !n.value.leaving)
        .map(|(id, _)| *id)
        .collect();
    let live_set: HashSet<Uuid> = live.iter().copied().collect();
    let expiring = |n: &Uuid| registered(n) && v.nodes.get(n).is_some_and(|e| v.age_of(e.created) > lease);
    let current: Vec<Option<Uuid>> = v
        .slots
        .values()
        .map(|s| s.value.owner.filter(|o| live_set.contains(o)))
        .collect();
    let desired = assign::assign(&live, &current);
    let mut out = Vec::new();
    for ((key, s), want) in v.slots.iter().zip(desired) {
        let row = &s.value;
        if row.owner.is_some_and(|o| expiring(&o)) || row.owner == want {
            continue;
        }
        let change = if let Some(gone) = row.owner.filter(|o| !registered(o)) {
            Change::Reassign { gone, to: want }
        } else {
            match (row.owner, want) {
                (None, Some(n)) => Change::Assign(n),
                (Some(_), Some(n)) if row.state == "assigned" || row.target != Some(n) => Change::Release(n),
                _ => continue,
            }
        };
        out.push(Step {
            key: key.clone(),
            row: row.clone(),
            revision: s.revision,
            change,
        });
    }
    out
}

/// Does the server still hold `node`'s registration? (An error counts as
/// yes: the slot waits for the next pass.)
async fn still_registered(b: &Bucket, node: Uuid) -> bool {
    if b.trust_absence.load(std::sync::atomic::Ordering::Relaxed) {
        return false;
    }
    match b.kv.entry(node_key(node)).await {
        Ok(Some(e)) => e.operation == async_nats::jetstream::kv::Operation::Put,
        Ok(None) => false,
        Err(_) => true,
    }
}

fn assigned(owner: Uuid, epoch: i64) -> SlotValue {
    SlotValue {
        owner: Some(owner),
        epoch,
        state: "assigned".into(),
        target: None,
    }
}
