//! The admin listener of a `weir run` process: health, readiness, the
//! Prometheus text and the slots, read over plain HTTP/1.1.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{Read as _, Write as _};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const WEIR: &str = env!("CARGO_BIN_EXE_weir");

fn get(port: u16, path: &str) -> Option<(u16, String)> {
    get_with(port, path, "").map(|(code, _, body)| (code, body))
}

/// `GET path` with extra header lines; the status, the head and the body.
fn get_with(port: u16, path: &str, headers: &str) -> Option<(u16, String, String)> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{headers}\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let code = out.split_whitespace().nth(1)?.parse().ok()?;
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    Some((code, head.to_owned(), body.to_owned()))
}

/// `promtool check metrics` on `text`: its exit code and output. A missing
/// promtool fails the test with the command that installs it.
fn promtool(text: &str) -> (i32, String) {
    let mut child = match Command::new(common::tools::ensure("promtool", "prometheus"))
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => panic!(
            "promtool is needed to check the metrics ({e}): install it with `apt-get install prometheus` \
             (Debian's package; .ci/run installs it when it is missing)"
        ),
    };
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// `weir run` on a config of `node` (the `[node]` table's lines) and the
/// `orders` topology of `slots` slots with its bundled handler; returns
/// once `GET /health` answers on `port`. Keep the directory while it runs.
fn start(node: &str, slots: u32, port: u16) -> (tempfile::TempDir, std::process::Child) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("node.toml");
    std::fs::write(
        &config,
        format!(
            "[node]\n{node}\n[[topology]]\nname = \"orders\"\nslots = {slots}\n\
             [[handler]]\nname = \"orders\"\ncomponent = \"bundled:orders\"\ntopology = \"orders\"\nmessage_types = [\"order.placed\"]\n"
        ),
    )
    .unwrap();
    let child = Command::new(WEIR)
        .args(["run", "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while get(port, "/health").is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the listener on {port} never came up"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (dir, child)
}

#[test]
fn health_ready_metrics_and_slots() {
    let port = common::http::free_port();
    let (_dir, mut child) = start(&format!("name = \"admin-test\"\nadmin = \"127.0.0.1:{port}\""), 3, port);
    let health = get(port, "/health").unwrap();
    assert_eq!(health.0, 200);
    assert_eq!(get(port, "/ready").unwrap().0, 200);

    let (code, metrics) = get(port, "/metrics").unwrap();
    assert_eq!(code, 200);
    for needle in [
        "weir_messages_total{outcome=\"handled\"} 0",
        "weir_dead_letters_total{reason=\"no-handler\"} 0",
        "weir_slots_owned 3",
        "weir_batches_total{reason=\"linger\"} 0",
        "weir_batch_replays_total 0",
        "weir_handler_messages_total{handler=\"orders\",tenant=\"\",outcome=\"handled\"} 0",
        "weir_slot_messages_total{topology=\"orders\",slot=\"2\",outcome=\"handled\"} 0",
        "weir_lane_depth{topology=\"orders\",slot=\"0\"} 0",
        "weir_handler_calls_in_flight{handler=\"orders\",tenant=\"\"} 0",
        "weir_handler_call_duration_seconds_bucket{le=\"+Inf\",handler=\"orders\",tenant=\"\"} 0",
        "weir_handler_call_duration_seconds_count{handler=\"orders\",tenant=\"\"} 0",
        "weir_handler_version_info{handler=\"orders\",tenant=\"\",digest=\"",
        "weir_handler_swaps_total 0",
        "# EOF",
    ] {
        assert!(metrics.contains(needle), "{needle} missing from:\n{metrics}");
    }

    let (code, slots) = get(port, "/v1/slots").unwrap();
    assert_eq!(code, 200);
    let json: serde_json::Value = serde_json::from_str(&slots).unwrap();
    let slots = json["slots"].as_array().unwrap();
    assert_eq!(slots.len(), 3, "{json}");
    assert!(
        slots
            .iter()
            .all(|s| s["owner"] == "admin-test" && s["topology"] == "orders"),
        "{json}"
    );
    assert_eq!(get(port, "/nope").unwrap().0, 404);

    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(i32::try_from(child.id()).unwrap(), libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert!(status.success());
}

/// Issue 36, item 7: `node.metrics` serves `/metrics` to a scraper that
/// holds no token (Kubernetes' annotations), and nothing else; the admin
/// listener of the same node still wants the operator's token there (the
/// scrape the manifest made before: 401).
#[test]
fn a_metrics_listener_serves_metrics_without_a_token_and_nothing_else() {
    let (admin, metrics) = (common::http::free_port(), common::http::free_port());
    let node = format!(
        "name = \"scraped\"\nadmin = \"127.0.0.1:{admin}\"\nadmin_token = \"secret\"\nmetrics = \"127.0.0.1:{metrics}\""
    );
    let (_dir, mut child) = start(&node, 2, metrics);
    // The negative control: the admin listener asks for the token.
    assert_eq!(get(admin, "/metrics").unwrap().0, 401);
    let (code, text) = get(metrics, "/metrics").unwrap();
    assert_eq!(code, 200, "{text}");
    assert!(text.contains("weir_slots_owned 2"), "{text}");
    assert_eq!(get(metrics, "/health").unwrap().0, 200);
    for path in ["/v1/slots", "/v1/handlers", "/v1/dead-letters", "/v1/whoami", "/"] {
        assert_eq!(get(metrics, path).unwrap().0, 404, "{path} on the metrics listener");
    }
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(i32::try_from(child.id()).unwrap(), libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
}

/// `promtool tsdb create-blocks-from openmetrics` on `om`, each sample
/// stamped with one timestamp: Prometheus's OpenMetrics parser.
fn promtool_openmetrics(om: &str, scratch: &std::path::Path) -> (i32, String) {
    let stamped: String = om
        .lines()
        .map(|l| {
            if l.starts_with('#') || l.is_empty() {
                format!("{l}\n")
            } else {
                format!("{l} 1700000000\n")
            }
        })
        .collect();
    let input = scratch.join(format!("metrics-{}.om", stamped.len()));
    std::fs::write(&input, stamped).unwrap();
    let blocks = scratch.join(format!("blocks-{}", om.len()));
    let out = Command::new(common::tools::ensure("promtool", "prometheus"))
        .args(["tsdb", "create-blocks-from", "openmetrics"])
        .arg(&input)
        .arg(&blocks)
        .output()
        .unwrap_or_else(|e| panic!("promtool: {e}: install it with `apt-get install prometheus`"));
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Issue 19 item 5: `/metrics` answers Prometheus text 0.0.4 to
/// `Accept: text/plain` and OpenMetrics when that is preferred, and
/// `promtool check metrics` finds nothing wrong with either, after traffic
/// that touched every outcome family. Its red check is the OpenMetrics body
/// served as text: promtool flags every counter (their HELP names the
/// family, not the `_total` samples).
#[test]
fn metrics_negotiate_their_format_and_pass_promtool() {
    let port = common::http::free_port();
    let (dir, mut child) = start(
        &format!("name = \"metrics-test\"\nadmin = \"127.0.0.1:{port}\""),
        2,
        port,
    );
    let (code, head, text) = get_with(port, "/metrics", "Accept: text/plain; version=0.0.4\r\n").unwrap();
    assert_eq!(code, 200);
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    assert!(!text.contains("# EOF"), "{text}");
    assert!(text.contains("# TYPE weir_messages_total counter"), "{text}");
    let (rc, said) = promtool(&text);
    assert_eq!(rc, 0, "promtool on the text format:\n{said}\n{text}");

    let (code, head, om) = get_with(
        port,
        "/metrics",
        "Accept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1\r\n",
    )
    .unwrap();
    assert_eq!(code, 200);
    assert!(head.contains("application/openmetrics-text"), "{head}");
    assert!(om.ends_with("# EOF\n"), "{om}");
    // The same samples in both.
    let samples = |t: &str| -> Vec<String> { t.lines().filter(|l| !l.starts_with('#')).map(str::to_owned).collect() };
    assert_eq!(samples(&om), samples(&text));
    // `promtool check metrics` reads only the text format; Prometheus's own
    // OpenMetrics parser is reached through `promtool tsdb
    // create-blocks-from openmetrics`, which wants a timestamp on each sample.
    let (rc, said) = promtool_openmetrics(&om, dir.path());
    assert_eq!(rc, 0, "promtool's OpenMetrics parser on the body:\n{said}\n{om}");
    // Red checks: a body cut before `# EOF` fails the OpenMetrics parser, and
    // OpenMetrics served as text is what `check metrics` refused (exit 3:
    // each counter's HELP names the family, not its `_total` samples).
    let cut = om.trim_end_matches("# EOF\n");
    assert_ne!(
        promtool_openmetrics(cut, dir.path()).0,
        0,
        "the OpenMetrics check cannot fail"
    );
    let (rc, said) = promtool(&om);
    assert_ne!(rc, 0, "promtool accepted OpenMetrics as text:\n{said}");
    assert!(said.contains("no help text"), "{said}");

    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(i32::try_from(child.id()).unwrap(), libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
}
