//! The dead-letter tools: list, show, redrive and purge what a topology's
//! dead-letter destination holds, the same way on every broker (the
//! broker's side is [`crate::transport::dead_letters`]). The CLI's
//! `weir dead-letters` and the admin API's `/v1/dead-letters` both use
//! this module.
//!
//! Every command reads the destination in one session ([`select`]): the
//! letters present when it opened, in the destination's order, filtered
//! ([`Filter`]). A listing then leaves them all where they were. A purge
//! removes the selected ones. A redrive ([`Selection::redrive`]) sends each
//! selected letter back through the broker to its slot and removes it only
//! once the broker confirmed the re-publish.
//!
//! **Order.** A redrive sends the selected letters in the destination's
//! order: the order in which they were captured (JetStream: the
//! `WEIR_T_DLQ` sequence; RabbitMQ: the queue's order, which a read keeps).
//! Each re-publish is confirmed before the next is sent, so a group's
//! letters reach its slot in that order, and run in it (one lane per
//! (tenant, group)). That is the order in which a group's messages failed
//! for good: for messages that were dead-lettered at their first failure
//! (a `reject`, no handler) it is the order they had on their slot; a
//! message that went through the retry ladder is captured when its ladder
//! ends, after any later message of its group that failed at once, and is
//! redriven in that place.
//!
//! **What a redriven message carries** ([`redrive_wire`]): every header of
//! the letter, `weir-redrive-count` (1 on the first redrive),
//! `weir-attempt` = 1 (a whole new ladder), the capture's provenance under
//! `weir-redrive-*` names (`weir-redrive-reason` = the letter's
//! `weir-dead-letter-reason`, `weir-redrive-error`, …), so that if it fails
//! again its new dead letter has one `weir-dead-letter-reason`, its own;
//! and `weir-handler-pin` when the redrive pins a version.

pub mod filter;
pub mod redrive;
pub mod view;

use async_trait::async_trait;

pub use filter::{Filter, parse_time};
pub use redrive::{Move, RedriveReport, redrive_wire};
pub use view::{LetterView, Payload};

use crate::envelope::header;
use crate::transport::TransportError;
use crate::transport::dead_letters::{DeadLetter, DeadLetterSession, DeadLetterStore};

/// How far a long command has come, for a progress display.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Letters read, of how many the destination held (when known).
    Read {
        /// Read so far.
        done: u64,
        /// In all.
        of: Option<u64>,
    },
    /// Letters redriven (re-published and removed), of how many selected.
    Redriven {
        /// Moved so far.
        done: u64,
        /// In all.
        of: u64,
    },
    /// Letters purged, of how many selected.
    Purged {
        /// Removed so far.
        done: u64,
        /// In all.
        of: u64,
    },
}

/// A progress display that shows nothing.
pub fn no_progress(_: Progress) {}

/// The letters of one topology that a [`Filter`] selects, read in one
/// session that is still open: [`Selection::close`] (or a dry run) leaves
/// them all, [`Selection::redrive`] or [`Selection::purge`] acts on them.
pub struct Selection {
    session: Box<dyn DeadLetterSession>,
    topology: String,
    /// Letters read (those the destination held when the session opened);
    /// in a tenant's view ([`select_scoped`]) only that tenant's.
    pub read: u64,
    /// The selected letters, in the destination's order.
    pub selected: Vec<DeadLetter>,
}

/// Read `topology`'s dead letters and keep those `filter` selects.
pub async fn select(
    store: &dyn DeadLetterStore,
    topology: &str,
    filter: &Filter,
    progress: &(dyn Fn(Progress) + Send + Sync),
) -> Result<Selection, TransportError> {
    select_scoped(store, topology, filter, None, progress).await
}

/// [`select`] for one tenant's view (`scope`: its name): `read` counts only
/// the letters whose `weir-tenant-id` is that tenant, so an answer tells a
/// tenant nothing about other tenants' letters. `None`: every letter counts.
pub async fn select_scoped(
    store: &dyn DeadLetterStore,
    topology: &str,
    filter: &Filter,
    scope: Option<&str>,
    progress: &(dyn Fn(Progress) + Send + Sync),
) -> Result<Selection, TransportError> {
    let mut session = store.open(topology).await?;
    let of = session.expected();
    let (mut read, mut in_scope) = (0, 0);
    let mut selected = Vec::new();
    loop {
        let letter = match session.next().await {
            Ok(Some(l)) => l,
            Ok(None) => break,
            Err(e) => {
                // Nothing was removed: every letter stays.
                let _ = session.close().await;
                return Err(e);
            }
        };
        read += 1;
        if read % 64 == 0 {
            progress(Progress::Read { done: read, of });
        }
        if scope.is_none_or(|t| filter::value(&letter.wire, header::TENANT_ID) == Some(t)) {
            in_scope += 1;
        }
        if filter.matches(&letter) {
            selected.push(letter);
        }
    }
    progress(Progress::Read { done: read, of });
    Ok(Selection {
        session,
        topology: topology.to_owned(),
        read: in_scope,
        selected,
    })
}

