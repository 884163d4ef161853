//! Issue 15, items 6, 8 and 9 (the admin API and directory grants under a
//! hostile tenant or client): grants that escape through a symlink (at
//! deploy, and swapped after it), HTTP timeouts and the connection cap
//! against raw sockets, uploads streamed to disk under a concurrency cap,
//! per-tenant deploy queues, and uniform 404s for tenant tokens.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::http::{call, digest, free_port, variant, wait_up};
use weir::config::{self, Config};
use weir::envelope::{self, header};
use weir::node::{Node, NodeOptions, bundled};
use weir::registry::Caller;
use weir::transport::memory::MemoryBroker;

const OPERATOR: &str = "operator-secret-0123456789";
const ACME: &str = "acme-secret-0123456789";
const GLOBEX: &str = "globex-secret-0123456789";
const TOPOLOGY: &str = "hostile-admin";
/// The `weir` binary; `WEIR_TEST_BIN` overrides it (a target directory
/// shared by several worktrees may hold another branch's build).
fn weir_bin() -> String {
    std::env::var("WEIR_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_weir").to_owned())
}

fn faulty() -> Vec<u8> {
    std::fs::read(bundled::FAULTY_PATH).unwrap()
}

/// `shop` (tenant acme, fresh instances, allowed `allow_dir`), `ledger`
/// (tenant globex), `ops` (no tenant).
fn config(port: u16, allow_dir: &Path, extra_node: &str) -> Config {
    let text = format!(
        r#"
[node]
name = "hostile-admin-test"
admin = "127.0.0.1:{port}"
admin_token = "{OPERATOR}"
max_component_size = "2MiB"
{extra_node}
[[topology]]
name = "{TOPOLOGY}"
slots = 1
[topology.retry]
ladder = ["100ms"]
max_deliver = 2
[[tenant]]
name = "acme"
token = "{ACME}"
allow = {{ dirs = [{allow:?}] }}
[[tenant]]
name = "globex"
token = "{GLOBEX}"
[[handler]]
name = "shop"
component = "{faulty}"
topology = "{TOPOLOGY}"
tenant = "acme"
instance_mode = "fresh"
message_types = ["ok", "admin.read"]
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
        allow = allow_dir.display().to_string(),
        faulty = bundled::FAULTY_PATH,
    );
    config::parse(&text, "<hostile admin test>").unwrap()
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

/// Have `shop` read `path` in the guest; what the read gave (from the dead letter).
async fn guest_reads(node: &Node, mem: &MemoryBroker, path: &str) -> String {
    let before = mem.dead_letters(TOPOLOGY).len();
    let msg = envelope::new_message(
        envelope::fresh_id(),
        "admin.read",
        Some(format!("g-{}", uuid::Uuid::new_v4())),
        Some("acme".into()),
        vec![],
        path.as_bytes().to_vec(),
    );
    node.publish(TOPOLOGY, &msg).await.unwrap();
    let start = Instant::now();
    loop {
        let letters = mem.dead_letters(TOPOLOGY);
        if letters.len() > before {
            return letters[before].header(header::ERROR).unwrap_or_default().to_owned();
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "admin.read never dead-lettered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Item 6: a grant is compared by where it resolves, at deploy and at every
/// instantiation; a symlink swapped after the deploy does not redirect it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_grant_cannot_escape_through_a_symlink() {
    let root = tempfile::tempdir().unwrap();
    let tenant = root.path().join("tenant-a");
    let data = tenant.join("data");
    let secret = root.path().join("secret");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::create_dir_all(&secret).unwrap();
    std::fs::write(data.join("passwd"), "mine").unwrap();
    std::fs::write(secret.join("passwd"), "root:secret").unwrap();
    std::os::unix::fs::symlink(&secret, tenant.join("escape")).unwrap();
    std::os::unix::fs::symlink(&data, tenant.join("grant")).unwrap();

    let port = free_port();
    let mem = Arc::new(MemoryBroker::new());
    let node = start(&config(port, &tenant, ""), &mem).await;
    let v2 = variant(&faulty(), "2");
    let v1 = digest(&faulty());

    // At deploy: the link under the allowed directory points out of it.
    let q = format!("/v1/handlers/shop?dir=/data:{}", tenant.join("escape").display());
    let (code, body) = http("PUT", port, &q, Some(ACME), v2.clone()).await;
    assert_eq!(
        code, 403,
        "a grant resolving outside tenant.allow.dirs is refused: {body}"
    );
    assert!(body["error"].as_str().unwrap().contains("resolves to"), "{body}");
    assert_eq!(common::http::current(port, Some(OPERATOR), "shop"), v1);

    // A link that stays inside is fine, and the guest reads through it.
    let q = format!("/v1/handlers/shop?dir=/data:{}", tenant.join("grant").display());
    let (code, body) = http("PUT", port, &q, Some(ACME), v2.clone()).await;
    assert_eq!(code, 200, "{body}");
    let seen = guest_reads(&node, &mem, "/data/passwd").await;
    assert!(seen.contains("ok mine"), "{seen}");

    // Swapped after the deploy: every new instance (instance_mode = fresh)
    // still sees the directory that was checked, never the new target.
    std::fs::remove_file(tenant.join("grant")).unwrap();
    std::os::unix::fs::symlink(&secret, tenant.join("grant")).unwrap();
    let seen = guest_reads(&node, &mem, "/data/passwd").await;
    assert!(
        seen.contains("ok mine") && !seen.contains("secret"),
        "a symlink swapped after the deploy must not redirect the grant: {seen}"
    );

    // The granted directory itself moved out of the allow list: new
    // instances are not given it any more.
    std::fs::rename(&data, root.path().join("moved-out")).unwrap();
    let seen = guest_reads(&node, &mem, "/data/passwd").await;
    assert!(
        seen.contains("denied"),
        "a grant now outside the allow list is withheld: {seen}"
    );
    node.shutdown().await.unwrap();
}

/// Item 9: for a tenant token, another tenant's handler and no handler at
/// all answer alike (status and body), on every route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_tokens_cannot_tell_another_tenants_handler_from_none() {
    let allow = tempfile::tempdir().unwrap();
    let port = free_port();
    let mem = Arc::new(MemoryBroker::new());
    let node = start(&config(port, allow.path(), ""), &mem).await;
    for (method, tail, body) in [
        ("GET", "", vec![]),
        ("PUT", "", faulty()),
        ("POST", "/rollback", vec![]),
    ] {
        let answer = |name: &str| {
            let path = format!("/v1/handlers/{name}{tail}");
            let body = body.clone();
            async move { http(method, port, &path, Some(GLOBEX), body).await }
        };
        let (other_code, other_body) = answer("shop").await;
        let (none_code, none_body) = answer("no-such-handler").await;
        assert_eq!(
            other_code, 404,
            "{method}{tail} on another tenant's handler: {other_body}"
        );
        assert_eq!(none_code, 404, "{method}{tail} on no handler: {none_body}");
        let strip = |b: &serde_json::Value, name: &str| b["error"].as_str().unwrap().replace(name, "NAME");
        assert_eq!(
            strip(&other_body, "shop"),
            strip(&none_body, "no-such-handler"),
            "{method}{tail}: the bodies differ"
        );
    }
    node.shutdown().await.unwrap();
}

/// Item 8: deploys queue per caller: while acme's queue is held (a deploy
/// compiling for ever), globex's and the operator's go through, and acme's
/// own second upload beyond its share is answered 429 with Retry-After.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_deploys_do_not_delay_anothers() {
    let allow = tempfile::tempdir().unwrap();
    let port = free_port();
    let mem = Arc::new(MemoryBroker::new());
    let node = start(&config(port, allow.path(), "admin_max_uploads_per_caller = 1"), &mem).await;
    let registry = node.registry();
    let held = registry.hold_queue(&Caller::Tenant("acme".into())).await;
    let acme = tokio::spawn(http(
        "PUT",
        port,
        "/v1/handlers/shop",
        Some(ACME),
        variant(&faulty(), "a"),
    ));

    let patience = Duration::from_secs(60);
    let (code, body) = tokio::time::timeout(
        patience,
        http(
            "PUT",
            port,
            "/v1/handlers/ledger",
            Some(GLOBEX),
            variant(&faulty(), "g"),
        ),
    )
    .await
    .expect("globex's deploy waited behind acme's queue");
    assert_eq!(code, 200, "{body}");
    let (code, body) = tokio::time::timeout(
        patience,
        http("PUT", port, "/v1/handlers/ops", Some(OPERATOR), variant(&faulty(), "o")),
    )
    .await
    .expect("the operator's deploy waited behind acme's queue");
    assert_eq!(code, 200, "{body}");
    assert!(!acme.is_finished(), "acme's deploy must still be queued");

    // acme's share (1) is taken by the queued deploy: raw request to see Retry-After.
    let answer = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(
            s,
            "PUT /v1/handlers/shop HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ACME}\r\nContent-Length: 4\r\n\r\nabcd"
        )
        .unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
    assert!(answer.to_ascii_lowercase().contains("retry-after: 5"), "{answer}");

    drop(held);
    let (code, body) = acme.await.unwrap();
    assert_eq!(code, 200, "acme's deploy runs once its queue moves: {body}");
    node.shutdown().await.unwrap();
}

// ---- a `weir run` process, seen from raw sockets -------------------------

struct Weir {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
    data: std::path::PathBuf,
}

impl Drop for Weir {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn weir_run(node_extra: &str) -> Weir {
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cfg = dir.path().join("node.toml");
    std::fs::write(
        &cfg,
        format!(
            "[node]\nname = \"hostile-admin\"\nadmin = \"127.0.0.1:{port}\"\nadmin_token = \"{OPERATOR}\"\n\
             data_dir = {data:?}\n{node_extra}\n\
             [[topology]]\nname = \"orders\"\nslots = 1\n\
             [[handler]]\nname = \"orders\"\ncomponent = \"bundled:orders\"\ntopology = \"orders\"\n\
             message_types = [\"order.placed\"]\n",
            data = data.display().to_string()
        ),
    )
    .unwrap();
    let child = Command::new(weir_bin())
        .args(["run", "--config"])
        .arg(&cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let w = Weir {
        child,
        port,
        _dir: dir,
        data,
    };
    let start = Instant::now();
    while raw_get(port, "/health").is_none() {
        assert!(start.elapsed() < Duration::from_secs(60), "weir run never came up");
        std::thread::sleep(Duration::from_millis(50));
    }
    w
}

fn raw_get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    out.starts_with("HTTP/1.1 200").then_some(out)
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap()
}

/// Whether the server closes `s` within `within` (EOF or reset; a response
/// before the close is read and returned).
fn closed_within(s: &mut TcpStream, within: Duration) -> Option<String> {
    s.set_read_timeout(Some(within)).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Some(String::from_utf8_lossy(&out).into_owned()),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return None;
            }
            Err(_) => return Some(String::from_utf8_lossy(&out).into_owned()),
        }
    }
}

