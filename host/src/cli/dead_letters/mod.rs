//! `weir dead-letters list|show|redrive|purge --config FILE`: the dead-letter
//! tools on the configured broker, for people (tables, progress) or
//! scripts (`--json`). The logic is `weir::deadletter`; this file parses,
//! checks a pin against the config's store, and prints.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::SystemTime;

use anyhow::{Context as _, bail};
use indicatif::{ProgressBar, ProgressStyle};

use weir::config::{self, Config};
use weir::deadletter::{self, Filter, Progress, Selection};
use weir::transport::{TopologySpec, Transport};

/// `writeln!` into the command's output (a `String`: writing to it cannot fail).
macro_rules! outln {
    ($o:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($o, $($arg)*);
    }};
}

/// `write!` into the command's output.
macro_rules! out {
    ($o:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = write!($o, $($arg)*);
    }};
}

// After the macros, which the submodules use.
mod read;
mod write;

use read::{list, show, summary};
use write::{purge, redrive};

/// From this many letters on, reading and moving show a progress bar.
const BAR_FROM: u64 = 500;

/// Letters `list` shows unless told `--limit` or `--all`.
const DEFAULT_LIMIT: usize = 50;

/// Longest error text a table row shows.
const ERROR_SHOWN: usize = 100;

#[derive(clap::Subcommand)]
pub enum Command {
    /// List the dead letters (in the order they were captured), with why
    /// each failed; every letter stays where it is.
    List {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        filter: FilterArgs,
        /// Show at most this many, the first captured (all are still counted).
        #[arg(long, default_value_t = DEFAULT_LIMIT, conflicts_with = "all")]
        limit: usize,
        /// Show every matching letter (no `--limit`).
        #[arg(long)]
        all: bool,
    },
    /// Show dead letters in full: every header and the payload.
    Show {
        #[command(flatten)]
        common: Common,
        /// Message ids (`weir-message-id`), or `#N` for the letter at position N.
        #[arg(value_name = "ID")]
        ids: Vec<String>,
        /// The same, as a flag (repeatable): `--id ID`.
        #[arg(long = "id", value_name = "ID")]
        id_flags: Vec<String>,
    },
    /// Count the dead letters by reason, handler, type and group (the most
    /// common first), so a pile of them reads as a few causes.
    Summary {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        filter: FilterArgs,
        /// Rows shown per column (the rest are summed as "others").
        #[arg(long, default_value_t = 10)]
        top: usize,
    },
    /// Send dead letters back to their group's slot, in the order they were
    /// captured, each removed only after the broker confirmed its re-publish.
    /// They restart at attempt 1 and carry `weir-redrive-count` and the old
    /// reason (`weir-redrive-reason`).
    Redrive {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        filter: FilterArgs,
        /// List what would move, and where, without moving anything.
        #[arg(long)]
        dry_run: bool,
        /// Run them on this version of their handler (its sha256, as
        /// `weir-handler-version` shows it); refused unless a node started
        /// from this config can load it.
        #[arg(long, value_name = "DIGEST")]
        handler_version: Option<String>,
    },
    /// Delete dead letters for good.
    Purge {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        filter: FilterArgs,
        /// List what would be deleted, without deleting.
        #[arg(long)]
        dry_run: bool,
        /// Really delete (required unless --dry-run).
        #[arg(long)]
        yes: bool,
    },
}

/// What every subcommand takes.
#[derive(clap::Args)]
pub struct Common {
    /// The node's TOML config (its transport and topologies).
    #[arg(long)]
    config: PathBuf,
    /// Topology name; defaults to the config's only topology.
    #[arg(long)]
    topology: Option<String>,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
}

/// Which letters (every one given must match).
#[derive(clap::Args)]
pub struct FilterArgs {
    /// `weir-dead-letter-reason`: rejected, exhausted, undecodable, no-handler, timeout or trap.
    #[arg(long)]
    reason: Option<String>,
    /// The handler that failed them (`weir-handler`).
    #[arg(long)]
    handler: Option<String>,
    /// Group id.
    #[arg(long)]
    group: Option<String>,
    /// Tenant id.
    #[arg(long)]
    tenant: Option<String>,
    /// Message type.
    #[arg(long = "type")]
    message_type: Option<String>,
    /// A message id, or `#N` for the letter at position N (repeatable).
    #[arg(long = "id")]
    ids: Vec<String>,
    /// Captured at or after: an RFC 3339 time, a date, or a duration back from now (`2h`).
    #[arg(long)]
    since: Option<String>,
    /// Captured before: as `--since`.
    #[arg(long)]
    until: Option<String>,
}

impl FilterArgs {
    fn filter(self) -> anyhow::Result<Filter> {
        let now = SystemTime::now();
        let time = |flag: &str, v: Option<String>| {
            v.map(|v| deadletter::parse_time(&v, now).map_err(|e| anyhow::anyhow!("{flag}: {e}")))
                .transpose()
        };
        let f = Filter {
            since: time("--since", self.since)?,
            until: time("--until", self.until)?,
            reason: self.reason,
            handler: self.handler,
            group: self.group,
            tenant: self.tenant,
            message_type: self.message_type,
            ids: self.ids,
        };
        f.validate().map_err(anyhow::Error::msg)?;
        Ok(f)
    }
}

