//! Cascades: the messages a handler published, sent through the broker
//! (never a local shortcut) before the message that caused them is acked.
//!
//! A cascade whose confirm did not come in time is *uncertain*, not failed:
//! the broker may have stored it. Its cause is retried all the same (nothing
//! is acked without every confirm), and the rerun publishes the cascade
//! again under the same deterministic id ([`crate::envelope::cascade_id`]),
//! which the broker's own dedup field carries where it has one (JetStream's
//! `Nats-Msg-Id`): the server then drops the second copy and says so
//! ([`Landed::Duplicate`]). Uncertain publishes and dropped copies are
//! counted apart (`weir_cascades_uncertain_total`,
//! `weir_cascades_duplicate_total`).

use std::sync::atomic::Ordering;

use crate::envelope::Envelope;
use crate::transport::{self, ErrorKind, Landed, TransportError};

use super::Slot;

/// Publish cascaded messages through the broker (never a local shortcut),
/// each to the slot of its group under its cascade id, waiting for every
/// confirm.
pub async fn publish_cascades(cx: &Slot<'_>, out: impl Iterator<Item = Envelope>) -> Result<(), TransportError> {
    for mut env in out {
        let span = crate::telemetry::publish(&mut env, cx.topology);
        let sent = transport::publish_cascade_to_slot(cx.sink.transport, cx.topology, cx.slots, &env).await;
        if let Some(span) = span {
            span.end(sent.as_ref().err().map(|e| e as &dyn std::fmt::Display));
        }
        match sent {
            Ok(Landed::Stored) => {}
            Ok(Landed::Duplicate) => {
                cx.sink.stats.cascades_duplicate.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    topology = cx.topology,
                    message_id = %env.id,
                    "cascade already in the stream (an earlier attempt's publish whose confirm was lost); the server dropped this copy"
                );
            }
            Err(e) => {
                if uncertain(&e) {
                    cx.sink.stats.cascades_uncertain.fetch_add(1, Ordering::Relaxed);
                }
                return Err(e);
            }
        }
        cx.sink.stats.cascaded.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// True when a failed cascade publish may have landed all the same: the
/// broker did not answer in time (its confirm may have been lost).
pub fn uncertain(e: &TransportError) -> bool {
    e.kind == ErrorKind::Timeout
}

/// The failure of a message whose cascade could not be confirmed, as its
/// retry and its dead letter name it: `uncertain` when the confirm was
/// lost (the cascade may be in the stream; the rerun's copy carries the same
/// id), `failed` otherwise.
pub fn failure_text(e: &TransportError) -> String {
    if uncertain(e) {
        format!(
            "cascaded publish uncertain (no confirm in time; it may have landed, and the retry publishes it again under the same id): {e}"
        )
    } else {
        format!("cascaded publish failed: {e}")
    }
}
