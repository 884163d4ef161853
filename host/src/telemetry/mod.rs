//! Traces: OpenTelemetry spans for each message a node handles, exported
//! over OTLP/HTTP when `[telemetry] endpoint` is set, and the W3C
//! `traceparent` header carried from a message to its cascades.
//!
//! One message makes this tree (the publisher's span, when its
//! `traceparent` arrives, is the root's parent):
//!
//! ```text
//! weir.receive        consumer; topology, slot, message id, group, tenant, type, attempt
//! ├── weir.call       handler, version digest, attempt, outcome (ok | retry | reject | trap …)
//! │   └── weir.publish  producer, one per cascade; its context is the cascade's traceparent
//! └── weir.settle     what the broker was told: ack, retry, dead-letter, release
//! ```
//!
//! While a message is in a call, its `traceparent` header names its
//! `weir.receive` span, so the guest (and the call span, made on the worker
//! thread) see their real parent; before it is settled the header it arrived
//! with is put back, so a retry or a dead letter carries the publisher's
//! context unchanged and every attempt is a sibling under it.
//!
//! With no endpoint nothing here allocates: [`enabled`] is one load, and a
//! cascade only inherits its cause's `traceparent` ([`inherit`]).
//!
//! What a publisher controls is bounded wherever it is copied ([`bound`]):
//! an invalid `traceparent` is ignored, a `tracestate` is cut to the W3C
//! limits, attribute values taken from a message are cut, and spans wait
//! for the collector in a bounded queue that drops with a count ([`queue`]).

pub mod bound;
pub mod queue;

use std::borrow::Cow;
use std::sync::OnceLock;
use std::time::Duration;

use opentelemetry::propagation::{Extractor, TextMapPropagator as _};
use opentelemetry::trace::{Span as _, SpanContext, SpanKind, Status, TraceContextExt as _, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider, Span};

use crate::config::Telemetry;
use crate::envelope::Envelope;
use crate::outcome::Outcome;

/// The W3C trace context header.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C vendor trace state, carried with [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";

static TRACER: OnceLock<SdkTracer> = OnceLock::new();

/// Whether spans are made (an endpoint is configured and [`init`] ran).
#[inline]
pub fn enabled() -> bool {
    TRACER.get().is_some()
}

fn tracer() -> Option<&'static SdkTracer> {
    TRACER.get()
}

/// Flushes the spans still queued when it is dropped (the end of `weir
/// run`, after the drain), so the last messages' traces are not lost.
pub struct Flush(SdkTracerProvider);

impl Drop for Flush {
    fn drop(&mut self) {
        if let Err(e) = self.0.shutdown() {
            tracing::warn!(error = %e, "flushing the last spans to the collector failed");
        }
    }
}

/// The collector URL for `endpoint`: `/v1/traces` added unless it is there.
pub fn traces_url(endpoint: &str) -> String {
    let base = endpoint.trim_end_matches('/');
    if base.ends_with("/v1/traces") {
        base.to_owned()
    } else {
        format!("{base}/v1/traces")
    }
}

/// Start exporting spans when `[telemetry] endpoint` is set; `None` (and
/// no spans made) otherwise. Call once per process, before the node starts.
pub fn init(cfg: &Telemetry, node: &str) -> anyhow::Result<Option<Flush>> {
    let Some(endpoint) = &cfg.endpoint else {
        return Ok(None);
    };
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_otlp::{Protocol, WithExportConfig as _, WithHttpConfig as _};
    let url = traces_url(endpoint);
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(UreqClient::new())
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url.clone())
        .build()
        .map_err(|e| anyhow::anyhow!("telemetry.endpoint = {endpoint:?}: cannot export spans there: {e}"))?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(cfg.service_name.clone())
        .with_attribute(KeyValue::new("service.instance.id", node.to_owned()))
        .build();
    let queue = queue::BoundedQueue::new(exporter, queue::QUEUE_SPANS)
        .map_err(|e| anyhow::anyhow!("starting the span export thread: {e}"))?;
    let provider = SdkTracerProvider::builder()
        .with_span_processor(queue)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(cfg.sampling))))
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("weir");
    if TRACER.set(tracer).is_err() {
        anyhow::bail!("telemetry was already started in this process");
    }
    tracing::info!(endpoint = %url, sampling = cfg.sampling, "exporting traces (OTLP/HTTP)");
    Ok(Some(Flush(provider)))
}

/// OTLP over the blocking HTTP client Weir already uses for deploys. The
/// SDK's batch processor exports from its own thread, so blocking there
/// holds up nothing else.
#[derive(Debug)]
struct UreqClient(ureq::Agent);

