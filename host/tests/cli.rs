//! The `weir` command as a person uses it: config errors that name the key,
//! `schedule check`'s table and exit codes, and `run` draining on SIGTERM.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read as _, Write as _};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const WEIR: &str = env!("CARGO_BIN_EXE_weir");

fn write_config(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    std::io::Write::write_all(&mut f, text.as_bytes()).unwrap();
    f
}

fn weir(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(WEIR)
        .args(args)
        .env("RUST_LOG", "warn,weir=info")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const GOOD: &str = r#"
[[topology]]
name = "orders"
slots = 2
[topology.retry]
ladder = ["1s", "5s"]
max_deliver = 4
[[handler]]
name = "orders"
component = "bundled:orders"
topology = "orders"
message_types = ["order.placed"]
"#;

#[test]
fn schedule_check_prints_the_ladder_and_exits_0() {
    let f = write_config(GOOD);
    let (code, out, _) = weir(&["schedule", "check", "--config", f.path().to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    // Delivery 2 waits rung 1, delivery 3 rung 2, delivery 4 repeats the last.
    assert!(out.contains("2            1s            1s"), "{out}");
    assert!(out.contains("4            5s           11s"), "{out}");
    assert!(out.contains("time to dead-letter: 11s"), "{out}");
    assert!(out.contains("no violations"), "{out}");
}

#[test]
fn schedule_check_names_every_violation_and_exits_1() {
    let f = write_config(&GOOD.replace("max_deliver = 4", "max_deliver = 1"));
    let (code, out, _) = weir(&["schedule", "check", "--config", f.path().to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("topology[0].retry.ladder"), "{out}");
}

#[test]
fn unknown_key_names_the_file_table_and_key() {
    let f = write_config(&GOOD.replace("slots = 2", "slots = 2\nslot_count = 3"));
    let path = f.path().to_str().unwrap().to_owned();
    let (code, _, err) = weir(&["run", "--config", &path]);
    assert_eq!(code, 1);
    assert!(err.contains(&path), "{err}");
    assert!(err.contains("topology[0]") && err.contains("slot_count"), "{err}");
}

#[test]
fn bad_value_says_what_would_be_accepted() {
    let f = write_config(&format!("{GOOD}limits = {{ memory = \"64MB\" }}\n"));
    let (code, _, err) = weir(&["run", "--config", f.path().to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("handler[0]") && err.contains("64MB") && err.contains("MiB"),
        "{err}"
    );
}

#[test]
fn missing_component_names_the_key_and_file() {
    let f = write_config(&GOOD.replace("bundled:orders", "/nonexistent/orders.wasm"));
    let (code, _, err) = weir(&["run", "--config", f.path().to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("handler[0].component") && err.contains("/nonexistent/orders.wasm"),
        "{err}"
    );
}

#[test]
fn a_file_that_is_not_a_component_is_refused_at_start() {
    let junk = write_config("this is not wasm");
    let f = write_config(&GOOD.replace("bundled:orders", junk.path().to_str().unwrap()));
    let (code, _, err) = weir(&["run", "--config", f.path().to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("not a valid WebAssembly component"), "{err}");
}

#[test]
fn an_unreachable_coordinator_database_stops_the_start_with_the_key() {
    let f = write_config(&format!(
        "[cluster]\nmode = \"postgres\"\ndatabase_url = \"postgres://postgres:secret@127.0.0.1:1/weir\"\n{GOOD}"
    ));
    let (code, _, err) = weir(&["run", "--config", f.path().to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("cluster.database_url"), "{err}");
    assert!(!err.contains("secret"), "the password must not be printed: {err}");
}

#[test]
fn a_broker_that_is_down_names_transport_url_and_the_file() {
    for (kind, url) in [
        ("rabbitmq", "amqp://guest:secret@127.0.0.1:1/%2f"),
        ("nats", "nats://127.0.0.1:1"),
    ] {
        let f = write_config(&format!("[transport]\nkind = \"{kind}\"\nurl = \"{url}\"\n{GOOD}"));
        let path = f.path().to_str().unwrap();
        for args in [
            vec!["run", "--config", path],
            vec!["publish", "--config", path, "--type", "order.placed", "--payload", "{}"],
            vec!["dead-letters", "list", "--config", path],
        ] {
            let (code, _, err) = weir(&args);
            assert_eq!(code, 1, "{kind} {args:?}: {err}");
            let line = err.lines().find(|l| l.starts_with("error:")).unwrap_or_default();
            assert!(
                line.contains(&format!("{path}: transport.url: cannot reach {kind}")),
                "{kind} {args:?}: {err}"
            );
            assert!(
                line.contains("Connection refused"),
                "{kind} {args:?}: the client's own reason: {err}"
            );
            assert!(!err.contains("secret"), "the password must not be printed: {err}");
        }
    }
}

#[test]
fn run_drains_and_exits_0_on_sigterm() {
    let f = write_config(GOOD);
    let mut child = Command::new(WEIR)
        .args(["run", "--config", f.path().to_str().unwrap()])
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        let mut all = String::new();
        while let Ok(n) = stderr.read(&mut buf) {
            if n == 0 {
                break;
            }
            all.push_str(&String::from_utf8_lossy(&buf[..n]));
            let _ = tx.send(all.clone());
        }
    });
    let start = Instant::now();
    let mut log = String::new();
    while !log.contains("node started") {
        assert!(start.elapsed() < Duration::from_secs(60), "node did not start: {log}");
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(100)) {
            log = l;
        }
    }
    let pid = child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = child.wait().unwrap();
    while let Ok(l) = rx.recv_timeout(Duration::from_millis(200)) {
        log = l;
    }
    assert!(status.success(), "exit {status:?}: {log}");
    assert!(log.contains("drained"), "{log}");
}

/// `weir run` held at its start (`WEIR_TEST_HOLD_START`: until a line
/// arrives on its stdin), sent SIGTERM there, then let go: its exit status
/// and log.
fn sigterm_during_the_start(extra_env: &[(&str, &str)]) -> (std::process::ExitStatus, String) {
    let f = write_config(GOOD);
    let mut child = Command::new(WEIR)
        .args(["run", "--config", f.path().to_str().unwrap()])
        .env("RUST_LOG", "info")
        .env("WEIR_TEST_HOLD_START", "1")
        .envs(extra_env.iter().copied())
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stderr));
    let mut log = String::new();
    for l in lines.by_ref() {
        let l = l.unwrap();
        log.push_str(&l);
        log.push('\n');
        if l.contains("holding the start") {
            break;
        }
    }
    let pid = child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    // Let it go (a process the SIGTERM ended has closed its stdin: ignore that).
    let mut stdin = child.stdin.take().unwrap();
    let _ = stdin.write_all(b"go\n");
    drop(stdin);
    for l in lines {
        log.push_str(&l.unwrap());
        log.push('\n');
    }
    (child.wait().unwrap(), log)
}

/// A SIGTERM that arrives while the node starts (its slots may already be
/// consuming) is answered with a drain once it has started: exit 0,
/// "drained". CI once caught the race this closes: a SIGTERM right after
/// "node started" ended the process (signal 15) before its handler was in.
#[test]
fn a_sigterm_while_the_node_starts_is_answered_with_a_drain() {
    let (status, log) = sigterm_during_the_start(&[]);
    assert!(status.success(), "exit {status:?}: {log}");
    assert!(log.contains("node started") && log.contains("drained"), "{log}");
}

/// Its red baseline: signals caught only after the start, as before.
#[test]
fn negative_control_with_late_signals_a_sigterm_while_starting_ends_the_process() {
    let (status, log) = sigterm_during_the_start(&[("WEIR_NEGATIVE_CONTROL_LATE_SIGNALS", "1")]);
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGTERM),
        "{status:?}: {log}"
    );
    assert!(!log.contains("drained"), "{log}");
}

/// Issue 18: the memory broker lives inside one process, so `weir publish`
/// against a memory config refuses, and says where to publish instead
/// (before, it reported a success that went nowhere).
#[test]
fn publish_against_a_memory_config_says_where_to_publish_instead() {
    let cfg = write_config(&format!("[node]\nadmin = \"127.0.0.1:9999\"\n{GOOD}"));
    let (code, out, err) = weir(&[
        "publish",
        "--config",
        cfg.path().to_str().unwrap(),
        "--type",
        "order.placed",
        "--payload",
        "{}",
    ]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(!out.contains("published"), "{out}");
    for needle in [
        "transport.kind = \"memory\"",
        "would reach no node",
        "http://127.0.0.1:9999/v1/topologies/orders/messages",
        "weir dev",
    ] {
        assert!(err.contains(needle), "{needle:?} not in: {err}");
    }
}

// ---------------------------------------------------------------- issue 36 item 5: operator commands

/// `weir config check FILE`: a good config is valid (exit 0, what it holds);
/// an unknown key, a component that is text and a ladder the schedule
/// refuses each exit 1 naming what is wrong. Nothing is contacted.
#[test]
fn config_check_validates_without_running() {
    let good = write_config(&GOOD.replace(
        "[[topology]]",
        "[transport]\nkind = \"rabbitmq\"\nurl = \"amqp://127.0.0.1:1/%2f\"\n[[topology]]",
    ));
    let (code, out, err) = weir(&["config", "check", good.path().to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("valid: transport rabbitmq") && out.contains("orders (order.placed on orders)"),
        "{out}"
    );
    let unknown = write_config(&GOOD.replace("slots = 2", "slots = 2\nslot_count = 3"));
    let (code, _, err) = weir(&["config", "check", unknown.path().to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("topology[0]") && err.contains("slot_count"), "{err}");
    let junk = write_config("this is not wasm");
    let text = write_config(&GOOD.replace("bundled:orders", junk.path().to_str().unwrap()));
    let (code, out, _) = weir(&["config", "check", text.path().to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        out.contains("handler[0].component") && out.contains("not WebAssembly at all"),
        "{out}"
    );
    let ladder = write_config(&GOOD.replace("max_deliver = 4", "max_deliver = 1"));
    let (code, out, err) = weir(&["config", "check", ladder.path().to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(err.contains("topology[0].retry.ladder"), "{err}");
}

/// `weir inspect`: the world and version a component implements, its
/// imports and exports, size and digest; exit 1 for what is no handler.
#[test]
fn inspect_names_world_version_imports_and_exports() {
    let faulty = std::path::Path::new(weir::runtime::bundled::FAULTY_PATH);
    let (code, out, err) = weir(&["inspect", faulty.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    let bytes = std::fs::read(faulty).unwrap();
    assert!(out.contains("world    weir:handler/handler@0.3.0"), "{out}");
    assert!(out.contains(&format!("size     {} bytes", bytes.len())), "{out}");
    assert!(
        out.contains("weir:handler/host@0.3.0")
            && out.contains("weir:handler/types@0.3.0")
            && out.contains("exports  handle, handle-batch\n"),
        "{out}"
    );
    // The world's types (`use types.{message, batch, failure}`) are not imports of their own.
    let imports = out.lines().find(|l| l.trim_start().starts_with("imports")).unwrap();
    assert!(
        !imports.contains("message") && !imports.contains("failure"),
        "{imports}"
    );
    let legacy = faulty.with_file_name("weir_test_legacy.wasm");
    let (code, out, _) = weir(&["inspect", legacy.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["version"], "0.1.0");
    assert_eq!(v["sha256"].as_str().unwrap().len(), 64);
    let junk = write_config("this is not wasm");
    let (code, _, err) = weir(&["inspect", junk.path().to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("not WebAssembly at all (it looks like text)"), "{err}");
}

/// `weir completions SHELL` and `weir new --list`.
#[test]
fn completions_and_the_template_list() {
    let (code, out, _) = weir(&["completions", "bash"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("complete") && out.contains("weir") && out.contains("inspect"),
        "{out}"
    );
    let (code, out, _) = weir(&["new", "--list"]);
    assert_eq!(code, 0);
    for lang in ["rust", "python", "js"] {
        assert!(out.contains(&format!("  {lang} ")), "{out}");
    }
    let (code, _, err) = weir(&["new", "rust"]);
    assert_eq!(code, 2, "a name is needed without --list: {err}");
}

/// The `.cwasm` files in `dir` (none when it does not exist).
fn compiled_in(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.path().extension().is_some_and(|x| x == "cwasm"))
                .count()
        })
        .unwrap_or(0)
}

/// Start `weir run --config cfg` with the user cache under `home`, wait until `dir` holds
/// compiled code, and stop it with SIGTERM.
fn run_until_compiled(cfg: &std::path::Path, home: &std::path::Path, dir: &std::path::Path) {
    let mut child = Command::new(WEIR)
        .args(["run", "--config", cfg.to_str().unwrap()])
        .env("XDG_CACHE_HOME", home)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while compiled_in(dir) == 0 {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("no compiled code appeared in {}", dir.display());
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let term = Command::new("kill").arg(child.id().to_string()).status().unwrap();
    assert!(term.success());
    let status = child.wait().unwrap();
    assert!(status.success(), "weir run exited {status} on SIGTERM");
}

/// Issue 36 item 4: `weir run` without `node.data_dir` keeps compiled code in the user's cache
/// (`XDG_CACHE_HOME/weir`, where `weir call` keeps it), so a restart does not compile again;
/// with a data directory, that directory's `cache/` is used and the user's stays empty.
#[test]
fn weir_run_without_a_data_dir_caches_compiled_code_for_the_user() {
    let cfg = write_config(GOOD);
    let home = tempfile::tempdir().unwrap();
    run_until_compiled(cfg.path(), home.path(), &home.path().join("weir"));

    let data = tempfile::tempdir().unwrap();
    let with_dir = write_config(&format!(
        "[node]\ndata_dir = {:?}\n{GOOD}",
        data.path().to_str().unwrap()
    ));
    let other_home = tempfile::tempdir().unwrap();
    run_until_compiled(with_dir.path(), other_home.path(), &data.path().join("cache"));
    assert_eq!(
        compiled_in(&other_home.path().join("weir")),
        0,
        "a data_dir's node leaves the user cache alone"
    );
}

/// Issue 36 item 4: a broker that is down is said before any handler is compiled (a Python
/// handler's compile takes seconds): nothing is compiled, and the error names the broker. The
/// red baseline is the order before the fix, which compiled every handler first.
#[test]
fn a_broker_that_is_down_is_reported_before_anything_is_compiled() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let cfg = write_config(&format!(
        "[transport]\nkind = \"rabbitmq\"\nurl = \"amqp://guest:guest@127.0.0.1:{port}/%2f\"\n{GOOD}"
    ));
    let home = tempfile::tempdir().unwrap();
    let out = Command::new(WEIR)
        .args(["run", "--config", cfg.path().to_str().unwrap()])
        .env("XDG_CACHE_HOME", home.path())
        .env("RUST_LOG", "warn,weir=info")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("cannot reach rabbitmq"), "{stderr}");
    assert!(
        !stderr.contains("compiling"),
        "compiled before the broker was tried:\n{stderr}"
    );
    assert_eq!(compiled_in(&home.path().join("weir")), 0);
}

/// The user cache is an optimisation: where it cannot be written (here a
/// path under a regular file), `weir run` still starts, and says why the
/// cache was skipped. Without the fix, the node failed to load its handler.
#[test]
fn weir_run_starts_when_the_user_cache_cannot_be_written() {
    let cfg = write_config(GOOD);
    let not_a_dir = tempfile::NamedTempFile::new().unwrap();
    let mut child = Command::new(WEIR)
        .args(["run", "--config", cfg.path().to_str().unwrap()])
        .env("XDG_CACHE_HOME", not_a_dir.path())
        .env("RUST_LOG", "warn,weir=info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stderr));
    let mut seen = String::new();
    let started = loop {
        match lines.next() {
            Some(Ok(l)) => {
                seen.push_str(&l);
                seen.push('\n');
                if l.contains("node started") {
                    break true;
                }
            }
            _ => break false,
        }
    };
    let _ = Command::new("kill").arg(child.id().to_string()).status();
    let status = child.wait().unwrap();
    assert!(started, "weir run did not start:\n{seen}");
    assert!(seen.contains("cannot keep compiled code in the cache"), "{seen}");
    assert!(status.success(), "exit {status} on SIGTERM:\n{seen}");
}
