//! `weir handlers`: each handler's topology, tenant, running version (and
//! since when, made by what), and its canary, from the admin listeners of
//! one or more nodes (merged: a version that differs between nodes is
//! shown per node) or, in `postgres` and `nats-kv` modes, from the store.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, UNIX_EPOCH};

use anyhow::{Context as _, bail};

use weir::config;
use weir::registry::shared::Shared;

use crate::cli::status::{get_json, shared_store};

/// What `weir handlers` was asked.
#[derive(clap::Args)]
pub struct Request {
    /// A node's TOML config: its node.admin (with its admin_token unless
    /// --token is given), else in postgres or nats-kv mode its store.
    #[arg(long, required_unless_present = "admin")]
    pub config: Option<PathBuf>,
    /// A node's admin listener, e.g. `http://127.0.0.1:9464` (repeatable).
    #[arg(long)]
    pub admin: Vec<String>,
    /// The token of those listeners (or WEIR_TOKEN); a tenant's token sees its handlers.
    #[arg(long, env = "WEIR_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One handler as one source sees it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Row {
    pub name: String,
    pub topology: String,
    pub tenant: Option<String>,
    /// The running version (sha256, hex).
    pub version: String,
    /// Its activation's sequence number.
    pub seq: i64,
    /// When it was activated, ms since the Unix epoch.
    pub since_ms: i64,
    /// `config`, `admin`, `watch` or `rollback`.
    pub source: String,
    /// The canary running beside it: its version and slots.
    pub canary: Option<CanaryRow>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CanaryRow {
    pub version: String,
    pub slots: Vec<u32>,
}

/// A handler and the sources (nodes or the store) that see each version of it.
#[derive(Debug, serde::Serialize)]
pub struct Merged {
    #[serde(flatten)]
    pub row: Row,
    /// Every source and what it runs, when they disagree (empty: all agree).
    pub skew: Vec<(String, String)>,
}

fn row_of(h: &serde_json::Value) -> Option<Row> {
    let current = &h["current"];
    Some(Row {
        name: h["name"].as_str()?.to_owned(),
        topology: h["topology"].as_str().unwrap_or_default().to_owned(),
        tenant: h["tenant"].as_str().map(str::to_owned),
        version: current["digest"].as_str()?.to_owned(),
        seq: current["seq"].as_i64().unwrap_or_default(),
        since_ms: current["at_ms"].as_i64().unwrap_or_default(),
        source: current["source"].as_str().unwrap_or_default().to_owned(),
        canary: (!h["canary"].is_null()).then(|| CanaryRow {
            version: h["canary"]["digest"].as_str().unwrap_or_default().to_owned(),
            slots: h["canary"]["slots"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s.as_u64().and_then(|s| u32::try_from(s).ok()))
                .collect(),
        }),
    })
}

/// The handlers one admin listener serves (what its token may see).
pub fn from_admin(admin: &str, token: Option<&str>) -> anyhow::Result<Vec<Row>> {
    let list: serde_json::Value = get_json(admin, "/v1/handlers", token, "the handlers", "a list of handlers")?;
    Ok(list["handlers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(row_of)
        .collect())
}

/// Several sources' views as one list, by name; where the sources do not
/// run the same version (or canary), the newest activation is shown and
/// every source's version is listed under `skew`.
pub fn merge(views: Vec<(String, Vec<Row>)>) -> Vec<Merged> {
    let mut by: BTreeMap<String, Vec<(String, Row)>> = BTreeMap::new();
    for (source, rows) in views {
        for r in rows {
            by.entry(r.name.clone()).or_default().push((source.clone(), r));
        }
    }
    by.into_values()
        .filter_map(|seen| {
            let newest = seen.iter().map(|(_, r)| r).max_by_key(|r| (r.seq, r.since_ms))?.clone();
            let agree = seen
                .iter()
                .all(|(_, r)| r.version == newest.version && r.canary == newest.canary);
            let skew = if agree {
                Vec::new()
            } else {
                seen.iter().map(|(s, r)| (s.clone(), r.version.clone())).collect()
            };
            Some(Merged { row: newest, skew })
        })
        .collect()
}

fn short(digest: &str) -> &str {
    digest.get(..12).unwrap_or(digest)
}

fn since(ms: i64) -> String {
    u64::try_from(ms)
        .ok()
        .filter(|ms| *ms > 0)
        .map(|ms| humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms)).to_string())
        .unwrap_or_else(|| "-".to_owned())
}

