//! `weir deploy` and `weir rollback`: talk to a node's admin listener.
//!
//! An upload asks `Expect: 100-continue`, so a node that refuses it before
//! reading (a bad token, deploys disabled, too large by its declared
//! length) answers before any byte of the component is sent, and the answer
//! is read instead of a broken pipe. Every failure says which of three kinds
//! it is, each with an exit code of its own ([`Failure::exit_code`]).

use std::path::Path;
use std::time::Duration;

/// Longest wait for the node's `100 Continue` before the body is sent anyway
/// (a proxy that does not pass it on).
const AWAIT_CONTINUE: Duration = Duration::from_secs(10);

/// Where and as whom.
pub struct Target<'a> {
    /// The admin listener, e.g. `http://127.0.0.1:9464`.
    pub admin: &'a str,
    /// Operator or tenant token.
    pub token: &'a str,
    /// The handler.
    pub handler: &'a str,
}

/// The kinds of failure, each with its own exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// The node refused who we are: 401, 403, or deploys disabled (exit 2).
    Auth,
    /// The node refused what we sent: a bad component, too large, an
    /// unknown handler or grant (exit 3).
    Refused,
    /// No answer, a broken connection, or a node too busy to answer now
    /// (429, 5xx): worth retrying (exit 4).
    Transport,
}

/// A deploy or rollback that did not happen, and why.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Failure {
    /// Which kind.
    pub class: Class,
    /// What to tell the user.
    pub message: String,
}

impl Failure {
    /// The process's exit code for this failure.
    pub fn exit_code(&self) -> u8 {
        match self.class {
            Class::Auth => 2,
            Class::Refused => 3,
            Class::Transport => 4,
        }
    }
}

fn fail(class: Class, message: String) -> anyhow::Error {
    Failure { class, message }.into()
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        // Keep 4xx/5xx bodies: they say why.
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(300)))
        .timeout_await_100(Some(AWAIT_CONTINUE))
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

/// A request that got no answer: the listener cannot be reached, or the
/// connection broke before the node answered.
fn unanswered(t: &Target<'_>, what: &str, e: &ureq::Error) -> anyhow::Error {
    let unreachable = match e {
        ureq::Error::ConnectionFailed | ureq::Error::HostNotFound | ureq::Error::BadUri(_) => true,
        ureq::Error::Io(io) => matches!(
            io.kind(),
            std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::AddrNotAvailable
        ),
        _ => false,
    };
    let message = if unreachable {
        format!(
            "{what}: cannot reach the admin listener at {}: {e} (is the node running with node.admin set?)",
            t.admin
        )
    } else {
        format!(
            "{what}: the connection to {} ended before the node answered: {e}; the node may or may not have \
             applied it (`curl {}` shows the current version)",
            t.admin,
            url(t, "")
        )
    };
    fail(Class::Transport, message)
}

fn answer(what: &str, resp: ureq::http::Response<ureq::Body>) -> anyhow::Result<serde_json::Value> {
    let status = resp.status();
    let text = resp.into_body().read_to_string().map_err(|e| {
        fail(
            Class::Transport,
            format!("{what}: the node answered {status} but its answer could not be read: {e}"),
        )
    })?;
    let json: serde_json::Value = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    if status.is_success() {
        return Ok(json);
    }
    let why = json["error"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| json.to_string());
    let disabled = why.starts_with("deploys are disabled");
    let hint = match status.as_u16() {
        _ if disabled => "",
        401 => " (check --token)",
        403 => " (a tenant token changes only its own tenant's handlers)",
        404 => " (no such handler, or, for a tenant token, another tenant's)",
        408 => " (the upload was too slow: node.admin_body_timeout, node.admin_idle_timeout)",
        413 => " (raise node.max_component_size, or make the component smaller)",
        429 | 503 => " (the node is busy with other uploads: retry in a few seconds)",
        _ => "",
    };
    let class = match status.as_u16() {
        401 | 403 => Class::Auth,
        429 | 500.. => Class::Transport,
        _ => Class::Refused,
    };
    Err(fail(
        class,
        format!("{what} refused with {status}: {why}{hint}; the running version stays"),
    ))
}

