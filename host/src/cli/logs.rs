//! `weir logs HANDLER`: a handler's recent log lines, failures and faults, from the admin
//! listeners of one or more nodes (each node keeps a bounded ring per handler), merged by
//! time; `--follow` keeps asking each node for what came after the last line it gave.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, UNIX_EPOCH};

use anyhow::bail;

use weir::config;
use weir::observe::logring::{Line, Source};

use crate::cli::status::get_json;

/// What `weir logs` was asked.
#[derive(clap::Args)]
pub struct Request {
    /// The handler's name.
    pub handler: String,
    /// A node's TOML config: its node.admin, with its admin_token unless --token is given.
    #[arg(long, required_unless_present = "admin")]
    pub config: Option<PathBuf>,
    /// A node's admin listener, e.g. `http://127.0.0.1:9464` (repeatable).
    #[arg(long)]
    pub admin: Vec<String>,
    /// The token of those listeners (or WEIR_TOKEN); a tenant's token sees its own handlers.
    #[arg(long, env = "WEIR_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Keep printing new lines as they come, until Ctrl-C.
    #[arg(long, short = 'f')]
    pub follow: bool,
    /// Lines per node, newest last (1 to 1000).
    #[arg(long, short = 'n', default_value_t = 100, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub limit: u16,
    /// One JSON object a line, each with its node.
    #[arg(long)]
    pub json: bool,
}

/// One node's answer.
#[derive(serde::Deserialize)]
struct Answer {
    node: String,
    lines: Vec<Line>,
    next: u64,
    missed: u64,
}

/// A line and the node it came from.
struct Seen {
    node: String,
    line: Line,
}

/// Where to ask: the `--admin` listeners, else the config's `node.admin` (and its token).
fn targets(req: &Request) -> anyhow::Result<(Vec<String>, Option<String>)> {
    if !req.admin.is_empty() {
        return Ok((req.admin.clone(), req.token.clone()));
    }
    let Some(path) = &req.config else {
        bail!("say where to look: --admin URL (repeatable) or --config FILE (a node with node.admin)");
    };
    let cfg = config::load(path)?;
    let Some(addr) = cfg.node.admin else {
        bail!(
            "{}: this config has no node.admin, and a handler's log lines are kept by the nodes: \
             set node.admin, or ask a node with --admin URL",
            cfg.origin
        );
    };
    Ok((
        vec![format!("http://{addr}")],
        req.token.clone().or_else(|| cfg.node.admin_token.clone()),
    ))
}

/// Lines merged by time, and (node, lines missed) for each node that missed some.
type Polled = (Vec<Seen>, Vec<(String, u64)>);

/// Ask every node for its lines after `after[i]`.
fn poll(req: &Request, admins: &[String], token: Option<&str>, after: &mut [u64]) -> anyhow::Result<Polled> {
    let mut seen = Vec::new();
    let mut missed = Vec::new();
    for (admin, after) in admins.iter().zip(after.iter_mut()) {
        let path = format!(
            "/v1/handlers/{}/logs?after={after}&limit={}",
            form_urlencoded::byte_serialize(req.handler.as_bytes()).collect::<String>(),
            req.limit
        );
        let a: Answer = get_json(admin, &path, token, "the handler's logs", "a page of log lines")?;
        *after = a.next;
        if a.missed > 0 {
            missed.push((a.node.clone(), a.missed));
        }
        seen.extend(a.lines.into_iter().map(|line| Seen {
            node: a.node.clone(),
            line,
        }));
    }
    seen.sort_by_key(|s| (s.line.at_ms, s.line.seq));
    Ok((seen, missed))
}

/// One line for a person: time, level, where from, the message, the text.
fn render(s: &Seen, with_node: bool) -> String {
    let l = &s.line;
    let at = humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(l.at_ms));
    let node = if with_node {
        format!("{}  ", s.node)
    } else {
        String::new()
    };
    let from = match l.source {
        Source::Log => "",
        Source::Stdout => "stdout  ",
        Source::Stderr => "stderr  ",
        Source::Fault => "fault  ",
        Source::Failure => "failure  ",
    };
    let message = l
        .message_id
        .as_deref()
        .map_or_else(String::new, |m| format!("message {m}  "));
    format!("{at}  {node}{:<5}  {from}{message}{}", l.level.to_uppercase(), l.text)
}

pub fn run(req: Request) -> anyhow::Result<ExitCode> {
    let (admins, token) = targets(&req)?;
    let mut after = vec![0; admins.len()];
    let with_node = admins.len() > 1;
    let mut first = true;
    loop {
        let (seen, missed) = poll(&req, &admins, token.as_deref(), &mut after)?;
        // The first answer leaves out what is older than `--limit` lines, as `tail` does;
        // after it, a gap means lines went by faster than they were asked for.
        if !first && !req.json {
            for (node, n) in missed {
                eprintln!(
                    "({node}: {n} line(s) of `{}` went by unseen: more than --limit {} a second)",
                    req.handler, req.limit
                );
            }
        }
        for s in &seen {
            if req.json {
                let mut v = serde_json::to_value(&s.line)?;
                v["node"] = serde_json::Value::String(s.node.clone());
                println!("{v}");
            } else {
                println!("{}", render(s, with_node));
            }
        }
        if first && seen.is_empty() && !req.json {
            eprintln!(
                "no log lines from `{}` yet{}",
                req.handler,
                if req.follow {
                    "; waiting for some (Ctrl-C to stop)"
                } else {
                    ""
                }
            );
        }
        if !req.follow {
            return Ok(ExitCode::SUCCESS);
        }
        first = false;
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_reads_as_time_level_source_message_and_text() {
        let s = Seen {
            node: "node-a".into(),
            line: Line {
                seq: 3,
                at_ms: 1_700_000_000_123,
                level: "error".into(),
                source: Source::Fault,
                message_id: Some("m-1".into()),
                text: "trap: unreachable".into(),
            },
        };
        assert_eq!(
            render(&s, false),
            "2023-11-14T22:13:20.123Z  ERROR  fault  message m-1  trap: unreachable"
        );
        assert!(render(&s, true).contains("Z  node-a  ERROR"));
    }
}
