//! Validation of a whole config: every key checked against the others, errors and warnings that
//! name the key.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use super::load::ConfigError;
use super::tenant::TenantBudgets;
use super::{ClusterMode, Config, TransportKind, defaults};
use crate::retry::schedule::{CheckContext, Violation};

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
    /// Checks everything that can be checked without a broker. Errors stop the start; the
    /// warnings (retry rules that do not reject, unused keys) are returned for logging.
    pub fn validate(&self) -> Result<Vec<Violation>, ConfigError> {
        let mut errors = Issues::default();
        let mut warnings = Vec::new();
        self.validate_node_transport_cluster(&mut errors, &mut warnings);
        self.validate_topologies(&mut errors, &mut warnings);
        self.validate_handlers(&mut errors);
        self.validate_tenants(&mut errors);
        self.validate_telemetry(&mut errors);
        if errors.0.is_empty() {
            Ok(warnings)
        } else {
            Err(ConfigError::Invalid {
                origin: self.origin.clone(),
                issues: errors.0,
            })
        }
    }

    fn validate_telemetry(&self, errors: &mut Issues) {
        let t = &self.telemetry;
        if !(0.0..=1.0).contains(&t.sampling) {
            errors.add(
                "telemetry.sampling",
                format!(
                    "is {}; accepted: a fraction from 0.0 (none) to 1.0 (every trace)",
                    t.sampling
                ),
            );
        }
        if t.service_name.trim().is_empty() {
            errors.add(
                "telemetry.service_name",
                "is empty; accepted: any non-empty name (default `weir`)",
            );
        }
        if let Some(endpoint) = &t.endpoint {
            let scheme_ok = endpoint.starts_with("http://") || endpoint.starts_with("https://");
            let parsed = endpoint.parse::<http::Uri>();
            match parsed {
                Ok(uri) if scheme_ok && uri.host().is_some_and(|h| !h.is_empty()) => {
                    if endpoint.starts_with("https://") {
                        errors.add(
                            "telemetry.endpoint",
                            format!(
                                "{endpoint:?} uses https, which this build does not speak to collectors; \
                                 accepted: an http:// OTLP/HTTP address such as \"http://127.0.0.1:4318\" \
                                 (put a local collector or sidecar in front for TLS)"
                            ),
                        );
                    }
                }
                _ => errors.add(
                    "telemetry.endpoint",
                    format!(
                        "{endpoint:?} is not an OTLP/HTTP address; accepted: a URL such as \
                         \"http://127.0.0.1:4318\" (the collector's OTLP/HTTP port)"
                    ),
                ),
            }
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
        let urls = t.urls();
        let shown = |u: &str| super::redact_url(u);
        match t.kind {
            TransportKind::Rabbitmq if urls.is_empty() => errors.add(
                "transport.url",
                "is required for kind = \"rabbitmq\", e.g. url = \"amqp://guest:guest@127.0.0.1:5672/%2f\" \
                 (or a list of the cluster's nodes)",
            ),
            TransportKind::Rabbitmq => {
                for url in urls.iter().filter(|u| !(u.starts_with("amqp://") || u.starts_with("amqps://"))) {
                    errors.add(
                        "transport.url",
                        format!("{:?} is not an AMQP URL; accepted: amqp://… or amqps://…", shown(url)),
                    );
                }
            }
            TransportKind::Nats if urls.is_empty() => errors.add(
                "transport.url",
                "is required for kind = \"nats\", e.g. url = \"nats://127.0.0.1:4222\" (or a list of the cluster's servers)",
            ),
            TransportKind::Memory if t.url.is_some() => warnings.push(Violation {
                key: "transport.url".into(),
                message: "is ignored by kind = \"memory\"".into(),
            }),
            _ => {}
        }
        if let Some(q) = t.queue_type
            && t.kind != TransportKind::Rabbitmq
        {
            errors.add(
                "transport.queue_type",
                format!(
                    "= {:?} applies to kind = \"rabbitmq\" only, not {kind:?}; remove it{}",
                    q.as_str(),
                    if t.kind == TransportKind::Nats {
                        " (NATS streams are replicated with transport.replicas)"
                    } else {
                        ""
                    }
                ),
            );
        }
        if let Some(r) = t.replicas {
            if t.kind != TransportKind::Nats {
                errors.add(
                    "transport.replicas",
                    format!(
                        "= {r} applies to kind = \"nats\" only, not {kind:?}; remove it{}",
                        if t.kind == TransportKind::Rabbitmq {
                            " (RabbitMQ queues are replicated with transport.queue_type = \"quorum\")"
                        } else {
                            ""
                        }
                    ),
                );
            } else if !(1..=defaults::REPLICAS_MAX).contains(&r) {
                errors.add(
                    "transport.replicas",
                    format!(
                        "= {r} is out of range; accepted: 1 to {} (JetStream's limit)",
                        defaults::REPLICAS_MAX
                    ),
                );
            }
        }
        if t.prefetch == 0 {
            errors.add(
                "transport.prefetch",
                "is 0, which would deliver nothing; accepted: 1 or more",
            );
        }

        let c = &self.cluster;
        let mode = c.mode.as_str();
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
                for t in &self.topology {
                    let missing: Vec<u32> = (0..t.slots).filter(|n| !slots.contains(n)).collect();
                    if !missing.is_empty() && !slots.is_empty() {
                        warnings.push(Violation {
                            key: "cluster.owned_slots".into(),
                            message: format!(
                                "topology {:?} has {} slots and this node consumes only {slots:?}: slots {missing:?} \
                                 must be in another node's owned_slots, or their messages wait unconsumed \
                                 (`weir status --admin URL …` with every node shows any that nobody owns)",
                                t.name, t.slots
                            ),
                        });
                    }
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
                format!("\"rabbitmq-sac\" needs transport.kind = \"rabbitmq\", not {kind:?}; accepted with {kind:?}: solo, static, postgres{}", if t.kind == TransportKind::Nats { " or nats-kv" } else { "" }),
            );
        }
        if c.mode == ClusterMode::NatsKv && t.kind != TransportKind::Nats {
            errors.add(
                "cluster.mode",
                format!("\"nats-kv\" keeps slot owners in a JetStream KV bucket of the transport's servers and needs transport.kind = \"nats\", not {kind:?}; accepted with {kind:?}: solo, static, postgres{}", if t.kind == TransportKind::Rabbitmq { " or rabbitmq-sac" } else { "" }),
            );
        }
        match (c.mode, c.bucket.as_deref()) {
            (ClusterMode::NatsKv, Some(b)) if !crate::config::validate::is_bucket_name(b) => errors.add(
                "cluster.bucket",
                format!("{b:?} cannot name a JetStream KV bucket; accepted: letters, digits, '_' and '-'"),
            ),
            (ClusterMode::NatsKv, _) | (_, None) => {}
            (_, Some(_)) => errors.add(
                "cluster.bucket",
                format!("is only read in nats-kv mode, not in mode = {mode:?}; remove it or set mode = \"nats-kv\""),
            ),
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
            let prefetch = self.transport.prefetch;
            if let Some(hold) = t.park_hold
                && (hold == 0 || (prefetch > 0 && hold > prefetch / 2))
            {
                errors.add(
                    format!("{key}.park_hold"),
                    format!(
                        "is {hold}; a parked group's held messages count against the slot's window \
                         (transport.prefetch = {prefetch}), and the failed head and the other groups need \
                         room in it; accepted: 1 to {}",
                        if prefetch > 0 { (prefetch / 2).max(1) } else { u32::MAX }
                    ),
                );
            }
            self.validate_park_hold_slot(t, &key, errors, warnings);
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

    /// `park_hold_slot` must leave room in the slot's window (issue 32: a
    /// hold that fills it stops the slot for good on RabbitMQ); a group's
    /// `park_hold` above it is only ever reached through it (a warning).
    fn validate_park_hold_slot(
        &self,
        t: &super::Topology,
        key: &str,
        errors: &mut Issues,
        warnings: &mut Vec<Violation>,
    ) {
        let prefetch = self.transport.prefetch;
        let Some(bound) = t.park_hold_slot else { return };
        if prefetch > 0 && bound >= prefetch {
            errors.add(
                format!("{key}.park_hold_slot"),
                format!(
                    "is {bound}, which is not below the slot's window (transport.prefetch = {prefetch}): \
                     parked groups could fill it, and then neither their failed heads (RabbitMQ brings \
                     them back through the slot's queue) nor the slot's other groups are delivered again, \
                     so the slot stops; accepted: 0 to {} (default: prefetch / 2 = {})",
                    prefetch - 1,
                    prefetch / 2
                ),
            );
        } else if let Some(hold) = t.park_hold
            && hold > bound
        {
            warnings.push(Violation {
                key: format!("{key}.park_hold"),
                message: format!(
                    "is {hold}, above {key}.park_hold_slot = {bound}: no parked group holds more than \
                     the slot's bound"
                ),
            });
        }
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

    /// `handler.dedup` keeps its record in the coordinator's store: only
    /// the modes that have one can honour it.
    fn validate_dedup(&self, key: &str, d: &super::Dedup, errors: &mut Issues) {
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
        if d.window < std::time::Duration::from_secs(1) || d.window > super::defaults::DEDUP_WINDOW_MAX {
            errors.add(
                format!("{key}.window"),
                format!(
                    "{} is outside 1s..={}; a redelivery after a lost ack comes within the lease and \
                     the ack wait, so minutes are plenty",
                    humantime::format_duration(d.window),
                    humantime::format_duration(super::defaults::DEDUP_WINDOW_MAX)
                ),
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
            if h.on_failure == super::OnFailure::Park && h.batch.is_some() {
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

/// A JetStream KV bucket name: `[A-Za-z0-9_-]+`.
pub(crate) fn is_bucket_name(b: &str) -> bool {
    !b.is_empty() && b.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
}
