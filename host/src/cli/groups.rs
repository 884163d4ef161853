//! `weir groups list`: the groups parked behind a failed message
//! (`on_failure = "park"`) on one or more nodes, from their admin listeners.

use std::process::ExitCode;

use weir::observe::stats::ParkedGroup;

/// What `GET /v1/groups` answers.
#[derive(serde::Deserialize)]
struct Answer {
    node: String,
    parked: Vec<ParkedGroup>,
}

/// Print every parked group of the nodes at `admin` (JSON with `json`).
pub fn list(admin: &[String], token: Option<&str>, json: bool) -> anyhow::Result<ExitCode> {
    let mut rows: Vec<(String, ParkedGroup)> = Vec::new();
    for a in admin {
        let answer: Answer = crate::cli::status::get_json(a, "/v1/groups", token, "the groups", "its parked groups")?;
        rows.extend(answer.parked.into_iter().map(|g| (answer.node.clone(), g)));
    }
    if json {
        let out: Vec<serde_json::Value> = rows
            .iter()
            .map(|(node, g)| serde_json::json!({ "node": node, "group": g }))
            .collect();
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(ExitCode::SUCCESS);
    }
    if rows.is_empty() {
        println!("no group is parked");
        return Ok(ExitCode::SUCCESS);
    }
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    println!(
        "{:<12} {:<16} {:>4} {:<12} {:<20} {:<36} {:>8} {:>9}",
        "node", "topology", "slot", "tenant", "group", "head (failed message)", "failures", "parked"
    );
    for (node, g) in &rows {
        let secs = now_ms.saturating_sub(g.since_ms) / 1000;
        println!(
            "{:<12} {:<16} {:>4} {:<12} {:<20} {:<36} {:>8} {:>8}s",
            node,
            g.topology,
            g.slot,
            g.tenant.as_deref().unwrap_or("-"),
            g.group,
            g.head,
            g.failures,
            secs
        );
    }
    println!(
        "{} group(s) parked: each waits for its head to succeed on the retry ladder or be dead-lettered",
        rows.len()
    );
    Ok(ExitCode::SUCCESS)
}

/// `weir groups unpark|skip`: ask each node at `admin` in turn to release
/// the parked group (and, with `skip`, to dead-letter its head `skipped`);
/// the node whose slot holds it answers.
pub fn order(
    admin: &[String],
    token: &str,
    topology: &str,
    group: &str,
    tenant: Option<&str>,
    skip: bool,
) -> anyhow::Result<ExitCode> {
    let action = if skip { "skip" } else { "unpark" };
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(std::time::Duration::from_secs(30)))
        .build()
        .into();
    let body = serde_json::json!({ "topology": topology, "group": group, "tenant": tenant }).to_string();
    let mut refusals = Vec::new();
    for a in admin {
        let base = a.trim_end_matches('/');
        let url = if base.contains("://") {
            format!("{base}/v1/groups/{action}")
        } else {
            format!("http://{base}/v1/groups/{action}")
        };
        let resp = agent
            .post(&url)
            .header("Authorization", &format!("Bearer {token}"))
            .header("Content-Type", "application/json")
            .send(body.as_bytes())
            .map_err(|e| anyhow::anyhow!("cannot reach the admin listener at {a}: {e}"))?;
        let status = resp.status();
        let text = resp.into_body().read_to_string().unwrap_or_default();
        if status.is_success() {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
            let head = v["head"].as_str().unwrap_or("?");
            let node = v["node"].as_str().unwrap_or(a);
            if skip {
                println!(
                    "group `{group}` released on {node}: its held messages run now; its head {head} is dead-lettered `skipped` when it comes back from the ladder"
                );
            } else {
                println!(
                    "group `{group}` released on {node}: its held messages run now; its head {head} runs when it comes back from the ladder (after them)"
                );
            }
            return Ok(ExitCode::SUCCESS);
        }
        if status.as_u16() != 404 {
            anyhow::bail!("{url} answered {status}: {}", text.trim());
        }
        refusals.push(format!("{a}: {}", text.trim()));
    }
    anyhow::bail!(
        "group `{group}` is not parked on any of these nodes:\n  {}",
        refusals.join("\n  ")
    )
}
