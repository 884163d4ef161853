//! Issue 32 item 4: a publisher cannot wedge a slot with parked groups
//! (`on_failure = "park"`), on RabbitMQ and on NATS JetStream.
//!
//! The attack, as a publisher would run it on one slot with the default
//! window (`transport.prefetch = 256`) and hold (`topology.park_hold = 64`):
//! eight groups whose heads fail on every attempt, then 80 more messages of
//! each of those groups (640, interleaved), then 200 messages of another
//! handler in twenty other groups. Before the fix the parked groups' held
//! messages filled the whole window: on RabbitMQ the failed heads come back
//! through the slot's queue, behind that window, so nothing was ever
//! delivered again (the slot stopped for good); on JetStream the heads come
//! back (the server redelivers them whatever the window), and the other
//! groups waited for that, a whole rung.
//!
//! With the fix, the parked groups of a slot hold at most
//! `topology.park_hold_slot` messages together (default prefetch / 2, their
//! heads counted on JetStream), and the rest are dead-lettered
//! `park-overflow` with a reason naming that bound. The test asserts the
//! other handler's 200 messages are all handled before any failed head is
//! back from its rung (they never wait for a parked group), that the slot
//! never held more than its bound, and that every message ends (held ones
//! in order after their head, the rest dead-lettered).
//!
//! The red baseline, kept here: the same attack with the slot bound set to
//! the window (`NodeOptions::park_hold_slot_unchecked`, which the config
//! refuses). Its waits are states, not sleeps: the runner holds the whole
//! window in parked lanes and runs nothing, while the broker still has the
//! other messages undelivered. On RabbitMQ the wait goes on until every
//! failed head is back in the slot's queue, undelivered: a fixed point (no
//! ack can come from the runner, so the broker delivers nothing more), and
//! not one of the 200 was handled. On JetStream none of the 200 is handled
//! before a failed head is back from its rung.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use weir::config::{self, Config, OnFailure, RetrySection, TransportKind};
use weir::deadletter::{self, Filter};
use weir::envelope::{self, Envelope, header};
use weir::node::{Node, NodeOptions, bundled};
use weir::outcome::{Outcome, Reason, SettleObserver};
use weir::transport::Transport;
use weir::transport::nats::Nats;
use weir::transport::rabbitmq::RabbitMq;

/// The ladder's one rung: how long a failed head is away.
const RUNG: Duration = Duration::from_secs(15);
const PREFETCH: u32 = 256;
/// The default slot bound at that window (prefetch / 2).
const SLOT_BOUND: usize = 128;
/// The default hold of one group.
const GROUP_HOLD: usize = 64;
const HEADS: usize = 8;
const FOLLOWERS: usize = 80;
const OTHERS: usize = 200;
/// How long anything may take that does not wait for a rung.
const PATIENCE: Duration = Duration::from_secs(60);

/// A broker to run on; `_guard` deletes its objects on drop.
struct On {
    transport: Arc<dyn Transport>,
    /// A client of its own, as `weir dead-letters list` would be.
    reader: Arc<dyn Transport>,
    kind: TransportKind,
    url: String,
    topology: String,
    /// Deliveries in total: two handler deliveries per head (one rung) on
    /// each broker (JetStream keeps the last one for a capture retry).
    max_deliver: i64,
    _guard: Box<dyn std::any::Any>,
}

fn rabbit() -> On {
    let topo = common::rabbit::Topo::new(1, &[RUNG]);
    On {
        transport: Arc::new(RabbitMq::new(
            common::rabbit::url(),
            format!("weir wedge-{}", topo.name),
        )),
        reader: Arc::new(RabbitMq::new(
            common::rabbit::url(),
            format!("weir wedge-reader-{}", topo.name),
        )),
        kind: TransportKind::Rabbitmq,
        url: common::rabbit::url(),
        topology: topo.name.clone(),
        max_deliver: 2,
        _guard: Box::new(topo),
    }
}

fn nats() -> On {
    let topo = common::nats::Topo::new();
    On {
        transport: Arc::new(Nats::new(topo.url.clone(), format!("weir wedge-{}", topo.name))),
        reader: Arc::new(Nats::new(topo.url.clone(), format!("weir wedge-reader-{}", topo.name))),
        kind: TransportKind::Nats,
        url: topo.url.clone(),
        topology: topo.name.clone(),
        max_deliver: 3,
        _guard: Box::new(topo),
    }
}

