//! A dead letter as the tools show it (the CLI's tables and `--json`, and
//! the admin API's answers): its position, who it is, why it failed, and on
//! request every header and the payload.

use serde::Serialize;

use super::filter::value;
use crate::envelope::{Wire, header};
use crate::partition;
use crate::transport::dead_letters::DeadLetter;

/// A payload as JSON can carry it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Payload {
    /// `utf-8` (the text as it is) or `hex` (bytes that are not UTF-8).
    pub encoding: &'static str,
    /// The payload in that encoding.
    pub data: String,
}

impl Payload {
    /// `bytes` as text when they are UTF-8, else as hex.
    pub fn of(bytes: &[u8]) -> Self {
        match std::str::from_utf8(bytes) {
            Ok(text) => Self {
                encoding: "utf-8",
                data: text.to_owned(),
            },
            Err(_) => Self {
                encoding: "hex",
                data: hex::encode(bytes),
            },
        }
    }
}

/// One dead letter, summarised; with `headers` and `payload` when shown in full.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LetterView {
    /// Its place on the dead-letter destination (see [`DeadLetter::position`]).
    pub position: u64,
    /// `weir-message-id`.
    pub message_id: Option<String>,
    /// `weir-message-type`.
    pub message_type: Option<String>,
    /// `weir-group-id`.
    pub group: Option<String>,
    /// `weir-tenant-id`.
    pub tenant: Option<String>,
    /// `weir-dead-letter-reason`.
    pub reason: Option<String>,
    /// `weir-error`.
    pub error: Option<String>,
    /// `weir-handler`.
    pub handler: Option<String>,
    /// `weir-handler-version`.
    pub handler_version: Option<String>,
    /// `weir-failed-at`.
    pub failed_at: Option<String>,
    /// `weir-source`.
    pub source: Option<String>,
    /// `weir-attempt`: the attempt that failed last.
    pub attempt: Option<String>,
    /// `weir-redrive-count`: redrives before this capture (0: none).
    pub redrive_count: u32,
    /// The slot a redrive sends it to.
    pub slot: u32,
    /// Payload size in bytes.
    pub payload_bytes: usize,
    /// Every header, in order (shown in full only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headers: Option<Vec<(String, String)>>,
    /// The payload (shown in full only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload: Option<Payload>,
}

/// The slot a letter belongs to in a topology of `slots` slots: its
/// group's, or its message id's when it has no group
/// ([`crate::transport::slot_of`], from the headers).
pub fn slot_of(wire: &Wire, slots: u32) -> u32 {
    partition::slot_for(
        value(wire, header::GROUP_ID),
        value(wire, header::MESSAGE_ID).unwrap_or_default(),
        slots,
    )
}

/// How many times the message of `wire` was redriven.
pub fn redrive_count(wire: &Wire) -> u32 {
    value(wire, header::REDRIVE_COUNT)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

impl LetterView {
    /// The view of `letter` in a topology of `slots` slots; `full` adds
    /// every header and the payload.
    pub fn of(letter: &DeadLetter, slots: u32, full: bool) -> Self {
        let w = &letter.wire;
        let get = |name: &str| value(w, name).map(str::to_owned);
        Self {
            position: letter.position,
            message_id: get(header::MESSAGE_ID),
            message_type: get(header::MESSAGE_TYPE),
            group: get(header::GROUP_ID),
            tenant: get(header::TENANT_ID),
            reason: get(header::DEAD_LETTER_REASON),
            error: get(header::ERROR),
            handler: get(header::HANDLER),
            handler_version: get(header::HANDLER_VERSION),
            failed_at: get(header::FAILED_AT),
            source: get(header::SOURCE),
            attempt: get(header::ATTEMPT),
            redrive_count: redrive_count(w),
            slot: slot_of(w, slots),
            payload_bytes: w.body.len(),
            headers: full.then(|| w.headers.clone()),
            payload: full.then(|| Payload::of(&w.body)),
        }
    }
}
