//! `[[handler]]`: names, components, bindings, limits, grants, dedup.

use std::collections::HashMap;

use super::super::{Config, Handler};
use super::{Issues, is_handler_name};

impl Config {
    pub(super) fn validate_handlers(&self, errors: &mut Issues) {
        let mut names: HashMap<&str, usize> = HashMap::new();
        // (topology, tenant, message type) → (handler index, key)
        let mut bound: Bindings<'_> = HashMap::new();
        for (i, h) in self.handler.iter().enumerate() {
            let key = format!("handler[{i}]");
            self.validate_handler_identity(i, h, &key, &mut names, errors);
            validate_bindings(i, h, &key, &mut bound, errors);
            validate_limits(h, &key, errors);
        }
    }

    /// A handler's name (valid and unique), component, topology, failure
    /// mode, dedup and tenant.
    fn validate_handler_identity<'a>(
        &self,
        i: usize,
        h: &'a Handler,
        key: &str,
        names: &mut HashMap<&'a str, usize>,
        errors: &mut Issues,
    ) {
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
        if h.on_failure == crate::config::OnFailure::Park && h.batch.is_some() {
            errors.add(
                format!("{key}.on_failure"),
                "\"park\" holds a group behind one failed message, and a batch fails or succeeds per member \
             inside one call; accepted: \"continue\" with batch, or park a handler without batch",
            );
        }
        if let Some(d) = &h.dedup {
            self.validate_dedup(&format!("{key}.dedup"), d, errors);
        }
        if let Some(tenant) = &h.tenant
            && tenant.trim().is_empty()
        {
            errors.add(
                format!("{key}.tenant"),
                "is empty; remove it to bind every tenant, or name one",
            );
        }
    }

    /// `handler.dedup` keeps its record in the coordinator's store: only
    /// the modes that have one can honour it.
    pub(super) fn validate_dedup(&self, key: &str, d: &crate::config::Dedup, errors: &mut Issues) {
        if !self.cluster.leased() {
            errors.add(
                key.to_owned(),
                format!(
                    "needs the coordinator's store, and cluster.mode = \"{}\" has none; accepted: \
                     cluster.mode = \"postgres\" or \"nats-kv\", or remove dedup",
                    self.cluster.mode.as_str()
                ),
            );
        }
        if d.window < std::time::Duration::from_secs(1) || d.window > crate::config::defaults::DEDUP_WINDOW_MAX {
            errors.add(
                format!("{key}.window"),
                format!(
                    "{} is outside 1s..={}; a redelivery after a lost ack comes within the lease and \
                     the ack wait, so minutes are plenty",
                    humantime::format_duration(d.window),
                    humantime::format_duration(crate::config::defaults::DEDUP_WINDOW_MAX)
                ),
            );
        }
    }
}

/// (topology, tenant, message type) → (handler index, key)
type Bindings<'a> = HashMap<(&'a str, Option<&'a str>, &'a str), (usize, String)>;

/// A handler's message types (and its batch's): present, not empty, and
/// each (topology, tenant, message type) bound once; a batch's own fields.
fn validate_bindings<'a>(i: usize, h: &'a Handler, key: &str, bound: &mut Bindings<'a>, errors: &mut Issues) {
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
}

/// A handler's limits and its WASI grants.
fn validate_limits(h: &Handler, key: &str, errors: &mut Issues) {
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
