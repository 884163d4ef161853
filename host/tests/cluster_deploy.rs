//! Cluster-wide deploys in `postgres` mode: a deploy to one node reaches
//! every node (versions in the database, nodes notified), a rollback on
//! another node reaches them all too, and a node that joins later serves
//! the cluster's version rather than its configured file.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::http::{call, current, digest, free_port, variant, wait_up};
use common::pg::TestDb;
use weir::config;
use weir::node::{Node, NodeOptions, bundled};
use weir::transport::memory::MemoryBroker;

const TOKEN: &str = "operator-secret-0123456789";

async fn node(db: &TestDb, mem: &Arc<MemoryBroker>, name: &str) -> (Node, u16) {
    let port = free_port();
    let text = format!(
        r#"
[node]
name = "{name}"
admin = "127.0.0.1:{port}"
admin_token = "{TOKEN}"
[cluster]
mode = "postgres"
database_url = "{url}"
lease = "2s"
[[topology]]
name = "cluster-deploy"
slots = 4
[[handler]]
name = "orders"
component = "{faulty}"
topology = "cluster-deploy"
message_types = ["ok"]
"#,
        url = db.url(),
        faulty = bundled::FAULTY_PATH,
    );
    let cfg = config::parse(&text, "<cluster deploy test>").unwrap();
    let opts = NodeOptions {
        workers: 1,
        runtime: common::cached(weir::runtime::RuntimeOptions::default()),
        ..NodeOptions::default()
    };
    let n = Node::start(&cfg, mem.clone(), opts).await.unwrap();
    wait_up(port);
    (n, port)
}

async fn digest_on(port: u16) -> String {
    tokio::task::spawn_blocking(move || current(port, Some(TOKEN), "orders"))
        .await
        .unwrap()
}

async fn wait_digest(port: u16, want: &str, what: &str) -> Duration {
    let start = Instant::now();
    while digest_on(port).await != want {
        assert!(start.elapsed() < Duration::from_secs(15), "{what}: never served {want}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deploy_to_one_node_reaches_every_node_and_so_does_a_rollback() {
    let db = TestDb::new();
    let mem = Arc::new(MemoryBroker::new());
    let (a, port_a) = node(&db, &mem, "deploy-a").await;
    let (b, port_b) = node(&db, &mem, "deploy-b").await;
    let v1 = std::fs::read(bundled::FAULTY_PATH).unwrap();
    let v2 = variant(&v1, "cluster-2");
    assert_eq!(digest_on(port_a).await, digest(&v1));
    assert_eq!(digest_on(port_b).await, digest(&v1));

    let body = v2.clone();
    let (code, answer) =
        tokio::task::spawn_blocking(move || call("PUT", port_a, "/v1/handlers/orders", Some(TOKEN), &body))
            .await
            .unwrap();
    assert_eq!(code, 200, "{answer}");
    assert_eq!(answer["kept_in"], "database");
    assert_eq!(
        digest_on(port_a).await,
        digest(&v2),
        "the node deployed to swaps at once"
    );
    let took = wait_digest(port_b, &digest(&v2), "the other node").await;
    println!("cluster deploy: the other node served v2 {took:?} after the deploy answered");

    // A node that joins now serves the cluster's version, not its file.
    let (c, port_c) = node(&db, &mem, "deploy-c").await;
    assert_eq!(digest_on(port_c).await, digest(&v2));

    // Roll back through another node: everyone follows.
    let (code, answer) =
        tokio::task::spawn_blocking(move || call("POST", port_b, "/v1/handlers/orders/rollback", Some(TOKEN), b""))
            .await
            .unwrap();
    assert_eq!(code, 200, "{answer}");
    assert_eq!(answer["digest"], digest(&v1));
    for port in [port_a, port_b, port_c] {
        wait_digest(port, &digest(&v1), "after the rollback").await;
    }
    // A bad upload to one node changes nothing anywhere.
    let (code, _) =
        tokio::task::spawn_blocking(move || call("PUT", port_c, "/v1/handlers/orders", Some(TOKEN), b"junk"))
            .await
            .unwrap();
    assert_eq!(code, 400);
    let versions = db.query("SELECT count(*)::text FROM weir_handler_versions");
    assert_eq!(versions[0][0].as_deref(), Some("2"), "v1 and v2 stored once each");
    for port in [port_a, port_b, port_c] {
        assert_eq!(digest_on(port).await, digest(&v1));
    }
    // Issue 36 item 9: a node's shutdown reports the slots its coordinator
    // drained as it left (it reported none, "0 slot(s) drained", in postgres
    // mode): the last node to leave drained every slot it then owned.
    let mut drained = Vec::new();
    for n in [a, b, c] {
        drained.push(n.shutdown().await.unwrap().len());
    }
    assert!(drained[2] > 0, "slots drained per node as they left: {drained:?}");
}
