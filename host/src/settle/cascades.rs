//! Cascades: the messages a handler published, sent through the broker
//! (never a local shortcut) before the message that caused them is acked.

use std::sync::atomic::Ordering;

use crate::envelope::Envelope;
use crate::transport::{self, TransportError};

use super::Slot;

/// Publish cascaded messages through the broker (never a local shortcut),
/// each to the slot of its group, waiting for every confirm.
pub async fn publish_cascades(cx: &Slot<'_>, out: impl Iterator<Item = Envelope>) -> Result<(), TransportError> {
    for mut env in out {
        let span = crate::telemetry::publish(&mut env, cx.topology);
        let sent = transport::publish_to_slot(cx.sink.transport, cx.topology, cx.slots, &env).await;
        if let Some(span) = span {
            span.end(sent.as_ref().err().map(|e| e as &dyn std::fmt::Display));
        }
        sent?;
        cx.sink.stats.cascaded.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}
