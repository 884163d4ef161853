//! A redrive: each selected letter, in the destination's order, is
//! re-published to its slot (confirmed by the broker) and only then removed
//! from the dead-letter destination (confirmed too). A command that dies
//! between the two leaves that one letter in both places, never in neither.

use std::collections::HashSet;

use serde::Serialize;

use super::filter::value;
use super::view::slot_of;
use super::{Progress, Selection};
use crate::envelope::{Wire, header};
use crate::transport::Transport;

/// Test hook, never for production: with this environment variable set to
/// `K`, a redrive stops dead (`std::process::abort`) right after the K-th
/// letter's first step (its confirmed re-publish; with
/// [`NEGATIVE_CONTROL_REMOVE_FIRST`], its removal), before the second, as a
/// command killed half-way would.
#[doc(hidden)]
pub const ABORT_AFTER: &str = "WEIR_TEST_REDRIVE_ABORT_AFTER";

/// Negative control for the kill test, never for production: with this
/// environment variable set to `1` a redrive removes each letter from the
/// dead-letter destination *before* re-publishing it, so a command killed
/// between the two loses that letter.
#[doc(hidden)]
pub const NEGATIVE_CONTROL_REMOVE_FIRST: &str = "WEIR_NEGATIVE_CONTROL_REDRIVE_REMOVE_FIRST";

/// Negative control for the ordered-redrive test, never for production:
/// with this environment variable set to `1` a redrive sends the selected
/// letters last first, so a group's messages reach its slot in reverse order.
#[doc(hidden)]
pub const NEGATIVE_CONTROL_REVERSED: &str = "WEIR_NEGATIVE_CONTROL_REDRIVE_REVERSED";

/// Headers that are instructions to a broker, not part of the message:
/// they are not carried into the re-publish (a NATS `Nats-Msg-Id` would make
/// the work stream drop the re-publish as a duplicate while the letter is
/// removed; `x-delivery-count` is the dead-letter queue's own count).
fn broker_instruction(name: &str) -> bool {
    name.len() >= 5 && name[..5].eq_ignore_ascii_case("nats-") || name.eq_ignore_ascii_case("x-delivery-count")
}

/// The message a redrive sends for the letter `letter`: every header of the
/// letter, except that
/// - the capture's provenance (`weir-dead-letter-reason`, `weir-error`,
///   `weir-source`, `weir-handler`, `weir-handler-version`,
///   `weir-failed-at`, `weir-stream-sequence`, `weir-delivery-count`)
///   moves to its `weir-redrive-*` name ([`header::redriven`]; the reason
///   to `weir-redrive-reason`), replacing what an earlier redrive left
///   there, so a later capture's provenance is its own;
/// - `weir-redrive-count` is one more than the letter's (1 the first time);
/// - `weir-attempt` starts again at 1: the message gets the whole ladder;
/// - `weir-handler-pin` is `pin` when given, and removed otherwise;
/// - broker instructions (`Nats-*`, `x-delivery-count`) are dropped.
pub fn redrive_wire(letter: &Wire, pin: Option<&str>) -> Wire {
    let count = super::view::redrive_count(letter).saturating_add(1);
    let mut moved: Vec<(String, String)> = Vec::new();
    let mut headers: Vec<(String, String)> = Vec::with_capacity(letter.headers.len() + 3);
    for (k, v) in &letter.headers {
        if header::PROVENANCE.contains(&k.as_str()) {
            moved.push((header::redriven(k), v.clone()));
        } else if broker_instruction(k) || k == header::HANDLER_PIN || k == header::REDRIVE_COUNT {
            continue;
        } else {
            headers.push((k.clone(), v.clone()));
        }
    }
    // The provenance of the letter replaces an earlier redrive's.
    headers.retain(|(k, _)| !moved.iter().any(|(m, _)| m == k));
    let mut wire = Wire {
        headers,
        body: letter.body.clone(),
    };
    for (k, v) in moved {
        wire.headers.push((k, v));
    }
    wire.set_header(header::REDRIVE_COUNT, count.to_string());
    wire.set_header(header::ATTEMPT, "1");
    if let Some(pin) = pin {
        wire.set_header(header::HANDLER_PIN, pin);
    }
    wire
}

/// One letter of a redrive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Move {
    /// Its place on the dead-letter destination.
    pub position: u64,
    /// `weir-message-id`.
    pub message_id: Option<String>,
    /// `weir-group-id`.
    pub group: Option<String>,
    /// `weir-tenant-id`.
    pub tenant: Option<String>,
    /// `weir-message-type`.
    pub message_type: Option<String>,
    /// `weir-dead-letter-reason`.
    pub reason: Option<String>,
    /// The slot it goes to.
    pub slot: u32,
}

