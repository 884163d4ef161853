//! Issue 32, items 1 and 2: Weir's own headers are Weir's. Run as an attacker
//! would, against the real RabbitMQ and nats-server, with a raw client of
//! each broker (no Weir code on the publishing side) and a guest's
//! cascades:
//! - a publisher's `weir-handler-pin` does not choose the version (it runs
//!   on the current one), and a version whose directory grant was revoked
//!   cannot be pinned back even by an operator's sealed redrive;
//! - a guest's cascade carrying `weir-*` provenance, and a publisher's
//!   forged `weir-redrive-count` and `weir-attempt`, never reach a dead
//!   letter as Weir's: the letter's provenance is the capture's own, the
//!   forgeries are kept under `untrusted-` names, and a claimed attempt
//!   does not shorten the ladder.
//!
//! The red baseline of each is kept: the same run on a node whose seal
//! believes every header (`NodeOptions::negative_control_trust_weir_headers`,
//! Weir before the seal) runs the pinned version, reports the forged
//! redrive count, and gives the forged attempt one call only.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use parking_lot::Mutex;
use weir::config::{self, Config};
use weir::deadletter::{self, Filter};
use weir::envelope::{self, Envelope, Wire, header};
use weir::node::{Node, NodeOptions, bundled};
use weir::outcome::{Outcome, Reason, SettleObserver};
use weir::runtime::{CallObserver, RuntimeOptions};
use weir::transport::Transport;
use weir::transport::nats::Nats;

use common::http::{call, digest, free_port, variant, wait_up};

