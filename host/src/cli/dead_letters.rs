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
use weir::deadletter::{self, Filter, LetterView, PinCheck, Progress, Selection};
use weir::router::Router;
use weir::transport::{TopologySpec, Transport};

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

fn cell(v: Option<&str>) -> &str {
    v.unwrap_or("-")
}

/// `failed at` to the second: `2025-03-01T12:00:01Z`.
fn when(v: Option<&str>) -> String {
    match v.and_then(|t| humantime::parse_rfc3339_weak(t).ok()) {
        Some(t) => humantime::format_rfc3339_seconds(t).to_string(),
        None => cell(v).to_owned(),
    }
}

fn cut(text: &str, max: usize) -> String {
    let line = text.lines().next().unwrap_or_default();
    if line.len() <= max && line.len() == text.len() {
        return line.to_owned();
    }
    let mut at = max.min(line.len());
    while !line.is_char_boundary(at) {
        at -= 1;
    }
    format!("{}…", &line[..at])
}

fn table(views: &[LetterView]) -> String {
    use std::fmt::Write as _;
    let rows: Vec<[String; 9]> = views
        .iter()
        .map(|v| {
            [
                format!("#{}", v.position),
                when(v.failed_at.as_deref()),
                cell(v.reason.as_deref()).to_owned(),
                cell(v.message_type.as_deref()).to_owned(),
                cell(v.group.as_deref()).to_owned(),
                cell(v.tenant.as_deref()).to_owned(),
                cell(v.handler.as_deref()).to_owned(),
                v.redrive_count.to_string(),
                cell(v.message_id.as_deref()).to_owned(),
            ]
        })
        .collect();
    let head = [
        "pos",
        "failed at",
        "reason",
        "type",
        "group",
        "tenant",
        "handler",
        "redrives",
        "message id",
    ];
    let mut width: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: &[&str]| {
        let mut s = String::from(" ");
        for (c, w) in cells.iter().zip(&width) {
            let _ = write!(s, " {c:<w$}");
        }
        out.push_str(s.trim_end());
        out.push('\n');
    };
    line(&mut out, &head);
    for (r, v) in rows.iter().zip(views) {
        line(&mut out, &r.iter().map(String::as_str).collect::<Vec<_>>());
        if let Some(e) = &v.error {
            let _ = writeln!(out, "        error: {}", cut(e, ERROR_SHOWN));
        }
    }
    out
}

/// The topology's letters that match `filter` (the first `limit` of them,
/// `full`: with headers and payload), with how many were read and matched.
async fn read_views(
    common: &Common,
    filter: &Filter,
    limit: Option<usize>,
    full: bool,
) -> anyhow::Result<(Target, Vec<LetterView>, u64, usize)> {
    let t = target(common).await?;
    let (bar, progress) = bar();
    let selection = select(&t, filter, &progress).await?;
    bar.finish_and_clear();
    let views: Vec<LetterView> = selection
        .selected
        .iter()
        .take(limit.unwrap_or(usize::MAX))
        .map(|l| LetterView::of(l, t.slots, full))
        .collect();
    let (read, matched) = (selection.read, selection.selected.len());
    selection.close().await;
    Ok((t, views, read, matched))
}

async fn list(common: &Common, filter: Filter, limit: Option<usize>) -> anyhow::Result<ExitCode> {
    let mut o = String::new();
    let (t, views, read, matched) = read_views(common, &filter, limit, false).await?;
    if common.json {
        let out = serde_json::json!({
            "topology": t.name, "system": t.transport.system(), "read": read, "matched": matched, "letters": views,
        });
        outln!(o, "{}", serde_json::to_string_pretty(&out)?);
        emit(&o);
        return Ok(ExitCode::SUCCESS);
    }
    let shown = if views.len() < matched {
        format!(" (the first {} shown; --limit N or --all for more)", views.len())
    } else {
        String::new()
    };
    outln!(
        o,
        "topology `{}` on {}: {matched} of {read} dead letter(s) match{shown}",
        t.name,
        t.transport.system()
    );
    if !views.is_empty() {
        out!(o, "{}", table(&views));
    }
    emit(&o);
    Ok(ExitCode::SUCCESS)
}

/// One column of a summary: (value, letters), most letters first, then by
/// value; beyond `top` rows the rest are summed into one "others" row.
fn tally<'a>(values: impl Iterator<Item = Option<&'a str>>, top: usize) -> Vec<(String, usize)> {
    let mut counts: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for v in values {
        *counts.entry(v.unwrap_or("-")).or_default() += 1;
    }
    let mut rows: Vec<(String, usize)> = counts.into_iter().map(|(k, n)| (k.to_owned(), n)).collect();
    rows.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    if rows.len() > top {
        let others: usize = rows[top..].iter().map(|r| r.1).sum();
        let kinds = rows.len() - top;
        rows.truncate(top);
        rows.push((format!("({kinds} others)"), others));
    }
    rows
}

