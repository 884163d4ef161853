//! The transport-neutral message: the WIT `message` record plus the header
//! mapping every broker uses. Brokers carry a [`Wire`] form (headers + body);
//! this module is the one place that turns one into the other.

use crate::bindings::weir::handler::types::Message;

/// A message as the host handles it. It is the WIT record itself, so a call
/// into a guest lowers it by reference without copying it first.
pub type Envelope = Message;

/// Header names of the contract (the same on every broker).
pub mod header {
    /// Unique message id, stable across redeliveries.
    pub const MESSAGE_ID: &str = "weir-message-id";
    /// Routing type.
    pub const MESSAGE_TYPE: &str = "weir-message-type";
    /// Ordering key; empty is the same as absent.
    pub const GROUP_ID: &str = "weir-group-id";
    /// Owning tenant.
    pub const TENANT_ID: &str = "weir-tenant-id";
    /// Delivery attempt, 1 on the first delivery.
    pub const ATTEMPT: &str = "weir-attempt";
    /// Why a message was dead-lettered.
    pub const DEAD_LETTER_REASON: &str = "weir-dead-letter-reason";
    /// The last error text.
    pub const ERROR: &str = "weir-error";
    /// Queue or subject the message came from.
    pub const SOURCE: &str = "weir-source";
    /// Handler that failed it.
    pub const HANDLER: &str = "weir-handler";
    /// Component digest of that handler.
    pub const HANDLER_VERSION: &str = "weir-handler-version";
    /// RFC 3339 time of the capture.
    pub const FAILED_AT: &str = "weir-failed-at";
    /// JetStream dead letters: the stream sequence of the captured message.
    pub const STREAM_SEQUENCE: &str = "weir-stream-sequence";
    /// JetStream dead letters: the server's delivery count when it was captured.
    pub const DELIVERY_COUNT: &str = "weir-delivery-count";

    /// A redriven message: how many times it was taken off the dead-letter
    /// destination and sent back to its slot (1 on the first redrive).
    pub const REDRIVE_COUNT: &str = "weir-redrive-count";
    /// A redriven message: the `weir-dead-letter-reason` of the letter it was
    /// redriven from. The rest of that letter's provenance is kept the same
    /// way, under [`redriven`] names, so that a later capture's own
    /// provenance is never mistaken for it.
    pub const REDRIVE_REASON: &str = "weir-redrive-reason";
    /// The component digest (`weir-handler-version`) this message must run
    /// on: set by a redrive with `--handler-version`. A message whose pin the
    /// node cannot resolve is dead-lettered `no-handler`, saying why.
    pub const HANDLER_PIN: &str = "weir-handler-pin";
    /// Weir's seal over the `weir-*` headers it writes onto a message it
    /// sends back to a slot (see `crate::seal`): without a valid one, those
    /// headers came from a publisher or a guest and are not Weir's.
    pub const SEAL: &str = "weir-seal";

    /// The provenance headers a capture writes, which a redrive moves out of
    /// the way: each is kept under its [`redriven`] name.
    pub const PROVENANCE: [&str; 8] = [
        DEAD_LETTER_REASON,
        ERROR,
        SOURCE,
        HANDLER,
        HANDLER_VERSION,
        FAILED_AT,
        STREAM_SEQUENCE,
        DELIVERY_COUNT,
    ];

    /// The name a redriven message keeps a [`PROVENANCE`] header under:
    /// `weir-dead-letter-reason` becomes [`REDRIVE_REASON`], any other
    /// `weir-X` becomes `weir-redrive-X` (`weir-redrive-error`,
    /// `weir-redrive-handler-version`, …).
    pub fn redriven(name: &str) -> String {
        match name {
            DEAD_LETTER_REASON => REDRIVE_REASON.to_owned(),
            other => format!("weir-redrive-{}", other.strip_prefix("weir-").unwrap_or(other)),
        }
    }

    /// Names the headers whose value arrived as bytes that are not UTF-8
    /// (an AMQP byte array or long string): a JSON array of names. Their
    /// values are carried as lowercase hex, so no byte is lost, and a
    /// broker that can carry bytes (RabbitMQ) writes them back as bytes.
    pub const BINARY_HEADERS: &str = "weir-binary-headers";

