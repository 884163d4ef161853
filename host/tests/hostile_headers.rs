//! Hostile bytes at every boundary where guest- or publisher-supplied bytes
//! reach a broker client (issue 15 items 1, 2, 3, 10; issue 14 items 13, 14),
//! against the real RabbitMQ (127.0.0.1:5672) and nats-server
//! (127.0.0.1:4222): reasons of a mebibyte, reasons and cascade headers with
//! CR/LF, header names over 255 bytes, cascades over `frame_max`, a
//! publisher's header that fills a frame, AMQP byte-array and non-UTF-8
//! headers, a dead-letter outage. Each test then shows the node's connection
//! was never lost (no resubscription) and other messages of the same slot
//! keep flowing. Guests: the faulty guest's `bytes.*` types.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, ByteArray, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use weir::config::TransportKind;
use weir::envelope::{Envelope, Wire, header};
use weir::outcome::{Outcome, Reason};
use weir::transport::limits::{Limits, cut_marker};
use weir::transport::nats::{Nats, NatsOptions, names as nats_names};
use weir::transport::rabbitmq::{RabbitMq, names};

use common::compliance::{Harness, Subject};

const TYPES: [&str; 8] = [
    "trap",
    "bytes.reject-big",
    "bytes.retry-big",
    "bytes.reject-lines",
    "bytes.cascade-long-name",
    "bytes.cascade-crlf",
    "bytes.cascade-bad-name",
    "bytes.cascade-huge",
];

const MIB: usize = 1 << 20;

/// A guest's failure text is cut twice over: first at the runtime seam to
/// `node.budgets.error_bytes` (4 KiB by default, with the runtime's marker),
/// then, if still needed, to fit the broker (the transport's marker). Either
/// way the dead letter says it was cut and how long the text was.
fn says_cut(e: &str, len: usize) -> bool {
    e.ends_with(&cut_marker(len)) || e.ends_with(&format!("[cut by weir: {len} bytes, limit 4096]"))
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn msg(t: &str, group: &str, payload: &str) -> Envelope {
    common::message(t, Some(group), payload.as_bytes())
}

async fn rabbit(slots: u32, max_deliver: i64) -> Harness<common::rabbit::Topo> {
    let ladder = [Duration::from_millis(50)];
    let topo = common::rabbit::Topo::new(slots, &ladder);
    let name = topo.name.clone();
    let url = common::rabbit::url();
    let subject = Subject {
        transport: Arc::new(RabbitMq::new(url.clone(), format!("weir node-{name}"))),
        kind: TransportKind::Rabbitmq,
        url: Some(url),
    };
    subscribed(Harness::start_typed(subject, &name, slots, &ladder, max_deliver, topo, &TYPES).await).await
}

/// `h` once every slot is subscribed (the count `still_flowing` compares with).
async fn subscribed<G>(h: Harness<G>) -> Harness<G> {
    let start = Instant::now();
    while h.subscriptions.load(Ordering::Relaxed) < h.slots {
        assert!(start.elapsed() < secs(20), "the slots were subscribed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    h
}

async fn nats(slots: u32) -> Harness<common::nats::Topo> {
    let ladder = [Duration::from_millis(200)];
    let topo = common::nats::Topo::new();
    let name = topo.name.clone();
    let subject = Subject {
        transport: Arc::new(Nats::with_options(
            topo.url.clone(),
            format!("weir node-{name}"),
            NatsOptions::default(),
        )),
        kind: TransportKind::Nats,
        url: Some(topo.url.clone()),
    };
    subscribed(Harness::start_typed(subject, &name, slots, &ladder, 3, topo, &TYPES).await).await
}

/// Other messages of the same slots are still handled, and the node never
/// had to subscribe again (its connection was not closed under it).
async fn still_flowing<G>(h: &Harness<G>, subscribed: u32) {
    let mut ids = HashSet::new();
    for i in 0..20 {
        let m = msg("ok", &format!("other-{i}"), "x");
        ids.insert(m.id.clone());
        h.publish(&m).await;
    }
    let outcomes = h.wait_outcomes(&ids, secs(30)).await;
    assert!(ids.iter().all(|id| outcomes.get(id) == Some(&Outcome::Handled)));
    assert_eq!(
        h.subscriptions.load(Ordering::Relaxed),
        subscribed,
        "no subscription was lost and made again (the connection stayed up)"
    );
}

// ---------------------------------------------------------------- RabbitMQ

async fn plain() -> (Connection, lapin::Channel) {
    let conn = Connection::connect(&common::rabbit::url(), ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    (conn, ch)
}

async fn amqp_publish(queue: &str, headers: FieldTable, body: &[u8]) {
    let (conn, ch) = plain().await;
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        body,
        BasicProperties::default().with_headers(headers).with_delivery_mode(2),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    assert!(
        conn.status().connected(),
        "the publisher's own message fitted its frame"
    );
    let _ = conn.close(200, "done".into()).await;
}

async fn read_queue(queue: &str, n: usize) -> Vec<lapin::message::Delivery> {
    let (conn, ch) = plain().await;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut out = Vec::new();
    while out.len() < n {
        let d = tokio::time::timeout(secs(10), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("timed out reading {queue}: {} of {n}", out.len()))
            .unwrap()
            .unwrap();
        d.ack(BasicAckOptions::default()).await.unwrap();
        out.push(d);
    }
    let _ = conn.close(200, "done".into()).await;
    out
}

fn amqp_value<'a>(d: &'a lapin::message::Delivery, name: &str) -> Option<&'a AMQPValue> {
    d.properties.headers().as_ref()?.inner().get(name)
}

fn amqp_text(d: &lapin::message::Delivery, name: &str) -> Option<String> {
    match amqp_value(d, name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        other => Some(format!("{other:?}")),
    }
}

fn by_reason<'a>(dead: &'a [lapin::message::Delivery], reason: &str) -> &'a lapin::message::Delivery {
    dead.iter()
        .find(|d| amqp_text(d, header::DEAD_LETTER_REASON).as_deref() == Some(reason))
        .unwrap_or_else(|| panic!("a dead letter `{reason}`"))
}

