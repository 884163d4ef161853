//! The TOML config of one `weir` node (DESIGN.md, "Config"): its types, every default (module
//! [`defaults`], plus the retry defaults in [`crate::retry::schedule`]), parsing, and validation
//! whose errors name the file, the key and what would be accepted.
//!
//! Validation here knows only the config itself. Facts that need a broker connection (a
//! stream's `max_age`, an existing consumer's `AckWait`) are checked by the transport or
//! `weir schedule check` with the same [`Schedule::check`], through [`Topology::schedule`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, Deserializer};

use crate::retry::schedule::{CheckContext, Redelivery, RetryPolicy, Schedule, Violation};

/// Every default of the config, in one place (retry defaults: `crate::retry::schedule`).
pub mod defaults {
    use super::ByteSize;
    use std::time::Duration;

    /// `transport.prefetch`: RabbitMQ prefetch / JetStream max-ack-pending per slot.
    pub const PREFETCH: u32 = 256;
    /// `cluster.lease`.
    pub const LEASE: Duration = Duration::from_secs(5);
    /// `cluster.drain_deadline` when not set: 25 s (below the 30 s a
    /// supervisor such as Kubernetes gives a process between SIGTERM and
    /// SIGKILL), or the lease when that is longer.
    pub const DRAIN_DEADLINE: Duration = Duration::from_secs(25);

    /// `cluster.drain_deadline` when not set, for a lease of `lease`.
    pub fn drain_deadline(lease: Duration) -> Duration {
        DRAIN_DEADLINE.max(lease)
    }
    /// `topology.max_concurrent_groups`, per slot.
    pub const MAX_CONCURRENT_GROUPS: u32 = 64;
    /// `topology.max_unordered`, per slot.
    pub const MAX_UNORDERED: u32 = 16;
    /// `handler.batch.size`.
    pub const BATCH_SIZE: u32 = 100;
    /// `handler.batch.linger`.
    pub const BATCH_LINGER: Duration = Duration::from_millis(20);
    /// `handler.limits.memory`.
    pub const MEMORY: ByteSize = ByteSize(64 * 1024 * 1024);
    /// `handler.limits.timeout`.
    pub const TIMEOUT: Duration = Duration::from_secs(5);
    /// `handler.limits.instances`.
    pub const INSTANCES: u32 = 16;
    /// `node.max_component_size`.
    pub const MAX_COMPONENT_SIZE: ByteSize = ByteSize(128 * 1024 * 1024);
    /// `node.budgets.cascade_bytes`: what one call's held cascades may total.
    pub const CASCADE_BYTES: ByteSize = ByteSize(8 * 1024 * 1024);
    /// `node.budgets.log_bytes`: log (and granted stdio) bytes one call may write.
    pub const LOG_BYTES: ByteSize = ByteSize(64 * 1024);
    /// `node.budgets.log_lines`: log (and granted stdio) lines one call may write.
    pub const LOG_LINES: u32 = 256;
    /// `node.budgets.log_line_bytes`: longest log line kept whole.
    pub const LOG_LINE_BYTES: ByteSize = ByteSize(4 * 1024);
    /// `node.budgets.error_bytes`: longest failure text (`retry`/`reject` reason, trap detail).
    pub const ERROR_BYTES: ByteSize = ByteSize(4 * 1024);
    /// `node.instance_pool`: the least the computed pool size may be.
    pub const INSTANCE_POOL_MIN: u32 = 256;
    /// `node.instance_pool`: the most instances a pool may reserve room for (each reserves
    /// address space for its memories; 4096 of them about 32 TiB of the 128 TiB there is).
    pub const INSTANCE_POOL_MAX: u32 = 4096;

    /// `node.admin_header_timeout`.
    pub const ADMIN_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
    /// `node.admin_body_timeout`.
    pub const ADMIN_BODY_TIMEOUT: Duration = Duration::from_secs(120);
    /// `node.admin_idle_timeout`.
    pub const ADMIN_IDLE_TIMEOUT: Duration = Duration::from_secs(15);
    /// `node.admin_max_connections`.
    pub const ADMIN_MAX_CONNECTIONS: u32 = 256;
    /// `node.admin_max_uploads`.
    pub const ADMIN_MAX_UPLOADS: u32 = 4;
    /// `node.admin_max_uploads_per_caller`.
    pub const ADMIN_MAX_UPLOADS_PER_CALLER: u32 = 2;

    /// `node.name`: the host name and the process id, `"{host}-{pid}"`.
    pub fn node_name() -> String {
        let host = std::env::var("HOSTNAME")
            .ok()
            .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "weir".to_string());
        format!("{host}-{}", std::process::id())
    }

    pub(super) fn max_component_size() -> ByteSize {
        MAX_COMPONENT_SIZE
    }
    pub(super) fn cascade_bytes() -> ByteSize {
        CASCADE_BYTES
    }
    pub(super) fn log_bytes() -> ByteSize {
        LOG_BYTES
    }
    pub(super) fn log_lines() -> u32 {
        LOG_LINES
    }
    pub(super) fn log_line_bytes() -> ByteSize {
        LOG_LINE_BYTES
    }
    pub(super) fn error_bytes() -> ByteSize {
        ERROR_BYTES
    }
    pub(super) fn admin_header_timeout() -> Duration {
        ADMIN_HEADER_TIMEOUT
    }
    pub(super) fn admin_body_timeout() -> Duration {
        ADMIN_BODY_TIMEOUT
    }
    pub(super) fn admin_idle_timeout() -> Duration {
        ADMIN_IDLE_TIMEOUT
    }
    pub(super) fn admin_max_connections() -> u32 {
        ADMIN_MAX_CONNECTIONS
    }
    pub(super) fn admin_max_uploads() -> u32 {
        ADMIN_MAX_UPLOADS
    }
    pub(super) fn admin_max_uploads_per_caller() -> u32 {
        ADMIN_MAX_UPLOADS_PER_CALLER
    }
    pub(super) fn prefetch() -> u32 {
        PREFETCH
    }
    pub(super) fn lease() -> Duration {
        LEASE
    }
    pub(super) fn max_concurrent_groups() -> u32 {
        MAX_CONCURRENT_GROUPS
    }
    pub(super) fn max_unordered() -> u32 {
        MAX_UNORDERED
    }
    pub(super) fn batch_size() -> u32 {
        BATCH_SIZE
    }
    pub(super) fn batch_linger() -> Duration {
        BATCH_LINGER
    }
    pub(super) fn memory() -> ByteSize {
        MEMORY
    }
    pub(super) fn timeout() -> Duration {
        TIMEOUT
    }
    pub(super) fn instances() -> u32 {
        INSTANCES
    }
    pub(super) fn yes() -> bool {
        true
    }
}

/// A whole config file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// This node: its name and admin listener.
    #[serde(default)]
    pub node: Node,
    /// The broker. Absent: the in-memory broker.
    #[serde(default)]
    pub transport: Transport,
    /// How slots are assigned to nodes. Absent: `solo`.
    #[serde(default)]
    pub cluster: Cluster,
    /// Topologies (`[[topology]]`): a named set of slots with its retry policy.
    #[serde(default)]
    pub topology: Vec<Topology>,
    /// Handlers (`[[handler]]`): a component bound to message types of one topology.
    #[serde(default)]
    pub handler: Vec<Handler>,
    /// Tenants (`[[tenant]]`): their admin token, limits and what their handlers may be granted.
    #[serde(default)]
    pub tenant: Vec<Tenant>,
    /// Where the config came from (file path or label), named in errors. Not read from TOML.
    #[serde(skip)]
    pub origin: String,
}

/// `[node]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Node {
    /// This node's name in the cluster; default: host name and process id.
    #[serde(default = "defaults::node_name")]
    pub name: String,
    /// Address of the admin HTTP listener (health, metrics, deploy), e.g. `"127.0.0.1:9464"`;
    /// absent: no admin listener.
    #[serde(default)]
    pub admin: Option<SocketAddr>,
    /// Bearer token of the operator (every admin route). With no token and no tenant tokens the
    /// read-only routes are open and deploys are refused.
    #[serde(default)]
    pub admin_token: Option<String>,
    /// Where deployed components and their history are kept, so they survive a restart; also
    /// the compiled-code cache. Relative paths are resolved against the config file's directory.
    #[serde(default)]
    pub data_dir: Option<PathBuf>,
    /// A directory watched for `{handler}.wasm` files: a new or changed file is deployed to the
    /// handler of that name (a bad file is refused and logged; the running version stays).
    #[serde(default)]
    pub components_dir: Option<PathBuf>,
    /// Largest component a deploy may upload, e.g. `"128MiB"`.
    #[serde(default = "defaults::max_component_size")]
    pub max_component_size: ByteSize,
    /// Per-call budgets for what any guest hands the host (cascades, log, failure texts).
    #[serde(default)]
    pub budgets: Budgets,
    /// Instances the pooling allocator keeps room for; absent: computed from the workers and
    /// handlers (at least 256). Cached idle instances are evicted when the pool is full.
    #[serde(default)]
    pub instance_pool: Option<u32>,
    /// How long the admin listener waits for a request's line and headers, counted from when
    /// the connection opens or its previous response is sent: an idle connection, or one whose
    /// headers trickle in, is closed after this. E.g. `"10s"`.
    #[serde(default = "defaults::admin_header_timeout", deserialize_with = "de_duration")]
    pub admin_header_timeout: Duration,
    /// The longest an upload's body may take to arrive; past it the request is answered 408
    /// and the connection closed.
    #[serde(default = "defaults::admin_body_timeout", deserialize_with = "de_duration")]
    pub admin_body_timeout: Duration,
    /// The longest pause (no byte received) while an upload's body arrives; past it: 408 and
    /// the connection closed.
    #[serde(default = "defaults::admin_idle_timeout", deserialize_with = "de_duration")]
    pub admin_idle_timeout: Duration,
    /// Connections the admin listener holds open at once; one more is closed as soon as it is
    /// accepted.
    #[serde(default = "defaults::admin_max_connections")]
    pub admin_max_connections: u32,
    /// Uploads (`PUT /v1/handlers/{name}`) received, queued or validated at once on this node
    /// (each streamed to a file, not held in memory); one more is answered 503 with
    /// `Retry-After`, and the running version stays.
    #[serde(default = "defaults::admin_max_uploads")]
    pub admin_max_uploads: u32,
    /// Of `admin_max_uploads`, how many one caller (a tenant token, or the operator) may hold,
    /// so one tenant cannot take every upload slot; one more: 429 with `Retry-After`.
    #[serde(default = "defaults::admin_max_uploads_per_caller")]
    pub admin_max_uploads_per_caller: u32,
}

