//! `weir dev`: the inner loop of a handler project. Builds it, starts a node
//! of its own on the memory broker with an admin listener, and then, until
//! Ctrl-C: publishes what is typed in the terminal (or posted to
//! `POST /v1/topologies/{T}/messages`), prints what each message did (the
//! guest's log lines, its cascades, its outcome and time), and on every
//! change of the sources rebuilds and deploys the new version through the
//! admin listener, the same path `weir deploy` takes in production. A build
//! or deploy that fails leaves the running version serving.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use async_trait::async_trait;

use weir::admin::messages::PublishRequest;
use weir::config::{self, Config, TransportKind};
use weir::envelope::{Envelope, Wire, header};
use weir::node::{Node, NodeOptions};
use weir::observe::CallObserver;
use weir::outcome::{Outcome, Reason, SettleObserver};
use weir::transport::memory::MemoryBroker;
use weir::transport::{RetryFacts, RetryOwner, Subscription, TopologySpec, Transport, TransportError};

use crate::cli::{deploy, scaffold};

/// The project's own node config, when it has one (`weir new` writes it).
pub const CONFIG_FILE: &str = "weir.toml";

/// What `weir dev` was asked.
pub struct Options {
    /// The project directory.
    pub dir: PathBuf,
    /// The admin listener's address (default: the config's, else 127.0.0.1:9464).
    pub admin: Option<SocketAddr>,
    /// Message types the handler takes, when the project has no `weir.toml`.
    pub types: Vec<String>,
    /// Build with crates already downloaded only.
    pub offline: bool,
    /// Python: a build and a deploy on every save instead of live sources.
    pub rebuild: bool,
}

/// The node config for the project: its `weir.toml` (the memory broker
/// whatever it says), else one handler named after the project taking
/// `types`. The admin listener is always on, with a token made up for this
/// session when the config names none.
fn dev_config(opts: &Options, name: &str, wasm: &Path) -> anyhow::Result<(Config, String)> {
    let file = opts.dir.join(CONFIG_FILE);
    let mut cfg = if file.is_file() {
        let cfg = config::load(&file)?;
        if cfg.transport.kind != TransportKind::Memory {
            eprintln!(
                "weir dev: {} says transport.kind = \"{}\"; `weir dev` runs on the memory broker (use `weir run --config {}` for that broker)",
                file.display(),
                cfg.transport.kind.as_str(),
                file.display()
            );
        }
        cfg
    } else {
        if opts.types.is_empty() {
            bail!(
                "{} has no {CONFIG_FILE}, so `weir dev` does not know which message types `{name}` takes: \
                 say so with --type (e.g. `weir dev --type greeting`), or write a {CONFIG_FILE} (`weir new` makes one)",
                opts.dir.display()
            );
        }
        let types: Vec<String> = opts.types.iter().map(|t| format!("{t:?}")).collect();
        let text = format!(
            "[[topology]]\nname = {name:?}\nslots = 4\n[topology.retry]\nladder = [\"1s\", \"5s\"]\nmax_deliver = 3\n\
             [[handler]]\nname = {name:?}\ncomponent = {wasm:?}\ntopology = {name:?}\nmessage_types = [{}]\n",
            types.join(", "),
            wasm = wasm.display().to_string()
        );
        config::parse(&text, "<weir dev>")?
    };
    cfg.transport.kind = TransportKind::Memory;
    cfg.cluster = config::Cluster::default();
    if let Some(a) = opts.admin {
        cfg.node.admin = Some(a);
    }
    if cfg.node.admin.is_none() {
        cfg.node.admin = Some(SocketAddr::from(([127, 0, 0, 1], 9464)));
    }
    let token = match &cfg.node.admin_token {
        Some(t) => t.clone(),
        None => {
            let t = format!("dev-{}", uuid::Uuid::new_v4().simple());
            cfg.node.admin_token = Some(t.clone());
            t
        }
    };
    Ok((cfg, token))
}

