//! `[[tenant]]`: a tenant's token, limits and what its handlers may be granted.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::defaults;
use super::handler::Limits;
use super::units::{ByteSize, de_duration_opt};

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
