//! What the host tells about itself: outcome and handler counters
//! ([`stats`], scraped by `/metrics`), each handler's recent log lines
//! ([`logring`], `weir logs`), the call and settlement ledgers tests and the
//! demo keep ([`ledger`]), and the soak's journal ([`journal`]).
//! Observers watch; nothing here decides how a message is settled.

pub mod journal;
pub mod ledger;
pub mod logring;
pub mod stats;

use crate::envelope::Envelope;

/// Observes every guest call (a test ledger or the demo's overlap detector).
pub trait CallObserver: Send + Sync {
    /// Right before [`CallObserver::before`] (and for every member of a
    /// batch): the version about to run `msg`, by digest.
    fn version(&self, _msg: &Envelope, _digest: &str) {}
    /// Right before the guest is entered for `msg`.
    fn before(&self, msg: &Envelope);
    /// Right after it returned, trapped or was interrupted.
    fn after(&self, msg: &Envelope);
    /// Right before `handle-batch` is entered for `batch` (never empty). One
    /// call, so by default it is seen as one call of its first member (a
    /// batch is one (tenant, group)); override to see every member.
    fn before_batch(&self, batch: &[Envelope]) {
        if let Some(first) = batch.first() {
            self.before(first);
        }
    }
    /// Right after `handle-batch` returned, trapped or was interrupted.
    fn after_batch(&self, batch: &[Envelope]) {
        if let Some(first) = batch.first() {
            self.after(first);
        }
    }
}
