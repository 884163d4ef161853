//! The files an operator deploys with (issue 19, items 5 and 8), checked as
//! far as this machine allows: the systemd unit by `systemd-analyze verify`,
//! the Kubernetes manifests parsed as YAML with the node config inside them
//! parsed by Weir itself, the Dockerfile's command against the CLI, the
//! Prometheus scrape config and alert rules by `promtool`, and every query of
//! the Grafana dashboard parsed by `promtool` and naming metrics a node
//! serves. Each check has a red case that shows it can fail.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;

use yaml_rust2::{Yaml, YamlLoader};

mod common;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// `program args`: exit code and everything it printed. A missing program
/// fails with the package that brings it.
fn run(program: &str, args: &[&str], package: &str) -> (i32, String) {
    let out = Command::new(common::tools::ensure(program, package))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}: install it with `apt-get install {package}`"));
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// `systemd-analyze verify` of `unit` with its binary pointed at the one
/// this test built: what it printed (nothing when the unit is sound).
fn verify_unit(unit: &str, scratch: &Path) -> (i32, String) {
    let file = scratch.join("weir.service");
    std::fs::write(&file, unit.replace("/usr/local/bin/weir", env!("CARGO_BIN_EXE_weir"))).unwrap();
    run("systemd-analyze", &["verify", file.to_str().unwrap()], "systemd")
}

#[test]
fn the_systemd_unit_verifies() {
    let scratch = tempfile::tempdir().unwrap();
    let unit = read("deploy/systemd/weir.service");
    assert!(
        unit.contains("KillSignal=SIGTERM") && unit.contains("weir run --config"),
        "{unit}"
    );
    // It needs no user made by hand: systemd makes one that owns only the state directory.
    assert!(
        unit.contains("DynamicUser=yes") && unit.contains("StateDirectory=weir") && !unit.contains("User=weir"),
        "{unit}"
    );
    let (code, said) = verify_unit(&unit, scratch.path());
    assert!(
        code == 0 && said.trim().is_empty(),
        "systemd-analyze verify: exit {code}\n{said}"
    );
    // Red: a key systemd does not know is reported.
    let broken = unit.replace("Type=exec", "Type=exec\nRestartAfterLunch=yes");
    let (_, said) = verify_unit(&broken, scratch.path());
    assert!(said.contains("RestartAfterLunch"), "a bad unit verified clean: {said}");
}

/// The documents of a YAML file.
fn yaml(rel: &str) -> Vec<Yaml> {
    YamlLoader::load_from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel} is not YAML: {e}"))
}

fn kind<'a>(docs: &'a [Yaml], kind: &str) -> &'a Yaml {
    docs.iter()
        .find(|d| d["kind"].as_str() == Some(kind))
        .unwrap_or_else(|| panic!("no {kind} in the manifests"))
}

#[test]
fn the_kubernetes_manifests_parse_and_carry_a_valid_config() {
    let docs = yaml("deploy/kubernetes/weir.yaml");
    let secret = kind(&docs, "Secret");
    let toml = secret["stringData"]["weir.toml"]
        .as_str()
        .expect("the config in the secret");
    let cfg = weir::config::parse(toml, "<deploy/kubernetes/weir.yaml weir.toml>")
        .unwrap_or_else(|e| panic!("the manifest's config does not load: {e}"));
    let set = kind(&docs, "StatefulSet");
    let pod = &set["spec"]["template"];
    let container = &pod["spec"]["containers"][0];
    assert_eq!(container["readinessProbe"]["httpGet"]["path"].as_str(), Some("/ready"));
    assert_eq!(container["livenessProbe"]["httpGet"]["path"].as_str(), Some("/health"));
    let notes = &pod["metadata"]["annotations"];
    assert_eq!(notes["prometheus.io/scrape"].as_str(), Some("true"));
    assert_eq!(notes["prometheus.io/path"].as_str(), Some("/metrics"));
    // The scrape holds no token: it goes to the metrics listener, which
    // asks for none (the admin listener's /metrics answers it 401).
    assert!(
        cfg.node.admin_token.is_some(),
        "the manifest's admin listener has a token"
    );
    let metrics = cfg.node.metrics.expect("node.metrics in the manifest's config");
    assert_eq!(
        notes["prometheus.io/port"].as_str(),
        Some(metrics.port().to_string().as_str()),
        "the scrape port is the metrics listener's"
    );
    let ports = container["ports"].as_vec().expect("the container's ports");
    assert!(
        ports
            .iter()
            .any(|p| p["containerPort"].as_i64() == Some(i64::from(metrics.port()))),
        "the container declares the metrics port"
    );
    // SIGTERM drains up to cluster.drain_deadline: the grace period must outlast it.
    let grace = pod["spec"]["terminationGracePeriodSeconds"]
        .as_i64()
        .expect("a grace period");
    assert!(
        u64::try_from(grace).unwrap() > cfg.cluster.drain_deadline().as_secs(),
        "terminationGracePeriodSeconds {grace} <= drain_deadline {:?}",
        cfg.cluster.drain_deadline()
    );
    assert_eq!(
        pod["spec"]["volumes"][0]["secret"]["secretName"].as_str(),
        secret["metadata"]["name"].as_str()
    );
    // Red: a config key Weir does not know is refused by the same parse.
    let bad = toml.replace("[node]", "[node]\nadmin_tokne = \"x\"");
    assert!(weir::config::parse(&bad, "<red>").is_err());
}

