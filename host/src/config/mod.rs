//! The TOML config of one `weir` node (DESIGN.md, "Config"): its types, every default (module
//! [`defaults`], plus the retry defaults in [`crate::retry::schedule`]), parsing, and validation
//! whose errors name the file, the key and what would be accepted.
//!
//! Validation here knows only the config itself. Facts that need a broker connection (a
//! stream's `max_age`, an existing consumer's `AckWait`) are checked by the transport or
//! `weir schedule check` with the same [`Schedule::check`], through [`Topology::schedule`].
//!
//! The files: this one (the file and its `[node]`, `[transport]`, `[cluster]`, `[[topology]]`
//! sections), [`handler`] and [`tenant`] (their sections), [`units`] (sizes and durations as
//! written), [`defaults`], [`load`] (reading and parsing, the error type) and [`validate`].

pub mod defaults;
pub mod handler;
pub mod load;
pub mod tenant;
pub mod units;
pub mod validate;

#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

pub use handler::{Batch, Dedup, Handler, InstanceMode, Limits, OnFailure, Preopen, Wasi};
pub use load::{ConfigError, load, parse};
pub(crate) use tenant::is_within;
pub use tenant::{Tenant, TenantAllow, TenantBudgets, TenantLimits};
pub use units::ByteSize;
use units::{de_duration, de_duration_list, de_duration_opt};

use crate::retry::schedule::{Redelivery, RetryPolicy, Schedule};

/// `transport.queue_type`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QueueType {
    /// Classic queues (one node holds each queue): the default.
    #[default]
    Classic,
    /// Quorum queues, replicated over the cluster (RabbitMQ 3.10 or later when
    /// the topology has a retry ladder).
    Quorum,
}

impl QueueType {
    /// The name as written in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }
}

impl std::fmt::Display for QueueType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `url` with its credentials hidden, for logs and errors: the user
/// information (everything of the authority before its last `@`, so a
/// password holding an unescaped `@` stays hidden) becomes `***`. An `@` in
/// the path, query or fragment is not a credential and is left alone.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_owned();
    };
    let authority_start = scheme_end + 3;
    let authority_end = url[authority_start..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| authority_start + i);
    match url[authority_start..authority_end].rfind('@') {
        Some(at) => format!("{}***{}", &url[..authority_start], &url[authority_start + at..]),
        None => url.to_owned(),
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
    /// Traces (`[telemetry]`): where spans go, and how many. Absent: no traces.
    #[serde(default)]
    pub telemetry: Telemetry,
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
    /// Address of a listener that serves only `GET /metrics` (and `GET /health`) with no token,
    /// for a scraper that cannot present one (Kubernetes' annotations, a sidecar); absent: none.
    /// Bind it where only the scraper reaches it: it answers anyone who can connect.
    #[serde(default)]
    pub metrics: Option<SocketAddr>,
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
    /// How `weir run` writes its log lines to stderr: `"text"` (for people; colour only on a
    /// terminal, never with NO_COLOR) or `"json"` (one object a line, for collectors).
    /// `--log-format` overrides it.
    #[serde(default)]
    pub log_format: Option<LogFormat>,
    /// The level of Weir's own log lines: `"error"`, `"warn"`, `"info"` (the default),
    /// `"debug"` or `"trace"`. `--log-level` overrides it; `RUST_LOG`, when set, replaces the
    /// whole filter (per-target directives, e.g. `RUST_LOG=warn,weir::settle=debug`).
    #[serde(default)]
    pub log_level: Option<LogLevel>,
    /// How long the admin listener waits for a request's line and headers, counted from when
    /// the connection opens or its previous response is sent: an idle connection, or one whose
    /// headers trickle in, is closed after this; so is one whose client stops reading a
    /// response for this long. E.g. `"10s"`.
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
            metrics: None,
            admin_token: None,
            data_dir: None,
            components_dir: None,
            max_component_size: defaults::MAX_COMPONENT_SIZE,
            budgets: Budgets::default(),
            instance_pool: None,
            log_format: None,
            log_level: None,
            admin_header_timeout: defaults::ADMIN_HEADER_TIMEOUT,
            admin_body_timeout: defaults::ADMIN_BODY_TIMEOUT,
            admin_idle_timeout: defaults::ADMIN_IDLE_TIMEOUT,
            admin_max_connections: defaults::ADMIN_MAX_CONNECTIONS,
            admin_max_uploads: defaults::ADMIN_MAX_UPLOADS,
            admin_max_uploads_per_caller: defaults::ADMIN_MAX_UPLOADS_PER_CALLER,
        }
    }
}

