//! Between Weir's [`Wire`] and AMQP properties, and from lapin errors to
//! [`TransportError`]s of the kind callers match on.

use std::borrow::Cow;

use lapin::BasicProperties;
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, ShortString};

use crate::envelope::{self, Wire, header};
use crate::transport::{ErrorKind, TransportError};

/// `messaging.system` of this transport.
pub(super) const SYSTEM: &str = "rabbitmq";

pub(super) fn kind_of(e: &lapin::Error) -> ErrorKind {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(_) => ErrorKind::Refused,
        _ => ErrorKind::Connection,
    }
}

pub(super) fn lapin_err(what: impl std::fmt::Display, e: &lapin::Error) -> TransportError {
    TransportError::new(kind_of(e), format!("{what}: {e}"))
}

pub(super) fn is_precondition_failed(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(amqp)
        if *amqp.kind() == AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED))
}

/// Turn a [`Wire`] into AMQP properties: persistent, every header a long
/// string, the message id also as the AMQP `message-id` (when it fits a
/// short string). Headers named in `weir-binary-headers` go out as the byte
/// arrays they arrived as (their hex decoded), and that list itself is not
/// written: it only stands for the AMQP field types in Weir's text headers.
/// An error (nothing sent) for a header name over 255 bytes; callers check
/// or fit the wire first ([`super::limits`]), so this is the last guard.
pub(super) fn properties(wire: &Wire) -> Result<BasicProperties, String> {
    let binary = envelope::binary_headers(wire.header(header::BINARY_HEADERS));
    let mut table = FieldTable::default();
    for (k, v) in &wire.headers {
        if k == header::BINARY_HEADERS {
            continue;
        }
        let name = ShortString::try_new(k.as_str()).map_err(|e| format!("header name of {} bytes: {e}", k.len()))?;
        let value = match binary.contains(k) {
            true => hex::decode(v).map_or_else(
                |_| AMQPValue::LongString(v.as_str().into()),
                |b| AMQPValue::ByteArray(b.into()),
            ),
            false => AMQPValue::LongString(v.as_str().into()),
        };
        table.insert(name, value);
    }
    let mut props = BasicProperties::default().with_delivery_mode(2).with_headers(table);
    if let Some(id) = wire.header(header::MESSAGE_ID)
        && let Ok(id) = ShortString::try_new(id)
    {
        props = props.with_message_id(id);
    }
    Ok(props)
}

/// A header value as text; `None` for values that are not scalars (arrays and
/// tables such as RabbitMQ's own `x-death`), which Weir does not carry.
/// Borrowed where it already is text, so decoding copies only what it keeps.
/// Byte arrays (what pika sends for Python `bytes`) and long strings are
/// text when they are UTF-8; bytes that are not are `Err` (the caller
/// writes them as hex and names them in `weir-binary-headers`).
pub(super) fn value_text(v: &AMQPValue) -> Option<Result<Cow<'_, str>, &[u8]>> {
    fn bytes(b: &[u8]) -> Result<Cow<'_, str>, &[u8]> {
        std::str::from_utf8(b).map(Cow::Borrowed).map_err(|_| b)
    }
    Some(Ok(match v {
        AMQPValue::LongString(s) => return Some(bytes(s.as_bytes())),
        AMQPValue::ByteArray(b) => return Some(bytes(b.as_slice())),
        AMQPValue::ShortString(s) => Cow::Borrowed(s.as_str()),
        AMQPValue::Boolean(b) => Cow::Owned(b.to_string()),
        AMQPValue::ShortShortInt(n) => Cow::Owned(n.to_string()),
        AMQPValue::ShortShortUInt(n) => Cow::Owned(n.to_string()),
        AMQPValue::ShortInt(n) => Cow::Owned(n.to_string()),
        AMQPValue::ShortUInt(n) => Cow::Owned(n.to_string()),
        AMQPValue::LongInt(n) => Cow::Owned(n.to_string()),
        AMQPValue::LongUInt(n) => Cow::Owned(n.to_string()),
        AMQPValue::LongLongInt(n) => Cow::Owned(n.to_string()),
        AMQPValue::Timestamp(n) => Cow::Owned(n.to_string()),
        AMQPValue::Float(n) => Cow::Owned(n.to_string()),
        AMQPValue::Double(n) => Cow::Owned(n.to_string()),
        _ => return None,
    }))
}

/// Every scalar header of `props` as text, in the table's order. Values
/// that are not UTF-8 come as hex, followed by one `weir-binary-headers`
/// naming them (any such header the publisher sent is replaced).
pub(super) fn header_pairs(props: &BasicProperties) -> Vec<(&str, Cow<'_, str>)> {
    let mut binary = Vec::new();
    let mut pairs: Vec<(&str, Cow<'_, str>)> = props
        .headers()
        .as_ref()
        .into_iter()
        .flat_map(|t| t.inner().iter())
        .filter(|(k, _)| k.as_str() != header::BINARY_HEADERS)
        .filter_map(|(k, v)| {
            let text = match value_text(v)? {
                Ok(text) => text,
                Err(raw) => {
                    binary.push(k.as_str());
                    Cow::Owned(hex::encode(raw))
                }
            };
            Some((k.as_str(), text))
        })
        .collect();
    if !binary.is_empty() {
        pairs.push((
            header::BINARY_HEADERS,
            Cow::Owned(envelope::binary_headers_value(&binary)),
        ));
    }
    pairs
}

/// The [`Wire`] form of a received message.
pub(super) fn wire_of(props: &BasicProperties, body: Vec<u8>) -> Wire {
    let headers = header_pairs(props)
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.into_owned()))
        .collect();
    Wire { headers, body }
}