/// The handler the project's build is: the one whose component is `wasm`,
/// else the only one.
fn project_handler<'a>(cfg: &'a Config, wasm: &Path) -> anyhow::Result<&'a config::Handler> {
    let same = |p: &Path| match (p.canonicalize(), wasm.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => p == wasm,
    };
    if let Some(h) = cfg.handler.iter().find(|h| same(&h.component)) {
        return Ok(h);
    }
    match cfg.handler.as_slice() {
        [only] => Ok(only),
        _ => bail!(
            "{}: no [[handler]] has component = {:?} (the project's build), so `weir dev` cannot tell which handler to swap",
            cfg.origin,
            wasm.display()
        ),
    }
}

/// Run the loop until Ctrl-C.
pub fn run(opts: Options) -> anyhow::Result<ExitCode> {
    let detected = scaffold::detect(&opts.dir)?;
    let live = if detected.lang == scaffold::Lang::Python && !opts.rebuild {
        Some(
            scaffold::live::build(&opts.dir, opts.offline)
                .with_context(|| format!("building {} before starting its node", opts.dir.display()))?,
        )
    } else {
        None
    };
    // The component the project's config names: built here, unless the sources are live
    // (then the config's entry is pointed at weir dev's own component below).
    let wasm = match &live {
        Some(_) => opts.dir.join(format!("{}.wasm", detected.name)),
        None => scaffold::build(&opts.dir, opts.offline)
            .with_context(|| format!("building {} before starting its node", opts.dir.display()))?,
    };
    let project = Project {
        lang: detected.lang,
        dir: opts.dir.canonicalize().unwrap_or_else(|_| opts.dir.clone()),
        name: detected.name.clone(),
    };
    let (mut cfg, token) = dev_config(&opts, &project.name, &wasm)?;
    let mut handler = project_handler(&cfg, &wasm)?.clone();
    if let Some((component, _)) = &live {
        let entry = cfg
            .handler
            .iter_mut()
            .find(|h| h.name == handler.name)
            .context("the project's handler is in the config")?;
        entry.component = component.clone();
        entry.wasi.preopens.push(config::Preopen {
            host: project.dir.clone(),
            guest: scaffold::live::GUEST_DIR.to_owned(),
            read_only: true,
        });
        handler = entry.clone();
    }
    let admin = cfg.node.admin.map(|a| format!("http://{a}")).unwrap_or_default();
    let printer = Arc::new(Printer::default());
    let broker = Arc::new(MemoryBroker::new());
    let transport: Arc<dyn Transport> = Arc::new(DevTransport {
        inner: broker,
        printer: printer.clone(),
    });
    let rt = crate::cli::runtime()?;
    rt.block_on(async {
        let node = Node::start(
            &cfg,
            transport,
            NodeOptions {
                call_observer: Some(printer.clone()),
                settle_observer: Some(printer.clone()),
                runtime: weir::runtime::RuntimeOptions {
                    cache_dir: crate::cli::call::cache_dir(),
                    ..weir::runtime::RuntimeOptions::default()
                },
                ..NodeOptions::default()
            },
        )
        .await
        .with_context(|| format!("starting the dev node of `{}`", project.name))?;
        let topology = handler.topology.clone();
        let example_type = handler.message_types.first().cloned().unwrap_or_else(|| "TYPE".into());
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
            "  watching {} for changes: {}; Ctrl-C stops",
            project.watched_label(),
            if live.is_some() {
                "a save runs at once (live sources); a new import, the WIT or pyproject.toml rebuilds"
            } else {
                "each is rebuilt and deployed"
            }
        );
        let (changed_tx, changed_rx) = tokio::sync::mpsc::channel::<()>(1);
        let _watcher = watch(&project, changed_tx)?;
        let builder = tokio::spawn(rebuild_loop(
            changed_rx,
            Rebuild {
                dir: opts.dir.clone(),
                offline: opts.offline,
                admin: admin.clone(),
                token: token.clone(),
                handler: handler.name.clone(),
                live: live.map(|(_, signature)| signature),
            },
        ));
        // Registered once, before the loop: a Ctrl-C while a line is being
        // published is kept for the next turn, not lost.
        let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
            .context("installing the SIGINT handler")?;
        let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("installing the SIGTERM handler")?;
        // Lines are read on a thread of their own, never joined: tokio's
        // stdin would hold the runtime's shutdown until the next Enter.
        let (line_tx, mut lines) = tokio::sync::mpsc::channel::<String>(16);
        std::thread::spawn(move || {
            use std::io::BufRead as _;
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if line_tx.blocking_send(line).is_err() {
                    break;
                }
            }
        });
        let mut stdin_open = true;
        let mut n = 0u64;
        loop {
            tokio::select! {
                _ = interrupt.recv() => break,
                _ = terminate.recv() => break,
                line = lines.recv(), if stdin_open => match line {
                    Some(line) => {
                        let line = line.trim();
                        if line.is_empty() {
                            continue;
                        }
                        if matches!(line, "help" | "?") {
                            print_help(&example_type);
                            continue;
                        }
                        n += 1;
                        match typed_message(line, &mut || format!("dev-{n}")) {
                            Ok(messages) => {
                                for m in messages {
                                    if let Err(e) = node.publish(&topology, &m).await {
                                        println!("not published: {e}");
                                    }
                                }
                            }
                            Err(e) => println!("not published: {e} (type `help` for the syntax)"),
                        }
                    }
                    None => stdin_open = false,
                },
            }
        }
        println!("weir dev: stopping (draining the node) …");
        builder.abort();
        let _ = builder.await;
        node.shutdown().await?;
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

fn print_help(example_type: &str) {
    println!(
        "one message per line:\n  {example_type} PAYLOAD\n  {example_type} group=g-1 PAYLOAD\n  {example_type} group=g-1 tenant=acme PAYLOAD\n  \
         {{\"type\": \"{example_type}\", \"group\": \"g-1\", \"payload\": {{…}}, \"headers\": {{…}}, \"count\": 3}}"
    );
}

/// A line typed into `weir dev`: a JSON [`PublishRequest`], or
/// `TYPE [group=G] [tenant=T] [PAYLOAD…]`.
pub fn typed_message(line: &str, fresh_id: &mut dyn FnMut() -> String) -> Result<Vec<Envelope>, String> {
    let req = if line.starts_with('{') {
        serde_json::from_str::<PublishRequest>(line).map_err(|e| format!("not a message request: {e}"))?
    } else {
        let (message_type, mut rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        let mut group = None;
        let mut tenant = None;
        loop {
            rest = rest.trim_start();
            let (word, after) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
            if let Some(g) = word.strip_prefix("group=") {
                group = Some(g.to_owned());
            } else if let Some(t) = word.strip_prefix("tenant=") {
                tenant = Some(t.to_owned());
            } else {
                break;
            }
            rest = after;
        }
        PublishRequest {
            message_type: message_type.to_owned(),
            group,
            tenant,
            headers: Default::default(),
            payload: Some(serde_json::Value::String(rest.to_owned())),
            payload_base64: None,
            id: None,
            count: None,
        }
    };
    req.envelopes(fresh_id)
}

/// The project `weir dev` runs: its language, directory and name.
#[derive(Clone)]
struct Project {
    lang: scaffold::Lang,
    dir: PathBuf,
    name: String,
}

/// Directories of a project that hold no sources: build output, installed
/// dependencies, version control.
const NOT_SOURCES: [&str; 6] = ["target", "node_modules", ".git", "__pycache__", ".venv", "dist"];

impl Project {
    /// Is `path` a source whose change means a rebuild? Everything in the
    /// project but build output, dependencies, hidden files, components and
    /// `weir.toml` (a config change needs a restart: said at start) that the
    /// language's build reads ([`scaffold::Lang::is_source`]).
    fn is_source(&self, path: &Path) -> bool {
        let Ok(rel) = path.strip_prefix(&self.dir) else {
            return false;
        };
        let hidden_or_built = rel.components().any(|c| {
            let c = c.as_os_str().to_string_lossy();
            c.starts_with('.') || NOT_SOURCES.contains(&c.as_ref())
        });
        let name = rel
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        !hidden_or_built
            && !name.ends_with(".wasm")
            && !name.ends_with('~')
            && !name.ends_with(".swp")
            && name != CONFIG_FILE
            && !rel.as_os_str().is_empty()
            && self.lang.is_source(rel)
    }

    fn watched_label(&self) -> String {
        format!(
            "{} (all but {}, *.wasm and {CONFIG_FILE}; restart for a {CONFIG_FILE} change)",
            self.dir.display(),
            NOT_SOURCES.join(", ")
        )
    }
}

/// Watch the project's sources; a change sends on `changed` (coalesced).
fn watch(project: &Project, changed: tokio::sync::mpsc::Sender<()>) -> anyhow::Result<notify::RecommendedWatcher> {
    use notify::Watcher as _;
    let relevant = project.clone();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else { return };
        if matches!(event.kind, notify::EventKind::Access(_)) {
            return;
        }
        if event.paths.iter().any(|p| relevant.is_source(p)) {
            // Full: a rebuild is already due; it will see this change too.
            let _ = changed.try_send(());
        }
    })
    .context("starting the file watcher")?;
    watcher
        .watch(&project.dir, notify::RecursiveMode::Recursive)
        .with_context(|| format!("watching {}", project.dir.display()))?;
    Ok(watcher)
}

