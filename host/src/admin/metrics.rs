//! `GET /metrics`: the counters, encoded at scrape time, as OpenMetrics or
//! as Prometheus text 0.0.4, whichever the scraper's `Accept` prefers.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry as Metrics;

use super::state::AdminState;
use crate::cluster::slots::SlotSet;
use crate::observe::stats::{Snapshot, Stats};
use crate::outcome::Reason;
use crate::registry::Caller;
use crate::transport::Transport;

pub(super) async fn metrics(State(s): State<Arc<AdminState>>, headers: HeaderMap) -> Response {
    if let Err(d) = s.auth.operator(&headers) {
        return d.into_response();
    }
    scrape(&s, &headers)
}

/// `GET /metrics` on the listener of `node.metrics`: no token asked (the
/// operator bound it where only the scraper reaches it).
pub(super) async fn open_metrics(State(s): State<Arc<AdminState>>, headers: HeaderMap) -> Response {
    scrape(&s, &headers)
}

fn scrape(s: &AdminState, headers: &HeaderMap) -> Response {
    let mut registry = Metrics::with_prefix("weir");
    registry.register_collector(Box::new(Scrape {
        handlers: s.registry.clone(),
        stats: s.stats.clone(),
        slots: s.slots.clone(),
        transport: s.transport.clone(),
        topologies: s.topologies.clone(),
        ready: s.ready.clone(),
    }));
    let mut body = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut body, &registry) {
        return (StatusCode::INTERNAL_SERVER_ERROR, format!("encoding metrics: {e}\n")).into_response();
    }
    match negotiate(headers.get(header::ACCEPT).and_then(|v| v.to_str().ok())) {
        Format::OpenMetrics => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Format::Text => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
            to_prometheus_text(&body),
        )
            .into_response(),
    }
}

/// The two exposition formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    /// OpenMetrics 1.0 (what Prometheus asks for first).
    OpenMetrics,
    /// The Prometheus text format 0.0.4.
    Text,
}

/// The format an `Accept` header prefers: OpenMetrics unless `text/plain`
/// is asked for with a higher quality (or alone). No header, or `*/*`:
/// OpenMetrics, as before content negotiation.
fn negotiate(accept: Option<&str>) -> Format {
    let Some(accept) = accept else {
        return Format::OpenMetrics;
    };
    let (mut om, mut text) = (-1.0f32, -1.0f32);
    for range in accept.split(',') {
        let mut parts = range.split(';').map(str::trim);
        let media = parts.next().unwrap_or("").to_ascii_lowercase();
        let q = parts
            .filter_map(|p| p.strip_prefix("q="))
            .find_map(|q| q.parse::<f32>().ok())
            .unwrap_or(1.0);
        match media.as_str() {
            "application/openmetrics-text" => om = om.max(q),
            "text/plain" => text = text.max(q),
            _ => {}
        }
    }
    if text > 0.0 && text > om {
        Format::Text
    } else {
        Format::OpenMetrics
    }
}

/// OpenMetrics text as Prometheus text 0.0.4: a counter's `HELP` and
/// `TYPE` name its `_total` samples, an info metric is a gauge named
/// `_info`, `unknown` is `untyped`, and `# UNIT` and `# EOF` are dropped.
fn to_prometheus_text(open_metrics: &str) -> String {
    let mut types: std::collections::HashMap<&str, &str> = std::collections::HashMap::new();
    for line in open_metrics.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ")
            && let Some((name, kind)) = rest.split_once(' ')
        {
            types.insert(name, kind);
        }
    }
    let renamed = |name: &str| match types.get(name).copied() {
        Some("counter") => format!("{name}_total"),
        Some("info") => format!("{name}_info"),
        _ => name.to_owned(),
    };
    let mut out = String::with_capacity(open_metrics.len());
    for line in open_metrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            out.push_str(&format!("# HELP {} {help}\n", renamed(name)));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let kind = match kind {
                "info" => "gauge",
                "unknown" => "untyped",
                k => k,
            };
            out.push_str(&format!("# TYPE {} {kind}\n", renamed(name)));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Reads the counters at scrape time.