/// The handlers as a table (and a line per source where versions differ).
pub fn render(list: &[Merged]) -> String {
    use std::fmt::Write as _;
    if list.is_empty() {
        return "no handlers\n".to_owned();
    }
    let rows: Vec<[String; 7]> = list
        .iter()
        .map(|m| {
            let r = &m.row;
            [
                r.name.clone(),
                r.topology.clone(),
                r.tenant.clone().unwrap_or_else(|| "-".to_owned()),
                format!("{} (#{})", short(&r.version), r.seq),
                since(r.since_ms),
                r.source.clone(),
                r.canary.as_ref().map_or_else(
                    || "-".to_owned(),
                    |c| {
                        let slots: Vec<String> = c.slots.iter().map(u32::to_string).collect();
                        format!("{} on slot(s) {}", short(&c.version), slots.join(","))
                    },
                ),
            ]
        })
        .collect();
    let head = ["handler", "topology", "tenant", "version", "since", "by", "canary"];
    let mut width: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: &[&str]| {
        let mut s = String::new();
        for (c, w) in cells.iter().zip(&width) {
            let _ = write!(s, "{c:<w$}  ");
        }
        out.push_str(s.trim_end());
        out.push('\n');
    };
    line(&mut out, &head);
    for (r, m) in rows.iter().zip(list) {
        line(&mut out, &r.iter().map(String::as_str).collect::<Vec<_>>());
        for (source, version) in &m.skew {
            let _ = writeln!(out, "  ! {source} runs {}", short(version));
        }
    }
    out
}

/// The handlers of a `postgres` or `nats-kv` cluster, from its store: the
/// config's handlers, each with its newest activation and live canary.
pub async fn from_store(store: &dyn Shared, cfg: &config::Config) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for h in &cfg.handler {
        let activations = store
            .activations(&h.name)
            .await
            .with_context(|| format!("reading the versions of handler `{}`", h.name))?;
        let Some(current) = activations.into_iter().max_by_key(|a| a.seq) else {
            continue;
        };
        let canary = store.live_canary(&h.name).await.ok().flatten().map(|c| CanaryRow {
            version: c.digest,
            slots: c.slots,
        });
        rows.push(Row {
            name: h.name.clone(),
            topology: h.topology.clone(),
            tenant: h.tenant.clone(),
            version: current.digest,
            seq: current.seq,
            since_ms: current.at_ms,
            source: current.source,
            canary,
        });
    }
    Ok(rows)
}

/// The merged view `req` asks for.
pub fn read(req: &Request) -> anyhow::Result<Vec<Merged>> {
    let mut admins = req.admin.clone();
    let mut token = req.token.clone();
    if admins.is_empty() {
        let Some(path) = &req.config else {
            bail!(
                "say where to look: --config FILE (a node with node.admin, or postgres or nats-kv mode) or --admin URL"
            );
        };
        let cfg = config::load(path)?;
        match cfg.node.admin {
            Some(addr) => {
                admins.push(format!("http://{addr}"));
                token = token.or_else(|| cfg.node.admin_token.clone());
            }
            None if cfg.cluster.leased() => {
                let rows = crate::cli::runtime()?.block_on(async {
                    match shared_store(&cfg).await? {
                        Some(store) => from_store(store.as_ref(), &cfg).await,
                        None => Ok(Vec::new()),
                    }
                })?;
                return Ok(merge(vec![("the store".to_owned(), rows)]));
            }
            None => bail!(
                "{}: cluster.mode = \"{}\" keeps no cluster-wide record, and this config has no node.admin to ask; \
                 ask the nodes themselves: weir handlers --admin URL [--admin URL …] --token TOKEN",
                cfg.origin,
                cfg.cluster.mode.as_str()
            ),
        }
    }
    let views = admins
        .iter()
        .map(|a| Ok((a.clone(), from_admin(a, token.as_deref())?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(merge(views))
}

pub fn run(req: Request) -> anyhow::Result<ExitCode> {
    let list = read(&req)?;
    if req.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "handlers": list }))?
        );
    } else {
        print!("{}", render(&list));
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, version: &str, seq: i64) -> Row {
        Row {
            name: name.into(),
            topology: "t".into(),
            tenant: None,
            version: version.into(),
            seq,
            since_ms: 1_700_000_000_000 + seq,
            source: "config".into(),
            canary: None,
        }
    }

    #[test]
    fn nodes_that_agree_show_one_row_and_a_skew_names_every_node() {
        let merged = merge(vec![
            ("a".into(), vec![row("orders", "aaaa", 1), row("users", "cccc", 1)]),
            ("b".into(), vec![row("orders", "bbbb", 2), row("users", "cccc", 1)]),
        ]);
        assert_eq!(merged.len(), 2);
        assert_eq!(merged[0].row.version, "bbbb", "the newest activation");
        assert_eq!(
            merged[0].skew,
            vec![("a".into(), "aaaa".into()), ("b".into(), "bbbb".into())]
        );
        assert!(merged[1].skew.is_empty());
        let text = render(&merged);
        assert!(text.starts_with("handler"), "{text}");
        assert!(text.contains("  ! a runs aaaa"), "{text}");
        assert!(text.contains("2023-11-14T22:13:20Z"), "{text}");
    }
}
