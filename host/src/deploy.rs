//! `weir deploy` and `weir rollback`: talk to a node's admin listener.

use std::path::Path;

use anyhow::Context as _;

/// Where and as whom.
pub struct Target<'a> {
    /// The admin listener, e.g. `http://127.0.0.1:9464`.
    pub admin: &'a str,
    /// Operator or tenant token.
    pub token: &'a str,
    /// The handler.
    pub handler: &'a str,
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        // Keep 4xx/5xx bodies: they say why.
        .http_status_as_error(false)
        .timeout_global(Some(std::time::Duration::from_secs(300)))
        .build()
        .into()
}

fn url(t: &Target<'_>, tail: &str) -> String {
    let base = t.admin.trim_end_matches('/');
    let base = if base.contains("://") {
        base.to_owned()
    } else {
        format!("http://{base}")
    };
    format!("{base}/v1/handlers/{}{tail}", t.handler)
}

fn answer(what: &str, resp: ureq::http::Response<ureq::Body>) -> anyhow::Result<serde_json::Value> {
    let status = resp.status();
    let text = resp
        .into_body()
        .read_to_string()
        .with_context(|| format!("{what}: reading the answer"))?;
    let json: serde_json::Value = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    if status.is_success() {
        return Ok(json);
    }
    let why = json["error"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| json.to_string());
    let hint = match status.as_u16() {
        401 => " (check --token)",
        403 => " (a tenant token changes only its own tenant's handlers)",
        404 => " (no such handler, or, for a tenant token, another tenant's)",
        408 => " (the upload was too slow: node.admin_body_timeout, node.admin_idle_timeout)",
        413 => " (raise node.max_component_size, or make the component smaller)",
        429 | 503 => " (the node is busy with other uploads: retry in a few seconds)",
        _ => "",
    };
    anyhow::bail!("{what} refused with {status}: {why}{hint}; the running version stays")
}

/// Upload `file` as the handler's new version; prints what happened.
pub fn deploy(t: &Target<'_>, file: &Path, env: &[String], dirs: &[String]) -> anyhow::Result<()> {
    let bytes = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let mut query: Vec<String> = env.iter().map(|e| format!("env={}", encode(e))).collect();
    query.extend(dirs.iter().map(|d| format!("dir={}", encode(d))));
    let url = if query.is_empty() {
        url(t, "")
    } else {
        format!("{}?{}", url(t, ""), query.join("&"))
    };
    eprintln!(
        "deploying {} ({:.1} KiB) to handler `{}` at {} …",
        file.display(),
        bytes.len() as f64 / 1024.0,
        t.handler,
        t.admin
    );
    let resp = agent()
        .put(&url)
        .header("Authorization", &format!("Bearer {}", t.token))
        .header("Content-Type", "application/wasm")
        .send(&bytes[..])
        .with_context(|| format!("cannot reach the admin listener at {}", t.admin))?;
    let d = answer("deploy", resp)?;
    if d["swapped"].as_bool() == Some(false) {
        println!("unchanged: `{}` already runs {}", t.handler, short(&d["digest"]));
    } else {
        println!(
            "deployed: `{}` now runs {} (was {}), validated and swapped in {} ms; kept in {}",
            t.handler,
            short(&d["digest"]),
            short(&d["previous"]),
            d["took_ms"],
            d["kept_in"].as_str().unwrap_or("?")
        );
    }
    Ok(())
}

/// Make the previous version current again.
pub fn rollback(t: &Target<'_>) -> anyhow::Result<()> {
    let resp = agent()
        .post(&url(t, "/rollback"))
        .header("Authorization", &format!("Bearer {}", t.token))
        .send_empty()
        .with_context(|| format!("cannot reach the admin listener at {}", t.admin))?;
    let d = answer("rollback", resp)?;
    println!(
        "rolled back: `{}` now runs {} (was {})",
        t.handler,
        short(&d["digest"]),
        short(&d["previous"])
    );
    Ok(())
}

fn short(v: &serde_json::Value) -> String {
    v.as_str()
        .map_or_else(|| "none".into(), |s| s.chars().take(12).collect())
}

fn encode(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes()).collect()
}
