#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! One behaviour suite for the orders handler in every language Weir ships it in:
//! Rust (`examples/rust/orders`), Python (`examples/python/orders`, componentize-py)
//! and JavaScript (`examples/js/orders`, ComponentizeJS), all built by `host/build.rs`.
//!
//! Each behaviour is a function of the language; [`languages!`] makes one test per
//! (language, behaviour), so a behaviour added here runs for every language or the
//! suite does not compile. Asserted: decoding and the cascaded `order.accepted` (exact
//! payload, group, tenant and header), the order checks and their reasons, malformed
//! input rejected (never a trap) without poisoning the instance, the simulated
//! transient failure, `handle-batch` (one result per message, repeated lines), the
//! handler end to end on a node over the memory broker (cascade through the broker,
//! batches, dead letters), and that a large guest keeps one instance per worker.
//!
//! Everything runs with the runtime's and the handler's default limits: they must fit
//! a Python component of tens of MiB. Compiled code is cached under the test scratch
//! directory, so only the first run compiles the large components.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use weir::config::{self, Config, RetrySection};
use weir::envelope::{self, Envelope, header};
use weir::node::{Node, NodeOptions, bundled};
use weir::observe::ledger::Ledger;
use weir::outcome::SettleObserver;
use weir::outcome::{Outcome, Reason};
use weir::runtime::bindings::weir::handler::types::Failure;
use weir::runtime::{
    BatchOutcome, CallObserver, CallOutcome, Executor, HandlerSettings, HandlerVersion, InstanceMode, Outgoing,
    Runtime, RuntimeOptions,
};
use weir::transport::memory::MemoryBroker;

mod built {
    include!(concat!(env!("OUT_DIR"), "/polyglot.rs"));
}

/// A language the orders handler is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lang {
    Rust,
    Python,
    Js,
}

impl Lang {
    /// What a `[[handler]]` entry names as its component.
    fn component(self) -> PathBuf {
        match self {
            Lang::Rust => "bundled:orders".into(),
            Lang::Python => built::ORDERS_PY.into(),
            Lang::Js => built::ORDERS_JS.into(),
        }
    }

    fn bytes(self) -> Vec<u8> {
        match self {
            Lang::Rust => bundled::ORDERS.to_vec(),
            Lang::Python | Lang::Js => {
                let path = self.component();
                std::fs::read(&path).unwrap_or_else(|e| {
                    panic!(
                        "the {self:?} orders handler at {} is missing ({e}): host/build.rs builds it \
                         unless WEIR_SKIP_POLYGLOT_BUILD or WEIR_SKIP_GUEST_BUILD is set",
                        path.display()
                    )
                })
            }
        }
    }
}

/// Default runtime options, with the compiled-code cache in the test scratch directory.
fn options() -> RuntimeOptions {
    RuntimeOptions {
        cache_dir: Some(PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("weir-compiled-guests")),
        ..RuntimeOptions::default()
    }
}

fn runtime() -> Arc<Runtime> {
    static RT: OnceLock<Arc<Runtime>> = OnceLock::new();
    RT.get_or_init(|| Runtime::new(options()).expect("runtime starts"))
        .clone()
}