/// `[telemetry]`: OpenTelemetry traces over OTLP/HTTP (protobuf). Off unless
/// `endpoint` is set; the W3C `traceparent` header is carried from a message
/// to its cascades either way.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Telemetry {
    /// The collector's OTLP/HTTP address, e.g. `"http://127.0.0.1:4318"` (`/v1/traces` is added
    /// unless the URL already ends with it). Absent: no spans are made or sent.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// The fraction of traces that start at this node which are kept, 0.0 to 1.0 (default 1.0).
    /// A message whose `traceparent` arrives follows its publisher's decision.
    #[serde(default = "defaults::sampling")]
    pub sampling: f64,
    /// `service.name` on every span (default `weir`).
    #[serde(default = "defaults::service_name")]
    pub service_name: String,
}

impl Default for Telemetry {
    fn default() -> Self {
        Self {
            endpoint: None,
            sampling: defaults::sampling(),
            service_name: defaults::service_name(),
        }
    }
}

/// `[transport]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Transport {
    /// The broker: `memory`, `rabbitmq` or `nats` (JetStream).
    #[serde(default)]
    pub kind: TransportKind,
    /// Broker URL, or a list of them (the nodes of a cluster); required for `rabbitmq`
    /// (`amqp://…`) and `nats` (`nats://…`). RabbitMQ: tried in order on every connect and
    /// reconnect. NATS: tried in order at start, then async-nats fails over between them (and
    /// the servers the cluster announces). Passwords are never shown in logs or errors.
    #[serde(default)]
    pub url: Option<Urls>,
    /// Unacknowledged messages a node may hold per slot subscription: RabbitMQ prefetch,
    /// JetStream max-ack-pending. The back-pressure bound.
    #[serde(default = "defaults::prefetch")]
    pub prefetch: u32,
    /// RabbitMQ only: `classic` (default) or `quorum`, the type of every queue Weir declares
    /// (slot, ingress, dead-letter, retry rungs). Quorum queues are replicated; with a retry
    /// ladder they need RabbitMQ 3.10 or later (message TTL and at-least-once dead-lettering),
    /// checked against the server at start. Existing queues of the other type are refused.
    #[serde(default)]
    pub queue_type: Option<QueueType>,
    /// NATS only: the replicas of every stream Weir creates (1 to 5, default 1); more than the
    /// JetStream cluster has servers is refused at start.
    #[serde(default)]
    pub replicas: Option<usize>,
}

impl Default for Transport {
    fn default() -> Self {
        Self {
            kind: TransportKind::default(),
            url: None,
            prefetch: defaults::PREFETCH,
            queue_type: None,
            replicas: None,
        }
    }
}

impl Transport {
    /// The URLs of `transport.url`, trimmed, empty ones left out.
    pub fn urls(&self) -> Vec<String> {
        self.url.as_ref().map(Urls::list).unwrap_or_default()
    }

    /// `transport.queue_type`, defaulted.
    pub fn queue_type(&self) -> QueueType {
        self.queue_type.unwrap_or_default()
    }

    /// `transport.replicas`, defaulted.
    pub fn replicas(&self) -> usize {
        self.replicas.unwrap_or(defaults::REPLICAS)
    }
}

/// `transport.url`: one URL, or a list of them.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Urls {
    /// `url = "amqp://…"`.
    One(String),
    /// `url = ["amqp://a…", "amqp://b…"]`.
    Many(Vec<String>),
}

impl Urls {
    /// Every URL, trimmed, empty ones left out.
    pub fn list(&self) -> Vec<String> {
        let all: Vec<&String> = match self {
            Urls::One(u) => vec![u],
            Urls::Many(v) => v.iter().collect(),
        };
        all.into_iter()
            .map(|u| u.trim().to_owned())
            .filter(|u| !u.is_empty())
            .collect()
    }
}

impl From<String> for Urls {
    fn from(u: String) -> Self {
        Urls::One(u)
    }
}

impl From<&str> for Urls {
    fn from(u: &str) -> Self {
        Urls::One(u.to_owned())
    }
}

