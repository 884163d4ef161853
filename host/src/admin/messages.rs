//! `POST /v1/topologies/{T}/messages`: publish messages through this node's
//! broker, to the slot of their group, each confirmed by the broker before
//! the answer. Every node has it; on the memory broker (which lives inside
//! one process) it is the only way in from outside, and `weir dev` reads the
//! same request from its terminal.
//!
//! The body is one JSON object (a [`PublishRequest`]):
//! `{"type": "greeting", "group": "g-1", "payload": {"name": "Ada"}}`, with
//! optional `tenant`, `headers` (an object of strings), `id`, `count` and
//! `payload_base64` for bytes that are not text. A tenant token publishes
//! only as its own tenant. Bad input is refused with 400 naming the field;
//! nothing is published unless every message of the request is valid.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::error::error_body;
use super::state::AdminState;
use crate::envelope::{self, Envelope};
use crate::registry::Caller;
use crate::transport;

/// The largest request body the route reads, in bytes.
pub const MAX_BODY: usize = 1024 * 1024;

/// The most messages one request may ask for (`count`).
pub const MAX_COUNT: u64 = 10_000;

/// Bytes of user headers (names and values) one message may carry.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;

/// One request: what to publish, and how many copies.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublishRequest {
    /// The message type (`weir-message-type`).
    #[serde(rename = "type")]
    pub message_type: String,
    /// The group id; absent or empty: unordered.
    #[serde(default)]
    pub group: Option<String>,
    /// The tenant id. A tenant token may only give its own (or none: it is filled in).
    #[serde(default)]
    pub tenant: Option<String>,
    /// Headers of the application's own (names must not start with `weir-`).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// The payload: a JSON string is sent as its text, anything else as its JSON encoding.
    #[serde(default)]
    pub payload: Option<serde_json::Value>,
    /// The payload as base64 (standard alphabet), for bytes that are not text.
    #[serde(default)]
    pub payload_base64: Option<String>,
    /// The message id; absent: a fresh one. Only with `count` 1.
    #[serde(default)]
    pub id: Option<String>,
    /// How many copies (each with its own id); default 1.
    #[serde(default)]
    pub count: Option<u64>,
}

impl PublishRequest {
    /// The messages this request asks for, or what is wrong with it (naming the field).
    pub fn envelopes(&self, fresh_id: &mut dyn FnMut() -> String) -> Result<Vec<Envelope>, String> {
        self.envelopes_checked(fresh_id, true)
    }

    /// [`PublishRequest::envelopes`]; `check_names` false skips the header-name
    /// check (a test's negative control, [`super::NegativeControls`]).
    pub fn envelopes_checked(
        &self,
        fresh_id: &mut dyn FnMut() -> String,
        check_names: bool,
    ) -> Result<Vec<Envelope>, String> {
        if self.message_type.trim().is_empty() {
            return Err("`type` must not be empty".into());
        }
        check_text("type", &self.message_type)?;
        if let Some(g) = &self.group {
            check_text("group", g)?;
        }
        if let Some(t) = &self.tenant {
            check_text("tenant", t)?;
        }
        let mut size = 0;
        for (name, value) in &self.headers {
            if name.is_empty() {
                return Err("headers: a header name must not be empty".into());
            }
            if name.to_ascii_lowercase().starts_with("weir-") {
                return Err(format!(
                    "headers: {name:?} is reserved (weir-* headers are Weir's own; use `type`, `group`, `tenant`, `id`)"
                ));
            }
            if check_names && let Some(bad) = name.chars().find(|c| !is_name_char(*c)) {
                return Err(format!(
                    "headers: header name {name:?} has the character {bad:?}, which a header name cannot hold on \
                     every broker; accepted: printable ASCII (letters, digits, punctuation) except `:`, no spaces, \
                     CR or LF"
                ));
            }
            if name.len() > crate::transport::limits::AMQP_SHORT_STRING_MAX {
                return Err(format!(
                    "headers: a header name is {} bytes; at most {} are accepted",
                    name.len(),
                    crate::transport::limits::AMQP_SHORT_STRING_MAX
                ));
            }
            check_text(&format!("headers: the value of header {name:?}"), value)?;
            size += name.len() + value.len();
        }
        if size > MAX_HEADER_BYTES {
            return Err(format!(
                "headers: {size} bytes of headers; at most {MAX_HEADER_BYTES} are accepted"
            ));
        }
        let payload = match (&self.payload, &self.payload_base64) {
            (Some(_), Some(_)) => return Err("give `payload` or `payload_base64`, not both".into()),
            (Some(serde_json::Value::String(s)), None) => s.clone().into_bytes(),
            (Some(v), None) => serde_json::to_vec(v).map_err(|e| format!("payload: {e}"))?,
            (None, Some(b)) => decode_base64(b).map_err(|e| format!("payload_base64: {e}"))?,
            (None, None) => Vec::new(),
        };
        let count = self.count.unwrap_or(1);
        if count == 0 || count > MAX_COUNT {
            return Err(format!("count: {count}; accepted: 1 to {MAX_COUNT}"));
        }
        if self.id.is_some() && count > 1 {
            return Err("`id` names one message: give it only with `count` 1".into());
        }
        if let Some(id) = &self.id {
            if id.trim().is_empty() {
                return Err("`id` must not be empty".into());
            }
            check_text("id", id)?;
        }
        let headers: Vec<(String, String)> = self.headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        Ok((0..count)
            .map(|_| {
                envelope::new_message(
                    self.id.clone().unwrap_or_else(&mut *fresh_id),
                    self.message_type.clone(),
                    self.group.clone(),
                    self.tenant.clone(),
                    headers.clone(),
                    payload.clone(),
                )
            })
            .collect())
    }
}

