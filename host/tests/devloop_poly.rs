#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Issue 18 in Python and JavaScript: from an empty folder outside the
//! repository to a deployed handler, with nothing but the `weir` binary,
//! python3 / node and the registries. `weir new` makes the project, its own
//! unit tests run natively (`python3 -m unittest`, `node --test`) and fail
//! when the handler stops rejecting bad input, `weir build` installs the
//! toolchain into the cache (once: the cache is kept across runs) and makes
//! the component, `weir call` runs it with a good and a bad payload, and a
//! changed version is deployed with `weir deploy` to a running node, which
//! then runs it.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::devloop::{compiled_cache, run, text};
use common::http::{free_port, wait_up};
use weir::config;
use weir::envelope::{self, header};
use weir::node::{Node, NodeOptions};
use weir::transport::memory::MemoryBroker;

const TOKEN: &str = "devloop-poly-operator-token";

/// `weir ARGS` in `dir`, with the toolchain and compiled-code caches kept across runs.
fn weir(dir: &Path, args: &[&str]) -> std::process::Output {
    common::devloop::weir(env!("CARGO_BIN_EXE_weir"), dir, args)
}

/// What differs between the languages.
struct Lang {
    /// `weir new` LANG.
    new: &'static str,
    /// The files `weir new` must make.
    files: &'static [&'static str],
    /// The handler's source file.
    source: &'static str,
    /// The project's unit tests: program and arguments.
    unit_test: (&'static str, &'static [&'static str]),
    /// What the unit test runner prints when all passed.
    passed: &'static str,
    /// (from, to) in the source: the reject of a payload that is not JSON
    /// turned into a success (the negative control of the unit test).
    break_reject: (&'static str, &'static str),
    /// (from, to) in the source: the default salutation changed.
    change: (&'static str, &'static str),
    /// (from, to) in the source, with the change: an exception the handler does not
    /// expect, thrown for the name "Boom" (issue 36 item 2).
    fault: (&'static str, &'static str),
    /// How its author would name that exception: type and message.
    exception: &'static str,
    /// Where it is thrown, as the fault text names it: the function, and the text of
    /// the line (whose number is looked up in the edited source).
    thrown_in: (&'static str, &'static str),
    /// `weir dev`: (from, to) in the source, a save that live sources run at once.
    live_save: (&'static str, &'static str),
    /// `weir dev`: a save that imports what the running component cannot load, and what the
    /// handler then logs for the name "Cy".
    live_import: (fn(&Path), &'static str),
}

const PYTHON: Lang = Lang {
    new: "python",
    files: &[
        "pyproject.toml",
        "app.py",
        "test_app.py",
        "weir_testing.py",
        "wit/handler.wit",
        "weir.toml",
        "README.md",
        ".gitignore",
    ],
    source: "app.py",
    unit_test: ("python3", &["-m", "unittest"]),
    passed: "OK",
    break_reject: (r#"raise reject(f"payload of \"greeting\" is not JSON: {e}")"#, "return"),
    change: (r#"or "Hello""#, r#"or "Howdy""#),
    fault: (
        r#"    if not name:"#,
        "    if name == \"Boom\":\n        raise ValueError(f\"no greeting for {name}\")\n    if not name:",
    ),
    exception: "ValueError: no greeting for Boom",
    thrown_in: ("greet", "raise ValueError("),
    live_save: ("greeting {name} (attempt", "hello {name} (attempt"),
    live_import: (
        |project| {
            let source = project.join("app.py");
            edit(&source, ("import json\n", "import json\nimport decimal\n"));
            edit(
                &source,
                (
                    "hello {name} (attempt",
                    "hello {name} {decimal.Decimal('1.5') * 2} (attempt",
                ),
            );
        },
        "hello Cy 3.0 (attempt 1)",
    ),
};

const JS: Lang = Lang {
    new: "javascript",
    files: &[
        "package.json",
        "handler.js",
        "handler.test.js",
        "testing/host.js",
        "testing/register.js",
        "testing/hooks.js",
        "wit/handler.wit",
        "weir.toml",
        "README.md",
        ".gitignore",
    ],
    source: "handler.js",
    unit_test: ("node", &["--test"]),
    passed: "# fail 0",
    break_reject: (
        r#"throw reject(`payload of "greeting" is not JSON: ${e.message}`);"#,
        "return;",
    ),
    change: ("?? 'Hello'", "?? 'Howdy'"),
    fault: (
        "  if (name === '') {",
        "  if (name === 'Boom') throw new TypeError(`no greeting for ${name}`);\n  if (name === '') {",
    ),
    exception: "TypeError: no greeting for Boom",
    thrown_in: ("greet", "throw new TypeError("),
    live_save: ("`greeting ${name} (attempt", "`hello ${name} (attempt"),
    // Another file: live sources run one, so from here each save is built.
    live_import: (
        |project| {
            std::fs::write(project.join("twice.js"), "export const twice = (x) => x * 2;\n").unwrap();
            let source = project.join("handler.js");
            edit(
                &source,
                (
                    "from 'weir:handler/host@0.2.0';\n",
                    "from 'weir:handler/host@0.2.0';\nimport { twice } from './twice.js';\n",
                ),
            );
            edit(
                &source,
                ("`hello ${name} (attempt", "`hello ${name} ${twice(1.5)} (attempt"),
            );
        },
        "hello Cy 3 (attempt 1)",
    ),
};

/// Replace `from` by `to` in `file`, which must contain it.
fn edit(file: &Path, (from, to): (&str, &str)) {
    let source = std::fs::read_to_string(file).unwrap();
    assert!(source.contains(from), "{} has no {from:?}", file.display());
    std::fs::write(file, source.replace(from, to)).unwrap();
}

/// Copy the files of a project (not its folders' build output) to `to`.
fn copy_project(from: &Path, to: &Path, files: &[&str]) {
    for f in files {
        let dst = to.join(f);
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(from.join(f), dst).unwrap();
    }
}

async fn from_an_empty_folder_to_a_running_node(lang: &Lang) {
    let started = Instant::now();
    let scratch = tempfile::tempdir().unwrap();
    let root = scratch.path();
    assert!(!root.starts_with(env!("CARGO_MANIFEST_DIR")), "outside the repository");

    // weir new
    let out = weir(root, &["new", lang.new, "greeter"]);
    assert!(out.status.success(), "{}", text(&out));
    let project = root.join("greeter");
    for f in lang.files {
        assert!(project.join(f).is_file(), "weir new {} made no {f}", lang.new);
    }
    let wit = std::fs::read_to_string(project.join("wit/handler.wit")).unwrap();
    assert!(wit.contains("package weir:handler@"), "{wit}");

    // The project's own unit tests, natively.
    let (program, args) = lang.unit_test;
    let tests = run(&project, program, args);
    assert!(
        tests.status.success() && text(&tests).contains(lang.passed),
        "{}",
        text(&tests)
    );
    // Negative control: the same tests fail on a handler that takes a payload
    // which is not JSON instead of rejecting it.
    let broken = root.join("broken");
    copy_project(&project, &broken, lang.files);
    edit(&broken.join(lang.source), lang.break_reject);
    let tests = run(&broken, program, args);
    assert!(
        !tests.status.success(),
        "the unit tests pass on a handler that does not reject bad input:\n{}",
        text(&tests)
    );

    // weir build: the toolchain (installed into the cache the first time), the component.
    let out = weir(&project, &["build"]);
    let built = text(&out);
    assert!(out.status.success(), "{built}");
    eprintln!("{built}");
    assert!(
        built.contains(&format!(
            "building {} component greeter",
            if lang.new == "python" { "python" } else { "js" }
        )),
        "{built}"
    );
    assert!(
        built.contains("built ") && built.contains("greeter.wasm (") && built.contains(" MiB, sha256 "),
        "{built}"
    );
    assert!(!project.join(".greeter.wasm.part").exists(), "the part file is left");
    let wasm = project.join("greeter.wasm");
    assert!(std::fs::metadata(&wasm).unwrap().len() > 1 << 20);

    // Built again from the same sources: the same component, not a new version (issue 36
    // item 3). The negative control: without the stamp of the last build's inputs the
    // toolchain runs again and its component differs, byte for byte.
    let digest = |built: &str| {
        let at = built.find("sha256 ").expect("a digest") + "sha256 ".len();
        built[at..at + 64].to_owned()
    };
    let first = digest(&built);
    let again = text(&weir(&project, &["build"]));
    assert_eq!(digest(&again), first, "{again}");
    assert!(again.contains("sources unchanged since the last build"), "{again}");
    std::fs::remove_file(project.join(".greeter.wasm.inputs")).unwrap();
    let unstamped = text(&weir(&project, &["build"]));
    assert!(unstamped.contains("building "), "{unstamped}");
    assert_ne!(
        digest(&unstamped),
        first,
        "the toolchain is reproducible now: the stamp may go ({unstamped})"
    );

    // A good payload: ok, the cascade, the log line.
    let good = weir(
        &project,
        &[
            "call",
            "greeter.wasm",
            "--type",
            "greeting",
            "--group",
            "g-1",
            "--payload",
            r#"{"name":"Ada"}"#,
        ],
    );
    let g = text(&good);
    eprintln!("{g}");
    assert_eq!(good.status.code(), Some(0), "{g}");
    assert!(g.contains("outcome  ok"), "{g}");
    assert!(
        g.contains(r#"cascade  greeted  group g-1  {"name":"Ada","text":"Hello, Ada!"}"#),
        "{g}"
    );
    assert!(g.contains("log      info   greeting Ada (attempt 1)"), "{g}");
    // A bad one: rejected with the reason, nothing published, and not ok.
    let bad = weir(
        &project,
        &["call", "greeter.wasm", "--type", "greeting", "--payload", "not json"],
    );
    let b = text(&bad);
    eprintln!("{b}");
    assert_eq!(bad.status.code(), Some(1), "{b}");
    assert!(
        b.contains(r#"outcome  reject: payload of "greeting" is not JSON: "#),
        "{b}"
    );
    assert!(!b.contains("outcome  ok") && !b.contains("cascade"), "{b}");
    let nameless = weir(
        &project,
        &[
            "call",
            "greeter.wasm",
            "--type",
            "greeting",
            "--payload",
            r#"{"name":" "}"#,
        ],
    );
    assert!(
        text(&nameless).contains("outcome  reject: a greeting needs a name"),
        "{}",
        text(&nameless)
    );
    // Config keys reach the guest.
    let hi = weir(
        &project,
        &[
            "call",
            "greeter.wasm",
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
name = "devloop-{lang}"
admin = "127.0.0.1:{port}"
admin_token = "{TOKEN}"
[[topology]]
name = "greeter"
slots = 1
[[handler]]
name = "greeter"
component = {wasm:?}
topology = "greeter"
message_types = ["greeting"]
[topology.retry]
ladder = []
max_deliver = 1
"#,
            lang = lang.new,
            wasm = wasm.display().to_string()
        ),
        "<devloop_poly test>",
    )
    .unwrap();
    let mem = Arc::new(MemoryBroker::new());
    let node = Node::start(
        &cfg,
        mem.clone(),
        NodeOptions {
            workers: 1,
            runtime: weir::runtime::RuntimeOptions {
                cache_dir: Some(compiled_cache()),
                ..weir::runtime::RuntimeOptions::default()
            },
            ..NodeOptions::default()
        },
    )
    .await
    .unwrap();
    wait_up(port);
    edit(&project.join(lang.source), lang.change);
    edit(&project.join(lang.source), lang.fault);
    let source = std::fs::read_to_string(project.join(lang.source)).unwrap();
    let thrown_at = 1 + source
        .lines()
        .position(|l| l.contains(lang.thrown_in.1))
        .expect("the line that throws");
    let rebuilt = weir(&project, &["build"]);
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
            "greeter",
            "greeter.wasm",
        ],
    );
    assert!(
        deployed.status.success() && text(&deployed).contains("deployed: `greeter` now runs"),
        "{}",
        text(&deployed)
    );

    // The node runs the new version: its cascade (which nothing handles, so it
    // is dead-lettered with its payload) says Howdy.
    let greeted = publish_until_dead_letter(&node, &mem, "dev-1", r#"{"name":"Cy"}"#, |w| {
        w.header(header::MESSAGE_TYPE) == Some("greeted")
    })
    .await;
    assert_eq!(
        String::from_utf8_lossy(&greeted.body),
        r#"{"name":"Cy","text":"Howdy, Cy!"}"#
    );

    // An exception the handler did not expect: its fault text names it as its author
    // would, with the file and line it was thrown at (issue 36 item 2). What it says
    // without that work, the runtime's own words, is in `trap_text`'s unit tests.
    let boomed = publish_until_dead_letter(&node, &mem, "dev-boom", r#"{"name":"Boom"}"#, |w| {
        w.header(header::MESSAGE_ID) == Some("dev-boom")
    })
    .await;
    let error = boomed.header(header::ERROR).unwrap_or_default().to_owned();
    eprintln!("{}: the fault text: {error}", lang.new);
    let (function, _) = lang.thrown_in;
    let said = format!("{} (at {}:{thrown_at} in {function}) [", lang.exception, lang.source);
    assert!(
        error
            .strip_prefix("handler trapped: ")
            .is_some_and(|e| e.starts_with(&said)),
        "the fault text does not begin with {said:?}: {error}"
    );
    // Its second line: the frames that led there, the exported `handle` among them.
    let frames = error.lines().nth(1).unwrap_or_default();
    assert!(
        frames.contains(&format!("{}:", lang.source)) && frames.contains(" in handle"),
        "{error}"
    );
    node.shutdown().await.unwrap();
    live_sources_in_weir_dev(lang, &project);
    eprintln!(
        "{}: from an empty folder to a running node in {:.1?}",
        lang.new,
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_handler_from_an_empty_folder_to_a_running_node() {
    from_an_empty_folder_to_a_running_node(&PYTHON).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_javascript_handler_from_an_empty_folder_to_a_running_node() {
    from_an_empty_folder_to_a_running_node(&JS).await;
}

/// Publish a `greeting` with `payload` to the node, and wait for the first dead letter that
/// `matches`.
async fn publish_until_dead_letter(
    node: &Node,
    mem: &MemoryBroker,
    id: &str,
    payload: &str,
    matches: impl Fn(&weir::envelope::Wire) -> bool,
) -> weir::envelope::Wire {
    let msg = envelope::new_message(
        id.into(),
        "greeting",
        Some("g".into()),
        None,
        vec![],
        payload.as_bytes().to_vec(),
    );
    node.publish("greeter", &msg).await.unwrap();
    let start = Instant::now();
    loop {
        let dead = mem.dead_letters("greeter");
        if let Some(w) = dead.into_iter().find(|w| matches(w)) {
            return w;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no dead letter after {id}: {:?}",
            mem.dead_letters("greeter")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `weir dev` on a Python or JavaScript project (issue 36 item 3): a save that adds no import
/// runs with the next message, with no build; a new import builds again, and the new version
/// runs it.
fn live_sources_in_weir_dev(lang: &Lang, project: &Path) {
    use std::io::{BufRead as _, Write as _};
    let port = free_port();
    let mut dev = std::process::Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(["dev", "--admin", &format!("127.0.0.1:{port}")])
        .current_dir(project)
        .env("XDG_CACHE_HOME", common::devloop::cache_home())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();
    let mut stdin = dev.stdin.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel::<String>();
    let stdout = dev.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            eprintln!("weir dev | {line}");
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // The lines up to the first that contains `want`; none may contain `never`.
    let until = |want: &str, never: &str| -> Vec<String> {
        // Generous: the first line waits for a cold compile of a 17 MiB component (28 s on an
        // idle machine of this kind), with the JavaScript test running beside it.
        let deadline = Instant::now() + Duration::from_secs(600);
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("weir dev never printed {want:?}; it printed:\n{}", seen.join("\n")));
            assert!(
                never.is_empty() || !line.contains(never),
                "weir dev printed {never:?} before {want:?}:\n{}\n{line}",
                seen.join("\n")
            );
            let done = line.contains(want);
            seen.push(line);
            if done {
                return seen;
            }
        }
    };
    until("Ctrl-C stops", "");
    writeln!(stdin, r#"greeting {{"name":"Ann"}}"#).unwrap();
    until("greeting Ann (attempt 1)", "");

    // A save: the next message runs it, and nothing is built.
    edit(&project.join(lang.source), lang.live_save);
    until("saved; the next message runs it (live sources: no build)", "rebuilding");
    writeln!(stdin, r#"greeting {{"name":"Bo"}}"#).unwrap();
    until("hello Bo (attempt 1)", "rebuilding");

    // A new import of a module the component does not hold: built again, then run.
    (lang.live_import.0)(project);
    until(
        "an import or a file other than the sources changed; rebuilding",
        "saved;",
    );
    // Until the new component is swapped in, the previous sources serve: a message that runs
    // meanwhile (the toolchain takes seconds) is not failed for the module the running
    // component does not hold (without that, it is retried: `ModuleNotFoundError: decimal`,
    // or JavaScript's SyntaxError for an import in evaluated code).
    writeln!(stdin, r#"greeting {{"name":"Di"}}"#).unwrap();
    let meanwhile = until("weir dev: swapped; new messages run the new version", "retry:");
    assert!(
        meanwhile.iter().any(|l| l.contains("hello Di (attempt 1)")) || meanwhile.iter().all(|l| !l.contains("Di")),
        "{}",
        meanwhile.join("\n")
    );
    writeln!(stdin, r#"greeting {{"name":"Cy"}}"#).unwrap();
    until(lang.live_import.1, "");

    // SAFETY: a signal to the child this test started.
    unsafe {
        libc::kill(i32::try_from(dev.id()).unwrap(), libc::SIGINT);
    }
    drop(stdin);
    assert!(dev.wait().unwrap().success());
}
