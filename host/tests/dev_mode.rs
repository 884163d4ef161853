//! `weir dev` (issue 18) as a person uses it, in a project made by
//! `weir new` outside the repository: it builds, starts a node on the memory
//! broker with an admin listener, runs what is typed in its terminal and what
//! is posted to the admin listener, and on a change of the sources rebuilds
//! and deploys the new version, which the next message runs. A change that
//! does not build leaves the running version serving. Ctrl-C drains and
//! exits 0. Offline: the crates come from the local cache.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead as _, Write as _};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::http::{call, free_port};

/// `weir dev`, its stdin, and its stdout line by line.
struct Dev {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    /// Everything read so far, for failure messages.
    seen: Vec<String>,
}

impl Dev {
    fn start(project: &Path, port: u16) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_weir"))
            .args(["dev", "--offline", "--admin", &format!("127.0.0.1:{port}")])
            .current_dir(project)
            // The same build directory as devloop.rs: serde and wit-bindgen
            // for wasm32 are compiled once for both.
            .env(
                "CARGO_TARGET_DIR",
                Path::new(env!("CARGO_TARGET_TMPDIR")).join("devloop-target"),
            )
            .env(
                "XDG_CACHE_HOME",
                Path::new(env!("CARGO_TARGET_TMPDIR")).join("devloop-cache"),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            stdin,
            lines,
            seen: Vec::new(),
        }
    }

    /// Read lines until one contains `needle`; that line.
    fn until(&mut self, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(_) => panic!(
                    "no line with {needle:?} within {within:?}; weir dev printed:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    fn type_line(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn weir(dir: &Path, args: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "weir {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn edit(file: &Path, from: &str, to: &str) {
    let text = std::fs::read_to_string(file).unwrap();
    assert!(text.contains(from), "{from:?} not in {}", file.display());
    std::fs::write(file, text.replace(from, to)).unwrap();
}

#[test]
fn dev_runs_typed_and_posted_messages_and_swaps_on_every_change() {
    let scratch = tempfile::tempdir().unwrap();
    weir(scratch.path(), &["new", "rust", "hi"]);
    let project = scratch.path().join("hi");
    assert!(project.join("weir.toml").is_file(), "weir new writes the dev config");
    let port = free_port();
    let mut dev = Dev::start(&project, port);
    let banner = dev.until("(token ", Duration::from_secs(600));
    let token = banner
        .split("(token ")
        .nth(1)
        .and_then(|t| t.split(')').next())
        .unwrap()
        .to_owned();
    dev.until("watching", Duration::from_secs(10));

    // Typed in the terminal: the call, its log line, its cascade, its outcome.
    dev.type_line(r#"greeting group=g-1 {"name":"Ada"}"#);
    dev.until("greeting Ada (attempt 1)", Duration::from_secs(60));
    dev.until(
        r#"cascade  greeted  group g-1  {"name":"Ada","text":"Hello, Ada!"}"#,
        Duration::from_secs(10),
    );
    dev.until("outcome  ok", Duration::from_secs(10));

    // Posted to the admin listener: a bad payload is dead-lettered with its reason.
    let (code, answer) = call(
        "POST",
        port,
        "/v1/topologies/hi/messages",
        Some(&token),
        br#"{"type":"greeting","group":"g-2","payload":"not json"}"#,
    );
    assert_eq!(code, 200, "{answer}");
    let rejected = dev.until("outcome  dead-lettered (rejected)", Duration::from_secs(60));
    assert!(rejected.contains("is not a valid"), "{rejected}");

    // A change of the sources: rebuilt, deployed through the admin listener, and run.
    edit(
        &project.join("src/lib.rs"),
        r#"format!("{salutation}, {name}!")"#,
        r#"format!("{salutation} again, {name}!")"#,
    );
    dev.until("sources changed; rebuilding", Duration::from_secs(30));
    dev.until("deployed: `hi` now runs", Duration::from_secs(600));
    dev.until("swapped", Duration::from_secs(10));
    dev.type_line(r#"greeting group=g-1 {"name":"Bo"}"#);
    dev.until(r#""text":"Hello again, Bo!""#, Duration::from_secs(60));

    // A change that does not build: the running version keeps serving.
    edit(&project.join("src/lib.rs"), "pub struct App;", "pub struct App");
    dev.until("sources changed; rebuilding", Duration::from_secs(30));
    dev.until("not swapped, the previous version still runs", Duration::from_secs(600));
    dev.type_line(r#"greeting {"name":"Cy"}"#);
    dev.until(r#""text":"Hello again, Cy!""#, Duration::from_secs(60));

    // A line it cannot read is refused with the reason; nothing is published.
    dev.type_line(r#"{"type": "greeting", "nope": 1}"#);
    dev.until("not published: not a message request", Duration::from_secs(10));

    // Ctrl-C: drains and exits 0.
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(dev.child.id() as i32, libc::SIGINT);
    }
    dev.until("stopping", Duration::from_secs(30));
    let start = Instant::now();
    let status = loop {
        if let Some(s) = dev.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "weir dev did not exit after Ctrl-C"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
}

#[test]
fn dev_without_a_config_asks_for_the_message_types() {
    let scratch = tempfile::tempdir().unwrap();
    weir(scratch.path(), &["new", "rust", "bare"]);
    let project = scratch.path().join("bare");
    std::fs::remove_file(project.join("weir.toml")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(["dev", "--offline", "--admin", &format!("127.0.0.1:{}", free_port())])
        .current_dir(&project)
        .env(
            "CARGO_TARGET_DIR",
            Path::new(env!("CARGO_TARGET_TMPDIR")).join("devloop-target"),
        )
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("has no weir.toml") && err.contains("--type"), "{err}");
}

/// Issue 36 item 1: a cascade no handler takes shows in `weir dev` as what it is (published, no
/// consumer), not as a failure of the handler that published it.
#[test]
fn a_cascade_without_a_consumer_is_shown_as_such() {
    let scratch = tempfile::tempdir().unwrap();
    weir(scratch.path(), &["new", "rust", "lone"]);
    let project = scratch.path().join("lone");
    // Unbind the template's own cascade.
    edit(
        &project.join("weir.toml"),
        r#"message_types = ["greeting", "greeted"]"#,
        r#"message_types = ["greeting"]"#,
    );
    let mut dev = Dev::start(&project, free_port());
    dev.until("watching", Duration::from_secs(600));
    dev.type_line(r#"greeting group=g-1 {"name":"Ada"}"#);
    dev.until("outcome  ok", Duration::from_secs(60));
    let line = dev.until("published, no consumer", Duration::from_secs(10));
    assert!(
        line.contains("cascade  greeted  published, no consumer: no handler here takes `greeted`"),
        "{line}"
    );
}