/// Issue 15 item 3 (a 1 MiB reject reason; a 1 MiB retry reason at
/// exhaustion): captured with the reason cut in `weir-error`, which keeps
/// its start, its length and says it was cut; the connection stays up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_mebibyte_reasons_are_cut_and_the_connection_stays() {
    let mut h = rabbit(1, 2).await;
    let subscribed = h.subscriptions.load(Ordering::Relaxed);
    let reject = msg("bytes.reject-big", "big-1", &MIB.to_string());
    let retry = msg("bytes.retry-big", "big-2", &MIB.to_string());
    h.publish(&reject).await;
    h.publish(&retry).await;
    h.wait_for(&reject.id, Outcome::DeadLettered(Reason::Rejected), secs(30))
        .await;
    h.wait_for(&retry.id, Outcome::DeadLettered(Reason::Exhausted), secs(30))
        .await;
    still_flowing(&h, subscribed).await;
    let dead = read_queue(&names::dead_letter(&h.name), 2).await;
    for (reason, start) in [("rejected", "big reject reason:"), ("exhausted", "big retry reason:")] {
        let e = amqp_text(by_reason(&dead, reason), header::ERROR).unwrap();
        assert!(e.starts_with(start), "{reason}: keeps the start: {:?}", &e[..40]);
        assert!(
            says_cut(&e, MIB),
            "{reason}: says it was cut, and its length: {:?}",
            &e[e.len().saturating_sub(80)..]
        );
        assert!(e.len() < 131_072, "{reason}: fits a frame ({} bytes)", e.len());
    }
    h.shutdown().await;
}

/// Issue 15 items 2 and 3: a cascade with a header name over 255 bytes, and
/// one with 200 KiB of headers, fail their call (a retry, then `exhausted`)
/// with a reason naming the limit; the runner and the connection stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_cascades_that_do_not_fit_fail_the_call() {
    let mut h = rabbit(1, 2).await;
    let subscribed = h.subscriptions.load(Ordering::Relaxed);
    let long = msg("bytes.cascade-long-name", "c-1", "x");
    let huge = msg("bytes.cascade-huge", "c-2", &(200 * 1024).to_string());
    h.publish(&long).await;
    h.publish(&huge).await;
    h.wait_for(&long.id, Outcome::DeadLettered(Reason::Exhausted), secs(30))
        .await;
    h.wait_for(&huge.id, Outcome::DeadLettered(Reason::Exhausted), secs(30))
        .await;
    still_flowing(&h, subscribed).await;
    let dead = read_queue(&names::dead_letter(&h.name), 2).await;
    let error_of = |id: &str| {
        let d = dead
            .iter()
            .find(|d| amqp_text(d, header::MESSAGE_ID).as_deref() == Some(id))
            .unwrap();
        amqp_text(d, header::ERROR).unwrap()
    };
    let e = error_of(&long.id);
    assert!(e.contains("300 bytes") && e.contains("at most 255"), "{e}");
    let e = error_of(&huge.id);
    assert!(e.contains("frame_max 131072") && e.contains("x-huge"), "{e}");
    h.shutdown().await;
}