async fn summary(common: &Common, filter: Filter, top: usize) -> anyhow::Result<ExitCode> {
    let mut o = String::new();
    let (t, views, read, matched) = read_views(common, &filter, None, false).await?;
    let top = top.max(1);
    let columns: [(&str, Vec<(String, usize)>); 4] = [
        ("reason", tally(views.iter().map(|v| v.reason.as_deref()), top)),
        ("handler", tally(views.iter().map(|v| v.handler.as_deref()), top)),
        ("type", tally(views.iter().map(|v| v.message_type.as_deref()), top)),
        ("group", tally(views.iter().map(|v| v.group.as_deref()), top)),
    ];
    let oldest = views.iter().filter_map(|v| v.failed_at.as_deref()).min();
    let newest = views.iter().filter_map(|v| v.failed_at.as_deref()).max();
    if common.json {
        let mut by = serde_json::Map::new();
        for (name, rows) in &columns {
            let rows: Vec<serde_json::Value> = rows
                .iter()
                .map(|(k, n)| serde_json::json!({ "value": k, "letters": n }))
                .collect();
            by.insert((*name).to_owned(), rows.into());
        }
        let out = serde_json::json!({
            "topology": t.name, "system": t.transport.system(), "read": read, "matched": matched,
            "oldest": oldest, "newest": newest, "by": by,
        });
        outln!(o, "{}", serde_json::to_string_pretty(&out)?);
        emit(&o);
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        o,
        "topology `{}` on {}: {matched} of {read} dead letter(s) match",
        t.name,
        t.transport.system()
    );
    if let (Some(a), Some(b)) = (oldest, newest) {
        outln!(o, "  captured {} .. {}", when(Some(a)), when(Some(b)));
    }
    for (name, rows) in &columns {
        if rows.is_empty() {
            continue;
        }
        let width = rows.iter().map(|r| r.0.chars().count()).max().unwrap_or(0);
        outln!(o, "\nby {name}:");
        for (k, n) in rows {
            outln!(o, "  {k:<width$}  {n:>7}");
        }
    }
    emit(&o);
    Ok(ExitCode::SUCCESS)
}

async fn show(common: &Common, filter: Filter) -> anyhow::Result<ExitCode> {
    let mut o = String::new();
    let (t, views, read, _) = read_views(common, &filter, None, true).await?;
    if common.json {
        outln!(o, "{}", serde_json::to_string_pretty(&views)?);
    } else if views.is_empty() {
        outln!(
            o,
            "topology `{}` on {}: none of {read} dead letter(s) is {}",
            t.name,
            t.transport.system(),
            filter.ids.join(" or ")
        );
    }
    if !common.json {
        for v in &views {
            outln!(
                o,
                "dead letter #{} of topology `{}` ({})",
                v.position,
                t.name,
                t.transport.system()
            );
            for (k, value) in v.headers.iter().flatten() {
                outln!(o, "  {k}: {value}");
            }
            if let Some(p) = &v.payload {
                outln!(o, "  payload ({} bytes, {}):", v.payload_bytes, p.encoding);
                for l in p.data.lines() {
                    outln!(o, "    {l}");
                }
            }
            outln!(o, "  redrive would send it to slot {}", v.slot);
        }
    }
    emit(&o);
    Ok(if views.is_empty() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// A pin checked against the store the config names, as a node started
/// from it would find its versions.
struct StoredPins<'a> {
    cfg: &'a Config,
    router: Router,
    database: Option<sqlx::PgPool>,
}

#[async_trait::async_trait]
impl PinCheck for StoredPins<'_> {
    async fn check(
        &self,
        topology: &str,
        tenant: Option<&str>,
        message_type: &str,
        digest: &str,
    ) -> Result<String, String> {
        let probe = weir::envelope::new_message(
            String::new(),
            message_type,
            None,
            tenant.map(str::to_owned),
            Vec::new(),
            Vec::new(),
        );
        let handler = self.router.handler_name(topology, &probe).ok_or_else(|| {
            format!(
                "no [[handler]] of {} takes message type `{message_type}` (tenant {}) in topology `{topology}`, so no \
                 version of one can be pinned",
                self.cfg.origin,
                tenant.unwrap_or("none")
            )
        })?;
        weir::registry::pin::stored(self.cfg, self.database.as_ref(), handler, digest)
            .await
            .map(|()| handler.to_owned())
            .map_err(|e| format!("handler `{handler}`: {e}"))
    }
}