impl UreqClient {
    fn new() -> Self {
        Self(
            ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(Duration::from_secs(10)))
                .build()
                .into(),
        )
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for UreqClient {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        let (parts, body) = request.into_parts();
        let response = self.0.run(http::Request::from_parts(parts, body.to_vec()))?;
        let (parts, mut body) = response.into_parts();
        // The collector's answer is a few bytes; a misbehaving one is cut off.
        let bytes = body.with_config().limit(1 << 20).read_to_vec()?;
        Ok(http::Response::from_parts(parts, bytes.into()))
    }
}

/// A message's trace context, bounded ([`bound`]): its `traceparent` when
/// valid, and then its `tracestate` cut to the W3C limits.
struct Headers {
    traceparent: Option<String>,
    tracestate: Option<String>,
}

impl Headers {
    fn of(headers: &[(String, String)]) -> Self {
        let find = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        };
        let traceparent = find(TRACEPARENT).and_then(bound::traceparent).map(str::to_owned);
        let tracestate = traceparent
            .as_ref()
            .and_then(|_| find(TRACESTATE))
            .and_then(bound::tracestate);
        Self {
            traceparent,
            tracestate,
        }
    }
}

impl Extractor for Headers {
    fn get(&self, key: &str) -> Option<&str> {
        if key.eq_ignore_ascii_case(TRACEPARENT) {
            self.traceparent.as_deref()
        } else if key.eq_ignore_ascii_case(TRACESTATE) {
            self.tracestate.as_deref()
        } else {
            None
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT, TRACESTATE]
    }
}

/// The context a message's headers carry (empty when they carry none, or
/// an invalid `traceparent`).
fn parent_of(headers: &[(String, String)]) -> Context {
    TraceContextPropagator::new().extract(&Headers::of(headers))
}

