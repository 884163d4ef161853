//! The command line's grammar: every subcommand and its flags (clap).

use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

use weir::config;

use super::{call, dead_letters, deploy, dev, handlers, logs, scaffold};

/// Weir: message handlers in WebAssembly, one host per node.
#[derive(Parser)]
#[command(name = "weir", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Log lines on stderr as text for people or one JSON object a line
    /// (default: node.log_format, else text). Colour only on a terminal, never with NO_COLOR.
    #[arg(long, global = true, value_enum)]
    pub log_format: Option<config::LogFormat>,
    /// The level of Weir's own log lines (default: node.log_level, else info).
    /// RUST_LOG, when set, replaces the whole filter, e.g. RUST_LOG=warn,weir::settle=debug.
    #[arg(long, global = true, value_enum)]
    pub log_level: Option<config::LogLevel>,
}

#[derive(Subcommand)]
pub enum Command {
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
    Status(StatusArgs),
    /// Each handler's topology, tenant, running version (since when, made
    /// by what) and canary: from the admin listeners given (merged; a
    /// version that differs between nodes is shown per node), the config's
    /// node.admin, or in postgres and nats-kv modes the store.
    Handlers(handlers::Request),
    /// A handler's recent log lines (its `log` calls, granted stdout and
    /// stderr), and the failures and faults its calls ended in, from the
    /// admin listeners of the nodes running it (each keeps the last 512 lines
    /// per handler), merged by time.
    Logs(logs::Request),
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
    Call(CallArgs),
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
    /// did. A save of a Python or JavaScript handler runs with the next message
    /// (live sources); a new import, or a Rust handler's save, is built and deployed.
    Dev(dev::Options),
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
pub enum ConfigCommand {
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
pub struct AdminTarget {
    /// The node's admin listener, e.g. `http://127.0.0.1:9464`.
    #[arg(long)]
    pub admin: String,
    /// Operator or tenant token (or WEIR_TOKEN).
    #[arg(long, env = "WEIR_TOKEN", hide_env_values = true)]
    pub token: String,
    /// The handler's name.
    #[arg(long)]
    pub handler: String,
}

impl AdminTarget {
    pub fn as_target(&self) -> deploy::Target<'_> {
        deploy::Target {
            admin: &self.admin,
            token: &self.token,
            handler: &self.handler,
        }
    }
}

#[derive(Subcommand)]
pub enum GroupsCommand {
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
pub struct GroupOrderArgs {
    /// The nodes' admin listeners (repeatable: the one running the group's slot acts).
    #[arg(long, required = true)]
    pub admin: Vec<String>,
    /// The operator's token, or the group's tenant's (or WEIR_TOKEN).
    #[arg(long, env = "WEIR_TOKEN", hide_env_values = true)]
    pub token: String,
    /// The group's topology.
    #[arg(long)]
    pub topology: String,
    /// The group id.
    #[arg(long)]
    pub group: String,
    /// The group's tenant, when its messages have one.
    #[arg(long)]
    pub tenant: Option<String>,
}

#[derive(Subcommand)]
pub enum ScheduleCommand {
    /// Print each topology's retry ladder as a table with every violation;
    /// exit 1 on a violation.
    Check {
        /// The node's TOML config.
        #[arg(long)]
        config: PathBuf,
    },
}

/// `weir status`'s flags.
#[derive(clap::Args)]
pub struct StatusArgs {
    /// A node's TOML config: its `[cluster] database_url` in postgres mode,
    /// else its `node.admin` (with its admin_token unless --token is given).
    #[arg(long, required_unless_present = "admin")]
    pub config: Option<PathBuf>,
    /// A node's admin listener, e.g. `http://127.0.0.1:9464` (repeatable:
    /// the nodes' views are merged, so static-mode clusters show whole).
    #[arg(long)]
    pub admin: Vec<String>,
    /// The operator token of those listeners (or WEIR_TOKEN).
    #[arg(long, env = "WEIR_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Print JSON (the same as `GET /v1/slots`) instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Redraw every SECONDS (default 2) until Ctrl-C.
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "2")]
    pub watch: Option<f64>,
}

impl StatusArgs {
    /// What `weir status` is asked, `--watch` checked.
    pub fn request(self) -> anyhow::Result<super::status::Request> {
        let watch = self
            .watch
            .map(|seconds| {
                std::time::Duration::try_from_secs_f64(seconds)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .context("--watch: a number of seconds above 0, e.g. --watch 2")
            })
            .transpose()?;
        Ok(super::status::Request {
            config: self.config,
            admin: self.admin,
            token: self.token,
            json: self.json,
            watch,
        })
    }
}

/// `weir call`'s flags.
#[derive(clap::Args)]
pub struct CallArgs {
    /// The component (`.wasm`).
    pub component: PathBuf,
    /// The message type.
    #[arg(long = "type")]
    pub message_type: String,
    /// The group id.
    #[arg(long)]
    pub group: Option<String>,
    /// The tenant id.
    #[arg(long)]
    pub tenant: Option<String>,
    /// The payload: text, or `@FILE` for a file's bytes.
    #[arg(long, conflicts_with = "each")]
    pub payload: Option<String>,
    /// One message per non-empty line of this file (JSONL), the line as its payload.
    #[arg(long)]
    pub each: Option<PathBuf>,
    /// A header, `NAME=VALUE` (repeatable).
    #[arg(long = "header", value_parser = call::pair)]
    pub headers: Vec<(String, String)>,
    /// A key of the handler's config table, `KEY=VALUE` (repeatable).
    #[arg(long = "config", value_parser = call::pair)]
    pub config: Vec<(String, String)>,
    /// Deliver all the messages in one `handle-batch` call.
    #[arg(long)]
    pub batch: bool,
    /// The call's timeout (limits.timeout), e.g. `2s`.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub timeout: Option<std::time::Duration>,
}

impl CallArgs {
    /// What `weir call` is asked, its payloads read.
    pub fn request(self) -> anyhow::Result<call::Request> {
        Ok(call::Request {
            payloads: call::payloads(self.payload.as_deref(), self.each.as_deref())?,
            component: self.component,
            message_type: self.message_type,
            group: self.group,
            tenant: self.tenant,
            headers: self.headers,
            config: self.config.into_iter().collect(),
            batch: self.batch,
            timeout: self.timeout,
        })
    }
}