/// `[node.budgets]`: per call, for every handler on the node. What is over a budget is
/// refused (a cascade), dropped with a counter and one marker line (log), or cut with a
/// marker (a long log line, a failure text).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budgets {
    /// Bytes one call's held cascades may total (payload, headers, type, group id); a
    /// `publish` beyond it answers an error and the call is rejected unless it failed itself.
    #[serde(default = "defaults::cascade_bytes")]
    pub cascade_bytes: ByteSize,
    /// Bytes one call may write to the host's log (`log` and granted stdout/stderr).
    #[serde(default = "defaults::log_bytes")]
    pub log_bytes: ByteSize,
    /// Lines one call may write to the host's log.
    #[serde(default = "defaults::log_lines")]
    pub log_lines: u32,
    /// Longest log line kept; longer ones are cut.
    #[serde(default = "defaults::log_line_bytes")]
    pub log_line_bytes: ByteSize,
    /// Longest `retry`/`reject` reason or trap detail kept: cut to its first line, a marker
    /// and the original length.
    #[serde(default = "defaults::error_bytes")]
    pub error_bytes: ByteSize,
}

impl Default for Budgets {
    fn default() -> Self {
        Self {
            cascade_bytes: defaults::CASCADE_BYTES,
            log_bytes: defaults::LOG_BYTES,
            log_lines: defaults::LOG_LINES,
            log_line_bytes: defaults::LOG_LINE_BYTES,
            error_bytes: defaults::ERROR_BYTES,
        }
    }
}

impl Budgets {
    /// These budgets with a tenant's own per-call ones in place of those it sets.
    pub fn for_tenant(&self, t: &TenantBudgets) -> Budgets {
        Budgets {
            cascade_bytes: t.cascade_bytes.unwrap_or(self.cascade_bytes),
            log_bytes: t.log_bytes.unwrap_or(self.log_bytes),
            log_lines: t.log_lines.unwrap_or(self.log_lines),
            log_line_bytes: t.log_line_bytes.unwrap_or(self.log_line_bytes),
            error_bytes: t.error_bytes.unwrap_or(self.error_bytes),
        }
    }
}

impl Default for Node {
    fn default() -> Self {
        Self {
            name: defaults::node_name(),
            admin: None,
            admin_token: None,
            data_dir: None,
            components_dir: None,
            max_component_size: defaults::MAX_COMPONENT_SIZE,
            budgets: Budgets::default(),
            instance_pool: None,
            admin_header_timeout: defaults::ADMIN_HEADER_TIMEOUT,
            admin_body_timeout: defaults::ADMIN_BODY_TIMEOUT,
            admin_idle_timeout: defaults::ADMIN_IDLE_TIMEOUT,
            admin_max_connections: defaults::ADMIN_MAX_CONNECTIONS,
            admin_max_uploads: defaults::ADMIN_MAX_UPLOADS,
            admin_max_uploads_per_caller: defaults::ADMIN_MAX_UPLOADS_PER_CALLER,
        }
    }
}

/// `[[tenant]]`: a tenant sharing the node with others.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenant {
    /// The tenant id, as in `weir-tenant-id`.
    pub name: String,
    /// Bearer token that sees and changes only this tenant's handlers.
    #[serde(default)]
    pub token: Option<String>,
    /// Ceilings for the tenant's handlers, shared by all of them where it says so.
    #[serde(default)]
    pub limits: TenantLimits,
    /// What the tenant's handlers may be granted; nothing by default.
    #[serde(default)]
    pub allow: TenantAllow,
    /// The tenant's own budgets: per call (each absent key: the node's), and over time.
    #[serde(default)]
    pub budgets: TenantBudgets,
}

/// `tenant.budgets`: per call, for every handler of the tenant, in place of `[node.budgets]`
/// (each absent key: the node's; never above the node's unless `above_node`), and over time,
/// shared by all the tenant's calls on the node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantBudgets {
    /// Bytes one call's held cascades may total; absent: `node.budgets.cascade_bytes`.
    #[serde(default)]
    pub cascade_bytes: Option<ByteSize>,
    /// Bytes one call may write to the host's log; absent: `node.budgets.log_bytes`.
    #[serde(default)]
    pub log_bytes: Option<ByteSize>,
    /// Lines one call may write to the host's log; absent: `node.budgets.log_lines`.
    #[serde(default)]
    pub log_lines: Option<u32>,
    /// Longest log line kept; absent: `node.budgets.log_line_bytes`.
    #[serde(default)]
    pub log_line_bytes: Option<ByteSize>,
    /// Longest failure text kept; absent: `node.budgets.error_bytes`.
    #[serde(default)]
    pub error_bytes: Option<ByteSize>,
    /// Log bytes all the tenant's calls together may write per second (a burst of up to one
    /// second's worth); beyond: dropped, counted, and one marker line a second at most.
    /// Absent: no limit over time.
    #[serde(default)]
    pub log_bytes_per_second: Option<ByteSize>,
    /// Log lines all the tenant's calls together may write per second, as above.
    #[serde(default)]
    pub log_lines_per_second: Option<u32>,
    /// Let the per-call budgets above exceed the node's (the operator says so); default: a
    /// value above the node's stops the start.
    #[serde(default)]
    pub above_node: bool,
}

impl TenantBudgets {
    /// Whether any per-call budget is set (the node's apply otherwise).
    pub fn overrides_per_call(&self) -> bool {
        self.cascade_bytes.is_some()
            || self.log_bytes.is_some()
            || self.log_lines.is_some()
            || self.log_line_bytes.is_some()
            || self.error_bytes.is_some()
    }
}

impl Tenant {
    /// Where a tenant handler's limits, set explicitly, exceed the tenant's: (key under
    /// `limits`, message). Defaults above a tenant's limit are lowered to it, not refused.
    pub fn check_handler_limits(&self, l: &Limits) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if let Some(max) = self.limits.memory
            && l.memory > max
            && l.memory != defaults::MEMORY
        {
            out.push((
                "memory",
                format!(
                    "{} is above tenant {:?}'s limit {}; accepted: at most that",
                    l.memory, self.name, max
                ),
            ));
        }
        if let Some(max) = self.limits.timeout
            && l.timeout > max
            && l.timeout != defaults::TIMEOUT
        {
            out.push((
                "timeout",
                format!(
                    "{:?} is above tenant {:?}'s limit {max:?}; accepted: at most that",
                    l.timeout, self.name
                ),
            ));
        }
        if let (Some(max), Some(f)) = (self.limits.fuel, l.fuel)
            && f > max
        {
            out.push((
                "fuel",
                format!(
                    "{f} is above tenant {:?}'s limit {max}; accepted: at most that",
                    self.name
                ),
            ));
        }
        out
    }

    /// Where grants exceed what the tenant allows: (key under `wasi`, message). `preopens` are
    /// (guest path, host path, read-only).
    pub fn check_grants(&self, env: &[String], preopens: &[(String, PathBuf, bool)]) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (k, name) in env.iter().enumerate() {
            if !self.allow.env.iter().any(|a| a == name) {
                out.push((
                    format!("env[{k}]"),
                    format!(
                        "{name:?} is not allowed for tenant {:?}; accepted: one of {:?} (tenant.allow.env)",
                        self.name, self.allow.env
                    ),
                ));
            }
        }
        for (k, (guest, host, read_only)) in preopens.iter().enumerate() {
            if !read_only {
                out.push((
                    format!("preopens[{k}].read_only"),
                    format!(
                        "tenant {:?} handlers get read-only directories only; set read_only = true",
                        self.name
                    ),
                ));
            }
            // Compared as resolved paths (symlinks followed) where they
            // exist, so a link under an allowed directory cannot point out
            // of it; as written where they do not (opening fails later).
            let resolved = std::fs::canonicalize(host).unwrap_or_else(|_| host.clone());
            let roots = self.resolved_allow_dirs();
            let allowed = is_within(host, Path::new("/")) && roots.iter().any(|d| is_within(&resolved, d));
            if !allowed {
                let via = if resolved == *host {
                    String::new()
                } else {
                    format!(" (it resolves to {})", resolved.display())
                };
                out.push((
                    format!("preopens[{k}].host"),
                    format!(
                        "{}{via} (guest {guest:?}) is not within a directory tenant {:?} may grant; accepted: one of {:?} \
                         (tenant.allow.dirs) or below, after following symlinks",
                        host.display(),
                        self.name,
                        self.allow.dirs
                    ),
                ));
            }
        }
        out
    }
}

impl Tenant {
    /// `allow.dirs` with symlinks resolved (as written where a directory does not exist).
    pub fn resolved_allow_dirs(&self) -> Vec<PathBuf> {
        self.allow
            .dirs
            .iter()
            .map(|d| std::fs::canonicalize(d).unwrap_or_else(|_| d.clone()))
            .collect()
    }
}

/// Whether `path` is `dir` or below it, compared component by component after removing `.`
/// and refusing `..` (a path with `..` is never within).
pub(crate) fn is_within(path: &Path, dir: &Path) -> bool {
    use std::path::Component;
    if path.components().any(|c| c == Component::ParentDir) || dir.components().any(|c| c == Component::ParentDir) {
        return false;
    }
    let clean = |p: &Path| -> Vec<std::ffi::OsString> {
        p.components()
            .filter(|c| *c != Component::CurDir)
            .map(|c| c.as_os_str().to_owned())
            .collect()
    };
    let (p, d) = (clean(path), clean(dir));
    p.len() >= d.len() && p[..d.len()] == d[..]
}

/// `tenant.limits`: each absent key leaves that resource bounded only by the handler's limits.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantLimits {
    /// Largest linear memory of one instance of any of the tenant's handlers.
    #[serde(default)]
    pub memory: Option<ByteSize>,
    /// Longest call of any of the tenant's handlers.
    #[serde(default, deserialize_with = "de_duration_opt")]
    pub timeout: Option<Duration>,
    /// Calls of all the tenant's handlers that may run at once on this node.
    #[serde(default)]
    pub concurrency: Option<u32>,
    /// Wasm fuel (roughly instructions) one call may burn; exhausted: the call traps.
    #[serde(default)]
    pub fuel: Option<u64>,
}

/// `tenant.allow`: the grants a tenant's handler may ask for.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantAllow {
    /// Host environment variable names the tenant's handlers may be given.
    #[serde(default)]
    pub env: Vec<String>,
    /// Host directories the tenant's handlers may be given read-only (a preopen's host path
    /// must be one of these or below one).
    #[serde(default)]
    pub dirs: Vec<PathBuf>,
}

/// `[transport]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Transport {
    /// The broker: `memory`, `rabbitmq` or `nats` (JetStream).
    #[serde(default)]
    pub kind: TransportKind,
    /// Broker URL; required for `rabbitmq` (`amqp://…`) and `nats` (`nats://…`).
    #[serde(default)]
    pub url: Option<String>,
    /// Unacknowledged messages a node may hold per slot subscription: RabbitMQ prefetch,
    /// JetStream max-ack-pending. The back-pressure bound.
    #[serde(default = "defaults::prefetch")]
    pub prefetch: u32,
}

impl Default for Transport {
    fn default() -> Self {
        Self {
            kind: TransportKind::default(),
            url: None,
            prefetch: defaults::PREFETCH,
        }
    }
}

/// `transport.kind`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// In-process broker: tests and `weir demo`.
    #[default]
    Memory,
    /// RabbitMQ (AMQP 0-9-1).
    Rabbitmq,
    /// NATS JetStream.
    Nats,
}