/// Item 8: idle connections, headers that never end and an upload body
/// that stops are all closed by the server after their timeouts.
#[test]
fn idle_slow_and_stalled_connections_are_closed() {
    let w = weir_run("admin_header_timeout = \"1s\"\nadmin_idle_timeout = \"1s\"\nadmin_body_timeout = \"3s\"");
    let port = w.port;
    let mut idle: Vec<TcpStream> = (0..50)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    let mut slow: Vec<TcpStream> = (0..20)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            write!(s, "GET /health HTTP/1.1\r\nHost: x\r\nX-Never: ").unwrap();
            s
        })
        .collect();
    let mut stalled = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        stalled,
        "PUT /v1/handlers/orders HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {OPERATOR}\r\nContent-Length: 100000\r\n\r\n0123456789"
    )
    .unwrap();
    // Generous: the timeouts are 1 s and 3 s.
    let bound = Duration::from_secs(20);
    for (i, s) in idle.iter_mut().enumerate() {
        assert!(
            closed_within(s, bound).is_some(),
            "idle connection {i} still open after {bound:?}"
        );
    }
    for (i, s) in slow.iter_mut().enumerate() {
        assert!(
            closed_within(s, bound).is_some(),
            "slow-header connection {i} still open after {bound:?}"
        );
    }
    let answer = closed_within(&mut stalled, bound).expect("a stalled upload is still held");
    assert!(
        answer.starts_with("HTTP/1.1 408"),
        "a stalled upload is answered 408: {answer}"
    );
    assert!(raw_get(port, "/health").is_some(), "the listener still serves");
}

