//! Issue 19, traces: a `weir run` node with `[telemetry]` pointed at an OTLP
//! receiver this test runs itself. A message published with a W3C
//! `traceparent` (a "publisher" span of the test's own) is handled by a
//! handler that publishes a cascade; after SIGTERM (whose drain flushes the
//! last spans) the receiver must hold one trace, under the publisher's
//! span: receive → call → publish → the cascade's receive → its call, and
//! each message's settle under its receive, with the attributes the issue
//! names. The tree is printed. A second message, of another trace, fails
//! twice: both attempts must hang under its publisher (a retry carries the
//! context it arrived with), settled `retry` then `dead-letter`. The
//! checkers' negative controls: the same spans with the cascade's link cut,
//! or with attempt 2 chained under attempt 1, must fail.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::http::{call, free_port};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message as _;

const TOKEN: &str = "traces-test-token";
/// The publisher's span: the trace the node must continue.
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PUBLISHER_SPAN: &str = "00f067aa0ba902b7";
/// The publisher of the message that fails.
const RETRY_TRACE: &str = "5bf92f3577b34da6a3ce929d0e0e4737";
const RETRY_PUBLISHER: &str = "10f067aa0ba902b8";

/// One span as the receiver got it.
#[derive(Clone, Debug)]
struct Got {
    trace: String,
    id: String,
    parent: String,
    name: String,
    attributes: BTreeMap<String, String>,
    service: String,
    /// Its W3C trace state.
    state: String,
}

/// An OTLP/HTTP (protobuf) receiver on `port`: every span exported to
/// `/v1/traces`, in arrival order.
fn receiver(port: u16) -> Arc<Mutex<Vec<Got>>> {
    let spans = Arc::new(Mutex::new(Vec::new()));
    let keep = spans.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let app = axum::Router::new().route(
                "/v1/traces",
                axum::routing::post(move |body: bytes::Bytes| {
                    let keep = keep.clone();
                    async move {
                        let req = ExportTraceServiceRequest::decode(body).unwrap();
                        let mut got = keep.lock().unwrap();
                        for rs in req.resource_spans {
                            let service = rs
                                .resource
                                .iter()
                                .flat_map(|r| r.attributes.iter())
                                .find(|kv| kv.key == "service.name")
                                .map(|kv| text(kv.value.as_ref()))
                                .unwrap_or_default();
                            for s in rs.scope_spans.into_iter().flat_map(|ss| ss.spans) {
                                got.push(Got {
                                    trace: hex::encode(&s.trace_id),
                                    id: hex::encode(&s.span_id),
                                    parent: hex::encode(&s.parent_span_id),
                                    name: s.name.clone(),
                                    attributes: s
                                        .attributes
                                        .iter()
                                        .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
                                        .collect(),
                                    service: service.clone(),
                                    state: s.trace_state.clone(),
                                });
                            }
                        }
                        // An empty ExportTraceServiceResponse.
                        (
                            [(axum::http::header::CONTENT_TYPE, "application/x-protobuf")],
                            Vec::<u8>::new(),
                        )
                    }
                }),
            );
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    spans
}

fn text(v: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

/// The spans as a tree under the publisher's span, one line each.
fn render(spans: &[Got]) -> String {
    fn walk(spans: &[Got], parent: &str, depth: usize, out: &mut String) {
        for s in spans.iter().filter(|s| s.parent == parent) {
            let keys = [
                "messaging.message.id",
                "weir.message_type",
                "weir.slot",
                "weir.group",
                "weir.handler",
                "weir.attempt",
                "weir.outcome",
            ];
            let attrs: Vec<String> = keys
                .iter()
                .filter_map(|k| {
                    s.attributes
                        .get(*k)
                        .map(|v| format!("{}={v}", k.rsplit('.').next().unwrap_or(k)))
                })
                .collect();
            out.push_str(&format!(
                "{}{} [{}] {}\n",
                "  ".repeat(depth),
                s.name,
                s.id,
                attrs.join(" ")
            ));
            walk(spans, &s.id, depth + 1, out);
        }
    }
    let mut out = format!("publisher [{PUBLISHER_SPAN}] (trace {TRACE_ID})\n");
    walk(spans, PUBLISHER_SPAN, 1, &mut out);
    out
}

/// The one span called `name` whose parent is `parent` (and, when given,
/// whose `weir.message_type` is `ty`).
fn child<'a>(spans: &'a [Got], parent: &str, name: &str, ty: Option<&str>) -> Result<&'a Got, String> {
    let found: Vec<&Got> = spans
        .iter()
        .filter(|s| s.parent == parent && s.name == name)
        .filter(|s| ty.is_none_or(|t| s.attributes.get("weir.message_type").map(String::as_str) == Some(t)))
        .collect();
    match found.as_slice() {
        [one] => Ok(one),
        other => Err(format!(
            "expected one {name} span{} under {parent}, found {}",
            ty.map(|t| format!(" of type {t}")).unwrap_or_default(),
            other.len()
        )),
    }
}

