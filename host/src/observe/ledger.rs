//! A ledger that watches guest calls and settlements: it detects two calls
//! of one group running at once (claim-and-release on the (tenant, group) key, with a
//! compare-and-remove so a losing claimant cannot evict the holder), counts
//! out-of-order starts within a group, the peak number of groups running at
//! once (cross-group parallelism), and the final outcome of every message id.
//! Used by `weir demo` and by the invariant tests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::thread::ThreadId;

use parking_lot::Mutex;

use super::CallObserver;
use crate::envelope::Envelope;
use crate::outcome::Outcome;
use crate::outcome::SettleObserver;

/// Header the ledger reads a message's position within its group from.
pub const SEQ_HEADER: &str = "weir-ledger-seq";

/// See the module docs.
#[derive(Debug, Default)]
pub struct Ledger {
    claims: Mutex<HashMap<String, ThreadId>>,
    last_seq: Mutex<HashMap<String, u64>>,
    outcomes: Mutex<HashMap<String, Outcome>>,
    overlaps: AtomicU64,
    out_of_order: AtomicU64,
    calls: AtomicU64,
    batches: AtomicU64,
    mixed_batches: AtomicU64,
    peak_groups: AtomicUsize,
}

impl Ledger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// Times a call started while another call of its group was running.
    pub fn overlaps(&self) -> u64 {
        self.overlaps.load(Ordering::Relaxed)
    }

    /// Calls that started with a lower [`SEQ_HEADER`] than an earlier call of the group.
    pub fn out_of_order(&self) -> u64 {
        self.out_of_order.load(Ordering::Relaxed)
    }

    /// Guest calls observed.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// `handle-batch` calls observed (their members count in [`Ledger::calls`]).
    pub fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

    /// Batches whose members did not all share one tenant and one group.
    pub fn mixed_batches(&self) -> u64 {
        self.mixed_batches.load(Ordering::Relaxed)
    }

    /// Most groups seen running at the same moment.
    pub fn peak_groups(&self) -> usize {
        self.peak_groups.load(Ordering::Relaxed)
    }

    /// Final outcome per message id (handled or dead-lettered), last one wins.
    pub fn outcomes(&self) -> HashMap<String, Outcome> {
        self.outcomes.lock().clone()
    }

    /// Distinct groups that had a call.
    pub fn groups(&self) -> usize {
        self.last_seq.lock().len()
    }
}

/// The key a lane runs under: (tenant, group), since two tenants' groups of
/// one name are different groups (they may run at once, in their own order).
/// `None` for a message without a group.
fn lane_of(msg: &Envelope) -> Option<String> {
    let group = msg.group()?;
    Some(match &msg.tenant_id {
        Some(t) => format!("{t}\0{group}"),
        None => group.to_owned(),
    })
}

impl Ledger {
    /// Check `msg`'s position against the latest started in `group`.
    fn note_seq(&self, group: &str, msg: &Envelope) {
        let seq = msg.header(SEQ_HEADER).and_then(|s| s.parse::<u64>().ok());
        let mut last = self.last_seq.lock();
        let entry = last.entry(group.to_owned()).or_insert(0);
        if let Some(seq) = seq {
            if seq < *entry {
                self.out_of_order.fetch_add(1, Ordering::Relaxed);
            }
            *entry = (*entry).max(seq);
        }
    }
}

impl CallObserver for Ledger {
    fn before(&self, msg: &Envelope) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let Some(group) = lane_of(msg) else { return };
        {
            let mut claims = self.claims.lock();
            if claims.contains_key(&group) {
                self.overlaps.fetch_add(1, Ordering::Relaxed);
                tracing::error!(group = msg.group(), tenant = msg.tenant_id.as_deref(), message_id = %msg.id, "ledger: two calls of one group at once");
            } else {
                claims.insert(group.clone(), std::thread::current().id());
            }
            self.peak_groups.fetch_max(claims.len(), Ordering::Relaxed);
        }
        self.note_seq(&group, msg);
    }

    /// One call for the whole batch: one claim on its group, every member
    /// counted, and a batch mixing tenants or groups counted as mixed.
    fn before_batch(&self, batch: &[Envelope]) {
        let Some(first) = batch.first() else { return };
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.calls
            .fetch_add(batch.len().saturating_sub(1) as u64, Ordering::Relaxed);
        if batch
            .iter()
            .any(|m| m.group() != first.group() || m.tenant_id != first.tenant_id)
        {
            self.mixed_batches.fetch_add(1, Ordering::Relaxed);
            tracing::error!(message_id = %first.id, "ledger: a batch mixes tenants or groups");
        }
        self.before(first);
        if let Some(group) = lane_of(first) {
            batch[1..].iter().for_each(|m| self.note_seq(&group, m));
        }
    }

    fn after(&self, msg: &Envelope) {
        let Some(group) = lane_of(msg) else { return };
        let mut claims = self.claims.lock();
        if claims.get(&group) == Some(&std::thread::current().id()) {
            claims.remove(&group);
        }
    }
}

impl SettleObserver for Ledger {
    fn settled(&self, id: &str, outcome: Outcome) {
        if matches!(
            outcome,
            Outcome::Handled | Outcome::DeadLettered(_) | Outcome::Uncertain
        ) {
            self.outcomes.lock().insert(id.to_owned(), outcome);
        }
    }
}
