#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Issue 15 item 4 across nodes: in `rabbitmq-sac` mode, node A's connection to RabbitMQ is
//! cut while A's guest sleeps in WASI. A must interrupt that call (its subscription fails,
//! the cancel flag is set, and the host's own `poll` honours it) before the broker hands the
//! message to node B; the cluster-wide ledger (the nodes' journals) must see no intra-group
//! overlap. A TCP proxy of the test's own sits between A and the broker: it cuts A's side
//! first, waits (bounded) for A's call to end, then cuts the broker's side, which is when the
//! broker requeues A's unacknowledged message for B. Without the interruption, A's call
//! outlives the wait and runs alongside B's.

#[path = "../host/tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cluster::{Cluster, describe};
use common::rabbit::{Topo, url};
use weir::partition;
use weir::transport::rabbitmq::RabbitMq;

/// A TCP proxy to the broker whose two sides can be cut separately.
struct Proxy {
    port: u16,
    cut: Arc<AtomicBool>,
    /// (client side, broker side) of every connection.
    conns: Arc<Mutex<Vec<(TcpStream, TcpStream)>>>,
}

impl Proxy {
    fn start(upstream: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let (cut, conns) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(Vec::new())));
        let (c, list, upstream) = (cut.clone(), conns.clone(), upstream.to_owned());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if c.load(Ordering::Relaxed) {
                    // Cut: refuse reconnections too.
                    drop(client);
                    continue;
                }
                let Ok(broker) = TcpStream::connect(&upstream) else {
                    continue;
                };
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), broker.try_clone().unwrap()),
                    (broker.try_clone().unwrap(), client.try_clone().unwrap()),
                ] {
                    // No shutdown is passed on: each side is cut only by the test.
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 16 << 10];
                        while let Ok(n) = from.read(&mut buf) {
                            if n == 0 || to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    });
                }
                list.lock().unwrap().push((client, broker));
            }
        });
        Self { port, cut, conns }
    }

    /// The node's side: it sees its connection fail; the broker still sees it open.
    fn cut_client_side(&self) {
        self.cut.store(true, Ordering::Relaxed);
        for (client, _) in self.conns.lock().unwrap().iter() {
            let _ = client.shutdown(Shutdown::Both);
        }
    }

    /// The broker's side: the broker closes the connection and requeues its deliveries.
    fn cut_broker_side(&self) {
        for (_, broker) in self.conns.lock().unwrap().iter() {
            let _ = broker.shutdown(Shutdown::Both);
        }
    }
}

fn config(node: &str, amqp: &str, topology: &str, timeout: &str) -> String {
    format!(
        r#"
[node]
name = "{node}"
[transport]
kind = "rabbitmq"
url = "{amqp}"
prefetch = 8
[cluster]
mode = "rabbitmq-sac"
[[topology]]
name = "{topology}"
slots = 1
[[handler]]
name = "faulty"
component = "{component}"
topology = "{topology}"
message_types = ["ok", "hostile.sleep"]
limits = {{ timeout = "{timeout}" }}
"#,
        component = weir::node::bundled::FAULTY_PATH,
    )
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while !done() {
        if start.elapsed() > timeout {
            eprintln!("gave up after {timeout:?} waiting for {what}");
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

#[test]
fn cutting_a_nodes_connection_during_a_sleeping_call_causes_no_overlap() {
    let topo = Topo::new(1, &[]);
    let proxy = Proxy::start("127.0.0.1:5672");
    let via_proxy = url().replace("127.0.0.1:5672", &format!("127.0.0.1:{}", proxy.port));
    assert_ne!(
        via_proxy,
        url(),
        "the broker URL names 127.0.0.1:5672, so it can be proxied"
    );
    let mut cluster = Cluster::default();
    // A subscribes first, so it is the slot's single active consumer; its calls may run a
    // minute, so only an interruption ends its sleep early. B's end after 3 s.
    cluster.start("node-a", &config("node-a", &via_proxy, &topo.name, "60s"));
    cluster.start("node-b", &config("node-b", &url(), &topo.name, "3s"));

    let msg = common::message("hostile.sleep", Some("g"), b"20000");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let t = RabbitMq::new(url(), "weir hostile-cluster publisher");
        common::publish_confirmed(&t, &topo.name, partition::slot_for(msg.group(), &msg.id, 1), &msg).await;
    });
    assert!(
        wait_for("node-a to start sleeping", Duration::from_secs(30), || {
            cluster.nodes[0].log().contains("hostile.sleep: sleeping")
        }),
        "node-a never ran the sleeper; logs:\n{}\n{}",
        cluster.nodes[0].log(),
        cluster.nodes[1].log()
    );
    let calls_of = |cluster: &Cluster, node: &str| {
        cluster
            .report()
            .calls
            .iter()
            .filter(|c| c.node == node && c.id == msg.id)
            .count()
    };

    let cut = Instant::now();
    proxy.cut_client_side();
    let interrupted = wait_for("node-a's call to end", Duration::from_secs(8), || {
        calls_of(&cluster, "node-a") > 0
    });
    let a_ended = cut.elapsed();
    proxy.cut_broker_side();

    assert!(
        wait_for("node-b to run the message", Duration::from_secs(60), || calls_of(
            &cluster, "node-b"
        ) > 0),
        "node-b never ran the released message; log:\n{}",
        cluster.nodes[1].log()
    );
    // Without the interruption node-a's call ends only when its 20 s sleep does.
    wait_for("node-a's call to end", Duration::from_secs(30), || {
        calls_of(&cluster, "node-a") > 0
    });
    let report = cluster.report();
    assert!(
        report.overlaps.is_empty(),
        "node-a's sleeping call ran alongside node-b's: {}",
        describe(&report)
    );
    assert!(
        interrupted,
        "node-a's sleeping call was not interrupted within 8 s of losing its connection"
    );
    assert!(
        a_ended < Duration::from_secs(8),
        "node-a's call ended {a_ended:?} after the cut"
    );
    for node in &mut cluster.nodes {
        if node.alive() {
            node.kill();
        }
    }
}