fn attr(s: &Got, key: &str, want: &str) -> Result<(), String> {
    match s.attributes.get(key) {
        Some(v) if v == want => Ok(()),
        other => Err(format!("{} [{}]: {key} is {other:?}, expected {want:?}", s.name, s.id)),
    }
}

fn present(s: &Got, key: &str) -> Result<(), String> {
    match s.attributes.get(key) {
        Some(v) if !v.is_empty() => Ok(()),
        _ => Err(format!("{} [{}] has no {key}", s.name, s.id)),
    }
}

/// The trace the issue asks for, or what is wrong with it.
fn check(spans: &[Got]) -> Result<(), String> {
    if let Some(s) = spans.iter().find(|s| s.trace != TRACE_ID) {
        return Err(format!(
            "{} [{}] is in trace {}, not the publisher's",
            s.name, s.id, s.trace
        ));
    }
    if let Some(s) = spans.iter().find(|s| s.service != "weir-traces-test") {
        return Err(format!("{} has service.name {:?}", s.name, s.service));
    }
    let receive = child(spans, PUBLISHER_SPAN, "weir.receive", Some("publish"))?;
    attr(receive, "weir.group", "order-7")?;
    attr(receive, "messaging.destination.name", "traced")?;
    attr(receive, "messaging.message.id", "traced-1")?;
    attr(receive, "weir.attempt", "1")?;
    present(receive, "weir.slot")?;
    let call = child(spans, &receive.id, "weir.call", None)?;
    attr(call, "weir.handler", "faulty")?;
    attr(call, "weir.outcome", "ok")?;
    attr(call, "weir.group", "order-7")?;
    attr(call, "weir.attempt", "1")?;
    present(call, "weir.handler.version")?;
    let settle = child(spans, &receive.id, "weir.settle", None)?;
    attr(settle, "weir.outcome", "ack")?;
    let publish = child(spans, &call.id, "weir.publish", None)?;
    attr(publish, "weir.message_type", "ok")?;
    let cascade = child(spans, &publish.id, "weir.receive", Some("ok"))?;
    attr(cascade, "weir.group", "order-7")?;
    let cascade_call = child(spans, &cascade.id, "weir.call", None)?;
    attr(cascade_call, "weir.outcome", "ok")?;
    let cascade_settle = child(spans, &cascade.id, "weir.settle", None)?;
    attr(cascade_settle, "weir.outcome", "ack")?;
    // receive, call, publish, settle; the cascade's receive, call, settle.
    if spans.len() != 7 {
        return Err(format!("expected 7 spans, got {}", spans.len()));
    }
    Ok(())
}

/// The failing message's trace: both attempts are the publisher's
/// children (a retry carries the context it arrived with), the first
/// settled `retry`, the second `dead-letter`, each call `retry`.
fn check_retried(spans: &[Got]) -> Result<(), String> {
    for (attempt, settled) in [("1", "retry"), ("2", "dead-letter")] {
        let receive = spans
            .iter()
            .find(|s| {
                s.name == "weir.receive"
                    && s.parent == RETRY_PUBLISHER
                    && s.attributes.get("weir.attempt").map(String::as_str) == Some(attempt)
            })
            .ok_or_else(|| format!("no weir.receive of attempt {attempt} under the publisher"))?;
        let call = child(spans, &receive.id, "weir.call", None)?;
        attr(call, "weir.outcome", "retry")?;
        attr(call, "weir.attempt", attempt)?;
        let settle = child(spans, &receive.id, "weir.settle", None)?;
        attr(settle, "weir.outcome", settled)?;
    }
    Ok(())
}

