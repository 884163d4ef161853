//! The dashboard at `/` (issue 19 item 7), end to end in headless Chromium
//! (Debian's `chromium`, driven by playwright-core from Node with
//! `executablePath` set: no browser download). Two nodes in `postgres` mode
//! on one memory broker: the page, opened on the first with the operator's
//! token, shows the four slots owned; a second node joins and the page shows
//! a slot change owner; a dead letter is redriven by a click in the page and
//! is handled. A tenant's token gets the same page read-only. A canary
//! shows beside the stable version and is promoted by a click. At 1280 and
//! 1920 px the page fits its window, the canary's buttons sit in its
//! handler's row, and the dead letters page by 50 and filter by reason
//! (`dashboard-layout.mjs`); its 1280 px screenshot, taken with messages
//! flowing, is docs/dashboard.png's source.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::CallLog;
use common::http::{call, current, digest, free_port, variant, wait_up};
use common::pg::TestDb;
use weir::config;
use weir::envelope;
use weir::node::{Node, NodeOptions, bundled};
use weir::outcome::Reason;
use weir::settle::capture::{Captured, Provenance, dead_letter_wire};
use weir::transport::Transport as _;
use weir::transport::memory::MemoryBroker;

const TOKEN: &str = "dashboard-operator-token";
const TENANT_TOKEN: &str = "dashboard-acme-token";
const TOPOLOGY: &str = "dash";

/// Chromium, or the command that installs it.
fn chromium() -> PathBuf {
    let path = match std::env::var("WEIR_CHROMIUM") {
        Ok(p) => PathBuf::from(p),
        Err(_) => common::tools::ensure("chromium", "chromium"),
    };
    assert!(
        path.exists(),
        "{} is missing: the dashboard test drives Debian's chromium; install it with \
         `apt-get install chromium` (.ci/run does when it is missing), or set WEIR_CHROMIUM",
        path.display()
    );
    path
}

/// `host/tests/browser` with its pinned playwright-core installed (`npm ci`,
/// once per lockfile) in the test scratch directory.
fn driver() -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser");
    let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join("browser-test");
    std::fs::create_dir_all(&work).unwrap();
    let lock = std::fs::read(src.join("package-lock.json")).unwrap();
    let stamp = work.join("installed.lock");
    if std::fs::read(&stamp).ok().as_deref() != Some(lock.as_slice())
        || !work.join("node_modules/playwright-core").exists()
    {
        for f in ["package.json", "package-lock.json"] {
            std::fs::copy(src.join(f), work.join(f)).unwrap();
        }
        let out = Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
            .current_dir(&work)
            .output()
            .unwrap_or_else(|e| panic!("npm: {e}: the dashboard test needs Node.js 18+ and npm"));
        assert!(
            out.status.success(),
            "npm ci of playwright-core in {} failed (no registry?): {}",
            work.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::write(&stamp, &lock).unwrap();
    }
    for f in [
        "dashboard.mjs",
        "dashboard-tenant.mjs",
        "dashboard-canary.mjs",
        "dashboard-layout.mjs",
    ] {
        std::fs::copy(src.join(f), work.join(f)).unwrap();
    }
    work.join("dashboard.mjs")
}

async fn node(db: &TestDb, mem: &Arc<MemoryBroker>, name: &str, calls: Arc<CallLog>) -> (Node, u16) {
    let port = free_port();
    let text = format!(
        r#"
[node]
name = "{name}"
admin = "127.0.0.1:{port}"
admin_token = "{TOKEN}"
[cluster]
mode = "postgres"
database_url = "{url}"
lease = "2s"
[[tenant]]
name = "acme"
token = "{TENANT_TOKEN}"
[[topology]]
name = "{TOPOLOGY}"
slots = 4
[[handler]]
name = "faulty"
component = "{faulty}"
topology = "{TOPOLOGY}"
message_types = ["ok"]
"#,
        url = db.url(),
        faulty = bundled::FAULTY_PATH,
    );
    let cfg = config::parse(&text, "<dashboard test>").unwrap();
    let opts = NodeOptions {
        workers: 1,
        call_observer: Some(calls),
        runtime: common::cached(weir::runtime::RuntimeOptions::default()),
        ..NodeOptions::default()
    };
    let n = Node::start(&cfg, mem.clone(), opts).await.unwrap();
    wait_up(port);
    (n, port)
}