impl TransportKind {
    /// Who serves the retry ladder on this broker. `ack_wait` is a JetStream consumer's
    /// `AckWait` when known; it is ignored for the other kinds.
    pub fn redelivery(self, ack_wait: Option<Duration>) -> Redelivery {
        match self {
            TransportKind::Memory | TransportKind::Rabbitmq => Redelivery::Host,
            TransportKind::Nats => Redelivery::JetStream {
                ack_wait,
                capture_reserve: crate::retry::schedule::DEFAULT_CAPTURE_RESERVE,
            },
        }
    }

    /// The name as written in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Memory => "memory",
            TransportKind::Rabbitmq => "rabbitmq",
            TransportKind::Nats => "nats",
        }
    }
}

/// `[cluster]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// `solo` (this node owns every slot), `static` (owned_slots), `postgres` (a coordinator
    /// with leases), or `rabbitmq-sac` (RabbitMQ single active consumer).
    #[serde(default)]
    pub mode: ClusterMode,
    /// The slots this node owns, in every topology; `static` mode only.
    #[serde(default)]
    pub owned_slots: Option<Vec<u32>>,
    /// Postgres URL of the coordinator; `postgres` mode only.
    #[serde(default)]
    pub database_url: Option<String>,
    /// How long a node's slot lease lasts without renewal (`postgres` mode).
    #[serde(default = "defaults::lease", deserialize_with = "de_duration")]
    pub lease: Duration,
    /// How long a stopping node lets its running calls finish (`postgres`
    /// mode). The node renews its lease throughout its drain; at this
    /// deadline it interrupts the calls still running (they are released to
    /// the broker, not failed), releases its slots and leaves. At least the
    /// lease: a node that crashed keeps its slots that long anyway. Default:
    /// [`defaults::drain_deadline`]; read it with [`Cluster::drain_deadline`].
    #[serde(default, deserialize_with = "de_duration_opt")]
    pub drain_deadline: Option<Duration>,
}

impl Cluster {
    /// `drain_deadline`, or its default for this lease.
    pub fn drain_deadline(&self) -> Duration {
        self.drain_deadline
            .unwrap_or_else(|| defaults::drain_deadline(self.lease))
    }
}

impl Default for Cluster {
    fn default() -> Self {
        Self {
            mode: ClusterMode::default(),
            owned_slots: None,
            database_url: None,
            lease: defaults::LEASE,
            drain_deadline: None,
        }
    }
}

/// `cluster.mode`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClusterMode {
    /// One node owns every slot.
    #[default]
    Solo,
    /// Ownership configured per node (`owned_slots`).
    Static,
    /// A Postgres coordinator assigns slots with leases and fencing epochs.
    Postgres,
    /// RabbitMQ's single active consumer enforces one consumer per slot queue.
    RabbitmqSac,
}

/// `[[topology]]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    /// Name used in broker objects (`weir.{name}`, `WEIR_{name}`): `[a-z0-9_-]+`.
    pub name: String,
    /// Number of slots (>= 1). Changing it moves groups between slots.
    pub slots: u32,
    /// Groups that may run at once in one slot.
    #[serde(default = "defaults::max_concurrent_groups")]
    pub max_concurrent_groups: u32,
    /// Messages without a group id that may run at once in one slot.
    #[serde(default = "defaults::max_unordered")]
    pub max_unordered: u32,
    /// Retry policy; absent: the default ladder, which no check rejects.
    #[serde(default)]
    pub retry: Option<RetrySection>,
}

impl Topology {
    /// A topology with default concurrency and the default retry policy.
    pub fn new(name: impl Into<String>, slots: u32) -> Self {
        Self {
            name: name.into(),
            slots,
            max_concurrent_groups: defaults::MAX_CONCURRENT_GROUPS,
            max_unordered: defaults::MAX_UNORDERED,
            retry: None,
        }
    }

    /// The effective retry policy: the section over [`RetryPolicy::default`].
    /// A section without a `ladder` takes the default ladder, except on NATS
    /// JetStream when the default is too long for the section's
    /// `max_deliver` (JetStream needs fewer rungs than deliveries): then no
    /// ladder, which there means AckWait between deliveries, so
    /// `max_deliver = 3` alone is not refused for the default's 3 rungs.
    pub fn retry_policy(&self, transport: TransportKind) -> RetryPolicy {
        match &self.retry {
            None => RetryPolicy::default(),
            Some(section) => {
                let default = RetryPolicy::default();
                let max_deliver = section.max_deliver.unwrap_or(default.max_deliver);
                let too_long = usize::try_from(max_deliver).is_ok_and(|m| m > 0 && default.ladder.len() >= m);
                let absent = match transport {
                    TransportKind::Nats if too_long => Vec::new(),
                    _ => default.ladder,
                };
                RetryPolicy {
                    ladder: section.ladder.clone().unwrap_or(absent),
                    max_deliver: section.max_deliver.unwrap_or(default.max_deliver),
                    max_time_to_dead_letter: section.max_time_to_dead_letter,
                    origin: crate::retry::schedule::Origin::Configured,
                }
            }
        }
    }

    /// The retry schedule on `transport` (`ack_wait`: a JetStream consumer's, when known).
    pub fn schedule(&self, transport: TransportKind, ack_wait: Option<Duration>) -> Schedule {
        self.retry_policy(transport).schedule(transport.redelivery(ack_wait))
    }
}

/// `[topology.retry]`; omitted keys take the defaults of [`RetryPolicy::default`].
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetrySection {
    /// Delay before each redelivery: rung k is waited before delivery k + 1; the last repeats.
    /// Default `["1s", "5s", "30s"]` (on NATS none when `max_deliver` is 3 or less: JetStream
    /// needs fewer rungs than deliveries). Empty: JetStream waits AckWait; others retry at once.
    #[serde(default, deserialize_with = "de_duration_list")]
    pub ladder: Option<Vec<Duration>>,
    /// Deliveries in total, the first included; 0 or less: unlimited. Default 5.
    #[serde(default)]
    pub max_deliver: Option<i64>,
    /// Upper bound on the time from first delivery to dead-letter, checked at start.
    #[serde(default, deserialize_with = "de_duration_opt")]
    pub max_time_to_dead_letter: Option<Duration>,
}

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
        }
    }
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

/// A size in bytes, written `"64MiB"`, `"512KiB"`, `"1GiB"`, `"100B"` or a plain integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Parses `"64MiB"`, `"512 KiB"`, `"1GiB"`, `"1TiB"`, `"100B"` or `"4096"`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (number, unit) = t.split_at(split);
        let accepted = "expected a whole number of bytes or a number with a unit B, KiB, MiB, \
                        GiB or TiB, e.g. \"64MiB\"";
        let number: u64 = number
            .parse()
            .map_err(|_| format!("invalid size {text:?}: {accepted}"))?;
        let factor: u64 = match unit.trim_start() {
            "" | "B" => 1,
            "KiB" => 1 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            "TiB" => 1 << 40,
            _ => return Err(format!("invalid size {text:?}: {accepted}")),
        };
        number
            .checked_mul(factor)
            .map(ByteSize)
            .ok_or_else(|| format!("size {text:?} does not fit in 64 bits"))
    }

    /// The size in bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let units = [
            (1u64 << 40, "TiB"),
            (1 << 30, "GiB"),
            (1 << 20, "MiB"),
            (1 << 10, "KiB"),
        ];
        for (factor, unit) in units {
            if self.0 >= factor && self.0.is_multiple_of(factor) {
                return write!(f, "{}{unit}", self.0 / factor);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(i64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) => u64::try_from(n)
                .map(ByteSize)
                .map_err(|_| de::Error::custom(format!("invalid size {n}: a size cannot be negative"))),
            Raw::Text(t) => ByteSize::parse(&t).map_err(de::Error::custom),
        }
    }
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim()).map_err(|e| {
        format!(
            "invalid duration {text:?} ({e}); expected a number with a unit, e.g. \"20ms\", \
             \"5s\", \"10m\", \"1h\""
        )
    })
}

fn de_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    parse_duration(&text).map_err(de::Error::custom)
}

fn de_duration_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    de_duration(d).map(Some)
}

fn de_duration_list<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<Duration>>, D::Error> {
    let texts = Vec::<String>::deserialize(d)?;
    texts
        .iter()
        .enumerate()
        .map(|(i, t)| parse_duration(t).map_err(|e| de::Error::custom(format!("ladder[{i}]: {e}"))))
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn de_string_table<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    let raw = BTreeMap::<String, toml::Value>::deserialize(d)?;
    raw.into_iter()
        .map(|(key, value)| match value {
            toml::Value::String(s) => Ok((key, s)),
            other => Err(de::Error::custom(format!(
                "config.{key}: expected a string, found {} {other}; handler config values are \
                 strings: write {key} = \"{}\"",
                other.type_str(),
                other.to_string().trim_matches('"'),
            ))),
        })
        .collect()
}

/// Why a config cannot be used. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{origin}: cannot read the config file: {source}")]
    Read {
        /// The path.
        origin: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Not valid TOML, an unknown key, or a value of the wrong shape; `message` is the toml
    /// crate's text with line, column and the offending key or value.
    #[error("{origin}: {}{message}", section.as_deref().map(|s| format!("in {s}: ")).unwrap_or_default())]
    Syntax {
        /// The file or label.
        origin: String,
        /// The enclosing table, e.g. `handler[1]`, when it could be found.
        section: Option<String>,
        /// The parser's message.
        message: String,
    },
    /// Well-formed but inconsistent: one violation per key at fault.
    #[error("{origin}: invalid config:\n{}", list(issues))]
    Invalid {
        /// The file or label.
        origin: String,
        /// Each key at fault, with what would be accepted.
        issues: Vec<Violation>,
    },
}

fn list(issues: &[Violation]) -> String {
    let lines: Vec<String> = issues.iter().map(|v| format!("  {v}")).collect();
    lines.join("\n")
}

/// Reads, parses and validates the config at `path` (see [`parse`]).
pub fn load(path: &Path) -> anyhow::Result<Config> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        origin: origin.clone(),
        source,
    })?;
    Ok(parse(&text, &origin)?)
}

/// Parses and validates `text`. `origin` is the file's path, named in errors; relative
/// component and preopen paths are resolved against its directory (a label with no directory,
/// like `"<inline>"`, leaves them as written). Warnings are not returned here: call
/// [`Config::validate`] to log them.
pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
    let mut config: Config = toml::from_str(text).map_err(|e| ConfigError::Syntax {
        origin: origin.to_string(),
        section: e.span().and_then(|span| section_at(text, span.start)),
        message: e.to_string().trim_end().to_string(),
    })?;
    config.origin = origin.to_string();
    if let Some(base) = Path::new(origin).parent().filter(|p| !p.as_os_str().is_empty()) {
        config.resolve_paths(base);
    }
    config.validate()?;
    Ok(config)
}