/// `traceparent` for `sc` (version 00).
fn traceparent(sc: &SpanContext) -> String {
    format!("00-{}-{}-{:02x}", sc.trace_id(), sc.span_id(), sc.trace_flags().to_u8())
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

fn set_header(headers: &mut Vec<(String, String)>, name: &str, value: String) {
    match headers.iter_mut().find(|(k, _)| k == name) {
        Some(slot) => slot.1 = value,
        None => headers.push((name.to_owned(), value)),
    }
}

fn remove_header(headers: &mut Vec<(String, String)>, name: &str) {
    headers.retain(|(k, _)| k != name);
}

/// A message's `weir.receive` span, from its admission to its settlement,
/// and the `traceparent` it arrived with (put back before it is settled).
pub struct Received {
    span: Span,
    arrived_with: Option<String>,
}

/// Start the `weir.receive` span of a message admitted to `handler` on
/// `slot` of `topology`, and point its `traceparent` at that span for the
/// call. `None` when traces are off.
pub fn receive(env: &mut Envelope, topology: &str, slot: u32, handler: &str) -> Option<Received> {
    let tracer = tracer()?;
    let parent = parent_of(&env.headers);
    let mut attributes = vec![
        KeyValue::new("messaging.system", "weir"),
        KeyValue::new("messaging.operation.type", "process"),
        KeyValue::new("messaging.destination.name", topology.to_owned()),
        KeyValue::new("messaging.message.id", bound::attribute(&env.id)),
        KeyValue::new("weir.slot", i64::from(slot)),
        KeyValue::new("weir.message_type", bound::attribute(&env.message_type)),
        KeyValue::new("weir.attempt", i64::from(env.attempt)),
        KeyValue::new("weir.handler", handler.to_owned()),
    ];
    if let Some(g) = env.group_id.as_deref().filter(|g| !g.is_empty()) {
        attributes.push(KeyValue::new("weir.group", bound::attribute(g)));
    }
    if let Some(t) = env.tenant_id.as_deref() {
        attributes.push(KeyValue::new("weir.tenant", bound::attribute(t)));
    }
    let span = tracer
        .span_builder("weir.receive")
        .with_kind(SpanKind::Consumer)
        .with_attributes(attributes)
        .start_with_context(tracer, &parent);
    let arrived_with = header(&env.headers, TRACEPARENT).map(str::to_owned);
    set_header(&mut env.headers, TRACEPARENT, traceparent(span.span_context()));
    Some(Received { span, arrived_with })
}

impl Received {
    /// Put back the `traceparent` `env` arrived with, so what is retried or
    /// dead-lettered carries its publisher's context, not this attempt's.
    pub fn restore(&self, env: &mut Envelope) {
        match &self.arrived_with {
            Some(v) => set_header(&mut env.headers, TRACEPARENT, v.clone()),
            None => remove_header(&mut env.headers, TRACEPARENT),
        }
    }

    /// The `weir.settle` span: what the broker was told. Ends the receive span.
    pub fn settled(mut self, outcome: Outcome, started: std::time::SystemTime) {
        let mut attributes = vec![KeyValue::new("weir.outcome", outcome.as_str())];
        if let Outcome::DeadLettered(reason) = outcome {
            attributes.push(KeyValue::new("weir.dead_letter_reason", reason.as_str()));
        }
        if let Some(tracer) = tracer() {
            let cx = Context::new().with_remote_span_context(self.span.span_context().clone());
            let mut settle = tracer
                .span_builder("weir.settle")
                .with_kind(SpanKind::Internal)
                .with_start_time(started)
                .with_attributes(attributes.clone())
                .start_with_context(tracer, &cx);
            if matches!(outcome, Outcome::Stranded | Outcome::Uncertain) {
                settle.set_status(Status::error(outcome.as_str()));
            }
            settle.end();
        }
        self.span.set_attributes(attributes);
        self.span.end();
    }
}

/// A `weir.call` span on the worker thread: a child of the message's
/// `weir.receive` (through its `traceparent`).
pub struct Call(Span);

/// Start the call span for `msg` (the first member of a batch of
/// `batch` messages) on `handler` at `digest`. `None` when traces are off.
pub fn call(msg: &Envelope, handler: &str, digest: &str, batch: Option<usize>) -> Option<Call> {
    let tracer = tracer()?;
    let parent = parent_of(&msg.headers);
    let mut attributes = vec![
        KeyValue::new("weir.handler", handler.to_owned()),
        KeyValue::new("weir.handler.version", digest.to_owned()),
        KeyValue::new("weir.attempt", i64::from(msg.attempt)),
        KeyValue::new("messaging.message.id", bound::attribute(&msg.id)),
    ];
    if let Some(g) = msg.group_id.as_deref().filter(|g| !g.is_empty()) {
        attributes.push(KeyValue::new("weir.group", bound::attribute(g)));
    }
    if let Some(t) = msg.tenant_id.as_deref() {
        attributes.push(KeyValue::new("weir.tenant", bound::attribute(t)));
    }
    if let Some(n) = batch {
        attributes.push(KeyValue::new(
            "messaging.batch.message_count",
            i64::try_from(n).unwrap_or(i64::MAX),
        ));
    }
    let name = if batch.is_some() {
        "weir.call-batch"
    } else {
        "weir.call"
    };
    let span = tracer
        .span_builder(name)
        .with_kind(SpanKind::Internal)
        .with_attributes(attributes)
        .start_with_context(tracer, &parent);
    Some(Call(span))
}

impl Call {
    /// Point each cascade's `traceparent` at this call (its `weir.publish`
    /// span will be the call's child).
    pub fn parent_of<'a>(&self, cascades: impl Iterator<Item = &'a mut Envelope>) {
        let tp = traceparent(self.0.span_context());
        for c in cascades {
            set_header(&mut c.headers, TRACEPARENT, tp.clone());
        }
    }

    /// End the call with its outcome (`ok`, `retry`, `reject`, a fault's
    /// kind) and, for a failure, why.
    pub fn end(mut self, outcome: &'static str, error: Option<&str>) {
        self.0.set_attribute(KeyValue::new("weir.outcome", outcome));
        if let Some(e) = error {
            self.0.set_status(Status::Error {
                description: Cow::Owned(e.chars().take(512).collect()),
            });
        }
        self.0.end();
    }
}

/// A cascade's `weir.publish` span, from the publish to the broker's confirm.
pub struct Publish(Span);

/// Start the publish span of `cascade` (a child of the call that made it,
/// through its `traceparent`) and point its `traceparent` at this span, so
/// the cascade's own receive is its child. `None` when traces are off.
pub fn publish(cascade: &mut Envelope, topology: &str) -> Option<Publish> {
    let tracer = tracer()?;
    let parent = parent_of(&cascade.headers);
    let span = tracer
        .span_builder("weir.publish")
        .with_kind(SpanKind::Producer)
        .with_attributes([
            KeyValue::new("messaging.system", "weir"),
            KeyValue::new("messaging.operation.type", "send"),
            KeyValue::new("messaging.destination.name", topology.to_owned()),
            KeyValue::new("messaging.message.id", bound::attribute(&cascade.id)),
            KeyValue::new("weir.message_type", bound::attribute(&cascade.message_type)),
        ])
        .start_with_context(tracer, &parent);
    set_header(&mut cascade.headers, TRACEPARENT, traceparent(span.span_context()));
    Some(Publish(span))
}