    /// Headers derived from the envelope's own fields; written from the
    /// fields, never copied from `headers`, so they cannot disagree.
    pub const DERIVED: [&str; 5] = [MESSAGE_ID, MESSAGE_TYPE, GROUP_ID, TENANT_ID, ATTEMPT];
}

/// A message as a broker carries it: headers and an opaque body.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Wire {
    /// Every header, in order.
    pub headers: Vec<(String, String)>,
    /// The payload, untouched.
    pub body: Vec<u8>,
}

impl Wire {
    /// The first header called `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// Set `name` to `value`, replacing any earlier value.
    pub fn set_header(&mut self, name: &str, value: impl Into<String>) {
        let value = value.into();
        match self.headers.iter_mut().find(|(k, _)| k == name) {
            Some(slot) => slot.1 = value,
            None => self.headers.push((name.to_owned(), value)),
        }
    }
}

/// Why a [`Wire`] message is not a valid [`Envelope`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// A required header is absent.
    #[error("missing header `{0}`")]
    Missing(&'static str),
    /// A header has a value that cannot be parsed.
    #[error("header `{name}` has invalid value {value:?}: {expected}")]
    Invalid {
        /// Header name.
        name: &'static str,
        /// What was found.
        value: String,
        /// What would be accepted.
        expected: &'static str,
    },
    /// Its headers do not fit the broker's rules, so Weir cannot send it
    /// on (forward it or schedule its retry): the broker's limit and the
    /// header at fault.
    #[error("cannot be sent on: {0}")]
    Unsendable(String),
}

/// Treat an empty id like an absent one (the contract says they are the same).
fn non_empty(value: Option<&str>) -> Option<String> {
    value.filter(|v| !v.is_empty()).map(str::to_owned)
}

/// Decode a wire message. `fallback_id` names the message when the publisher
/// set no `weir-message-id` (the broker's own id or sequence);
/// `attempt_override` is the broker's delivery count where the broker owns it
/// (JetStream), otherwise the `weir-attempt` header is used (default 1).
pub fn decode(
    wire: Wire,
    fallback_id: impl FnOnce() -> String,
    attempt_override: Option<u32>,
) -> Result<Envelope, (Wire, DecodeError)> {
    // Validate before taking anything apart, so a refusal returns the wire intact.
    if non_empty(wire.header(header::MESSAGE_TYPE)).is_none() {
        return Err((wire, DecodeError::Missing(header::MESSAGE_TYPE)));
    }
    let attempt = match (attempt_override, wire.header(header::ATTEMPT)) {
        (Some(a), _) => a,
        (None, None) => 1,
        (None, Some(raw)) => match raw.parse::<u32>() {
            Ok(a) if a >= 1 => a,
            _ => {
                let value = raw.to_owned();
                return Err((
                    wire,
                    DecodeError::Invalid {
                        name: header::ATTEMPT,
                        value,
                        expected: "a whole number >= 1",
                    },
                ));
            }
        },
    };
    // Move the derived headers' values into the fields (no copies); the
    // guest sees them as fields, `headers` keeps everything else.
    let Wire { headers: all, body } = wire;
    let (mut id, mut message_type, mut group_id, mut tenant_id) = (None, String::new(), None, None);
    let mut headers = Vec::with_capacity(all.len());
    for (k, v) in all {
        let field = match k.as_str() {
            header::MESSAGE_ID => &mut id,
            header::GROUP_ID => &mut group_id,
            header::TENANT_ID => &mut tenant_id,
            header::MESSAGE_TYPE => {
                if message_type.is_empty() {
                    message_type = v;
                }
                continue;
            }
            header::ATTEMPT => continue,
            _ => {
                headers.push((k, v));
                continue;
            }
        };
        if field.is_none() && !v.is_empty() {
            *field = Some(v);
        }
    }
    Ok(Envelope {
        id: id.unwrap_or_else(fallback_id),
        message_type,
        group_id,
        tenant_id,
        headers,
        payload: body,
        attempt,
    })
}

