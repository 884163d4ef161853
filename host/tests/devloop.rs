#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Issue 18: from an empty folder outside the repository to a deployed
//! handler, with nothing but the `weir` binary and the registries (offline:
//! the crates come from the local cache). `weir new rust` makes the project,
//! `cargo test` runs its unit tests, `weir build` makes the component,
//! `weir call` runs it with a good and a bad payload, and a changed version
//! is deployed with `weir deploy` to a running node, which then runs it.

mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::http::{free_port, wait_up};
use weir::config;
use weir::envelope::{self, header};
use weir::node::{Node, NodeOptions};
use weir::transport::memory::MemoryBroker;

const TOKEN: &str = "devloop-operator-token";

/// `cargo ARGS` in `dir`, building in `target` under the test scratch directory.
fn cargo(dir: &Path, args: &[&str], target: &str) -> Output {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(args)
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", Path::new(env!("CARGO_TARGET_TMPDIR")).join(target))
        .output()
        .unwrap()
}

/// `weir ARGS` in `dir`, with a target directory kept across runs (the first
/// build compiles serde and wit-bindgen for wasm32).
fn weir(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(args)
        .current_dir(dir)
        .env(
            "CARGO_TARGET_DIR",
            Path::new(env!("CARGO_TARGET_TMPDIR")).join("devloop-target"),
        )
        .env(
            "XDG_CACHE_HOME",
            Path::new(env!("CARGO_TARGET_TMPDIR")).join("devloop-cache"),
        )
        .env_remove("WEIR_TOKEN")
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_handler_from_an_empty_folder_to_a_running_node() {
    let scratch = tempfile::tempdir().unwrap();
    let root = scratch.path();
    assert!(!root.starts_with(env!("CARGO_MANIFEST_DIR")), "outside the repository");

    let out = weir(root, &["new", "rust", "hello"]);
    assert!(out.status.success(), "{}", text(&out));
    let project = root.join("hello");
    for f in [
        "Cargo.toml",
        "src/lib.rs",
        "README.md",
        "weir-guest/src/lib.rs",
        "weir-guest/wit/handler.wit",
    ] {
        assert!(project.join(f).is_file(), "weir new made no {f}");
    }
    let again = weir(root, &["new", "rust", "hello"]);
    assert!(
        !again.status.success() && text(&again).contains("already exists"),
        "{}",
        text(&again)
    );

    // The template's own unit tests, natively.
    let tests = cargo(&project, &["test", "--offline", "--quiet"], "devloop-target");
    assert!(tests.status.success(), "{}", text(&tests));

    let out = weir(&project, &["build", "--offline"]);
    assert!(out.status.success(), "{}", text(&out));
    let built = text(&out);
    assert!(
        built.contains("built ") && built.contains("hello.wasm") && built.contains("sha256 "),
        "{built}"
    );
    let wasm = project.join("hello.wasm");
    // Function names stay in the component, so a trap's wasm backtrace
    // names the handler's frames (`hello::explode <- <hello::App as
    // weir_guest::Handler>::handle <- …`); with `strip = true` it showed
    // `<wasm function 276> <- <wasm function 220> <- …`.
    let bytes = std::fs::read(&wasm).unwrap();
    assert!(
        bytes.windows(19).any(|w| w == b"_export_handle_cabi"),
        "the template's component keeps no function names"
    );

    // A good payload: ok, the cascade, the log line.
    let good = weir(
        &project,
        &[
            "call",
            "hello.wasm",
            "--type",
            "greeting",
            "--group",
            "g-1",
            "--payload",
            r#"{"name":"Ada"}"#,
        ],
    );
    let g = text(&good);
    assert_eq!(good.status.code(), Some(0), "{g}");
    assert!(g.contains("outcome  ok"), "{g}");
    assert!(
        g.contains(r#"cascade  greeted  group g-1  {"name":"Ada","text":"Hello, Ada!"}"#),
        "{g}"
    );
    assert!(g.contains("log      info   greeting Ada (attempt 1)"), "{g}");
    // A bad one: rejected with serde's reason, nothing published.
    let bad = weir(
        &project,
        &["call", "hello.wasm", "--type", "greeting", "--payload", "not json"],
    );
    let b = text(&bad);
    assert_eq!(bad.status.code(), Some(1), "{b}");
    assert!(
        b.contains("outcome  reject: payload of \"greeting\" is not a valid"),
        "{b}"
    );
    assert!(!b.contains("cascade"), "{b}");
    // Config keys reach the guest.
    let hi = weir(
        &project,
        &[
            "call",
            "hello.wasm",
            "--type",
            "greeting",
            "--config",
            "salutation=Hi",
            "--payload",
            r#"{"name":"Bo"}"#,
        ],
    );
    assert!(text(&hi).contains("Hi, Bo!"), "{}", text(&hi));

    // A node runs the first build; a changed version is deployed to it.
    let port = free_port();
    let cfg = config::parse(
        &format!(
            r#"
[node]
name = "devloop"
admin = "127.0.0.1:{port}"
admin_token = "{TOKEN}"
[[topology]]
name = "hello"
slots = 1
[[handler]]
name = "hello"
component = {wasm:?}
topology = "hello"
message_types = ["greeting"]
"#,
            wasm = wasm.display().to_string()
        ),
        "<devloop test>",
    )
    .unwrap();
    let mem = Arc::new(MemoryBroker::new());
    let node = Node::start(
        &cfg,
        mem.clone(),
        NodeOptions {
            workers: 1,
            runtime: common::cached(weir::runtime::RuntimeOptions::default()),
            ..NodeOptions::default()
        },
    )
    .await
    .unwrap();
    wait_up(port);
    let lib = project.join("src/lib.rs");
    let source = std::fs::read_to_string(&lib).unwrap();
    std::fs::write(
        &lib,
        source.replace(
            "unwrap_or_else(|| \"Hello\".into())",
            "unwrap_or_else(|| \"Howdy\".into())",
        ),
    )
    .unwrap();
    let rebuilt = weir(&project, &["build", "--offline"]);
    assert!(rebuilt.status.success(), "{}", text(&rebuilt));
    let admin = format!("http://127.0.0.1:{port}");
    let deployed = weir(
        &project,
        &[
            "deploy",
            "--admin",
            &admin,
            "--token",
            TOKEN,
            "--handler",
            "hello",
            "hello.wasm",
        ],
    );
    assert!(
        deployed.status.success() && text(&deployed).contains("deployed: `hello` now runs"),
        "{}",
        text(&deployed)
    );

    // The node runs the new version: its cascade (which nothing handles, so it
    // is dead-lettered with its payload) says Howdy.
    let msg = envelope::new_message(
        "dev-1".into(),
        "greeting",
        Some("g".into()),
        None,
        vec![],
        br#"{"name":"Cy"}"#.to_vec(),
    );
    node.publish("hello", &msg).await.unwrap();
    let start = Instant::now();
    let greeted = loop {
        let dead = mem.dead_letters("hello");
        if let Some(w) = dead.iter().find(|w| w.header(header::MESSAGE_TYPE) == Some("greeted")) {
            break String::from_utf8_lossy(&w.body).into_owned();
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no greeted cascade: {dead:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(greeted, r#"{"name":"Cy","text":"Howdy, Cy!"}"#);
    node.shutdown().await.unwrap();

    // Issue 36 item 1: the template's own weir.toml gives its cascade a home,
    // so a first run shows no false alarm; the old template's binding (the
    // negative control) dead-letters every `greeted` as `no-handler`.
    let weir_toml = std::fs::read_to_string(project.join("weir.toml")).unwrap();
    assert!(
        weir_toml.contains(r#"message_types = ["greeting", "greeted"]"#),
        "{weir_toml}"
    );
    assert_eq!(
        first_run(&project, &weir_toml).await,
        0,
        "no dead letter on a first run"
    );
    let old = weir_toml.replace(r#"["greeting", "greeted"]"#, r#"["greeting"]"#);
    assert_eq!(
        first_run(&project, &old).await,
        10,
        "the old template dead-letters each cascade"
    );
}

/// Run the project's node config `text` (from the project folder, as `weir
/// run --config weir.toml` would, without its admin listener) on 10
/// greetings: how many dead letters that made.
async fn first_run(project: &Path, text: &str) -> usize {
    let file = project.join("first-run.toml");
    std::fs::write(&file, text).unwrap();
    let mut cfg = config::load(&file).unwrap();
    cfg.node.admin = None;
    let mem = Arc::new(MemoryBroker::new());
    let node = Node::start(
        &cfg,
        mem.clone(),
        NodeOptions {
            workers: 1,
            runtime: common::cached(weir::runtime::RuntimeOptions::default()),
            ..NodeOptions::default()
        },
    )
    .await
    .unwrap();
    let topology = cfg.topology[0].name.clone();
    for i in 0..10 {
        let msg = envelope::new_message(
            format!("first-{i}"),
            "greeting",
            Some(format!("g-{i}")),
            None,
            vec![],
            br#"{"name":"Ada"}"#.to_vec(),
        );
        node.publish(&topology, &msg).await.unwrap();
    }
    // Every greeting and every cascade settled, one way or the other.
    let start = Instant::now();
    loop {
        let s = node.stats().snapshot();
        let dead: u64 = s.dead_lettered.iter().map(|(_, n)| n).sum();
        if s.handled + dead >= 20 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the first run did not settle"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    node.shutdown().await.unwrap();
    std::fs::remove_file(&file).unwrap();
    mem.dead_letters(&topology).len()
}

/// Issue 18 item 1: `weir-guest` is publishable as it is (its WIT inside the
/// crate): `cargo package` builds it from the packaged files alone.
#[test]
fn the_guest_sdk_packages_on_its_own() {
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let out = cargo(
        root,
        &["package", "-p", "weir-guest", "--offline", "--allow-dirty", "--quiet"],
        "package-target",
    );
    assert!(out.status.success(), "{}", text(&out));
}
