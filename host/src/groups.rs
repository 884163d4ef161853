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
        let answer: Answer = crate::status::get_json(a, "/v1/groups", token, "the groups", "its parked groups")?;
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