/// A header value that makes a wire of `headers` plus `x-big` exactly
/// `size` bytes of an AMQP content header.
fn filler(headers: &[(&str, &str)], size: usize) -> String {
    let mut wire = Wire {
        headers: headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        body: Vec::new(),
    };
    wire.headers.push(("x-big".into(), String::new()));
    let base = Limits::amqp(131_072).size(&wire);
    "b".repeat(size - base)
}

fn table(headers: &[(&str, &str)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in headers {
        t.insert((*k).into(), AMQPValue::LongString((*v).into()));
    }
    t
}

/// Issue 15 item 3, no guest involved: a publisher's message whose header
/// all but fills the 131 072-byte frame, sent to the ingress (forwarding
/// adds headers) and straight to a slot with a type nobody handles (the
/// capture adds provenance). Neither may close the connection; both are
/// dead-lettered (`undecodable`: it cannot be forwarded; `no-handler`) with
/// the big header cut with a marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_a_publishers_frame_filling_header_is_dead_lettered_not_crash_looped() {
    let mut h = rabbit(1, 3).await;
    let subscribed = h.subscriptions.load(Ordering::Relaxed);
    let (in_id, slot_id) = (format!("in-{}", h.name), format!("sl-{}", h.name));
    let ingress = [(header::MESSAGE_ID, in_id.as_str()), (header::MESSAGE_TYPE, "ok")];
    // 20 bytes short of the frame: forwarding adds `weir-attempt` (19) and
    // the AMQP message-id (1 + 13).
    let big = filler(&ingress, 131_072 - 20);
    let mut headers = ingress.to_vec();
    headers.push(("x-big", &big));
    amqp_publish(&names::ingress(&h.name), table(&headers), b"in").await;
    let slot = [
        (header::MESSAGE_ID, slot_id.as_str()),
        (header::MESSAGE_TYPE, "nobody-handles-this"),
    ];
    let big_slot = filler(&slot, 131_072 - 40);
    let mut headers = slot.to_vec();
    headers.push(("x-big", &big_slot));
    amqp_publish(&names::slot_queue(&h.name, 0), table(&headers), b"sl").await;

    // The forward fits or is refused before anything is sent (then it is
    // dead-lettered `undecodable`); never a closed connection.
    let ids = HashSet::from([in_id.clone()]);
    let forwarded = h.wait_outcomes(&ids, secs(30)).await[&in_id];
    assert!(
        matches!(forwarded, Outcome::Handled | Outcome::DeadLettered(Reason::Undecodable)),
        "{forwarded:?}"
    );
    h.wait_for(&slot_id, Outcome::DeadLettered(Reason::NoHandler), secs(30))
        .await;
    still_flowing(&h, subscribed).await;
    let n = if forwarded == Outcome::Handled { 1 } else { 2 };
    let dead = read_queue(&names::dead_letter(&h.name), n).await;
    if n == 2 {
        let undecodable = by_reason(&dead, "undecodable");
        let e = amqp_text(undecodable, header::ERROR).unwrap();
        assert!(e.contains("frame_max"), "names the limit: {e}");
        let cut = amqp_text(undecodable, "x-big").unwrap();
        assert!(
            cut.starts_with("bbbb") && cut.ends_with(&cut_marker(big.len())),
            "cut with a marker"
        );
    }
    let no_handler = by_reason(&dead, "no-handler");
    let cut = amqp_text(no_handler, "x-big").unwrap();
    assert!(cut.ends_with(&cut_marker(big_slot.len())), "cut with a marker");
    assert_eq!(
        amqp_text(no_handler, header::MESSAGE_TYPE).as_deref(),
        Some("nobody-handles-this")
    );
    h.shutdown().await;
}

