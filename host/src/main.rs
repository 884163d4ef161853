//! The `weir` command: parse, build, run. No logic beyond that.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

use weir::cluster::postgres;
use weir::config;
use weir::demo::{self, DemoOptions};
use weir::node::{self, Node, NodeOptions};
use weir::observe::journal::{self, Journal};

mod call;
mod dead_letters;
mod deploy;
mod publish;
mod scaffold;

/// Weir: message handlers in WebAssembly, one host per node.
#[derive(Parser)]
#[command(name = "weir", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The embedded default: in-memory broker, bundled orders handler, a
    /// generated stream; live progress, then a summary. Exits 0 only when
    /// nothing was lost.
    Demo {
        /// Groups in the generated stream.
        #[arg(long, default_value_t = 200)]
        groups: u32,
        /// Messages per group.
        #[arg(long, default_value_t = 50)]
        per_group: u32,
    },
    /// Run one node until SIGTERM/SIGINT, then drain and exit.
    Run {
        /// The node's TOML config.
        #[arg(long)]
        config: PathBuf,
    },
    /// The cluster as the coordinator database has it: nodes (lease age,
    /// leader) and slots (owner, fencing epoch, state). `postgres` mode.
    Status {
        /// The node's TOML config (its `[cluster] database_url`).
        #[arg(long)]
        config: PathBuf,
        /// Print JSON (the same as `GET /v1/slots`) instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Publish messages through the configured broker to the slot of their
    /// group (publisher confirms), with a progress bar for large counts.
    Publish {
        /// The node's TOML config (its transport and topologies).
        #[arg(long)]
        config: PathBuf,
        /// Message type (`weir-message-type`).
        #[arg(long = "type")]
        message_type: String,
        /// Group id (`weir-group-id`); without it messages are unordered.
        #[arg(long)]
        group: Option<String>,
        /// Tenant id (`weir-tenant-id`).
        #[arg(long)]
        tenant: Option<String>,
        /// How many messages.
        #[arg(long, default_value_t = 1)]
        count: u64,
        /// The payload: text, or `@FILE` for a file's bytes.
        #[arg(long, default_value = "")]
        payload: String,
        /// Topology name; defaults to the config's only topology.
        #[arg(long)]
        topology: Option<String>,
    },
    /// Upload a component as a handler's new version through a node's admin
    /// listener. It is validated first; a refused upload leaves the running
    /// version serving. Exit codes: 0 deployed, 2 refused for who you are
    /// (token, deploys disabled), 3 refused for what was sent (not a
    /// component, too large, unknown handler or grant), 4 no answer or the
    /// node is busy (worth retrying).
    #[command(
        after_help = "Exit codes: 0 deployed or unchanged; 2 auth (401, 403, deploys disabled); \
        3 refused (400, 404, 408, 413, 422); 4 transport (unreachable, connection lost, 429, 5xx)."
    )]
    Deploy {
        #[command(flatten)]
        target: AdminTarget,
        /// Grant a host environment variable (repeatable; checked against the tenant's allowance).
        #[arg(long = "grant-env")]
        grant_env: Vec<String>,
        /// Grant a read-only directory, `GUEST:HOST` (repeatable).
        #[arg(long = "grant-dir")]
        grant_dir: Vec<String>,
        /// The component.
        file: PathBuf,
    },
    /// Run a handler component once per message, with no broker, under the
    /// limits a node gives it, and print the outcome (ok, retry, reject or a
    /// fault), every cascade it published, its log lines and the time taken.
    /// Exit 0 when every message answered ok, 1 otherwise.
    Call {
        /// The component (`.wasm`).
        component: PathBuf,
        /// The message type.
        #[arg(long = "type")]
        message_type: String,
        /// The group id.
        #[arg(long)]
        group: Option<String>,
        /// The tenant id.
        #[arg(long)]
        tenant: Option<String>,
        /// The payload: text, or `@FILE` for a file's bytes.
        #[arg(long, conflicts_with = "each")]
        payload: Option<String>,
        /// One message per non-empty line of this file (JSONL), the line as its payload.
        #[arg(long)]
        each: Option<PathBuf>,
        /// A header, `NAME=VALUE` (repeatable).
        #[arg(long = "header", value_parser = call::pair)]
        headers: Vec<(String, String)>,
        /// A key of the handler's config table, `KEY=VALUE` (repeatable).
        #[arg(long = "config", value_parser = call::pair)]
        config: Vec<(String, String)>,
        /// Deliver all the messages in one `handle-batch` call.
        #[arg(long)]
        batch: bool,
        /// The call's timeout (limits.timeout), e.g. `2s`.
        #[arg(long, value_parser = humantime::parse_duration)]
        timeout: Option<std::time::Duration>,
    },
    /// Make a handler project in `./NAME` from a template in this binary: the
    /// handler (decodes JSON, publishes a cascade, rejects bad input), a unit
    /// test, the WIT and SDK it needs, a README.
    New {
        /// The language.
        #[arg(value_enum)]
        lang: scaffold::Lang,
        /// The project, crate, component and handler name.
        name: String,
        /// Make it in this directory instead of the current one.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
    /// Build the handler project here (or in `--dir`) into `NAME.wasm`, with
    /// the language's toolchain; prints the component's path, size and digest.
    Build {
        /// The project directory.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// Use only crates already downloaded (cargo --offline).
        #[arg(long)]
        offline: bool,
    },
    /// Make a handler's previous version current again (exit codes as for `deploy`).
    Rollback {
        #[command(flatten)]
        target: AdminTarget,
    },
    /// Dead letters: list, show, redrive (in order, each re-publish
    /// confirmed before the letter is removed), purge.
    DeadLetters {
        #[command(subcommand)]
        command: dead_letters::Command,
    },
    /// Retry schedule tools.
    Schedule {
        #[command(subcommand)]
        command: ScheduleCommand,
    },
}