/// [`decode`] straight from a broker's header pairs, in the order the broker
/// gives them: only what the envelope keeps is copied (no intermediate
/// [`Wire`] with a `String` pair per header). The payload is left empty for
/// the caller to move in. `None` when the pairs would not decode (no
/// message type, an invalid `weir-attempt`): the caller then builds the
/// [`Wire`] and calls [`decode`], which names the problem and keeps the
/// message intact. For pairs that decode, the result equals [`decode`]'s.
pub fn decode_pairs<'a>(
    pairs: impl IntoIterator<Item = (&'a str, std::borrow::Cow<'a, str>)>,
    fallback_id: impl FnOnce() -> String,
    attempt_override: Option<u32>,
) -> Option<Envelope> {
    let (mut id, mut message_type, mut group_id, mut tenant_id) = (None, None, None, None);
    let mut attempt = attempt_override;
    let mut attempt_seen = attempt_override.is_some();
    let mut headers = Vec::new();
    for (k, v) in pairs {
        let field = match k {
            header::MESSAGE_ID => &mut id,
            header::GROUP_ID => &mut group_id,
            header::TENANT_ID => &mut tenant_id,
            header::MESSAGE_TYPE => {
                if message_type.is_none() {
                    // `decode` judges the first one: empty means missing.
                    if v.is_empty() {
                        return None;
                    }
                    message_type = Some(v.into_owned());
                }
                continue;
            }
            header::ATTEMPT => {
                if !attempt_seen {
                    attempt_seen = true;
                    match v.parse::<u32>() {
                        Ok(a) if a >= 1 => attempt = Some(a),
                        _ => return None,
                    }
                }
                continue;
            }
            _ => {
                headers.push((k.to_owned(), v.into_owned()));
                continue;
            }
        };
        if field.is_none() && !v.is_empty() {
            *field = Some(v.into_owned());
        }
    }
    Some(Envelope {
        id: id.unwrap_or_else(fallback_id),
        message_type: message_type?,
        group_id,
        tenant_id,
        headers,
        payload: Vec::new(),
        attempt: attempt.unwrap_or(1),
    })
}

/// Encode an envelope for a broker: the derived `weir-*` headers come from
/// the fields; every other header is kept as it is.
pub fn encode(env: &Envelope) -> Wire {
    let mut headers = Vec::with_capacity(env.headers.len() + 5);
    headers.push((header::MESSAGE_ID.to_owned(), env.id.clone()));
    headers.push((header::MESSAGE_TYPE.to_owned(), env.message_type.clone()));
    if let Some(g) = &env.group_id {
        headers.push((header::GROUP_ID.to_owned(), g.clone()));
    }
    if let Some(t) = &env.tenant_id {
        headers.push((header::TENANT_ID.to_owned(), t.clone()));
    }
    headers.push((header::ATTEMPT.to_owned(), env.attempt.to_string()));
    headers.extend(
        env.headers
            .iter()
            .filter(|(k, _)| !header::DERIVED.contains(&k.as_str()))
            .cloned(),
    );
    Wire {
        headers,
        body: env.payload.clone(),
    }
}

/// The names a `weir-binary-headers` value lists (none when absent or not a
/// JSON array of strings).
pub fn binary_headers(value: Option<&str>) -> Vec<String> {
    value
        .and_then(|v| serde_json::from_str::<Vec<String>>(v).ok())
        .unwrap_or_default()
}

/// The `weir-binary-headers` value naming `names`.
pub fn binary_headers_value(names: &[&str]) -> String {
    serde_json::to_string(names).unwrap_or_else(|_| "[]".to_owned())
}

/// A fresh envelope for a new message (attempt 1).
pub fn new_message(
    id: String,
    message_type: impl Into<String>,
    group_id: Option<String>,
    tenant_id: Option<String>,
    headers: Vec<(String, String)>,
    payload: Vec<u8>,
) -> Envelope {
    Envelope {
        id,
        message_type: message_type.into(),
        group_id: group_id.filter(|g| !g.is_empty()),
        tenant_id: tenant_id.filter(|t| !t.is_empty()),
        headers,
        payload,
        attempt: 1,
    }
}

/// The id of the `index`-th message a handler published for `parent`:
/// derived from (tenant, message id, message type, index), so a retried call
/// republishes the same ids and consumers can deduplicate, while two messages
/// that share an id but not a tenant or type never share a cascade id.
pub fn cascade_id(parent: &Envelope, index: usize) -> String {
    derived_id(parent, "", index)
}

/// The id of the `index`-th message a `handle-batch` call published for the
/// whole batch (before naming a member) whose first member is `first`; never
/// equal to a [`cascade_id`] of that member.
pub fn batch_cascade_id(first: &Envelope, index: usize) -> String {
    derived_id(first, "batch", index)
}

