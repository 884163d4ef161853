//! The dead-letter tools (issue 19 item 2) against the real brokers:
//! `weir dead-letters list|show|redrive|purge` on RabbitMQ and NATS, an
//! ordered redrive of a group with three dead letters through a node (red
//! baseline: the letters sent last first), a redrive killed half-way (red
//! baseline: removal before the confirmed re-publish loses the letter in
//! flight), version pinning (`--handler-version`, refused when it cannot be
//! honoured, dead-lettered when it becomes unresolvable), and the admin
//! API's tenant scoping, also on the memory broker.
//!
//! Letters are written as a node's capture writes them
//! (`settle::capture::dead_letter_wire`, then `publish_dead_letter`), except
//! in the pinning test, where a node captures them itself.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use parking_lot::Mutex;
use weir::config::{self, Config};
use weir::deadletter::{self, Filter};
use weir::envelope::{self, Envelope, Wire, header};
use weir::node::{Node, NodeOptions, bundled};
use weir::outcome::{Outcome, Reason, SettleObserver};
use weir::runtime::{CallObserver, RuntimeOptions};
use weir::settle::capture::{Captured, Provenance, dead_letter_wire};
use weir::transport::dead_letters::DeadLetter;
use weir::transport::memory::MemoryBroker;
use weir::transport::nats::Nats;
use weir::transport::{TopologySpec, Transport};

use common::http::{call, digest, free_port, variant, wait_up};

const WEIR: &str = env!("CARGO_BIN_EXE_weir");
const OPERATOR: &str = "operator-secret-dlq-0123456789";
const ACME: &str = "acme-secret-dlq-0123456789";
const GLOBEX: &str = "globex-secret-dlq-0123456789";
const SLOTS: u32 = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Broker {
    Rabbit,
    Nats,
}

/// A fresh topology on a real broker, declared, deleted on drop.
struct Setup {
    broker: Broker,
    name: String,
    transport: Arc<dyn Transport>,
    _guard: Box<dyn std::any::Any + Send>,
}

impl Setup {
    async fn new(broker: Broker) -> Self {
        let ladder = [Duration::from_secs(1)];
        let (name, transport, guard): (String, Arc<dyn Transport>, Box<dyn std::any::Any + Send>) = match broker {
            Broker::Rabbit => {
                let topo = common::rabbit::Topo::new(SLOTS, &ladder);
                let t = Arc::new(common::rabbit::transport("dlq-test"));
                (topo.name.clone(), t, Box::new(topo))
            }
            Broker::Nats => {
                let topo = common::nats::Topo::new();
                let t = Arc::new(Nats::new(common::nats::url(), "dlq-test"));
                (topo.name.clone(), t, Box::new(topo))
            }
        };
        let mut spec = TopologySpec::new(&name, SLOTS);
        spec.retry.ladder = ladder.to_vec();
        spec.retry.max_deliver = 3;
        transport.declare(&spec).await.unwrap();
        Self {
            broker,
            name,
            transport,
            _guard: guard,
        }
    }

