//! What `weir dev` prints: each message's block (its log lines, cascades, outcome and time),
//! from the node's observers and a transport that sees what is published.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;

use weir::envelope::{Envelope, Wire, header};
use weir::observe::CallObserver;
use weir::outcome::{Outcome, Reason, SettleObserver};
use weir::transport::memory::MemoryBroker;
use weir::transport::{RetryFacts, RetryOwner, Subscription, TopologySpec, Transport, TransportError};

/// Prints the guest's log lines (`weir::guest` events) as they come, in
/// the message's block of the output.
pub struct GuestEcho;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for GuestEcho {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: tracing_subscriber::layer::Context<'_, S>) {
        if event.metadata().target() != "weir::guest" {
            return;
        }
        struct Text(String);
        impl tracing::field::Visit for Text {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    use std::fmt::Write as _;
                    let _ = write!(self.0, "{value:?}");
                }
            }
        }
        let mut text = Text(String::new());
        event.record(&mut text);
        println!(
            "  log      {:<5}  {}",
            event.metadata().level().as_str().to_lowercase(),
            text.0
        );
    }
}

/// What happened to a message so far.
#[derive(Default)]
struct Seen {
    started: Option<Instant>,
    took: Option<Duration>,
    error: Option<(String, Option<Duration>)>,
    attempt: u32,
}

/// Prints each message's way through the node: calls, cascades, outcomes.
#[derive(Default)]
pub struct Printer {
    seen: Mutex<HashMap<String, Seen>>,
    /// Messages whose call returned and which are not settled yet: what is
    /// published meanwhile is their cascades.
    settling: Mutex<HashSet<String>>,
    /// Cascades published and not settled yet, by id: their type.
    cascades: Mutex<HashMap<String, String>>,
}

impl Printer {
    fn published(&self, wire: &Wire) {
        let id = wire.header(header::MESSAGE_ID).unwrap_or("?");
        let kind = wire.header(header::MESSAGE_TYPE).unwrap_or("?");
        let group = wire.header(header::GROUP_ID).filter(|g| !g.is_empty()).unwrap_or("-");
        let payload = crate::cli::call::show_payload(&wire.body);
        let cascade = self.settling.lock().map(|s| !s.is_empty()).unwrap_or(false);
        if cascade {
            if let Ok(mut c) = self.cascades.lock() {
                c.insert(id.to_owned(), kind.to_owned());
            }
            println!("  cascade  {kind}  group {group}  {payload}");
        } else {
            println!("{id}  {kind}  group {group}  queued  {payload}");
        }
    }
}

impl CallObserver for Printer {
    fn version(&self, msg: &Envelope, digest: &str) {
        let short: String = digest.chars().take(12).collect();
        println!("{}  attempt {}  on version {short}", msg.id, msg.attempt);
    }

    fn before(&self, msg: &Envelope) {
        if let Ok(mut s) = self.seen.lock() {
            let e = s.entry(msg.id.clone()).or_default();
            e.started = Some(Instant::now());
            e.attempt = msg.attempt;
        }
    }

    fn after(&self, msg: &Envelope) {
        if let Ok(mut s) = self.seen.lock()
            && let Some(e) = s.get_mut(&msg.id)
        {
            e.took = e.started.map(|t| t.elapsed());
        }
        if let Ok(mut s) = self.settling.lock() {
            s.insert(msg.id.clone());
        }
    }
}

impl SettleObserver for Printer {
    fn failed(&self, id: &str, error: &str, retry_in: Option<Duration>) {
        if let Ok(mut s) = self.seen.lock() {
            s.entry(id.to_owned()).or_default().error = Some((error.to_owned(), retry_in));
        }
    }