/// What every broker carries in a header name: printable ASCII except `:`
/// (NATS's rule; AMQP would take more, but a name must mean the same on
/// any broker, and CR/LF in a name splits headers wherever they are written as text).
fn is_name_char(c: char) -> bool {
    c.is_ascii_graphic() && c != ':'
}

/// A header-borne text: no control characters a broker would refuse or split on.
fn check_text(field: &str, value: &str) -> Result<(), String> {
    if value.chars().any(|c| c == '\r' || c == '\n' || c == '\0') {
        return Err(format!("{field}: must not contain CR, LF or NUL"));
    }
    if value.len() > 4096 {
        return Err(format!("{field}: {} bytes; at most 4096 are accepted", value.len()));
    }
    Ok(())
}

/// Standard base64 (padding optional, whitespace ignored).
pub fn decode_base64(text: &str) -> Result<Vec<u8>, String> {
    fn value(c: u8) -> Option<u32> {
        match c {
            b'A'..=b'Z' => Some(u32::from(c - b'A')),
            b'a'..=b'z' => Some(u32::from(c - b'a') + 26),
            b'0'..=b'9' => Some(u32::from(c - b'0') + 52),
            b'+' => Some(62),
            b'/' => Some(63),
            _ => None,
        }
    }
    let bytes: Vec<u8> = text.bytes().filter(|c| !c.is_ascii_whitespace()).collect();
    let trimmed = bytes
        .strip_suffix(b"==")
        .or_else(|| bytes.strip_suffix(b"="))
        .unwrap_or(&bytes);
    let mut out = Vec::with_capacity(trimmed.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for (i, &c) in trimmed.iter().enumerate() {
        let v = value(c).ok_or_else(|| format!("byte {i} ({:?}) is not base64", c as char))?;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    if bits >= 6 {
        return Err("its length is not that of base64".into());
    }
    Ok(out)
}

/// The route.
pub(super) async fn publish(
    State(s): State<Arc<AdminState>>,
    Path(topology): Path<String>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    // Who and how large are decided before a byte of the body is read: a
    // refused client gets its answer, not a reset in the middle of sending.
    let caller = match s.auth.publisher(&headers) {
        Ok(c) => c,
        Err(d) => return d.into_response(),
    };
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let too_large = || {
        (
            StatusCode::PAYLOAD_TOO_LARGE,
            error_body(&format!(
                "a message request may be at most {MAX_BODY} bytes (publish large payloads in several requests, or through the broker)"
            )),
        )
            .into_response()
    };
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return too_large();
    }
    let body = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(b) => b,
        Err(_) => return too_large(),
    };
    let Some(&slots) = s.topologies.get(&topology) else {
        let mut known: Vec<&String> = s.topologies.keys().collect();
        known.sort();
        return (
            StatusCode::NOT_FOUND,
            error_body(&format!("no topology {topology:?} on this node; it has {known:?}")),
        )
            .into_response();
    };
    let mut req: PublishRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                error_body(&format!(
                    "the body is not a message request ({e}); expected e.g. {{\"type\": \"greeting\", \"group\": \"g-1\", \"payload\": {{\"name\": \"Ada\"}}}}"
                )),
            )
                .into_response();
        }
    };
    if let Caller::Tenant(own) = &caller {
        match req.tenant.as_deref() {
            None | Some("") => req.tenant = Some(own.clone()),
            Some(t) if t == own => {}
            Some(t) => {
                return (
                    StatusCode::FORBIDDEN,
                    error_body(&format!(
                        "a tenant token ({own}) may only publish as its own tenant, not as {t:?}"
                    )),
                )
                    .into_response();
            }
        }
    }
    let check_names = !s.controls.unchecked_header_names;
    let envelopes = match req.envelopes_checked(&mut envelope::fresh_id, check_names) {
        Ok(e) => e,
        Err(e) => return (StatusCode::BAD_REQUEST, error_body(&e)).into_response(),
    };
    let mut published = Vec::with_capacity(envelopes.len());
    for env in &envelopes {
        if let Err(e) = transport::publish_to_slot(s.transport.as_ref(), &topology, slots, env).await {
            tracing::warn!(topology = %topology, error = %e, "publish through the admin listener failed");
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                axum::Json(serde_json::json!({
                    "error": format!("the broker did not confirm message {}: {e}", env.id),
                    "published": published,
                })),
            )
                .into_response();
        }
        published.push(serde_json::json!({ "id": env.id, "slot": transport::slot_of(env, slots) }));
    }
    (
        StatusCode::OK,
        axum::Json(serde_json::json!({ "topology": topology, "published": published })),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(json: &str) -> PublishRequest {
        match serde_json::from_str(json) {
            Ok(r) => r,
            Err(e) => unreachable!("{json}: {e}"),
        }
    }

    fn ids() -> impl FnMut() -> String {
        let mut n = 0;
        move || {
            n += 1;
            format!("m-{n}")
        }
    }

    #[test]
    fn a_json_payload_is_sent_as_its_encoding_and_a_string_as_its_text() {
        let e = req(r#"{"type":"greeting","group":"g-1","payload":{"name":"Ada"}}"#)
            .envelopes(&mut ids())
            .unwrap_or_default();
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].payload, br#"{"name":"Ada"}"#);
        assert_eq!(e[0].group_id.as_deref(), Some("g-1"));
        assert_eq!(e[0].id, "m-1");
        let e = req(r#"{"type":"t","payload":"not json"}"#)
            .envelopes(&mut ids())
            .unwrap_or_default();
        assert_eq!(e[0].payload, b"not json");
        let e = req(r#"{"type":"t","payload_base64":"AAH/"}"#)
            .envelopes(&mut ids())
            .unwrap_or_default();
        assert_eq!(e[0].payload, [0, 1, 255]);
    }

    #[test]
    fn bad_requests_name_the_field() {
        let cases = [
            (r#"{"type":""}"#, "`type` must not be empty"),
            (r#"{"type":"t","headers":{"weir-group-id":"x"}}"#, "is reserved"),
            (r#"{"type":"t","group":"a\nb"}"#, "group: must not contain"),
            (r#"{"type":"t","count":0}"#, "count: 0"),
            (r#"{"type":"t","count":2,"id":"x"}"#, "only with `count` 1"),
            (r#"{"type":"t","payload":"a","payload_base64":"YQ=="}"#, "not both"),
            (r#"{"type":"t","payload_base64":"!!"}"#, "payload_base64: byte 0"),
            (
                r#"{"type":"t","headers":{"x-a\r\nx-b":"v"}}"#,
                r#"header name "x-a\r\nx-b" has the character '\r'"#,
            ),
            (r#"{"type":"t","headers":{"x a":"v"}}"#, "has the character ' '"),
            (r#"{"type":"t","headers":{"x:a":"v"}}"#, "has the character ':'"),
            (r#"{"type":"t","headers":{"x-é":"v"}}"#, "has the character 'é'"),
            (
                r#"{"type":"t","headers":{"x-a":"1\r\n2"}}"#,
                r#"the value of header "x-a": must not contain CR"#,
            ),
        ];
        for (json, want) in cases {
            match req(json).envelopes(&mut ids()) {
                Ok(_) => unreachable!("{json} was accepted"),
                Err(e) => assert!(e.contains(want), "{json}: {e}"),
            }
        }
        let long = format!(r#"{{"type":"t","headers":{{"x":"{}"}}}}"#, "v".repeat(4097));
        assert!(req(&long).envelopes(&mut ids()).is_err());
    }

    #[test]
    fn count_makes_copies_with_their_own_ids() {
        let e = req(r#"{"type":"t","count":3}"#)
            .envelopes(&mut ids())
            .unwrap_or_default();
        let got: Vec<&str> = e.iter().map(|m| m.id.as_str()).collect();
        assert_eq!(got, ["m-1", "m-2", "m-3"]);
    }

    #[test]
    fn base64_round_trips() {
        for (text, bytes) in [
            ("", &b""[..]),
            ("YQ==", b"a"),
            ("YWI=", b"ab"),
            ("YWJj", b"abc"),
            ("YW Jj\n", b"abc"),
        ] {
            assert_eq!(decode_base64(text).as_deref(), Ok(bytes), "{text}");
        }
        assert!(decode_base64("YWJjZ").is_err());
    }
}