    fn kind(&self) -> &'static str {
        match self.broker {
            Broker::Rabbit => "rabbitmq",
            Broker::Nats => "nats",
        }
    }

    fn url(&self) -> String {
        match self.broker {
            Broker::Rabbit => common::rabbit::url(),
            Broker::Nats => common::nats::url(),
        }
    }

    /// The config a node and the CLI use: the faulty guest bound to `types`.
    fn config_text(&self, types: &[&str], node_extra: &str, extra: &str) -> String {
        format!(
            r#"
[node]
name = "dlq-{name}"
{node_extra}
[transport]
kind = "{kind}"
url = "{url}"
prefetch = 32
{queue_type}
[[topology]]
name = "{name}"
slots = {SLOTS}
[topology.retry]
ladder = ["1s"]
max_deliver = 3
[[handler]]
name = "faulty"
component = "{faulty}"
topology = "{name}"
message_types = {types:?}
{extra}
"#,
            name = self.name,
            kind = self.kind(),
            url = self.url(),
            queue_type = match self.broker {
                Broker::Rabbit => format!("queue_type = \"{}\"", common::rabbit::queue_type()),
                Broker::Nats => String::new(),
            },
            faulty = bundled::FAULTY_PATH,
        )
    }

    fn config_file(&self, text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
        std::io::Write::write_all(&mut f, text.as_bytes()).unwrap();
        f
    }

    /// Capture `wire` on the dead-letter destination, as a node does.
    async fn capture(&self, wire: Wire) {
        self.transport.publish_dead_letter(&self.name, wire).await.unwrap();
    }

    /// Every dead letter, in order (read and left in place).
    async fn dlq(&self) -> Vec<DeadLetter> {
        self.dlq_idle().await;
        let store = self.transport.dead_letters().unwrap();
        let sel = deadletter::select(store, &self.name, &Filter::default(), &deadletter::no_progress)
            .await
            .unwrap();
        let letters = sel.selected.clone();
        sel.close().await;
        letters
    }

    /// RabbitMQ: wait until no consumer (a killed command's) holds the
    /// dead-letter queue, so its letters are back in it.
    async fn dlq_idle(&self) {
        if self.broker != Broker::Rabbit {
            return;
        }
        let conn = Connection::connect(&common::rabbit::url(), ConnectionProperties::default())
            .await
            .unwrap();
        let start = Instant::now();
        loop {
            let ch = conn.create_channel().await.unwrap();
            let q = ch
                .queue_declare(
                    format!("weir.{}.dead-letter", self.name).as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap();
            let _ = ch.close(200, "".into()).await;
            if q.consumer_count() == 0 {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the dead-letter queue stayed held"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = conn.close(200, "".into()).await;
    }

    /// Everything on the slots (taken off them), in each slot's order.
    async fn take_slots(&self) -> Vec<Wire> {
        let mut out = Vec::new();
        match self.broker {
            Broker::Rabbit => {
                let conn = Connection::connect(&common::rabbit::url(), ConnectionProperties::default())
                    .await
                    .unwrap();
                let ch = conn.create_channel().await.unwrap();
                for slot in 0..SLOTS {
                    let q = format!("weir.{}.{slot}", self.name);
                    // A consumer, not basic.get: quorum queues with single
                    // active consumer refuse basic.get (RESOURCE_LOCKED).
                    let passive = QueueDeclareOptions {
                        passive: true,
                        ..QueueDeclareOptions::default()
                    };
                    let ready = ch
                        .queue_declare(q.as_str().into(), passive, FieldTable::default())
                        .await
                        .unwrap()
                        .message_count();
                    if ready == 0 {
                        continue;
                    }
                    let mut consumer = ch
                        .basic_consume(
                            q.as_str().into(),
                            "".into(),
                            BasicConsumeOptions {
                                no_ack: true,
                                ..BasicConsumeOptions::default()
                            },
                            FieldTable::default(),
                        )
                        .await
                        .unwrap();
                    for _ in 0..ready {
                        let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.next())
                            .await
                            .expect("a ready message is delivered")
                            .unwrap()
                            .unwrap();
                        let headers = delivery
                            .properties
                            .headers()
                            .as_ref()
                            .map(|t| {
                                t.inner()
                                    .iter()
                                    .filter_map(|(k, v)| match v {
                                        AMQPValue::LongString(s) => {
                                            Some((k.to_string(), String::from_utf8_lossy(s.as_bytes()).into_owned()))
                                        }
                                        _ => None,
                                    })
                                    .collect()
                            })
                            .unwrap_or_default();
                        out.push(Wire {
                            headers,
                            body: delivery.data,
                        });
                    }
                    ch.basic_cancel(consumer.tag().as_str().into(), Default::default())
                        .await
                        .unwrap();
                }
                let _ = conn.close(200, "".into()).await;
            }
            Broker::Nats => {
                let js = common::nats::js_at(&common::nats::url()).await;
                let mut stream = js
                    .get_stream(weir::transport::nats::names::stream(&self.name))
                    .await
                    .unwrap();
                let last = stream.info().await.unwrap().state.last_sequence;
                for seq in 1..=last {
                    let Ok(m) = stream.get_raw_message(seq).await else {
                        continue;
                    };
                    let mut headers = Vec::new();
                    for (k, vs) in m.headers.iter() {
                        for v in vs {
                            headers.push((AsRef::<str>::as_ref(k).to_owned(), v.as_str().to_owned()));
                        }
                    }
                    out.push(Wire {
                        headers,
                        body: m.payload.to_vec(),
                    });
                    stream.delete_message(seq).await.unwrap();
                }
            }
        }
        out
    }
}

/// A message of `group` (tenant `tenant`) as a capture of `reason` writes it.
fn letter(ty: &str, group: Option<&str>, tenant: Option<&str>, reason: Reason, payload: &str) -> (String, Wire) {
    let env = envelope::new_message(
        envelope::fresh_id(),
        ty,
        group.map(str::to_owned),
        tenant.map(str::to_owned),
        vec![("x-order-note".into(), format!("kept {payload}"))],
        payload.as_bytes().to_vec(),
    );
    let p = Provenance {
        reason,
        error: "failed in the test",
        source: "weir.test.0",
        handler: Some(("faulty", "0000")),
        tag: 1,
    };
    (env.id.clone(), dead_letter_wire(Captured::Envelope(&env), &p))
}

fn id_of(w: &Wire) -> String {
    w.header(header::MESSAGE_ID).unwrap_or_default().to_owned()
}

/// `weir ARGS` with `envs`, off the async threads: (status, stdout, stderr).
async fn weir(args: Vec<String>, envs: Vec<(&'static str, String)>) -> (std::process::ExitStatus, String, String) {
    tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new(WEIR)
            .args(&args)
            .envs(envs)
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
    .await
    .unwrap()
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

/// Every call a node made: message, group, headers, version, when.
#[derive(Debug, Clone)]
struct Seen {
    id: String,
    group: Option<String>,
    attempt: u32,
    headers: Vec<(String, String)>,
    digest: String,
    start: Instant,
    end: Option<Instant>,
}

#[derive(Default)]
struct Watch {
    calls: Mutex<Vec<Seen>>,
    digests: Mutex<HashMap<String, String>>,
    settled: Mutex<Vec<(String, Outcome)>>,
}

impl CallObserver for Watch {
    fn version(&self, msg: &Envelope, digest: &str) {
        self.digests.lock().insert(msg.id.clone(), digest.to_owned());
    }
    fn before(&self, msg: &Envelope) {
        let digest = self.digests.lock().get(&msg.id).cloned().unwrap_or_default();
        self.calls.lock().push(Seen {
            id: msg.id.clone(),
            group: msg.group_id.clone(),
            attempt: msg.attempt,
            headers: msg.headers.clone(),
            digest,
            start: Instant::now(),
            end: None,
        });
    }
    fn after(&self, msg: &Envelope) {
        let now = Instant::now();
        if let Some(c) = self
            .calls
            .lock()
            .iter_mut()
            .rev()
            .find(|c| c.id == msg.id && c.end.is_none())
        {
            c.end = Some(now);
        }
    }
}

impl SettleObserver for Watch {
    fn settled(&self, id: &str, outcome: Outcome) {
        self.settled.lock().push((id.to_owned(), outcome));
    }
}

impl Watch {
    /// Wait until each of `ids` was settled `outcome` at least `times` times.
    async fn wait(&self, ids: &[String], outcome: Outcome, times: usize) {
        let start = Instant::now();
        loop {
            let settled = self.settled.lock().clone();
            let done = ids
                .iter()
                .all(|id| settled.iter().filter(|(i, o)| i == id && *o == outcome).count() >= times);
            if done {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "timed out waiting for {outcome:?} x{times} of {ids:?}; settled: {settled:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn start_node(cfg: &Config, transport: Arc<dyn Transport>, watch: &Arc<Watch>) -> Node {
    let opts = NodeOptions {
        workers: 2,
        runtime: common::cached(RuntimeOptions::default()),
        call_observer: Some(watch.clone()),
        settle_observer: Some(watch.clone()),
        ..NodeOptions::default()
    };
    Node::start(cfg, transport, opts).await.unwrap()
}

// ---------------------------------------------------------------- CLI: list, show, purge, dry runs

async fn cli_list_show_purge(broker: Broker) {
    let s = Setup::new(broker).await;
    let cfg = s.config_file(&s.config_text(&["ok"], "", ""));
    let path = cfg.path().to_str().unwrap().to_owned();
    let mut ids = Vec::new();
    for (i, (g, t, r)) in [
        ("g1", Some("acme"), Reason::Rejected),
        ("g2", None, Reason::Exhausted),
        ("g1", Some("acme"), Reason::Rejected),
        ("g2", None, Reason::Exhausted),
        ("g1", Some("acme"), Reason::Trap),
    ]
    .into_iter()
    .enumerate()
    {
        let (id, w) = letter("ok", Some(g), t, r, &format!("{{\"n\":{i}}}"));
        ids.push(id);
        s.capture(w).await;
    }
    // One that never decoded: no type, bytes that are not UTF-8.
    let raw = Wire {
        headers: vec![
            (header::MESSAGE_ID.into(), "raw-1".into()),
            (header::DEAD_LETTER_REASON.into(), "undecodable".into()),
            (header::ERROR.into(), "missing header `weir-message-type`".into()),
            (header::FAILED_AT.into(), "2020-01-01T00:00:00Z".into()),
        ],
        body: vec![0xff, 0x00, 0x7f],
    };
    s.capture(raw).await;
    ids.push("raw-1".into());
    let before = s.dlq().await;
    assert_eq!(before.iter().map(|l| id_of(&l.wire)).collect::<Vec<_>>(), ids);

    // list: a table of every letter, in capture order; nothing moves.
    let (st, out, err) = weir(args(&["dead-letters", "list", "--config", &path]), vec![]).await;
    assert!(st.success(), "{out}{err}");
    assert!(
        out.contains(&format!(
            "topology `{}` on {}: 6 of 6 dead letter(s) match",
            s.name,
            s.kind()
        )),
        "{out}"
    );
    let rows: Vec<&str> = out.lines().filter(|l| l.trim_start().starts_with('#')).collect();
    assert_eq!(rows.len(), 6, "{out}");
    for (row, id) in rows.iter().zip(&ids) {
        assert!(row.ends_with(id.as_str()), "rows in capture order: {out}");
    }
    assert!(out.contains("error: failed in the test"), "{out}");
    assert!(err.is_empty(), "no log chatter by default: {err}");
    // filters, JSON
    let (st, out, _) = weir(
        args(&[
            "dead-letters",
            "list",
            "--config",
            &path,
            "--reason",
            "exhausted",
            "--json",
        ]),
        vec![],
    )
    .await;
    assert!(st.success());
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["matched"], 2);
    assert_eq!(v["read"], 6);
    assert!(
        v["letters"]
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l["group"] == "g2" && l["reason"] == "exhausted")
    );
    let (_, out, _) = weir(
        args(&[
            "dead-letters",
            "list",
            "--config",
            &path,
            "--tenant",
            "acme",
            "--group",
            "g1",
            "--json",
        ]),
        vec![],
    )
    .await;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["matched"], 3);
    let (_, out, _) = weir(
        args(&[
            "dead-letters",
            "list",
            "--config",
            &path,
            "--until",
            "2021-01-01",
            "--json",
        ]),
        vec![],
    )
    .await;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["matched"], 1, "only the 2020 letter: {v}");
    let (_, out, _) = weir(
        args(&["dead-letters", "list", "--config", &path, "--since", "1h", "--json"]),
        vec![],
    )
    .await;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["matched"], 5);
    let (st, _, err) = weir(
        args(&["dead-letters", "list", "--config", &path, "--since", "soon"]),
        vec![],
    )
    .await;
    assert!(
        !st.success() && err.contains("--since") && err.contains("\"soon\""),
        "{err}"
    );

    // show: every header and the payload.
    let (st, out, _) = weir(
        args(&["dead-letters", "show", "--config", &path, &ids[1], "--json"]),
        vec![],
    )
    .await;
    assert!(st.success(), "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["payload"]["data"], "{\"n\":1}");
    assert!(
        v[0]["headers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h[0] == "x-order-note" && h[1] == "kept {\"n\":1}")
    );
    let pos = format!("#{}", before[5].position);
    let (st, out, _) = weir(args(&["dead-letters", "show", "--config", &path, &pos]), vec![]).await;
    assert!(st.success(), "{out}");
    assert!(
        out.contains("weir-dead-letter-reason: undecodable")
            && out.contains("payload (3 bytes, hex)")
            && out.contains("ff007f"),
        "{out}"
    );
    let (st, out, _) = weir(args(&["dead-letters", "show", "--config", &path, "no-such-id"]), vec![]).await;
    assert!(!st.success() && out.contains("none of 6"), "{out}");
    // show --id, as the README writes it; nothing to show is an error that says what to give.
    let (st, out, _) = weir(
        args(&["dead-letters", "show", "--config", &path, "--id", &ids[1], "--id", &pos]),
        vec![],
    )
    .await;
    assert!(st.success(), "{out}");
    assert_eq!(out.matches("dead letter #").count(), 2, "{out}");
    let (st, _, err) = weir(args(&["dead-letters", "show", "--config", &path]), vec![]).await;
    assert!(!st.success() && err.contains("--id"), "{err}");

    // list pages: --limit shows the first N and says how to see more; --all shows every one.
    let (st, out, _) = weir(
        args(&["dead-letters", "list", "--config", &path, "--limit", "2"]),
        vec![],
    )
    .await;
    assert!(st.success(), "{out}");
    assert!(
        out.contains("6 of 6 dead letter(s) match (the first 2 shown; --limit N or --all for more)"),
        "{out}"
    );
    assert_eq!(
        out.lines().filter(|l| l.trim_start().starts_with('#')).count(),
        2,
        "{out}"
    );
    let (st, out, _) = weir(args(&["dead-letters", "list", "--config", &path, "--all"]), vec![]).await;
    assert!(st.success() && !out.contains("shown"), "{out}");

    // summary: the pile as a few causes, most common first.
    let (st, out, _) = weir(args(&["dead-letters", "summary", "--config", &path, "--json"]), vec![]).await;
    assert!(st.success(), "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["matched"], 6);
    let by = |col: &str| -> Vec<(String, u64)> {
        v["by"][col]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (r["value"].as_str().unwrap().to_owned(), r["letters"].as_u64().unwrap()))
            .collect()
    };
    let owned =
        |rows: &[(&str, u64)]| -> Vec<(String, u64)> { rows.iter().map(|(k, n)| ((*k).to_owned(), *n)).collect() };
    assert_eq!(
        by("reason"),
        owned(&[("exhausted", 2), ("rejected", 2), ("trap", 1), ("undecodable", 1)])
    );
    assert_eq!(by("group"), owned(&[("g1", 3), ("g2", 2), ("-", 1)]));
    assert_eq!(by("type"), owned(&[("ok", 5), ("-", 1)]));
    let (st, out, _) = weir(
        args(&[
            "dead-letters",
            "summary",
            "--config",
            &path,
            "--top",
            "1",
            "--tenant",
            "acme",
        ]),
        vec![],
    )
    .await;
    assert!(st.success(), "{out}");
    assert!(out.contains("3 of 6 dead letter(s) match"), "{out}");
    let words: Vec<String> = out
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    let at = words.iter().position(|l| l == "by reason:").expect(&out);
    assert_eq!(words[at + 1..at + 3], ["rejected 2", "(1 others) 1"], "{out}");

    // redrive --dry-run: what would move, where; nothing moves.
    let (st, out, _) = weir(
        args(&[
            "dead-letters",
            "redrive",
            "--config",
            &path,
            "--group",
            "g1",
            "--dry-run",
        ]),
        vec![],
    )
    .await;
    assert!(st.success(), "{out}");
    assert!(
        out.contains("dry run: would redrive 3 of 6") && out.contains("(1 group(s))"),
        "{out}"
    );
    let slot = weir::partition::slot_for(Some("g1"), "", SLOTS);
    assert_eq!(out.matches(&format!("-> slot {slot}")).count(), 3, "{out}");

    // purge: refused without --yes, dry run, then only the selected go.
    let (st, _, err) = weir(args(&["dead-letters", "purge", "--config", &path]), vec![]).await;
    assert!(!st.success() && err.contains("--yes"), "{err}");
    let (st, out, _) = weir(
        args(&["dead-letters", "purge", "--config", &path, "--group", "g2", "--dry-run"]),
        vec![],
    )
    .await;
    assert!(st.success() && out.contains("would purge 2 of 6"), "{out}");
    assert_eq!(s.dlq().await.len(), 6);
    let (st, out, _) = weir(
        args(&["dead-letters", "purge", "--config", &path, "--group", "g2", "--yes"]),
        vec![],
    )
    .await;
    assert!(st.success() && out.contains("purged 2 of 2"), "{out}");
    let after: Vec<String> = s.dlq().await.iter().map(|l| id_of(&l.wire)).collect();
    let kept: Vec<String> = [0, 2, 4, 5].iter().map(|i| ids[*i].clone()).collect();
    assert_eq!(after, kept, "the others stay, in their order");
    assert!(s.take_slots().await.is_empty(), "nothing reached a slot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_list_show_purge_and_dry_runs() {
    cli_list_show_purge(Broker::Rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_list_show_purge_and_dry_runs() {
    cli_list_show_purge(Broker::Nats).await;
}

/// RabbitMQ has no browse: a read holds the letters as an exclusive
/// consumer. A second command meanwhile is refused (it would otherwise see
/// an empty queue), and the letters come back in their order when the
/// first one ends, however often they are read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_a_read_is_exclusive_and_keeps_the_order() {
    let s = Setup::new(Broker::Rabbit).await;
    let cfg = s.config_file(&s.config_text(&["ok"], "", ""));
    let path = cfg.path().to_str().unwrap().to_owned();
    let mut ids = Vec::new();
    for i in 0..20 {
        let (id, w) = letter("ok", Some(&format!("g{}", i % 3)), None, Reason::Rejected, "x");
        ids.push(id);
        s.capture(w).await;
    }
    let store = s.transport.dead_letters().unwrap();
    let held = deadletter::select(store, &s.name, &Filter::default(), &deadletter::no_progress)
        .await
        .unwrap();
    assert_eq!(held.selected.len(), 20);
    let (st, _, err) = weir(args(&["dead-letters", "list", "--config", &path]), vec![]).await;
    assert!(!st.success(), "a second reader must be refused");
    assert!(err.contains("another `weir dead-letters` command"), "{err}");
    // A capture meanwhile is not blocked.
    let (late, w) = letter("ok", Some("g9"), None, Reason::Rejected, "late");
    s.capture(w).await;
    held.close().await;
    for _ in 0..3 {
        let got: Vec<String> = s.dlq().await.iter().map(|l| id_of(&l.wire)).collect();
        let mut want = ids.clone();
        want.push(late.clone());
        assert_eq!(got, want, "every letter, in capture order");
    }
}

// ---------------------------------------------------------------- ordered redrive through a node

/// Three dead letters of group `g` (and two of others between them) are
/// redriven by the CLI into a node that now handles them: they must run in
/// their original order, once each, at attempt 1, with the redrive headers.
/// Returns the order group `g` ran in (indices of its letters).
async fn ordered_redrive(broker: Broker, negative_control: bool) -> Vec<usize> {
    let s = Setup::new(broker).await;
    let mut group_g = Vec::new();
    let mut all = Vec::new();
    for g in ["g", "h", "g", "k", "g"] {
        let (id, w) = letter("slow", Some(g), Some("acme"), Reason::NoHandler, "3");
        if g == "g" {
            group_g.push(id.clone());
        }
        all.push(id);
        s.capture(w).await;
    }
    // One data directory for the node and the command: the key that seals
    // the redrive's headers lives there, so the node believes them.
    let data = tempfile::tempdir().unwrap();
    let node_extra = format!("data_dir = {:?}", data.path().display().to_string());
    let cfg_text = s.config_text(&["slow", "ok"], &node_extra, "");
    let cfg = config::parse(&cfg_text, "<dead-letter test>").unwrap();
    let file = s.config_file(&cfg_text);
    let watch = Arc::new(Watch::default());
    let node = start_node(&cfg, s.transport.clone(), &watch).await;
    let envs = if negative_control {
        vec![(deadletter::redrive::NEGATIVE_CONTROL_REVERSED, "1".to_owned())]
    } else {
        vec![]
    };
    let (st, out, err) = weir(
        args(&["dead-letters", "redrive", "--config", file.path().to_str().unwrap()]),
        envs,
    )
    .await;
    assert!(st.success(), "{out}{err}");
    assert!(out.contains("redrove 5 of 5") && out.contains("(3 group(s))"), "{out}");
    watch.wait(&all, Outcome::Handled, 1).await;
    node.shutdown().await.unwrap();
    assert!(
        s.dlq().await.is_empty(),
        "every letter left the dead-letter destination"
    );

    let calls = watch.calls.lock().clone();
    for id in &all {
        let mine: Vec<&Seen> = calls.iter().filter(|c| &c.id == id).collect();
        assert_eq!(mine.len(), 1, "{id} ran once");
        let c = mine[0];
        assert_eq!(c.attempt, 1, "a redriven message starts its ladder again");
        let h = |n: &str| c.headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
        assert_eq!(h(header::REDRIVE_COUNT), Some("1"));
        assert_eq!(h(header::REDRIVE_REASON), Some("no-handler"));
        assert_eq!(h("weir-redrive-error"), Some("failed in the test"));
        assert_eq!(h("x-order-note"), Some("kept 3"), "the message's own headers are kept");
        assert_eq!(h(header::DEAD_LETTER_REASON), None);
        assert_eq!(h(header::ERROR), None);
    }
    // Group g never overlapped, and its order is what it ran in.
    let mut g: Vec<&Seen> = calls.iter().filter(|c| c.group.as_deref() == Some("g")).collect();
    g.sort_by_key(|c| c.start);
    for w in g.windows(2) {
        assert!(w[0].end.unwrap() <= w[1].start, "group g overlapped");
    }
    g.iter()
        .map(|c| group_g.iter().position(|id| id == &c.id).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_ordered_redrive_of_a_group_with_three_dead_letters() {
    assert_eq!(ordered_redrive(Broker::Rabbit, false).await, vec![0, 1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_ordered_redrive_of_a_group_with_three_dead_letters() {
    assert_eq!(ordered_redrive(Broker::Nats, false).await, vec![0, 1, 2]);
}

/// Red baseline: letters sent last first reach the group's lane reversed,
/// and the order check sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_a_reversed_redrive_breaks_the_group_order() {
    assert_eq!(ordered_redrive(Broker::Rabbit, true).await, vec![2, 1, 0]);
}

// ---------------------------------------------------------------- killed half-way

/// (ids on no side, ids on both sides or twice): where each of `ids` is now.
fn tally(ids: &[String], slots: &[Wire], dlq: &[DeadLetter]) -> (Vec<String>, Vec<String>) {
    let mut count: HashMap<String, usize> = ids.iter().map(|i| (i.clone(), 0)).collect();
    for w in slots.iter().chain(dlq.iter().map(|l| &l.wire)) {
        *count.entry(id_of(w)).or_default() += 1;
    }
    let lost = ids.iter().filter(|i| count[*i] == 0).cloned().collect();
    let doubled = ids.iter().filter(|i| count[*i] > 1).cloned().collect();
    (lost, doubled)
}

const KILL_AT: usize = 3;

/// What a killed redrive left: (lost, doubled) ids, what it had put on the
/// slots (taken off them), the setup, the letters' ids, the config's path.
struct Killed {
    lost: Vec<String>,
    doubled: Vec<String>,
    slots: Vec<Wire>,
    setup: Setup,
    ids: Vec<String>,
    path: String,
    _file: tempfile::NamedTempFile,
}

/// Five letters of one group; the redrive aborts after the third letter's
/// first step.
async fn killed_half_way(broker: Broker, remove_first: bool) -> Killed {
    let s = Setup::new(broker).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let (id, w) = letter("ok", Some("kill"), None, Reason::Exhausted, &i.to_string());
        ids.push(id);
        s.capture(w).await;
    }
    let file = s.config_file(&s.config_text(&["ok"], "", ""));
    let path = file.path().to_str().unwrap().to_owned();
    let mut envs = vec![(deadletter::redrive::ABORT_AFTER, KILL_AT.to_string())];
    if remove_first {
        envs.push((deadletter::redrive::NEGATIVE_CONTROL_REMOVE_FIRST, "1".to_owned()));
    }
    let (st, out, err) = weir(args(&["dead-letters", "redrive", "--config", &path]), envs).await;
    assert!(!st.success(), "the command must have died: {out}{err}");
    assert!(err.contains(deadletter::redrive::ABORT_AFTER), "{err}");
    let dlq = s.dlq().await;
    let slots = s.take_slots().await;
    let (lost, doubled) = tally(&ids, &slots, &dlq);
    if !remove_first {
        // The slot has the first three, in order; the rest wait in order.
        assert_eq!(slots.iter().map(id_of).collect::<Vec<_>>(), ids[..KILL_AT].to_vec());
        assert_eq!(
            dlq.iter().map(|l| id_of(&l.wire)).collect::<Vec<_>>(),
            ids[KILL_AT - 1..].to_vec()
        );
        assert!(slots.iter().all(|w| w.header(header::REDRIVE_COUNT) == Some("1")));
    }
    Killed {
        lost,
        doubled,
        slots,
        setup: s,
        ids,
        path,
        _file: file,
    }
}

async fn kill_test(broker: Broker) {
    let Killed {
        lost,
        doubled,
        slots: first,
        setup: s,
        ids,
        path,
        _file,
    } = killed_half_way(broker, false).await;
    assert!(lost.is_empty(), "nothing lost: {lost:?}");
    assert_eq!(
        doubled,
        vec![ids[KILL_AT - 1].clone()],
        "only the letter in flight is in both places"
    );
    // Running it again finishes the job: the one in flight goes twice
    // (at-least-once), the group's order holds.
    let (st, out, err) = weir(args(&["dead-letters", "redrive", "--config", &path]), vec![]).await;
    assert!(st.success(), "{out}{err}");
    assert!(out.contains("redrove 3 of 3"), "{out}");
    assert!(s.dlq().await.is_empty());
    let mut slots: Vec<String> = first.iter().map(id_of).collect();
    slots.extend(s.take_slots().await.iter().map(id_of));
    let order: Vec<usize> = slots
        .iter()
        .map(|id| ids.iter().position(|i| i == id).unwrap())
        .collect();
    assert_eq!(order, vec![0, 1, 2, 2, 3, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_redrive_killed_half_way_loses_nothing() {
    kill_test(Broker::Rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_redrive_killed_half_way_loses_nothing() {
    kill_test(Broker::Nats).await;
}

/// Red baseline: removing a letter before its re-publish is confirmed, and
/// dying in between, loses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_removal_before_the_confirm_loses_the_letter_in_flight() {
    for broker in [Broker::Rabbit, Broker::Nats] {
        let k = killed_half_way(broker, true).await;
        assert_eq!(
            k.lost,
            vec![k.ids[KILL_AT - 1].clone()],
            "{broker:?}: the letter in flight is lost"
        );
        assert!(k.doubled.is_empty());
    }
}

// ---------------------------------------------------------------- version pinning

/// A node on RabbitMQ with a data directory serves v2 of the faulty
/// handler; a letter it captured is redriven pinned to v1 and runs on v1.
/// A pin no node can honour is refused by the admin API and the CLI, and a
/// message whose pin cannot be resolved when it runs is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redrive_pins_a_kept_version_and_refuses_one_it_cannot_honour() {
    let s = Setup::new(Broker::Rabbit).await;
    let data = tempfile::tempdir().unwrap();
    let port = free_port();
    let text = s.config_text(
        &["ok", "reject"],
        &format!(
            "admin = \"127.0.0.1:{port}\"\nadmin_token = \"{OPERATOR}\"\ndata_dir = {:?}",
            data.path().display().to_string()
        ),
        "",
    );
    let cfg = config::parse(&text, "<pin test>").unwrap();
    let file = s.config_file(&text);
    let path = file.path().to_str().unwrap().to_owned();
    let watch = Arc::new(Watch::default());
    let node = start_node(&cfg, s.transport.clone(), &watch).await;
    wait_up(port);
    let http = |method: &'static str, path: String, token: Option<&'static str>, body: Vec<u8>| {
        tokio::task::spawn_blocking(move || call(method, port, &path, token, &body))
    };
    let faulty = common::faulty_bytes();
    let v1 = digest(&faulty);
    let v2_bytes = variant(&faulty, "v2");
    let v2 = digest(&v2_bytes);
    let (code, body) = http("PUT", "/v1/handlers/faulty".into(), Some(OPERATOR), v2_bytes)
        .await
        .unwrap();
    assert_eq!(code, 200, "{body}");

    let m = envelope::new_message(envelope::fresh_id(), "reject", Some("gp".into()), None, vec![], vec![]);
    node.publish(&s.name, &m).await.unwrap();
    watch
        .wait(std::slice::from_ref(&m.id), Outcome::DeadLettered(Reason::Rejected), 1)
        .await;
    let (code, body) = http("GET", "/v1/dead-letters".into(), Some(OPERATOR), vec![])
        .await
        .unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["letters"][0]["handler_version"], v2.as_str());

    // Refused: a digest that was never a version of the handler.
    let never = "ab".repeat(32);
    let (code, body) = http(
        "POST",
        format!("/v1/dead-letters/redrive?handler_version={never}"),
        Some(OPERATOR),
        vec![],
    )
    .await
    .unwrap();
    assert_eq!(code, 409, "{body}");
    assert!(body["error"].as_str().unwrap().contains("never deployed"), "{body}");
    let (st, _, err) = weir(
        args(&[
            "dead-letters",
            "redrive",
            "--config",
            &path,
            "--handler-version",
            &never,
        ]),
        vec![],
    )
    .await;
    assert!(
        !st.success() && err.contains("refused, nothing was moved") && err.contains(&never),
        "{err}"
    );
    // The CLI finds v2 in the data directory (dry run: the node does the real one).
    let (st, out, err) = weir(
        args(&[
            "dead-letters",
            "redrive",
            "--config",
            &path,
            "--handler-version",
            &v2,
            "--dry-run",
        ]),
        vec![],
    )
    .await;
    assert!(
        st.success() && out.contains(&format!("pinned to version {v2}")),
        "{out}{err}"
    );
    assert_eq!(s.dlq().await.len(), 1, "nothing moved");

    // Pinned to v1: it runs on v1 (v2 is current) and is captured again.
    let (code, body) = http(
        "POST",
        format!("/v1/dead-letters/redrive?handler_version={v1}"),
        Some(OPERATOR),
        vec![],
    )
    .await
    .unwrap();
    assert_eq!((code, body["moved"].as_u64()), (200, Some(1)), "{body}");
    watch
        .wait(std::slice::from_ref(&m.id), Outcome::DeadLettered(Reason::Rejected), 2)
        .await;
    let runs: Vec<String> = watch
        .calls
        .lock()
        .iter()
        .filter(|c| c.id == m.id)
        .map(|c| c.digest.clone())
        .collect();
    assert_eq!(
        runs,
        vec![v2.clone(), v1.clone()],
        "first on the current version, then on the pinned one"
    );
    let (_, body) = http("GET", "/v1/dead-letters?full=true".into(), Some(OPERATOR), vec![])
        .await
        .unwrap();
    let l = &body["letters"][0];
    assert_eq!(body["matched"], 1);
    assert_eq!(l["handler_version"], v1.as_str());
    assert_eq!(l["redrive_count"], 1);
    let h = |n: &str| {
        l["headers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p[0] == n)
            .map(|p| p[1].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    assert_eq!(h(header::HANDLER_PIN), vec![v1.clone()]);
    assert_eq!(h(header::REDRIVE_REASON), vec!["rejected".to_owned()]);
    assert_eq!(h("weir-redrive-handler-version"), vec![v2.clone()]);
    assert_eq!(
        h(header::DEAD_LETTER_REASON),
        vec!["rejected".to_owned()],
        "one reason: this capture's"
    );

    // A pin that becomes unresolvable is dead-lettered `no-handler`, saying why;
    // one that resolves runs on its version.
    let pinned = |ty: &str, d: &str| {
        envelope::new_message(
            envelope::fresh_id(),
            ty,
            Some("gp2".into()),
            None,
            vec![(header::HANDLER_PIN.into(), d.to_owned())],
            vec![],
        )
    };
    // Pins are honoured only when sealed with the cluster's key (here the
    // node's data directory), as a redrive seals them.
    let seal = weir::seal::key::load(&cfg, None).await.unwrap();
    let mut lost_pin = pinned("ok", &never);
    let mut good_pin = pinned("ok", &v1);
    seal.sign(&mut lost_pin, true);
    seal.sign(&mut good_pin, true);
    node.publish(&s.name, &lost_pin).await.unwrap();
    node.publish(&s.name, &good_pin).await.unwrap();
    watch
        .wait(
            std::slice::from_ref(&lost_pin.id),
            Outcome::DeadLettered(Reason::NoHandler),
            1,
        )
        .await;
    watch
        .wait(std::slice::from_ref(&good_pin.id), Outcome::Handled, 1)
        .await;
    assert_eq!(watch.digests.lock()[&good_pin.id], v1);
    let (_, body) = http(
        "GET",
        format!("/v1/dead-letters?id={}", lost_pin.id),
        Some(OPERATOR),
        vec![],
    )
    .await
    .unwrap();
    let e = body["letters"][0]["error"].as_str().unwrap();
    assert!(
        e.contains("pinned to version") && e.contains(&never) && e.contains("never deployed"),
        "{e}"
    );
    node.shutdown().await.unwrap();
}

// ---------------------------------------------------------------- admin API, tenant scoping

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_is_tenant_scoped_on_nats() {
    let s = Setup::new(Broker::Nats).await;
    let port = free_port();
    let text = s.config_text(
        &["ok"],
        &format!("admin = \"127.0.0.1:{port}\"\nadmin_token = \"{OPERATOR}\""),
        &format!(
            "[[tenant]]\nname = \"acme\"\ntoken = \"{ACME}\"\n[[tenant]]\nname = \"globex\"\ntoken = \"{GLOBEX}\"\n"
        ),
    );
    let cfg = config::parse(&text, "<tenant test>").unwrap();
    let mut by_tenant: HashMap<&str, Vec<String>> = HashMap::new();
    for t in ["acme", "globex", "acme", "", "globex"] {
        let (id, w) = letter(
            "ok",
            Some("g"),
            Some(t).filter(|t| !t.is_empty()),
            Reason::Rejected,
            "x",
        );
        by_tenant.entry(t).or_default().push(id);
        s.capture(w).await;
    }
    let watch = Arc::new(Watch::default());
    let node = start_node(&cfg, s.transport.clone(), &watch).await;
    wait_up(port);
    let http = |method: &'static str, path: &str, token: Option<&'static str>| {
        let path = path.to_owned();
        tokio::task::spawn_blocking(move || call(method, port, &path, token, b""))
    };
    let ids = |body: &serde_json::Value| -> HashSet<String> {
        body["letters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["message_id"].as_str().unwrap().to_owned())
            .collect()
    };
    let set = |t: &str| by_tenant[t].iter().cloned().collect::<HashSet<_>>();

    let (code, _) = http("GET", "/v1/dead-letters", None).await.unwrap();
    assert_eq!(code, 401);
    let (code, body) = http("GET", "/v1/dead-letters", Some(OPERATOR)).await.unwrap();
    assert_eq!((code, body["matched"].as_u64()), (200, Some(5)), "{body}");
    let (code, body) = http("GET", "/v1/dead-letters", Some(ACME)).await.unwrap();
    assert_eq!(code, 200);
    assert_eq!(ids(&body), set("acme"), "a tenant sees only its own");
    let (code, body) = http("GET", "/v1/dead-letters?tenant=globex", Some(ACME)).await.unwrap();
    assert_eq!(code, 403, "{body}");
    let (code, body) = http("GET", "/v1/dead-letters?bogus=1", Some(ACME)).await.unwrap();
    assert!(
        code == 400 && body["error"].as_str().unwrap().contains("bogus"),
        "{body}"
    );

    let (code, body) = http("POST", "/v1/dead-letters/redrive?dry_run=true", Some(ACME))
        .await
        .unwrap();
    assert_eq!(
        (code, body["letters"].as_array().unwrap().len(), body["moved"].as_u64()),
        (200, 2, Some(0))
    );
    let (code, body) = http("POST", "/v1/dead-letters/redrive", Some(ACME)).await.unwrap();
    assert_eq!((code, body["moved"].as_u64()), (200, Some(2)), "{body}");
    watch.wait(&by_tenant["acme"], Outcome::Handled, 1).await;
    let (_, body) = http("GET", "/v1/dead-letters", Some(OPERATOR)).await.unwrap();
    assert_eq!(
        ids(&body),
        set("globex").union(&set("")).cloned().collect(),
        "the others stay"
    );

    let (code, body) = http("POST", "/v1/dead-letters/purge", Some(GLOBEX)).await.unwrap();
    assert_eq!((code, body["purged"].as_u64()), (200, Some(2)), "{body}");
    let (_, body) = http("GET", "/v1/dead-letters", Some(OPERATOR)).await.unwrap();
    assert_eq!(ids(&body), set(""), "only the letter of no tenant is left");
    let (code, body) = http("GET", "/v1/dead-letters", Some(GLOBEX)).await.unwrap();
    assert_eq!((code, body["matched"].as_u64()), (200, Some(0)));
    node.shutdown().await.unwrap();
}

/// `weir dev` runs on the memory broker: its admin API has the same tools.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_works_on_a_memory_node() {
    let port = free_port();
    let text = format!(
        r#"
[node]
name = "dlq-memory"
admin = "127.0.0.1:{port}"
admin_token = "{OPERATOR}"
[[topology]]
name = "mem"
slots = 2
[[handler]]
name = "faulty"
component = "{faulty}"
topology = "mem"
message_types = ["reject", "ok"]
"#,
        faulty = bundled::FAULTY_PATH
    );
    let cfg = config::parse(&text, "<memory test>").unwrap();
    let mem = Arc::new(MemoryBroker::new());
    let watch = Arc::new(Watch::default());
    let node = start_node(&cfg, mem.clone(), &watch).await;
    wait_up(port);
    let m = envelope::new_message(envelope::fresh_id(), "reject", Some("g".into()), None, vec![], vec![]);
    node.publish("mem", &m).await.unwrap();
    watch
        .wait(std::slice::from_ref(&m.id), Outcome::DeadLettered(Reason::Rejected), 1)
        .await;
    let http = |method: &'static str, path: &str| {
        let path = path.to_owned();
        tokio::task::spawn_blocking(move || call(method, port, &path, Some(OPERATOR), b""))
    };
    let (code, body) = http("GET", "/v1/dead-letters").await.unwrap();
    assert_eq!((code, body["matched"].as_u64()), (200, Some(1)), "{body}");
    let (code, body) = http("POST", "/v1/dead-letters/redrive").await.unwrap();
    assert_eq!((code, body["moved"].as_u64()), (200, Some(1)), "{body}");
    watch
        .wait(std::slice::from_ref(&m.id), Outcome::DeadLettered(Reason::Rejected), 2)
        .await;
    let letters = mem.dead_letters("mem");
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].header(header::REDRIVE_COUNT), Some("1"));
    let (code, body) = http("POST", "/v1/dead-letters/purge").await.unwrap();
    assert_eq!((code, body["purged"].as_u64()), (200, Some(1)), "{body}");
    assert!(mem.dead_letters("mem").is_empty());
    node.shutdown().await.unwrap();
}