/// One slot; `parker` parks its groups (`flaky`), `other` handles `ok`;
/// the window, hold and slot bound are the defaults.
fn config(on: &On) -> Config {
    let mut t = config::Topology::new(&on.topology, 1);
    t.retry = Some(RetrySection {
        ladder: Some(vec![RUNG]),
        max_deliver: Some(on.max_deliver),
        ..Default::default()
    });
    let mut parker = config::Handler::new("parker", bundled::FAULTY_PATH, &on.topology, vec!["flaky".into()]);
    parker.on_failure = OnFailure::Park;
    let other = config::Handler::new("other", bundled::FAULTY_PATH, &on.topology, vec!["ok".into()]);
    Config {
        node: config::Node {
            name: format!("node-{}", on.topology),
            admin: None,
            ..config::Node::default()
        },
        transport: config::Transport {
            kind: on.kind,
            url: Some(on.url.clone().into()),
            prefetch: PREFETCH,
            ..Default::default()
        },
        cluster: config::Cluster::default(),
        topology: vec![t],
        handler: vec![parker, other],
        tenant: Vec::new(),
        telemetry: Default::default(),
        origin: "<park wedge test>".into(),
    }
}

/// Every settlement, in the order they happened.
#[derive(Default)]
struct Settled(Mutex<Vec<(String, Outcome)>>);

impl SettleObserver for Settled {
    fn settled(&self, id: &str, outcome: Outcome) {
        self.0.lock().push((id.to_owned(), outcome));
    }
}

fn ended(o: Outcome) -> bool {
    matches!(o, Outcome::Handled | Outcome::DeadLettered(_))
}

fn message(message_type: &str, group: &str, payload: &str) -> Envelope {
    envelope::new_message(
        envelope::fresh_id(),
        message_type,
        Some(group.to_owned()),
        None,
        vec![],
        payload.as_bytes().to_vec(),
    )
}

/// The attack's messages, by role.
struct Attack {
    heads: Vec<String>,
    /// Each parked group's later messages, in publish order.
    followers: Vec<Vec<String>>,
    others: Vec<String>,
}

impl Attack {
    fn all(&self) -> impl Iterator<Item = &String> {
        self.heads
            .iter()
            .chain(self.followers.iter().flatten())
            .chain(&self.others)
    }
}

struct Run {
    on: On,
    node: Node,
    settled: Arc<Settled>,
    attack: Attack,
    /// When the attack began, and when its last message was published.
    started_at: Instant,
    published_at: Instant,
}

/// Start a node (`unchecked`: the negative control's slot bound) and run
/// the attack against its slot.
async fn attack(on: On, unchecked: Option<usize>) -> Run {
    let settled = Arc::new(Settled::default());
    let opts = NodeOptions {
        workers: 2,
        settle_observer: Some(settled.clone()),
        park_hold_slot_unchecked: unchecked,
        ..NodeOptions::default()
    };
    let node = Node::start(&config(&on), on.transport.clone(), opts).await.unwrap();
    let t = on.transport.as_ref();
    let started_at = Instant::now();
    let groups: Vec<String> = (0..HEADS).map(|g| format!("parked-{g}")).collect();
    let mut heads = Vec::new();
    for g in &groups {
        // Fails with `retry` on its first 1000 attempts: every one here.
        let m = message("flaky", g, "1000");
        heads.push(m.id.clone());
        common::publish_confirmed(t, &on.topology, 0, &m).await;
    }
    let mut followers = vec![Vec::new(); HEADS];
    for _ in 0..FOLLOWERS {
        for (g, group) in groups.iter().enumerate() {
            let m = message("flaky", group, "0");
            followers[g].push(m.id.clone());
            common::publish_confirmed(t, &on.topology, 0, &m).await;
        }
    }
    let mut others = Vec::new();
    for i in 0..OTHERS {
        let m = message("ok", &format!("other-{}", i % 20), "");
        others.push(m.id.clone());
        common::publish_confirmed(t, &on.topology, 0, &m).await;
    }
    Run {
        on,
        node,
        settled,
        attack: Attack {
            heads,
            followers,
            others,
        },
        started_at,
        published_at: Instant::now(),
    }
}

impl Run {
    /// The slot's counters: (messages waiting in lanes, lanes running,
    /// parked groups, held by parked groups).
    fn slot(&self) -> (u64, u64, u64, u64) {
        let slots = self.node.stats().slots();
        let Some((_, c)) = slots.iter().find(|((t, s), _)| **t == *self.on.topology && *s == 0) else {
            return (0, 0, 0, 0);
        };
        let (queued, running) = c.depth();
        (queued, running, c.parked(), c.held())
    }