/// What a purge did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PurgeReport {
    /// The topology.
    pub topology: String,
    /// Letters read from the destination (in a tenant's view, its own only).
    pub read: u64,
    /// Letters selected.
    pub selected: usize,
    /// Letters removed (0 on a dry run).
    pub purged: usize,
    /// A dry run: nothing was removed.
    pub dry_run: bool,
    /// Why the purge stopped before the end, if it did (the rest stay).
    pub stopped: Option<String>,
}

/// Letters removed per confirmation in a purge.
const PURGE_CHUNK: usize = 256;

impl Selection {
    /// The topology read.
    pub fn topology(&self) -> &str {
        &self.topology
    }

    /// End the session: every letter stays where it was.
    pub async fn close(self) {
        if let Err(e) = self.session.close().await {
            tracing::warn!(topology = %self.topology, error = %e, "closing the dead-letter session failed; the broker gives the letters back when the connection ends");
        }
    }

    /// Remove every selected letter (unless `dry_run`), confirmed by the
    /// broker a chunk at a time.
    pub async fn purge(mut self, dry_run: bool, progress: &(dyn Fn(Progress) + Send + Sync)) -> PurgeReport {
        let positions: Vec<u64> = self.selected.iter().map(|l| l.position).collect();
        let mut report = PurgeReport {
            topology: self.topology.clone(),
            read: self.read,
            selected: positions.len(),
            purged: 0,
            dry_run,
            stopped: None,
        };
        if !dry_run {
            let of = positions.len() as u64;
            for chunk in positions.chunks(PURGE_CHUNK) {
                if let Err(e) = self.session.remove_all(chunk).await {
                    report.stopped = Some(format!(
                        "removing letters #{}..#{} failed; some of them and every later one stay: {e}",
                        chunk.first().copied().unwrap_or_default(),
                        chunk.last().copied().unwrap_or_default()
                    ));
                    break;
                }
                report.purged += chunk.len();
                progress(Progress::Purged {
                    done: report.purged as u64,
                    of,
                });
            }
            tracing::info!(topology = %report.topology, purged = report.purged, "dead letters purged");
        }
        self.close().await;
        report
    }
}

/// Whether a node can run a message on a pinned version: the callers'
/// side of [`check_pin`] (a node asks its registry; the CLI the store its
/// config names).
#[async_trait]
pub trait PinCheck: Sync {
    /// `Ok(handler)` when a message of `message_type` (tenant `tenant`) on
    /// `topology` goes to a handler that can run version `digest`; otherwise
    /// why not, naming the handler.
    async fn check(
        &self,
        topology: &str,
        tenant: Option<&str>,
        message_type: &str,
        digest: &str,
    ) -> Result<String, String>;
}

/// Whether `digest` is a component digest: 64 lowercase hex digits.
pub fn is_digest(digest: &str) -> bool {
    digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Refuse a pin that a selected letter's handler cannot honour: each
/// distinct (tenant, message type) of `letters` (of `topology`) is checked
/// once. `Ok` with the handlers the pinned letters go to.
pub async fn check_pin(
    topology: &str,
    letters: &[DeadLetter],
    digest: &str,
    check: &dyn PinCheck,
) -> Result<Vec<String>, String> {
    if !is_digest(digest) {
        return Err(format!(
            "--handler-version {digest:?} is not a component digest; accepted: the 64 hex digits of a version's \
             sha256, as `weir-handler-version` and GET /v1/handlers show it"
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut handlers = std::collections::BTreeSet::new();
    for l in letters {
        let tenant = filter::value(&l.wire, header::TENANT_ID);
        let Some(message_type) = filter::value(&l.wire, header::MESSAGE_TYPE) else {
            return Err(format!(
                "dead letter #{} has no weir-message-type, so no handler version can be pinned for it; \
                 leave it out (e.g. --reason) or redrive it without --handler-version",
                l.position
            ));
        };
        if !seen.insert((tenant, message_type)) {
            continue;
        }
        handlers.insert(check.check(topology, tenant, message_type, digest).await?);
    }
    Ok(handlers.into_iter().collect())
}