/// Which node, as whom, which handler: `weir deploy` and `weir rollback`.
#[derive(clap::Args)]
struct AdminTarget {
    /// The node's admin listener, e.g. `http://127.0.0.1:9464`.
    #[arg(long)]
    admin: String,
    /// Operator or tenant token (or WEIR_TOKEN).
    #[arg(long, env = "WEIR_TOKEN", hide_env_values = true)]
    token: String,
    /// The handler's name.
    #[arg(long)]
    handler: String,
}

impl AdminTarget {
    fn as_target(&self) -> deploy::Target<'_> {
        deploy::Target {
            admin: &self.admin,
            token: &self.token,
            handler: &self.handler,
        }
    }
}

#[derive(Subcommand)]
enum ScheduleCommand {
    /// Print each topology's retry ladder as a table with every violation;
    /// exit 1 on a violation.
    Check {
        /// The node's TOML config.
        #[arg(long)]
        config: PathBuf,
    },
}

/// mimalloc: the host allocates small, short-lived objects on several threads
/// per message; glibc's malloc cost a third of the end-to-end time (BENCHMARKS.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo's own output is the progress bar and the summary; its
    // dead letters are expected, so only warnings are logged by default.
    let default_filter = match cli.command {
        Command::Demo { .. } => "warn",
        // Their output is the table or the summary; the broker's chatter is not.
        Command::DeadLetters { .. } => "warn",
        _ => "warn,weir=info",
    };
    let guest_log = call::GuestLog::default();
    // Colour only for a person at a terminal, and never with NO_COLOR set.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none();
    if matches!(cli.command, Command::Call { .. }) {
        // `weir call` prints the guest's log lines with the call they belong
        // to; the rest of the log goes to stderr as usual.
        use tracing_subscriber::Layer as _;
        use tracing_subscriber::layer::SubscriberExt as _;
        use tracing_subscriber::util::SubscriberInitExt as _;
        let fmt = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(colour)
            .with_filter(
                tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                    tracing_subscriber::EnvFilter::new("warn,weir::runtime::engine=info,weir::guest=off")
                }),
            );
        let guest = tracing_subscriber::Layer::with_filter(
            guest_log.clone(),
            tracing_subscriber::filter::Targets::new().with_target("weir::guest", tracing::Level::TRACE),
        );
        tracing_subscriber::registry().with(fmt).with(guest).init();
    } else {
        tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
            )
            .with_writer(std::io::stderr)
            .with_ansi(colour)
            .init();
    }
    match run(cli, &guest_log) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            // `weir deploy` / `weir rollback`: one exit code per kind of failure.
            match e.downcast_ref::<deploy::Failure>() {
                Some(f) => ExitCode::from(f.exit_code()),
                None => ExitCode::FAILURE,
            }
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    node::async_runtime().context("starting the async runtime")
}

