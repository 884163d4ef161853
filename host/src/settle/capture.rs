//! Dead-letter capture: publish the message with its provenance to the
//! dead-letter destination, wait for the broker's confirm, and only then
//! acknowledge the original. A failed capture is never followed by an ack.
use crate::envelope::{self, DecodeError, Envelope, Wire, header};
use crate::outcome::{Outcome, Reason};
use crate::runtime::HandlerVersion;
use crate::transport::{Acker, Delivery, Disposition, Transport};

use super::{Sink, Slot};

/// Where a dead letter came from and why.
#[derive(Debug, Clone)]
pub struct Provenance<'a> {
    /// Why.
    pub reason: Reason,
    /// The last error text.
    pub error: &'a str,
    /// Queue or subject it was consumed from.
    pub source: &'a str,
    /// Handler name and component digest, when one was involved.
    pub handler: Option<(&'a str, &'a str)>,
    /// Broker position (delivery tag or stream sequence), for logs.
    pub tag: u64,
}

/// The message to capture: decoded, or raw when it did not decode.
pub enum Captured<'a> {
    /// A decoded message.
    Envelope(&'a Envelope),
    /// Raw bytes and headers as received.
    Raw(Wire),
}

/// The longest `weir-error` a dead letter carries, in bytes: a longer error
/// text keeps its start and ends with a marker saying it was cut and how
/// long it was ([`crate::transport::limits::cut_marker`]). The broker's
/// own limits may cut it further.
pub const ERROR_MAX: usize = 16 * 1024;

/// The longest error text a log line of a capture carries, in bytes.
const LOGGED_ERROR_MAX: usize = 1024;

/// `text` cut to at most `max` bytes plus the marker (whole when it fits).
pub fn cut_text(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut at = max;
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    let marker = crate::transport::limits::cut_marker(text.len());
    std::borrow::Cow::Owned(format!("{}{marker}", &text[..at]))
}

/// Build the dead-letter form: all original headers plus provenance.
pub fn dead_letter_wire(message: Captured<'_>, p: &Provenance<'_>) -> Wire {
    let mut wire = match message {
        Captured::Envelope(env) => envelope::encode(env),
        Captured::Raw(w) => w,
    };
    wire.set_header(header::DEAD_LETTER_REASON, p.reason.as_str());
    wire.set_header(header::ERROR, cut_text(p.error, ERROR_MAX));
    wire.set_header(header::SOURCE, p.source);
    if let Some((name, digest)) = p.handler {
        wire.set_header(header::HANDLER, name);
        wire.set_header(header::HANDLER_VERSION, digest);
    }
    let now = time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default();
    wire.set_header(header::FAILED_AT, now);
    wire
}

/// Capture then settle. Never acks unless the broker confirmed the capture.
pub async fn capture(
    transport: &dyn Transport,
    topology: &str,
    message: Captured<'_>,
    acker: Box<dyn Acker>,
    p: &Provenance<'_>,
) -> Outcome {
    let system = transport.system();
    let (id, group) = match &message {
        Captured::Envelope(env) => (env.id.clone(), env.group_id.clone().unwrap_or_default()),
        Captured::Raw(w) => (
            w.header(header::MESSAGE_ID).unwrap_or_default().to_owned(),
            w.header(header::GROUP_ID).unwrap_or_default().to_owned(),
        ),
    };
    let mut wire = dead_letter_wire(message, p);
    for (name, value) in acker.provenance() {
        wire.set_header(name, value);
    }
    match transport.publish_dead_letter(topology, wire).await {
        Ok(()) => match acker.settle(Disposition::AckCaptured).await {
            Ok(()) => {
                tracing::info!(
                    messaging.system = system,
                    topology,
                    message_id = %id,
                    group = %group,
                    handler = p.handler.map_or("", |h| h.0),
                    source = p.source,
                    tag = p.tag,
                    reason = p.reason.as_str(),
                    error = %cut_text(p.error, LOGGED_ERROR_MAX),
                    "dead-lettered"
                );
                Outcome::DeadLettered(p.reason)
            }
            Err(e) => {
                tracing::warn!(
                    messaging.system = system, topology, source = p.source, tag = p.tag, error = %e,
                    "uncertain: the dead-letter capture was confirmed but the ack's confirmation was lost; \
                     the ack may have landed. Check whether the consumer's ack floor passed this position; \
                     if it did not, the message will be delivered again and captured again (a duplicate dead letter). \
                     Delete nothing."
                );
                Outcome::Uncertain
            }
        },
        Err(e) => {
            if acker.deliveries_left() == Some(0) {
                tracing::error!(
                    messaging.system = system, topology, source = p.source, tag = p.tag,
                    reason = p.reason.as_str(), error = %e,
                    "stranded: the dead-letter capture failed and the broker has no delivery left; \
                     nothing reached the dead-letter destination"
                );
                return Outcome::Stranded;
            }
            tracing::warn!(
                messaging.system = system, topology, source = p.source, tag = p.tag, error = %e,
                deliveries_left = ?acker.deliveries_left(),
                "dead-letter capture failed; the message will be delivered again to try again"
            );
            if let Err(e) = acker.settle(Disposition::Defer).await {
                tracing::warn!(tag = p.tag, error = %e, "returning the message after a failed capture failed; the broker redelivers it");
            }
            Outcome::Requeued
        }
    }
}

/// Dead-letter a delivery that did not decode (a no-op for one that did).
pub async fn capture_undecodable(cx: &Slot<'_>, d: Delivery) {
    let Delivery {
        message,
        source,
        tag,
        acker,
    } = d;
    let Err((wire, err)) = message else { return };
    capture_raw(cx.sink, cx.topology, wire, &err, &source, tag, acker).await;
}

/// Dead-letter a message that did not decode (reason `undecodable`), keep
/// its bytes and headers as received, and record the outcome under its
/// message id (or `source#tag` when it has none).
pub async fn capture_raw(
    sink: Sink<'_>,
    topology: &str,
    wire: Wire,
    err: &DecodeError,
    source: &str,
    tag: u64,
    acker: Box<dyn Acker>,
) -> Outcome {
    let error = err.to_string();
    let prov = Provenance {
        reason: Reason::Undecodable,
        error: &error,
        source,
        handler: None,
        tag,
    };
    let id = wire
        .header(header::MESSAGE_ID)
        .map_or_else(|| format!("{source}#{tag}"), str::to_owned);
    let outcome = capture(sink.transport, topology, Captured::Raw(wire), acker, &prov).await;
    sink.record(&id, outcome);
    outcome
}

/// Dead-letter a decoded message with its provenance (the one place
/// settlement builds a [`Provenance`] for an envelope).
#[allow(clippy::too_many_arguments)]
pub async fn capture_envelope(
    cx: &Slot<'_>,
    env: &Envelope,
    acker: Box<dyn Acker>,
    reason: Reason,
    error: &str,
    source: &str,
    handler: Option<&HandlerVersion>,
    tag: u64,
) -> Outcome {
    let prov = Provenance {
        reason,
        error,
        source,
        handler: handler.map(|h| (h.name(), h.digest.as_str())),
        tag,
    };
    let outcome = capture(cx.sink.transport, cx.topology, Captured::Envelope(env), acker, &prov).await;
    if let Some(o) = cx.sink.observer {
        o.failed(&env.id, error, None);
    }
    outcome
}