    fn count(&self, ids: &[String], want: impl Fn(Outcome) -> bool) -> usize {
        let log = self.settled.0.lock();
        ids.iter()
            .filter(|id| log.iter().any(|(x, o)| x == *id && want(*o)))
            .count()
    }

    /// The log position where a failed head first came back from its rung
    /// (its second settlement), if one has.
    fn first_head_back(&self) -> Option<usize> {
        let log = self.settled.0.lock();
        let mut seen: HashMap<&str, usize> = HashMap::new();
        log.iter().position(|(id, _)| {
            if !self.attack.heads.contains(id) {
                return false;
            }
            let n = seen.entry(id.as_str()).or_default();
            *n += 1;
            *n == 2
        })
    }

    /// Poll every 20 ms until `cond`, failing after `limit` with `what` and the state.
    async fn wait(&self, what: &str, limit: Duration, mut cond: impl FnMut(&Self) -> bool) {
        let start = Instant::now();
        while !cond(self) {
            assert!(
                start.elapsed() < limit,
                "waited {limit:?} for {what}; slot (queued, running, parked, held) {:?}; others handled {}; \
                 settled {}",
                self.slot(),
                self.count(&self.attack.others, |o| o == Outcome::Handled),
                self.settled.0.lock().len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Messages of the slot the broker has not delivered yet.
    async fn backlog(&self) -> u64 {
        self.on
            .transport
            .backlog(&self.on.topology, 0)
            .await
            .unwrap()
            .expect("the broker reports a slot's backlog")
    }
}

/// With the fix: the other handler's messages never wait for the parked
/// groups, the slot never holds more than its bound, and everything ends.
async fn the_slot_keeps_running(on: On) {
    let r = attack(on, None).await;
    let mut most_held = 0;
    let others = r.attack.others.clone();
    r.wait("the other handler's 200 messages to be handled", PATIENCE, |r| {
        most_held = most_held.max(r.slot().3);
        r.count(&others, |o| o == Outcome::Handled) == OTHERS
    })
    .await;
    let others_done = (r.started_at.elapsed(), r.published_at.elapsed());
    let last_other = {
        let log = r.settled.0.lock();
        others
            .iter()
            .map(|id| log.iter().position(|(x, o)| x == id && *o == Outcome::Handled).unwrap())
            .max()
            .unwrap()
    };
    assert!(
        r.first_head_back().is_none_or(|back| last_other < back),
        "the other handler's messages waited for a failed head to come back from the ladder"
    );
    // Then every message ends: the heads exhaust their one rung.
    let all: Vec<String> = r.attack.all().cloned().collect();
    r.wait("every message to end", RUNG * 3 + PATIENCE, |r| {
        most_held = most_held.max(r.slot().3);
        r.count(&all, ended) == all.len()
    })
    .await;
    assert!(
        most_held <= SLOT_BOUND as u64,
        "the slot held {most_held} messages of parked groups, over its bound {SLOT_BOUND}"
    );
    let exhausted = r.count(&r.attack.heads, |o| o == Outcome::DeadLettered(Reason::Exhausted));
    assert_eq!(exhausted, HEADS, "every failed head is dead-lettered `exhausted`");
    let overflow = Outcome::DeadLettered(Reason::ParkOverflow);
    let mut held = 0;
    {
        let log = r.settled.0.lock();
        let at = |id: &String, want: Outcome| log.iter().position(|(x, o)| x == id && *o == want);
        for (head, followers) in r.attack.heads.iter().zip(&r.attack.followers) {
            let head_end = at(head, Outcome::DeadLettered(Reason::Exhausted)).unwrap();
            let handled: Vec<usize> = followers.iter().filter_map(|id| at(id, Outcome::Handled)).collect();
            assert!(handled.len() <= GROUP_HOLD, "a group held {} messages", handled.len());
            assert!(
                handled.iter().all(|p| *p > head_end) && handled.windows(2).all(|w| w[0] < w[1]),
                "a parked group's held messages run after its head ends, in order"
            );
            held += handled.len();
        }
    }
    let dropped = r.count(&r.attack.followers.concat(), |o| o == overflow);
    assert!(held <= SLOT_BOUND, "the parked groups held {held} messages together");
    assert_eq!(
        held + dropped,
        HEADS * FOLLOWERS,
        "each follower is held or dead-lettered"
    );
    r.node.shutdown().await.unwrap();
    // The dead letters say which bound they ran into.
    let store = r.on.reader.dead_letters().unwrap();
    let sel = deadletter::select(store, &r.on.topology, &Filter::default(), &deadletter::no_progress)
        .await
        .unwrap();
    let reasons: Vec<String> = sel
        .selected
        .iter()
        .filter(|l| l.wire.header(header::DEAD_LETTER_REASON) == Some("park-overflow"))
        .filter_map(|l| l.wire.header(header::ERROR).map(str::to_owned))
        .collect();
    sel.close().await;
    assert_eq!(
        reasons.len(),
        dropped,
        "every park-overflow is on the dead-letter destination"
    );
    assert!(
        reasons.iter().any(|e| e.contains("topology.park_hold_slot")),
        "a dead letter names the slot bound: {:?}",
        reasons.first()
    );
    eprintln!(
        "{}: the other handler's {OTHERS} messages were all handled {:?} after the attack began ({:?} after \
         its last message was published); \
         at most {most_held} held; {held} held messages ran after their heads, {dropped} dead-lettered park-overflow",
        r.on.kind.as_str(),
        others_done.0,
        others_done.1
    );
}

/// The red baseline: the slot bound at the window. The runner holds the
/// whole window in parked lanes and runs nothing, while the broker has the
/// other messages undelivered.
async fn wedged_without_the_slot_bound(on: On) -> Run {
    let r = attack(on, Some(PREFETCH as usize)).await;
    r.wait("the parked groups to hold the whole window", PATIENCE, |r| {
        let (_, running, parked, held) = r.slot();
        held == u64::from(PREFETCH) && running == 0 && parked == HEADS as u64
    })
    .await;
    assert!(r.backlog().await > 0, "the broker still has undelivered messages");
    r
}

async fn rabbitmq_red_baseline() {
    let r = wedged_without_the_slot_bound(rabbit()).await;
    // Wait for every failed head to be back in the slot's queue, behind
    // the window: every message that has not ended is then held by the
    // runner or waits, undelivered, in the slot's queue.
    let all: Vec<String> = r.attack.all().cloned().collect();
    let total = all.len() as u64;
    let start = Instant::now();
    loop {
        let ended = r.count(&all, ended) as u64;
        let backlog = r.backlog().await;
        let (_, running, _, held) = r.slot();
        if running == 0 && backlog + held + ended == total {
            break;
        }
        assert!(
            start.elapsed() < RUNG + PATIENCE,
            "the heads never got back to the slot's queue: backlog {backlog}, held {held}, ended {ended} of {total}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A fixed point: the runner can run nothing (every lane it holds is
    // parked behind a head that is in the broker's queue), and the broker
    // delivers nothing while the whole window is unacknowledged.
    let (_, running, parked, held) = r.slot();
    assert_eq!((running, parked, held), (0, HEADS as u64, u64::from(PREFETCH)));
    let handled = r.count(&r.attack.others, |o| o == Outcome::Handled);
    assert_eq!(
        handled, 0,
        "the wedged slot handled {handled} of the other handler's messages"
    );
    assert!(r.first_head_back().is_none(), "no failed head ran again");
    eprintln!(
        "rabbitmq without the slot bound: wedged {:?} after the attack was published: window full of held \
         messages, every head back in the slot's queue and undelivered, 0 of {OTHERS} others handled",
        r.published_at.elapsed()
    );
    r.node.shutdown().await.unwrap();
}

async fn nats_red_baseline() {
    let r = wedged_without_the_slot_bound(nats()).await;
    // JetStream brings the heads back whatever the window: the others run
    // only after that, one rung late.
    let others = r.attack.others.clone();
    r.wait("the other handler's messages, one rung late", RUNG + PATIENCE, |r| {
        r.count(&others, |o| o == Outcome::Handled) > 0
    })
    .await;
    let first_other = {
        let log = r.settled.0.lock();
        others
            .iter()
            .filter_map(|id| log.iter().position(|(x, o)| x == id && *o == Outcome::Handled))
            .min()
            .unwrap()
    };
    let back = r
        .first_head_back()
        .expect("a head came back before any other message ran");
    assert!(
        back < first_other,
        "without the slot bound the other messages should wait for a failed head to come back"
    );
    eprintln!(
        "nats without the slot bound: the first of the other handler's messages ran {:?} after the attack \
         was published, after a failed head came back from its rung",
        r.published_at.elapsed()
    );
    r.node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_groups_cannot_wedge_a_rabbitmq_slot() {
    the_slot_keeps_running(rabbit()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_groups_cannot_hold_up_a_nats_slot() {
    the_slot_keeps_running(nats()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn red_baseline_parked_groups_wedge_a_rabbitmq_slot_without_the_slot_bound() {
    rabbitmq_red_baseline().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn red_baseline_parked_groups_hold_up_a_nats_slot_without_the_slot_bound() {
    nats_red_baseline().await;
}