/// `weir deploy --canary-slots …`: run the upload on some slots only.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct CanaryArgs {
    /// Run the version as a canary on these slots of the handler's topology
    /// only: `0,1`, `0-2`, or a share like `10%` (the lowest slots). The
    /// other slots keep the current version; finish with `weir promote` or
    /// `weir rollback`.
    #[arg(long = "canary-slots")]
    pub canary_slots: Option<String>,
    /// Roll the canary back by itself when its dead-letter rate is above the
    /// stable version's by more than this (0 to 1), with `--min-messages`
    /// settled on each side and the difference significant (3 standard errors).
    #[arg(long = "max-dead-letter-rate", requires = "canary_slots")]
    pub max_dead_letter_rate: Option<f64>,
    /// Roll the canary back by itself when its retry rate is above the
    /// stable version's by more than this (0 to 1), as for dead letters.
    #[arg(long = "max-retry-rate", requires = "canary_slots")]
    pub max_retry_rate: Option<f64>,
    /// Settled messages on each side before a rate is judged (default 20).
    #[arg(long = "min-messages", requires = "canary_slots")]
    pub min_messages: Option<u64>,
    /// `relative` (the default: the canary against the stable version) or
    /// `absolute` (the canary's own rate alone, over --min-messages of its
    /// messages; any publisher can trip it with messages every version
    /// fails, so only for a stable version with too little traffic to compare).
    #[arg(long = "threshold-mode", requires = "canary_slots", value_parser = ["relative", "absolute"])]
    pub threshold_mode: Option<String>,
}

impl CanaryArgs {
    fn query(&self) -> Vec<String> {
        let mut q = Vec::new();
        if let Some(s) = &self.canary_slots {
            q.push(format!("canary_slots={}", encode(s)));
        }
        let rates = [
            ("max_dead_letter_rate", self.max_dead_letter_rate),
            ("max_retry_rate", self.max_retry_rate),
        ];
        q.extend(rates.iter().filter_map(|(k, v)| Some(format!("{k}={}", (*v)?))));
        q.extend(self.min_messages.map(|n| format!("min_messages={n}")));
        q.extend(
            self.threshold_mode
                .as_ref()
                .map(|m| format!("threshold_mode={}", encode(m))),
        );
        q
    }
}

/// Upload `file` as the handler's new version (or its canary); prints what
/// happened. False when the node already ran it (nothing was swapped).
pub fn deploy(
    t: &Target<'_>,
    file: &Path,
    env: &[String],
    dirs: &[String],
    canary: &CanaryArgs,
) -> anyhow::Result<bool> {
    let bytes =
        std::fs::read(file).map_err(|e| fail(Class::Refused, format!("cannot read {}: {e}", file.display())))?;
    let mut query: Vec<String> = env.iter().map(|e| format!("env={}", encode(e))).collect();
    query.extend(dirs.iter().map(|d| format!("dir={}", encode(d))));
    query.extend(canary.query());
    let url = if query.is_empty() {
        url(t, "")
    } else {
        format!("{}?{}", url(t, ""), query.join("&"))
    };
    eprintln!(
        "deploying {} ({}) to handler `{}` at {} (the node validates and compiles it first; \
         a large component takes a while) …",
        file.display(),
        size(bytes.len()),
        t.handler,
        t.admin
    );
    let resp = agent()
        .put(&url)
        .header("Authorization", &format!("Bearer {}", t.token))
        .header("Content-Type", "application/wasm")
        .header("Expect", "100-continue")
        .send(&bytes[..])
        .map_err(|e| unanswered(t, "deploy", &e))?;
    let d = answer("deploy", resp)?;
    if canary.canary_slots.is_some() {
        print_canary(t, &d);
    } else if d["swapped"].as_bool() == Some(false) {
        println!("unchanged: `{}` already runs {}", t.handler, short(&d["digest"]));
        return Ok(false);
    } else {
        let compiled = match d["compiled_ms"].as_u64() {
            Some(ms) => format!("compiled in {:.1} s, ", ms as f64 / 1e3),
            None => "compiled code from the node's cache, ".to_owned(),
        };
        println!(
            "deployed: `{}` now runs {} (was {}), validated and swapped in {} ms ({compiled}kept in {})",
            t.handler,
            short(&d["digest"]),
            short(&d["previous"]),
            d["took_ms"],
            d["kept_in"].as_str().unwrap_or("?")
        );
    }
    Ok(true)
}

