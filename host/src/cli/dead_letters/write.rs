//! `weir dead-letters redrive|purge`: moving letters back, and deleting them.

use std::process::ExitCode;

use anyhow::bail;

use weir::config::{self, Config};
use weir::deadletter::{self, Filter, LetterView, PinCheck};
use weir::router::Router;

use super::read::{cell, table};
use super::*;

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

pub(super) async fn redrive(
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
        redrive_text(&mut o, &report, t.transport.system());
    }
    emit(&o);
    Ok(match report.stopped {
        Some(_) => ExitCode::FAILURE,
        None => ExitCode::SUCCESS,
    })
}

/// What `weir dead-letters redrive` says of `report`, for people.
fn redrive_text(o: &mut String, report: &deadletter::RedriveReport, system: &str) {
    let n = report.letters.len();
    let pinned = report
        .pinned
        .as_deref()
        .map(|p| format!(", pinned to version {p}"))
        .unwrap_or_default();
    if report.dry_run {
        outln!(
            *o,
            "dry run: would redrive {n} of {} dead letter(s) of topology `{}` on {} ({} group(s)){pinned}, in this order:",
            report.read,
            report.topology,
            system,
            report.groups
        );
    } else {
        outln!(
            *o,
            "redrove {} of {n} selected dead letter(s) of topology `{}` on {} ({} group(s)){pinned}; each was \
             re-published to its slot (confirmed) before it was removed",
            report.moved,
            report.topology,
            system,
            report.groups
        );
    }
    if report.dry_run {
        for m in &report.letters {
            outln!(
                *o,
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
        outln!(*o, "nothing was sent or removed");
    }
    if let Some(why) = &report.stopped {
        outln!(*o, "stopped: {why}");
    }
}

pub(super) async fn purge(common: &Common, filter: Filter, dry_run: bool) -> anyhow::Result<ExitCode> {
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