/// What a redrive did (or, dry, would do).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RedriveReport {
    /// The topology.
    pub topology: String,
    /// Letters read from the destination (in a tenant's view, its own only).
    pub read: u64,
    /// Letters selected, in the order they are sent.
    pub letters: Vec<Move>,
    /// Distinct (tenant, group) among them (letters without a group count as one).
    pub groups: usize,
    /// How many were re-published and removed (0 on a dry run).
    pub moved: usize,
    /// A dry run: nothing was sent or removed.
    pub dry_run: bool,
    /// The version pinned (`weir-handler-pin`), if any.
    pub pinned: Option<String>,
    /// Why the redrive stopped before the end, if it did: the letters from
    /// `letters[moved]` on are still dead letters (see the text for the one
    /// at `moved`).
    pub stopped: Option<String>,
}

/// The test hook and the negative control, as set in the environment.
struct Hooks {
    abort_after: Option<usize>,
    remove_first: bool,
    reversed: bool,
}

impl Hooks {
    fn from_env() -> Self {
        let abort_after = std::env::var(ABORT_AFTER).ok().and_then(|v| v.parse().ok());
        let remove_first = std::env::var(NEGATIVE_CONTROL_REMOVE_FIRST).is_ok_and(|v| v == "1");
        let reversed = std::env::var(NEGATIVE_CONTROL_REVERSED).is_ok_and(|v| v == "1");
        if reversed {
            tracing::error!(
                "{NEGATIVE_CONTROL_REVERSED}=1: letters are redriven LAST FIRST (a test's negative control; never in production)"
            );
        }
        if let Some(k) = abort_after {
            tracing::error!(
                "{ABORT_AFTER}={k}: this redrive aborts after the {k}-th letter's first step (a test hook)"
            );
        }
        if remove_first {
            tracing::error!(
                "{NEGATIVE_CONTROL_REMOVE_FIRST}=1: letters are removed BEFORE their re-publish is confirmed \
                 (a test's negative control; never in production)"
            );
        }
        Self {
            abort_after,
            remove_first,
            reversed,
        }
    }

    fn after_first_step(&self, n: usize) {
        if self.abort_after == Some(n) {
            std::process::abort();
        }
    }
}

/// The group key of a letter: lanes are per (tenant, group).
fn group_key(wire: &Wire) -> (Option<&str>, Option<&str>) {
    (value(wire, header::TENANT_ID), value(wire, header::GROUP_ID))
}

impl Selection {
    /// The letters a redrive would send, in order, with their slots in a
    /// topology of `slots` slots; nothing is sent or removed.
    pub fn plan(&self, slots: u32) -> Vec<Move> {
        self.selected
            .iter()
            .map(|l| {
                let get = |name: &str| value(&l.wire, name).map(str::to_owned);
                Move {
                    position: l.position,
                    message_id: get(header::MESSAGE_ID),
                    group: get(header::GROUP_ID),
                    tenant: get(header::TENANT_ID),
                    message_type: get(header::MESSAGE_TYPE),
                    reason: get(header::DEAD_LETTER_REASON),
                    slot: slot_of(&l.wire, slots),
                }
            })
            .collect()
    }

    fn report(&self, slots: u32, dry_run: bool, pin: Option<&str>) -> RedriveReport {
        let groups: HashSet<_> = self.selected.iter().map(|l| group_key(&l.wire)).collect();
        RedriveReport {
            topology: self.topology.clone(),
            read: self.read,
            letters: self.plan(slots),
            groups: groups.len(),
            moved: 0,
            dry_run,
            pinned: pin.map(str::to_owned),
            stopped: None,
        }
    }

    /// What a redrive would do; the letters all stay.
    pub async fn dry_run(self, slots: u32, pin: Option<&str>) -> RedriveReport {
        let report = self.report(slots, true, pin);
        self.close().await;
        report
    }

