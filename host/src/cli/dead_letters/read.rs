//! `weir dead-letters list|summary|show`: reading letters, as tables or JSON.

use std::process::ExitCode;

use weir::deadletter::{Filter, LetterView};

use super::*;

pub(super) fn cell(v: Option<&str>) -> &str {
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

pub(super) fn table(views: &[LetterView]) -> String {
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

pub(super) async fn list(common: &Common, filter: Filter, limit: Option<usize>) -> anyhow::Result<ExitCode> {
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

pub(super) async fn summary(common: &Common, filter: Filter, top: usize) -> anyhow::Result<ExitCode> {
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

pub(super) async fn show(common: &Common, filter: Filter) -> anyhow::Result<ExitCode> {
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
