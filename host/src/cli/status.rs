//! `weir status`: the cluster's slots (owner, epoch, state, lag, consumers,
//! calls in flight) and nodes, from the coordinator database (`postgres`)
//! or bucket (`nats-kv`) or from the admin listeners of one or more nodes in any mode;
//! unowned slots in red; `--watch` redraws it.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, bail};

use weir::cluster::status::Status;
use weir::cluster::{nats_kv, postgres};
use weir::config::{self, ClusterMode};
use weir::registry::canary;
use weir::registry::kv::Buckets;
use weir::registry::shared::Shared;
use weir::registry::store::pg::Database;

use crate::cli::handlers;

/// What `weir status` was asked.
pub struct Request {
    pub config: Option<PathBuf>,
    pub admin: Vec<String>,
    pub token: Option<String>,
    pub json: bool,
    pub watch: Option<Duration>,
}

/// One node's view, from its admin listener.
fn from_admin(admin: &str, token: Option<&str>) -> anyhow::Result<Status> {
    get_json(admin, "/v1/slots", token, "the slots", "a status")
}

/// `GET path` of the admin listener at `admin` (with `token`), as JSON;
/// the errors say what to fix. `what`: what a tenant token is refused
/// (`the slots`); `shape`: what the answer should have been.
pub fn get_json<T: serde::de::DeserializeOwned>(
    admin: &str,
    path: &str,
    token: Option<&str>,
    what: &str,
    shape: &str,
) -> anyhow::Result<T> {
    let base = admin.trim_end_matches('/');
    let url = if base.contains("://") {
        format!("{base}{path}")
    } else {
        format!("http://{base}{path}")
    };
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into();
    let mut req = agent.get(&url);
    if let Some(t) = token {
        req = req.header("Authorization", &format!("Bearer {t}"));
    }
    let resp = req.call().with_context(|| {
        format!("cannot reach the admin listener at {admin} (is the node running with node.admin set?)")
    })?;
    let status = resp.status();
    let text = resp
        .into_body()
        .read_to_string()
        .with_context(|| format!("reading the answer of {url}"))?;
    if !status.is_success() {
        let hint = match status.as_u16() {
            401 => " (give the operator token: --token or WEIR_TOKEN)".to_owned(),
            403 => format!(" ({what} are for the operator's token, not a tenant's)"),
            _ => String::new(),
        };
        // The admin API's errors are `{"error": "…"}`: the sentence, not the JSON.
        let said = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_owned))
            .unwrap_or_else(|| text.trim().to_owned());
        bail!("{url} answered {status}: {said}{hint}");
    }
    serde_json::from_str(&text).with_context(|| format!("{url} did not answer {shape}: {text}"))
}

/// The running canaries as `GET /v1/handlers` shows them (those with a
/// `canary`), from the first admin listener that answers.
fn canaries_from_admin(admins: &[String], token: Option<&str>) -> Vec<Canary> {
    for a in admins {
        match get_json::<serde_json::Value>(a, "/v1/handlers", token, "the handlers", "a list of handlers") {
            Ok(list) => {
                return list["handlers"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|h| {
                        Some(Canary {
                            handler: h["name"].as_str()?.to_owned(),
                            canary: Some(h["canary"].clone()).filter(|c| !c.is_null())?,
                        })
                    })
                    .collect();
            }
            Err(e) => tracing::warn!(admin = %a, error = %format!("{e:#}"), "cannot read the handlers' canaries"),
        }
    }
    Vec::new()
}

/// A running canary and its comparison with the stable version.
#[derive(serde::Serialize)]
struct Canary {
    handler: String,
    #[serde(flatten)]
    canary: serde_json::Value,
}