/// A UUID v5 over the parent's tenant, id and type, a scope and an index,
/// each length-prefixed so that no two tuples share a name (no tenant and an
/// empty tenant are the same: envelopes never carry an empty one).
fn derived_id(parent: &Envelope, scope: &str, index: usize) -> String {
    use std::fmt::Write as _;
    let tenant = parent.tenant_id.as_deref().unwrap_or_default();
    let mut name = String::with_capacity(48 + tenant.len() + parent.id.len() + parent.message_type.len());
    for part in [tenant, parent.id.as_str(), parent.message_type.as_str(), scope] {
        let _ = write!(name, "{}:{part}\u{0}", part.len());
    }
    let _ = write!(name, "{index}");
    uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, name.as_bytes()).to_string()
}

/// A new random message id (time-ordered UUID v7).
pub fn fresh_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

impl Envelope {
    /// The group id, `None` when absent or empty.
    pub fn group(&self) -> Option<&str> {
        self.group_id.as_deref().filter(|g| !g.is_empty())
    }

    /// The first header called `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire(h: &[(&str, &str)]) -> Wire {
        Wire {
            headers: h.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
            body: b"{}".to_vec(),
        }
    }

    #[test]
    fn round_trip_keeps_fields_and_user_headers() {
        let env = new_message(
            "m1".into(),
            "order.placed",
            Some("g".into()),
            Some("acme".into()),
            vec![("x-trace".into(), "abc".into())],
            b"hi".to_vec(),
        );
        let back = decode(encode(&env), || "unused".into(), None).map_err(|e| e.1);
        let back = back.expect("decodes");
        assert_eq!(back.id, "m1");
        assert_eq!(back.group_id.as_deref(), Some("g"));
        assert_eq!(back.tenant_id.as_deref(), Some("acme"));
        assert_eq!(back.header("x-trace"), Some("abc"));
        assert_eq!(back.attempt, 1);
        // The derived headers are carried as fields, not repeated in `headers`.
        assert_eq!(back.headers, vec![("x-trace".to_owned(), "abc".to_owned())]);
    }

    #[test]
    fn empty_group_is_none_and_missing_id_uses_fallback() {
        let env = decode(
            wire(&[(header::MESSAGE_TYPE, "t"), (header::GROUP_ID, "")]),
            || "broker-7".into(),
            None,
        )
        .map_err(|e| e.1)
        .expect("decodes");
        assert_eq!(env.group_id, None);
        assert_eq!(env.id, "broker-7");
    }

    #[test]
    fn missing_type_and_bad_attempt_are_named() {
        let err = decode(wire(&[]), || "x".into(), None).err().map(|e| e.1);
        assert_eq!(err, Some(DecodeError::Missing(header::MESSAGE_TYPE)));
        let err = decode(
            wire(&[(header::MESSAGE_TYPE, "t"), (header::ATTEMPT, "zero")]),
            || "x".into(),
            None,
        )
        .err()
        .map(|e| e.1.to_string());
        assert!(err.is_some_and(|e| e.contains("weir-attempt") && e.contains("zero")));
    }

    #[test]
    fn derived_headers_cannot_disagree_with_fields() {
        let mut env = new_message("m".into(), "t", None, None, vec![], vec![]);
        env.headers.push((header::ATTEMPT.into(), "9".into()));
        env.attempt = 3;
        let w = encode(&env);
        assert_eq!(w.header(header::ATTEMPT), Some("3"));
        assert_eq!(w.headers.iter().filter(|(k, _)| k == header::ATTEMPT).count(), 1);
    }

    /// `decode_pairs` gives what `decode` gives, or `None` where `decode`
    /// refuses.
    fn agree(h: &[(&str, &str)], attempt: Option<u32>) {
        let w = wire(h);
        let fields = |e: Envelope| {
            (
                e.id,
                e.message_type,
                e.group_id,
                e.tenant_id,
                e.headers,
                e.payload,
                e.attempt,
            )
        };
        let slow = decode(w.clone(), || "fb".into(), attempt).ok().map(fields);
        let fast = decode_pairs(
            w.headers
                .iter()
                .map(|(k, v)| (k.as_str(), std::borrow::Cow::Borrowed(v.as_str()))),
            || "fb".into(),
            attempt,
        )
        .map(|mut e| {
            e.payload = w.body.clone();
            fields(e)
        });
        assert_eq!(fast, slow, "{h:?} {attempt:?}");
    }

    #[test]
    fn decode_pairs_agrees_with_decode() {
        use header::*;
        agree(&[(MESSAGE_TYPE, "t")], None);
        agree(&[(MESSAGE_TYPE, "")], None);
        agree(&[(MESSAGE_TYPE, ""), (MESSAGE_TYPE, "t")], None);
        agree(&[(MESSAGE_TYPE, "t"), (MESSAGE_TYPE, "u")], None);
        agree(&[], None);
        agree(&[(MESSAGE_TYPE, "t"), (ATTEMPT, "0")], None);
        agree(&[(MESSAGE_TYPE, "t"), (ATTEMPT, "0")], Some(4));
        agree(&[(MESSAGE_TYPE, "t"), (ATTEMPT, "3"), (ATTEMPT, "x")], None);
        agree(&[(ATTEMPT, "x"), (MESSAGE_TYPE, "t")], None);
        agree(
            &[
                ("x-a", "1"),
                (MESSAGE_ID, ""),
                (MESSAGE_ID, "m"),
                (GROUP_ID, ""),
                (TENANT_ID, "acme"),
                (TENANT_ID, "other"),
                (MESSAGE_TYPE, "t"),
                ("x-a", "2"),
                (ATTEMPT, "2"),
            ],
            None,
        );
        agree(
            &[(GROUP_ID, "g"), (MESSAGE_TYPE, "t"), ("content-type", "json")],
            Some(7),
        );
    }

    proptest::proptest! {
        #[test]
        fn decode_pairs_agrees_with_decode_on_any_headers(
            h in proptest::collection::vec(
                (
                    proptest::sample::select(vec![
                        header::MESSAGE_ID, header::MESSAGE_TYPE, header::GROUP_ID,
                        header::TENANT_ID, header::ATTEMPT, "x-user", "weir-error",
                    ]),
                    proptest::sample::select(vec!["", "0", "1", "7", "abc", "g"]),
                ),
                0..8,
            ),
            attempt in proptest::option::of(1u32..5),
        ) {
            agree(&h, attempt);
        }
    }

    #[test]
    fn binary_header_lists_round_trip() {
        let v = binary_headers_value(&["x-a", "x,\"b"]);
        assert_eq!(binary_headers(Some(&v)), vec!["x-a".to_owned(), "x,\"b".to_owned()]);
        assert!(binary_headers(Some("not json")).is_empty());
        assert!(binary_headers(None).is_empty());
    }

    #[test]
    fn cascade_ids_are_deterministic_and_distinct() {
        let p = new_message("p".into(), "t", None, None, vec![], vec![]);
        assert_eq!(cascade_id(&p, 0), cascade_id(&p, 0));
        assert_ne!(cascade_id(&p, 0), cascade_id(&p, 1));
        assert_ne!(cascade_id(&p, 0), batch_cascade_id(&p, 0));
    }

    /// Issue 15, item 9: one `weir-message-id` from two tenants, or of two
    /// types, gives distinct cascade ids; moving a byte between fields too.
    #[test]
    fn cascade_ids_differ_across_tenants_and_types_for_one_message_id() {
        let of = |tenant: Option<&str>, id: &str, ty: &str| {
            new_message(
                id.into(),
                ty,
                Some("g".into()),
                tenant.map(str::to_owned),
                vec![],
                vec![],
            )
        };
        let parents = [
            of(Some("acme"), "m-1", "order.placed"),
            of(Some("globex"), "m-1", "order.placed"),
            of(None, "m-1", "order.placed"),
            of(Some("acme"), "m-1", "order.paid"),
            of(Some("acme"), "m-1x", "order.placed"),
            of(Some("acmem"), "-1", "order.placed"),
        ];
        let ids: std::collections::HashSet<String> = parents.iter().map(|p| cascade_id(p, 0)).collect();
        assert_eq!(ids.len(), parents.len(), "cascade ids collide: {ids:?}");
        // The group does not take part: it is not part of the message's identity.
        let mut regrouped = parents[0].clone();
        regrouped.group_id = Some("other".into());
        assert_eq!(cascade_id(&regrouped, 0), cascade_id(&parents[0], 0));
    }
}