/// Item 8: at most `admin_max_connections` are held; more are closed at
/// once and take no file descriptor.
#[test]
fn connections_beyond_the_cap_are_closed_at_once() {
    let w = weir_run("admin_header_timeout = \"120s\"\nadmin_max_connections = 16");
    let (port, pid) = (w.port, w.child.id());
    let before = fds(pid);
    let mut conns: Vec<TcpStream> = (0..80)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    let mut closed = 0;
    let mut open = Vec::new();
    for s in &mut conns {
        if closed_within(s, Duration::from_millis(1500)).is_some() {
            closed += 1;
        } else {
            open.push(s.try_clone().unwrap());
        }
    }
    assert_eq!(
        open.len(),
        16,
        "exactly admin_max_connections are held ({closed} closed)"
    );
    let held = fds(pid);
    assert!(
        held <= before + 16 + 8,
        "the node holds {held} fds with 16 connections (it had {before})"
    );
    drop(conns);
    drop(open);
    let start = Instant::now();
    while raw_get(port, "/health").is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the listener never served again"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Item 8: eight 40 MiB uploads arriving at once are spooled to disk (the
/// node's RSS barely moves), a ninth is answered 503 with Retry-After, and
/// the running version stays.
#[test]
fn concurrent_big_uploads_are_spooled_to_disk_and_capped() {
    let w = weir_run(
        "max_component_size = \"64MiB\"\nadmin_max_uploads = 8\nadmin_max_uploads_per_caller = 8\n\
         admin_idle_timeout = \"120s\"\nadmin_body_timeout = \"300s\"",
    );
    let (port, pid) = (w.port, w.child.id());
    let (code, before) = call("GET", port, "/v1/handlers/orders", Some(OPERATOR), b"");
    assert_eq!(code, 200);
    let rss_before = rss_kib(pid);
    let chunk = vec![7u8; 1 << 20];
    let mut uploads = Vec::new();
    for _ in 0..8 {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(
            s,
            "PUT /v1/handlers/orders HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {OPERATOR}\r\nContent-Length: {}\r\n\r\n",
            48 << 20
        )
        .unwrap();
        uploads.push(s);
    }
    for _ in 0..40 {
        for s in &mut uploads {
            s.write_all(&chunk).unwrap();
        }
    }
    // Wait until the node has received most of it (the spool files grow).
    let spool = w.data.join("uploads");
    let spooled = || -> u64 {
        std::fs::read_dir(&spool)
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0)
    };
    let start = Instant::now();
    while spooled() < 8 * (36 << 20) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "uploads never reached the spool ({} bytes there)",
            spooled()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let grown_mib = rss_kib(pid).saturating_sub(rss_before) / 1024;
    assert!(
        grown_mib < 100,
        "8 x 40 MiB uploads in flight grew the node's RSS by {grown_mib} MiB"
    );
    // A ninth upload: the node is at admin_max_uploads.
    let mut ninth = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        ninth,
        "PUT /v1/handlers/orders HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {OPERATOR}\r\nContent-Length: 4\r\n\r\nabcd"
    )
    .unwrap();
    let answer = closed_within(&mut ninth, Duration::from_secs(30)).expect("no answer to the ninth upload");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.to_ascii_lowercase().contains("retry-after: 5"), "{answer}");
    drop(uploads);
    let (code, after) = call("GET", port, "/v1/handlers/orders", Some(OPERATOR), b"");
    assert_eq!(code, 200);
    assert_eq!(after["current"], before["current"], "the running version stays");
    let start = Instant::now();
    while spooled() > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "spooled uploads were not removed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