impl Publish {
    /// End it; a publish the broker did not confirm is an error.
    pub fn end(mut self, error: Option<&dyn std::fmt::Display>) {
        if let Some(e) = error {
            self.0.set_status(Status::Error {
                description: Cow::Owned(bound::attribute(&e.to_string())),
            });
        }
        self.0.end();
    }
}

/// With traces off: a cascade that names no trace of its own continues its
/// cause's (`traceparent` and `tracestate` copied), so a trace started by a
/// publisher survives a node that does not record it. Only a valid
/// `traceparent` is copied, and its `tracestate` within the W3C limits
/// ([`bound`]).
pub fn inherit<'a>(cause: &Envelope, cascades: impl Iterator<Item = &'a mut Envelope>) {
    let Headers {
        traceparent: Some(tp),
        tracestate: state,
    } = Headers::of(&cause.headers)
    else {
        return;
    };
    for c in cascades {
        if header(&c.headers, TRACEPARENT).is_none() {
            c.headers.push((TRACEPARENT.to_owned(), tp.clone()));
            if let Some(s) = &state {
                set_header(&mut c.headers, TRACESTATE, s.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg() -> Envelope {
        crate::envelope::new_message("m".into(), "t", None, None, Vec::new(), Vec::new())
    }

    #[test]
    fn the_collector_url_gets_its_path_once() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/v1/traces"), "http://c:4318/v1/traces");
    }

    #[test]
    fn a_traceparent_is_read_and_written_in_the_w3c_form() {
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let cx = parent_of(&[(TRACEPARENT.to_owned(), tp.to_owned())]);
        let sc = cx.span().span_context().clone();
        assert!(sc.is_valid() && sc.is_remote() && sc.is_sampled());
        assert_eq!(traceparent(&sc), tp);
        // A malformed one is no parent at all (the span starts a new trace).
        let bad = parent_of(&[(TRACEPARENT.to_owned(), "00-zz-yy-01".to_owned())]);
        assert!(!bad.span().span_context().is_valid());
    }

    #[test]
    fn a_cascade_inherits_its_causes_trace_unless_it_names_its_own() {
        let mut cause = msg();
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        cause.headers.push((TRACEPARENT.to_owned(), tp.to_owned()));
        cause.headers.push((TRACESTATE.to_owned(), "k=v".to_owned()));
        let mut plain = msg();
        let mut own = msg();
        own.headers.push((TRACEPARENT.to_owned(), "00-c-d-01".to_owned()));
        inherit(&cause, [&mut plain, &mut own].into_iter());
        assert_eq!(header(&plain.headers, TRACEPARENT), Some(tp));
        assert_eq!(header(&plain.headers, TRACESTATE), Some("k=v"));
        assert_eq!(header(&own.headers, TRACEPARENT), Some("00-c-d-01"));
    }

    /// Issue 33, item 5: a publisher's oversized trace context is not copied
    /// as received: an invalid `traceparent` (a 100 003-byte one) carries
    /// nothing, and a 120 000-byte `tracestate` is cut to the W3C limits.
    #[test]
    fn a_cascade_inherits_no_more_than_the_w3c_limits() {
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let mut huge_parent = msg();
        huge_parent.headers.push((
            TRACEPARENT.to_owned(),
            format!("{tp}{}", "0".repeat(100_003 - tp.len())),
        ));
        huge_parent.headers.push((TRACESTATE.to_owned(), "k=v".to_owned()));
        let mut c = msg();
        inherit(&huge_parent, std::iter::once(&mut c));
        assert!(
            c.headers.is_empty(),
            "an invalid traceparent is ignored: {:?}",
            c.headers.len()
        );

        let mut huge_state = msg();
        huge_state.headers.push((TRACEPARENT.to_owned(), tp.to_owned()));
        let members: Vec<String> = (0..1000).map(|i| format!("k{i}={}", "v".repeat(110))).collect();
        let state = members.join(",");
        assert!(state.len() >= 110_000);
        huge_state.headers.push((TRACESTATE.to_owned(), state));
        let mut c = msg();
        inherit(&huge_state, std::iter::once(&mut c));
        assert_eq!(header(&c.headers, TRACEPARENT), Some(tp));
        let cut = header(&c.headers, TRACESTATE).unwrap();
        assert!(cut.len() <= bound::TRACESTATE_BYTES, "{} bytes", cut.len());
        assert!(cut.split(',').count() <= bound::TRACESTATE_MEMBERS);
        assert!(cut.starts_with("k0="));
    }
}