    fn settled(&self, id: &str, outcome: Outcome) {
        if let Ok(mut s) = self.settling.lock() {
            s.remove(id);
        }
        let seen = self.seen.lock().ok().and_then(|mut s| s.remove(id)).unwrap_or_default();
        let took = seen
            .took
            .map(|d| format!("  ({:.2} ms)", d.as_secs_f64() * 1e3))
            .unwrap_or_default();
        let error = seen.error.as_ref().map(|(e, _)| e.as_str()).unwrap_or("");
        let cascade = self.cascades.lock().ok().and_then(|mut c| c.remove(id));
        match outcome {
            // A cascade nothing consumes is not a failure of the handler that
            // published it: say what it is.
            Outcome::DeadLettered(Reason::NoHandler) if seen.started.is_none() && cascade.is_some() => {
                let kind = cascade.unwrap_or_default();
                println!(
                    "  cascade  {kind}  published, no consumer: no handler here takes `{kind}` \
                     (kept as a no-handler dead letter; bind it with a [[handler]] to run it)"
                );
            }
            Outcome::Handled => println!("  outcome  ok{took}"),
            Outcome::RetryScheduled => {
                let when = seen
                    .error
                    .as_ref()
                    .and_then(|(_, d)| *d)
                    .map(|d| format!(", attempt {} in {}", seen.attempt + 1, humantime::format_duration(d)))
                    .unwrap_or_default();
                println!("  outcome  retry: {error}{took}{when}");
            }
            Outcome::DeadLettered(reason) if seen.started.is_none() => {
                println!("{id}  dead-lettered ({reason}): {error}");
            }
            Outcome::DeadLettered(reason) => println!("  outcome  dead-lettered ({reason}): {error}{took}"),
            other => println!("  outcome  {}{took}", other.as_str()),
        }
    }
}

/// The memory broker, with every publish shown.
pub(super) struct DevTransport {
    pub(super) inner: Arc<MemoryBroker>,
    pub(super) printer: Arc<Printer>,
}

#[async_trait]
impl Transport for DevTransport {
    fn system(&self) -> &'static str {
        self.inner.system()
    }

    fn retry_owner(&self) -> RetryOwner {
        self.inner.retry_owner()
    }

    async fn declare(&self, topology: &TopologySpec) -> Result<(), TransportError> {
        self.inner.declare(topology).await
    }

    async fn subscribe(
        &self,
        topology: &str,
        slot: u32,
        prefetch: u32,
    ) -> Result<Box<dyn Subscription>, TransportError> {
        self.inner.subscribe(topology, slot, prefetch).await
    }

    async fn subscribe_ingress(
        &self,
        topology: &str,
        prefetch: u32,
    ) -> Result<Option<Box<dyn Subscription>>, TransportError> {
        self.inner.subscribe_ingress(topology, prefetch).await
    }

    async fn publish(&self, topology: &str, slot: u32, wire: Wire) -> Result<(), TransportError> {
        self.printer.published(&wire);
        self.inner.publish(topology, slot, wire).await
    }

    async fn publish_dead_letter(&self, topology: &str, wire: Wire) -> Result<(), TransportError> {
        self.inner.publish_dead_letter(topology, wire).await
    }

    async fn retry_facts(&self, topology: &str) -> Result<Option<RetryFacts>, TransportError> {
        self.inner.retry_facts(topology).await
    }

    async fn backlog(&self, topology: &str, slot: u32) -> Result<Option<u64>, TransportError> {
        self.inner.backlog(topology, slot).await
    }

    async fn consumers(&self, topology: &str, slot: u32) -> Result<Option<u32>, TransportError> {
        self.inner.consumers(topology, slot).await
    }

    async fn close(&self) {
        self.inner.close().await;
    }

    fn dead_letters(&self) -> Option<&dyn weir::transport::dead_letters::DeadLetterStore> {
        Transport::dead_letters(self.inner.as_ref())
    }
}

/// What `weir dev` says once its node runs: where it is, how to publish, what it watches.
pub(super) fn banner(handler: &weir::config::Handler, admin: &str, token: &str, watched: &str, live: bool) {
    let topology = &handler.topology;
    let example_type = handler.message_types.first().map_or("TYPE", String::as_str);
    println!(
        "weir dev: `{}` runs on a node of its own (memory broker, topology `{topology}`, types {:?})",
        handler.name, handler.message_types
    );
    println!("  admin    {admin}   (token {token})");
    println!("  publish  type a line: {example_type} [group=G] [tenant=T] PAYLOAD   (or a JSON object)");
    println!(
        "           or: curl -H 'Authorization: Bearer {token}' -d '{{\"type\":\"{example_type}\",\"payload\":{{}}}}' {admin}/v1/topologies/{topology}/messages"
    );
    println!(
        "  watching {watched} for changes: {}; Ctrl-C stops",
        if live {
            "a save runs at once (live sources); a new import, the WIT or the project file rebuilds"
        } else {
            "each is rebuilt and deployed"
        }
    );
}