/// The table enclosing byte `offset` of `text`, from the headers before it: `node`,
/// `topology[2].retry`, `handler[1]`, …
fn section_at(text: &str, offset: usize) -> Option<String> {
    let mut counts: HashMap<String, usize> = HashMap::new();
    let mut current: Option<String> = None;
    let mut arrays: HashMap<String, String> = HashMap::new();
    let mut start = 0;
    for line in text.split_inclusive('\n') {
        if start > offset {
            break;
        }
        start += line.len();
        let code = line.split('#').next().unwrap_or("").trim();
        let (array, inner) = if let Some(i) = code.strip_prefix("[[").and_then(|c| c.strip_suffix("]]")) {
            (true, i)
        } else if let Some(i) = code.strip_prefix('[').and_then(|c| c.strip_suffix(']')) {
            (false, i)
        } else {
            continue;
        };
        let name = inner.trim();
        let is_header = !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
        if !is_header {
            continue;
        }
        // Qualify with the index of the innermost array of tables it extends.
        let (parent, leaf) = name.rsplit_once('.').map_or(("", name), |(p, l)| (p, l));
        let qualified_parent = arrays.get(parent).cloned().unwrap_or_else(|| parent.to_string());
        let base = if parent.is_empty() {
            leaf.to_string()
        } else {
            format!("{qualified_parent}.{leaf}")
        };
        if array {
            let n = counts.entry(name.to_string()).or_insert(0);
            let q = format!("{base}[{n}]");
            *n += 1;
            arrays.insert(name.to_string(), q.clone());
            current = Some(q);
        } else {
            current = Some(base);
        }
    }
    current
}

/// Collects violations during validation.
#[derive(Default)]
struct Issues(Vec<Violation>);

impl Issues {
    fn add(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.0.push(Violation {
            key: key.into(),
            message: message.into(),
        });
    }
}

fn is_broker_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-'))
}

fn is_handler_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

impl Config {
    /// The config key of topology `index`'s retry section, as named in violations.
    pub fn retry_key(index: usize) -> String {
        format!("topology[{index}].retry")
    }

    /// The topology named `name`.
    pub fn topology(&self, name: &str) -> Option<&Topology> {
        self.topology.iter().find(|t| t.name == name)
    }

    /// Resolves relative component and preopen paths against `base`.
    pub fn resolve_paths(&mut self, base: &Path) {
        for dir in [&mut self.node.data_dir, &mut self.node.components_dir]
            .into_iter()
            .flatten()
        {
            if dir.is_relative() {
                *dir = base.join(&*dir);
            }
        }
        for t in &mut self.tenant {
            for d in &mut t.allow.dirs {
                if d.is_relative() {
                    *d = base.join(&*d);
                }
            }
        }
        for h in &mut self.handler {
            if h.component.is_relative() {
                h.component = base.join(&h.component);
            }
            for p in &mut h.wasi.preopens {
                if p.host.is_relative() {
                    p.host = base.join(&p.host);
                }
            }
        }
    }

    /// Checks everything that can be checked without a broker. Errors stop the start; the
    /// warnings (retry rules that do not reject, unused keys) are returned for logging.
    pub fn validate(&self) -> Result<Vec<Violation>, ConfigError> {
        let mut errors = Issues::default();
        let mut warnings = Vec::new();
        self.validate_node_transport_cluster(&mut errors, &mut warnings);
        self.validate_topologies(&mut errors, &mut warnings);
        self.validate_handlers(&mut errors);
        self.validate_tenants(&mut errors);
        if errors.0.is_empty() {
            Ok(warnings)
        } else {
            Err(ConfigError::Invalid {
                origin: self.origin.clone(),
                issues: errors.0,
            })
        }
    }

    fn validate_node_transport_cluster(&self, errors: &mut Issues, warnings: &mut Vec<Violation>) {
        if self.node.name.trim().is_empty() {
            errors.add(
                "node.name",
                "is empty; accepted: any non-empty name, unique in the cluster",
            );
        }
        let b = &self.node.budgets;
        for (key, value) in [
            ("node.budgets.cascade_bytes", b.cascade_bytes.bytes()),
            ("node.budgets.log_bytes", b.log_bytes.bytes()),
            ("node.budgets.log_lines", u64::from(b.log_lines)),
            ("node.budgets.log_line_bytes", b.log_line_bytes.bytes()),
        ] {
            if value == 0 {
                errors.add(
                    key,
                    "is 0; accepted: a positive size or count (or remove it for the default)",
                );
            }
        }
        if b.error_bytes.bytes() < 128 {
            errors.add(
                "node.budgets.error_bytes",
                format!(
                    "{} is too small to keep a first line and the cut marker; accepted: 128B or more",
                    b.error_bytes
                ),
            );
        }
        if let Some(n) = self.node.instance_pool
            && !(1..=defaults::INSTANCE_POOL_MAX).contains(&n)
        {
            errors.add(
                "node.instance_pool",
                format!("{n} is out of range; accepted: 1 to {}", defaults::INSTANCE_POOL_MAX),
            );
        }
        let n = &self.node;
        for (key, d) in [
            ("node.admin_header_timeout", n.admin_header_timeout),
            ("node.admin_body_timeout", n.admin_body_timeout),
            ("node.admin_idle_timeout", n.admin_idle_timeout),
        ] {
            if d.is_zero() {
                errors.add(key, "is 0s; accepted: a positive duration such as \"10s\"");
            }
        }
        for (key, v) in [
            ("node.admin_max_connections", n.admin_max_connections),
            ("node.admin_max_uploads", n.admin_max_uploads),
            ("node.admin_max_uploads_per_caller", n.admin_max_uploads_per_caller),
        ] {
            if v == 0 {
                errors.add(key, "is 0; accepted: 1 or more");
            }
        }
        let t = &self.transport;
        let kind = t.kind.as_str();
        match (t.kind, t.url.as_deref().map(str::trim)) {
            (TransportKind::Rabbitmq, None | Some("")) => errors.add(
                "transport.url",
                "is required for kind = \"rabbitmq\", e.g. url = \"amqp://guest:guest@127.0.0.1:5672/%2f\"",
            ),
            (TransportKind::Rabbitmq, Some(url)) if !(url.starts_with("amqp://") || url.starts_with("amqps://")) => {
                errors.add(
                    "transport.url",
                    format!("{url:?} is not an AMQP URL; accepted: amqp://… or amqps://…"),
                )
            }
            (TransportKind::Nats, None | Some("")) => errors.add(
                "transport.url",
                "is required for kind = \"nats\", e.g. url = \"nats://127.0.0.1:4222\"",
            ),
            (TransportKind::Memory, Some(_)) => warnings.push(Violation {
                key: "transport.url".into(),
                message: "is ignored by kind = \"memory\"".into(),
            }),
            _ => {}
        }
        if t.prefetch == 0 {
            errors.add(
                "transport.prefetch",
                "is 0, which would deliver nothing; accepted: 1 or more",
            );
        }

        let c = &self.cluster;
        let mode = match c.mode {
            ClusterMode::Solo => "solo",
            ClusterMode::Static => "static",
            ClusterMode::Postgres => "postgres",
            ClusterMode::RabbitmqSac => "rabbitmq-sac",
        };
        match (c.mode, &c.owned_slots) {
            (ClusterMode::Static, None) => errors.add(
                "cluster.owned_slots",
                "is required in static mode: the slots this node consumes, e.g. owned_slots = [0, 1]",
            ),
            (ClusterMode::Static, Some(slots)) => {
                if slots.is_empty() {
                    errors.add(
                        "cluster.owned_slots",
                        "is empty; a static node must own at least one slot, e.g. [0]",
                    );
                }
                let mut seen = HashSet::new();
                for (j, slot) in slots.iter().enumerate() {
                    if !seen.insert(slot) {
                        errors.add(
                            format!("cluster.owned_slots[{j}]"),
                            format!("slot {slot} is listed twice"),
                        );
                    }
                    for t in &self.topology {
                        if *slot >= t.slots {
                            errors.add(
                                format!("cluster.owned_slots[{j}]"),
                                format!(
                                    "slot {slot} does not exist in topology {:?}, which has {} slots; \
                                     accepted: 0 to {}",
                                    t.name,
                                    t.slots,
                                    t.slots.saturating_sub(1)
                                ),
                            );
                        }
                    }
                }
            }
            (_, Some(_)) => errors.add(
                "cluster.owned_slots",
                format!("is only read in static mode, not in mode = {mode:?}; remove it or set mode = \"static\""),
            ),
            _ => {}
        }
        match (c.mode, c.database_url.as_deref().map(str::trim)) {
            (ClusterMode::Postgres, None | Some("")) => errors.add(
                "cluster.database_url",
                "is required in postgres mode, e.g. database_url = \"postgres://postgres@127.0.0.1/weir\"",
            ),
            (ClusterMode::Postgres, _) | (_, None) => {}
            (_, Some(_)) => errors.add(
                "cluster.database_url",
                format!("is only read in postgres mode, not in mode = {mode:?}; remove it or set mode = \"postgres\""),
            ),
        }
        if c.mode == ClusterMode::RabbitmqSac && t.kind != TransportKind::Rabbitmq {
            errors.add(
                "cluster.mode",
                format!("\"rabbitmq-sac\" needs transport.kind = \"rabbitmq\", not {kind:?}; accepted with {kind:?}: solo, static or postgres"),
            );
        }
        if c.lease.is_zero() {
            errors.add("cluster.lease", "is 0s; accepted: a positive duration such as \"5s\"");
        }
        if c.drain_deadline() < c.lease {
            errors.add(
                "cluster.drain_deadline",
                format!(
                    "is {:?}, shorter than cluster.lease ({:?}): a crashed node keeps its slots for a lease, a stopping one should not get less; accepted: a duration of at least {:?}",
                    c.drain_deadline(), c.lease, c.lease
                ),
            );
        }
    }

    fn validate_topologies(&self, errors: &mut Issues, warnings: &mut Vec<Violation>) {
        let mut names: HashMap<&str, usize> = HashMap::new();
        for (i, t) in self.topology.iter().enumerate() {
            let key = format!("topology[{i}]");
            if !is_broker_name(&t.name) {
                errors.add(
                    format!("{key}.name"),
                    format!("{:?} cannot name broker objects; accepted: lowercase letters, digits, '_' and '-' ([a-z0-9_-]+)", t.name),
                );
            }
            if let Some(first) = names.insert(&t.name, i) {
                errors.add(
                    format!("{key}.name"),
                    format!(
                        "{:?} is already the name of topology[{first}]; topology names are unique",
                        t.name
                    ),
                );
            }
            if t.slots == 0 {
                errors.add(format!("{key}.slots"), "is 0; accepted: 1 or more");
            }
            if t.max_concurrent_groups == 0 {
                errors.add(
                    format!("{key}.max_concurrent_groups"),
                    "is 0, which would run nothing; accepted: 1 or more",
                );
            }
            if t.max_unordered == 0 {
                errors.add(
                    format!("{key}.max_unordered"),
                    "is 0, which would never run messages without a group id; accepted: 1 or more",
                );
            }
            let report = t
                .schedule(self.transport.kind, None)
                .check(&CheckContext::new(Self::retry_key(i)));
            errors.0.extend(report.errors);
            warnings.extend(report.warnings);
        }
    }

