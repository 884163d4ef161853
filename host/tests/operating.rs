//! Issue 19 as an operator meets it, with `weir run` processes on RabbitMQ:
//! `weir status` from the nodes' admin listeners in `static` mode, with the
//! slot nobody owns flagged, merged across nodes; the start warning of a
//! static node whose slots do not cover its topology; `weir publish`'s
//! warning about a slot without a consumer; a closed pipe ending a command
//! quietly; and a drain that says what it waits for, then gives up on a
//! second Ctrl-C by handing the running call back to the broker unspent.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::cluster::{Cluster, node_config, static_mode};
use common::http::{call, free_port};
use weir::transport::Transport as _;

const TOKEN: &str = "operating-test-token";

/// A node config with an admin listener on `port` (and the test's token).
fn with_admin(config: &str, port: u16) -> String {
    config.replacen(
        "[node]\n",
        &format!("[node]\nadmin = \"127.0.0.1:{port}\"\nadmin_token = \"{TOKEN}\"\n"),
        1,
    )
}

fn weir(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(args)
        .env("NO_COLOR", "1")
        .env_remove("WEIR_TOKEN")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The `weir status` line of slot `n`.
fn slot_line(status: &str, topology: &str, n: u32) -> String {
    status
        .lines()
        .find(|l| {
            let mut w = l.split_whitespace();
            w.next() == Some(topology) && w.next() == Some(n.to_string().as_str())
        })
        .unwrap_or_else(|| panic!("no line for slot {n} in:\n{status}"))
        .to_owned()
}

/// A group id whose messages go to `slot` of `slots`.
fn group_in(slot: u32, slots: u32) -> String {
    (0..)
        .map(|i| format!("g-{i}"))
        .find(|g| weir::partition::slot_for(Some(g), "", slots) == slot)
        .unwrap()
}

#[test]
fn static_status_flags_the_slot_nobody_owns_and_publish_warns_about_it() {
    let topo = common::rabbit::Topo::new(4, &[]);
    let url = common::rabbit::url();
    let mut cluster = Cluster::default();
    let (pa, pb) = (free_port(), free_port());
    let a = cluster.start(
        "a",
        &with_admin(
            &node_config("a", "rabbitmq", &url, 16, &static_mode(&[0, 1]), &topo.name, 4),
            pa,
        ),
    );
    // At start: the config's warning, and the broker's answer that nobody
    // consumes 2 and 3 (asked after the node started: wait for that line).
    let start = Instant::now();
    while !cluster.nodes[a].log().contains("no node consumes these slots now") {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no warning about the unconsumed slots:\n{}",
            cluster.nodes[a].log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = cluster.nodes[a].log();
    assert!(log.contains("this node consumes only [0, 1]: slots [2, 3]"), "{log}");
    assert!(
        log.contains("no node consumes these slots now") && log.contains("slots=[2, 3]"),
        "{log}"
    );
    let admin_a = format!("http://127.0.0.1:{pa}");
    let (code, out, err) = weir(&["status", "--admin", &admin_a, "--token", TOKEN]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("cluster mode static"), "{out}");
    assert!(slot_line(&out, &topo.name, 0).contains(" a "), "{out}");
    assert!(slot_line(&out, &topo.name, 2).contains("UNOWNED"), "{out}");
    assert!(
        out.contains(&format!("2 unowned slot(s): {t}/2, {t}/3", t = topo.name)),
        "{out}"
    );

    // A second node takes slot 2: node a alone sees it consumed by another
    // node; both together name its owner; slot 3 stays unowned.
    let b = cluster.start(
        "b",
        &with_admin(
            &node_config("b", "rabbitmq", &url, 16, &static_mode(&[2]), &topo.name, 4),
            pb,
        ),
    );
    let (_, out, _) = weir(&["status", "--admin", &admin_a, "--token", TOKEN]);
    assert!(slot_line(&out, &topo.name, 2).contains("(another node)"), "{out}");
    let admin_b = format!("http://127.0.0.1:{pb}");
    let (_, out, _) = weir(&["status", "--admin", &admin_a, "--admin", &admin_b, "--token", TOKEN]);
    assert!(slot_line(&out, &topo.name, 2).contains(" b "), "{out}");
    assert!(out.contains(&format!("1 unowned slot(s): {}/3", topo.name)), "{out}");
    // JSON, as GET /v1/slots.
    let (_, json, _) = weir(&["status", "--admin", &admin_a, "--token", TOKEN, "--json"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["mode"], "static");
    assert_eq!(v["slots"].as_array().unwrap().len(), 4, "{v}");
    // No token: the node says which.
    let (code, _, err) = weir(&["status", "--admin", &admin_a]);
    assert_eq!(code, 1);
    assert!(err.contains("401") && err.contains("--token"), "{err}");

    // Publishing to the unowned slot is warned about.
    let config_a = cluster_config_path(&cluster, "a");
    let g3 = group_in(3, 4);
    let (code, out, err) = weir(&["publish", "--config", &config_a, "--type", "ok", "--group", &g3]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        err.contains(&format!("group \"{g3}\" goes to slot 3")) && err.contains("which no consumer reads now"),
        "{err}"
    );
    let g0 = group_in(0, 4);
    let (_, _, err) = weir(&["publish", "--config", &config_a, "--type", "ok", "--group", &g0]);
    assert!(!err.contains("warning"), "{err}");

    // A closed pipe ends the command quietly (it panicked with a backtrace).
    let mut child = Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(["status", "--admin", &admin_a, "--token", TOKEN, "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked") && !err.contains("Broken pipe"), "{err}");

    cluster.nodes[b].terminate(Duration::from_secs(30));
    cluster.nodes[a].terminate(Duration::from_secs(30));
    drop(topo);
}

/// The config file `Cluster::start` wrote for node `name`.
fn cluster_config_path(cluster: &Cluster, name: &str) -> String {
    let node = cluster.nodes.iter().find(|n| n.name == name).unwrap();
    node.journal
        .with_file_name(format!("{name}.toml"))
        .display()
        .to_string()
}

/// SIGINT with a long call running: the node says every second what it
/// waits for; a second SIGINT interrupts the call, which goes back to its
/// slot queue unspent (attempt 1, no retry scheduled), and the node exits 0
/// with an honest last line. Without the release (`cancel_fails`, the
/// negative control) the interrupted call would count as a failed attempt
/// and leave for the retry ladder instead.
fn second_signal_hands_the_running_call_back(negative_control: bool) -> (Option<u64>, String) {
    let topo = common::rabbit::Topo::new(1, &[Duration::from_secs(60)]);
    let url = common::rabbit::url();
    let port = free_port();
    let mut config = with_admin(
        &node_config("d", "rabbitmq", &url, 16, "mode = \"solo\"", &topo.name, 1),
        port,
    );
    config = config.replace(
        "max_concurrent_groups = 16\n",
        "max_concurrent_groups = 16\n[topology.retry]\nladder = [\"60s\"]\nmax_deliver = 5\n",
    );
    let mut cluster = Cluster::default();
    let env: &[(&str, &str)] = if negative_control {
        &[("WEIR_NEGATIVE_CONTROL_CANCEL_FAILS", "1")]
    } else {
        &[]
    };
    let d = cluster.start_with_env("d", &config, env);
    let (code, answer) = call(
        "POST",
        port,
        &format!("/v1/topologies/{}/messages", topo.name),
        Some(TOKEN),
        br#"{"type":"slow","group":"g","payload":"600000"}"#,
    );
    assert_eq!(code, 200, "{answer}");
    // Wait until the call runs (the node's own gauge).
    let start = Instant::now();
    loop {
        let (_, metrics) = call("GET", port, "/metrics", Some(TOKEN), b"");
        if metrics
            .as_str()
            .unwrap_or_default()
            .contains("weir_handler_calls_in_flight{handler=\"faulty\",tenant=\"\"} 1")
        {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "the call never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    cluster.nodes[d].send_signal(libc::SIGINT);
    let start = Instant::now();
    while !cluster.nodes[d].log().contains("waiting for 1 call(s): faulty ×1") {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no progress line:\n{}",
            cluster.nodes[d].log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    cluster.nodes[d].send_signal(libc::SIGINT);
    let status = cluster.nodes[d].wait(Duration::from_secs(60));
    let log = cluster.nodes[d].log();
    assert!(status.success(), "{status}: {log}");
    assert!(
        log.contains("second signal: interrupting the calls still running"),
        "{log}"
    );
    assert!(
        log.contains("stopped: 1 slot(s) drained") && log.contains("or were interrupted"),
        "{log}"
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let backlog = rt.block_on(async {
        let t = weir::transport::rabbitmq::RabbitMq::new(url.as_str(), "operating-test");
        t.backlog(&topo.name, 0).await.unwrap()
    });
    drop(topo);
    (backlog, log)
}

#[test]
fn a_second_ctrl_c_hands_the_running_call_back_unspent() {
    let (backlog, log) = second_signal_hands_the_running_call_back(false);
    assert_eq!(
        backlog,
        Some(1),
        "the interrupted message is not back on its slot queue:\n{log}"
    );
    assert!(!log.contains("retry scheduled"), "{log}");
}

#[test]
fn negative_control_an_interrupt_that_fails_the_call_spends_an_attempt() {
    let (backlog, log) = second_signal_hands_the_running_call_back(true);
    assert_eq!(
        backlog,
        Some(0),
        "the control did not move the message to the ladder:\n{log}"
    );
    assert!(log.contains("retry scheduled"), "{log}");
}
