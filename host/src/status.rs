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
use weir::node;

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
        bail!("{url} answered {status}: {}{hint}", text.trim());
    }
    serde_json::from_str(&text).with_context(|| format!("{url} did not answer {shape}: {text}"))
}

/// The cluster once.
fn read(req: &Request) -> anyhow::Result<Status> {
    if !req.admin.is_empty() {
        let views = req
            .admin
            .iter()
            .map(|a| from_admin(a, req.token.as_deref()))
            .collect::<anyhow::Result<Vec<_>>>()?;
        return Ok(Status::merge(views));
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
        return from_admin(&format!("http://{addr}"), token.as_deref());
    }
    crate::runtime()?.block_on(async {
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
        // Lag and consumers per slot from the broker; a broker that cannot answer leaves them unknown.
        let transport = node::transport_for(&cfg)?;
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
        anyhow::Ok(status)
    })
}

/// Print it (and again every `watch`).
pub fn run(req: Request) -> anyhow::Result<ExitCode> {
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let colour = terminal && std::env::var_os("NO_COLOR").is_none();
    loop {
        let status = read(&req)?;
        let text = if req.json {
            format!("{}\n", serde_json::to_string_pretty(&status)?)
        } else {
            status.render(colour)
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