#[test]
fn the_dockerfile_runs_a_command_the_cli_takes() {
    let docker = read("deploy/Dockerfile");
    let line = |prefix: &str| -> Vec<String> {
        let l = docker
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in the Dockerfile"));
        serde_json::from_str(&l[prefix.len()..]).unwrap_or_else(|e| panic!("{prefix} is not a JSON array: {e}"))
    };
    let entry = line("ENTRYPOINT ");
    let cmd = line("CMD ");
    assert_eq!(entry, ["/usr/local/bin/weir"]);
    // The same arguments, with a config that exists, and `--help` to stop
    // before a node starts: clap refuses an unknown flag even then.
    let scratch = tempfile::tempdir().unwrap();
    let cfg = scratch.path().join("weir.toml");
    std::fs::write(&cfg, "").unwrap();
    let args: Vec<String> = cmd
        .iter()
        .map(|a| {
            if a == "/etc/weir/weir.toml" {
                cfg.display().to_string()
            } else {
                a.clone()
            }
        })
        .collect();
    let check = |args: &[String]| {
        Command::new(env!("CARGO_BIN_EXE_weir"))
            .args(args)
            .arg("--help")
            .output()
            .unwrap()
    };
    let out = check(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Red: a flag the CLI does not have fails.
    let mut bad = args.clone();
    bad.push("--log-fromat".into());
    assert!(!check(&bad).status.success());
    // The toolchain the image builds with is the one the workspace asks for.
    let manifest = read("Cargo.toml");
    let wanted = manifest
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .map(|v| v.trim_matches('"').to_owned())
        .unwrap();
    assert!(
        docker.contains(&format!("FROM rust:{wanted}-")),
        "the image's Rust is not {wanted}"
    );
}

/// Copies of `docs/ops` with the token file pointed at one that exists.
fn ops_copy() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "t").unwrap();
    for f in ["prometheus.yml", "alerts.yml"] {
        let text = read(&format!("docs/ops/{f}")).replace("/etc/prometheus/weir-token", token.to_str().unwrap());
        std::fs::write(dir.path().join(f), text).unwrap();
    }
    dir
}

#[test]
fn the_scrape_config_and_alert_rules_pass_promtool() {
    let dir = ops_copy();
    let config = dir.path().join("prometheus.yml");
    let (code, said) = run("promtool", &["check", "config", config.to_str().unwrap()], "prometheus");
    assert_eq!(code, 0, "{said}");
    assert!(said.contains("6 rules found"), "{said}");
    // Red: a rule with a broken expression is refused.
    let rules = dir.path().join("alerts.yml");
    let text = std::fs::read_to_string(&rules).unwrap();
    std::fs::write(&rules, text.replace("weir_node_ready == 0", "weir_node_ready ==")).unwrap();
    let (code, _) = run("promtool", &["check", "rules", rules.to_str().unwrap()], "prometheus");
    assert_ne!(code, 0);
}

/// The metric names a node serves: the families of a running node's
/// `/metrics` in the text format.
async fn served_metrics() -> Vec<String> {
    let port = common::http::free_port();
    let cfg = weir::config::parse(
        &format!(
            "[node]\nadmin = \"127.0.0.1:{port}\"\n[[topology]]\nname = \"orders\"\nslots = 2\n\
             [[handler]]\nname = \"orders\"\ncomponent = \"bundled:orders\"\ntopology = \"orders\"\n\
             message_types = [\"order.placed\"]\n"
        ),
        "<packaging test>",
    )
    .unwrap();
    let node = weir::node::Node::start(
        &cfg,
        std::sync::Arc::new(weir::transport::memory::MemoryBroker::new()),
        weir::node::NodeOptions {
            workers: 1,
            runtime: common::cached(weir::runtime::RuntimeOptions::default()),
            ..weir::node::NodeOptions::default()
        },
    )
    .await
    .unwrap();
    common::http::wait_up(port);
    let text = tokio::task::spawn_blocking(move || {
        ureq::get(format!("http://127.0.0.1:{port}/metrics"))
            .header("Accept", "text/plain")
            .call()
            .unwrap()
            .into_body()
            .read_to_string()
            .unwrap()
    })
    .await
    .unwrap();
    node.shutdown().await.unwrap();
    // Sample names, and the families declared (some have no sample on a
    // memory node, e.g. the JetStream ack floors).
    text.lines()
        .filter_map(|l| match l.strip_prefix("# TYPE ") {
            Some(t) => t.split(' ').next(),
            None if l.starts_with('#') => None,
            None => l.split(['{', ' ']).next(),
        })
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_parses_and_reads_served_metrics() {
    let dash: serde_json::Value = serde_json::from_str(&read("docs/ops/grafana-dashboard.json")).unwrap();
    let served = served_metrics().await;
    assert!(served.contains(&"weir_messages_total".to_owned()), "{served:?}");
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let mut n = 0;
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            let expr = t["expr"]
                .as_str()
                .unwrap()
                .replace("$__rate_interval", "5m")
                .replace("$job", ".*")
                .replace("$instance", ".*");
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if word.starts_with("weir_") {
                    assert!(
                        served.iter().any(|s| s == word),
                        "panel {:?} reads {word}, which no node serves",
                        p["title"]
                    );
                }
            }
            n += 1;
            rules.push_str(&format!(
                "      - record: dashboard:q{n}\n        expr: {}\n",
                serde_json::to_string(&expr).unwrap()
            ));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dashboard-rules.yml");
    std::fs::write(&file, &rules).unwrap();
    let (code, said) = run("promtool", &["check", "rules", file.to_str().unwrap()], "prometheus");
    assert_eq!(code, 0, "a dashboard query does not parse:\n{said}\n{rules}");
    // Red: a query with a syntax error fails the same check.
    std::fs::write(&file, rules.replace("sum by (", "sum by (((")).unwrap();
    assert_ne!(
        run("promtool", &["check", "rules", file.to_str().unwrap()], "prometheus").0,
        0
    );
}