/// How long a burst of file events is let settle before a rebuild (an
/// editor's save is several events).
const SETTLE: Duration = Duration::from_millis(300);

/// What the rebuild loop needs.
struct Rebuild {
    dir: PathBuf,
    offline: bool,
    admin: String,
    token: String,
    handler: String,
    /// Live sources: the signature of the sources the running component was built from.
    live: Option<String>,
}

/// Rebuild and deploy on each change, one at a time; with live sources, only a change
/// that a running component cannot load needs it.
async fn rebuild_loop(mut changed: tokio::sync::mpsc::Receiver<()>, mut r: Rebuild) {
    while changed.recv().await.is_some() {
        // Let the burst end, then take what arrived meanwhile.
        tokio::time::sleep(SETTLE).await;
        while changed.try_recv().is_ok() {}
        if let Some(built) = &r.live {
            match scaffold::live::signature(&r.dir) {
                Ok(now) if now == *built => {
                    println!("weir dev: saved; the next message runs it (live sources: no build)");
                    continue;
                }
                Ok(_) => println!("weir dev: an import or a file other than Python changed; rebuilding …"),
                Err(e) => println!("weir dev: {e:#}; rebuilding …"),
            }
        } else {
            println!("weir dev: sources changed; rebuilding …");
        }
        let (dir, offline, live) = (r.dir.clone(), r.offline, r.live.is_some());
        let (admin, token, handler) = (r.admin.clone(), r.token.clone(), r.handler.clone());
        let done = tokio::task::spawn_blocking(move || -> anyhow::Result<(bool, Option<String>)> {
            let (wasm, signature) = if live {
                let (wasm, signature) = scaffold::live::build(&dir, offline)?;
                (wasm, Some(signature))
            } else {
                (scaffold::build(&dir, offline)?, None)
            };
            let swapped = deploy::deploy(
                &deploy::Target {
                    admin: &admin,
                    token: &token,
                    handler: &handler,
                },
                &wasm,
                &[],
                &[],
                &deploy::CanaryArgs::default(),
            )?;
            Ok((swapped, signature))
        })
        .await;
        match done {
            Ok(Ok((swapped, signature))) => {
                if signature.is_some() {
                    r.live = signature;
                }
                if swapped {
                    println!("weir dev: swapped; new messages run the new version");
                } else {
                    println!("weir dev: the build is the version already running; nothing to swap");
                }
            }
            Ok(Err(e)) => println!("weir dev: not swapped, the previous version still runs: {e:#}"),
            Err(e) => println!("weir dev: the rebuild task failed: {e}"),
        }
    }
}

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
struct DevTransport {
    inner: Arc<MemoryBroker>,
    printer: Arc<Printer>,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> impl FnMut() -> String {
        let mut n = 0;
        move || {
            n += 1;
            format!("dev-{n}")
        }
    }