/// `lang`'s handler with default settings and this config table. The first load of a
/// language compiles it (or reads the cache); tests of one language wait for it
/// rather than each compiling 30 MiB at once.
fn load_on(rt: &Runtime, lang: Lang, config: &[(&str, &str)], mode: InstanceMode) -> Arc<HandlerVersion> {
    static WARM: [OnceLock<()>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let bytes = lang.bytes();
    let origin = format!("the {lang:?} orders handler");
    WARM[lang as usize].get_or_init(|| {
        let started = Instant::now();
        rt.load(&bytes, HandlerSettings::new("warm-up"), &origin)
            .unwrap_or_else(|e| panic!("{origin} loads: {e:#}"));
        eprintln!("{origin}: {} bytes, first load {:?}", bytes.len(), started.elapsed());
    });
    let mut settings = HandlerSettings::new(format!("orders-{lang:?}"));
    settings.instance_mode = mode;
    settings.config = config.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect();
    rt.load(&bytes, settings, &origin)
        .unwrap_or_else(|e| panic!("{origin} loads: {e:#}"))
}

fn load(lang: Lang, config: &[(&str, &str)]) -> Arc<HandlerVersion> {
    load_on(&runtime(), lang, config, InstanceMode::Reuse)
}

fn msg(id: &str, message_type: &str, group: Option<&str>, payload: impl Into<Vec<u8>>) -> Envelope {
    envelope::new_message(
        id.into(),
        message_type,
        group.map(str::to_owned),
        Some("acme".into()),
        Vec::new(),
        payload.into(),
    )
}

fn order() -> serde_json::Value {
    serde_json::json!({ "order_id": "o-1", "customer": "ada", "lines": [
        { "sku": "a", "qty": 2, "unit_price_cents": 150 },
        { "sku": "b", "qty": 1, "unit_price_cents": 99 },
    ]})
}

fn placed(payload: &serde_json::Value) -> Envelope {
    msg("m-1", "order.placed", Some("ada"), payload.to_string())
}

fn line(id: &str, order: &str, sku: &str, qty: u32) -> Envelope {
    let payload = serde_json::json!({ "order_id": order, "sku": sku, "qty": qty, "unit_price_cents": 100 });
    msg(id, "order.line-added", Some(order), payload.to_string())
}

/// `handle` for one message: the guest's answer and what it published (panics on a fault).
fn call(exec: &mut Executor, v: &Arc<HandlerVersion>, m: &Envelope) -> (Result<(), Failure>, Vec<Outgoing>) {
    match exec.call(v, m, &None) {
        CallOutcome::Done { result, published } => (result, published),
        CallOutcome::Fault(f) => panic!(
            "{} ({}) faulted: {f}",
            m.message_type,
            String::from_utf8_lossy(&m.payload)
        ),
    }
}

/// `handle-batch`: the answers and what each member published (panics on a fault, or on a
/// publish that names no member: a 0.2.0 guest calls `begin-member` before each).
fn batch(
    exec: &mut Executor,
    v: &Arc<HandlerVersion>,
    members: &[Envelope],
) -> (Vec<Result<(), Failure>>, Vec<Vec<Outgoing>>) {
    match exec.call_batch(v, members, &None) {
        BatchOutcome::Done {
            results,
            published,
            unattributed,
        } => {
            assert!(
                unattributed.is_empty(),
                "the batch published for no member: {unattributed:?}"
            );
            (results, published)
        }
        BatchOutcome::Fault(f) => panic!("handle-batch of {} faulted: {f}", members.len()),
    }
}

fn rejection(result: &Result<(), Failure>) -> &str {
    match result {
        Err(Failure::Reject(reason)) => reason,
        other => panic!("expected a reject, got {other:?}"),
    }
}

fn retry_reason(result: &Result<(), Failure>) -> &str {
    match result {
        Err(Failure::Retry(reason)) => reason,
        other => panic!("expected a retry, got {other:?}"),
    }
}

fn assert_ok(result: &Result<(), Failure>, what: &str) {
    assert!(result.is_ok(), "{what}: {result:?}");
}

fn assert_announced(out: &Outgoing, payload: &str, group: &str) {
    let e = &out.envelope;
    assert_eq!(e.message_type, "order.accepted");
    assert_eq!(e.group_id.as_deref(), Some(group), "published in the order's group");
    assert_eq!(e.tenant_id.as_deref(), Some("acme"), "inherits the tenant");
    assert_eq!(String::from_utf8_lossy(&e.payload), payload);
    assert_eq!(
        e.headers,
        vec![("content-type".to_owned(), "application/json".to_owned())]
    );
}

/// Decode, check, and announce: an accepted `order.placed` publishes exactly one
/// `order.accepted` in its group; `order.paid` publishes nothing; unknown fields are ignored.
fn accepted_order_is_announced_in_its_group(lang: Lang) {
    let v = load(lang, &[]);
    let mut exec = Executor::new(runtime());
    let (result, published) = call(&mut exec, &v, &placed(&order()));
    assert_ok(&result, "the valid order");
    assert_eq!(published.len(), 1, "one cascade");
    assert_announced(
        &published[0],
        r#"{"order_id":"o-1","total_cents":399,"currency":"EUR"}"#,
        "ada",
    );

    let mut extra = order();
    extra["note"] = "leave at the door".into();
    extra["currency"] = "CHF".into();
    let (result, published) = call(&mut exec, &v, &placed(&extra));
    assert_ok(&result, "unknown fields are ignored");
    assert_announced(
        &published[0],
        r#"{"order_id":"o-1","total_cents":399,"currency":"CHF"}"#,
        "ada",
    );

    let paid = msg("m-2", "order.paid", Some("ada"), order().to_string());
    let (result, published) = call(&mut exec, &v, &paid);
    assert_ok(&result, "the valid order");
    assert!(published.is_empty(), "a payment cascades nothing");
}

/// The order checks, with `currency = USD` configured: each invalid order is rejected
/// with the order, the customer and the reason, and nothing is published.
fn invalid_orders_are_rejected_with_a_reason(lang: Lang) {
    let v = load(lang, &[("currency", "USD")]);
    let mut exec = Executor::new(runtime());
    let with = |key: &str, value: serde_json::Value| {
        let mut o = order();
        o[key] = value;
        o
    };
    let cases = [
        (with("lines", serde_json::json!([])), "no lines"),
        (with("order_id", "".into()), "empty order_id"),
        (
            with(
                "lines",
                serde_json::json!([{ "sku": "a", "qty": 0, "unit_price_cents": 1 }]),
            ),
            r#"line 0 ("a") has qty 0"#,
        ),
        (
            with("currency", "EUR".into()),
            r#"currency "EUR", this shop accepts only "USD""#,
        ),
        (
            // 2^62 * 4 = 2^64: one past u64::MAX (and exact in a double, for JavaScript).
            with(
                "lines",
                serde_json::json!([{ "sku": "big", "qty": 4, "unit_price_cents": 4_611_686_018_427_387_904u64 }]),
            ),
            r#"line 0 ("big") overflows the total"#,
        ),
    ];
    for (payload, reason) in cases {
        let (result, published) = call(&mut exec, &v, &placed(&payload));
        let text = rejection(&result);
        assert!(text.contains(reason), "{lang:?}, {payload}: {text}");
        assert!(
            text.contains(r#"invalid order"#) && text.contains(r#"from "ada""#),
            "{lang:?}: {text}"
        );
        assert!(published.is_empty());
    }
    // The configured currency fills a missing one.
    let (result, published) = call(&mut exec, &v, &placed(&order()));
    assert_ok(&result, "the valid order");
    assert_announced(
        &published[0],
        r#"{"order_id":"o-1","total_cents":399,"currency":"USD"}"#,
        "ada",
    );
}

/// Malformed input is a reject (dead letter), not a trap, and leaves the instance
/// fit for the next message.
fn malformed_input_is_rejected_not_trapped(lang: Lang) {
    let v = load(lang, &[]);
    let mut exec = Executor::new(runtime());
    let with_line = |line: serde_json::Value| {
        let mut o = order();
        o["lines"] = serde_json::json!([line]);
        o.to_string().into_bytes()
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "truncated JSON",
            br#"{"order_id": "broken", "lines": [ {"sku": "#.to_vec(),
        ),
        ("not UTF-8", vec![0xff, 0xfe, 0x7b]),
        ("empty", Vec::new()),
        ("an array", b"[]".to_vec()),
        ("a string", br#""o-1""#.to_vec()),
        ("missing fields", br#"{"order_id":"o-1"}"#.to_vec()),
        (
            "customer not a string",
            br#"{"order_id":"o-1","customer":7,"lines":[]}"#.to_vec(),
        ),
        (
            "lines not a list",
            br#"{"order_id":"o-1","customer":"ada","lines":{}}"#.to_vec(),
        ),
        (
            "qty as a string",
            with_line(serde_json::json!({ "sku": "a", "qty": "2", "unit_price_cents": 1 })),
        ),
        (
            "negative qty",
            with_line(serde_json::json!({ "sku": "a", "qty": -1, "unit_price_cents": 1 })),
        ),
        (
            "fractional qty",
            with_line(serde_json::json!({ "sku": "a", "qty": 1.5, "unit_price_cents": 1 })),
        ),
        (
            "qty over u32",
            with_line(serde_json::json!({ "sku": "a", "qty": 4_294_967_296u64, "unit_price_cents": 1 })),
        ),
        (
            "line without a price",
            with_line(serde_json::json!({ "sku": "a", "qty": 1 })),
        ),
    ];
    for (what, payload) in cases {
        let (result, published) = call(&mut exec, &v, &msg("m-bad", "order.placed", Some("ada"), payload));
        let text = rejection(&result);
        assert!(
            text.contains(r#"payload of "order.placed" is not a valid"#),
            "{lang:?}, {what}: {text}"
        );
        assert!(published.is_empty());
    }
    let bad_line = msg(
        "l-bad",
        "order.line-added",
        Some("o-1"),
        br#"{"order_id":"o-1"}"#.to_vec(),
    );
    let text = call(&mut exec, &v, &bad_line).0;
    assert!(
        rejection(&text).contains(r#"payload of "order.line-added" is not a valid"#),
        "{lang:?}: {text:?}"
    );
    let unknown = msg("m-x", "order.refunded", Some("ada"), order().to_string());
    let text = call(&mut exec, &v, &unknown).0;
    assert_eq!(rejection(&text), r#"unknown message type "order.refunded""#);

    let (result, published) = call(&mut exec, &v, &placed(&order()));
    assert_ok(&result, "the same instance goes on");
    assert_eq!(published.len(), 1);
}

/// `simulate: "transient"` fails the first two attempts with a retry, then succeeds.
fn simulated_transient_failure_succeeds_on_the_third_attempt(lang: Lang) {
    let v = load(lang, &[]);
    let mut exec = Executor::new(runtime());
    let mut payload = order();
    payload["simulate"] = "transient".into();
    for attempt in 1..=2 {
        let mut m = placed(&payload);
        m.attempt = attempt;
        let (result, published) = call(&mut exec, &v, &m);
        assert_eq!(
            retry_reason(&result),
            "simulated transient failure",
            "attempt {attempt}"
        );
        assert!(published.is_empty());
    }
    let mut m = placed(&payload);
    m.attempt = 3;
    let (result, published) = call(&mut exec, &v, &m);
    assert_ok(&result, "the valid order");
    assert_eq!(published.len(), 1);
}

/// `handle-batch`: one result per message in order; a bad member fails alone; lines are
/// checked in one pass and a line repeated within the batch is rejected.
fn batch_answers_each_member_in_order(lang: Lang) {
    let v = load(lang, &[]);
    let mut exec = Executor::new(runtime());
    let members = vec![
        placed(&order()),
        msg("m-2", "order.shipped", Some("ada"), "{}"),
        placed(&serde_json::json!([])),
        {
            let mut o = order();
            o["simulate"] = "transient".into();
            placed(&o)
        },
    ];
    let (results, published) = batch(&mut exec, &v, &members);
    assert_eq!(results.len(), 4);
    assert_ok(&results[0], "the valid order");
    assert_eq!(rejection(&results[1]), r#"unknown message type "order.shipped""#);
    assert!(rejection(&results[2]).contains("is not a valid"));
    assert_eq!(retry_reason(&results[3]), "simulated transient failure");
    let counts: Vec<usize> = published.iter().map(Vec::len).collect();
    assert_eq!(counts, [1, 0, 0, 0], "only the accepted order cascades, as its own");
    assert_eq!(published[0][0].envelope.id, envelope::cascade_id(&members[0], 0));

    let lines = vec![
        line("l-1", "o-1", "a", 1),
        line("l-2", "o-1", "b", 0),
        line("l-3", "o-1", "a", 2),
        line("l-4", "o-1", "c", 3),
        line("l-5", "o-2", "a", 1),
    ];
    let (results, published) = batch(&mut exec, &v, &lines);
    assert_eq!(results.len(), 5);
    assert!(
        results[0].is_ok() && results[3].is_ok() && results[4].is_ok(),
        "{results:?}"
    );
    assert_eq!(rejection(&results[1]), r#"order "o-1": line "b" has qty 0"#);
    assert_eq!(
        rejection(&results[2]),
        r#"order "o-1": sku "a" added twice in one batch"#
    );
    assert!(published.iter().all(Vec::is_empty));
    // Alone, a line is checked the same way (and never counts as a repeat).
    assert_ok(&call(&mut exec, &v, &line("l-6", "o-1", "a", 1)).0, "a line alone");
    let no_sku = call(&mut exec, &v, &line("l-7", "o-2", "", 1)).0;
    assert_eq!(rejection(&no_sku), r#"order "o-2": line without sku"#);
    let no_order = call(&mut exec, &v, &line("l-8", "", "a", 1)).0;
    assert_eq!(rejection(&no_order), "order line without order_id");
}

/// Every call's message, in call order (batch members one by one), beside a ledger.
#[derive(Default)]
struct Seen {
    ledger: Ledger,
    calls: Mutex<Vec<Envelope>>,
}

impl CallObserver for Seen {
    fn before(&self, msg: &Envelope) {
        self.ledger.before(msg);
        self.calls.lock().push(msg.clone());
    }
    fn after(&self, msg: &Envelope) {
        self.ledger.after(msg);
    }
    fn before_batch(&self, batch: &[Envelope]) {
        self.ledger.before_batch(batch);
        self.calls.lock().extend(batch.iter().cloned());
    }
    fn after_batch(&self, batch: &[Envelope]) {
        self.ledger.after_batch(batch);
    }
}

impl SettleObserver for Seen {
    fn settled(&self, id: &str, outcome: Outcome) {
        self.ledger.settled(id, outcome);
    }
}

/// On a node over the memory broker, with the config a user would write: orders are
/// handled and their `order.accepted` goes through the broker to the next handler;
/// lines arrive in batches; poison messages are dead-lettered with the handler's reason.
fn runs_on_a_node_end_to_end(lang: Lang) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let topology = "orders";
        let mut t = config::Topology::new(topology, 2);
        t.retry = Some(RetrySection {
            ladder: Some(vec![Duration::from_millis(20)]),
            max_deliver: Some(3),
            ..Default::default()
        });
        let mut orders = config::Handler::new(
            "orders",
            lang.component(),
            topology,
            vec!["order.placed".into(), "order.paid".into()],
        );
        orders.batch = Some(config::Batch {
            message_types: vec!["order.line-added".into()],
            size: 8,
            linger: Duration::from_millis(200),
        });
        let notify = config::Handler::new("notify", "bundled:noop", topology, vec!["order.accepted".into()]);
        let cfg = Config {
            node: config::Node {
                name: format!("polyglot-{lang:?}"),
                admin: None,
                ..config::Node::default()
            },
            transport: config::Transport::default(),
            cluster: config::Cluster::default(),
            topology: vec![t],
            handler: vec![orders, notify],
            tenant: Vec::new(),
            telemetry: Default::default(),
            origin: "<polyglot test>".into(),
        };
        let broker = MemoryBroker::new();
        let seen = Arc::new(Seen::default());
        let opts = NodeOptions {
            workers: 2,
            runtime: options(),
            call_observer: Some(seen.clone()),
            settle_observer: Some(seen.clone()),
            ..NodeOptions::default()
        };
        let node = Node::start(&cfg, Arc::new(broker.clone()), opts)
            .await
            .expect("the node starts");

        let mut expected = HashMap::new();
        let mut publish = |env: Envelope, outcome: Outcome| {
            expected.insert(env.id.clone(), outcome);
            env
        };
        let mut sent = Vec::new();
        for (i, customer) in ["ada", "bob", "cy"].iter().enumerate() {
            let mut o = order();
            o["order_id"] = format!("o-{i}").into();
            o["customer"] = (*customer).into();
            let env = envelope::new_message(
                envelope::fresh_id(),
                "order.placed",
                Some((*customer).into()),
                None,
                Vec::new(),
                o.to_string().into_bytes(),
            );
            sent.push(publish(env, Outcome::Handled));
        }
        let poison = envelope::new_message(
            envelope::fresh_id(),
            "order.placed",
            Some("ada".into()),
            None,
            Vec::new(),
            br#"{"order_id": "broken", "lines": [ {"sku": "#.to_vec(),
        );
        sent.push(publish(poison, Outcome::DeadLettered(Reason::Rejected)));
        for (sku, qty, outcome) in [
            ("a", 1, Outcome::Handled),
            ("b", 0, Outcome::DeadLettered(Reason::Rejected)),
            ("a", 2, Outcome::DeadLettered(Reason::Rejected)),
            ("c", 3, Outcome::Handled),
        ] {
            let mut env = line("", "o-9", sku, qty);
            env.id = envelope::fresh_id();
            env.tenant_id = None;
            sent.push(publish(env, outcome));
        }
        for env in &sent {
            node.publish(topology, env).await.expect("confirmed publish");
        }

        let started = Instant::now();
        let accepted = loop {
            let outcomes = seen.ledger.outcomes();
            let accepted: Vec<Envelope> = seen
                .calls
                .lock()
                .iter()
                .filter(|c| c.message_type == "order.accepted")
                .cloned()
                .collect();
            let settled = |id: &String| outcomes.get(id).is_some_and(|o| !matches!(o, Outcome::RetryScheduled));
            if expected.keys().all(settled)
                && accepted.len() == 3
                && accepted.iter().all(|a| outcomes.get(&a.id) == Some(&Outcome::Handled))
            {
                break accepted;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{lang:?}: timed out; outcomes {outcomes:?}, {} accepted",
                accepted.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        node.shutdown().await.expect("node drains");

        let outcomes = seen.ledger.outcomes();
        for (id, outcome) in &expected {
            assert_eq!(outcomes.get(id), Some(outcome), "{lang:?}: message {id}");
        }
        let mut totals: Vec<(Option<String>, String)> = accepted
            .iter()
            .map(|a| (a.group_id.clone(), String::from_utf8_lossy(&a.payload).into_owned()))
            .collect();
        totals.sort();
        assert_eq!(
            totals,
            ["ada", "bob", "cy"]
                .iter()
                .enumerate()
                .map(|(i, c)| (
                    Some((*c).to_owned()),
                    format!(r#"{{"order_id":"o-{i}","total_cents":399,"currency":"EUR"}}"#)
                ))
                .collect::<Vec<_>>(),
            "{lang:?}: each accepted order went through the broker in its group"
        );
        let lines = seen
            .calls
            .lock()
            .iter()
            .filter(|c| c.message_type == "order.line-added")
            .count();
        assert!(lines >= 4, "{lang:?}: every line reached the handler");
        assert!(seen.ledger.batches() >= 1, "{lang:?}: lines arrived in batches");

        let mut reasons: Vec<String> = broker
            .dead_letters(topology)
            .iter()
            .filter_map(|w| w.header(header::ERROR).map(str::to_owned))
            .collect();
        reasons.sort();
        assert_eq!(reasons.len(), 3, "{lang:?}: {reasons:?}");
        assert!(reasons.iter().any(|r| r.contains("is not a valid")), "{reasons:?}");
        assert!(
            reasons.iter().any(|r| r.contains(r#"line "b" has qty 0"#)),
            "{reasons:?}"
        );
        assert!(
            reasons.iter().any(|r| r.contains("added twice in one batch")),
            "{reasons:?}"
        );
        assert_eq!(broker.total_depth(topology), 0, "nothing left on the broker");
    });
}

/// In reuse mode a worker instantiates a handler once and keeps that instance between
/// messages (rejects included): instantiation stays off the per-message path, however
/// large the guest. Fresh mode, the control, keeps nothing between messages. Counted
/// with the pooling allocator's live instances, on a runtime of the test's own.
fn one_instance_serves_every_message_in_reuse_mode(lang: Lang) {
    let rt = Runtime::new(options()).expect("runtime starts");
    let metrics = rt
        .engine()
        .pooling_allocator_metrics()
        .expect("the engine pools instances");
    for (mode, kept) in [(InstanceMode::Reuse, 1), (InstanceMode::Fresh, 0)] {
        let v = load_on(&rt, lang, &[], mode);
        let mut exec = Executor::new(rt.clone());
        assert_eq!(
            metrics.component_instances(),
            0,
            "{lang:?}: the load's probe instance is gone"
        );
        let started = Instant::now();
        for i in 0..40 {
            let m = if i % 4 == 3 {
                msg("m-bad", "order.placed", Some("ada"), "{")
            } else {
                placed(&order())
            };
            let (result, _) = call(&mut exec, &v, &m);
            assert_eq!(result.is_ok(), i % 4 != 3, "{lang:?}: message {i}: {result:?}");
            assert_eq!(
                metrics.component_instances(),
                kept,
                "{lang:?}, {mode:?}: live instances after message {i}"
            );
        }
        eprintln!(
            "{lang:?} {mode:?}: 40 messages in {:?}; one instance is {} core instances, {} memories, {} tables",
            started.elapsed(),
            metrics.core_instances(),
            metrics.memories(),
            metrics.tables()
        );
        drop(exec);
        assert_eq!(metrics.component_instances(), 0, "the worker's instance goes with it");
    }
}

/// The pool keeps room for `pool_instances` live instances of the handler, whatever
/// its language: here 16 workers each keep one. (A Python instance is 14 core
/// instances; the pool once budgeted 8 per component, and stopped at the 10th.)
fn the_pool_holds_pool_instances_of_it(lang: Lang) {
    const N: u32 = 16;
    let rt = Runtime::new(RuntimeOptions {
        pool_instances: N,
        ..options()
    })
    .expect("runtime starts");
    let v = load_on(&rt, lang, &[], InstanceMode::Reuse);
    let mut workers: Vec<Executor> = (0..N).map(|_| Executor::new(rt.clone())).collect();
    for (i, exec) in workers.iter_mut().enumerate() {
        let (result, _) = call(exec, &v, &placed(&order()));
        assert_ok(&result, &format!("{lang:?}: worker {i}"));
    }
    let metrics = rt
        .engine()
        .pooling_allocator_metrics()
        .expect("the engine pools instances");
    assert_eq!(metrics.component_instances(), u64::from(N));
}

/// One test per (language, behaviour): `rust::x`, `python::x`, `js::x`.
macro_rules! languages {
    ($($behaviour:ident),* $(,)?) => {
        mod rust {
            $(#[test] fn $behaviour() { super::$behaviour(super::Lang::Rust) })*
        }
        mod python {
            $(#[test] fn $behaviour() { super::$behaviour(super::Lang::Python) })*
        }
        mod js {
            $(#[test] fn $behaviour() { super::$behaviour(super::Lang::Js) })*
        }
    };
}

languages!(
    accepted_order_is_announced_in_its_group,
    invalid_orders_are_rejected_with_a_reason,
    malformed_input_is_rejected_not_trapped,
    simulated_transient_failure_succeeds_on_the_third_attempt,
    batch_answers_each_member_in_order,
    runs_on_a_node_end_to_end,
    one_instance_serves_every_message_in_reuse_mode,
    the_pool_holds_pool_instances_of_it,
);