    /// The `[[tenant]]` named `name`.
    pub fn tenant(&self, name: &str) -> Option<&Tenant> {
        self.tenant.iter().find(|t| t.name == name)
    }

    fn validate_tenants(&self, errors: &mut Issues) {
        let mut names: HashMap<&str, usize> = HashMap::new();
        let mut tokens: HashMap<&str, String> = HashMap::new();
        if let Some(t) = &self.node.admin_token {
            if t.trim().is_empty() {
                errors.add(
                    "node.admin_token",
                    "is empty; accepted: a secret of at least 16 characters",
                );
            }
            tokens.insert(t.as_str(), "node.admin_token".into());
        }
        for (i, t) in self.tenant.iter().enumerate() {
            let key = format!("tenant[{i}]");
            if t.name.trim().is_empty() {
                errors.add(
                    format!("{key}.name"),
                    "is empty; accepted: the tenant id its messages carry",
                );
            }
            if let Some(first) = names.insert(&t.name, i) {
                errors.add(
                    format!("{key}.name"),
                    format!(
                        "{:?} is already the name of tenant[{first}]; tenant names are unique",
                        t.name
                    ),
                );
            }
            if let Some(token) = &t.token {
                if token.trim().is_empty() {
                    errors.add(
                        format!("{key}.token"),
                        "is empty; accepted: a secret of at least 16 characters",
                    );
                } else if let Some(other) = tokens.insert(token.as_str(), format!("{key}.token")) {
                    errors.add(
                        format!("{key}.token"),
                        format!("is the same as {other}; every token must be different"),
                    );
                }
            }
            if t.limits.concurrency == Some(0) {
                errors.add(
                    format!("{key}.limits.concurrency"),
                    "is 0; accepted: 1 or more calls at once",
                );
            }
            if t.limits.fuel == Some(0) {
                errors.add(
                    format!("{key}.limits.fuel"),
                    "is 0; accepted: a positive amount, or remove it",
                );
            }
            self.validate_tenant_budgets(&key, &t.budgets, errors);
        }
        for (i, h) in self.handler.iter().enumerate() {
            if h.limits.fuel == Some(0) {
                errors.add(
                    format!("handler[{i}].limits.fuel"),
                    "is 0; accepted: a positive amount, or remove it",
                );
            }
            let Some(tenant) = h.tenant.as_deref().and_then(|n| self.tenant(n)) else {
                continue;
            };
            for (k, message) in tenant.check_handler_limits(&h.limits) {
                errors.add(format!("handler[{i}].limits.{k}"), message);
            }
            let preopens: Vec<(String, PathBuf, bool)> = h
                .wasi
                .preopens
                .iter()
                .map(|p| (p.guest.clone(), p.host.clone(), p.read_only))
                .collect();
            for (k, message) in tenant.check_grants(&h.wasi.env, &preopens) {
                errors.add(format!("handler[{i}].wasi.{k}"), message);
            }
            if h.wasi.network {
                errors.add(
                    format!("handler[{i}].wasi.network"),
                    format!("tenant {:?} handlers may not open sockets; remove it", tenant.name),
                );
            }
        }
    }

    /// `tenant[i].budgets`: positive, an error budget that holds its marker, and per call
    /// not above the node's unless `above_node`.
    fn validate_tenant_budgets(&self, key: &str, t: &TenantBudgets, errors: &mut Issues) {
        let node = &self.node.budgets;
        let sizes = [
            ("cascade_bytes", t.cascade_bytes, node.cascade_bytes),
            ("log_bytes", t.log_bytes, node.log_bytes),
            ("log_line_bytes", t.log_line_bytes, node.log_line_bytes),
            ("error_bytes", t.error_bytes, node.error_bytes),
        ];
        for (name, value, at_node) in sizes {
            let Some(value) = value else { continue };
            let k = format!("{key}.budgets.{name}");
            if value.bytes() == 0 {
                errors.add(k, "is 0; accepted: a positive size (or remove it for the node's)");
            } else if name == "error_bytes" && value.bytes() < 128 {
                errors.add(
                    k,
                    format!("{value} is too small to keep a first line and the cut marker; accepted: 128B or more"),
                );
            } else if value > at_node && !t.above_node {
                errors.add(
                    k,
                    format!(
                        "{value} is above node.budgets.{name} ({at_node}); accepted: at most that, \
                         or set {key}.budgets.above_node = true"
                    ),
                );
            }
        }
        if let Some(lines) = t.log_lines {
            let k = format!("{key}.budgets.log_lines");
            if lines == 0 {
                errors.add(k, "is 0; accepted: a positive count (or remove it for the node's)");
            } else if lines > node.log_lines && !t.above_node {
                errors.add(
                    k,
                    format!(
                        "{lines} is above node.budgets.log_lines ({}); accepted: at most that, \
                         or set {key}.budgets.above_node = true",
                        node.log_lines
                    ),
                );
            }
        }
        if t.log_bytes_per_second.is_some_and(|b| b.bytes() == 0) {
            errors.add(
                format!("{key}.budgets.log_bytes_per_second"),
                "is 0; accepted: a positive size (or remove it for no limit over time)",
            );
        }
        if t.log_lines_per_second == Some(0) {
            errors.add(
                format!("{key}.budgets.log_lines_per_second"),
                "is 0; accepted: a positive count (or remove it for no limit over time)",
            );
        }
    }

