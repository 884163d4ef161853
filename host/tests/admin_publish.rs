//! `POST /v1/topologies/{T}/messages` (issue 18): every node publishes
//! through its own broker what is posted to its admin listener — the only
//! way into a node on the memory broker from outside. Who may publish as
//! whom, bad requests named by field, and the messages handled, on the
//! memory broker and on RabbitMQ.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead as _, Write as _};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use weir::config;
use weir::envelope::Envelope;
use weir::node::{Node, NodeOptions};
use weir::observe::CallObserver;
use weir::transport::Transport;
use weir::transport::memory::MemoryBroker;

use common::http::{call, free_port, wait_up};

const OPERATOR: &str = "publish-operator-token";
const TENANT: &str = "publish-acme-token";

/// Every message a guest was called with: (id, group, tenant).
/// (message type, group, tenant) of a call.
type Called = (String, Option<String>, Option<String>);

#[derive(Default)]
struct Seen(Mutex<Vec<Called>>);

impl CallObserver for Seen {
    fn before(&self, msg: &Envelope) {
        self.0
            .lock()
            .push((msg.id.clone(), msg.group_id.clone(), msg.tenant_id.clone()));
    }
    fn after(&self, _msg: &Envelope) {}
}

impl Seen {
    /// Wait until `id` was called; its (group, tenant).
    fn wait(&self, id: &str) -> (Option<String>, Option<String>) {
        let start = Instant::now();
        loop {
            if let Some((_, g, t)) = self.0.lock().iter().find(|(i, _, _)| i == id) {
                return (g.clone(), t.clone());
            }
            assert!(start.elapsed() < Duration::from_secs(30), "{id} was never called");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn config_text(port: u16, tokens: bool, transport: &str, topology: &str) -> String {
    let tokens = if tokens {
        format!("admin_token = \"{OPERATOR}\"\n[[tenant]]\nname = \"acme\"\ntoken = \"{TENANT}\"\n")
    } else {
        String::new()
    };
    let (node, tenants) = tokens
        .split_once("[[tenant]]")
        .map_or((tokens.as_str(), String::new()), |(n, t)| (n, format!("[[tenant]]{t}")));
    format!(
        "[node]\nname = \"publish-test\"\nadmin = \"127.0.0.1:{port}\"\n{node}{transport}\n{tenants}\
         [[topology]]\nname = \"{topology}\"\nslots = 3\n\
         [[handler]]\nname = \"orders\"\ncomponent = \"bundled:orders\"\ntopology = \"{topology}\"\nmessage_types = [\"order.placed\"]\n"
    )
}

async fn start(text: &str, transport: Arc<dyn Transport>, seen: Arc<Seen>) -> Node {
    let cfg = config::parse(text, "<admin publish test>").unwrap();
    Node::start(
        &cfg,
        transport,
        NodeOptions {
            workers: 1,
            call_observer: Some(seen),
            runtime: common::cached(weir::runtime::RuntimeOptions::default()),
            ..NodeOptions::default()
        },
    )
    .await
    .unwrap()
}

const ORDER: &str = r#"{"order_id":"o-1","customer":"c","lines":[{"sku":"s","qty":1,"unit_price_cents":100}]}"#;

fn post(port: u16, topology: &str, token: Option<&str>, body: &str) -> (u16, serde_json::Value) {
    call(
        "POST",
        port,
        &format!("/v1/topologies/{topology}/messages"),
        token,
        body.as_bytes(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn posted_messages_reach_their_slot_and_tokens_decide_as_whom() {
    let port = free_port();
    let seen = Arc::new(Seen::default());
    let node = start(
        &config_text(port, true, "", "orders"),
        Arc::new(MemoryBroker::new()),
        seen.clone(),
    )
    .await;
    wait_up(port);
    tokio::task::spawn_blocking(move || {
        let body = format!(r#"{{"type":"order.placed","group":"g-1","payload":{ORDER}}}"#);
        // No token, an unknown one: refused, nothing published.
        assert_eq!(post(port, "orders", None, &body).0, 401);
        assert_eq!(post(port, "orders", Some("nope"), &body).0, 401);

        // The operator: published to the group's slot, then handled.
        let (code, answer) = post(port, "orders", Some(OPERATOR), &body);
        assert_eq!(code, 200, "{answer}");
        let published = answer["published"].as_array().unwrap();
        assert_eq!(published.len(), 1, "{answer}");
        assert_eq!(
            published[0]["slot"].as_u64(),
            Some(u64::from(weir::partition::slot_for(Some("g-1"), "", 3)))
        );
        let id = published[0]["id"].as_str().unwrap().to_owned();
        assert_eq!(seen.wait(&id), (Some("g-1".into()), None));

        // A tenant token publishes as its tenant, and only as its tenant.
        let (code, answer) = post(port, "orders", Some(TENANT), &body);
        assert_eq!(code, 200, "{answer}");
        let id = answer["published"][0]["id"].as_str().unwrap().to_owned();
        assert_eq!(seen.wait(&id).1.as_deref(), Some("acme"));
        let as_other = format!(r#"{{"type":"order.placed","tenant":"globex","payload":{ORDER}}}"#);
        let (code, answer) = post(port, "orders", Some(TENANT), &as_other);
        assert_eq!(code, 403, "{answer}");
        assert!(
            answer["error"]
                .as_str()
                .unwrap()
                .contains("only publish as its own tenant"),
            "{answer}"
        );

        // Copies, each with its own id; an explicit id is kept.
        let (code, answer) = post(
            port,
            "orders",
            Some(OPERATOR),
            &format!(r#"{{"type":"order.placed","group":"g-2","count":3,"payload":{ORDER}}}"#),
        );
        assert_eq!(code, 200, "{answer}");
        for p in answer["published"].as_array().unwrap() {
            seen.wait(p["id"].as_str().unwrap());
        }
        let (code, answer) = post(
            port,
            "orders",
            Some(OPERATOR),
            &format!(r#"{{"type":"order.placed","id":"chosen-1","payload":{ORDER}}}"#),
        );
        assert_eq!(code, 200, "{answer}");
        seen.wait("chosen-1");

        // Bad requests: named, and nothing published.
        let before = seen.0.lock().len();
        for (body, status, needle) in [
            ("not json", 400, "not a message request"),
            (r#"{"payload":"x"}"#, 400, "missing field `type`"),
            (r#"{"type":"t","nope":1}"#, 400, "unknown field `nope`"),
            (r#"{"type":"t","headers":{"weir-attempt":"9"}}"#, 400, "is reserved"),
            (r#"{"type":"t","count":100000}"#, 400, "count: 100000"),
        ] {
            let (code, answer) = post(port, "orders", Some(OPERATOR), body);
            assert_eq!(code, status, "{body}: {answer}");
            assert!(answer["error"].as_str().unwrap().contains(needle), "{body}: {answer}");
        }
        let (code, answer) = post(port, "shipping", Some(OPERATOR), &body);
        assert_eq!(code, 404, "{answer}");
        assert!(answer["error"].as_str().unwrap().contains("\"orders\""), "{answer}");
        // Over the body limit: refused by its declared length, before it is sent.
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(
            s,
            "POST /v1/topologies/orders/messages HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {OPERATOR}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            2 << 20
        )
        .unwrap();
        let mut status = String::new();
        std::io::BufReader::new(&s).read_line(&mut status).unwrap();
        assert!(status.contains(" 413 "), "{status}");
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(seen.0.lock().len(), before, "a refused request published something");
    })
    .await
    .unwrap();
    node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_tokens_takes_no_posted_messages() {
    let port = free_port();
    let seen = Arc::new(Seen::default());
    let node = start(
        &config_text(port, false, "", "orders"),
        Arc::new(MemoryBroker::new()),
        seen,
    )
    .await;
    wait_up(port);
    let (code, answer) = tokio::task::spawn_blocking(move || post(port, "orders", None, r#"{"type":"order.placed"}"#))
        .await
        .unwrap();
    assert_eq!(code, 403, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .unwrap()
            .contains("disabled on this node (no admin_token)"),
        "{answer}"
    );
    node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn posted_messages_go_through_rabbitmq() {
    let topo = common::rabbit::Topo::new(3, &[]);
    let port = free_port();
    let seen = Arc::new(Seen::default());
    let text = config_text(
        port,
        true,
        &format!("[transport]\nkind = \"rabbitmq\"\nurl = \"{}\"", common::rabbit::url()),
        &topo.name,
    );
    let cfg = config::parse(&text, "<admin publish test>").unwrap();
    let transport = weir::transport::connect::for_config(&cfg).unwrap();
    let node = start(&text, transport, seen.clone()).await;
    wait_up(port);
    let name = topo.name.clone();
    tokio::task::spawn_blocking(move || {
        let (code, answer) = post(
            port,
            &name,
            Some(OPERATOR),
            &format!(r#"{{"type":"order.placed","group":"g-7","count":5,"payload":{ORDER}}}"#),
        );
        assert_eq!(code, 200, "{answer}");
        let ids: Vec<String> = answer["published"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["id"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(ids.len(), 5);
        for id in &ids {
            assert_eq!(seen.wait(id).0.as_deref(), Some("g-7"));
        }
    })
    .await
    .unwrap();
    node.shutdown().await.unwrap();
    drop(topo);
}
