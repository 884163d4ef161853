//! `weir demo`: the embedded default. An in-memory broker, the bundled
//! orders handler (and a no-op handler for the `order.accepted` messages it
//! cascades), a generated stream of grouped orders with a few malformed,
//! transient and unroutable ones; live progress; then a summary whose every
//! number is computed from the ledger, the counters and the broker.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use indicatif::{ProgressBar, ProgressStyle};

use weir::config::{self, Config, RetrySection};
use weir::envelope::{self, header};
use weir::node::{Node, NodeOptions};
use weir::observe::ledger::{Ledger, SEQ_HEADER};
use weir::observe::stats::Stats;
use weir::outcome::{Outcome, Reason};
use weir::transport::Transport;
use weir::transport::memory::MemoryBroker;

/// Shape of the generated stream.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Groups (customers).
    pub groups: u32,
    /// Messages per group.
    pub per_group: u32,
    /// Slots of the `orders` topology.
    pub slots: u32,
    /// Every n-th message is malformed JSON (0 = none).
    pub malformed_every: u32,
    /// Every n-th message fails transiently twice before it succeeds (0 = none).
    pub transient_every: u32,
    /// Every n-th message has a type no handler is bound to (0 = none).
    pub unroutable_every: u32,
    /// Give up waiting after this long.
    pub deadline: Duration,
    /// Show a progress bar.
    pub progress: bool,
}

impl Default for DemoOptions {
    fn default() -> Self {
        Self {
            groups: 200,
            per_group: 50,
            slots: 6,
            malformed_every: 997,
            transient_every: 331,
            unroutable_every: 2503,
            deadline: Duration::from_secs(120),
            progress: true,
        }
    }
}

/// What the demo measured.
#[derive(Debug, Clone)]
pub struct DemoSummary {
    /// Messages published by the generator.
    pub published: u64,
    /// Cascaded `order.accepted` messages published by the handler.
    pub cascaded: u64,
    /// Messages handled successfully.
    pub handled: u64,
    /// Retries scheduled.
    pub retried: u64,
    /// Dead letters by reason (non-zero reasons only).
    pub dead_lettered: Vec<(Reason, u64)>,
    /// Dead letters expected from the generator (malformed + unroutable).
    pub expected_dead_letters: u64,
    /// Distinct groups that ran.
    pub groups: usize,
    /// Intra-group concurrent executions seen by the ledger (must be 0).
    pub overlaps: u64,
    /// Calls that started before an earlier message of their group (retries reorder).
    pub out_of_order: u64,
    /// Most groups running at once.
    pub peak_parallel_groups: usize,
    /// Message ids with no final outcome (must be 0).
    pub lost: u64,
    /// Messages still on the broker at the end.
    pub left_on_broker: usize,
    /// Stranded or uncertain captures.
    pub stranded: u64,
    /// Uncertain captures.
    pub uncertain: u64,
    /// Wall time from the first message to the last settlement.
    pub elapsed: Duration,
}

impl DemoSummary {
    /// Messages settled per second (originals and cascades).
    pub fn throughput(&self) -> f64 {
        (self.published + self.cascaded) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Nothing lost, nothing left, no overlap, dead letters as expected.
    pub fn ok(&self) -> bool {
        self.lost == 0
            && self.left_on_broker == 0
            && self.overlaps == 0
            && self.stranded == 0
            && self.dead_lettered.iter().map(|(_, n)| n).sum::<u64>() == self.expected_dead_letters
    }
}

impl std::fmt::Display for DemoSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dl: u64 = self.dead_lettered.iter().map(|(_, n)| n).sum();
        let reasons: Vec<String> = self.dead_lettered.iter().map(|(r, n)| format!("{r} {n}")).collect();
        writeln!(f, "Weir demo summary")?;
        writeln!(
            f,
            "  published              {:>8}   (+{} cascaded order.accepted)",
            self.published, self.cascaded
        )?;
        writeln!(f, "  handled                {:>8}", self.handled)?;
        writeln!(
            f,
            "  retried                {:>8}   (retries scheduled on the ladder)",
            self.retried
        )?;
        writeln!(
            f,
            "  dead-lettered          {:>8}   ({}; expected {})",
            dl,
            reasons.join(", "),
            self.expected_dead_letters
        )?;
        writeln!(
            f,
            "  groups                 {:>8}   (peak {} running at once)",
            self.groups, self.peak_parallel_groups
        )?;
        writeln!(f, "  intra-group overlaps   {:>8}   (must be 0)", self.overlaps)?;
        writeln!(
            f,
            "  out-of-order starts    {:>8}   (retries may reorder a group: best effort)",
            self.out_of_order
        )?;
        writeln!(
            f,
            "  lost                   {:>8}   (ids with no final outcome; must be 0)",
            self.lost
        )?;
        writeln!(f, "  left on broker         {:>8}", self.left_on_broker)?;
        writeln!(f, "  stranded / uncertain   {:>8} / {}", self.stranded, self.uncertain)?;
        writeln!(f, "  elapsed                {:>8.2} s", self.elapsed.as_secs_f64())?;
        write!(f, "  throughput             {:>8.0} messages/s", self.throughput())
    }
}

