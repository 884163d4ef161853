//! The bucket's keys and what they hold.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::cluster::slots::SlotKey;

/// `node.<id>`.
pub fn node_key(id: Uuid) -> String {
    format!("node.{id}")
}

/// `slot.<topology>.<n>` (topology names are `[a-z0-9_-]+`, valid in keys).
pub fn slot_key(key: &SlotKey) -> String {
    format!("slot.{}.{}", key.0, key.1)
}

/// The slot a `slot.<topology>.<n>` key names.
pub fn parse_slot_key(k: &str) -> Option<SlotKey> {
    let rest = k.strip_prefix("slot.")?;
    let (t, n) = rest.rsplit_once('.')?;
    Some((t.to_owned(), n.parse().ok()?))
}

/// `leader`.
pub const LEADER_KEY: &str = "leader";

/// The value of `node.<id>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeValue {
    pub name: String,
    #[serde(default)]
    pub leaving: bool,
}

/// The value of `leader`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaderValue {
    pub node: Uuid,
    pub term: u64,
}

/// The value of `slot.<topology>.<n>`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SlotValue {
    pub owner: Option<Uuid>,
    pub epoch: i64,
    /// `free`, `assigned` or `releasing`.
    pub state: String,
    pub target: Option<Uuid>,
}

impl SlotValue {
    /// Nobody's, at `epoch`.
    pub fn free(epoch: i64) -> Self {
        Self {
            owner: None,
            epoch,
            state: "free".into(),
            target: None,
        }
    }
}

/// A value as stored.
pub fn encode<T: Serialize>(v: &T) -> Bytes {
    // Plain structs of strings and numbers: serializing cannot fail.
    Bytes::from(serde_json::to_vec(v).unwrap_or_default())
}

/// A stored value (`None`: not one of ours).
pub fn decode<'a, T: Deserialize<'a>>(b: &'a [u8]) -> Option<T> {
    serde_json::from_slice(b).ok()
}
