//! Deploys through the admin API and the CLI: versions by digest, bad
//! uploads refused with the running version still serving, rollbacks down
//! the chain, versions kept across a restart, the watched components
//! directory, tenant grants, and the auth matrix of every route.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::http::{call, current, digest, free_port, variant, wait_up};
use weir::config::{self, Config};
use weir::envelope;
use weir::node::{Node, NodeOptions, bundled};
use weir::transport::memory::MemoryBroker;

const OPERATOR: &str = "operator-secret-0123456789";
const ACME: &str = "acme-secret-0123456789";
const GLOBEX: &str = "globex-secret-0123456789";
const TOPOLOGY: &str = "deploys";

fn faulty() -> Vec<u8> {
    std::fs::read(bundled::FAULTY_PATH).unwrap()
}

/// Three handlers of the faulty guest: `shop` for tenant acme, `ledger` for
/// tenant globex, `ops` for any tenant.
fn config(port: u16, data_dir: Option<&Path>, components_dir: Option<&Path>, tokens: bool) -> Config {
    config::parse(&config_text(port, data_dir, components_dir, tokens), "<deploy test>").unwrap()
}

/// [`config`]'s text (components up to 2 MiB).
fn config_text(port: u16, data_dir: Option<&Path>, components_dir: Option<&Path>, tokens: bool) -> String {
    format!(
        r#"
[node]
name = "deploy-test"
admin = "127.0.0.1:{port}"
max_component_size = "2MiB"
{tokens}
{data}
{watch}
[[topology]]
name = "{TOPOLOGY}"
slots = 2
[topology.retry]
ladder = ["100ms"]
max_deliver = 2
[[tenant]]
name = "acme"
{acme_token}
allow = {{ env = ["WEIR_TEST_ACME_ENV"], dirs = ["/tmp"] }}
[[tenant]]
name = "globex"
{globex_token}
[[handler]]
name = "shop"
component = "{faulty}"
topology = "{TOPOLOGY}"
tenant = "acme"
message_types = ["ok", "env", "flaky", "trap", "hostile.log-lines"]
[[handler]]
name = "ledger"
component = "{faulty}"
topology = "{TOPOLOGY}"
tenant = "globex"
message_types = ["ok"]
[[handler]]
name = "ops"
component = "{faulty}"
topology = "{TOPOLOGY}"
message_types = ["ok"]
"#,
        tokens = if tokens {
            format!("admin_token = \"{OPERATOR}\"")
        } else {
            String::new()
        },
        acme_token = if tokens {
            format!("token = \"{ACME}\"")
        } else {
            String::new()
        },
        globex_token = if tokens {
            format!("token = \"{GLOBEX}\"")
        } else {
            String::new()
        },
        data = data_dir
            .map(|d| format!("data_dir = {:?}", d.display().to_string()))
            .unwrap_or_default(),
        watch = components_dir
            .map(|d| format!("components_dir = {:?}", d.display().to_string()))
            .unwrap_or_default(),
        faulty = bundled::FAULTY_PATH,
    )
}

async fn start(cfg: &Config, mem: &Arc<MemoryBroker>) -> Node {
    let opts = NodeOptions {
        workers: 2,
        runtime: common::cached(weir::runtime::RuntimeOptions::default()),
        ..NodeOptions::default()
    };
    let node = Node::start(cfg, mem.clone(), opts).await.unwrap();
    wait_up(cfg.node.admin.unwrap().port());
    node
}

/// `weir ARGS` (without `WEIR_TOKEN` from the environment), off the test's async threads.
async fn weir(args: Vec<String>) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_weir"))
            .args(&args)
            .env_remove("WEIR_TOKEN")
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

/// The admin client is blocking: run it off the test's async threads.
async fn http(
    method: &'static str,
    port: u16,
    path: &str,
    token: Option<&'static str>,
    body: Vec<u8>,
) -> (u16, serde_json::Value) {
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || call(method, port, &path, token, &body))
        .await
        .unwrap()
}

async fn digest_of(port: u16, name: &str) -> String {
    let name = name.to_owned();
    tokio::task::spawn_blocking(move || current(port, Some(OPERATOR), &name))
        .await
        .unwrap()
}