fn demo_config(o: &DemoOptions) -> Config {
    let mut topology = config::Topology::new("orders", o.slots);
    topology.retry = Some(RetrySection {
        ladder: Some(vec![
            Duration::from_millis(50),
            Duration::from_millis(100),
            Duration::from_millis(200),
        ]),
        max_deliver: Some(5),
        max_time_to_dead_letter: None,
    });
    let mut orders = config::Handler::new(
        "orders",
        "bundled:orders",
        "orders",
        vec!["order.placed".into(), "order.paid".into()],
    );
    orders.tenant = Some("acme".into());
    orders.config.insert("currency".into(), "EUR".into());
    let notify = config::Handler::new("notify", "bundled:noop", "orders", vec!["order.accepted".into()]);
    Config {
        node: config::Node {
            name: "demo".into(),
            admin: None,
            ..config::Node::default()
        },
        transport: config::Transport::default(),
        cluster: config::Cluster::default(),
        topology: vec![topology],
        handler: vec![orders, notify],
        tenant: Vec::new(),
        telemetry: Default::default(),
        origin: "<demo>".into(),
    }
}

/// The payload and type of message `seq` of group `g`.
/// The third value says whether it must end up dead-lettered.
fn generate(o: &DemoOptions, g: u32, seq: u32, n: u64) -> (&'static str, Vec<u8>, bool) {
    let every = |k: u32| k != 0 && n % u64::from(k) == u64::from(k) - 1;
    if every(o.unroutable_every) {
        return ("order.refunded", br#"{"order_id":"r"}"#.to_vec(), true);
    }
    if every(o.malformed_every) {
        return (
            "order.placed",
            br#"{"order_id": "broken", "lines": [ {"sku": "#.to_vec(),
            true,
        );
    }
    let simulate = if every(o.transient_every) {
        r#","simulate":"transient""#
    } else {
        ""
    };
    let body = format!(
        r#"{{"order_id":"c{g}-o{seq}","customer":"customer-{g}","currency":"EUR","lines":[{{"sku":"sku-{}","qty":{},"unit_price_cents":{}}}]{simulate}}}"#,
        n % 97,
        1 + n % 5,
        100 + n % 900
    );
    ("order.placed", body.into_bytes(), false)
}

/// Run the demo; the summary says whether anything was lost.
pub async fn run(o: DemoOptions) -> anyhow::Result<DemoSummary> {
    let config = demo_config(&o);
    let broker = MemoryBroker::new();
    let ledger = Arc::new(Ledger::new());
    let opts = NodeOptions {
        call_observer: Some(ledger.clone()),
        settle_observer: Some(ledger.clone()),
        ..NodeOptions::default()
    };
    let transport: Arc<dyn Transport> = Arc::new(broker.clone());
    let node = Node::start(&config, transport, opts)
        .await
        .context("starting the demo node")?;
    let stats = node.stats();

    let total = u64::from(o.groups) * u64::from(o.per_group);
    let bar = progress_bar(&o, total);

    let started = Instant::now();
    let (ids, expected_dead) = publish_all(&o, &node, &bar).await?;
    bar.set_position(0);
    bar.set_prefix("handling");

    wait_until_final(&o, &stats, &broker, &bar, started, total).await;
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    node.shutdown().await?;

    let s = stats.snapshot();
    let lost = lost(&ids, &ledger, &broker);
    Ok(DemoSummary {
        published: total,
        cascaded: s.cascaded,
        handled: s.handled,
        retried: s.retry_scheduled,
        dead_lettered: s.dead_lettered.iter().copied().filter(|(_, n)| *n > 0).collect(),
        expected_dead_letters: expected_dead,
        groups: ledger.groups(),
        overlaps: ledger.overlaps(),
        out_of_order: ledger.out_of_order(),
        peak_parallel_groups: ledger.peak_groups(),
        lost,
        left_on_broker: broker.total_depth("orders"),
        stranded: s.stranded,
        uncertain: s.uncertain,
        elapsed,
    })
}

/// The demo's progress bar (hidden unless `o.progress`), publishing first.
fn progress_bar(o: &DemoOptions, total: u64) -> ProgressBar {
    let bar = if o.progress {
        ProgressBar::new(total)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} {prefix:>10} [{bar:40}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix("publishing");
    bar
}

/// Publish `o.per_group` messages to each of `o.groups` groups, round
/// after round; their ids, and how many of them should be dead-lettered.
async fn publish_all(o: &DemoOptions, node: &Node, bar: &ProgressBar) -> anyhow::Result<(Vec<String>, u64)> {
    let total = u64::from(o.groups) * u64::from(o.per_group);
    let mut ids = Vec::with_capacity(total as usize);
    let mut expected_dead = 0u64;
    let mut n = 0u64;
    for seq in 0..o.per_group {
        for g in 0..o.groups {
            let (kind, payload, dead) = generate(o, g, seq, n);
            expected_dead += u64::from(dead);
            let env = envelope::new_message(
                envelope::fresh_id(),
                kind,
                Some(format!("customer-{g}")),
                Some("acme".into()),
                vec![(SEQ_HEADER.into(), seq.to_string())],
                payload,
            );
            node.publish("orders", &env)
                .await
                .with_context(|| format!("publishing demo message {n}"))?;
            ids.push(env.id);
            n += 1;
            if n.is_multiple_of(500) {
                bar.set_position(n);
            }
        }
    }
    Ok((ids, expected_dead))
}

/// Wait until every published message (and every cascade) is final, or
/// the demo's deadline passed. `started`: when publishing began; `total`:
/// how many messages it published.
async fn wait_until_final(
    o: &DemoOptions,
    stats: &Stats,
    broker: &MemoryBroker,
    bar: &ProgressBar,
    started: Instant,
    total: u64,
) {
    loop {
        let s = stats.snapshot();
        let finished = s.handled + s.dead_lettered_total() + s.uncertain;
        bar.set_position(finished.min(total));
        bar.set_message(format!(
            "handled {} · retried {} · dead-lettered {} · cascaded {}",
            s.handled,
            s.retry_scheduled,
            s.dead_lettered_total(),
            s.cascaded
        ));
        if finished >= total + s.cascaded && broker.total_depth("orders") == 0 {
            break;
        }
        if started.elapsed() > o.deadline {
            tracing::error!(finished, total, "demo deadline passed with messages outstanding");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Published messages neither handled nor on the dead-letter list.
fn lost(ids: &[String], ledger: &Ledger, broker: &MemoryBroker) -> u64 {
    let outcomes = ledger.outcomes();
    let dead_ids: HashSet<String> = broker
        .dead_letters("orders")
        .iter()
        .filter_map(|w| w.header(header::MESSAGE_ID).map(str::to_owned))
        .collect();
    ids.iter()
        .filter(|id| match outcomes.get(*id) {
            Some(Outcome::Handled) => false,
            Some(Outcome::DeadLettered(_)) | Some(Outcome::Uncertain) => !dead_ids.contains(*id),
            _ => true,
        })
        .count() as u64
}
