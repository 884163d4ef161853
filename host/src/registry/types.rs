//! What the registry's callers see: grants, activations, deploy answers and
//! errors, and who is asking.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use sha2::Digest as _;

/// Capabilities of one version beyond clocks and random.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grants {
    /// Host environment variables the guest sees (names; values are read at load).
    #[serde(default)]
    pub env: Vec<String>,
    /// Host directories the guest may read.
    #[serde(default)]
    pub dirs: Vec<DirGrant>,
}

/// A read-only directory grant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirGrant {
    /// The path the guest sees.
    pub guest: String,
    /// The host directory.
    pub host: PathBuf,
}

/// One deploy or rollback that made a version current.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Activation {
    /// Increasing per handler (per cluster in `postgres` and `nats-kv` modes).
    pub seq: i64,
    /// sha256 of the component, hex.
    pub digest: String,
    /// Component size in bytes.
    pub size: u64,
    /// Milliseconds since the Unix epoch.
    pub at_ms: i64,
    /// `config`, `admin`, `watch` or `rollback`.
    pub source: String,
    /// The node that made it.
    pub node: String,
    /// The activation it replaced.
    pub previous: Option<i64>,
    /// What the version was granted.
    #[serde(default)]
    pub grants: Grants,
}

/// Why a deploy or rollback was refused. The running version stays.
#[derive(Debug, thiserror::Error)]
pub enum DeployError {
    /// No `[[handler]]` of that name.
    #[error("no handler named `{0}` is configured on this node")]
    UnknownHandler(String),
    /// A tenant token asked for a handler that is not its tenant's, or for
    /// none at all: both answer alike (404, the same text).
    #[error("no handler named `{0}` is visible to this token (a tenant token sees only its own tenant's handlers)")]
    NotVisible(String),
    /// The caller may not change this handler, or asked for grants beyond its tenant's.
    #[error("{0}")]
    Forbidden(String),
    /// Larger than `node.max_component_size`.
    #[error("component is {size} bytes; node.max_component_size allows at most {max}")]
    TooLarge {
        /// Upload size.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// It does not compile, is not a component, exports another world or cannot instantiate.
    #[error("{0}")]
    Invalid(String),
    /// A rollback with nothing to roll back to, or a promote with no canary.
    #[error("{0}")]
    NoPrevious(String),
    /// The change clashes with the handler's state (a canary runs already).
    #[error("{0}")]
    Conflict(String),
    /// The data directory or the database failed; nothing was swapped.
    #[error("{0:#}")]
    Store(anyhow::Error),
}

/// The component a deploy brings.
#[derive(Debug)]
pub enum Upload {
    /// In memory.
    Bytes(Vec<u8>),
    /// In a file of `size` bytes (the admin listener's spooled upload).
    File {
        /// The file.
        path: PathBuf,
        /// Its length.
        size: usize,
    },
}

impl Upload {
    pub(super) fn size(&self) -> usize {
        match self {
            Upload::Bytes(b) => b.len(),
            Upload::File { size, .. } => *size,
        }
    }
}

/// What a deploy or rollback did.
#[derive(Debug, Clone, Serialize)]
pub struct Deployed {
    /// The handler.
    pub handler: String,
    /// The version now current.
    pub digest: String,
    /// The version it replaced.
    pub previous: Option<String>,
    /// False when the upload was the current version already.
    pub swapped: bool,
    /// Where the version is kept: `data-dir`, `database` or `memory` (lost at restart).
    pub kept_in: &'static str,
    /// Milliseconds from receiving the request to the swap (validation and compilation).
    pub took_ms: u64,
    /// Milliseconds spent compiling the component; `null` when it was not
    /// compiled (the compiled-code cache had it, or nothing was swapped).
    pub compiled_ms: Option<u64>,
}

/// A handler as `GET /v1/handlers` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct HandlerInfo {
    /// Its name.
    pub name: String,
    /// Its topology.
    pub topology: String,
    /// The tenant it is bound to (`null`: any tenant without a binding of its own).
    pub tenant: Option<String>,
    /// The current version.
    pub current: Activation,
    /// Earlier activations, newest first (what rollbacks would walk back to).
    pub history: Vec<Activation>,
    /// The canary running on some of its slots, with its live comparison.
    pub canary: Option<super::canary::CanaryView>,
    /// How its last canary ended (as this node saw it).
    pub last_canary: Option<super::canary::Ended>,
}

/// sha256 of `bytes`, hex.
pub fn digest(bytes: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(bytes))
}

/// Who is asking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// The operator token: everything.
    Operator,
    /// A tenant token: that tenant's handlers only.
    Tenant(String),
}
