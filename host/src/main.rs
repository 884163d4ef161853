//! The `weir` command: parse, build, run. No logic beyond that.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

use weir::config;
use weir::demo::{self, DemoOptions};
use weir::node::{self, Node, NodeOptions};
use weir::observe::journal::{self, Journal};

mod call;
mod dead_letters;
mod deploy;
mod dev;
mod groups;
mod handlers;
mod inspect;
mod logging;
mod logs;
mod publish;
mod scaffold;
mod status;

/// Weir: message handlers in WebAssembly, one host per node.
#[derive(Parser)]
#[command(name = "weir", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log lines on stderr as text for people or one JSON object a line
    /// (default: node.log_format, else text). Colour only on a terminal, never with NO_COLOR.
    #[arg(long, global = true, value_enum)]
    log_format: Option<config::LogFormat>,
    /// The level of Weir's own log lines (default: node.log_level, else info).
    /// RUST_LOG, when set, replaces the whole filter, e.g. RUST_LOG=warn,weir::settle=debug.
    #[arg(long, global = true, value_enum)]
    log_level: Option<config::LogLevel>,
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
    /// Groups parked behind a failed message (`on_failure = "park"`).
    Groups {
        #[command(subcommand)]
        command: GroupsCommand,
    },
    /// The cluster's slots (owner, fencing epoch, state, lag, consumers, calls
    /// in flight) and nodes, with every unowned slot flagged (red on a terminal).
    /// From the coordinator database in `postgres` mode, or from the admin
    /// listener of one or more nodes in any mode.
    Status {
        /// A node's TOML config: its `[cluster] database_url` in postgres mode,
        /// else its `node.admin` (with its admin_token unless --token is given).
        #[arg(long, required_unless_present = "admin")]
        config: Option<PathBuf>,
        /// A node's admin listener, e.g. `http://127.0.0.1:9464` (repeatable:
        /// the nodes' views are merged, so static-mode clusters show whole).
        #[arg(long)]
        admin: Vec<String>,
        /// The operator token of those listeners (or WEIR_TOKEN).
        #[arg(long, env = "WEIR_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// Print JSON (the same as `GET /v1/slots`) instead of tables.
        #[arg(long)]
        json: bool,
        /// Redraw every SECONDS (default 2) until Ctrl-C.
        #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "2")]
        watch: Option<f64>,
    },
    /// Each handler's topology, tenant, running version (since when, made
    /// by what) and canary: from the admin listeners given (merged; a
    /// version that differs between nodes is shown per node), the config's
    /// node.admin, or in postgres and nats-kv modes the store.
    Handlers {
        /// A node's TOML config: its node.admin (with its admin_token unless
        /// --token is given), else in postgres or nats-kv mode its store.
        #[arg(long, required_unless_present = "admin")]
        config: Option<PathBuf>,
        /// A node's admin listener, e.g. `http://127.0.0.1:9464` (repeatable).
        #[arg(long)]
        admin: Vec<String>,
        /// The token of those listeners (or WEIR_TOKEN); a tenant's token sees its handlers.
        #[arg(long, env = "WEIR_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// A handler's recent log lines (its `log` calls, granted stdout and
    /// stderr), and the failures and faults its calls ended in, from the
    /// admin listeners of the nodes running it (each keeps the last 512 lines
    /// per handler), merged by time.
    Logs {
        /// The handler's name.
        handler: String,
        /// A node's TOML config: its node.admin, with its admin_token unless --token is given.
        #[arg(long, required_unless_present = "admin")]
        config: Option<PathBuf>,
        /// A node's admin listener, e.g. `http://127.0.0.1:9464` (repeatable).
        #[arg(long)]
        admin: Vec<String>,
        /// The token of those listeners (or WEIR_TOKEN); a tenant's token sees its own handlers.
        #[arg(long, env = "WEIR_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// Keep printing new lines as they come, until Ctrl-C.
        #[arg(long, short = 'f')]
        follow: bool,
        /// Lines per node, newest last (1 to 1000).
        #[arg(long, short = 'n', default_value_t = 100, value_parser = clap::value_parser!(u16).range(1..=1000))]
        limit: u16,
        /// One JSON object a line, each with its node.
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
        #[command(flatten)]
        canary: deploy::CanaryArgs,
        /// The component.
        file: PathBuf,
    },
    /// Make a handler's running canary its current version on every slot
    /// (and every node of a `postgres` cluster). Exit codes as for `deploy`.
    Promote {
        #[command(flatten)]
        target: AdminTarget,
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
    /// test that runs natively, the WIT (and for Rust the SDK) it needs, a
    /// `weir.toml` for `weir dev`, a README.
    New {
        /// The language: rust, python, or js (alias: javascript).
        #[arg(value_enum, required_unless_present = "list")]
        lang: Option<scaffold::Lang>,
        /// The project, crate, component and handler name.
        #[arg(required_unless_present = "list")]
        name: Option<String>,
        /// List the templates this binary holds, and what each needs.
        #[arg(long)]
        list: bool,
        /// Make it in this directory instead of the current one.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
    /// Build the handler project here (or in `--dir`) into `NAME.wasm`, with
    /// the language's toolchain; prints the component's path, size and digest.
    /// Rust: cargo for wasm32-wasip2 (the target added with rustup when
    /// missing). Python and JavaScript: componentize-py or ComponentizeJS,
    /// installed on first use into `$XDG_CACHE_HOME/weir/toolchains/` (else
    /// `~/.cache/weir/toolchains/`); needs python3 (or `$WEIR_PYTHON`) or
    /// node and npm.
    Build {
        /// The project directory.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// Use only what is already downloaded (cargo --offline, pip
        /// --no-index with PIP_FIND_LINKS, npm --offline).
        #[arg(long)]
        offline: bool,
    },
    /// The inner loop of a handler project: build it, run it on a node of its
    /// own (memory broker, admin listener), publish what is typed here or
    /// posted to `POST /v1/topologies/{T}/messages`, print what each message
    /// did, and rebuild and deploy on every change of the sources.
    Dev {
        /// The project directory.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// The admin listener's address (default: weir.toml's node.admin, else 127.0.0.1:9464).
        #[arg(long)]
        admin: Option<std::net::SocketAddr>,
        /// A message type the handler takes (repeatable), for a project without weir.toml.
        #[arg(long = "type")]
        types: Vec<String>,
        /// Build with crates already downloaded only (cargo --offline).
        #[arg(long)]
        offline: bool,
    },
    /// Make a handler's previous version current again; while a canary runs,
    /// end the canary instead (exit codes as for `deploy`).
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
    /// Config tools.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// What a component is, read without compiling it: the weir:handler
    /// world and version it implements, its imports and exports, its size
    /// and sha256 digest (the version id a node reports). Exit 1 when it is
    /// not a Weir handler.
    Inspect {
        /// The component.
        file: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print a completion script for SHELL (bash, zsh, fish, elvish,
    /// powershell), e.g. `weir completions bash > /etc/bash_completion.d/weir`.
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Validate a node's config as `weir run` would, without running a node
    /// or contacting the broker: every error names its key; each handler's
    /// component must be readable and a component. Exit 1 on an error.
    Check {
        /// The node's TOML config.
        file: PathBuf,
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
enum GroupsCommand {
    /// The parked groups of each node: slot, tenant, group, the failed head,
    /// its failures, and how long the group has waited.
    List {
        /// A node's admin listener, e.g. `http://127.0.0.1:9464` (repeatable).
        #[arg(long, required = true)]
        admin: Vec<String>,
        /// The operator's or a tenant's token (or WEIR_TOKEN): a tenant sees its own groups.
        #[arg(long, env = "WEIR_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Release a parked group now: its held messages run at once, its head
    /// when it comes back from the ladder (out of order, as asked).
    Unpark(GroupOrderArgs),
    /// Release a parked group and dead-letter its head `skipped` when it
    /// comes back from the ladder.
    Skip(GroupOrderArgs),
}

/// Which group, on which nodes, as whom.
#[derive(clap::Args)]
struct GroupOrderArgs {
    /// The nodes' admin listeners (repeatable: the one running the group's slot acts).
    #[arg(long, required = true)]
    admin: Vec<String>,
    /// The operator's token, or the group's tenant's (or WEIR_TOKEN).
    #[arg(long, env = "WEIR_TOKEN", hide_env_values = true)]
    token: String,
    /// The group's topology.
    #[arg(long)]
    topology: String,
    /// The group id.
    #[arg(long)]
    group: String,
    /// The group's tenant, when its messages have one.
    #[arg(long)]
    tenant: Option<String>,
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
    if !matches!(cli.command, Command::Run { .. }) {
        // A command whose output is piped into `head` ends quietly when the
        // pipe closes, as Unix tools do, instead of panicking on the write.
        // SAFETY: setting a signal's disposition before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    // `weir run` takes its log settings from its config unless the flags say otherwise.
    let from_config = match &cli.command {
        Command::Run { config } => config::load(config).ok().map(|c| (c.node.log_format, c.node.log_level)),
        _ => None,
    };
    let settings = logging::Settings {
        kind: match cli.command {
            // A node logs what it does.
            Command::Run { .. } => logging::Kind::Other,
            Command::Call { .. } => logging::Kind::Call,
            Command::Dev { .. } => logging::Kind::Dev,
            // The other commands' output is their progress and summary, or a
            // table: warnings only (no broker client's connection lines).
            _ => logging::Kind::Quiet,
        },
        format: cli.log_format.or(from_config.and_then(|c| c.0)).unwrap_or_default(),
        level: cli.log_level.or(from_config.and_then(|c| c.1)),
    };
    let guest_log = call::GuestLog::default();
    match settings.kind {
        // `weir call` prints the guest's log lines with the call they belong to.
        logging::Kind::Call => logging::init(&settings, Some(guest_log.clone())),
        // `weir dev` prints them as they come, in the message's block.
        logging::Kind::Dev => logging::init(&settings, Some(dev::GuestEcho)),
        _ => logging::init(&settings, None::<dev::GuestEcho>),
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
            // Spans queued when the node stops are flushed when this drops,
            // after the drain.
            let _traces = weir::telemetry::init(&cfg.telemetry, &cfg.node.name)?;
            runtime()?.block_on(async {
                // Caught from here on: a SIGTERM while the node starts (its
                // slots may already be consuming) is answered with a drain
                // once it has started, never with the default exit.
                let late = std::env::var(NEGATIVE_CONTROL_LATE_SIGNALS).is_ok_and(|v| v == "1");
                let mut signals = if late {
                    tracing::error!("{NEGATIVE_CONTROL_LATE_SIGNALS}=1: signals are caught only once the node has started (a test's negative control; never in production)");
                    None
                } else {
                    Some(Signals::install()?)
                };
                if std::env::var_os(HOLD_START).is_some() {
                    tracing::info!("{HOLD_START}: holding the start until a line arrives on standard input");
                    tokio::task::spawn_blocking(|| {
                        let mut line = String::new();
                        let _ = std::io::stdin().read_line(&mut line);
                    })
                    .await?;
                }
                let transport = node::transport_for(&cfg)?;
                let mut opts = NodeOptions::default();
                // Without a data directory, compiled code is kept where `weir call`
                // keeps it (the user's cache), so a restart does not compile again.
                if cfg.node.data_dir.is_none() {
                    opts.runtime.cache_dir = call::cache_dir();
                }
                // A cluster-wide ledger for multi-process tests (see weir::observe::journal).
                if let Some(path) = std::env::var_os(journal::ENV) {
                    let j = Arc::new(Journal::open(std::path::Path::new(&path), &cfg.node.name)?);
                    opts.call_observer = Some(j.clone());
                    opts.settle_observer = Some(j);
                }
                let node = Node::start(&cfg, transport.clone(), opts).await?;
                warn_unconsumed_static_slots(&cfg, transport.as_ref()).await;
                match signals.as_mut() {
                    Some(signals) => signals.recv().await,
                    None => wait_for_signal().await?,
                }
                drain(node).await
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
            if cfg.transport.kind == config::TransportKind::Memory {
                anyhow::bail!("{}", publish::memory_refusal(&cfg));
            }
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
        Command::Config {
            command: ConfigCommand::Check { file },
        } => inspect::config_check(&file),
        Command::Inspect { file, json } => inspect::inspect(&file, json),
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut cmd, "weir", &mut std::io::stdout());
            Ok(ExitCode::SUCCESS)
        }
        Command::Deploy {
            target,
            grant_env,
            grant_dir,
            canary,
            file,
        } => {
            deploy::deploy(&target.as_target(), &file, &grant_env, &grant_dir, &canary)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Promote { target } => {
            deploy::promote(&target.as_target())?;
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
        Command::New { lang, name, dir, list } => {
            match (lang, name) {
                (Some(lang), Some(name)) if !list => {
                    scaffold::new(lang, &name, &dir)?;
                }
                _ => {
                    use clap::ValueEnum as _;
                    println!("templates (weir new LANG NAME):");
                    for lang in scaffold::Lang::value_variants() {
                        let help = lang
                            .to_possible_value()
                            .and_then(|v| v.get_help().map(ToString::to_string));
                        println!("  {:<8} {}", lang.as_str(), help.unwrap_or_default());
                    }
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Build { dir, offline } => {
            scaffold::build(&dir, offline)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Dev {
            dir,
            admin,
            types,
            offline,
        } => dev::run(dev::Options {
            dir,
            admin,
            types,
            offline,
        }),
        Command::DeadLetters { command } => dead_letters::run(command),
        Command::Groups { command } => match command {
            GroupsCommand::List { admin, token, json } => groups::list(&admin, token.as_deref(), json),
            GroupsCommand::Unpark(a) => {
                groups::order(&a.admin, &a.token, &a.topology, &a.group, a.tenant.as_deref(), false)
            }
            GroupsCommand::Skip(a) => {
                groups::order(&a.admin, &a.token, &a.topology, &a.group, a.tenant.as_deref(), true)
            }
        },
        Command::Rollback { target } => {
            deploy::rollback(&target.as_target())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Handlers {
            config,
            admin,
            token,
            json,
        } => handlers::run(handlers::Request {
            config,
            admin,
            token,
            json,
        }),
        Command::Logs {
            handler,
            config,
            admin,
            token,
            follow,
            limit,
            json,
        } => logs::run(logs::Request {
            handler,
            config,
            admin,
            token,
            follow,
            limit: usize::from(limit),
            json,
        }),
        Command::Status {
            config,
            admin,
            token,
            json,
            watch,
        } => status::run(status::Request {
            config,
            admin,
            token,
            json,
            watch: watch
                .map(|w| {
                    std::time::Duration::try_from_secs_f64(w)
                        .ok()
                        .filter(|d| !d.is_zero())
                        .context("--watch: a number of seconds above 0, e.g. --watch 2")
                })
                .transpose()?,
        }),
    }
}

/// Static mode: the slots of this node's topologies that it does not own
/// and that no consumer reads now are named at start (the config warning
/// already said another node must own them; this says none does yet).
async fn warn_unconsumed_static_slots(cfg: &config::Config, transport: &dyn weir::transport::Transport) {
    if cfg.cluster.mode != config::ClusterMode::Static {
        return;
    }
    let owned = cfg.cluster.owned_slots.clone().unwrap_or_default();
    for t in &cfg.topology {
        let mut idle = Vec::new();
        for slot in (0..t.slots).filter(|n| !owned.contains(n)) {
            match transport.consumers(&t.name, slot).await {
                Ok(Some(0)) => idle.push(slot),
                Ok(_) => {}
                Err(_) => return,
            }
        }
        if !idle.is_empty() {
            tracing::warn!(
                topology = %t.name,
                slots = ?idle,
                "no node consumes these slots now: their messages wait until a node with them in cluster.owned_slots starts"
            );
        }
    }
}

/// Leave: stop taking messages, let the calls in flight finish (saying
/// which, every second), start no other call (the rest of a job holding
/// several messages is released with what was queued), and exit. So the
/// drain lasts as long as the calls that were running when it began. A
/// second SIGINT or SIGTERM interrupts the calls still running: they go
/// back to the broker unfinished, like everything not started, and nothing
/// is lost.
async fn drain(node: Node) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let draining = node.draining();
    let running: i64 = draining.in_flight().iter().map(|(_, n)| n).sum();
    tracing::info!(
        running,
        "signal received: draining: {running} call(s) running finish, no other call starts, the rest goes back to \
         the broker (a second Ctrl-C interrupts the calls)"
    );
    let progress = {
        let draining = draining.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
            tick.tick().await;
            loop {
                tick.tick().await;
                let calls = draining.in_flight();
                let total: i64 = calls.iter().map(|(_, n)| n).sum();
                if total > 0 {
                    let each: Vec<String> = calls.iter().map(|(h, n)| format!("{h} ×{n}")).collect();
                    tracing::info!(
                        waited_s = started.elapsed().as_secs(),
                        "waiting for {total} call(s): {}",
                        each.join(", ")
                    );
                } else {
                    tracing::info!(
                        waited_s = started.elapsed().as_secs(),
                        "no call running; releasing the slots"
                    );
                }
            }
        })
    };
    let forced = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let force = {
        let (draining, forced) = (draining.clone(), forced.clone());
        tokio::spawn(async move {
            if wait_for_signal().await.is_ok() {
                forced.store(true, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(
                    "second signal: interrupting the calls still running; they go back to the broker unfinished \
                     (redelivered, not lost)"
                );
                draining.interrupt();
            }
        })
    };
    let reports = node.shutdown().await?;
    progress.abort();
    force.abort();
    let released: u64 = reports.iter().map(|r| r.released).sum();
    let finished: usize = reports.iter().map(|r| r.drained.len()).sum();
    tracing::info!(
        slots = reports.len(),
        finished,
        released,
        interrupted = forced.load(std::sync::atomic::Ordering::Relaxed),
        took_ms = started.elapsed().as_millis() as u64,
        "stopped: {} slot(s) drained, {finished} job(s) in flight finished{}, {released} message(s) this node held \
         but had not started went back to the broker; everything not acknowledged is delivered again",
        reports.len(),
        if forced.load(std::sync::atomic::Ordering::Relaxed) {
            " or were interrupted"
        } else {
            ""
        },
    );
    Ok(())
}

/// A test's barrier, never for production: with this variable set, `weir
/// run` holds its start (signals already caught) until a line arrives on
/// standard input.
const HOLD_START: &str = "WEIR_TEST_HOLD_START";

/// Negative control for that test, never for production: with this set to
/// `1`, signals are caught only once the node has started (as before the
/// fix), and a SIGTERM during the start ends the process without a drain.
const NEGATIVE_CONTROL_LATE_SIGNALS: &str = "WEIR_NEGATIVE_CONTROL_LATE_SIGNALS";

/// SIGTERM and SIGINT, caught from the moment this is made (until then a
/// SIGTERM ends the process at once, without a drain).
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
        })
    }

    /// The next SIGTERM or SIGINT (one that came since `install` counts).
    async fn recv(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

async fn wait_for_signal() -> anyhow::Result<()> {
    Signals::install()?.recv().await;
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
                "  {:>8}  {:>12}  {:>12}  {}",
                r.delivery,
                humantime::format_duration(r.delay_before).to_string(),
                humantime::format_duration(r.since_first).to_string(),
                r.role.as_str()
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