/// Issue 14 item 14: `weir-message-type` sent as an AMQP byte array (pika's
/// Python `bytes`) routes the message; byte-array and long-string headers
/// that are not UTF-8 reach the dead letter with every byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_byte_array_and_non_utf8_headers_are_kept() {
    let mut h = rabbit(1, 3).await;
    let id = format!("bin-{}", h.name);
    let mut t = FieldTable::default();
    t.insert(header::MESSAGE_ID.into(), AMQPValue::LongString(id.as_str().into()));
    t.insert(
        header::MESSAGE_TYPE.into(),
        AMQPValue::ByteArray(ByteArray::from(b"reject".to_vec())),
    );
    t.insert(
        "x-bin".into(),
        AMQPValue::ByteArray(ByteArray::from(vec![0xff, 0x00, 0x80])),
    );
    t.insert(
        "x-latin1".into(),
        AMQPValue::LongString(LongString::from(vec![b'c', 0xe9])),
    );
    t.insert(
        "x-text".into(),
        AMQPValue::ByteArray(ByteArray::from(b"plain".to_vec())),
    );
    amqp_publish(&names::slot_queue(&h.name, 0), t, b"b").await;
    h.wait_for(&id, Outcome::DeadLettered(Reason::Rejected), secs(30)).await;
    let dead = read_queue(&names::dead_letter(&h.name), 1).await;
    let d = &dead[0];
    assert_eq!(amqp_text(d, header::MESSAGE_TYPE).as_deref(), Some("reject"));
    assert_eq!(amqp_text(d, header::ERROR).as_deref(), Some("rejected by test"));
    let bytes = |name: &str| match amqp_value(d, name) {
        Some(AMQPValue::ByteArray(b)) => b.as_slice().to_vec(),
        Some(AMQPValue::LongString(s)) => s.as_bytes().to_vec(),
        other => panic!("{name}: {other:?}"),
    };
    assert_eq!(bytes("x-bin"), vec![0xff, 0x00, 0x80], "every byte kept");
    assert_eq!(bytes("x-latin1"), vec![b'c', 0xe9], "no replacement character");
    assert_eq!(bytes("x-text"), b"plain".to_vec());
    assert!(
        amqp_value(d, header::BINARY_HEADERS).is_none(),
        "the hex list stays inside Weir"
    );
    h.shutdown().await;
}

/// Issue 14 item 13: with the dead-letter queue gone, a rejected message's
/// failed capture is returned after a growing backoff, not at once (which
/// ran the handler thousands of times a second); once the queue is back the
/// message is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_dead_letter_outage_backs_off_instead_of_hot_looping() {
    let mut h = rabbit(1, 3).await;
    let dlq = names::dead_letter(&h.name);
    let (conn, ch) = plain().await;
    ch.queue_delete(dlq.as_str().into(), Default::default()).await.unwrap();
    let m = msg("reject", "dl-out", "x");
    h.publish(&m).await;
    let start = Instant::now();
    while h.obs.calls.of(&m.id).is_empty() {
        assert!(start.elapsed() < secs(20), "the message was called");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A measuring window, not a synchronisation: how often it ran in 3 s.
    tokio::time::sleep(secs(3)).await;
    let calls = h.obs.calls.of(&m.id).len();
    assert!(
        calls <= 20,
        "the handler ran {calls} times in 3 s while captures failed"
    );
    let opts = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    ch.queue_declare(dlq.as_str().into(), opts, FieldTable::default())
        .await
        .unwrap();
    let _ = conn.close(200, "done".into()).await;
    h.wait_for(&m.id, Outcome::DeadLettered(Reason::Rejected), secs(30))
        .await;
    h.shutdown().await;
}

// -------------------------------------------------------------------- NATS

async fn nats_dead_letters(topology: &str, n: usize) -> Vec<async_nats::jetstream::message::StreamMessage> {
    let js = common::nats::js_at(&common::nats::url()).await;
    let stream = js.get_stream(nats_names::dead_letter_stream(topology)).await.unwrap();
    let deadline = Instant::now() + secs(10);
    let mut out = Vec::new();
    let mut seq = 1;
    while out.len() < n {
        match stream.get_raw_message(seq).await {
            Ok(m) => {
                out.push(m);
                seq += 1;
            }
            Err(e) => {
                assert!(Instant::now() < deadline, "dead letters: {} of {n} ({e})", out.len());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    out
}

fn nats_header(m: &async_nats::jetstream::message::StreamMessage, name: &str) -> Option<String> {
    m.headers.get(name).map(|v| v.as_str().to_owned())
}

fn nats_by_id<'a>(
    dead: &'a [async_nats::jetstream::message::StreamMessage],
    id: &str,
) -> &'a async_nats::jetstream::message::StreamMessage {
    dead.iter()
        .find(|m| nats_header(m, header::MESSAGE_ID).as_deref() == Some(id))
        .unwrap_or_else(|| panic!("a dead letter of {id}"))
}

/// Issue 15 item 1: a guest panic on its last delivery (a multi-line wasm
/// backtrace in `weir-error`) and a multi-line reject reason are captured
/// with the line breaks written as `\n`; the slot runner lives on and
/// handles the other messages of its slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_multi_line_errors_are_captured_and_the_slot_lives_on() {
    let mut h = nats(1).await;
    let subscribed = h.subscriptions.load(Ordering::Relaxed);
    let trap = msg("trap", "n-1", "x");
    let lines = msg("bytes.reject-lines", "n-2", "x");
    h.publish(&trap).await;
    h.publish(&lines).await;
    h.wait_for(&trap.id, Outcome::DeadLettered(Reason::Trap), secs(30))
        .await;
    h.wait_for(&lines.id, Outcome::DeadLettered(Reason::Rejected), secs(30))
        .await;
    still_flowing(&h, subscribed).await;
    let dead = nats_dead_letters(&h.name, 2).await;
    let e = nats_header(nats_by_id(&dead, &lines.id), header::ERROR).unwrap();
    assert_eq!(e, "first line\\nsecond line\\r\\nthird line");
    let e = nats_header(nats_by_id(&dead, &trap.id), header::ERROR).unwrap();
    assert!(e.contains("trap requested by test"), "{e}");
    h.shutdown().await;
}

