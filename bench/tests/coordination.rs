//! `weir-bench coordination` at a small size against a real PostgreSQL
//! (`WEIR_BENCH_DATABASE_URL`, else the local server) and a real NATS
//! (`--mode nats-kv`; `WEIR_BENCH_NATS_URL`, else the local server): every
//! phase reaches balance, no change moves fewer slots than the lower bound,
//! and the steady state renews leases. Keeps the benchmark from rotting.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

use serde_json::Value;

#[test]
fn a_small_cluster_balances_after_every_change() {
    balances_after_every_change("postgres");
}

#[test]
fn a_small_nats_kv_cluster_balances_after_every_change() {
    balances_after_every_change("nats-kv");
}

fn balances_after_every_change(mode: &str) {
    let out = std::env::temp_dir().join(format!("weir-coordination-{mode}-{}.json", std::process::id()));
    let run = Command::new(env!("CARGO_BIN_EXE_weir-bench"))
        .args([
            "coordination",
            "--mode",
            mode,
            "--nodes",
            "4",
            "--slots",
            "64",
            "--churn",
            "1",
            "--lease-ms",
            "1000",
            "--steady-secs",
            "3",
            "--deadline-secs",
            "60",
            "--json",
        ])
        .arg(&out)
        .output()
        .expect("running weir-bench");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "weir-bench coordination failed:\n{stderr}\n{}",
        String::from_utf8_lossy(&run.stdout)
    );
    let r: Value = serde_json::from_slice(&std::fs::read(&out).expect("the JSON report")).expect("JSON");
    let _ = std::fs::remove_file(&out);
    let phases = r["phases"].as_array().expect("phases");
    let names: Vec<&str> = phases.iter().map(|p| p["phase"].as_str().unwrap()).collect();
    assert_eq!(names, ["start", "add", "leave", "crash"], "{r:#}");
    for p in phases {
        let (moved, handoffs, bound) = (
            p["slots_moved_net"].as_u64().unwrap(),
            p["handoffs"].as_u64().unwrap(),
            p["lower_bound"].as_u64().unwrap(),
        );
        assert!(bound > 0, "every change here must move slots: {p}");
        assert!(
            moved >= bound && handoffs >= bound,
            "fewer moves than the lower bound: {p}"
        );
        assert!(p["seconds_to_balance"].as_f64().unwrap() < 60.0, "{p}");
    }
    // Starting from nothing, every slot is assigned (some more than once:
    // the first nodes registered get slots the later ones take over).
    assert_eq!(phases[0]["lower_bound"], 64);
    assert_eq!(phases[0]["slots_moved_net"], 64, "{r:#}");
    let renewals = r["steady"]["renewals_per_s"].as_f64().unwrap();
    assert!(renewals > 0.0, "no lease renewals counted in steady state: {r:#}");
}
