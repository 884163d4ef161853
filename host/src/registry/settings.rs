//! From the config to a handler's runtime settings: its limits (capped by
//! its tenant's), budgets, config table, grants, the admission its tenant's
//! handlers share, and the component bytes as configured.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::Context as _;

use super::types::{DirGrant, Grants};
use crate::config::{self, Config};
use crate::runtime::{self, HandlerSettings, TenantShare};

/// The admission a tenant's handlers share, one per `[[tenant]]`.
pub(super) fn tenant_shares(config: &Config) -> HashMap<String, TenantShare> {
    config
        .tenant
        .iter()
        .map(|t| {
            let share = TenantShare {
                name: Arc::from(t.name.as_str()),
                permits: t
                    .limits
                    .concurrency
                    .map(|n| Arc::new(tokio::sync::Semaphore::new(n.max(1) as usize))),
                log_rate: tenant_log_rate(t),
            };
            (t.name.clone(), share)
        })
        .collect()
}

/// A tenant's log budget over time, when it sets one.
pub(super) fn tenant_log_rate(t: &config::Tenant) -> Option<Arc<runtime::stdio::LogRate>> {
    let (bytes, lines) = (t.budgets.log_bytes_per_second, t.budgets.log_lines_per_second);
    if bytes.is_none() && lines.is_none() {
        return None;
    }
    Some(Arc::new(runtime::stdio::LogRate::new(
        Arc::from(t.name.as_str()),
        bytes.map(|b| b.bytes()),
        lines.map(u64::from),
    )))
}

/// The settings a node runs `h` with (limits capped by its tenant's,
/// budgets, config table, WASI switches), without grants: what
/// `weir call` runs a component with.
pub fn handler_settings(h: &config::Handler, config: &Config) -> HandlerSettings {
    base_settings(h, config, &tenant_shares(config))
}

/// The runtime settings of a configured handler, without grants: limits
/// (capped by its tenant's), config table, admission shared by its versions.
pub(super) fn base_settings(
    h: &config::Handler,
    config: &Config,
    shares: &HashMap<String, TenantShare>,
) -> HandlerSettings {
    let mut s = HandlerSettings::new(&h.name);
    s.memory_limit = usize::try_from(h.limits.memory.bytes()).unwrap_or(usize::MAX);
    s.timeout = h.limits.timeout;
    s.instance_mode = match h.instance_mode {
        config::InstanceMode::Reuse => runtime::InstanceMode::Reuse,
        config::InstanceMode::Fresh => runtime::InstanceMode::Fresh,
    };
    s.config = h.config.clone();
    s.max_instances = h.limits.instances as usize;
    s.permits = Some(Arc::new(tokio::sync::Semaphore::new(s.max_instances.max(1))));
    s.fuel = h.limits.fuel;
    s.dedup = h.dedup.map(|d| d.window);
    s.park = h.on_failure == config::OnFailure::Park;
    s.wasi.inherit_stdio = h.wasi.inherit_stdio;
    s.wasi.network = h.wasi.network;
    if let Some(t) = h.tenant.as_deref() {
        s.tenant = Some(shares.get(t).cloned().unwrap_or_else(|| TenantShare {
            name: Arc::from(t),
            permits: None,
            log_rate: None,
        }));
        if let Some(tenant) = config.tenant(t) {
            s.budgets = config.call_budgets(Some(tenant));
            if let Some(m) = tenant.limits.memory {
                s.memory_limit = s.memory_limit.min(usize::try_from(m.bytes()).unwrap_or(usize::MAX));
            }
            if let Some(d) = tenant.limits.timeout {
                s.timeout = s.timeout.min(d);
            }
            if let Some(f) = tenant.limits.fuel {
                s.fuel = Some(s.fuel.map_or(f, |x| x.min(f)));
            }
        }
    }
    s
}

pub(super) fn config_grants(h: &config::Handler) -> Grants {
    Grants {
        env: h.wasi.env.clone(),
        dirs: h
            .wasi
            .preopens
            .iter()
            .map(|p| DirGrant {
                guest: p.guest.clone(),
                host: p.host.clone(),
            })
            .collect(),
    }
}

/// Read a handler's configured component: a file, or `bundled:NAME`.
pub fn component_bytes(h: &config::Handler, index: usize) -> anyhow::Result<Vec<u8>> {
    let raw = h.component.to_string_lossy();
    if let Some(name) = raw.rsplit("bundled:").next().filter(|_| raw.contains("bundled:")) {
        return crate::runtime::bundled::get(name).map(<[u8]>::to_vec).with_context(|| {
            format!("handler[{index}].component = {raw:?}: no bundled component called `{name}` (accepted: bundled:orders, bundled:noop, or a file path)")
        });
    }
    std::fs::read(&h.component)
        .with_context(|| format!("handler[{index}].component: cannot read {}", h.component.display()))
}