    fn validate_handlers(&self, errors: &mut Issues) {
        let mut names: HashMap<&str, usize> = HashMap::new();
        // (topology, tenant, message type) → (handler index, key)
        let mut bound: HashMap<(&str, Option<&str>, &str), (usize, String)> = HashMap::new();
        for (i, h) in self.handler.iter().enumerate() {
            let key = format!("handler[{i}]");
            if !is_handler_name(&h.name) {
                errors.add(
                    format!("{key}.name"),
                    format!(
                        "{:?} is not a handler name; accepted: letters, digits, '_', '-' and '.'",
                        h.name
                    ),
                );
            }
            if let Some(first) = names.insert(&h.name, i) {
                errors.add(
                    format!("{key}.name"),
                    format!(
                        "{:?} is already the name of handler[{first}]; handler names are unique",
                        h.name
                    ),
                );
            }
            if h.component.as_os_str().is_empty() {
                errors.add(
                    format!("{key}.component"),
                    "is empty; accepted: the path of a .wasm component",
                );
            }
            if self.topology(&h.topology).is_none() {
                let known: Vec<&str> = self.topology.iter().map(|t| t.name.as_str()).collect();
                errors.add(
                    format!("{key}.topology"),
                    format!(
                        "{:?} is not a [[topology]] name; accepted: one of {known:?}",
                        h.topology
                    ),
                );
            }
            if let Some(tenant) = &h.tenant
                && tenant.trim().is_empty()
            {
                errors.add(
                    format!("{key}.tenant"),
                    "is empty; remove it to bind every tenant, or name one",
                );
            }
            let batch_types = h.batch.as_ref().map_or(&[][..], |b| b.message_types.as_slice());
            if h.message_types.is_empty() && batch_types.is_empty() {
                errors.add(
                    format!("{key}.message_types"),
                    "is empty and there is no batch.message_types: the handler would receive nothing; \
                     accepted: at least one message type, e.g. [\"order.placed\"]",
                );
            }
            let lists = [
                ("message_types", h.message_types.as_slice()),
                ("batch.message_types", batch_types),
            ];
            for (field, types) in lists {
                for (k, ty) in types.iter().enumerate() {
                    let type_key = format!("{key}.{field}[{k}]");
                    if ty.trim().is_empty() {
                        errors.add(type_key, "is empty; accepted: a message type such as \"order.placed\"");
                        continue;
                    }
                    let slot = (h.topology.as_str(), h.tenant.as_deref(), ty.as_str());
                    if let Some((other, other_key)) = bound.get(&slot) {
                        let tenant = h
                            .tenant
                            .as_deref()
                            .map_or("any tenant".to_string(), |t| format!("tenant {t:?}"));
                        errors.add(
                            type_key,
                            format!(
                                "{ty:?} in topology {:?} for {tenant} is already bound by {other_key} (handler[{other}]); \
                                 each (topology, tenant, message type) goes to one handler: remove one binding \
                                 or set a different tenant",
                                h.topology
                            ),
                        );
                    } else {
                        bound.insert(slot, (i, type_key));
                    }
                }
            }
            if let Some(b) = &h.batch {
                if b.message_types.is_empty() {
                    errors.add(
                        format!("{key}.batch.message_types"),
                        "is empty; accepted: the message types to batch, or remove batch",
                    );
                }
                if b.size == 0 {
                    errors.add(format!("{key}.batch.size"), "is 0; accepted: 1 or more");
                }
            }
            let l = &h.limits;
            if l.memory.0 == 0 {
                errors.add(
                    format!("{key}.limits.memory"),
                    "is 0; accepted: a size such as \"64MiB\"",
                );
            }
            if l.timeout.is_zero() {
                errors.add(
                    format!("{key}.limits.timeout"),
                    "is 0s; accepted: a positive duration such as \"5s\"",
                );
            }
            if l.instances == 0 {
                errors.add(
                    format!("{key}.limits.instances"),
                    "is 0, which would run nothing; accepted: 1 or more",
                );
            }
            if let Some(stack) = l.max_stack
                && stack.0 == 0
            {
                errors.add(
                    format!("{key}.limits.max_stack"),
                    "is 0; accepted: a size such as \"512KiB\", or remove it",
                );
            }
            for (k, name) in h.wasi.env.iter().enumerate() {
                if name.is_empty() || name.contains('=') || name.contains('\0') {
                    errors.add(
                        format!("{key}.wasi.env[{k}]"),
                        format!("{name:?} is not an environment variable name; accepted: a name such as \"RUST_LOG\" (no '=')"),
                    );
                }
            }
            for (k, p) in h.wasi.preopens.iter().enumerate() {
                if p.host.as_os_str().is_empty() {
                    errors.add(
                        format!("{key}.wasi.preopens[{k}].host"),
                        "is empty; accepted: a host directory",
                    );
                }
                if p.guest.trim().is_empty() {
                    errors.add(
                        format!("{key}.wasi.preopens[{k}].guest"),
                        "is empty; accepted: a guest path such as \"/data\"",
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::schedule::Origin;

    const DESIGN_EXAMPLE: &str = include_str!("../tests/config/design-example.toml");

    fn invalid(text: &str) -> Vec<Violation> {
        match parse(text, "weir.toml") {
            Err(ConfigError::Invalid { origin, issues }) => {
                assert_eq!(origin, "weir.toml");
                issues
            }
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    /// Asserts that validation fails with exactly one issue at `key`, whose message contains
    /// `needle`, and that the rendered error names the file and the key.
    fn assert_one(text: &str, key: &str, needle: &str) {
        let issues = invalid(text);
        assert_eq!(issues.len(), 1, "{issues:#?}");
        assert_eq!(issues[0].key, key, "{issues:#?}");
        assert!(
            issues[0].message.contains(needle),
            "{:?} lacks {needle:?}",
            issues[0].message
        );
        let rendered = parse(text, "weir.toml").map(|_| ()).unwrap_err().to_string();
        assert!(rendered.starts_with("weir.toml: "), "{rendered}");
        assert!(rendered.contains(key), "{rendered}");
    }

    fn syntax(text: &str) -> String {
        match parse(text, "conf/weir.toml") {
            Err(e @ ConfigError::Syntax { .. }) => e.to_string(),
            other => panic!("expected Syntax, got {other:?}"),
        }
    }

    /// A minimal valid config, with room to add lines.
    fn base(extra: &str) -> String {
        format!(
            "[[topology]]\nname = \"orders\"\nslots = 4\n\n[[handler]]\nname = \"h\"\n\
             component = \"h.wasm\"\ntopology = \"orders\"\nmessage_types = [\"a\"]\n{extra}"
        )
    }

    #[test]
    fn node_budgets_and_instance_pool_parse_default_and_name_their_keys() {
        let c = parse(&base(""), "weir.toml").unwrap();
        assert_eq!(c.node.budgets, Budgets::default());
        assert_eq!(c.node.budgets.to_runtime(), crate::runtime::CallBudgets::default());
        assert_eq!(c.node.instance_pool, None);
        let text = format!(
            "[node]\ninstance_pool = 1024\n[node.budgets]\ncascade_bytes = \"1MiB\"\nlog_lines = 10\n{}",
            base("")
        );
        let c = parse(&text, "weir.toml").unwrap();
        assert_eq!(c.node.budgets.cascade_bytes, ByteSize(1 << 20));
        assert_eq!(c.node.budgets.log_lines, 10);
        assert_eq!(
            c.node.budgets.log_bytes,
            defaults::LOG_BYTES,
            "the others keep their defaults"
        );
        assert_eq!(c.node.instance_pool, Some(1024));
        assert_one(
            &format!("[node.budgets]\nlog_lines = 0\n{}", base("")),
            "node.budgets.log_lines",
            "positive",
        );
        assert_one(
            &format!("[node.budgets]\nerror_bytes = 10\n{}", base("")),
            "node.budgets.error_bytes",
            "128B or more",
        );
        assert_one(
            &format!("[node]\ninstance_pool = 100000\n{}", base("")),
            "node.instance_pool",
            "1 to 4096",
        );
        let err = parse(&format!("[node.budgets]\nlog_lnes = 1\n{}", base("")), "weir.toml").unwrap_err();
        assert!(err.to_string().contains("log_lnes"), "{err}");
    }

    #[test]
    fn tenant_budgets_default_to_the_nodes_and_name_their_keys() {
        let tenant = |budgets: &str| {
            format!(
                "[node.budgets]\nlog_lines = 100\n{}[[tenant]]\nname = \"acme\"\n{budgets}\n",
                base("")
            )
        };
        let c = parse(&tenant(""), "weir.toml").unwrap();
        assert_eq!(
            c.call_budgets(c.tenant("acme")),
            None,
            "no budgets of its own: the node's"
        );
        let c = parse(
            &tenant("budgets = { log_lines = 10, error_bytes = \"1KiB\", log_bytes_per_second = \"1MiB\" }"),
            "weir.toml",
        )
        .unwrap();
        let b = c.call_budgets(c.tenant("acme")).unwrap();
        assert_eq!((b.log_lines, b.error_bytes), (10, 1024));
        let node = c.node.budgets.to_runtime();
        assert_eq!(
            (b.log_bytes, b.cascade_bytes),
            (node.log_bytes, node.cascade_bytes),
            "the rest: the node's"
        );
        assert_eq!(c.tenant[0].budgets.log_bytes_per_second, Some(ByteSize(1 << 20)));
        assert_one(
            &tenant("budgets = { log_lines = 101 }"),
            "tenant[0].budgets.log_lines",
            "above node.budgets.log_lines",
        );
        assert_one(
            &tenant("budgets = { cascade_bytes = \"1GiB\" }"),
            "tenant[0].budgets.cascade_bytes",
            "above_node = true",
        );
        assert!(parse(&tenant("budgets = { log_lines = 101, above_node = true }"), "weir.toml").is_ok());
        assert_one(
            &tenant("budgets = { log_bytes = 0 }"),
            "tenant[0].budgets.log_bytes",
            "is 0",
        );
        assert_one(
            &tenant("budgets = { error_bytes = 10 }"),
            "tenant[0].budgets.error_bytes",
            "128B or more",
        );
        assert_one(
            &tenant("budgets = { log_lines_per_second = 0 }"),
            "tenant[0].budgets.log_lines_per_second",
            "is 0",
        );
        let err = parse(&tenant("budgets = { log_lnes = 1 }"), "weir.toml").unwrap_err();
        assert!(err.to_string().contains("log_lnes"), "{err}");
    }

    #[test]
    fn tenant_handlers_stay_within_their_tenant() {
        let tenant = "[[tenant]]\nname = \"acme\"\nlimits = { memory = \"32MiB\", timeout = \"2s\", fuel = 1000 }\n\
                      allow = { env = [\"REGION\"], dirs = [\"/srv/acme\"] }\n";
        let handler = |extra: &str| {
            format!(
                "[[topology]]\nname = \"orders\"\nslots = 4\n{tenant}\n[[handler]]\nname = \"h\"\n\
                 component = \"h.wasm\"\ntopology = \"orders\"\ntenant = \"acme\"\nmessage_types = [\"a\"]\n{extra}"
            )
        };
        // Defaults above the tenant's limits are lowered, not refused.
        parse(&handler(""), "weir.toml").expect("defaults are capped");
        assert_one(
            &handler("limits = { memory = \"48MiB\" }"),
            "handler[0].limits.memory",
            "tenant \"acme\"'s limit",
        );
        assert_one(
            &handler("limits = { timeout = \"3s\" }"),
            "handler[0].limits.timeout",
            "at most that",
        );
        assert_one(
            &handler("limits = { fuel = 2000 }"),
            "handler[0].limits.fuel",
            "above tenant",
        );
        assert_one(
            &handler("wasi = { env = [\"HOME\"] }"),
            "handler[0].wasi.env[0]",
            "\"HOME\" is not allowed",
        );
        assert_one(
            &handler("wasi = { preopens = [{ host = \"/etc\", guest = \"/etc\" }] }"),
            "handler[0].wasi.preopens[0].host",
            "not within",
        );
        assert_one(
            &handler("wasi = { preopens = [{ host = \"/srv/acme/../../etc\", guest = \"/x\" }] }"),
            "handler[0].wasi.preopens[0].host",
            "not within",
        );
        assert_one(
            &handler("wasi = { preopens = [{ host = \"/srv/acme/data\", guest = \"/d\", read_only = false }] }"),
            "handler[0].wasi.preopens[0].read_only",
            "read-only",
        );
        assert_one(
            &handler("wasi = { network = true }"),
            "handler[0].wasi.network",
            "sockets",
        );
        parse(
            &handler("wasi = { env = [\"REGION\"], preopens = [{ host = \"/srv/acme/data\", guest = \"/d\" }] }"),
            "weir.toml",
        )
        .expect("grants within the allowance");
    }

    #[test]
    fn tokens_are_unique_and_tenants_named_once() {
        let issues = invalid(&base(
            "[node]\nadmin_token = \"same-secret-0123456789\"\n[[tenant]]\nname = \"a\"\ntoken = \"same-secret-0123456789\"\n\
             [[tenant]]\nname = \"a\"\nlimits = { concurrency = 0 }\n",
        ));
        let keys: Vec<&str> = issues.iter().map(|v| v.key.as_str()).collect();
        assert_eq!(
            keys,
            ["tenant[0].token", "tenant[1].name", "tenant[1].limits.concurrency"],
            "{issues:#?}"
        );
    }

    #[test]
    fn within_compares_whole_components() {
        assert!(is_within(Path::new("/srv/acme/data"), Path::new("/srv/acme")));
        assert!(is_within(Path::new("/srv/acme"), Path::new("/srv/acme")));
        assert!(is_within(Path::new("/srv/./acme/x"), Path::new("/srv/acme")));
        assert!(!is_within(Path::new("/srv/acme-evil"), Path::new("/srv/acme")));
        assert!(!is_within(Path::new("/srv/acme/../x"), Path::new("/srv/acme")));
        assert!(!is_within(Path::new("/srv"), Path::new("/srv/acme")));
    }

    #[test]
    fn design_example_parses() {
        let c = parse(DESIGN_EXAMPLE, "design-example.toml").expect("the DESIGN.md config parses");
        assert_eq!(c.node.name, "node-a");
        assert_eq!(c.node.admin, Some("127.0.0.1:9464".parse().expect("addr")));
        assert_eq!(c.transport.kind, TransportKind::Rabbitmq);
        assert_eq!(c.transport.prefetch, 256);
        assert_eq!(c.cluster.mode, ClusterMode::Postgres);
        assert_eq!(c.cluster.lease, Duration::from_secs(5));
        assert_eq!(c.topology.len(), 1);
        let t = &c.topology[0];
        assert_eq!(
            (t.name.as_str(), t.slots, t.max_concurrent_groups, t.max_unordered),
            ("orders", 6, 64, 16)
        );
        let p = t.retry_policy(TransportKind::Rabbitmq);
        assert_eq!(p.ladder, [1, 5, 30].map(Duration::from_secs));
        assert_eq!(p.max_deliver, 5);
        assert_eq!(p.max_time_to_dead_letter, Some(Duration::from_secs(600)));
        assert_eq!(p.origin, Origin::Configured);
        let h = &c.handler[0];
        assert_eq!(h.component, PathBuf::from("examples/rust/orders/orders.wasm"));
        assert_eq!(h.message_types, ["order.placed", "order.paid"]);
        assert_eq!(h.tenant.as_deref(), Some("acme"));
        let b = h.batch.as_ref().expect("batch");
        assert_eq!(
            (b.message_types.as_slice(), b.size, b.linger),
            (&["order.line-added".to_string()][..], 100, Duration::from_millis(20))
        );
        assert_eq!(h.limits.memory, ByteSize(64 << 20));
        assert_eq!(h.limits.timeout, Duration::from_secs(5));
        assert_eq!(h.limits.instances, 16);
        assert_eq!(h.config.get("currency").map(String::as_str), Some("EUR"));
        assert_eq!(h.instance_mode, InstanceMode::Reuse);
        assert_eq!(h.wasi, Wasi::default());
        assert_eq!(c.validate().expect("valid"), Vec::<Violation>::new());
    }

    #[test]
    fn an_empty_file_is_a_memory_solo_node() {
        let c = parse("", "<inline>").expect("empty config");
        assert_eq!(c.transport.kind, TransportKind::Memory);
        assert_eq!(c.cluster.mode, ClusterMode::Solo);
        assert!(!c.node.name.is_empty());
        assert!(
            c.node.name.ends_with(&format!("-{}", std::process::id())),
            "{}",
            c.node.name
        );
    }

    #[test]
    fn defaults_fill_every_omitted_key() {
        let c = parse(&base(""), "<inline>").expect("valid");
        let t = &c.topology[0];
        assert_eq!(t.max_concurrent_groups, defaults::MAX_CONCURRENT_GROUPS);
        assert_eq!(t.max_unordered, defaults::MAX_UNORDERED);
        assert_eq!(t.retry_policy(TransportKind::Rabbitmq), RetryPolicy::default());
        let h = &c.handler[0];
        assert_eq!(h.limits.memory, defaults::MEMORY);
        assert_eq!(h.limits.max_stack, None);
        assert_eq!(h.instance_mode, InstanceMode::Reuse);
        assert!(!h.wasi.inherit_stdio && !h.wasi.network && h.wasi.env.is_empty() && h.wasi.preopens.is_empty());
        assert_eq!(c.transport.prefetch, defaults::PREFETCH);
        // a partial retry section keeps the other defaults but counts as configured
        let c = parse(
            &base("").replace("slots = 4\n", "slots = 4\n[topology.retry]\nmax_deliver = 9\n"),
            "<inline>",
        )
        .expect("valid");
        let p = c.topology[0].retry_policy(c.transport.kind);
        assert_eq!((p.ladder.len(), p.max_deliver, p.origin), (3, 9, Origin::Configured));
    }

    #[test]
    fn handler_fields_beyond_the_example_parse() {
        let c = parse(
            &base(
                "instance_mode = \"fresh\"\nlimits = { memory = \"512KiB\", max_stack = 1048576, timeout = \"250ms\" }\n\
                 wasi = { env = [\"RUST_LOG\"], inherit_stdio = true, network = true, \
                 preopens = [{ host = \"data\", guest = \"/data\" }, { host = \"/tmp\", guest = \"/tmp\", read_only = false }] }\n",
            ),
            "/etc/weir/weir.toml",
        )
        .expect("valid");
        let h = &c.handler[0];
        assert_eq!(h.instance_mode, InstanceMode::Fresh);
        assert_eq!(h.limits.memory, ByteSize(512 * 1024));
        assert_eq!(h.limits.max_stack, Some(ByteSize(1 << 20)));
        assert_eq!(h.limits.timeout, Duration::from_millis(250));
        assert_eq!(h.wasi.env, ["RUST_LOG"]);
        assert!(h.wasi.inherit_stdio && h.wasi.network);
        assert_eq!(h.wasi.preopens[0].host, PathBuf::from("/etc/weir/data"));
        assert!(h.wasi.preopens[0].read_only);
        assert_eq!(h.wasi.preopens[1].host, PathBuf::from("/tmp"));
        assert!(!h.wasi.preopens[1].read_only);
        // component paths are resolved against the config file's directory
        assert_eq!(h.component, PathBuf::from("/etc/weir/h.wasm"));
    }

    #[test]
    fn load_reads_a_file_and_names_it_in_errors() {
        let dir = std::env::temp_dir().join(format!("weir-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tempdir");
        let path = dir.join("weir.toml");
        std::fs::write(&path, base("")).expect("write");
        let c = load(&path).expect("loads");
        assert_eq!(c.handler[0].component, dir.join("h.wasm"));
        assert_eq!(c.origin, path.display().to_string());
        let missing = dir.join("missing.toml");
        let err = load(&missing).expect_err("missing file").to_string();
        assert!(err.contains("missing.toml") && err.contains("cannot read"), "{err}");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn byte_sizes() {
        for (text, bytes) in [
            ("64MiB", 64u64 << 20),
            ("512KiB", 512 << 10),
            ("1GiB", 1 << 30),
            ("1 GiB", 1 << 30),
            ("4096", 4096),
            ("7B", 7),
            ("2TiB", 2 << 40),
        ] {
            assert_eq!(ByteSize::parse(text), Ok(ByteSize(bytes)), "{text}");
        }
        for bad in ["", "MiB", "64MB", "64 mib", "-1", "1.5GiB", "99999999999999TiB"] {
            assert!(ByteSize::parse(bad).is_err(), "{bad}");
        }
        assert!(ByteSize::parse("64MB").unwrap_err().contains("KiB, MiB"));
        assert_eq!(ByteSize(64 << 20).to_string(), "64MiB");
        assert_eq!(ByteSize(1000).to_string(), "1000B");
    }

    // ---- syntax-level errors: the toml crate's line/column, prefixed with the file ----

    #[test]
    fn unknown_key_is_named_with_its_line_and_table() {
        let e = syntax(&base("colour = \"blue\"\n"));
        assert!(e.starts_with("conf/weir.toml: in handler[0]: "), "{e}");
        assert!(e.contains("colour") && e.contains("line 10"), "{e}");
        let e = syntax("[node]\nnmae = \"x\"\n");
        assert!(
            e.contains("in node:") && e.contains("nmae") && e.contains("`admin`"),
            "{e}"
        );
        let e = syntax("[[topology]]\nname = \"a\"\nslots = 1\n[topology.retry]\nladdder = []\n");
        assert!(e.contains("in topology[0].retry:") && e.contains("laddder"), "{e}");
    }

    #[test]
    fn bad_size_names_the_value_and_accepted_units() {
        let text = base("").replace("[[handler]]", "[[handler]]\nname = \"x\"\ncomponent = \"x\"\ntopology = \"orders\"\nmessage_types = [\"b\"]\n\n[[handler]]") + "limits = { memory = \"64 megs\" }\n";
        let e = syntax(&text);
        assert!(e.contains("in handler[1]:"), "{e}");
        assert!(
            e.contains("\"64 megs\"") && e.contains("MiB") && e.contains("memory"),
            "{e}"
        );
    }

    #[test]
    fn bad_duration_names_the_value() {
        let e = syntax("[cluster]\nlease = \"5 parsecs\"\n");
        assert!(
            e.contains("in cluster:") && e.contains("5 parsecs") && e.contains("\"5s\""),
            "{e}"
        );
        let e = syntax("[[topology]]\nname = \"a\"\nslots = 1\nretry = { ladder = [\"1s\", \"soon\"] }\n");
        assert!(e.contains("ladder[1]") && e.contains("soon"), "{e}");
    }

    #[test]
    fn unknown_enum_values_list_the_accepted_ones() {
        let e = syntax("[transport]\nkind = \"kafka\"\n");
        assert!(
            e.contains("kafka") && e.contains("memory") && e.contains("rabbitmq") && e.contains("nats"),
            "{e}"
        );
        let e = syntax("[cluster]\nmode = \"raft\"\n");
        assert!(e.contains("rabbitmq-sac") && e.contains("postgres"), "{e}");
        let e = syntax(&base("instance_mode = \"pooled\"\n"));
        assert!(e.contains("reuse") && e.contains("fresh"), "{e}");
    }

    #[test]
    fn non_string_handler_config_value_names_the_key() {
        let e = syntax(&base("config = { currency = \"EUR\", retries = 3 }\n"));
        assert!(e.contains("config.retries") && e.contains("retries = \"3\""), "{e}");
        assert!(e.contains("in handler[0]"), "{e}");
    }

    #[test]
    fn invalid_toml_keeps_line_and_column() {
        let e = syntax("[node\nname = 1\n");
        assert!(e.starts_with("conf/weir.toml: ") && e.contains("line 1"), "{e}");
    }

    // ---- validation errors: each names its key ----

    #[test]
    fn zero_slots() {
        assert_one(
            &base("").replace("slots = 4", "slots = 0"),
            "topology[0].slots",
            "accepted: 1 or more",
        );
    }

    #[test]
    fn topology_name_not_fit_for_broker_objects() {
        let text = base("").replace("\"orders\"", "\"Orders.EU\"");
        assert_one(&text, "topology[0].name", "[a-z0-9_-]+");
    }

    #[test]
    fn duplicate_topology_name() {
        let text = format!("[[topology]]\nname = \"orders\"\nslots = 1\n{}", base(""));
        let issues = invalid(&text);
        assert_eq!(issues.len(), 1, "{issues:#?}");
        assert_eq!(issues[0].key, "topology[1].name");
        assert!(issues[0].message.contains("topology[0]"));
    }

    #[test]
    fn zero_concurrency() {
        assert_one(
            &base("").replace("slots = 4", "slots = 4\nmax_concurrent_groups = 0"),
            "topology[0].max_concurrent_groups",
            "1 or more",
        );
        assert_one(
            &base("").replace("slots = 4", "slots = 4\nmax_unordered = 0"),
            "topology[0].max_unordered",
            "1 or more",
        );
    }

    #[test]
    fn duplicate_handler_name() {
        let text = base("")
            + "\n[[handler]]\nname = \"h\"\ncomponent = \"h2.wasm\"\ntopology = \"orders\"\nmessage_types = [\"b\"]\n";
        assert_one(&text, "handler[1].name", "handler[0]");
    }

    #[test]
    fn bad_handler_name() {
        assert_one(
            &base("").replace("name = \"h\"", "name = \"my handler\""),
            "handler[0].name",
            "letters, digits",
        );
    }

    #[test]
    fn handler_topology_must_exist() {
        assert_one(
            &base("").replace("topology = \"orders\"", "topology = \"order\""),
            "handler[0].topology",
            "[\"orders\"]",
        );
    }

    #[test]
    fn handler_must_bind_a_message_type() {
        assert_one(
            &base("").replace("message_types = [\"a\"]", "message_types = []"),
            "handler[0].message_types",
            "at least one",
        );
        assert_one(
            &base("").replace("[\"a\"]", "[\"a\", \"\"]"),
            "handler[0].message_types[1]",
            "is empty",
        );
        // batch-only handlers are fine
        let text = base("batch = { message_types = [\"b\"] }\n").replace("message_types = [\"a\"]\n", "");
        assert!(parse(&text, "<inline>").is_ok());
    }

    #[test]
    fn a_message_type_bound_twice() {
        let second = "\n[[handler]]\nname = \"h2\"\ncomponent = \"h2.wasm\"\ntopology = \"orders\"\nmessage_types = [\"z\", \"a\"]\n";
        assert_one(
            &(base("") + second),
            "handler[1].message_types[1]",
            "already bound by handler[0].message_types[0]",
        );
        // a batch type clashing with a single type of the same handler
        assert_one(
            &base("batch = { message_types = [\"a\"] }\n"),
            "handler[0].batch.message_types[0]",
            "already bound",
        );
        // another tenant is a different binding
        assert!(parse(&(base("") + second + "tenant = \"acme\"\n"), "<inline>").is_ok());
        // the same tenant twice is not
        let text = base("tenant = \"acme\"\n") + second + "tenant = \"acme\"\n";
        assert_one(&text, "handler[1].message_types[1]", "tenant \"acme\"");
    }

    #[test]
    fn empty_tenant() {
        assert_one(&base("tenant = \"\"\n"), "handler[0].tenant", "is empty");
    }

    #[test]
    fn batch_size_zero_and_empty_batch_types() {
        assert_one(
            &base("batch = { message_types = [\"b\"], size = 0 }\n"),
            "handler[0].batch.size",
            "1 or more",
        );
        assert_one(
            &base("batch = { message_types = [] }\n"),
            "handler[0].batch.message_types",
            "is empty",
        );
    }

    #[test]
    fn zero_limits() {
        assert_one(&base("limits = { memory = 0 }\n"), "handler[0].limits.memory", "64MiB");
        assert_one(
            &base("limits = { timeout = \"0s\" }\n"),
            "handler[0].limits.timeout",
            "positive",
        );
        assert_one(
            &base("limits = { instances = 0 }\n"),
            "handler[0].limits.instances",
            "1 or more",
        );
        assert_one(
            &base("limits = { max_stack = \"0KiB\" }\n"),
            "handler[0].limits.max_stack",
            "512KiB",
        );
    }

    #[test]
    fn wasi_grants_are_checked() {
        assert_one(
            &base("wasi = { env = [\"A=1\"] }\n"),
            "handler[0].wasi.env[0]",
            "no '='",
        );
        assert_one(
            &base("wasi = { preopens = [{ host = \"d\", guest = \"\" }] }\n"),
            "handler[0].wasi.preopens[0].guest",
            "/data",
        );
    }

    #[test]
    fn static_mode_needs_owned_slots_that_exist_in_every_topology() {
        assert_one(
            &base("").replace("[[topology]]", "[cluster]\nmode = \"static\"\n[[topology]]"),
            "cluster.owned_slots",
            "owned_slots = [0, 1]",
        );
        let two = "[cluster]\nmode = \"static\"\nowned_slots = [0, 3]\n[[topology]]\nname = \"small\"\nslots = 2\n";
        let issues = invalid(&(two.to_string() + &base("")));
        assert_eq!(issues.len(), 1, "{issues:#?}");
        assert_eq!(issues[0].key, "cluster.owned_slots[1]");
        assert!(
            issues[0].message.contains("\"small\"") && issues[0].message.contains("0 to 1"),
            "{}",
            issues[0]
        );
        assert_one(
            &base("").replace(
                "[[topology]]",
                "[cluster]\nmode = \"static\"\nowned_slots = [1, 1]\n[[topology]]",
            ),
            "cluster.owned_slots[1]",
            "twice",
        );
        assert_one(
            &base("").replace(
                "[[topology]]",
                "[cluster]\nmode = \"static\"\nowned_slots = []\n[[topology]]",
            ),
            "cluster.owned_slots",
            "at least one",
        );
        assert!(
            parse(
                &base("").replace(
                    "[[topology]]",
                    "[cluster]\nmode = \"static\"\nowned_slots = [0, 3]\n[[topology]]"
                ),
                "<inline>"
            )
            .is_ok()
        );
    }

    #[test]
    fn owned_slots_outside_static_mode() {
        assert_one(
            &base("").replace("[[topology]]", "[cluster]\nowned_slots = [0]\n[[topology]]"),
            "cluster.owned_slots",
            "only read in static mode",
        );
    }

    #[test]
    fn postgres_mode_needs_database_url() {
        assert_one(
            &base("").replace("[[topology]]", "[cluster]\nmode = \"postgres\"\n[[topology]]"),
            "cluster.database_url",
            "postgres://",
        );
        assert_one(
            &base("").replace(
                "[[topology]]",
                "[cluster]\ndatabase_url = \"postgres://x\"\n[[topology]]",
            ),
            "cluster.database_url",
            "only read in postgres mode",
        );
    }

    #[test]
    fn brokers_need_a_url() {
        assert_one(
            &base("").replace("[[topology]]", "[transport]\nkind = \"rabbitmq\"\n[[topology]]"),
            "transport.url",
            "amqp://",
        );
        assert_one(
            &base("").replace(
                "[[topology]]",
                "[transport]\nkind = \"rabbitmq\"\nurl = \"http://x\"\n[[topology]]",
            ),
            "transport.url",
            "amqps://",
        );
        assert_one(
            &base("").replace(
                "[[topology]]",
                "[transport]\nkind = \"nats\"\nurl = \" \"\n[[topology]]",
            ),
            "transport.url",
            "nats://",
        );
        assert!(
            parse(
                &base("").replace(
                    "[[topology]]",
                    "[transport]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:4222\"\n[[topology]]"
                ),
                "<inline>"
            )
            .is_ok()
        );
    }

    #[test]
    fn memory_url_is_only_a_warning() {
        let c = parse(
            &base("").replace("[[topology]]", "[transport]\nurl = \"x\"\n[[topology]]"),
            "<inline>",
        )
        .expect("valid");
        let w = c.validate().expect("valid");
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].key, "transport.url");
    }

    #[test]
    fn zero_prefetch_and_zero_lease() {
        assert_one(
            &base("").replace("[[topology]]", "[transport]\nprefetch = 0\n[[topology]]"),
            "transport.prefetch",
            "1 or more",
        );
        assert_one(
            &base("").replace("[[topology]]", "[cluster]\nlease = \"0s\"\n[[topology]]"),
            "cluster.lease",
            "positive",
        );
    }

    #[test]
    fn drain_deadline_at_least_the_lease() {
        assert_one(
            &base("").replace(
                "[[topology]]",
                "[cluster]\nlease = \"10s\"\ndrain_deadline = \"3s\"\n[[topology]]",
            ),
            "cluster.drain_deadline",
            "at least 10s",
        );
        let c = parse(
            &base("").replace("[[topology]]", "[cluster]\nlease = \"40s\"\n[[topology]]"),
            "weir.toml",
        )
        .unwrap();
        assert_eq!(
            c.cluster.drain_deadline(),
            Duration::from_secs(40),
            "the default grows with the lease"
        );
        let c = parse(&base(""), "weir.toml").unwrap();
        assert_eq!(c.cluster.drain_deadline(), defaults::DRAIN_DEADLINE);
    }

    #[test]
    fn rabbitmq_sac_needs_rabbitmq() {
        assert_one(
            &base("").replace("[[topology]]", "[cluster]\nmode = \"rabbitmq-sac\"\n[[topology]]"),
            "cluster.mode",
            "transport.kind = \"rabbitmq\"",
        );
    }

    #[test]
    fn empty_node_name() {
        assert_one(&format!("[node]\nname = \"\"\n{}", base("")), "node.name", "non-empty");
    }

    /// Issue 14 item 14: no ladder on JetStream means AckWait repeated, so
    /// `max_deliver = 3` alone is accepted on NATS (it was refused for the
    /// default ladder's 3 rungs); elsewhere the default ladder still applies.
    #[test]
    fn max_deliver_without_a_ladder_on_nats_waits_ack_wait() {
        let text = base("").replace("slots = 4", "slots = 4\n[topology.retry]\nmax_deliver = 3");
        let nats = text.replace(
            "[[topology]]",
            "[transport]\nkind = \"nats\"\nurl = \"nats://n\"\n[[topology]]",
        );
        let c = parse(&nats, "<inline>").unwrap_or_else(|e| panic!("accepted on nats: {e}"));
        let p = c.topology[0].retry_policy(c.transport.kind);
        assert!(p.ladder.is_empty() && p.max_deliver == 3, "{p:?}");
        let c = parse(&text.replace("max_deliver = 3", "max_deliver = 4"), "<inline>").expect("valid");
        assert_eq!(
            c.topology[0].retry_policy(c.transport.kind).ladder.len(),
            3,
            "the default ladder elsewhere"
        );
    }

    #[test]
    fn retry_ladder_longer_than_max_deliver() {
        let text = base("").replace(
            "slots = 4",
            "slots = 4\nretry = { ladder = [\"1s\", \"5s\", \"30s\"], max_deliver = 2 }",
        );
        assert_one(&text, "topology[0].retry.ladder", "at most 2 rungs");
        let equal = base("").replace(
            "slots = 4",
            "slots = 4\nretry = { ladder = [\"1s\", \"5s\"], max_deliver = 2 }",
        );
        assert!(parse(&equal, "<inline>").is_ok());
    }

    #[test]
    fn retry_zero_rung_and_time_bound() {
        let text = base("").replace("slots = 4", "slots = 4\n[topology.retry]\nladder = [\"1s\", \"0s\"]\n");
        assert_one(&text, "topology[0].retry.ladder[1]", "positive");
        let text = base("").replace(
            "slots = 4",
            "slots = 4\n[topology.retry]\nmax_time_to_dead_letter = \"1m\"\n",
        );
        assert_one(
            &text,
            "topology[0].retry.max_time_to_dead_letter",
            "max_time_to_dead_letter >= 1m 6s",
        );
        // on nats the capture reserve moves the handler's last try to 36s, inside a 1m bound
        let nats = text.replace(
            "[[topology]]",
            "[transport]\nkind = \"nats\"\nurl = \"nats://n\"\n[[topology]]",
        );
        assert!(parse(&nats, "<inline>").is_ok());
    }

    #[test]
    fn unlimited_retry_is_accepted_with_warnings() {
        let text = base("").replace(
            "slots = 4",
            "slots = 4\n[topology.retry]\nmax_deliver = 0\nmax_time_to_dead_letter = \"1s\"\n",
        );
        let c = parse(&text, "<inline>").expect("unlimited is not rejected");
        let w = c.validate().expect("valid");
        assert_eq!(
            w.iter().map(|v| v.key.as_str()).collect::<Vec<_>>(),
            ["topology[0].retry.max_time_to_dead_letter"]
        );
    }

    #[test]
    fn no_retry_section_is_never_rejected() {
        for transport in [
            "",
            "[transport]\nkind = \"nats\"\nurl = \"nats://n\"\n",
            "[transport]\nkind = \"rabbitmq\"\nurl = \"amqp://r\"\n",
        ] {
            let text = base("").replace("[[topology]]", &format!("{transport}[[topology]]"));
            let c = parse(&text, "<inline>").expect("valid");
            assert_eq!(c.validate().expect("valid"), Vec::<Violation>::new());
            assert_eq!(c.topology[0].retry_policy(c.transport.kind).origin, Origin::Default);
        }
    }

    #[test]
    fn several_problems_are_reported_together() {
        let text = base("limits = { instances = 0 }\n").replace("slots = 4", "slots = 0");
        let issues = invalid(&text);
        let keys: Vec<&str> = issues.iter().map(|v| v.key.as_str()).collect();
        assert_eq!(keys, ["topology[0].slots", "handler[0].limits.instances"]);
        let rendered = parse(&text, "weir.toml").map(|_| ()).unwrap_err().to_string();
        assert_eq!(rendered.lines().count(), 3, "{rendered}");
    }

    #[test]
    fn section_lookup_follows_arrays_of_tables() {
        let text = "[node]\nname='a'\n[[topology]]\nname='x'\n[[topology]]\n[topology.retry]\nx=1\n[[handler]]\n[[handler]]\ny=2\n";
        let at = |needle: &str| section_at(text, text.find(needle).expect("needle"));
        assert_eq!(at("name='a'").as_deref(), Some("node"));
        assert_eq!(at("name='x'").as_deref(), Some("topology[0]"));
        assert_eq!(at("x=1").as_deref(), Some("topology[1].retry"));
        assert_eq!(at("y=2").as_deref(), Some("handler[1]"));
        assert_eq!(section_at("a = 1\n", 0), None);
    }
}