struct Scrape {
    handlers: Arc<crate::registry::Registry>,
    stats: Arc<Stats>,
    slots: Arc<SlotSet>,
    transport: Arc<dyn Transport>,
    topologies: std::collections::HashMap<String, u32>,
    ready: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for Scrape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Scrape")
    }
}

fn counter(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    labels: &[(&str, &str, u64)],
) -> std::fmt::Result {
    let probe = ConstCounter::new(0u64);
    let mut m = encoder.encode_descriptor(name, help, None, probe.metric_type())?;
    for (key, value, n) in labels {
        let labels = [(*key, *value)];
        ConstCounter::new(*n).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let s = self.stats.snapshot();
        outcome_families(&mut encoder, &s)?;
        batch_families(&mut encoder, &s)?;
        total_families(&mut encoder, &s)?;
        self.version_families(&mut encoder)?;
        let handler_metrics = self.handlers.metrics();
        handler_message_family(&mut encoder, &handler_metrics)?;
        self.slot_families(&mut encoder)?;
        handler_call_families(&mut encoder, &handler_metrics)?;
        self.node_families(&mut encoder)?;
        self.ack_floor_family(&mut encoder)
    }
}

/// A handler's name, its tenant, and its counters, as the registry lists them.
type HandlerRows<'a> = [(&'a str, Option<&'a str>, Arc<crate::observe::stats::HandlerMetrics>)];

/// Settled deliveries by outcome, `handler.dedup` failures, dead letters by reason.
fn outcome_families(encoder: &mut DescriptorEncoder<'_>, s: &Snapshot) -> std::fmt::Result {
    counter(
        encoder,
        "messages",
        "Settled deliveries by outcome.",
        &[
            ("outcome", "handled", s.handled),
            ("outcome", "retry-scheduled", s.retry_scheduled),
            ("outcome", "dead-lettered", s.dead_lettered.iter().map(|(_, n)| n).sum()),
            ("outcome", "stranded", s.stranded),
            ("outcome", "uncertain", s.uncertain),
            ("outcome", "requeued", s.requeued),
            ("outcome", "released", s.released),
            ("outcome", "deduplicated", s.deduplicated),
        ],
    )?;
    counter(
        encoder,
        "dedup_failures",
        "handler.dedup store operations that failed, by operation.",
        &[
            ("op", "lookup", s.dedup_lookup_failures),
            ("op", "record", s.dedup_record_failures),
        ],
    )?;
    let reasons: Vec<(Reason, u64)> = s.dead_lettered.to_vec();
    let by_reason: Vec<(&str, &str, u64)> = reasons.iter().map(|(r, n)| ("reason", r.as_str(), *n)).collect();
    counter(encoder, "dead_letters", "Dead-letter captures by reason.", &by_reason)?;
    Ok(())
}

/// Batches by why they ran and by size.
fn batch_families(encoder: &mut DescriptorEncoder<'_>, s: &Snapshot) -> std::fmt::Result {
    let flushes: Vec<(&str, &str, u64)> = s
        .batch_flushes
        .iter()
        .map(|(r, n)| ("reason", r.as_str(), *n))
        .collect();
    counter(
        encoder,
        "batches",
        "Batches handed to handle-batch, by why they ran.",
        &flushes,
    )?;
    let bounds: Vec<String> = s
        .batch_sizes
        .iter()
        .map(|(b, _)| {
            if *b == u64::MAX {
                "+Inf".to_owned()
            } else {
                b.to_string()
            }
        })
        .collect();
    let sizes: Vec<(&str, &str, u64)> = s
        .batch_sizes
        .iter()
        .zip(&bounds)
        .map(|((_, n), b)| ("size_at_most", b.as_str(), *n))
        .collect();
    counter(
        encoder,
        "batches_by_size",
        "Batches by size bucket (members, inclusive upper bound; not cumulative).",
        &sizes,
    )?;
    Ok(())
}