/// Issue 15 item 2 on NATS: cascade headers NATS cannot carry (a value with
/// CR/LF, a name with a space and a colon) fail the call with a reason that
/// says so; the runner lives on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_cascade_headers_nats_cannot_carry_fail_the_call() {
    let mut h = nats(1).await;
    let subscribed = h.subscriptions.load(Ordering::Relaxed);
    let crlf = msg("bytes.cascade-crlf", "nc-1", "x");
    let name = msg("bytes.cascade-bad-name", "nc-2", "x");
    h.publish(&crlf).await;
    h.publish(&name).await;
    h.wait_for(&crlf.id, Outcome::DeadLettered(Reason::Exhausted), secs(30))
        .await;
    h.wait_for(&name.id, Outcome::DeadLettered(Reason::Exhausted), secs(30))
        .await;
    still_flowing(&h, subscribed).await;
    let dead = nats_dead_letters(&h.name, 2).await;
    let e = nats_header(nats_by_id(&dead, &crlf.id), header::ERROR).unwrap();
    assert!(e.contains("x-evil") && e.contains("CR or LF"), "{e}");
    let e = nats_header(nats_by_id(&dead, &name.id), header::ERROR).unwrap();
    assert!(e.contains("printable ASCII"), "{e}");
    h.shutdown().await;
}

/// Issue 15 item 10: a reject reason over the server's `max_payload` is
/// captured as `rejected` with its (cut) reason, not as `exhausted` with a
/// generic text; and a publisher's message that all but fills `max_payload`
/// is captured `no-handler` with its big header cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_oversized_reasons_and_headers_are_captured_cut() {
    let mut h = nats(1).await;
    let subscribed = h.subscriptions.load(Ordering::Relaxed);
    let big = msg("bytes.reject-big", "nb-1", &(2 * MIB).to_string());
    h.publish(&big).await;
    h.wait_for(&big.id, Outcome::DeadLettered(Reason::Rejected), secs(30))
        .await;

    let client = async_nats::connect(common::nats::url()).await.unwrap();
    let max_payload = client.server_info().max_payload;
    let id = format!("np-{}", h.name);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(header::MESSAGE_ID, id.as_str());
    headers.insert(header::MESSAGE_TYPE, "nobody-handles-this");
    // Under both limits a publisher meets: max_payload and JetStream's 64 KiB of headers.
    let filler = "b".repeat((64 * 1024).min(max_payload) - 300);
    headers.insert("x-big", filler.as_str());
    let js = async_nats::jetstream::new(client);
    js.publish_with_headers(nats_names::slot_subject(&h.name, 0), headers, "p".into())
        .await
        .unwrap()
        .await
        .unwrap();
    h.wait_for(&id, Outcome::DeadLettered(Reason::NoHandler), secs(30))
        .await;
    still_flowing(&h, subscribed).await;

    let dead = nats_dead_letters(&h.name, 2).await;
    let e = nats_header(nats_by_id(&dead, &big.id), header::ERROR).unwrap();
    assert!(e.starts_with("big reject reason:"), "keeps the start");
    assert!(
        says_cut(&e, 2 * MIB),
        "says it was cut, and its length: {:?}",
        &e[e.len().saturating_sub(80)..]
    );
    assert!(!e.contains('\n') && !e.contains('\r'));
    let cut = nats_header(nats_by_id(&dead, &id), "x-big").unwrap();
    assert!(cut.ends_with(&cut_marker(filler.len())), "cut with a marker");
    h.shutdown().await;
}