/// The topology the command is about, and the transport, declared.
struct Target {
    cfg: Config,
    name: String,
    slots: u32,
    transport: std::sync::Arc<dyn Transport>,
}

async fn target(common: &Common) -> anyhow::Result<Target> {
    let cfg = config::load(&common.config)?;
    if cfg.transport.kind == config::TransportKind::Memory {
        bail!(
            "{}: transport.kind = \"memory\" keeps the dead letters inside the node's process; use that node's admin \
             API (GET /v1/dead-letters, POST /v1/dead-letters/redrive, POST /v1/dead-letters/purge)",
            cfg.origin
        );
    }
    let names: Vec<&str> = cfg.topology.iter().map(|t| t.name.as_str()).collect();
    let topo = match &common.topology {
        Some(name) => cfg
            .topology
            .iter()
            .find(|t| &t.name == name)
            .with_context(|| format!("--topology {name:?}: not in {}; accepted: {names:?}", cfg.origin))?,
        None => match cfg.topology.as_slice() {
            [only] => only,
            [] => bail!("{}: no [[topology]]", cfg.origin),
            _ => bail!(
                "{}: several topologies; choose one with --topology, accepted: {names:?}",
                cfg.origin
            ),
        },
    };
    let transport = weir::transport::connect::for_config(&cfg)?;
    transport
        .declare(&TopologySpec {
            name: topo.name.clone(),
            slots: topo.slots,
            retry: topo.retry_policy(cfg.transport.kind),
        })
        .await
        .with_context(|| format!("declaring topology `{}` on {}", topo.name, transport.system()))
        .map_err(|e| weir::transport::connect::unreachable(&cfg, transport.system(), e))?;
    let (name, slots) = (topo.name.clone(), topo.slots);
    Ok(Target {
        cfg,
        name,
        slots,
        transport,
    })
}

/// A progress bar on stderr (drawn only at a terminal) for long reads and moves.
fn bar() -> (ProgressBar, impl Fn(Progress) + Send + Sync) {
    let bar = ProgressBar::hidden();
    let shown = bar.clone();
    let style = |t: &str| ProgressStyle::with_template(t).unwrap_or_else(|_| ProgressStyle::default_bar());
    let update = move |p: Progress| {
        let (done, of, what) = match p {
            Progress::Read { done, of } => (done, of, "read"),
            Progress::Redriven { done, of } => (done, Some(of), "redriven"),
            Progress::Purged { done, of } => (done, Some(of), "purged"),
        };
        if of.unwrap_or(done) < BAR_FROM {
            return;
        }
        if shown.is_hidden() && done < of.unwrap_or(u64::MAX) {
            shown.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        }
        if shown.message() != what {
            shown.set_style(style(&format!(
                "{{bar:40}} {{pos}}/{{len}} {what}, {{per_sec}}, eta {{eta}}"
            )));
            shown.set_message(what);
            shown.reset();
        }
        shown.set_length(of.unwrap_or(done));
        shown.set_position(done);
    };
    (bar, update)
}

async fn select(t: &Target, filter: &Filter, progress: &(dyn Fn(Progress) + Send + Sync)) -> anyhow::Result<Selection> {
    let store = t
        .transport
        .dead_letters()
        .with_context(|| format!("the {} transport offers no dead-letter tools", t.transport.system()))?;
    deadletter::select(store, &t.name, filter, progress)
        .await
        .with_context(|| {
            format!(
                "reading the dead letters of topology `{}` on {}",
                t.name,
                t.transport.system()
            )
        })
}

/// Print the command's output. A reader that went away (`| head`) is no
/// error: the command's work is done by then.
fn emit(text: &str) {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush())
        && e.kind() != std::io::ErrorKind::BrokenPipe
    {
        tracing::warn!(error = %e, "writing the output failed");
    }
}

/// Run a `weir dead-letters` subcommand.
pub fn run(command: Command) -> anyhow::Result<ExitCode> {
    let rt = weir::sched::async_runtime().context("starting the async runtime")?;
    rt.block_on(async move {
        match command {
            Command::List {
                common,
                filter,
                limit,
                all,
            } => list(&common, filter.filter()?, (!all).then_some(limit)).await,
            Command::Summary { common, filter, top } => summary(&common, filter.filter()?, top).await,
            Command::Show {
                common,
                mut ids,
                id_flags,
            } => {
                ids.extend(id_flags);
                if ids.is_empty() {
                    bail!("`weir dead-letters show` needs the letters to show: message ids or `#N` positions, as arguments or with --id");
                }
                let filter = Filter {
                    ids,
                    ..Filter::default()
                };
                filter.validate().map_err(anyhow::Error::msg)?;
                show(&common, filter).await
            }
            Command::Redrive {
                common,
                filter,
                dry_run,
                handler_version,
            } => redrive(&common, filter.filter()?, dry_run, handler_version).await,
            Command::Purge {
                common,
                filter,
                dry_run,
                yes,
            } => {
                if !dry_run && !yes {
                    bail!(
                        "`weir dead-letters purge` deletes dead letters for good: add --yes to delete, or --dry-run to \
                         list what it would delete"
                    );
                }
                purge(&common, filter.filter()?, dry_run).await
            }
        }
    })
}