    #[test]
    fn a_typed_line_names_type_group_tenant_and_payload() {
        let m = typed_message(r#"greeting group=g-1 tenant=acme {"name": "Ada"}"#, &mut ids()).unwrap_or_default();
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].message_type, "greeting");
        assert_eq!(m[0].group_id.as_deref(), Some("g-1"));
        assert_eq!(m[0].tenant_id.as_deref(), Some("acme"));
        assert_eq!(m[0].payload, br#"{"name": "Ada"}"#);
        assert_eq!(m[0].id, "dev-1");
        let m = typed_message("greeting", &mut ids()).unwrap_or_default();
        assert_eq!((m[0].group_id.as_deref(), m[0].payload.len()), (None, 0));
    }

    #[test]
    fn sources_are_what_a_build_reads() {
        let p = Project {
            lang: scaffold::Lang::Rust,
            dir: PathBuf::from("/p"),
            name: "x".into(),
        };
        for yes in [
            "/p/src/lib.rs",
            "/p/app.py",
            "/p/handler.js",
            "/p/Cargo.toml",
            "/p/tests/t.py",
        ] {
            assert!(p.is_source(Path::new(yes)), "{yes}");
        }
        for no in [
            "/p/target/wasm32-wasip2/release/x.wasm",
            "/p/x.wasm",
            "/p/node_modules/a/index.js",
            "/p/.git/index",
            "/p/src/.lib.rs.swp",
            "/p/weir.toml",
            "/p/__pycache__/app.cpython-311.pyc",
            "/elsewhere/lib.rs",
            "/p",
        ] {
            assert!(!p.is_source(Path::new(no)), "{no}");
        }
        let py = Project {
            lang: scaffold::Lang::Python,
            ..p.clone()
        };
        let js = Project {
            lang: scaffold::Lang::Js,
            ..p
        };
        for (project, yes, no) in [
            (
                &py,
                ["/p/app.py", "/p/pyproject.toml", "/p/wit/handler.wit"],
                "/p/README.md",
            ),
            (
                &js,
                ["/p/handler.js", "/p/package.json", "/p/wit/handler.wit"],
                "/p/README.md",
            ),
        ] {
            for yes in yes {
                assert!(project.is_source(Path::new(yes)), "{yes}");
            }
            assert!(!project.is_source(Path::new(no)), "{no}");
        }
        assert!(!py.is_source(Path::new("/p/.greeter.wasm.part")));
        assert!(!js.is_source(Path::new("/p/node_modules/x/index.js")));
    }

    #[test]
    fn a_json_line_is_a_publish_request() {
        let m = typed_message(
            r#"{"type":"greeting","group":"g","payload":{"name":"Bo"},"count":2}"#,
            &mut ids(),
        )
        .unwrap_or_default();
        assert_eq!(m.len(), 2);
        assert_eq!(m[1].payload, br#"{"name":"Bo"}"#);
        assert!(typed_message(r#"{"type":"greeting","nope":1}"#, &mut ids()).is_err());
        assert!(typed_message("greeting group=a\u{0}b x", &mut ids()).is_err());
    }
}
