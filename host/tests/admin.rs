//! The admin listener of a `weir run` process: health, readiness, the
//! Prometheus text and the slots, read over plain HTTP/1.1.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read as _, Write as _};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const WEIR: &str = env!("CARGO_BIN_EXE_weir");

fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let code = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((code, body))
}

#[test]
fn health_ready_metrics_and_slots() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("node.toml");
    std::fs::write(
        &config,
        format!(
            "[node]\nname = \"admin-test\"\nadmin = \"127.0.0.1:{port}\"\n[[topology]]\nname = \"orders\"\nslots = 3\n\
             [[handler]]\nname = \"orders\"\ncomponent = \"bundled:orders\"\ntopology = \"orders\"\nmessage_types = [\"order.placed\"]\n"
        ),
    )
    .unwrap();
    let mut child = Command::new(WEIR)
        .args(["run", "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let health = loop {
        if let Some(r) = get(port, "/health") {
            break r;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "admin listener never came up"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
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