/// The plain counters, one family each.
fn total_families(encoder: &mut DescriptorEncoder<'_>, s: &Snapshot) -> std::fmt::Result {
    for (name, help, n) in [
        (
            "batch_members",
            "Members of every batch handed to handle-batch.",
            s.batch_members,
        ),
        (
            "batch_replays",
            "Batches whose call trapped or timed out, replayed member by member.",
            s.batch_replays,
        ),
        (
            "batch_released",
            "Members of unstarted batches returned to the broker by a drain.",
            s.batch_released,
        ),
        (
            "ack_failures",
            "Acks whose confirmation failed (the message may come again).",
            s.ack_failures,
        ),
        ("cascaded", "Messages published by handlers, confirmed.", s.cascaded),
        (
            "cascades_uncertain",
            "Cascade publishes whose confirm did not come in time (they may have landed; the cause is retried).",
            s.cascades_uncertain,
        ),
        (
            "cascades_duplicate",
            "Cascades the broker dropped as copies of ones it already held (a rerun after a lost confirm).",
            s.cascades_duplicate,
        ),
        (
            "trace_spans_dropped",
            "Spans dropped because the export queue toward the trace collector was full (the collector slow or unreachable).",
            crate::telemetry::queue::spans_dropped(),
        ),
        (
            "guest_faults",
            "Guest calls that trapped, timed out or were interrupted.",
            s.faults,
        ),
        (
            "untrusted_headers",
            "Deliveries whose weir-* headers carried no valid seal (from a publisher or a guest): moved under untrusted- names.",
            s.untrusted_headers,
        ),
        (
            "runner_panics",
            "Slot runner jobs that panicked (caught; the runner restarted).",
            s.runner_panics,
        ),
    ] {
        let c = ConstCounter::new(n);
        c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
    }
    Ok(())
}

