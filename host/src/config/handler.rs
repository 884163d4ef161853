//! `[[handler]]`: a handler's binding, batching, limits and WASI grants.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::defaults;
use super::units::{ByteSize, de_duration, de_string_table};

/// `[[handler]]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Handler {
    /// Unique name, used by the admin API and in `weir-handler`: `[A-Za-z0-9_.-]+`.
    pub name: String,
    /// Path of the Wasm component; relative paths are resolved against the config file's
    /// directory.
    pub component: PathBuf,
    /// Name of the topology whose messages this handler receives.
    pub topology: String,
    /// Message types delivered one at a time to `handle`.
    #[serde(default)]
    pub message_types: Vec<String>,
    /// Bind only this tenant's messages; absent: messages of any tenant without a more
    /// specific binding.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Message types delivered in batches to `handle-batch`.
    #[serde(default)]
    pub batch: Option<Batch>,
    /// Resource limits per call and per pool.
    #[serde(default)]
    pub limits: Limits,
    /// The handler's own settings, read by the guest with `config(key)`; values are strings.
    #[serde(default, deserialize_with = "de_string_table")]
    pub config: BTreeMap<String, String>,
    /// `reuse` instances within a pool (fast), or a `fresh` instance per message (isolation).
    #[serde(default)]
    pub instance_mode: InstanceMode,
    /// WASI capabilities granted beyond clocks and random; all denied by default.
    #[serde(default)]
    pub wasi: Wasi,
    /// Skip what this handler already handled: a message redelivered after
    /// its success (its ack lost to a crash) is acked without a call.
    #[serde(default)]
    pub dedup: Option<Dedup>,
    /// What a `retry` (or a retried fault) of a grouped message does to the
    /// rest of its group: `continue` (they run on) or `park` (they wait, in
    /// order, until it succeeds or is dead-lettered).
    #[serde(default)]
    pub on_failure: OnFailure,
}

/// `handler.on_failure`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnFailure {
    /// The failed message goes to the ladder; its group runs on.
    #[default]
    Continue,
    /// The failed message's group waits for it (see the README).
    Park,
}

impl Handler {
    /// A handler with default limits, no batch, no grants and an empty config table.
    pub fn new(
        name: impl Into<String>,
        component: impl Into<PathBuf>,
        topology: impl Into<String>,
        message_types: Vec<String>,
    ) -> Self {
        Self {
            name: name.into(),
            component: component.into(),
            topology: topology.into(),
            message_types,
            tenant: None,
            batch: None,
            limits: Limits::default(),
            config: BTreeMap::new(),
            instance_mode: InstanceMode::default(),
            wasi: Wasi::default(),
            dedup: None,
            on_failure: OnFailure::Continue,
        }
    }
}

/// `handler.dedup`: a record of each handled (tenant, group, message id),
/// kept in the coordinator's store for `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dedup {
    /// How long a handled message is remembered, e.g. `"10m"`.
    #[serde(deserialize_with = "de_duration")]
    pub window: Duration,
}

/// `handler.batch`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Batch {
    /// Message types delivered in batches; each batch is one (tenant, group).
    pub message_types: Vec<String>,
    /// Most messages in one batch (>= 1).
    #[serde(default = "defaults::batch_size")]
    pub size: u32,
    /// How long a partial batch waits for more messages.
    #[serde(default = "defaults::batch_linger", deserialize_with = "de_duration")]
    pub linger: Duration,
}

/// `handler.limits`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Linear memory one instance may grow to, e.g. `"64MiB"`.
    #[serde(default = "defaults::memory")]
    pub memory: ByteSize,
    /// Longest a call may run before it is interrupted (and retried).
    #[serde(default = "defaults::timeout", deserialize_with = "de_duration")]
    pub timeout: Duration,
    /// Instances of this handler that may exist at once on this node.
    #[serde(default = "defaults::instances")]
    pub instances: u32,
    /// Wasm stack limit; absent: the engine's default.
    #[serde(default)]
    pub max_stack: Option<ByteSize>,
    /// Wasm fuel one call may burn (roughly instructions); absent: unmetered.
    #[serde(default)]
    pub fuel: Option<u64>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory: defaults::MEMORY,
            timeout: defaults::TIMEOUT,
            instances: defaults::INSTANCES,
            max_stack: None,
            fuel: None,
        }
    }
}

/// `handler.instance_mode`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InstanceMode {
    /// Reuse instances from a pool (about 1 µs a call for a Rust guest).
    #[default]
    Reuse,
    /// A fresh instance for every message or batch (strict isolation; slower).
    Fresh,
}

/// `handler.wasi`: grants beyond clocks and random. Everything is denied unless listed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Wasi {
    /// Names of host environment variables passed to the guest (name only, no `=`).
    #[serde(default)]
    pub env: Vec<String>,
    /// Let the guest write to the host's stdout and stderr.
    #[serde(default)]
    pub inherit_stdio: bool,
    /// Host directories the guest may open.
    #[serde(default)]
    pub preopens: Vec<Preopen>,
    /// Allow outbound sockets.
    #[serde(default)]
    pub network: bool,
}

/// One `handler.wasi.preopens` entry.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Preopen {
    /// Host directory; relative paths are resolved against the config file's directory.
    pub host: PathBuf,
    /// Path the guest sees, e.g. `"/data"`.
    pub guest: String,
    /// Deny writes (default true).
    #[serde(default = "defaults::yes")]
    pub read_only: bool,
}