/// The canaries as a table below the slots.
fn render_canaries(list: &[Canary]) -> String {
    use std::fmt::Write as _;
    if list.is_empty() {
        return String::new();
    }
    let pct = |v: &serde_json::Value| v.as_f64().map_or("-".to_owned(), |r| format!("{:.1}%", r * 100.0));
    let ms = |v: &serde_json::Value| v.as_f64().map_or("-".to_owned(), |m| format!("{m:.2}"));
    let mut out =
        String::from("\ncanaries (since each began; scope: cluster = every node's calls, node = one node's)\n");
    let _ = writeln!(
        out,
        "{:<16} {:<8} {:<14} {:<12} {:>8} {:>9} {:>8} {:>9} {:>9}",
        "handler", "side", "version", "slots", "settled", "handled", "retry", "dead-let", "mean ms"
    );
    for c in list {
        let v = &c.canary;
        let slots: Vec<String> = v["slots"]
            .as_array()
            .map(|a| a.iter().map(|s| s.to_string()).collect())
            .unwrap_or_default();
        for side in ["canary", "stable"] {
            let x = &v["compare"][side];
            let on = if side == "canary" {
                slots.join(",")
            } else {
                "the others".to_owned()
            };
            let _ = writeln!(
                out,
                "{:<16} {:<8} {:<14} {:<12} {:>8} {:>9} {:>8} {:>9} {:>9}",
                c.handler,
                side,
                x["digest"].as_str().unwrap_or("").chars().take(12).collect::<String>(),
                on,
                x["settled"],
                pct(&x["handled_rate"]),
                pct(&x["retry_rate"]),
                pct(&x["dead_letter_rate"]),
                ms(&x["mean_call_ms"]),
            );
        }
        let th = &v["thresholds"];
        let absolute = th["mode"] == "absolute";
        let mut rules = Vec::new();
        for (k, what) in [("max_dead_letter_rate", "dead-letter"), ("max_retry_rate", "retry")] {
            if let Some(r) = th[k].as_f64() {
                rules.push(if absolute {
                    format!("{what} rate > {r} (absolute)")
                } else {
                    format!("{what} rate > stable's + {r}")
                });
            }
        }
        let _ = writeln!(
            out,
            "{:<16} rolls back by itself on: {} (scope {})",
            "",
            if rules.is_empty() {
                "nothing (no threshold)".to_owned()
            } else {
                rules.join(" or ")
            },
            v["compare"]["scope"].as_str().unwrap_or("?")
        );
    }
    out
}

/// The handlers' versions the nodes at `admins` run, merged (a node that
/// cannot say is left out, with a warning).
fn versions_from_admin(admins: &[String], token: Option<&str>) -> Vec<handlers::Merged> {
    let views = admins
        .iter()
        .filter_map(|a| match handlers::from_admin(a, token) {
            Ok(rows) => Some((a.clone(), rows)),
            Err(e) => {
                tracing::warn!(admin = %a, error = %format!("{e:#}"), "cannot read the handlers' versions");
                None
            }
        })
        .collect();
    handlers::merge(views)
}

/// What `weir status` shows: the slots, the running canaries, and the
/// version each handler runs.
type View = (Status, Vec<Canary>, Vec<handlers::Merged>);

/// The cluster once, and its running canaries when a node was asked.
fn read(req: &Request) -> anyhow::Result<View> {
    if !req.admin.is_empty() {
        let views = req
            .admin
            .iter()
            .map(|a| from_admin(a, req.token.as_deref()))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let canaries = canaries_from_admin(&req.admin, req.token.as_deref());
        let versions = versions_from_admin(&req.admin, req.token.as_deref());
        return Ok((Status::merge(views), canaries, versions));
    }
    let Some(path) = &req.config else {
        bail!("say where to look: --config FILE (postgres or nats-kv mode, or a node with node.admin) or --admin URL");
    };
    let cfg = config::load(path)?;
    if !cfg.cluster.leased() {
        let Some(addr) = cfg.node.admin else {
            bail!(
                "{}: cluster.mode = \"{}\" keeps no cluster-wide record, and this config has no node.admin to ask; \
                 ask the nodes themselves: weir status --admin URL [--admin URL …] --token TOKEN",
                cfg.origin,
                cfg.cluster.mode.as_str()
            );
        };
        let token = req.token.clone().or_else(|| cfg.node.admin_token.clone());
        let admin = format!("http://{addr}");
        let status = from_admin(&admin, token.as_deref())?;
        let canaries = canaries_from_admin(std::slice::from_ref(&admin), token.as_deref());
        let versions = versions_from_admin(std::slice::from_ref(&admin), token.as_deref());
        return Ok((status, canaries, versions));
    }
    crate::cli::runtime()?.block_on(from_store(&cfg))
}

/// The view of a `postgres` or `nats-kv` cluster: its record, the broker's backlog per slot,
/// and the handlers' versions and canaries from the store.
async fn from_store(cfg: &config::Config) -> anyhow::Result<View> {
    let mut status = if cfg.cluster.mode == ClusterMode::NatsKv {
        let kv = nats_kv::NatsKv::open(
            &cfg.transport.urls(),
            "weir status",
            cfg.cluster.bucket(),
            cfg.transport.replicas(),
        )
        .await
        .with_context(|| {
            format!(
                "{}: cluster.bucket {:?} on transport.url",
                cfg.origin,
                cfg.cluster.bucket()
            )
        })?;
        nats_kv::status(&kv, cfg.cluster.lease).await?
    } else {
        let url = cfg.cluster.database_url.clone().unwrap_or_default();
        let pool = postgres::connect(&url)
            .await
            .with_context(|| format!("{}: cluster.database_url", cfg.origin))?;
        postgres::status::status(&pool).await?
    };
    let versions = shared_store(cfg).await?;
    slot_backlogs(cfg, &mut status).await?;
    let (mut canaries, mut running) = (Vec::new(), Vec::new());
    if let Some(versions) = versions {
        match handlers::from_store(versions.as_ref(), cfg).await {
            Ok(rows) => running = handlers::merge(vec![("the store".to_owned(), rows)]),
            Err(e) => tracing::warn!(error = %format!("{e:#}"), "cannot read the handlers' versions"),
        }
        canaries = canaries_in_store(cfg, versions.as_ref()).await?;
    }
    Ok((status, canaries, running))
}