#[test]
fn a_publishers_trace_continues_through_the_handler_into_its_cascade() {
    let otlp = free_port();
    let spans = receiver(otlp);
    let admin = free_port();
    let config = format!(
        r#"
[node]
name = "traced"
admin = "127.0.0.1:{admin}"
admin_token = "{TOKEN}"
[telemetry]
endpoint = "http://127.0.0.1:{otlp}"
service_name = "weir-traces-test"
[[topology]]
name = "traced"
slots = 2
[topology.retry]
ladder = ["50ms"]
max_deliver = 2
[[handler]]
name = "faulty"
component = "{component}"
topology = "traced"
message_types = ["publish", "ok", "retry"]
"#,
        component = weir::node::bundled::FAULTY_PATH,
    );
    let mut cluster = Cluster::default();
    let node = cluster.start("traced", &config);
    assert!(
        cluster.nodes[node].log().contains("exporting traces"),
        "{}",
        cluster.nodes[node].log()
    );

    let body = serde_json::json!({
        "type": "publish",
        "group": "order-7",
        "id": "traced-1",
        "payload": "hello",
        "headers": { "traceparent": format!("00-{TRACE_ID}-{PUBLISHER_SPAN}-01") },
    });
    let (status, answer) = call(
        "POST",
        admin,
        "/v1/topologies/traced/messages",
        Some(TOKEN),
        body.to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{answer}");
    // A message of another trace that fails twice: a retry, then a dead letter.
    let failing = serde_json::json!({
        "type": "retry",
        "group": "order-8",
        "id": "traced-2",
        "payload": "x",
        "headers": { "traceparent": format!("00-{RETRY_TRACE}-{RETRY_PUBLISHER}-01") },
    });
    let (status, answer) = call(
        "POST",
        admin,
        "/v1/topologies/traced/messages",
        Some(TOKEN),
        failing.to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{answer}");

    // The message and its cascade handled, the failing one dead-lettered,
    // then a drain, which flushes the spans still queued (the exporter's own
    // interval is 5 s).
    let start = Instant::now();
    while {
        let r = cluster.report();
        r.handled().len() < 2
            || r.settled
                .get("traced-2")
                .is_none_or(|(_, o)| !o.starts_with("dead-lettered"))
    } {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "not handled; log:\n{}",
            cluster.nodes[node].log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    cluster.nodes[node].terminate(Duration::from_secs(30));

    let all = spans.lock().unwrap().clone();
    let (got, retried): (Vec<Got>, Vec<Got>) = all.into_iter().partition(|s| s.trace != RETRY_TRACE);
    println!("the trace the receiver got:\n{}", render(&got));
    if let Err(e) = check_retried(&retried) {
        panic!("{e}\nspans: {retried:#?}");
    }
    // Negative control: attempt 2 hung under attempt 1 (what a retry that
    // kept this node's context instead of the publisher's would give).
    let mut chained = retried.clone();
    let first = retried
        .iter()
        .find(|s| s.name == "weir.receive" && s.attributes.get("weir.attempt").map(String::as_str) == Some("1"))
        .unwrap()
        .id
        .clone();
    for s in chained
        .iter_mut()
        .filter(|s| s.name == "weir.receive" && s.attributes.get("weir.attempt").map(String::as_str) == Some("2"))
    {
        s.parent = first.clone();
    }
    assert!(check_retried(&chained).is_err(), "a chained retry must fail the check");
    if let Err(e) = check(&got) {
        panic!("{e}\nspans: {got:#?}\nlog:\n{}", cluster.nodes[node].log());
    }

    // Negative control: the cascade's receive hung under the first receive
    // (what a cascade that did not carry the trace would give) is caught.
    let mut cut = got.clone();
    let first = got
        .iter()
        .find(|s| s.name == "weir.receive" && s.parent == PUBLISHER_SPAN)
        .unwrap()
        .id
        .clone();
    for s in cut
        .iter_mut()
        .filter(|s| s.name == "weir.receive" && s.attributes.get("weir.message_type").map(String::as_str) == Some("ok"))
    {
        s.parent = first.clone();
    }
    let err = check(&cut).expect_err("a cut cascade link must fail the check");
    assert!(err.contains("weir.receive"), "{err}");
    // And a trace that never reached the node (another trace id) is caught too.
    let mut other = got.clone();
    other[0].trace = "0".repeat(32);
    assert!(check(&other).is_err());
}

#[test]
fn a_bad_telemetry_table_stops_the_start_naming_the_key() {
    for (table, key) in [
        ("endpoint = \"not a url\"", "telemetry.endpoint"),
        ("endpoint = \"https://collector:4318\"", "telemetry.endpoint"),
        (
            "endpoint = \"http://127.0.0.1:4318\"\nsampling = 1.5",
            "telemetry.sampling",
        ),
        ("endpoint = \"http://127.0.0.1:4318\"\nsampels = 0.5", "sampels"),
    ] {
        let text = format!(
            "[telemetry]\n{table}\n[[topology]]\nname = \"t\"\nslots = 1\n[[handler]]\nname = \"h\"\ncomponent = \"{}\"\ntopology = \"t\"\nmessage_types = [\"ok\"]\n",
            weir::node::bundled::FAULTY_PATH
        );
        let err = match weir::config::parse(&text, "telemetry.toml").and_then(|c| c.validate().map(|_| c)) {
            Ok(_) => panic!("{table:?} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(key), "{table:?}: {err}");
    }
}

/// Issue 33, item 5: attribute values a publisher controls (its message id,
/// group id and type, each up to the 4 096 bytes the admin API takes) reach
/// the collector cut to 256 bytes, and its trace state to the W3C limits.
/// Before the bound they were exported verbatim.
#[test]
fn a_publishers_oversized_values_are_cut_in_the_export() {
    let otlp = free_port();
    let spans = receiver(otlp);
    let admin = free_port();
    let config = format!(
        r#"
[node]
name = "traced-big"
admin = "127.0.0.1:{admin}"
admin_token = "{TOKEN}"
[telemetry]
endpoint = "http://127.0.0.1:{otlp}"
[[topology]]
name = "traced"
slots = 1
[[handler]]
name = "faulty"
component = "{component}"
topology = "traced"
message_types = ["publish", "ok"]
"#,
        component = weir::node::bundled::FAULTY_PATH,
    );
    let mut cluster = Cluster::default();
    let node = cluster.start("traced-big", &config);
    let big = |c: &str| c.repeat(4000);
    let members: Vec<String> = (0..36).map(|i| format!("k{i}={}", "v".repeat(100))).collect();
    let body = serde_json::json!({
        "type": "publish",
        "group": big("g"),
        "id": big("i"),
        "payload": "x",
        "headers": {
            "traceparent": format!("00-{TRACE_ID}-{PUBLISHER_SPAN}-01"),
            "tracestate": members.join(","),
        },
    });
    let (status, answer) = call(
        "POST",
        admin,
        "/v1/topologies/traced/messages",
        Some(TOKEN),
        body.to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{answer}");
    let start = Instant::now();
    while cluster.report().handled().len() < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "not handled; log:\n{}",
            cluster.nodes[node].log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    cluster.nodes[node].terminate(Duration::from_secs(30));
    let got = spans.lock().unwrap().clone();
    assert!(got.iter().any(|s| s.name == "weir.receive"), "no spans: {got:?}");
    for s in &got {
        for (k, v) in &s.attributes {
            assert!(v.len() <= 256, "{} {k} is {} bytes", s.name, v.len());
        }
        assert!(
            s.state.len() <= 512,
            "{}'s trace state is {} bytes",
            s.name,
            s.state.len()
        );
    }
    assert!(
        got.iter().any(|s| s.state.starts_with("k0=")),
        "the publisher's trace state is carried (cut)"
    );
    let group = got
        .iter()
        .find_map(|s| s.attributes.get("weir.group"))
        .expect("a span names the group");
    assert!(group.starts_with("ggg") && group.ends_with('…'), "{group}");
}