impl From<Vec<String>> for Urls {
    fn from(v: Vec<String>) -> Self {
        Urls::Many(v)
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
    /// with leases), `nats-kv` (the same, on a JetStream KV bucket), or `rabbitmq-sac`
    /// (RabbitMQ single active consumer).
    #[serde(default)]
    pub mode: ClusterMode,
    /// The slots this node owns, in every topology; `static` mode only.
    #[serde(default)]
    pub owned_slots: Option<Vec<u32>>,
    /// Postgres URL of the coordinator; `postgres` mode only.
    #[serde(default)]
    pub database_url: Option<String>,
    /// The JetStream KV bucket of `nats-kv` mode (default
    /// [`defaults::BUCKET`]): one per cluster.
    #[serde(default)]
    pub bucket: Option<String>,
    /// How long a node's slot lease lasts without renewal (`postgres` and `nats-kv` modes).
    #[serde(default = "defaults::lease", deserialize_with = "de_duration")]
    pub lease: Duration,
    /// How long a stopping node lets its running calls finish (`postgres`
    /// and `nats-kv` modes). The node renews its lease throughout its drain; at this
    /// deadline it interrupts the calls still running (they are released to
    /// the broker, not failed), releases its slots and leaves. At least the
    /// lease: a node that crashed keeps its slots that long anyway. Default:
    /// [`defaults::drain_deadline`]; read it with [`Cluster::drain_deadline`].
    #[serde(default, deserialize_with = "de_duration_opt")]
    pub drain_deadline: Option<Duration>,
    /// A file holding the key that seals Weir's own headers (64 hex digits
    /// or 32 raw bytes, at least). Optional: by default the key lives in
    /// the cluster's store (`postgres`, `nats-kv`) or in `node.data_dir`.
    /// Give every node of a `static` cluster without a shared store the
    /// same file, so a redrive through one node is honoured by another.
    #[serde(default)]
    pub seal_key_file: Option<PathBuf>,
}

impl Cluster {
    /// `bucket`, or its default.
    pub fn bucket(&self) -> &str {
        self.bucket.as_deref().unwrap_or(defaults::BUCKET)
    }

    /// Is slot ownership leased from a coordinator (`postgres`, `nats-kv`)?
    pub fn leased(&self) -> bool {
        matches!(self.mode, ClusterMode::Postgres | ClusterMode::NatsKv)
    }

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
            bucket: None,
            lease: defaults::LEASE,
            drain_deadline: None,
            seal_key_file: None,
        }
    }
}

/// `node.log_format` and `--log-format`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    /// Lines for people.
    #[default]
    Text,
    /// One JSON object a line.
    Json,
}

/// `node.log_level` and `--log-level`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum LogLevel {
    /// Failures only.
    Error,
    /// And what may need a look.
    Warn,
    /// And what a node does: starts, swaps, retries, dead letters.
    Info,
    /// And the detail of each step.
    Debug,
    /// Everything.
    Trace,
}

impl LogLevel {
    /// As a tracing filter directive's level.
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
            LogLevel::Trace => "trace",
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
    /// The same on a JetStream KV bucket: no database.
    NatsKv,
    /// RabbitMQ's single active consumer enforces one consumer per slot queue.
    RabbitmqSac,
}

impl ClusterMode {
    /// The name as written in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            ClusterMode::Solo => "solo",
            ClusterMode::Static => "static",
            ClusterMode::Postgres => "postgres",
            ClusterMode::NatsKv => "nats-kv",
            ClusterMode::RabbitmqSac => "rabbitmq-sac",
        }
    }
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
    /// Most messages one parked group (`on_failure = "park"`) may hold in a
    /// slot while its head waits on the ladder; absent: 64, and never more
    /// than half of `transport.prefetch`. Beyond it the group's newer
    /// messages are dead-lettered `park-overflow`.
    #[serde(default)]
    pub park_hold: Option<u32>,
    /// Most messages the parked groups of one slot may hold together (each
    /// also within `park_hold`); on JetStream each parked group's failed
    /// head counts too, as it waits unacknowledged. Absent: half of
    /// `transport.prefetch`; it must stay below `transport.prefetch`. The
    /// held messages sit in the slot's window, and the failed heads
    /// (RabbitMQ returns them through the slot's queue) and the slot's other
    /// groups need room in it: a hold that can fill the window stops the
    /// slot. Beyond it, the newer messages of parked groups are
    /// dead-lettered `park-overflow`.
    #[serde(default)]
    pub park_hold_slot: Option<u32>,
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
            park_hold: None,
            park_hold_slot: None,
        }
    }

    /// Most messages a parked group may hold in one slot of this topology
    /// with `prefetch` (see [`Topology::park_hold`]).
    pub fn park_hold(&self, prefetch: u32) -> usize {
        let cap = if prefetch == 0 { u32::MAX } else { (prefetch / 2).max(1) };
        self.park_hold.unwrap_or(defaults::PARK_HOLD).min(cap) as usize
    }

    /// Most messages the parked groups of one slot of this topology may hold
    /// together with `prefetch` (see [`Topology::park_hold_slot`]): always
    /// below the window.
    pub fn park_hold_slot(&self, prefetch: u32) -> usize {
        let below = prefetch.saturating_sub(1);
        self.park_hold_slot.unwrap_or(prefetch / 2).min(below) as usize
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
        for dir in [
            &mut self.node.data_dir,
            &mut self.node.components_dir,
            &mut self.cluster.seal_key_file,
        ]
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

    /// The `[[tenant]]` named `name`.
    pub fn tenant(&self, name: &str) -> Option<&Tenant> {
        self.tenant.iter().find(|t| t.name == name)
    }
}
