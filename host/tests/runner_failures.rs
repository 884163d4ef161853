//! A slot runner cannot die silently, and one tenant cannot hold another's
//! messages in a shared lane (issue 15).
//!
//! - A job that panics (a fault injected through a test hook, standing in
//!   for any host bug) is caught: it is counted, the slot is marked failing
//!   (`GET /ready` answers 503 and names it), the runner drains and restarts,
//!   the panicked job's message comes back from the broker and is handled,
//!   and every other message of the slot is handled too. Real RabbitMQ: the
//!   panicked job's delivery is only redelivered once its channel closes.
//! - Lanes are keyed by (tenant, group): a tenant whose group `order-42` is
//!   stuck in a long call does not delay another tenant's `order-42`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::http::{call, free_port, wait_up};
use common::rabbit::{Topo, url};
use weir::config::{self, Config};
use weir::envelope::{self, Envelope};
use weir::node::{Node, NodeOptions, bundled};
use weir::runtime::RuntimeOptions;
use weir::transport::memory::MemoryBroker;
use weir::transport::rabbitmq::RabbitMq;

fn rabbit_config(topology: &str, admin: u16) -> Config {
    let text = format!(
        r#"
[node]
name = "runner-failures"
admin = "127.0.0.1:{admin}"
[transport]
kind = "rabbitmq"
url = "{url}"
[[topology]]
name = "{topology}"
slots = 1
[[handler]]
name = "faulty"
component = "{faulty}"
topology = "{topology}"
message_types = ["ok", "slow"]
"#,
        url = url(),
        faulty = bundled::FAULTY_PATH,
    );
    config::parse(&text, "<runner failures test>").unwrap()
}

fn msg(t: &str, group: &str, tenant: Option<&str>, payload: &[u8]) -> Envelope {
    envelope::new_message(
        envelope::fresh_id(),
        t,
        Some(group.to_owned()),
        tenant.map(str::to_owned),
        vec![],
        payload.to_vec(),
    )
}

/// Wait for `cond`, polling; fail with `what` after `limit`.
async fn wait_for(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "{what} not seen within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn get(port: u16, path: &str) -> (u16, String) {
    let (status, body) = call("GET", port, path, None, b"");
    (status, body.as_str().map_or_else(|| body.to_string(), str::to_owned))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_job_is_caught_counted_reported_and_the_slot_restarts() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let topo = Topo::new(1, &[]);
    let admin = free_port();
    let cfg = rabbit_config(&topo.name, admin);
    let transport = Arc::new(RabbitMq::new(url(), "runner-failures-test"));
    let opts = NodeOptions {
        workers: 2,
        runtime: common::cached(RuntimeOptions::default()),
        inject_panic_on: Some("slow".into()),
        ..NodeOptions::default()
    };
    let node = Node::start(&cfg, transport, opts).await.unwrap();
    wait_up(admin);
    assert_eq!(get(admin, "/ready").0, 200, "ready before the fault");

    // `slow` with 0 ms is an ordinary success: only the hook makes its job panic.
    node.publish(&topo.name, &msg("slow", "g-boom", None, b"0"))
        .await
        .unwrap();
    let stats = node.stats();
    wait_for(Duration::from_secs(30), "the caught panic", || {
        stats.snapshot().runner_panics == 1
    })
    .await;
    // The slot is reported at once, by name, until the restarted runner has
    // run a while without failing.
    let (status, body) = get(admin, "/ready");
    assert_eq!(status, 503, "/ready while the slot restarts: {body}");
    assert!(
        body.contains(&format!("{}/0", topo.name)),
        "/ready names the slot: {body}"
    );

    // Every other message of the slot is handled, and so is the one whose
    // job panicked (redelivered once the old runner's channel closed).
    for i in 0..100 {
        node.publish(&topo.name, &msg("ok", &format!("g{}", i % 10), None, b""))
            .await
            .unwrap();
    }
    let start = Instant::now();
    while stats.snapshot().handled < 101 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "101 handled messages not seen within 60 s: {:?}",
            stats.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(stats.snapshot().runner_panics, 1, "the hook fires once");
    assert_eq!(stats.snapshot().dead_lettered_total(), 0, "{:?}", stats.snapshot());
    node.shutdown().await.unwrap();
}

fn tenants_config() -> Config {
    let text = format!(
        r#"
[node]
name = "tenant-lanes"
[[topology]]
name = "lanes"
slots = 1
max_concurrent_groups = 8
[[tenant]]
name = "hostile"
[[tenant]]
name = "quiet"
[[handler]]
name = "hostile-handler"
component = "{faulty}"
topology = "lanes"
tenant = "hostile"
message_types = ["slow"]
limits = {{ timeout = "60s" }}
[[handler]]
name = "quiet-handler"
component = "{faulty}"
topology = "lanes"
tenant = "quiet"
message_types = ["ok"]
"#,
        faulty = bundled::FAULTY_PATH,
    );
    config::parse(&text, "<tenant lanes test>").unwrap()
}

/// Lanes are keyed by (tenant, group): another tenant's `order-42` runs
/// while the hostile tenant's `order-42` is in a 15 s call. With lanes keyed
/// by group alone (the defect) the quiet message waits behind that call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenants_group_of_the_same_name_does_not_wait() {
    let mem = Arc::new(MemoryBroker::new());
    let opts = NodeOptions {
        workers: 2,
        runtime: common::cached(RuntimeOptions::default()),
        ..NodeOptions::default()
    };
    let cfg = tenants_config();
    let node = Node::start(&cfg, mem, opts).await.unwrap();
    node.publish("lanes", &msg("slow", "order-42", Some("hostile"), b"15000"))
        .await
        .unwrap();
    node.publish("lanes", &msg("ok", "order-42", Some("quiet"), b""))
        .await
        .unwrap();
    // The quiet tenant's message is handled long before the hostile call
    // ends (15 s): within 10 s even on a loaded machine.
    let stats = node.stats();
    wait_for(Duration::from_secs(10), "the quiet tenant's message handled", || {
        stats.snapshot().handled >= 1
    })
    .await;
    node.shutdown().await.unwrap();
}
