//! Between Weir's [`Wire`] and NATS messages, and from async-nats errors to
//! [`TransportError`]s of the kind callers match on.

use std::str::FromStr as _;

use async_nats::HeaderMap;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::{self, ErrorCode};
use bytes::Bytes;

use crate::envelope::Wire;
use crate::transport::{ErrorKind, TransportError};

pub(super) fn js_code(e: &async_nats::jetstream::Error) -> ErrorCode {
    e.error_code()
}

/// The NATS headers of a [`Wire`]; an error (nothing appended that
/// async-nats would panic on) for a name or value NATS cannot carry.
/// Callers check or fit the wire first ([`super::limits`]), so this is the
/// last guard.
pub(super) fn headers_of(wire: &Wire) -> Result<HeaderMap, String> {
    let mut h = HeaderMap::new();
    for (k, v) in &wire.headers {
        let name = async_nats::HeaderName::from_str(k).map_err(|e| format!("header name {k:?}: {e}"))?;
        let value = async_nats::HeaderValue::from_str(v).map_err(|e| format!("header {k:?}: {e}"))?;
        h.append(name, value);
    }
    Ok(h)
}

/// The [`Wire`] form of a received message: every header value (in order),
/// and the payload (moved, not copied, when nothing else holds it).
pub(super) fn wire_of(headers: Option<&HeaderMap>, payload: Bytes) -> Wire {
    let mut out = Vec::new();
    if let Some(h) = headers {
        for (name, values) in h.iter() {
            for v in values {
                out.push((AsRef::<str>::as_ref(name).to_owned(), v.as_str().to_owned()));
            }
        }
    }
    Wire {
        headers: out,
        body: Vec::from(payload),
    }
}

pub(super) fn publish_err(target: &str, e: &jetstream::context::PublishError) -> TransportError {
    match e.kind() {
        PublishErrorKind::StreamNotFound => TransportError::new(
            ErrorKind::Refused,
            format!("publishing to {target}: no stream captures it (is the topology declared?): {e}"),
        ),
        PublishErrorKind::TimedOut => TransportError::new(
            ErrorKind::Timeout,
            format!("publishing to {target}: no PubAck in time: {e}"),
        ),
        PublishErrorKind::BrokenPipe => {
            TransportError::new(ErrorKind::Connection, format!("publishing to {target}: {e}"))
        }
        _ => TransportError::new(ErrorKind::Refused, format!("publishing to {target}: {e}")),
    }
}

pub(super) fn is_stream_not_found(e: &jetstream::context::GetStreamError) -> bool {
    matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(j) if js_code(&j) == ErrorCode::STREAM_NOT_FOUND)
}

pub(super) fn is_not_found(e: &jetstream::stream::ConsumerError) -> bool {
    matches!(e.kind(), jetstream::stream::ConsumerErrorKind::JetStream(j)
        if js_code(&j) == ErrorCode::CONSUMER_NOT_FOUND || js_code(&j) == ErrorCode::STREAM_NOT_FOUND)
}
