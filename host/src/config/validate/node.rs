//! `[node]`, `[transport]`, `[cluster]` and `[telemetry]`.

use std::collections::HashSet;

use super::super::{ClusterMode, Config, TransportKind, defaults};
use super::Issues;
use crate::retry::schedule::Violation;

impl Config {
    /// `[node]`: its name, budgets, pool and admin listener limits.
    pub(super) fn validate_node(&self, errors: &mut Issues) {
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
    }

    /// `[transport]`: URLs by kind, the keys of one kind given to another, prefetch.
    pub(super) fn validate_transport(&self, errors: &mut Issues, warnings: &mut Vec<Violation>) {
        let t = &self.transport;
        let kind = t.kind.as_str();
        let urls = t.urls();
        let shown = |u: &str| crate::config::redact_url(u);
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
    }

    /// `[cluster]`: the keys of each mode, and the transport a mode needs.
    pub(super) fn validate_cluster(&self, errors: &mut Issues, warnings: &mut Vec<Violation>) {
        let c = &self.cluster;
        let t = &self.transport;
        let kind = t.kind.as_str();
        let mode = c.mode.as_str();
        self.validate_owned_slots(errors, warnings);
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
            (ClusterMode::NatsKv, Some(b)) if !super::is_bucket_name(b) => errors.add(
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

    /// `cluster.owned_slots`: static mode's, within every topology, each once.
    fn validate_owned_slots(&self, errors: &mut Issues, warnings: &mut Vec<Violation>) {
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
    }

    pub(super) fn validate_telemetry(&self, errors: &mut Issues) {
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
}