fn print_canary(t: &Target<'_>, d: &serde_json::Value) {
    let slots: Vec<String> = d["slots"]
        .as_array()
        .map(|a| a.iter().map(|s| s.to_string()).collect())
        .unwrap_or_default();
    let th = &d["thresholds"];
    let absolute = th["mode"] == "absolute";
    let mut rules = Vec::new();
    for (k, what) in [("max_dead_letter_rate", "dead-letter"), ("max_retry_rate", "retry")] {
        if let Some(r) = th[k].as_f64() {
            rules.push(if absolute {
                format!("{what} rate above {r}")
            } else {
                format!("{what} rate more than {r} above the stable version's")
            });
        }
    }
    let rollback = if rules.is_empty() {
        "no threshold: it runs until you promote it or roll it back".to_owned()
    } else if absolute {
        format!(
            "it rolls back by itself on a {} (threshold mode absolute: the stable version is not compared; judged \
             after {} settled canary messages)",
            rules.join(" or a "),
            th["min_messages"]
        )
    } else {
        format!(
            "it rolls back by itself on a {} (judged after {} settled messages on each side, when the difference \
             is at least 3 standard errors)",
            rules.join(" or a "),
            th["min_messages"]
        )
    };
    println!(
        "canary: `{}` runs {} on slots {} of {}; the other slots keep {} ({rollback})",
        t.handler,
        short(&d["digest"]),
        slots.join(","),
        d["topology_slots"],
        short(&d["stable"]),
    );
    println!(
        "  compare: weir status --admin {} --token …   finish: weir promote … or weir rollback … --handler {}",
        t.admin, t.handler
    );
}

/// Make the running canary the current version everywhere.
pub fn promote(t: &Target<'_>) -> anyhow::Result<()> {
    let resp = agent()
        .post(&url(t, "/promote"))
        .header("Authorization", &format!("Bearer {}", t.token))
        .send_empty()
        .map_err(|e| unanswered(t, "promote", &e))?;
    let d = answer("promote", resp)?;
    println!(
        "promoted: `{}` now runs {} on every slot (was {})",
        t.handler,
        short(&d["digest"]),
        short(&d["previous"])
    );
    Ok(())
}

/// Make the previous version current again, or end the running canary.
pub fn rollback(t: &Target<'_>) -> anyhow::Result<()> {
    let resp = agent()
        .post(&url(t, "/rollback"))
        .header("Authorization", &format!("Bearer {}", t.token))
        .send_empty()
        .map_err(|e| unanswered(t, "rollback", &e))?;
    let d = answer("rollback", resp)?;
    println!(
        "rolled back: `{}` now runs {} (was {})",
        t.handler,
        short(&d["digest"]),
        short(&d["previous"])
    );
    Ok(())
}

/// `n` bytes for people: KiB below a MiB, MiB above.
fn size(n: usize) -> String {
    match n {
        n if n < 1 << 20 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{:.1} MiB", n as f64 / (1 << 20) as f64),
    }
}

fn short(v: &serde_json::Value) -> String {
    v.as_str()
        .map_or_else(|| "none".into(), |s| s.chars().take(12).collect())
}

fn encode(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes()).collect()
}
