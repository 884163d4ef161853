//! `weir dev`: the inner loop of a handler project. Builds it, starts a node
//! of its own on the memory broker with an admin listener, and then, until
//! Ctrl-C: publishes what is typed in the terminal (or posted to
//! `POST /v1/topologies/{T}/messages`), prints what each message did (the
//! guest's log lines, its cascades, its outcome and time), and on every
//! change of the sources rebuilds and deploys the new version through the
//! admin listener, the same path `weir deploy` takes in production. A build
//! or deploy that fails leaves the running version serving.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context as _, bail};

use weir::admin::messages::PublishRequest;
use weir::config::{self, Config, TransportKind};
use weir::envelope::Envelope;
use weir::node::{Node, NodeOptions};
use weir::transport::Transport;
use weir::transport::memory::MemoryBroker;

use crate::cli::scaffold;

mod print;
mod watch;

use print::DevTransport;
pub use print::{GuestEcho, Printer};
use watch::{Project, Rebuild, rebuild_loop, watch};

/// The project's own node config, when it has one (`weir new` writes it).
pub const CONFIG_FILE: &str = "weir.toml";

/// What `weir dev` was asked.
#[derive(clap::Args)]
pub struct Options {
    /// The project directory.
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
    /// The admin listener's address (default: weir.toml's node.admin, else 127.0.0.1:9464).
    #[arg(long)]
    pub admin: Option<std::net::SocketAddr>,
    /// A message type the handler takes (repeatable), for a project without weir.toml.
    #[arg(long = "type")]
    pub types: Vec<String>,
    /// Build with crates already downloaded only (cargo --offline).
    #[arg(long)]
    pub offline: bool,
    /// Python and JavaScript: build and deploy on every save, as `weir build` does,
    /// instead of live sources (a save that adds no import runs at once, with no build).
    #[arg(long)]
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

/// The first build: `weir dev`'s own live component and its signature, unless the project
/// cannot run live sources; and the component the project's config names (built here unless
/// the sources are live: then the config's entry is pointed at the live one).
fn first_build(opts: &Options, detected: &scaffold::Project) -> anyhow::Result<(Option<(PathBuf, String)>, PathBuf)> {
    let live_blocked = if opts.rebuild {
        Some("--rebuild".to_owned())
    } else {
        scaffold::live::unsupported(&opts.dir)?
    };
    if let (scaffold::Lang::Js, Some(why)) = (detected.lang, &live_blocked)
        && !opts.rebuild
    {
        println!("weir dev: each save is built: {why}");
    }
    let building = || format!("building {} before starting its node", opts.dir.display());
    if live_blocked.is_some() {
        let wasm = scaffold::build(&opts.dir, opts.offline).with_context(building)?;
        return Ok((None, wasm));
    }
    let live = scaffold::live::build(&opts.dir, opts.offline).with_context(building)?;
    Ok((Some(live), opts.dir.join(format!("{}.wasm", detected.name))))
}

/// Point the config's entry of `handler` at the live `component`, with the sources mounted.
fn point_at_live(cfg: &mut Config, handler: &str, component: &Path, dir: &Path) -> anyhow::Result<config::Handler> {
    let entry = cfg
        .handler
        .iter_mut()
        .find(|h| h.name == handler)
        .context("the project's handler is in the config")?;
    entry.component = component.to_owned();
    entry.wasi.preopens.push(config::Preopen {
        host: scaffold::live::mount(dir)?,
        guest: scaffold::live::GUEST_DIR.to_owned(),
        read_only: true,
    });
    Ok(entry.clone())
}

/// Run the loop until Ctrl-C.
pub fn run(opts: Options) -> anyhow::Result<ExitCode> {
    let detected = scaffold::detect(&opts.dir)?;
    let (live, wasm) = first_build(&opts, &detected)?;
    let project = Project {
        lang: detected.lang,
        dir: opts.dir.canonicalize().unwrap_or_else(|_| opts.dir.clone()),
        name: detected.name.clone(),
    };
    let (mut cfg, token) = dev_config(&opts, &project.name, &wasm)?;
    let mut handler = project_handler(&cfg, &wasm)?.clone();
    if let Some((component, _)) = &live {
        handler = point_at_live(&mut cfg, &handler.name, component, &opts.dir)?;
    }
    let admin = cfg.node.admin.map(|a| format!("http://{a}")).unwrap_or_default();
    let printer = Arc::new(Printer::default());
    let transport: Arc<dyn Transport> = Arc::new(DevTransport {
        inner: Arc::new(MemoryBroker::new()),
        printer: printer.clone(),
    });
    crate::cli::runtime()?.block_on(async {
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
        print::banner(&handler, &admin, &token, &project.watched_label(), live.is_some());
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
        publish_typed_lines(&node, &handler).await?;
        println!("weir dev: stopping (draining the node) …");
        builder.abort();
        let _ = builder.await;
        node.shutdown().await?;
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Publish each line typed to `handler`'s topology, until Ctrl-C (or SIGTERM).
async fn publish_typed_lines(node: &Node, handler: &config::Handler) -> anyhow::Result<()> {
    let topology = &handler.topology;
    let example_type = handler.message_types.first().cloned().unwrap_or_else(|| "TYPE".into());
    // Registered once, before the loop: a Ctrl-C while a line is being
    // published is kept for the next turn, not lost.
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .context("installing the SIGINT handler")?;
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let mut lines = read_terminal();
    let mut stdin_open = true;
    let mut n = 0u64;
    loop {
        tokio::select! {
            _ = interrupt.recv() => return Ok(()),
            _ = terminate.recv() => return Ok(()),
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
                                if let Err(e) = node.publish(topology, &m).await {
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
}

/// The terminal's lines, read on a thread of their own, never joined: tokio's stdin would
/// hold the runtime's shutdown until the next Enter.
fn read_terminal() -> tokio::sync::mpsc::Receiver<String> {
    let (line_tx, lines) = tokio::sync::mpsc::channel::<String>(16);
    std::thread::spawn(move || {
        use std::io::BufRead as _;
        for line in std::io::stdin().lock().lines() {
            let line = match line {
                Ok(line) => line,
                Err(e) => {
                    println!("weir dev: the terminal cannot be read ({e}); publish through the admin listener");
                    break;
                }
            };
            if line_tx.blocking_send(line).is_err() {
                break;
            }
        }
    });
    lines
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