/// Lag and consumers per slot from the broker; a broker that cannot answer leaves them unknown.
async fn slot_backlogs(cfg: &config::Config, status: &mut Status) -> anyhow::Result<()> {
    let transport = weir::transport::connect::for_config(cfg)?;
    for s in &mut status.slots {
        let (lag, consumers) = tokio::join!(
            transport.backlog(&s.topology, s.slot),
            transport.consumers(&s.topology, s.slot)
        );
        match (lag, consumers) {
            (Ok(lag), Ok(consumers)) => {
                s.lag = lag;
                s.consumers = consumers;
            }
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(topology = %s.topology, slot = s.slot, error = %e, "cannot read the slot's backlog");
                break;
            }
        }
    }
    Ok(())
}

/// The running canaries and the cluster's comparison, from the store.
async fn canaries_in_store(cfg: &config::Config, versions: &dyn Shared) -> anyhow::Result<Vec<Canary>> {
    let handlers: Vec<(String, u32)> = cfg
        .handler
        .iter()
        .map(|h| {
            let slots = cfg
                .topology
                .iter()
                .find(|t| t.name == h.topology)
                .map_or(1, |t| t.slots);
            (h.name.clone(), slots)
        })
        .collect();
    let mut canaries = Vec::new();
    match canary::in_store(versions, &handlers).await {
        Ok(list) => {
            for (handler, view) in list {
                canaries.push(Canary {
                    handler,
                    canary: serde_json::to_value(view)?,
                });
            }
        }
        Err(e) => tracing::warn!(error = %format!("{e:#}"), "cannot read the running canaries"),
    }
    Ok(canaries)
}

/// The store of handler versions of a `postgres` or `nats-kv` cluster
/// (`None`: a `nats-kv` cluster that has stored no version yet).
pub async fn shared_store(cfg: &config::Config) -> anyhow::Result<Option<Box<dyn Shared>>> {
    if cfg.cluster.mode == ClusterMode::NatsKv {
        let client = weir::transport::nats::connect(&cfg.transport.urls(), "weir").await?;
        Ok(
            Buckets::existing(&async_nats::jetstream::new(client), cfg.cluster.bucket())
                .await?
                .map(|b| Box::new(b) as Box<dyn Shared>),
        )
    } else {
        let url = cfg.cluster.database_url.clone().unwrap_or_default();
        let pool = postgres::connect(&url)
            .await
            .with_context(|| format!("{}: cluster.database_url", cfg.origin))?;
        Ok(Some(Box::new(Database(pool))))
    }
}

/// Print it (and again every `watch`).
pub fn run(req: Request) -> anyhow::Result<ExitCode> {
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let colour = terminal && std::env::var_os("NO_COLOR").is_none();
    loop {
        let (status, canaries, versions) = read(&req)?;
        let text = if req.json {
            let mut v = serde_json::to_value(&status)?;
            v["canaries"] = serde_json::to_value(&canaries)?;
            v["handlers"] = serde_json::to_value(&versions)?;
            format!("{}\n", serde_json::to_string_pretty(&v)?)
        } else {
            let mut text = status.render(colour);
            if !versions.is_empty() {
                text.push_str("\nhandlers\n");
                text.push_str(&handlers::render(&versions));
            }
            text + &render_canaries(&canaries)
        };
        match req.watch {
            None => {
                print!("{text}");
                return Ok(ExitCode::SUCCESS);
            }
            Some(every) => {
                if terminal {
                    // Clear the screen and go home, then the new table.
                    print!("\x1b[2J\x1b[H");
                }
                let now = time::OffsetDateTime::now_utc()
                    .format(&time::format_description::well_known::Rfc3339)
                    .unwrap_or_default();
                println!("{now}  (every {}; Ctrl-C stops)", humantime::format_duration(every));
                print!("{text}");
                std::thread::sleep(every);
            }
        }
    }
}
