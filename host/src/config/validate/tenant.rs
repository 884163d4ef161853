//! `[[tenant]]`: names, tokens, limits, budgets.

use std::collections::HashMap;
use std::path::PathBuf;

use super::super::Config;
use super::super::tenant::TenantBudgets;
use super::Issues;

impl Config {
    pub(super) fn validate_tenants(&self, errors: &mut Issues) {
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
    pub(super) fn validate_tenant_budgets(&self, key: &str, t: &TenantBudgets, errors: &mut Issues) {
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
}