/// `weir_handler_deploys_refused` from `/metrics`.
async fn refused(port: u16) -> u64 {
    let (code, body) = http("GET", port, "/metrics", Some(OPERATOR), vec![]).await;
    assert_eq!(code, 200, "{body}");
    let text = body.as_str().unwrap().to_owned();
    text.lines()
        .find(|l| l.starts_with("weir_handler_deploys_refused"))
        .and_then(|l| l.split_whitespace().last())
        .unwrap_or_else(|| panic!("no weir_handler_deploys_refused in {text}"))
        .parse()
        .unwrap()
}

/// Publish one `ok` message for `tenant` and wait until it is handled.
async fn handled_once_more(node: &Node, tenant: &str) {
    let stats = node.stats();
    let before = stats.snapshot().handled;
    let msg = envelope::new_message(
        envelope::fresh_id(),
        "ok",
        Some("g".into()),
        Some(tenant.into()),
        vec![],
        vec![],
    );
    node.publish(TOPOLOGY, &msg).await.unwrap();
    let start = Instant::now();
    while stats.snapshot().handled <= before {
        assert!(start.elapsed() < Duration::from_secs(20), "message not handled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `weir logs` (issue 36, item 5): what a handler's calls logged, the failures they
/// returned and the fault they trapped with, from the node's admin listener, to the
/// handler's tenant and the operator; another tenant is told no such handler. The negative
/// control is that tenant's own answer: nothing of acme's reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weir_logs_shows_a_handlers_lines_failures_and_faults_to_its_tenant_only() {
    let port = free_port();
    let mem = Arc::new(MemoryBroker::new());
    let node = start(&config(port, None, None, true), &mem).await;
    let send = |kind: &'static str, payload: &'static str| {
        let msg = envelope::new_message(
            envelope::fresh_id(),
            kind,
            Some(format!("g-{kind}")),
            Some("acme".into()),
            vec![],
            payload.as_bytes().to_vec(),
        );
        let node = &node;
        async move {
            node.publish(TOPOLOGY, &msg).await.unwrap();
            msg.id
        }
    };
    let logged = send("hostile.log-lines", "3").await;
    let flaky = send("flaky", "1").await;
    let trapped = send("trap", "").await;
    let stats = node.stats();
    let start = Instant::now();
    // The log lines and the flaky one's second try handled; the trap dead-lettered.
    while {
        let s = stats.snapshot();
        s.handled < 2 || s.dead_lettered.iter().map(|(_, n)| n).sum::<u64>() < 1
    } {
        assert!(start.elapsed() < Duration::from_secs(30), "{:?}", stats.snapshot());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let admin = format!("http://127.0.0.1:{port}");
    let logs = |token: &str, extra: &[&str]| {
        let mut args: Vec<String> = ["logs", "shop", "--admin", &admin, "--token", token]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        weir(args)
    };

    let out = logs(ACME, &[]).await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    for want in [
        format!("INFO   message {logged}  flood line 0"),
        format!("INFO   message {logged}  flood line 2"),
        format!("WARN   failure  message {flaky}  retry: flaky: attempt 1 of the first 1 fails"),
        format!("ERROR  fault  message {trapped}  "),
        "trap requested by test".to_owned(),
    ] {
        assert!(text.contains(&want), "`{want}` missing from:\n{text}");
    }
    // Oldest first: the three lines in the order they were written.
    let at = |needle: &str| text.find(needle).unwrap();
    assert!(at("flood line 0") < at("flood line 1") && at("flood line 1") < at("flood line 2"));
    // The trap ran twice (max_deliver 2): two fault lines.
    assert_eq!(text.matches("trap requested by test").count(), 2, "{text}");

    // `-n 1`: the newest line only; `--json`: one object a line, with its node.
    let out = logs(OPERATOR, &["-n", "1", "--json"]).await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}");
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 1, "{text}");
    assert_eq!(lines[0]["node"], "deploy-test");
    assert_eq!(lines[0]["source"], "fault");

    // Another tenant: no such handler, said as a sentence; nothing of acme's printed.
    let out = logs(GLOBEX, &[]).await;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(!out.status.success());
    assert!(stdout.is_empty(), "{stdout}");
    assert!(stderr.contains("answered 404 Not Found"), "{stderr}");
    assert!(!stderr.contains("{\""), "the error, not its JSON: {stderr}");
    assert!(!stderr.contains("flood line"), "{stderr}");
    node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_uploads_are_refused_with_the_reason_and_the_running_version_keeps_serving() {
    let port = free_port();
    let mem = Arc::new(MemoryBroker::new());
    let node = start(&config(port, None, None, true), &mem).await;
    let v1 = digest(&faulty());
    assert_eq!(digest_of(port, "shop").await, v1);

    // An empty component: valid, but it implements nothing.
    let empty_component = b"\0asm\x0d\0\x01\0".to_vec();
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "garbage bytes",
            b"this is not wasm at all".to_vec(),
            400,
            "not a valid WebAssembly component",
        ),
        (
            "a core module",
            b"\0asm\x01\0\0\0".to_vec(),
            400,
            "not a valid WebAssembly component",
        ),
        (
            "a component of another world",
            empty_component,
            400,
            "does not implement the weir:handler/handler world",
        ),
        ("too large", vec![0u8; 3 << 20], 413, "max_component_size"),
        ("empty body", Vec::new(), 400, "not a valid WebAssembly component"),
        // The text parser quotes what it could not parse: a long run of
        // it must not come back in the answer (or the log).
        (
            "1 MiB of text",
            "x".repeat(1 << 20).into_bytes(),
            400,
            "not a valid WebAssembly component",
        ),
    ];
    for (what, bytes, status, reason) in cases {
        let (code, body) = http("PUT", port, "/v1/handlers/shop", Some(OPERATOR), bytes).await;
        assert_eq!(code, status, "{what}: {body}");
        let error = body["error"].as_str().unwrap_or_default();
        assert!(
            error.contains(reason),
            "{what}: the reason should say {reason:?}, got {error:?}"
        );
        assert!(error.len() < 4096, "{what}: a {} byte reason", error.len());
        assert_eq!(digest_of(port, "shop").await, v1, "{what}: the running version changed");
        handled_once_more(&node, "acme").await;
    }
    // And a good one goes through.
    let v2 = variant(&faulty(), "2");
    let (code, body) = http("PUT", port, "/v1/handlers/shop", Some(OPERATOR), v2.clone()).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["digest"], digest(&v2));
    assert_eq!(body["previous"], v1);
    assert_eq!(body["swapped"], true);
    // The same bytes again change nothing.
    let (code, body) = http("PUT", port, "/v1/handlers/shop", Some(OPERATOR), v2.clone()).await;
    assert_eq!((code, &body["swapped"]), (200, &serde_json::json!(false)), "{body}");
    handled_once_more(&node, "acme").await;
    node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_matrix_of_every_route_and_token_kind() {
    let port = free_port();
    let mem = Arc::new(MemoryBroker::new());
    let node = start(&config(port, None, None, true), &mem).await;
    let current_shop = faulty();
    // (method, path, body, [none, wrong, operator, acme, globex])
    let rows: Vec<(&str, &str, Vec<u8>, [u16; 5])> = vec![
        ("GET", "/health", vec![], [200, 200, 200, 200, 200]),
        ("GET", "/ready", vec![], [200, 200, 200, 200, 200]),
        ("GET", "/metrics", vec![], [401, 401, 200, 403, 403]),
        ("GET", "/v1/slots", vec![], [401, 401, 200, 403, 403]),
        ("GET", "/v1/handlers", vec![], [401, 401, 200, 200, 200]),
        // A tenant token gets 404 for another tenant's handler, as for none at all.
        ("GET", "/v1/handlers/shop", vec![], [401, 401, 200, 200, 404]),
        ("GET", "/v1/handlers/ops", vec![], [401, 401, 200, 404, 404]),
        ("GET", "/v1/handlers/nope", vec![], [401, 401, 404, 404, 404]),
        (
            "PUT",
            "/v1/handlers/shop",
            current_shop.clone(),
            [401, 401, 200, 200, 404],
        ),
        (
            "PUT",
            "/v1/handlers/ops",
            current_shop.clone(),
            [401, 401, 200, 404, 404],
        ),
        (
            "PUT",
            "/v1/handlers/nope",
            current_shop.clone(),
            [401, 401, 404, 404, 404],
        ),
        ("GET", "/v1/handlers/shop/logs", vec![], [401, 401, 200, 200, 404]),
        ("GET", "/v1/handlers/ops/logs", vec![], [401, 401, 200, 404, 404]),
        ("GET", "/v1/handlers/nope/logs", vec![], [401, 401, 404, 404, 404]),
        ("POST", "/v1/handlers/shop/rollback", vec![], [401, 401, 409, 409, 404]),
        ("POST", "/v1/handlers/ops/rollback", vec![], [401, 401, 409, 404, 404]),
        // No canary runs: 409 for whoever may change the handler.
        ("POST", "/v1/handlers/shop/promote", vec![], [401, 401, 409, 409, 404]),
        ("POST", "/v1/handlers/ops/promote", vec![], [401, 401, 409, 404, 404]),
    ];
    let tokens: [Option<&'static str>; 5] = [
        None,
        Some("wrong-token-0123456789"),
        Some(OPERATOR),
        Some(ACME),
        Some(GLOBEX),
    ];
    let mut failures = Vec::new();
    for (method, path, body, expected) in rows {
        for (token, want) in tokens.iter().zip(expected) {
            let (got, answer) = http(method, port, path, *token, body.clone()).await;
            if got != want {
                failures.push(format!("{method} {path} as {token:?}: {got} (want {want}): {answer}"));
            }
        }
    }
    assert!(failures.is_empty(), "auth matrix:\n{}", failures.join("\n"));

    // A tenant sees only its own handlers in the list.
    let names = |body: &serde_json::Value| -> Vec<String> {
        body["handlers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h["name"].as_str().unwrap().to_owned())
            .collect()
    };
    let (_, all) = http("GET", port, "/v1/handlers", Some(OPERATOR), vec![]).await;
    assert_eq!(names(&all), ["ledger", "ops", "shop"]);
    let (_, acme) = http("GET", port, "/v1/handlers", Some(ACME), vec![]).await;
    assert_eq!(names(&acme), ["shop"]);
    let (_, globex) = http("GET", port, "/v1/handlers", Some(GLOBEX), vec![]).await;
    assert_eq!(names(&globex), ["ledger"]);
    node.shutdown().await.unwrap();

    // No token configured at all: reads are open, deploys are refused.
    let port = free_port();
    let node = start(&config(port, None, None, false), &mem).await;
    assert_eq!(http("GET", port, "/metrics", None, vec![]).await.0, 200);
    assert_eq!(http("GET", port, "/v1/handlers", None, vec![]).await.0, 200);
    let (code, body) = http("PUT", port, "/v1/handlers/shop", None, faulty()).await;
    assert_eq!(code, 403, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .starts_with("deploys are disabled on this node (no admin_token)"),
        "{body}"
    );
    // A token changes nothing there: it is not unknown, there is none to know.
    let (code, body) = http("PUT", port, "/v1/handlers/shop", Some(ACME), faulty()).await;
    assert_eq!(code, 403, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("deploys are disabled"),
        "{body}"
    );
    assert_eq!(http("GET", port, "/v1/handlers", Some(ACME), vec![]).await.0, 200);
    node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollbacks_walk_back_the_chain_and_versions_survive_a_restart() {
    let data = tempfile::tempdir().unwrap();
    let port = free_port();
    let mem = Arc::new(MemoryBroker::new());
    let cfg = config(port, Some(data.path()), None, true);
    let node = start(&cfg, &mem).await;
    let (v1, v2, v3) = (faulty(), variant(&faulty(), "2"), variant(&faulty(), "3"));
    for v in [&v2, &v3] {
        let (code, body) = http("PUT", port, "/v1/handlers/shop", Some(ACME), v.clone()).await;
        assert_eq!(code, 200, "{body}");
        assert_eq!(body["kept_in"], "data-dir");
    }
    assert_eq!(digest_of(port, "shop").await, digest(&v3));
    let (_, info) = http("GET", port, "/v1/handlers/shop", Some(ACME), vec![]).await;
    let history: Vec<&str> = info["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["digest"].as_str().unwrap())
        .collect();
    assert_eq!(history, [digest(&v2), digest(&v1)], "history newest first");

    for want in [&v2, &v1] {
        let (code, body) = http("POST", port, "/v1/handlers/shop/rollback", Some(ACME), vec![]).await;
        assert_eq!(code, 200, "{body}");
        assert_eq!(body["digest"], digest(want));
        assert_eq!(digest_of(port, "shop").await, digest(want));
        handled_once_more(&node, "acme").await;
    }
    let (code, body) = http("POST", port, "/v1/handlers/shop/rollback", Some(ACME), vec![]).await;
    assert_eq!(code, 409, "nothing before the first version: {body}");

    // A deploy after rollbacks starts a new branch; it survives a restart.
    let (code, _) = http("PUT", port, "/v1/handlers/shop", Some(ACME), v3.clone()).await;
    assert_eq!(code, 200);
    node.shutdown().await.unwrap();
    let node = start(&cfg, &mem).await;
    assert_eq!(
        digest_of(port, "shop").await,
        digest(&v3),
        "the deployed version is served after a restart"
    );
    handled_once_more(&node, "acme").await;
    // ...and so does its history: a rollback goes back to v1.
    let (code, body) = http("POST", port, "/v1/handlers/shop/rollback", Some(ACME), vec![]).await;
    assert_eq!(
        (code, body["digest"].as_str().unwrap()),
        (200, digest(&v1).as_str()),
        "{body}"
    );
    node.shutdown().await.unwrap();
    let node = start(&cfg, &mem).await;
    assert_eq!(
        digest_of(port, "shop").await,
        digest(&v1),
        "the rollback survives a restart too"
    );
    node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_components_directory_deploys_good_files_and_refuses_bad_ones() {
    let watched = tempfile::tempdir().unwrap();
    let port = free_port();
    let mem = Arc::new(MemoryBroker::new());
    let node = start(&config(port, None, Some(watched.path()), true), &mem).await;
    let v2 = variant(&faulty(), "2");
    // Written under another name, then renamed in: never seen half-written.
    let tmp = watched.path().join("shop.partial");
    std::fs::write(&tmp, &v2).unwrap();
    std::fs::rename(&tmp, watched.path().join("shop.wasm")).unwrap();
    let start_t = Instant::now();
    while digest_of(port, "shop").await != digest(&v2) {
        assert!(
            start_t.elapsed() < Duration::from_secs(20),
            "the watched file was never deployed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, info) = http("GET", port, "/v1/handlers/shop", Some(OPERATOR), vec![]).await;
    assert_eq!(info["current"]["source"], "watch");
    // A bad file is refused; the running version stays. Wait until the
    // watcher has refused it (the counter moves), so this fails if it never looked.
    let refused_before = refused(port).await;
    std::fs::write(watched.path().join("shop.wasm"), b"garbage").unwrap();
    std::fs::write(watched.path().join("nobody.wasm"), &v2).unwrap();
    let start_t = Instant::now();
    while refused(port).await <= refused_before {
        assert!(
            start_t.elapsed() < Duration::from_secs(20),
            "the watcher never refused the bad file (weir_handler_deploys_refused did not move)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(digest_of(port, "shop").await, digest(&v2));
    handled_once_more(&node, "acme").await;
    node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_are_checked_against_the_tenant_at_deploy_time() {
    let port = free_port();
    let mem = Arc::new(MemoryBroker::new());
    let node = start(&config(port, None, None, true), &mem).await;
    let v2 = variant(&faulty(), "2");
    let v1 = digest(&faulty());
    for (query, reason) in [
        ("env=HOME", "\"HOME\" is not allowed for tenant \"acme\""),
        ("dir=/data:/etc", "is not within a directory tenant \"acme\" may grant"),
        ("dir=/data:/tmp/../etc", "is not within"),
        ("bogus=1", "unknown query parameter"),
        ("dir=nocolon", "accepted: GUEST:HOST"),
    ] {
        let (code, body) = http(
            "PUT",
            port,
            &format!("/v1/handlers/shop?{query}"),
            Some(ACME),
            v2.clone(),
        )
        .await;
        assert!(code == 403 || code == 400, "{query}: {code} {body}");
        assert!(body["error"].as_str().unwrap().contains(reason), "{query}: {body}");
        assert_eq!(digest_of(port, "shop").await, v1);
    }
    let (code, body) = http(
        "PUT",
        port,
        "/v1/handlers/shop?env=WEIR_TEST_ACME_ENV&dir=/data:/tmp",
        Some(ACME),
        v2.clone(),
    )
    .await;
    assert_eq!(code, 200, "{body}");
    let (_, info) = http("GET", port, "/v1/handlers/shop", Some(ACME), vec![]).await;
    assert_eq!(
        info["current"]["grants"]["env"],
        serde_json::json!(["WEIR_TEST_ACME_ENV"])
    );
    assert_eq!(info["current"]["grants"]["dirs"][0]["guest"], "/data");
    // The operator's handler (no tenant) may be granted anything.
    let (code, body) = http("PUT", port, "/v1/handlers/ops?env=HOME", Some(OPERATOR), v2).await;
    assert_eq!(code, 200, "{body}");
    node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_deploys_and_rolls_back_and_says_why_when_refused() {
    let port = free_port();
    let mem = Arc::new(MemoryBroker::new());
    let node = start(&config(port, None, None, true), &mem).await;
    let dir = tempfile::tempdir().unwrap();
    let v2 = variant(&faulty(), "2");
    let good = dir.path().join("v2.wasm");
    std::fs::write(&good, &v2).unwrap();
    let bad = dir.path().join("bad.wasm");
    std::fs::write(&bad, b"nope").unwrap();
    let admin = format!("http://127.0.0.1:{port}");
    let args = |token: &str, rest: &[&str]| -> Vec<String> {
        ["--admin", admin.as_str(), "--token", token, "--handler", "shop"]
            .iter()
            .chain(rest)
            .map(|s| s.to_string())
            .collect()
    };

    let mut a = vec!["deploy".to_owned()];
    a.extend(args(ACME, &[good.to_str().unwrap()]));
    let out = weir(a).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("deployed: `shop` now runs"), "{stdout}");
    assert_eq!(digest_of(port, "shop").await, digest(&v2));

    let mut a = vec!["deploy".to_owned()];
    a.extend(args(ACME, &[bad.to_str().unwrap()]));
    let out = weir(a).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("400")
            && stderr.contains("not a valid WebAssembly component")
            && stderr.contains("running version stays"),
        "{stderr}"
    );

    let mut a = vec!["deploy".to_owned()];
    a.extend(args(GLOBEX, &[good.to_str().unwrap()]));
    let out = weir(a).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("404"), "{stderr}");

    let mut a = vec!["rollback".to_owned()];
    a.extend(args(OPERATOR, &[]));
    let out = weir(a).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("rolled back: `shop`"), "{stdout}");
    assert_eq!(digest_of(port, "shop").await, digest(&faulty()));
    node.shutdown().await.unwrap();
}

/// Issue 14 item 11: a deploy whose data-dir write fails is neither stored
/// nor swapped (the registry and the router keep the old version), says so,
/// and the same deploy made again once the directory is back goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_data_dir_write_applies_nothing_and_a_redeploy_works() {
    let data = tempfile::tempdir().unwrap();
    let port = free_port();
    let mem = Arc::new(MemoryBroker::new());
    let cfg = config(port, Some(data.path()), None, true);
    let node = start(&cfg, &mem).await;
    let (v1, v2) = (digest(&faulty()), variant(&faulty(), "2"));
    // A file where the history directory should be: writes there fail even as root.
    let handlers = data.path().join("handlers");
    let aside = data.path().join("handlers.aside");
    std::fs::rename(&handlers, &aside).unwrap();
    std::fs::write(&handlers, b"not a directory").unwrap();
    let (code, body) = http("PUT", port, "/v1/handlers/shop", Some(ACME), v2.clone()).await;
    assert_eq!(code, 503, "a failed store is an error: {body}");
    assert_eq!(
        digest_of(port, "shop").await,
        v1,
        "the registry reports the old version"
    );
    assert!(
        body["error"].as_str().unwrap().contains("nothing was swapped"),
        "{body}"
    );
    handled_once_more(&node, "acme").await;

    std::fs::remove_file(&handlers).unwrap();
    std::fs::rename(&aside, &handlers).unwrap();
    let (code, body) = http("PUT", port, "/v1/handlers/shop", Some(ACME), v2.clone()).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["swapped"], true, "the redeploy swaps: {body}");
    assert_eq!(body["previous"], v1, "{body}");
    assert_eq!(digest_of(port, "shop").await, digest(&v2));
    handled_once_more(&node, "acme").await;
    node.shutdown().await.unwrap();
    // And it was stored: served after a restart.
    let node = start(&cfg, &mem).await;
    assert_eq!(digest_of(port, "shop").await, digest(&v2));
    node.shutdown().await.unwrap();
}

/// Issue 18 item 5: every refusal of a 15 MiB upload (the size whose upload
/// was still running when the node answered, so the CLI used to report a
/// broken pipe) is reported with the node's status and reason, the file's
/// real size in a 413, and an exit code per class: 2 auth, 3 refused,
/// 4 transport. The control shows why `weir deploy` asks
/// `Expect: 100-continue`: a client that sends the body at once into the
/// same refusal loses the answer to a reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_of_a_15_mib_deploy_is_reported_with_its_class() {
    const SIZE: usize = 15 << 20;
    let mem = Arc::new(MemoryBroker::new());
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.wasm");
    std::fs::write(&junk, vec![7u8; SIZE]).unwrap();
    let junk = junk.to_str().unwrap().to_owned();
    let deploy = |port: u16, token: &str| -> Vec<String> {
        let admin = format!("http://127.0.0.1:{port}");
        [
            "deploy",
            "--admin",
            &admin,
            "--token",
            token,
            "--handler",
            "shop",
            &junk,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let expect = |out: &std::process::Output, code: i32, needles: &[&str]| {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{stderr}");
        for n in needles {
            assert!(stderr.contains(n), "wanted {n:?} in: {stderr}");
        }
        assert!(
            !stderr.contains("Broken pipe") && !stderr.contains("reset by peer"),
            "{stderr}"
        );
    };

    // Components up to 2 MiB, tokens configured.
    let port = free_port();
    let node = start(&config(port, None, None, true), &mem).await;
    let out = weir(deploy(port, "not-a-token")).await;
    expect(
        &out,
        2,
        &["401", "unknown token", "check --token", "running version stays"],
    );
    let out = weir(deploy(port, ACME)).await;
    expect(&out, 3, &["413", &SIZE.to_string(), "max_component_size"]);

    // The control: the same refusal to a client that sends all 48 MiB at
    // once (as `weir deploy` did) ends in a reset, the answer unread.
    let raw = tokio::task::spawn_blocking(move || {
        use std::io::{Read as _, Write as _};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let body = vec![7u8; 48 << 20];
        let head = format!(
            "PUT /v1/handlers/shop HTTP/1.1\r\nhost: x\r\nauthorization: Bearer not-a-token\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        let sent = s.write_all(head.as_bytes()).and_then(|()| s.write_all(&body));
        let mut answer = String::new();
        let read = s.read_to_string(&mut answer);
        (sent.is_err() || read.is_err(), answer)
    })
    .await
    .unwrap();
    assert!(
        raw.0,
        "control: sending the body into a refusal should break the connection; got {:?}",
        raw.1
    );
    node.shutdown().await.unwrap();

    // Components up to 32 MiB: the node reads it all and refuses what it is.
    let port = free_port();
    let text = config_text(port, None, None, true).replace("\"2MiB\"", "\"32MiB\"");
    let node = start(&config::parse(&text, "<deploy test>").unwrap(), &mem).await;
    let out = weir(deploy(port, ACME)).await;
    expect(
        &out,
        3,
        &["400", "not a valid WebAssembly component", "running version stays"],
    );
    node.shutdown().await.unwrap();

    // No tokens at all: deploys are disabled, whatever token is shown.
    let port = free_port();
    let node = start(&config(port, None, None, false), &mem).await;
    let out = weir(deploy(port, ACME)).await;
    expect(&out, 2, &["403", "deploys are disabled on this node (no admin_token)"]);
    node.shutdown().await.unwrap();

    // Nothing listening: transport.
    let out = weir(deploy(free_port(), ACME)).await;
    expect(&out, 4, &["cannot reach the admin listener"]);
}
