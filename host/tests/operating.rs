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
    // The handlers and their versions, merged over both nodes: one row, as they agree.
    let (code, out, err) = weir(&["handlers", "--admin", &admin_a, "--admin", &admin_b, "--token", TOKEN]);
    assert_eq!(code, 0, "{out}{err}");
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("faulty ")).collect();
    assert_eq!(rows.len(), 1, "{out}");
    assert!(rows[0].contains(&topo.name) && rows[0].contains(" config"), "{out}");
    assert!(!out.contains(" runs "), "no skew between nodes that agree: {out}");
    let (_, json, _) = weir(&["handlers", "--admin", &admin_a, "--token", TOKEN, "--json"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["handlers"][0]["name"], "faulty", "{v}");
    assert_eq!(v["handlers"][0]["version"].as_str().unwrap().len(), 64, "{v}");
    let (_, out, _) = weir(&["status", "--admin", &admin_a, "--token", TOKEN]);
    assert!(
        out.contains("\nhandlers\n") && out.contains("faulty "),
        "status shows versions: {out}"
    );
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

/// Issue 33 item 6: SIGTERM while two lanes each run a call with the rest
/// of their group in the same job. The drain waits for the calls running
/// when it began and no other: no call starts after the signal, the
/// messages those jobs had not started go back to the broker unspent (no
/// retry, attempt unchanged) with what was still queued, and the progress
/// lines never count more calls than were running. Returns the calls that
/// started after the signal, the most calls a progress line counted, the
/// messages back on the queue, and the log.
fn sigterm_with_jobs_in_flight(negative_control: bool) -> (usize, usize, Option<u64>, String) {
    const SLEEP_MS: u32 = 1500;
    let topo = common::rabbit::Topo::new(1, &[]);
    let url = common::rabbit::url();
    let port = free_port();
    let config = with_admin(
        &node_config("d", "rabbitmq", &url, 64, "mode = \"solo\"", &topo.name, 1),
        port,
    )
    .replace(
        "message_types = [\"ok\", \"slow\"]",
        "message_types = [\"ok\", \"slow\", \"hostile.sleep\"]",
    );
    let mut cluster = Cluster::default();
    // A first node declares the topology and leaves, so the messages wait
    // on the queue and reach the next node together: each lane's job holds
    // the rest of its group.
    let first = cluster.start("d0", &config.replace("name = \"d\"", "name = \"d0\""));
    cluster.nodes[first].terminate(Duration::from_secs(30));
    let mut msgs = Vec::new();
    for g in ["ga", "gb"] {
        // A short call first: once it ended, the lane's next call is one of
        // the long ones, with the group's later messages queued behind it.
        msgs.push(common::message("hostile.sleep", Some(g), b"200"));
        for _ in 0..5 {
            msgs.push(common::message(
                "hostile.sleep",
                Some(g),
                SLEEP_MS.to_string().as_bytes(),
            ));
        }
    }
    common::cluster::publish(
        || weir::transport::rabbitmq::RabbitMq::new(url.as_str(), "operating-test"),
        &topo.name,
        &msgs,
        |_| 0,
    );
    let env: &[(&str, &str)] = if negative_control {
        &[(weir::dispatch::runner::NEGATIVE_CONTROL_DRAIN_STARTS_CALLS, "1")]
    } else {
        &[]
    };
    let d = cluster.start_with_env("d", &config, env);
    // Both short calls ended and both lanes run a long call.
    let start = Instant::now();
    loop {
        let report = cluster.report();
        let (_, metrics) = call("GET", port, "/metrics", Some(TOKEN), b"");
        if report.calls.len() >= 2
            && metrics
                .as_str()
                .unwrap_or_default()
                .contains("weir_handler_calls_in_flight{handler=\"faulty\",tenant=\"\"} 2")
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "two long calls never ran at once:\n{}",
            cluster.nodes[d].log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let signalled = weir::observe::journal::monotonic_ns();
    cluster.nodes[d].send_signal(libc::SIGTERM);
    let status = cluster.nodes[d].wait(Duration::from_secs(60));
    let log = cluster.nodes[d].log();
    assert!(status.success(), "{status}: {log}");
    let report = cluster.report();
    let started_after = report.calls.iter().filter(|c| c.start > signalled).count();
    let most_waited = log
        .lines()
        .filter_map(|l| l.split("waiting for ").nth(1))
        .filter_map(|rest| rest.split(' ').next()?.parse::<usize>().ok())
        .max()
        .unwrap_or(0);
    assert!(!log.contains("retry scheduled"), "a release spent an attempt:\n{log}");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let backlog = rt.block_on(async {
        let t = weir::transport::rabbitmq::RabbitMq::new(url.as_str(), "operating-test");
        t.backlog(&topo.name, 0).await.unwrap()
    });
    drop(topo);
    eprintln!(
        "drain{}: {started_after} call(s) started after SIGTERM, progress counted at most {most_waited}, \
         {backlog:?} back on the queue",
        if negative_control { " (negative control)" } else { "" }
    );
    (started_after, most_waited, backlog, log)
}

#[test]
fn a_draining_node_starts_no_call_and_gives_the_rest_of_its_jobs_back() {
    let (started_after, most_waited, backlog, log) = sigterm_with_jobs_in_flight(false);
    assert_eq!(started_after, 0, "a call started after SIGTERM:\n{log}");
    assert!(
        most_waited <= 2,
        "a progress line counted {most_waited} calls, 2 were running:\n{log}"
    );
    assert_eq!(
        backlog,
        Some(8),
        "the two running calls finish; the 8 messages not started go back:\n{log}"
    );
    assert!(
        log.contains("signal received: draining: 2 call(s) running finish"),
        "{log}"
    );
}

/// The red baseline of the test above: a drain that lets jobs start their
/// next calls runs messages after the signal.
#[test]
fn negative_control_a_drain_that_starts_calls_runs_the_rest_of_its_jobs() {
    let (started_after, _, backlog, log) = sigterm_with_jobs_in_flight(true);
    assert!(started_after >= 2, "the control started no call after SIGTERM:\n{log}");
    assert!(backlog.is_some_and(|b| b < 8), "{backlog:?}:\n{log}");
}