/// The driver's next line (panics with what it said so far on EOF).
fn next_line(lines: &mut impl Iterator<Item = std::io::Result<String>>, said: &mut Vec<String>) -> String {
    let Some(Ok(l)) = lines.next() else {
        panic!("the browser driver ended early:\n{}", said.join("\n"));
    };
    said.push(l.clone());
    if l.starts_with("PAGEERROR") {
        panic!("the page threw: {l}\n{}", said.join("\n"));
    }
    if l.starts_with("FAIL") {
        panic!("the browser driver failed: {l}\n{}", said.join("\n"));
    }
    l
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_a_slot_move_and_redrives_a_dead_letter_on_a_click() {
    let chromium = chromium();
    let script = driver();
    let db = TestDb::new();
    let mem = Arc::new(MemoryBroker::new());
    let calls = Arc::new(CallLog::default());
    let (a, port) = node(&db, &mem, "dash-a", calls.clone()).await;

    // A dead letter from an earlier failure, for the page to redrive.
    let env = envelope::new_message("dl-1".into(), "ok", Some("g-1".into()), None, vec![], b"{}".to_vec());
    let wire = dead_letter_wire(
        Captured::Envelope(&env),
        &Provenance {
            reason: Reason::Rejected,
            error: "rejected by an earlier version",
            source: "weir.dash.0",
            handler: Some(("faulty", "0000")),
            tag: 1,
        },
    );
    mem.publish_dead_letter(TOPOLOGY, wire).await.unwrap();

    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    let mut child = Command::new("node")
        .arg(&script)
        .arg(format!("http://127.0.0.1:{port}/"))
        .arg(TOKEN)
        .arg(&shot)
        .env("WEIR_CHROMIUM", &chromium)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(stdout).lines() {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let mut lines = std::iter::from_fn(move || rx.recv_timeout(Duration::from_secs(180)).ok());
    let mut said = Vec::new();

    let owners = next_line(&mut lines, &mut said);
    assert_eq!(owners, "OWNERS dash-a,dash-a,dash-a,dash-a", "{said:?}");
    // A second node joins: the leader hands it slots, and the page shows it.
    let (b, _) = node(&db, &mem, "dash-b", calls.clone()).await;
    writeln!(stdin, "go").unwrap();
    let moved = next_line(&mut lines, &mut said);
    assert!(moved.starts_with("MOVED ") && moved.ends_with(" dash-b"), "{said:?}");

    let redriven = next_line(&mut lines, &mut said);
    assert_eq!(redriven, "REDRIVEN", "{said:?}");
    assert!(mem.dead_letters(TOPOLOGY).is_empty(), "the dead letter is still there");
    let start = std::time::Instant::now();
    while calls.of("dl-1").is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the redriven message was never handled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(calls.of("dl-1")[0].attempt, 1, "a redrive starts again at attempt 1");
    assert_eq!(next_line(&mut lines, &mut said), "DONE", "{said:?}");
    // The driver reads its stdin until it closes: close it, then it ends.
    drop(stdin);
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("the browser driver did not exit after DONE: {said:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{said:?}");
    assert!(
        std::fs::metadata(&shot).unwrap().len() > 10_000,
        "no screenshot at {}",
        shot.display()
    );
    println!("dashboard screenshot: {}", shot.display());

    // A tenant's token: the same page, read-only (no redrive, no rollback).
    let out = Command::new("node")
        .arg(script.with_file_name("dashboard-tenant.mjs"))
        .arg(format!("http://127.0.0.1:{port}/"))
        .arg(TENANT_TOKEN)
        .env("WEIR_CHROMIUM", &chromium)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("TENANT read-only"), "{text}");

    // A canary on slot 0: the page shows it against the stable version, and
    // a click on Promote makes it the handler's version.
    let v2 = variant(&std::fs::read(bundled::FAULTY_PATH).unwrap(), "dashboard-canary");
    let body = v2.clone();
    let (code, answer) = tokio::task::spawn_blocking(move || {
        call("PUT", port, "/v1/handlers/faulty?canary_slots=0", Some(TOKEN), &body)
    })
    .await
    .unwrap();
    assert_eq!(code, 200, "{answer}");

    // More than a page of dead letters, three of them rejected; messages flowing for the
    // rates; then the layout at two widths.
    for i in 0..113 {
        let env = envelope::new_message(
            format!("dl-page-{i}"),
            "ok",
            Some(format!("g-{i}")),
            None,
            vec![],
            b"{}".to_vec(),
        );
        let (reason, error) = if i % 40 == 7 {
            (Reason::Rejected, "order o-17: no price for sku x")
        } else {
            (
                Reason::Exhausted,
                "inventory service unavailable (HTTP 503) after 5 attempts; the ladder is spent",
            )
        };
        let wire = dead_letter_wire(
            Captured::Envelope(&env),
            &Provenance {
                reason,
                error,
                source: "weir.dash.1",
                handler: Some(("faulty", "0000")),
                tag: 2,
            },
        );
        mem.publish_dead_letter(TOPOLOGY, wire).await.unwrap();
    }
    let shots = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let mut layout = {
        let mut cmd = Command::new("node");
        cmd.arg(script.with_file_name("dashboard-layout.mjs"))
            .arg(format!("http://127.0.0.1:{port}/"))
            .arg(TOKEN)
            .arg("faulty")
            .arg(shots)
            .env("WEIR_CHROMIUM", &chromium);
        tokio::task::spawn_blocking(move || cmd.output().unwrap())
    };
    // A message every 10 ms while the page is looked at.
    let mut n = 0u64;
    let out = loop {
        tokio::select! {
            out = &mut layout => break out.unwrap(),
            () = tokio::time::sleep(Duration::from_millis(10)) => {
                let env = envelope::new_message(envelope::fresh_id(), "ok", Some(format!("t-{}", n % 16)), None, vec![], b"{}".to_vec());
                a.publish(TOPOLOGY, &env).await.unwrap();
                n += 1;
            }
        }
    };
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("LAYOUT 1280 ok") && text.contains("LAYOUT 1920 ok"),
        "{text}"
    );
    println!("dashboard screenshot: {}", shots.join("dashboard-1280.png").display());

    let out = Command::new("node")
        .arg(script.with_file_name("dashboard-canary.mjs"))
        .arg(format!("http://127.0.0.1:{port}/"))
        .arg(TOKEN)
        .arg("faulty")
        .env("WEIR_CHROMIUM", &chromium)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let short: String = digest(&v2).chars().take(12).collect();
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(&format!("CANARY canary {short} on slots 0 of 4")),
        "{text}"
    );
    assert!(text.contains("PROMOTED"), "{text}");
    let now = tokio::task::spawn_blocking(move || current(port, Some(TOKEN), "faulty"))
        .await
        .unwrap();
    assert_eq!(now, digest(&v2), "promoted through the page");

    b.shutdown().await.unwrap();
    a.shutdown().await.unwrap();
}
