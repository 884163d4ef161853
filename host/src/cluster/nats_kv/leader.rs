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

use uuid::Uuid;

use super::{
    Bucket, LEADER_KEY, LeaderValue, Leadership, NodeValue, SlotValue, decode, encode, nodes, slot_key, slots,
};
use crate::cluster::assign;
use crate::cluster::leased::renewals::interval;
use crate::cluster::leased::{REASSIGN_MARGIN, fence_margin};

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
        let v = b.current()?;
        let held = *b.leader.lock();
        let entry = v.entries.get(LEADER_KEY).cloned();
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
                if v.age(&e) <= b.lease + REASSIGN_MARGIN {
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
    pub(super) async fn lead(&self, id: Uuid) -> anyhow::Result<()> {
        let b = self;
        if !b.leads(id) {
            return Ok(());
        }
        let v = b.current()?;
        let may_write = || b.leads(id);
        // Every slot of the config has its key.
        for key in &b.all_slots {
            let k = slot_key(key);
            if !v.entries.contains_key(&k) && may_write() {
                let _ = b.kv.create(&k, encode(&SlotValue::free(0))).await;
            }
        }
        let all = nodes(&v);
        // Expired by more than the margin: removed, at the revision read (a
        // node that renewed meanwhile stays).
        let mut removed = HashSet::new();
        for (node, _, age, revision) in &all {
            if *age > b.lease + REASSIGN_MARGIN && may_write() {
                match b
                    .kv
                    .delete_expect_revision(super::node_key(*node), Some(*revision))
                    .await
                {
                    Ok(()) => {
                        removed.insert(*node);
                    }
                    Err(e) => tracing::debug!(node = %node, error = %e, "an expired node changed before its removal"),
                }
            }
        }
        if !removed.is_empty() {
            tracing::warn!(nodes = ?removed, "leader: nodes whose lease expired were removed; their slots are free");
        }
        let registered: HashSet<Uuid> = all.iter().map(|n| n.0).filter(|n| !removed.contains(n)).collect();
        let live: Vec<Uuid> = all
            .iter()
            .filter(|(n, value, age, _)| *age <= b.lease && !leaving(value) && registered.contains(n))
            .map(|n| n.0)
            .collect();
        let live_set: HashSet<Uuid> = live.iter().copied().collect();
        // Registered, lease run out (not yet by the margin): may be fencing.
        let expiring: HashSet<Uuid> = all
            .iter()
            .filter(|(n, _, age, _)| *age > b.lease && registered.contains(n))
            .map(|n| n.0)
            .collect();
        let rows = slots(&v);
        let current: Vec<Option<Uuid>> = rows
            .iter()
            .map(|r| r.1.owner.filter(|o| live_set.contains(o)))
            .collect();
        let desired = assign::assign(&live, &current);
        for ((key, row, revision), want) in rows.iter().zip(desired) {
            let pinned = row.owner.is_some_and(|o| expiring.contains(&o));
            if pinned || row.owner == want {
                continue;
            }
            let next = if let Some(gone) = row.owner.filter(|o| !registered.contains(o)) {
                // Its owner left (after draining) or was removed (after
                // fencing): nothing of it runs. Unless the view merely lacks
                // its key (a watch catching up): asked of the server first.
                if !may_write() || still_registered(b, gone).await {
                    continue;
                }
                tracing::warn!(topology = %key.0, slot = key.1, gone = %gone, owner = ?want, "leader: the slot's owner is no longer registered; slot reassigned");
                match want {
                    Some(n) => assigned(n, row.epoch + 1),
                    None => SlotValue::free(row.epoch),
                }
            } else {
                match (row.owner, want) {
                    (None, Some(n)) => {
                        tracing::info!(topology = %key.0, slot = key.1, owner = %n, "leader: slot assigned");
                        assigned(n, row.epoch + 1)
                    }
                    (Some(_), Some(n)) if row.state == "assigned" || row.target != Some(n) => {
                        tracing::info!(topology = %key.0, slot = key.1, from = ?row.owner, to = %n, "leader: asked the owner to release the slot");
                        SlotValue {
                            state: "releasing".into(),
                            target: Some(n),
                            ..row.clone()
                        }
                    }
                    _ => continue,
                }
            };
            if !may_write() {
                break;
            }
            if let Err(e) = b.kv.update(slot_key(key), encode(&next), *revision).await {
                tracing::debug!(topology = %key.0, slot = key.1, error = %e, "leader: the slot changed since it was read; next pass");
            }
        }
        Ok(())
    }
}

/// Does the server still hold `node`'s registration? (An error counts as
/// yes: the slot waits for the next pass.)
async fn still_registered(b: &Bucket, node: Uuid) -> bool {
    if b.trust_absence.load(std::sync::atomic::Ordering::Relaxed) {
        return false;
    }
    match b.kv.entry(super::node_key(node)).await {
        Ok(Some(e)) => e.operation == async_nats::jetstream::kv::Operation::Put,
        Ok(None) => false,
        Err(_) => true,
    }
}

fn leaving(n: &NodeValue) -> bool {
    n.leaving
}

fn assigned(owner: Uuid, epoch: i64) -> SlotValue {
    SlotValue {
        owner: Some(owner),
        epoch,
        state: "assigned".into(),
        target: None,
    }
}
