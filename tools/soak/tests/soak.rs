//! The chaos soak (`weir-soak`, tools/soak) as part of the
//! suite: a two-minute run per broker in `postgres` mode, and one on NATS in
//! `nats-kv` mode (three `weir run` processes; kill -9, SIGTERM, scaling,
//! broker cuts, coordination stalls and outages) must exit 0: nothing lost,
//! no intra-group overlap, nothing falsely dead-lettered, no stuck slot.
//! Its red baselines, `negative_control_no_drain_reports_overlaps` (and
//! `..._on_nats_kv`), run the soak with slots given up before their drain
//! and must see it report overlaps.
//!
//! The runs take turns (one lock): each is a cluster of its own on two cores.
//! Fixed seeds keep the fault schedule the same from run to run; set
//! `WEIR_SOAK_SEED` to try another. A failing run keeps its run directory
//! (configs, node logs, `events.log`, `summary.json`) and names it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../../host/tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;

use common::cluster;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

struct Run {
    code: Option<i32>,
    stdout: String,
    dir: PathBuf,
    summary: serde_json::Value,
}

fn soak(broker: &str, seed: u64, args: &[&str]) -> Run {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let seed = std::env::var("WEIR_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(seed);
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "soak-{broker}-{seed}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ));
    let out = Command::new(cluster::package_bin(
        "weir-soak",
        option_env!("CARGO_BIN_EXE_weir-soak"),
    ))
    .args([
        "--broker",
        broker,
        "--seed",
        &seed.to_string(),
        "--weir",
        &cluster::weir_bin(),
    ])
    .arg("--dir")
    .arg(&dir)
    .args(args)
    .stdin(Stdio::null())
    .stderr(Stdio::inherit())
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    // The summary goes to the run's log (straight to stderr: the test
    // harness would hold it back for a passing test), and is kept beside the
    // run directories for the figures in docs/RELIABILITY.md.
    let _ = std::io::Write::write_all(&mut std::io::stderr(), stdout.as_bytes());
    let _ = std::fs::write(
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("soak-{broker}-last-summary.txt")),
        &stdout,
    );
    let summary = std::fs::read_to_string(dir.join("summary.json"))
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(serde_json::Value::Null);
    Run {
        code: out.status.code(),
        stdout,
        dir,
        summary,
    }
}

fn passes(broker: &str, seed: u64, args: &[&str]) {
    let mut all = vec!["--duration", "120s"];
    all.extend_from_slice(args);
    let run = soak(broker, seed, &all);
    assert_eq!(
        run.code,
        Some(0),
        "the {broker} soak failed (exit {:?}); run directory {}:\n{}",
        run.code,
        run.dir.display(),
        run.stdout
    );
    let _ = std::fs::remove_dir_all(&run.dir);
}

#[test]
fn soak_rabbitmq_two_minutes() {
    passes("rabbitmq", 14_001, &[]);
}

#[test]
fn soak_nats_two_minutes() {
    passes("nats", 14_002, &[]);
}

/// The same soak with the cluster coordinated on a NATS KV bucket: its
/// coordination stalls and outages (`kv-stall`, `kv-outage`) hold or cut
/// each node's NATS connections, the streams' and the bucket's together.
#[test]
fn soak_nats_kv_two_minutes() {
    passes("nats", 14_004, &["--cluster", "nats-kv"]);
}

/// Slots handed over before their drain (`--negative-control no-drain`),
/// with handoffs made frequent (nodes join: scale-up, and a new node after
/// every kill -9) while many long calls run with messages queued behind
/// them (sleeping calls, so the machine is not saturated; no SIGTERM, whose
/// drain is not what this control switches off): the soak must report
/// intra-group overlaps and fail. The same run without the switch reported
/// none (docs/RELIABILITY.md).
/// The control's run: handoffs made frequent while long calls hold groups.
const NO_DRAIN: [&str; 18] = [
    "--duration",
    "60s",
    "--negative-control",
    "no-drain",
    "--faults",
    "scale-up,kill-9",
    "--groups",
    "8",
    "--rate",
    "4",
    "--long-share",
    "0.5",
    "--long-ms",
    "3000..6000",
    "--sleep-calls",
    "--max-deliver=-1",
    "--cluster",
    "postgres",
];

fn reports_overlaps(seed: u64, cluster: &str) {
    let mut args = NO_DRAIN;
    args[NO_DRAIN.len() - 1] = cluster;
    let run = soak("nats", seed, &args);
    let overlaps = run.summary["overlaps"].as_u64();
    assert!(
        overlaps.is_some_and(|n| n > 0) && run.code == Some(1),
        "the {cluster} soak did not see the overlaps of a handoff without drain (exit {:?}, overlaps {overlaps:?}); run directory {}:\n{}",
        run.code,
        run.dir.display(),
        run.stdout
    );
    let _ = std::fs::remove_dir_all(&run.dir);
}

#[test]
fn negative_control_no_drain_reports_overlaps() {
    reports_overlaps(14_003, "postgres");
}

/// The red baseline of `soak_nats_kv_two_minutes`.
#[test]
fn negative_control_no_drain_reports_overlaps_on_nats_kv() {
    reports_overlaps(14_005, "nats-kv");
}

/// Issue 33 item 7: the soak through the topology's ingress (each node
/// forwards to the slots), with kill -9 as the only fault: nothing lost,
/// no overlap, nothing dead-lettered, no slot stuck. The time after a kill
/// is measured by hand (docs/RELIABILITY.md), never asserted here.
#[test]
fn soak_nats_kv_through_the_ingress_under_kill_9() {
    passes(
        "nats",
        14_005,
        &[
            "--cluster",
            "nats-kv",
            "--ingress",
            "--faults",
            "kill-9",
            "--fault-gap",
            "4..8",
        ],
    );
}

#[test]
fn soak_rabbitmq_through_the_ingress_under_kill_9() {
    passes(
        "rabbitmq",
        14_006,
        &["--ingress", "--faults", "kill-9", "--fault-gap", "4..8"],
    );
}
