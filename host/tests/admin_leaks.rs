//! Issue 32 item 5, the smaller leaks of the admin API, against the real
//! brokers, as a tenant would run them with its own token:
//! - `GET /v1/dead-letters` (and a redrive's or purge's dry run) answered
//!   `read` = every tenant's letter count to a tenant token; now a tenant's
//!   counts are of its own letters. Red baseline: the count before the fix
//!   (`NegativeControls::unscoped_read_count`) is every tenant's.
//! - `POST /v1/topologies/{T}/messages` took CR/LF (and spaces, `:`) in
//!   header names: RabbitMQ carried them to the handler, NATS refused them
//!   with 503. Now both answer 400 naming the header, and nothing is
//!   published. Red baseline (`NegativeControls::unchecked_header_names`):
//!   RabbitMQ delivers the injected name, NATS answers 503.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use weir::admin::NegativeControls;
use weir::config;
use weir::envelope::Envelope;
use weir::node::{Node, NodeOptions, bundled};
use weir::observe::CallObserver;
use weir::transport::Transport;
use weir::transport::nats::Nats;

use common::http::{call, free_port, wait_up};

const OPERATOR: &str = "leaks-operator-token-0123";
const ACME: &str = "leaks-acme-token-0123456";
const GLOBEX: &str = "leaks-globex-token-01234";

#[derive(Debug, Clone, Copy, PartialEq)]
enum Broker {
    Rabbit,
    Nats,
}

/// The user headers of every guest call.
#[derive(Default)]
struct Calls(Mutex<Vec<Vec<(String, String)>>>);

impl CallObserver for Calls {
    fn before(&self, msg: &Envelope) {
        self.0.lock().push(msg.headers.clone());
    }
    fn after(&self, _: &Envelope) {}
}

/// A node on `broker` with tenants acme and globex, the faulty guest taking
/// `ok` and `reject` from any tenant, and `controls` switched on.
struct Bed {
    node: Node,
    port: u16,
    topology: String,
    calls: Arc<Calls>,
    _guard: Box<dyn std::any::Any + Send>,
}

async fn bed(broker: Broker, controls: NegativeControls) -> Bed {
    let port = free_port();
    let (topology, transport, url, kind, guard): (
        String,
        Arc<dyn Transport>,
        String,
        &str,
        Box<dyn std::any::Any + Send>,
    ) = match broker {
        Broker::Rabbit => {
            let topo = common::rabbit::Topo::new(2, &[]);
            let t = Arc::new(common::rabbit::transport(format!("leaks {}", topo.name)));
            (topo.name.clone(), t, common::rabbit::url(), "rabbitmq", Box::new(topo))
        }
        Broker::Nats => {
            let topo = common::nats::Topo::new();
            let t = Arc::new(Nats::new(common::nats::url(), format!("leaks {}", topo.name)));
            (topo.name.clone(), t, common::nats::url(), "nats", Box::new(topo))
        }
    };
    let text = format!(
        r#"
[node]
name = "leaks"
admin = "127.0.0.1:{port}"
admin_token = "{OPERATOR}"
[transport]
kind = "{kind}"
url = "{url}"
[[tenant]]
name = "acme"
token = "{ACME}"
[[tenant]]
name = "globex"
token = "{GLOBEX}"
[[topology]]
name = "{topology}"
slots = 2
[[handler]]
name = "faulty"
component = "{faulty}"
topology = "{topology}"
message_types = ["ok", "reject"]
"#,
        faulty = bundled::FAULTY_PATH,
    );
    let cfg = config::parse(&text, "<admin leaks test>").unwrap();
    let calls = Arc::new(Calls::default());
    let opts = NodeOptions {
        workers: 1,
        call_observer: Some(calls.clone()),
        runtime: common::cached(weir::runtime::RuntimeOptions::default()),
        admin_controls: controls,
        ..NodeOptions::default()
    };
    let node = Node::start(&cfg, transport, opts).await.unwrap();
    wait_up(port);
    Bed {
        node,
        port,
        topology,
        calls,
        _guard: guard,
    }
}

async fn http(
    port: u16,
    method: &'static str,
    path: String,
    token: &'static str,
    body: String,
) -> (u16, serde_json::Value) {
    tokio::task::spawn_blocking(move || call(method, port, &path, Some(token), body.as_bytes()))
        .await
        .unwrap()
}