const OPERATOR: &str = "operator-secret-seal-0123456789";
const SLOTS: u32 = 2;
const TYPES: [&str; 5] = ["ok", "reject", "retry", "admin.read", "hostile.forge-cascade"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Broker {
    Rabbit,
    Nats,
}

/// Every call a node made (id, attempt, version) and every settlement.
#[derive(Default)]
struct Watch {
    digests: Mutex<HashMap<String, String>>,
    calls: Mutex<Vec<(String, u32, String)>>,
    settled: Mutex<Vec<(String, Outcome)>>,
}

impl CallObserver for Watch {
    fn version(&self, msg: &Envelope, digest: &str) {
        self.digests.lock().insert(msg.id.clone(), digest.to_owned());
    }
    fn before(&self, msg: &Envelope) {
        let digest = self.digests.lock().get(&msg.id).cloned().unwrap_or_default();
        self.calls.lock().push((msg.id.clone(), msg.attempt, digest));
    }
    fn after(&self, _: &Envelope) {}
}

impl SettleObserver for Watch {
    fn settled(&self, id: &str, outcome: Outcome) {
        self.settled.lock().push((id.to_owned(), outcome));
    }
}

impl Watch {
    /// Wait until `id` was settled `outcome`.
    async fn wait(&self, id: &str, outcome: Outcome) {
        let start = Instant::now();
        while !self.settled.lock().iter().any(|(i, o)| i == id && *o == outcome) {
            let settled = self.settled.lock().clone();
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "timed out waiting for {outcome:?} of {id}; settled: {settled:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The calls of `id`: (attempt, version) in call order.
    fn calls_of(&self, id: &str) -> Vec<(u32, String)> {
        self.calls
            .lock()
            .iter()
            .filter(|(i, ..)| i == id)
            .map(|(_, a, d)| (*a, d.clone()))
            .collect()
    }

    /// The id of the first settled message other than `known`.
    fn other_settled(&self, known: &[&str]) -> Option<String> {
        self.settled
            .lock()
            .iter()
            .map(|(i, _)| i.clone())
            .find(|i| !known.contains(&i.as_str()))
    }
}

/// A node of the faulty guest on a fresh topology of `broker`, with an
/// admin listener and a data directory; its broker objects go on drop.
struct Setup {
    broker: Broker,
    name: String,
    cfg: Config,
    node: Node,
    watch: Arc<Watch>,
    port: u16,
    transport: Arc<dyn Transport>,
    _data: tempfile::TempDir,
    _guard: Box<dyn std::any::Any + Send>,
}

impl Setup {
    async fn new(broker: Broker, trust_everything: bool) -> Self {
        let ladder = [Duration::from_millis(300)];
        let (name, url, transport, guard): (String, String, Arc<dyn Transport>, Box<dyn std::any::Any + Send>) =
            match broker {
                Broker::Rabbit => {
                    let topo = common::rabbit::Topo::new(SLOTS, &ladder);
                    let t = Arc::new(common::rabbit::transport("seal-test"));
                    (topo.name.clone(), common::rabbit::url(), t, Box::new(topo))
                }
                Broker::Nats => {
                    let topo = common::nats::Topo::new();
                    let t = Arc::new(Nats::new(common::nats::url(), "seal-test"));
                    (topo.name.clone(), common::nats::url(), t, Box::new(topo))
                }
            };
        let data = tempfile::tempdir().unwrap();
        let port = free_port();
        let text = format!(
            r#"
[node]
name = "seal-{name}"
admin = "127.0.0.1:{port}"
admin_token = "{OPERATOR}"
data_dir = {data:?}
[transport]
kind = "{kind}"
url = "{url}"
prefetch = 32
{queue_type}
[[topology]]
name = "{name}"
slots = {SLOTS}
[topology.retry]
ladder = ["300ms"]
max_deliver = 3
[[handler]]
name = "faulty"
component = "{faulty}"
topology = "{name}"
message_types = {TYPES:?}
"#,
            data = data.path().display().to_string(),
            kind = match broker {
                Broker::Rabbit => "rabbitmq",
                Broker::Nats => "nats",
            },
            queue_type = match broker {
                Broker::Rabbit => format!("queue_type = \"{}\"", common::rabbit::queue_type()),
                Broker::Nats => String::new(),
            },
            faulty = bundled::FAULTY_PATH,
        );
        let cfg = config::parse(&text, "<seal test>").unwrap();
        let watch = Arc::new(Watch::default());
        let opts = NodeOptions {
            workers: 2,
            runtime: common::cached(RuntimeOptions::default()),
            call_observer: Some(watch.clone()),
            settle_observer: Some(watch.clone()),
            negative_control_trust_weir_headers: trust_everything,
            ..NodeOptions::default()
        };
        let node = Node::start(&cfg, transport.clone(), opts).await.unwrap();
        wait_up(port);
        Self {
            broker,
            name,
            cfg,
            node,
            watch,
            port,
            transport,
            _data: data,
            _guard: guard,
        }
    }

    async fn http(&self, method: &'static str, path: String, body: Vec<u8>) -> (u16, serde_json::Value) {
        let port = self.port;
        tokio::task::spawn_blocking(move || call(method, port, &path, Some(OPERATOR), &body))
            .await
            .unwrap()
    }

    /// Publish `headers` + `payload` to the slot of `group` with the
    /// broker's own client, as any publisher can: nothing of Weir's
    /// touches the message on its way.
    async fn raw_publish(&self, headers: &[(&str, &str)], group: &str, payload: &[u8]) {
        let slot = weir::partition::slot_of(group, SLOTS);
        match self.broker {
            Broker::Rabbit => {
                let conn = Connection::connect(&common::rabbit::url(), ConnectionProperties::default())
                    .await
                    .unwrap();
                let ch = conn.create_channel().await.unwrap();
                ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
                let mut table = FieldTable::default();
                for (k, v) in headers {
                    table.insert(ShortString::from(*k), AMQPValue::LongString(LongString::from(*v)));
                }
                ch.basic_publish(
                    format!("weir.{}", self.name).as_str().into(),
                    slot.to_string().as_str().into(),
                    BasicPublishOptions::default(),
                    payload,
                    BasicProperties::default().with_headers(table),
                )
                .await
                .unwrap()
                .await
                .unwrap();
                let _ = conn.close(200, "".into()).await;
            }
            Broker::Nats => {
                let js = common::nats::js_at(&common::nats::url()).await;
                let mut map = async_nats::HeaderMap::new();
                for (k, v) in headers {
                    map.insert(*k, *v);
                }
                js.publish_with_headers(format!("weir.{}.slot.{slot}", self.name), map, payload.to_vec().into())
                    .await
                    .unwrap()
                    .await
                    .unwrap();
            }
        }
    }

    /// The dead letter of message `id` (read and left in place).
    async fn letter(&self, id: &str) -> Wire {
        let start = Instant::now();
        loop {
            let store = self.transport.dead_letters().unwrap();
            let sel = deadletter::select(store, &self.name, &Filter::default(), &deadletter::no_progress)
                .await
                .unwrap();
            let found = sel
                .selected
                .iter()
                .find(|l| l.wire.header(header::MESSAGE_ID) == Some(id))
                .map(|l| l.wire.clone());
            sel.close().await;
            if let Some(w) = found {
                return w;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "no dead letter of {id}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn id() -> String {
    envelope::fresh_id()
}

// ---------------------------------------------------------------- item 1: pins

/// A publisher's pin: the message runs on the current version (v2), not the
/// pinned v1; the pin is kept only as `untrusted-weir-handler-pin`.
/// `trust_everything`: the red baseline, where it runs on v1.
async fn a_publishers_pin(broker: Broker, trust_everything: bool) {
    let s = Setup::new(broker, trust_everything).await;
    let v1 = digest(&common::faulty_bytes());
    let v2_bytes = variant(&common::faulty_bytes(), "v2");
    let v2 = digest(&v2_bytes);
    let (code, body) = s.http("PUT", "/v1/handlers/faulty".into(), v2_bytes).await;
    assert_eq!(code, 200, "{body}");
    let m = id();
    s.raw_publish(
        &[
            (header::MESSAGE_ID, &m),
            (header::MESSAGE_TYPE, "ok"),
            (header::GROUP_ID, "pinned"),
            (header::HANDLER_PIN, &v1),
        ],
        "pinned",
        b"",
    )
    .await;
    s.watch.wait(&m, Outcome::Handled).await;
    let ran = s.watch.calls_of(&m);
    if trust_everything {
        assert_eq!(ran, vec![(1, v1)], "the negative control honours the publisher's pin");
    } else {
        assert_eq!(ran, vec![(1, v2)], "a publisher's pin runs the current version");
        let counted = s.node.stats().snapshot().untrusted_headers;
        assert_eq!(counted, 1, "the forged pin is counted");
    }
    s.node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_a_publishers_pin_runs_the_current_version() {
    a_publishers_pin(Broker::Rabbit, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_negative_control_a_publishers_pin_is_honoured_when_headers_are_believed() {
    a_publishers_pin(Broker::Rabbit, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_a_publishers_pin_runs_the_current_version() {
    a_publishers_pin(Broker::Nats, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_negative_control_a_publishers_pin_is_honoured_when_headers_are_believed() {
    a_publishers_pin(Broker::Nats, true).await;
}

/// A version deployed with a directory grant, then replaced by one without:
/// its secret cannot be read again through a pin. Not by a publisher (the
/// pin is not believed), and not by an operator's sealed redrive either (a
/// pinned version never has more grants than the current one: refused
/// with 409 by the admin API, dead-lettered `no-handler` naming the grant
/// when the pin arrives sealed on the slot). A pin to the grant-free
/// configured version is honoured (the pin itself still works).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_grant_cannot_be_pinned_back() {
    let s = Setup::new(Broker::Rabbit, false).await;
    let secret_dir = tempfile::tempdir().unwrap();
    std::fs::write(secret_dir.path().join("secret"), "TOP-SECRET-GRANTED-ONCE").unwrap();
    let v1 = digest(&common::faulty_bytes());
    let granted_bytes = variant(&common::faulty_bytes(), "granted");
    let granted = digest(&granted_bytes);
    let q = format!("/v1/handlers/faulty?dir=/data:{}", secret_dir.path().display());
    let (code, body) = s.http("PUT", q, granted_bytes).await;
    assert_eq!(code, 200, "{body}");
    let read = |group: &str, extra: Vec<(String, String)>| {
        let mut h = vec![(header::HANDLER_PIN.to_owned(), granted.clone())];
        h.extend(extra);
        envelope::new_message(
            id(),
            "admin.read",
            Some(group.into()),
            None,
            h,
            b"/data/secret".to_vec(),
        )
    };
    // While granted, the version reads it (the grant works).
    let first = envelope::new_message(
        id(),
        "admin.read",
        Some("g0".into()),
        None,
        vec![],
        b"/data/secret".to_vec(),
    );
    s.node.publish(&s.name, &first).await.unwrap();
    s.watch.wait(&first.id, Outcome::DeadLettered(Reason::Rejected)).await;
    let e = s.letter(&first.id).await;
    assert!(e.header(header::ERROR).unwrap().contains("ok TOP-SECRET"), "{e:?}");
    // Revoked: v3 has no grant.
    let v3_bytes = variant(&common::faulty_bytes(), "v3");
    let (code, body) = s.http("PUT", "/v1/handlers/faulty".into(), v3_bytes).await;
    assert_eq!(code, 200, "{body}");

    // A publisher pins the granted version: it runs on v3, denied.
    let forged = read("g1", vec![]);
    s.node.publish(&s.name, &forged).await.unwrap();
    s.watch.wait(&forged.id, Outcome::DeadLettered(Reason::Rejected)).await;
    let letter = s.letter(&forged.id).await;
    let error = letter.header(header::ERROR).unwrap();
    assert!(error.contains("denied") && !error.contains("TOP-SECRET"), "{error}");
    assert_eq!(letter.header("untrusted-weir-handler-pin"), Some(granted.as_str()));

    // The operator's redrive pinned to it is refused, nothing moved.
    let (code, body) = s
        .http(
            "POST",
            format!("/v1/dead-letters/redrive?handler_version={granted}"),
            vec![],
        )
        .await;
    assert_eq!(code, 409, "{body}");
    let why = body["error"].as_str().unwrap();
    assert!(
        why.contains("directory grant /data") && why.contains("current version"),
        "{why}"
    );

    // Sealed with the cluster's key (an operator's tool), it reaches the
    // slot as Weir's, and is still refused: dead-lettered `no-handler`.
    let seal = weir::seal::key::load(&s.cfg, None).await.unwrap();
    let mut sealed = read("g2", vec![]);
    seal.sign(&mut sealed, true);
    s.node.publish(&s.name, &sealed).await.unwrap();
    s.watch.wait(&sealed.id, Outcome::DeadLettered(Reason::NoHandler)).await;
    let error = s.letter(&sealed.id).await.header(header::ERROR).unwrap().to_owned();
    assert!(
        error.contains("directory grant /data") && !error.contains("TOP-SECRET"),
        "{error}"
    );
    assert!(s.watch.calls_of(&sealed.id).is_empty(), "the pinned version never ran");

    // A sealed pin to the configured, grant-free v1 is honoured.
    let mut ok = envelope::new_message(
        id(),
        "ok",
        Some("g3".into()),
        None,
        vec![(header::HANDLER_PIN.into(), v1.clone())],
        vec![],
    );
    seal.sign(&mut ok, true);
    s.node.publish(&s.name, &ok).await.unwrap();
    s.watch.wait(&ok.id, Outcome::Handled).await;
    assert_eq!(s.watch.calls_of(&ok.id), vec![(1, v1)]);
    s.node.shutdown().await.unwrap();
}

// ---------------------------------------------------------------- item 2: provenance

/// A guest's cascade with forged provenance, and a publisher's forged
/// redrive count, are dead-lettered with the capture's own provenance.
/// `trust_everything`: the red baseline, where the letter tells the
/// attacker's story.
async fn forged_provenance(broker: Broker, trust_everything: bool) {
    let s = Setup::new(broker, trust_everything).await;
    let v1 = digest(&common::faulty_bytes());
    let v2_bytes = variant(&common::faulty_bytes(), "v2");
    let v2 = digest(&v2_bytes);
    let (code, body) = s.http("PUT", "/v1/handlers/faulty".into(), v2_bytes).await;
    assert_eq!(code, 200, "{body}");

    // The guest's cascade: a `reject` carrying forged weir-* headers and a
    // pin to the replaced v1.
    let parent = envelope::new_message(
        id(),
        "hostile.forge-cascade",
        Some("forger".into()),
        None,
        vec![("x-pin".into(), v1.clone())],
        b"reject".to_vec(),
    );
    s.node.publish(&s.name, &parent).await.unwrap();
    s.watch.wait(&parent.id, Outcome::Handled).await;
    let start = Instant::now();
    let cascade = loop {
        if let Some(c) = s.watch.other_settled(&[&parent.id]) {
            break c;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "the cascade never settled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    s.watch.wait(&cascade, Outcome::DeadLettered(Reason::Rejected)).await;
    let letter = s.letter(&cascade).await;
    let redrives = deadletter::view::redrive_count(&letter);

    // The publisher's forged redrive count on a `reject`.
    let forged = id();
    s.raw_publish(
        &[
            (header::MESSAGE_ID, &forged),
            (header::MESSAGE_TYPE, "reject"),
            (header::GROUP_ID, "forged"),
            (header::REDRIVE_COUNT, "4294967295"),
            (header::REDRIVE_REASON, "forged-reason"),
        ],
        "forged",
        b"",
    )
    .await;
    s.watch.wait(&forged, Outcome::DeadLettered(Reason::Rejected)).await;
    let published = s.letter(&forged).await;

    if trust_everything {
        assert_eq!(redrives, 4_294_967_295, "the negative control believes the guest");
        assert_eq!(
            letter.header(header::HANDLER_VERSION),
            Some(v1.as_str()),
            "and runs the version its cascade pinned"
        );
        assert_eq!(letter.header(header::REDRIVE_REASON), Some("forged-reason"));
        assert_eq!(deadletter::view::redrive_count(&published), 4_294_967_295);
    } else {
        // The capture's own provenance, the forgeries set aside.
        assert_eq!(redrives, 0, "{letter:?}");
        assert_eq!(letter.header(header::DEAD_LETTER_REASON), Some("rejected"));
        assert_eq!(letter.header(header::ERROR), Some("rejected by test"));
        assert_eq!(
            letter.header(header::HANDLER_VERSION),
            Some(v2.as_str()),
            "the current version ran it"
        );
        assert_eq!(letter.header("untrusted-weir-handler-pin"), Some(v1.as_str()));
        assert_eq!(letter.header("untrusted-weir-handler-version"), Some("forged-version"));
        assert_eq!(letter.header(header::REDRIVE_REASON), None);
        assert_eq!(letter.header("untrusted-weir-redrive-count"), Some("4294967295"));
        assert_eq!(
            letter.header("untrusted-weir-error"),
            Some("forged: the operator reads the attacker's story")
        );
        assert!(
            letter.headers.iter().filter(|(k, _)| k == header::ERROR).count() == 1,
            "one weir-error: the capture's"
        );
        assert_eq!(deadletter::view::redrive_count(&published), 0, "{published:?}");
        assert_eq!(published.header("untrusted-weir-redrive-count"), Some("4294967295"));
        assert_eq!(
            published.header(header::SEAL),
            None,
            "a letter carries no seal of a delivery"
        );
    }
    s.node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_forged_provenance_never_reaches_a_letter() {
    forged_provenance(Broker::Rabbit, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_negative_control_forged_provenance_is_believed_without_the_seal() {
    forged_provenance(Broker::Rabbit, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_forged_provenance_never_reaches_a_letter() {
    forged_provenance(Broker::Nats, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_negative_control_forged_provenance_is_believed_without_the_seal() {
    forged_provenance(Broker::Nats, true).await;
}

/// RabbitMQ, where the host counts attempts in `weir-attempt`: a publisher
/// claiming attempt 3 of 3 still gets three calls (1, 2, 3) before it is
/// dead-lettered `exhausted`, and its own retries (sealed) keep counting.
/// `trust_everything`: the red baseline, one call at attempt 3.
async fn a_claimed_attempt(trust_everything: bool) {
    let s = Setup::new(Broker::Rabbit, trust_everything).await;
    let m = id();
    s.raw_publish(
        &[
            (header::MESSAGE_ID, &m),
            (header::MESSAGE_TYPE, "retry"),
            (header::GROUP_ID, "claims"),
            (header::ATTEMPT, "3"),
        ],
        "claims",
        b"",
    )
    .await;
    s.watch.wait(&m, Outcome::DeadLettered(Reason::Exhausted)).await;
    let attempts: Vec<u32> = s.watch.calls_of(&m).into_iter().map(|(a, _)| a).collect();
    if trust_everything {
        assert_eq!(attempts, vec![3], "the negative control believes the claimed attempt");
    } else {
        assert_eq!(
            attempts,
            vec![1, 2, 3],
            "a claimed attempt is not one; Weir's own retries are"
        );
        let letter = s.letter(&m).await;
        assert_eq!(letter.header("untrusted-weir-attempt"), Some("3"));
        assert_eq!(letter.header(header::ATTEMPT), Some("3"));
    }
    s.node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_a_claimed_attempt_is_not_one() {
    a_claimed_attempt(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_negative_control_a_claimed_attempt_is_believed_without_the_seal() {
    a_claimed_attempt(true).await;
}