    /// Send every selected letter back to its slot of `topology` (`slots`
    /// slots) through `transport`, in the destination's order, each
    /// re-published as [`redrive_wire`] makes it (sealed with `seal`) and removed only once the
    /// broker confirmed the re-publish. The first failure stops the redrive
    /// (a group's later letters must not overtake an earlier one): what was
    /// not moved stays dead-lettered, and [`RedriveReport::stopped`] says
    /// where and why. The pin, if any, must have been checked
    /// ([`super::check_pin`]).
    pub async fn redrive(
        mut self,
        transport: &dyn Transport,
        seal: &crate::seal::Seal,
        slots: u32,
        pin: Option<&str>,
        progress: &(dyn Fn(Progress) + Send + Sync),
    ) -> RedriveReport {
        let host_attempts = transport.retry_owner() == crate::transport::RetryOwner::Host;
        let hooks = Hooks::from_env();
        if hooks.reversed {
            self.selected.reverse();
        }
        let mut report = self.report(slots, false, pin);
        let letters = std::mem::take(&mut self.selected);
        let of = letters.len() as u64;
        for (i, letter) in letters.iter().enumerate() {
            let slot = report.letters[i].slot;
            let mut wire = redrive_wire(&letter.wire, pin);
            // Its count, provenance and pin are Weir's: sealed, so the node
            // honours them (and no publisher's copy of them).
            seal.sign_wire(&mut wire, host_attempts);
            let at = format!(
                "#{} ({})",
                letter.position,
                value(&letter.wire, header::MESSAGE_ID).unwrap_or("no message id")
            );
            let stopped = if hooks.remove_first {
                match self.session.remove(letter.position).await {
                    Err(e) => Some(format!("removing {at} failed, so it was not sent: {e}")),
                    Ok(()) => {
                        hooks.after_first_step(i + 1);
                        transport.publish(&self.topology, slot, wire).await.err().map(|e| {
                            format!("{at} was removed, but its re-publish to slot {slot} failed (LOST: the negative control's order): {e}")
                        })
                    }
                }
            } else {
                match transport.publish(&self.topology, slot, wire).await {
                    Err(e) => Some(format!(
                        "the re-publish of {at} to slot {slot} failed; it and the letters after it stay dead-lettered: {e}"
                    )),
                    Ok(()) => {
                        hooks.after_first_step(i + 1);
                        self.session.remove(letter.position).await.err().map(|e| {
                            format!(
                                "{at} was re-published to slot {slot} (confirmed) but removing it failed, so it is \
                                 also still dead-lettered (a redrive again sends it twice); the letters after it stay: {e}"
                            )
                        })
                    }
                }
            };
            if let Some(why) = stopped {
                tracing::warn!(topology = %self.topology, moved = i, "redrive stopped: {why}");
                report.stopped = Some(why);
                break;
            }
            report.moved = i + 1;
            progress(Progress::Redriven {
                done: (i + 1) as u64,
                of,
            });
        }
        self.close().await;
        tracing::info!(topology = %report.topology, moved = report.moved, selected = report.letters.len(), pinned = ?report.pinned, "redrive done");
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire(h: &[(&str, &str)]) -> Wire {
        Wire {
            headers: h.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
            body: b"payload".to_vec(),
        }
    }

    #[test]
    fn a_redriven_message_keeps_its_headers_and_moves_the_provenance() {
        let letter = wire(&[
            (header::MESSAGE_ID, "m-1"),
            (header::MESSAGE_TYPE, "order.placed"),
            (header::GROUP_ID, "g"),
            (header::TENANT_ID, "acme"),
            (header::ATTEMPT, "4"),
            ("x-trace", "abc"),
            ("Nats-Msg-Id", "dedup-me"),
            (header::DEAD_LETTER_REASON, "exhausted"),
            (header::ERROR, "boom"),
            (header::SOURCE, "weir.t.1"),
            (header::HANDLER, "orders"),
            (header::HANDLER_VERSION, "abc123"),
            (header::FAILED_AT, "2025-03-01T12:00:00Z"),
            (header::STREAM_SEQUENCE, "17"),
        ]);
        let out = redrive_wire(&letter, None);
        assert_eq!(out.body, letter.body);
        for kept in [
            header::MESSAGE_ID,
            header::MESSAGE_TYPE,
            header::GROUP_ID,
            header::TENANT_ID,
            "x-trace",
        ] {
            assert_eq!(out.header(kept), letter.header(kept), "{kept}");
        }
        assert_eq!(out.header(header::ATTEMPT), Some("1"));
        assert_eq!(out.header(header::REDRIVE_COUNT), Some("1"));
        assert_eq!(out.header(header::REDRIVE_REASON), Some("exhausted"));
        assert_eq!(out.header("weir-redrive-error"), Some("boom"));
        assert_eq!(out.header("weir-redrive-handler-version"), Some("abc123"));
        assert_eq!(out.header("weir-redrive-stream-sequence"), Some("17"));
        for gone in header::PROVENANCE {
            assert_eq!(out.header(gone), None, "{gone} must not look like a new failure's");
        }
        assert_eq!(out.header("Nats-Msg-Id"), None);
        assert_eq!(out.header(header::HANDLER_PIN), None);
    }

    #[test]
    fn a_second_redrive_counts_on_and_keeps_only_the_latest_provenance() {
        let first = redrive_wire(
            &wire(&[
                (header::MESSAGE_TYPE, "t"),
                (header::DEAD_LETTER_REASON, "exhausted"),
                (header::ERROR, "first"),
            ]),
            Some("d1"),
        );
        assert_eq!(first.header(header::HANDLER_PIN), Some("d1"));
        // It failed again: the capture adds its own provenance.
        let mut again = first.clone();
        again.set_header(header::DEAD_LETTER_REASON, "rejected");
        again.set_header(header::ERROR, "second");
        let second = redrive_wire(&again, None);
        assert_eq!(second.header(header::REDRIVE_COUNT), Some("2"));
        assert_eq!(second.header(header::REDRIVE_REASON), Some("rejected"));
        assert_eq!(second.header("weir-redrive-error"), Some("second"));
        assert_eq!(
            second.headers.iter().filter(|(k, _)| k == "weir-redrive-error").count(),
            1
        );
        assert_eq!(
            second.header(header::HANDLER_PIN),
            None,
            "a redrive without a pin runs on the current version"
        );
    }
}