async fn publish(b: &Bed, token: &'static str, body: &str) -> (u16, serde_json::Value) {
    let path = format!("/v1/topologies/{}/messages", b.topology);
    http(b.port, "POST", path, token, body.to_owned()).await
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(30), "{what}: not within 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ------------------------------------------------------------ dead-letter counts

/// acme's 2 letters and globex's 3, each dead-lettered by the node from a
/// message its tenant published; then what acme's token is told:
/// (`read` and `matched` of the list, `read` of a redrive's and a purge's dry run).
async fn acme_counts(controls: NegativeControls) -> [u64; 4] {
    let b = bed(Broker::Rabbit, controls).await;
    for (token, n) in [(ACME, 2), (GLOBEX, 3)] {
        let body = format!(r#"{{"type":"reject","group":"g","count":{n}}}"#);
        let (code, answer) = publish(&b, token, &body).await;
        assert_eq!(code, 200, "{answer}");
    }
    let stats = b.node.stats();
    wait_for("five dead letters", || {
        stats.snapshot().dead_lettered.iter().map(|(_, n)| n).sum::<u64>() == 5
    })
    .await;
    let get = |path: &str, method: &'static str, token: &'static str| {
        http(b.port, method, path.to_owned(), token, String::new())
    };
    // The operator reads all five.
    let (code, all) = get("/v1/dead-letters", "GET", OPERATOR).await;
    assert_eq!(
        (code, all["read"].as_u64(), all["matched"].as_u64()),
        (200, Some(5), Some(5)),
        "{all}"
    );
    let (code, list) = get("/v1/dead-letters", "GET", ACME).await;
    assert_eq!(code, 200, "{list}");
    assert_eq!(list["letters"].as_array().unwrap().len(), 2, "{list}");
    let (code, redrive) = get("/v1/dead-letters/redrive?dry_run=true", "POST", ACME).await;
    assert_eq!(code, 200, "{redrive}");
    let (code, purge) = get("/v1/dead-letters/purge?dry_run=true", "POST", ACME).await;
    assert_eq!(code, 200, "{purge}");
    assert_eq!(purge["selected"], 2, "{purge}");
    b.node.shutdown().await.unwrap();
    [&list["read"], &list["matched"], &redrive["read"], &purge["read"]].map(|v| v.as_u64().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_token_counts_only_its_own_dead_letters_on_rabbitmq() {
    assert_eq!(acme_counts(NegativeControls::default()).await, [2, 2, 2, 2]);
}

/// Red baseline: before the fix, acme's token learnt that the topology
/// held 5 letters, 3 of them another tenant's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_unscoped_a_tenant_token_reads_every_tenants_count() {
    let controls = NegativeControls {
        unscoped_read_count: true,
        ..NegativeControls::default()
    };
    assert_eq!(acme_counts(controls).await, [5, 2, 5, 5]);
}

// ------------------------------------------------------------ header names

/// A tenant posts a message whose header name carries CR/LF (a second
/// header smuggled in), then a good one. The answer to the first, and the
/// header names of the calls the node made.
async fn crlf_header_name(broker: Broker, controls: NegativeControls) -> ((u16, serde_json::Value), Vec<String>) {
    let b = bed(broker, controls).await;
    let bad = r#"{"type":"ok","group":"g","headers":{"x-note\r\nx-injected":"1"}}"#;
    let answer = publish(&b, ACME, bad).await;
    // A good message after it: once it has run, the bad one would have too.
    let (code, good) = publish(&b, ACME, r#"{"type":"ok","group":"g","headers":{"x-note":"fine"}}"#).await;
    assert_eq!(code, 200, "{good}");
    let calls = b.calls.clone();
    wait_for("the good message handled", || {
        calls
            .0
            .lock()
            .iter()
            .any(|h| h.iter().any(|(k, v)| k == "x-note" && v == "fine"))
    })
    .await;
    let names = b.calls.0.lock().iter().flatten().map(|(k, _)| k.clone()).collect();
    b.node.shutdown().await.unwrap();
    (answer, names)
}

async fn crlf_refused(broker: Broker) {
    let ((code, answer), names) = crlf_header_name(broker, NegativeControls::default()).await;
    assert_eq!(code, 400, "{answer}");
    let e = answer["error"].as_str().unwrap();
    assert!(
        e.contains(r#"header name "x-note\r\nx-injected" has the character '\r'"#),
        "{e}"
    );
    assert_eq!(names, ["x-note"], "only the good message ran");
    // Other characters no broker carries alike: a space, a colon; a value with LF.
    let b = bed(broker, NegativeControls::default()).await;
    for (body, needle) in [
        (
            r#"{"type":"ok","headers":{"x note":"1"}}"#,
            r#"header name "x note" has the character ' '"#,
        ),
        (
            r#"{"type":"ok","headers":{"x:note":"1"}}"#,
            r#"header name "x:note" has the character ':'"#,
        ),
        (
            r#"{"type":"ok","headers":{"x-note":"1\n2"}}"#,
            r#"the value of header "x-note": must not contain CR, LF"#,
        ),
    ] {
        let (code, answer) = publish(&b, OPERATOR, body).await;
        assert_eq!(code, 400, "{body}: {answer}");
        assert!(answer["error"].as_str().unwrap().contains(needle), "{body}: {answer}");
    }
    b.node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crlf_in_a_header_name_is_refused_with_400_on_rabbitmq() {
    crlf_refused(Broker::Rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crlf_in_a_header_name_is_refused_with_400_on_nats() {
    crlf_refused(Broker::Nats).await;
}

fn unchecked() -> NegativeControls {
    NegativeControls {
        unchecked_header_names: true,
        ..NegativeControls::default()
    }
}

/// Red baseline: RabbitMQ carries the CR/LF name to the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_unchecked_rabbitmq_carries_crlf_in_a_header_name() {
    let ((code, answer), names) = crlf_header_name(Broker::Rabbit, unchecked()).await;
    assert_eq!(code, 200, "{answer}");
    assert!(names.iter().any(|n| n == "x-note\r\nx-injected"), "{names:?}");
}

/// Red baseline: NATS refuses it, and the client is told 503 (the broker
/// failed) instead of 400 (its request is wrong).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_unchecked_nats_answers_503_for_crlf_in_a_header_name() {
    let ((code, answer), names) = crlf_header_name(Broker::Nats, unchecked()).await;
    assert_eq!(code, 503, "{answer}");
    assert_eq!(names, ["x-note"]);
}
