//! Every default of the config, in one place (retry defaults: `crate::retry::schedule`).

use super::units::ByteSize;
use std::time::Duration;

/// `transport.prefetch`: RabbitMQ prefetch / JetStream max-ack-pending per slot.
pub const PREFETCH: u32 = 256;
/// `transport.replicas`: one replica per stream, as before the key existed.
pub const REPLICAS: usize = 1;
/// The most replicas a JetStream stream may have.
pub const REPLICAS_MAX: usize = 5;
/// `cluster.lease`.
pub const LEASE: Duration = Duration::from_secs(5);

/// `cluster.bucket`: the JetStream KV bucket of `nats-kv` mode.
pub const BUCKET: &str = "weir-coordination";
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

/// `telemetry.sampling`: every trace that starts here is kept.
pub(super) fn sampling() -> f64 {
    1.0
}

/// `telemetry.service_name`.
pub(super) fn service_name() -> String {
    "weir".to_owned()
}

/// `topology.park_hold` when not set.
pub const PARK_HOLD: u32 = 64;

/// Longest `handler.dedup.window`: a week of records.
pub const DEDUP_WINDOW_MAX: Duration = Duration::from_secs(7 * 24 * 3600);