fn run(cli: Cli, guest_log: &call::GuestLog) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Demo { groups, per_group } => {
            let opts = DemoOptions {
                groups,
                per_group,
                ..DemoOptions::default()
            };
            let summary = runtime()?.block_on(demo::run(opts))?;
            println!("{summary}");
            if summary.ok() {
                println!("OK: nothing lost, no intra-group overlap.");
                Ok(ExitCode::SUCCESS)
            } else {
                println!("FAILED: see the lost / overlap / dead-letter lines above.");
                Ok(ExitCode::FAILURE)
            }
        }
        Command::Run { config } => {
            let cfg = config::load(&config)?;
            for w in cfg.validate().unwrap_or_default() {
                tracing::warn!(key = %w.key, "{}", w.message);
            }
            runtime()?.block_on(async {
                let transport = node::transport_for(&cfg)?;
                let mut opts = NodeOptions::default();
                // A cluster-wide ledger for multi-process tests (see weir::observe::journal).
                if let Some(path) = std::env::var_os(journal::ENV) {
                    let j = Arc::new(Journal::open(std::path::Path::new(&path), &cfg.node.name)?);
                    opts.call_observer = Some(j.clone());
                    opts.settle_observer = Some(j);
                }
                let node = Node::start(&cfg, transport, opts).await?;
                wait_for_signal().await?;
                tracing::info!("signal received: draining");
                let reports = node.shutdown().await?;
                let released: u64 = reports.iter().map(|r| r.released).sum();
                tracing::info!(slots = reports.len(), released, "drained; exiting");
                Ok::<_, anyhow::Error>(())
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Publish {
            config,
            message_type,
            group,
            tenant,
            count,
            payload,
            topology,
        } => {
            let cfg = config::load(&config)?;
            let payload = match payload.strip_prefix('@') {
                Some(file) => std::fs::read(file).with_context(|| format!("--payload @{file}: cannot read {file}"))?,
                None => payload.into_bytes(),
            };
            let req = publish::Request {
                message_type,
                group,
                tenant,
                count,
                payload,
                topology,
            };
            let summary = runtime()?.block_on(publish::run(&cfg, req))?;
            println!("{summary}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Schedule {
            command: ScheduleCommand::Check { config },
        } => schedule_check(&config),
        Command::Deploy {
            target,
            grant_env,
            grant_dir,
            file,
        } => {
            deploy::deploy(&target.as_target(), &file, &grant_env, &grant_dir)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Call {
            component,
            message_type,
            group,
            tenant,
            payload,
            each,
            headers,
            config,
            batch,
            timeout,
        } => {
            let req = call::Request {
                component,
                message_type,
                group,
                tenant,
                headers,
                payloads: call::payloads(payload.as_deref(), each.as_deref())?,
                config: config.into_iter().collect(),
                batch,
                timeout,
            };
            call::run(req, guest_log)
        }
        Command::New { lang, name, dir } => {
            scaffold::new(lang, &name, &dir)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Build { dir, offline } => {
            scaffold::build(&dir, offline)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::DeadLetters { command } => dead_letters::run(command),
        Command::Rollback { target } => {
            deploy::rollback(&target.as_target())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { config, json } => {
            let cfg = config::load(&config)?;
            if cfg.cluster.mode != config::ClusterMode::Postgres {
                anyhow::bail!(
                    "{}: `weir status` reads the coordinator database; it needs cluster.mode = \"postgres\"",
                    cfg.origin
                );
            }
            let url = cfg.cluster.database_url.clone().unwrap_or_default();
            let status = runtime()?.block_on(async {
                let pool = postgres::connect(&url).await?;
                let mut status = postgres::status::status(&pool).await?;
                // Lag per slot from the broker; a broker that cannot answer leaves it unknown.
                let transport = node::transport_for(&cfg)?;
                for s in &mut status.slots {
                    match transport.backlog(&s.topology, s.slot).await {
                        Ok(lag) => s.lag = lag,
                        Err(e) => {
                            tracing::warn!(topology = %s.topology, slot = s.slot, error = %e, "cannot read the slot's backlog");
                            break;
                        }
                    }
                }
                anyhow::Ok(status)
            })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                print!("{status}");
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn wait_for_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("waiting for SIGINT")?,
        _ = term.recv() => {}
    }
    Ok(())
}

/// What the configured broker reports for each topology's schedule check
/// (JetStream: stream `max_age`, consumer `AckWait`); nothing for brokers
/// without such facts. A broker that cannot be reached is reported and the
/// check goes on without its facts.
fn broker_facts(cfg: &config::Config) -> anyhow::Result<Vec<Option<weir::transport::RetryFacts>>> {
    if cfg.transport.kind != config::TransportKind::Nats {
        return Ok(Vec::new());
    }
    let transport = node::transport_for(cfg)?;
    runtime()?.block_on(async {
        let mut out = Vec::new();
        for t in &cfg.topology {
            let read = tokio::time::timeout(std::time::Duration::from_secs(10), transport.retry_facts(&t.name)).await;
            match read {
                Ok(Ok(f)) => out.push(f),
                Ok(Err(e)) => {
                    println!(
                        "warning: topology `{}`: the broker's facts could not be read ({e}); checked without them",
                        t.name
                    );
                    out.push(None);
                }
                Err(_) => {
                    println!(
                        "warning: topology `{}`: the broker did not answer in 10s; checked without its facts",
                        t.name
                    );
                    out.push(None);
                }
            }
        }
        Ok(out)
    })
}

fn schedule_check(path: &std::path::Path) -> anyhow::Result<ExitCode> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let origin = path.display().to_string();
    // Parse without validation first so every retry violation is shown in the table view.
    let cfg = match config::parse(&text, &origin) {
        Ok(c) => c,
        Err(config::ConfigError::Invalid { issues, .. }) => {
            println!("{origin}: invalid config");
            for v in issues {
                println!("  error   {v}");
            }
            return Ok(ExitCode::FAILURE);
        }
        Err(e) => return Err(e.into()),
    };
    let facts = broker_facts(&cfg)?;
    let mut violations = 0;
    for (i, t) in cfg.topology.iter().enumerate() {
        let fact = facts.get(i).cloned().flatten();
        let schedule = t.schedule(cfg.transport.kind, fact.as_ref().and_then(|f| f.ack_wait));
        let policy = schedule.policy();
        println!(
            "topology `{}` on {} (max_deliver {}):",
            t.name,
            cfg.transport.kind.as_str(),
            if policy.max_deliver <= 0 {
                "unlimited".to_string()
            } else {
                policy.max_deliver.to_string()
            }
        );
        println!(
            "  {:>8}  {:>12}  {:>12}  role",
            "delivery", "delay before", "cumulative"
        );
        let rows = schedule.table(u32::try_from(policy.ladder.len()).unwrap_or(8).saturating_add(3).max(6));
        for r in &rows {
            println!(
                "  {:>8}  {:>12}  {:>12}  {:?}",
                r.delivery,
                humantime::format_duration(r.delay_before).to_string(),
                humantime::format_duration(r.since_first).to_string(),
                r.role
            );
        }
        match schedule.time_to_dead_letter() {
            Some(d) => println!("  time to dead-letter: {}", humantime::format_duration(d)),
            None => println!("  time to dead-letter: never (unlimited deliveries)"),
        }
        if let Some(f) = &fact {
            println!(
                "  broker: stream max_age {}, consumer AckWait {}",
                f.stream_max_age.map_or_else(
                    || "unlimited".to_string(),
                    |d| humantime::format_duration(d).to_string()
                ),
                f.ack_wait.map_or_else(
                    || "(no consumer yet)".to_string(),
                    |d| humantime::format_duration(d).to_string()
                ),
            );
        }
        let ctx = weir::retry::schedule::CheckContext {
            key: config::Config::retry_key(i),
            stream_max_age: fact.as_ref().and_then(|f| f.stream_max_age),
        };
        let report = schedule.check(&ctx);
        for v in &report.errors {
            println!("  error   {v}");
        }
        for v in &report.warnings {
            println!("  warning {v}");
        }
        violations += report.errors.len();
        println!();
    }
    if violations > 0 {
        println!("{violations} violation(s)");
        Ok(ExitCode::FAILURE)
    } else {
        println!("no violations");
        Ok(ExitCode::SUCCESS)
    }
}
