//! A handler's settings (limits, config table, admission) and its WASI grants.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::grants;
use super::options::{BudgetCounters, CallBudgets, InstanceMode};
use super::stdio;

/// A host directory a handler may see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preopen {
    /// Directory on the host.
    pub host: PathBuf,
    /// Path the guest sees.
    pub guest: String,
    /// Read-only when true.
    pub read_only: bool,
    /// The directory opened when the version was loaded: each instance is
    /// given this handle (re-checked against the tenant's allow list), not `host`.
    pub pinned: Option<Arc<grants::PinnedDir>>,
}

/// WASI capabilities beyond clocks and random; all denied by default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WasiGrants {
    /// Environment variables visible to the guest.
    pub env: Vec<(String, String)>,
    /// Guest stdout/stderr go to the host's.
    pub inherit_stdio: bool,
    /// Directories the guest may open.
    pub preopens: Vec<Preopen>,
    /// TCP/UDP and name lookup to any address.
    pub network: bool,
}

impl WasiGrants {
    pub(super) fn apply(&self, b: &mut wasmtime_wasi::WasiCtxBuilder) {
        for (k, v) in &self.env {
            b.env(k, v);
        }
        // `inherit_stdio` is applied by `HostState::new`: the host's streams within the
        // call's log budget.
        for p in &self.preopens {
            let perms = if p.read_only {
                wasmtime_wasi::FsPerms::ReadOnly
            } else {
                wasmtime_wasi::FsPerms::ReadWrite
            };
            let host = match p.pinned.as_deref().map(grants::PinnedDir::open_path) {
                None => p.host.clone(),
                Some(Ok(handle)) => handle,
                Some(Err(e)) => {
                    tracing::error!(guest = %p.guest, error = %e, "directory grant refused at instantiation; the guest does not see it");
                    continue;
                }
            };
            // Checked by `Runtime::load`, which opens each directory first.
            if let Err(e) = b.preopened_dir(&host, &p.guest, perms) {
                tracing::error!(host = %p.host.display(), error = %e, "preopen failed after validation");
            }
        }
        if self.network {
            b.inherit_network()
                .allow_tcp(true)
                .allow_udp(true)
                .allow_ip_name_lookup(true);
        }
    }
}

/// Everything about a handler that is not its code.
#[derive(Debug, Clone)]
pub struct HandlerSettings {
    /// Handler name from the config.
    pub name: String,
    /// Linear memory limit per instance, bytes.
    pub memory_limit: usize,
    /// Per-call timeout.
    pub timeout: Duration,
    /// Reuse or fresh instances.
    pub instance_mode: InstanceMode,
    /// The handler's own config table, read by the `config` import.
    pub config: BTreeMap<String, String>,
    /// WASI grants.
    pub wasi: WasiGrants,
    /// Upper bound on `publish` calls per handler call.
    pub max_publish_per_call: usize,
    /// Calls of this handler that may run at once on this node (and so
    /// instances in use at once).
    pub max_instances: usize,
    /// Admission shared by every version of this handler (`None`: each
    /// version gets its own, `max_instances` permits).
    pub permits: Option<Arc<tokio::sync::Semaphore>>,
    /// The tenant this handler is bound to, with the tenant's shared admission.
    pub tenant: Option<TenantShare>,
    /// Fuel one call may burn; `None`: unmetered.
    pub fuel: Option<u64>,
    /// Outcomes, call durations and calls in flight, shared by the handler's versions.
    pub metrics: Arc<crate::observe::stats::HandlerMetrics>,
    /// What the per-call budgets refused or cut for this handler.
    pub budget: Arc<BudgetCounters>,
    /// Its recent log lines and faults (`weir logs`), shared by its versions.
    pub logs: Arc<crate::observe::logring::LogRing>,
    /// Per-call budgets of its own (its tenant's, `tenant.budgets`); `None`: the node's
    /// ([`RuntimeOptions::budgets`]).
    pub budgets: Option<CallBudgets>,
    /// `handler.dedup.window`: how long a handled message is remembered
    /// (`None`: no dedup).
    pub dedup: Option<Duration>,
    /// `handler.on_failure = "park"`.
    pub park: bool,
}

/// A tenant's share of the node: calls of all its handlers at once.
#[derive(Debug, Clone)]
pub struct TenantShare {
    /// The tenant id.
    pub name: Arc<str>,
    /// Calls of the tenant's handlers that may run at once (`None`: unbounded).
    pub permits: Option<Arc<tokio::sync::Semaphore>>,
    /// The tenant's log budget over time, shared by all its calls (`None`: none).
    pub log_rate: Option<Arc<stdio::LogRate>>,
}

impl HandlerSettings {
    /// Defaults for a handler called `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            memory_limit: 64 << 20,
            timeout: Duration::from_secs(5),
            instance_mode: InstanceMode::Reuse,
            config: BTreeMap::new(),
            wasi: WasiGrants::default(),
            max_publish_per_call: 1000,
            max_instances: 16,
            permits: None,
            tenant: None,
            fuel: None,
            metrics: Arc::default(),
            budget: Arc::default(),
            logs: Arc::default(),
            budgets: None,
            dedup: None,
            park: false,
        }
    }
}