async fn redrive(
    common: &Common,
    filter: Filter,
    dry_run: bool,
    handler_version: Option<String>,
) -> anyhow::Result<ExitCode> {
    let mut o = String::new();
    if let Some(pin) = &handler_version
        && !deadletter::is_digest(pin)
    {
        bail!("--handler-version {pin:?} is not a component digest; accepted: the 64 hex digits of a version's sha256");
    }
    let t = target(common).await?;
    let (bar, progress) = bar();
    let database = match t.cfg.cluster.mode {
        config::ClusterMode::Postgres => {
            let url = t.cfg.cluster.database_url.clone().unwrap_or_default();
            Some(weir::cluster::postgres::connect(&url).await?)
        }
        _ => None,
    };
    // A redrive's count, provenance and pin are sealed with the key the
    // cluster's nodes share; without one, a node would not honour them.
    let shared_key = weir::seal::key::shared(&t.cfg);
    if !shared_key && handler_version.is_some() {
        bail!(
            "refused, nothing was moved: --handler-version needs the sealing key the nodes share, and {} gives none \
             (no node.data_dir, cluster.seal_key_file or coordinated cluster.mode); redrive through the node's admin \
             API instead (POST /v1/dead-letters/redrive?handler_version=…)",
            t.cfg.origin
        );
    }
    let seal = weir::seal::key::load(&t.cfg, database.as_ref()).await?;
    let selection = select(&t, &filter, &progress).await?;
    if let Some(pin) = &handler_version {
        let check = StoredPins {
            cfg: &t.cfg,
            router: weir::router::Router::from_config(&t.cfg)?,
            database,
        };
        if let Err(why) = deadletter::check_pin(&t.name, &selection.selected, pin, &check).await {
            selection.close().await;
            bar.finish_and_clear();
            bail!("refused, nothing was moved: --handler-version {pin} cannot be honoured: {why}");
        }
    }
    let pin = handler_version.as_deref();
    let report = if dry_run {
        selection.dry_run(t.slots, pin).await
    } else {
        if !shared_key {
            eprintln!(
                "note: {} gives no sealing key the nodes share, so they will keep this redrive's count and provenance \
                 as untrusted-weir-* headers; redrive through a node's admin API to keep them as Weir's",
                t.cfg.origin
            );
        }
        selection
            .redrive(t.transport.as_ref(), &seal, t.slots, pin, &progress)
            .await
    };
    bar.finish_and_clear();
    if common.json {
        outln!(o, "{}", serde_json::to_string_pretty(&report)?);
    } else {
        let n = report.letters.len();
        let pinned = report
            .pinned
            .as_deref()
            .map(|p| format!(", pinned to version {p}"))
            .unwrap_or_default();
        if report.dry_run {
            outln!(
                o,
                "dry run: would redrive {n} of {} dead letter(s) of topology `{}` on {} ({} group(s)){pinned}, in this order:",
                report.read,
                report.topology,
                t.transport.system(),
                report.groups
            );
        } else {
            outln!(
                o,
                "redrove {} of {n} selected dead letter(s) of topology `{}` on {} ({} group(s)){pinned}; each was \
                 re-published to its slot (confirmed) before it was removed",
                report.moved,
                report.topology,
                t.transport.system(),
                report.groups
            );
        }
        if report.dry_run {
            for m in &report.letters {
                outln!(
                    o,
                    "  #{:<5} {}  group {}  tenant {}  type {}  {}  -> slot {}",
                    m.position,
                    cell(m.message_id.as_deref()),
                    cell(m.group.as_deref()),
                    cell(m.tenant.as_deref()),
                    cell(m.message_type.as_deref()),
                    cell(m.reason.as_deref()),
                    m.slot
                );
            }
            outln!(o, "nothing was sent or removed");
        }
        if let Some(why) = &report.stopped {
            outln!(o, "stopped: {why}");
        }
    }
    emit(&o);
    Ok(match report.stopped {
        Some(_) => ExitCode::FAILURE,
        None => ExitCode::SUCCESS,
    })
}

async fn purge(common: &Common, filter: Filter, dry_run: bool) -> anyhow::Result<ExitCode> {
    let mut o = String::new();
    let t = target(common).await?;
    let (bar, progress) = bar();
    let selection = select(&t, &filter, &progress).await?;
    let views: Vec<LetterView> = selection
        .selected
        .iter()
        .map(|l| LetterView::of(l, t.slots, false))
        .collect();
    let report = selection.purge(dry_run, &progress).await;
    bar.finish_and_clear();
    if common.json {
        outln!(o, "{}", serde_json::to_string_pretty(&report)?);
    } else if dry_run {
        outln!(
            o,
            "dry run: would purge {} of {} dead letter(s) of topology `{}` on {}:",
            report.selected,
            report.read,
            report.topology,
            t.transport.system()
        );
        if !views.is_empty() {
            out!(o, "{}", table(&views));
        }
        outln!(o, "nothing was removed");
    } else {
        outln!(
            o,
            "purged {} of {} selected dead letter(s) of topology `{}` on {}",
            report.purged,
            report.selected,
            report.topology,
            t.transport.system()
        );
        if let Some(why) = &report.stopped {
            outln!(o, "stopped: {why}");
        }
    }
    emit(&o);
    Ok(match report.stopped {
        Some(_) => ExitCode::FAILURE,
        None => ExitCode::SUCCESS,
    })
}
