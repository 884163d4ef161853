//! Issue 33, item 7: a forwarder that dies holding the ingress message
//! stalls the ingress for the ingress consumer's short `AckWait` (5 s), not
//! 30 s, against the real nats-server (nats://127.0.0.1:4222, override with
//! WEIR_TEST_NATS_URL; each test declares its own `t-<uuid8>` topology and
//! deletes it afterwards).
//!
//! Two forwarders on the one ingress consumer (`MaxAckPending` 1): A,
//! connected through a TCP fault proxy, receives an ingress message and
//! holds it; B subscribes after it, so the message is A's. Then:
//! - while A lives and holds it for three `AckWait`s (a slow forward), its
//!   in-progress signals keep it: B receives nothing (no reorder, no second
//!   forward);
//! - the proxy cuts A's connection (what a kill -9 does to its socket): B
//!   receives the message within `AckWait` and a little.
//!
//! Negative control: the same cut with the ingress `AckWait` of before (30 s,
//! a test-only transport option): B waits about 30 s.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/proxy.rs"]
mod proxy;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use weir::envelope::header;
use weir::transport::nats::conn::INGRESS_ACK_WAIT;
use weir::transport::nats::{Nats, NatsOptions, names};
use weir::transport::{Subscription, TopologySpec, Transport};

use common::nats::{Topo, js_at, url};
use proxy::FaultProxy;

/// The next delivery of `sub` within `timeout`, as its message id.
async fn next_id(sub: &mut Box<dyn Subscription>, timeout: Duration) -> Option<String> {
    match tokio::time::timeout(timeout, sub.next()).await {
        Ok(Some(Ok(d))) => {
            let id = d.message.as_ref().map(|e| e.id.clone()).unwrap_or_default();
            // Keep the delivery unsettled: dropping the acker sends nothing.
            std::mem::forget(d);
            Some(id)
        }
        Ok(Some(Err(e))) => panic!("ingress subscription failed: {e}"),
        Ok(None) | Err(_) => None,
    }
}

/// A holds an ingress message, stays alive for `alive_for`, then its
/// connection is cut; returns how long after the cut B received it (`None`
/// if B received it while A was alive).
async fn handover_after_a_dies(ack_wait: Duration, alive_for: Duration) -> Result<Duration, String> {
    let topo = Topo::new();
    let target: SocketAddr = url().trim_start_matches("nats://").parse().unwrap();
    let proxy = FaultProxy::start(target);
    let options = NatsOptions {
        ingress_ack_wait: ack_wait,
        ..NatsOptions::default()
    };
    let spec = TopologySpec::new(&topo.name, 2);
    let a = Nats::with_options(format!("nats://{}", proxy.addr), "weir ingress A", options.clone());
    let b = Nats::with_options(url(), "weir ingress B", options);
    a.declare(&spec).await.unwrap();
    b.declare(&spec).await.unwrap();
    let mut sub_a = a.subscribe_ingress(&topo.name, 1).await.unwrap().unwrap();

    let js = js_at(&url()).await;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(header::MESSAGE_ID, "m-1");
    headers.insert(header::MESSAGE_TYPE, "ok");
    headers.insert(header::GROUP_ID, "g");
    js.publish_with_headers(names::ingress(&topo.name), headers, Bytes::from_static(b"x"))
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(
        next_id(&mut sub_a, Duration::from_secs(10)).await.as_deref(),
        Some("m-1"),
        "A receives the ingress message"
    );
    let mut sub_b = b.subscribe_ingress(&topo.name, 1).await.unwrap().unwrap();
    // A lives (a slow forward): B gets nothing.
    if let Some(id) = next_id(&mut sub_b, alive_for).await {
        return Err(format!("B received {id} while A was alive and holding it"));
    }
    proxy.cut();
    let cut = Instant::now();
    let got = next_id(&mut sub_b, Duration::from_secs(60)).await;
    assert_eq!(got.as_deref(), Some("m-1"), "B receives the message A held");
    let waited = cut.elapsed();
    sub_b.close().await;
    drop(sub_a);
    Ok(waited)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forwarder_that_dies_holding_the_ingress_stalls_it_for_a_short_ack_wait() {
    assert_eq!(INGRESS_ACK_WAIT, Duration::from_secs(5));
    let waited = handover_after_a_dies(INGRESS_ACK_WAIT, INGRESS_ACK_WAIT * 3)
        .await
        .unwrap();
    println!("B received the message {waited:?} after A's connection was cut");
    // AckWait, one pull request's expiry (1 s) and a little.
    assert!(
        waited <= INGRESS_ACK_WAIT + Duration::from_secs(3),
        "the ingress stalled {waited:?} after its holder died"
    );
}

/// Negative control: the ingress `AckWait` of before (30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_control_with_the_old_ack_wait_the_ingress_stalls_for_30_s() {
    let waited = handover_after_a_dies(Duration::from_secs(30), Duration::from_secs(1))
        .await
        .unwrap();
    println!("B received the message {waited:?} after A's connection was cut");
    assert!(
        waited >= Duration::from_secs(25),
        "with a 30 s AckWait the ingress should stall about 30 s, not {waited:?}"
    );
}