/// Settled deliveries by handler, tenant and outcome.
fn handler_message_family(encoder: &mut DescriptorEncoder<'_>, handler_metrics: &HandlerRows<'_>) -> std::fmt::Result {
    let probe = ConstCounter::new(0u64);
    let mut m = encoder.encode_descriptor(
        "handler_messages",
        "Settled deliveries by handler, tenant and outcome.",
        None,
        probe.metric_type(),
    )?;
    for (name, tenant, hm) in handler_metrics {
        for (outcome, n) in hm.outcomes.snapshot() {
            let labels = [
                ("handler", *name),
                ("tenant", tenant.unwrap_or("")),
                ("outcome", outcome),
            ];
            ConstCounter::new(n).encode(m.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

/// Guest calls running now, and how long they took, by handler.
fn handler_call_families(encoder: &mut DescriptorEncoder<'_>, handler_metrics: &HandlerRows<'_>) -> std::fmt::Result {
    {
        let probe = ConstGauge::new(0i64);
        let mut m = encoder.encode_descriptor(
            "handler_calls_in_flight",
            "Guest calls running now, by handler.",
            None,
            probe.metric_type(),
        )?;
        for (name, tenant, hm) in handler_metrics {
            let labels = [("handler", *name), ("tenant", tenant.unwrap_or(""))];
            ConstGauge::new(hm.in_flight()).encode(m.encode_family(&labels)?)?;
        }
    }
    {
        let mut m = encoder.encode_descriptor(
            "handler_call_duration_seconds",
            "Guest call durations (handle and handle-batch), by handler.",
            None,
            prometheus_client::metrics::MetricType::Histogram,
        )?;
        for (name, tenant, hm) in handler_metrics {
            let labels = [("handler", *name), ("tenant", tenant.unwrap_or(""))];
            let (sum, count, buckets) = hm.durations();
            let mut family = m.encode_family(&labels)?;
            family.encode_histogram::<prometheus_client::encoding::NoLabelSet>(sum, count, &buckets, None)?;
        }
    }
    Ok(())
}

impl Scrape {
    /// The version each handler runs, and its running canary's tally.
    fn version_families(&self, encoder: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let probe = ConstGauge::new(1i64);
        let mut m = encoder.encode_descriptor(
            "handler_version_info",
            "The version each handler runs now (sha256 of the component).",
            None,
            probe.metric_type(),
        )?;
        let handlers = self.handlers.list(&Caller::Operator);
        for h in &handlers {
            let tenant = h.tenant.clone().unwrap_or_default();
            let labels = [
                ("handler", h.name.as_str()),
                ("tenant", tenant.as_str()),
                ("digest", h.current.digest.as_str()),
                ("source", h.current.source.as_str()),
            ];
            ConstGauge::new(1i64).encode(m.encode_family(&labels)?)?;
        }
        // A running canary against the stable version, since it began
        // (a gauge: each canary counts from zero).
        let mut family = encoder.encode_descriptor(
            "canary_messages",
            "Settled messages of a running canary and of the stable version since the canary began, by side and outcome.",
            None,
            probe.metric_type(),
        )?;
        for h in &handlers {
            let Some(c) = &h.canary else { continue };
            let tenant = h.tenant.clone().unwrap_or_default();
            for (side, x) in [("canary", &c.compare.canary), ("stable", &c.compare.stable)] {
                let t = &x.tally;
                for (outcome, n) in [
                    ("handled", t.handled),
                    ("retry-scheduled", t.retried),
                    ("dead-lettered", t.dead_lettered),
                ] {
                    let labels = [
                        ("handler", h.name.as_str()),
                        ("tenant", tenant.as_str()),
                        ("side", side),
                        ("digest", x.digest.as_str()),
                        ("outcome", outcome),
                    ];
                    ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX)).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        Ok(())
    }

    /// Settled deliveries by slot, and each slot's lanes and parked groups.
    fn slot_families(&self, encoder: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        {
            let probe = ConstCounter::new(0u64);
            let mut m = encoder.encode_descriptor(
                "slot_messages",
                "Settled deliveries by topology, slot and outcome.",
                None,
                probe.metric_type(),
            )?;
            for ((topology, slot), counters) in self.stats.slots() {
                let slot = slot.to_string();
                for (outcome, n) in counters.snapshot() {
                    let labels = [("topology", &*topology), ("slot", slot.as_str()), ("outcome", outcome)];
                    ConstCounter::new(n).encode(m.encode_family(&labels)?)?;
                }
            }
        }
        for (name, help, pick) in [
            (
                "lane_depth",
                "Deliveries taken from the broker and waiting in a slot's lanes.",
                0usize,
            ),
            (
                "lanes_running",
                "Lanes (groups) of a slot with a call running or queued for a worker.",
                1,
            ),
            (
                "parked_groups",
                "Groups of a slot parked behind a failed message (on_failure = \"park\").",
                2,
            ),
            (
                "parked_held",
                "Messages held by a slot's parked groups, their heads counted on JetStream (at most topology.park_hold_slot).",
                3,
            ),
        ] {
            let probe = ConstGauge::new(0i64);
            let mut m = encoder.encode_descriptor(name, help, None, probe.metric_type())?;
            for ((topology, slot), counters) in self.stats.slots() {
                let slot = slot.to_string();
                let (queued, running) = counters.depth();
                let v = match pick {
                    0 => queued,
                    1 => running,
                    2 => counters.parked(),
                    _ => counters.held(),
                };
                let labels = [("topology", &*topology), ("slot", slot.as_str())];
                ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX)).encode(m.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }

    /// Deploys, the slots this node owns against each topology's count, and
    /// whether the node takes work.
    fn node_families(&self, encoder: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let swaps = ConstCounter::new(self.handlers.swaps());
        swaps.encode(encoder.encode_descriptor(
            "handler_swaps",
            "Deploys and rollbacks that changed a handler's version on this node.",
            None,
            swaps.metric_type(),
        )?)?;
        let refused = ConstCounter::new(self.handlers.refused());
        refused.encode(encoder.encode_descriptor(
            "handler_deploys_refused",
            "Deploys refused (invalid, too large, grants refused, store failed); the running version stayed.",
            None,
            refused.metric_type(),
        )?)?;
        let owned = ConstGauge::new(i64::try_from(self.slots.running().len()).unwrap_or(i64::MAX));
        owned.encode(encoder.encode_descriptor(
            "slots_owned",
            "Slots this node consumes now.",
            None,
            owned.metric_type(),
        )?)?;
        {
            let running = self.slots.running();
            let mut topologies: Vec<(&String, &u32)> = self.topologies.iter().collect();
            topologies.sort();
            let probe = ConstGauge::new(0i64);
            {
                let mut m = encoder.encode_descriptor(
                    "topology_slots",
                    "Slots of each topology (the config's count).",
                    None,
                    probe.metric_type(),
                )?;
                for (t, n) in &topologies {
                    ConstGauge::new(i64::from(**n)).encode(m.encode_family(&[("topology", t.as_str())])?)?;
                }
            }
            let mut m = encoder.encode_descriptor(
                "topology_slots_owned",
                "Slots of each topology this node consumes now (summed over the nodes: below weir_topology_slots means some slot has no owner).",
                None,
                probe.metric_type(),
            )?;
            for (t, _) in &topologies {
                let owned = running.iter().filter(|(rt, _)| rt == *t).count();
                ConstGauge::new(i64::try_from(owned).unwrap_or(i64::MAX))
                    .encode(m.encode_family(&[("topology", t.as_str())])?)?;
            }
        }
        let ready = ConstGauge::new(i64::from(self.ready.load(std::sync::atomic::Ordering::Relaxed)));
        ready.encode(encoder.encode_descriptor(
            "node_ready",
            "1 while the node takes work; 0 while it starts, is fenced (lost its lease) or stops.",
            None,
            ready.metric_type(),
        )?)?;
        Ok(())
    }

    /// How long each JetStream slot consumer's ack floor has stood still.
    fn ack_floor_family(&self, encoder: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        // Declared on every broker (empty but for JetStream), so dashboards
        // and alerts read the same families everywhere.
        let floors = self.transport.ack_floor();
        {
            let probe = ConstGauge::new(0.0f64);
            let mut m = encoder.encode_descriptor(
                "ack_floor_stall_seconds",
                "How long a JetStream slot consumer's ack floor has stood still while it had delivered past it (0: not stalled).",
                None,
                probe.metric_type(),
            )?;
            for f in floors {
                let slot = f.slot.to_string();
                let labels = [("topology", f.topology.as_str()), ("slot", slot.as_str())];
                ConstGauge::new(f.stalled_for.as_secs_f64()).encode(m.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod format_tests {
    use super::*;

    #[test]
    fn accept_headers_choose_the_format() {
        assert_eq!(negotiate(None), Format::OpenMetrics);
        assert_eq!(negotiate(Some("*/*")), Format::OpenMetrics);
        assert_eq!(negotiate(Some("text/plain")), Format::Text);
        assert_eq!(negotiate(Some("text/plain; version=0.0.4")), Format::Text);
        assert_eq!(
            negotiate(Some(
                "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,\
                 text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
            )),
            Format::OpenMetrics
        );
        assert_eq!(
            negotiate(Some("application/openmetrics-text;q=0.3, text/plain;q=0.9")),
            Format::Text
        );
    }

    #[test]
    fn counters_and_infos_are_named_by_their_samples_in_text() {
        let om = "# HELP weir_messages Messages.\n# TYPE weir_messages counter\nweir_messages_total{outcome=\"handled\"} 3\n\
                  # HELP weir_v Version.\n# TYPE weir_v info\nweir_v_info{digest=\"x\"} 1\n\
                  # HELP weir_slots Slots.\n# TYPE weir_slots gauge\n# UNIT weir_slots slots\nweir_slots 2\n# EOF\n";
        let text = to_prometheus_text(om);
        assert_eq!(
            text,
            "# HELP weir_messages_total Messages.\n# TYPE weir_messages_total counter\nweir_messages_total{outcome=\"handled\"} 3\n\
             # HELP weir_v_info Version.\n# TYPE weir_v_info gauge\nweir_v_info{digest=\"x\"} 1\n\
             # HELP weir_slots Slots.\n# TYPE weir_slots gauge\nweir_slots 2\n"
        );
    }
}
