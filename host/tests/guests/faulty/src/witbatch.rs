//! Behaviours of the `wb.` types (issue 14 item 8: a batch's cascades belong to its members).
//!
//! - `wb.publish`: publishes `ok` (same group, the payload) and succeeds.
//! - `wb.publish-retry-first`: publishes `ok`, then answers `retry` on attempt 1 and succeeds
//!   after.
//! - `wb.publish-reject`: publishes `ok`, then rejects.
//! - `wb.legacy.X`: behaves as `wb.X`; a batch with such a member is handled the 0.1.0 way, with
//!   no `begin-member`, so all its publishes belong to the whole batch.

use weir_guest::{Failure, Message};

/// `handle` for a `wb.` type.
pub fn handle(msg: Message) -> Result<(), Failure> {
    let kind = msg.message_type();
    let kind = kind
        .strip_prefix("wb.legacy.")
        .or_else(|| kind.strip_prefix("wb."))
        .unwrap_or(kind);
    let publish = || weir_guest::publish("ok", msg.group_id(), &[], msg.payload());
    match kind {
        "publish" => publish(),
        "publish-retry-first" => {
            publish()?;
            if msg.attempt() == 1 {
                Err(Failure::retry("retry on the first attempt, after publishing"))
            } else {
                Ok(())
            }
        }
        "publish-reject" => {
            publish()?;
            Err(Failure::reject("rejected after publishing"))
        }
        other => Err(Failure::reject(format!("faulty: unknown wb. type {other:?}"))),
    }
}

/// Whether `batch` is to be handled the 0.1.0 way ([`legacy_batch`]).
pub fn is_legacy(batch: &[Message]) -> bool {
    batch.iter().any(|m| m.message_type().starts_with("wb.legacy."))
}

/// `handle-batch` without `begin-member`.
pub fn legacy_batch(batch: Vec<Message>) -> Vec<Result<(), Failure>> {
    batch.into_iter().map(handle).collect()
}
