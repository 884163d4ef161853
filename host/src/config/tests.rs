use super::load::section_at;
use super::*;
use crate::retry::schedule::Origin;
use crate::retry::schedule::Violation;

const DESIGN_EXAMPLE: &str = include_str!("../../tests/config/design-example.toml");

fn invalid(text: &str) -> Vec<Violation> {
    match parse(text, "weir.toml") {
        Err(ConfigError::Invalid { origin, issues }) => {
            assert_eq!(origin, "weir.toml");
            issues
        }
        other => panic!("expected Invalid, got {other:?}"),
    }
}

/// Asserts that validation fails with exactly one issue at `key`, whose message contains
/// `needle`, and that the rendered error names the file and the key.
fn assert_one(text: &str, key: &str, needle: &str) {
    let issues = invalid(text);
    assert_eq!(issues.len(), 1, "{issues:#?}");
    assert_eq!(issues[0].key, key, "{issues:#?}");
    assert!(
        issues[0].message.contains(needle),
        "{:?} lacks {needle:?}",
        issues[0].message
    );
    let rendered = parse(text, "weir.toml").map(|_| ()).unwrap_err().to_string();
    assert!(rendered.starts_with("weir.toml: "), "{rendered}");
    assert!(rendered.contains(key), "{rendered}");
}

fn syntax(text: &str) -> String {
    match parse(text, "conf/weir.toml") {
        Err(e @ ConfigError::Syntax { .. }) => e.to_string(),
        other => panic!("expected Syntax, got {other:?}"),
    }
}

/// A minimal valid config, with room to add lines.
fn base(extra: &str) -> String {
    format!(
        "[[topology]]\nname = \"orders\"\nslots = 4\n\n[[handler]]\nname = \"h\"\n\
         component = \"h.wasm\"\ntopology = \"orders\"\nmessage_types = [\"a\"]\n{extra}"
    )
}

#[test]
fn node_budgets_and_instance_pool_parse_default_and_name_their_keys() {
    let c = parse(&base(""), "weir.toml").unwrap();
    assert_eq!(c.node.budgets, Budgets::default());
    assert_eq!(c.node.budgets.to_runtime(), crate::runtime::CallBudgets::default());
    assert_eq!(c.node.instance_pool, None);
    let text = format!(
        "[node]\ninstance_pool = 1024\n[node.budgets]\ncascade_bytes = \"1MiB\"\nlog_lines = 10\n{}",
        base("")
    );
    let c = parse(&text, "weir.toml").unwrap();
    assert_eq!(c.node.budgets.cascade_bytes, ByteSize(1 << 20));
    assert_eq!(c.node.budgets.log_lines, 10);
    assert_eq!(
        c.node.budgets.log_bytes,
        defaults::LOG_BYTES,
        "the others keep their defaults"
    );
    assert_eq!(c.node.instance_pool, Some(1024));
    assert_one(
        &format!("[node.budgets]\nlog_lines = 0\n{}", base("")),
        "node.budgets.log_lines",
        "positive",
    );
    assert_one(
        &format!("[node.budgets]\nerror_bytes = 10\n{}", base("")),
        "node.budgets.error_bytes",
        "128B or more",
    );
    assert_one(
        &format!("[node]\ninstance_pool = 100000\n{}", base("")),
        "node.instance_pool",
        "1 to 4096",
    );
    let err = parse(&format!("[node.budgets]\nlog_lnes = 1\n{}", base("")), "weir.toml").unwrap_err();
    assert!(err.to_string().contains("log_lnes"), "{err}");
}

#[test]
fn tenant_budgets_default_to_the_nodes_and_name_their_keys() {
    let tenant = |budgets: &str| {
        format!(
            "[node.budgets]\nlog_lines = 100\n{}[[tenant]]\nname = \"acme\"\n{budgets}\n",
            base("")
        )
    };
    let c = parse(&tenant(""), "weir.toml").unwrap();
    assert_eq!(
        c.call_budgets(c.tenant("acme")),
        None,
        "no budgets of its own: the node's"
    );
    let c = parse(
        &tenant("budgets = { log_lines = 10, error_bytes = \"1KiB\", log_bytes_per_second = \"1MiB\" }"),
        "weir.toml",
    )
    .unwrap();
    let b = c.call_budgets(c.tenant("acme")).unwrap();
    assert_eq!((b.log_lines, b.error_bytes), (10, 1024));
    let node = c.node.budgets.to_runtime();
    assert_eq!(
        (b.log_bytes, b.cascade_bytes),
        (node.log_bytes, node.cascade_bytes),
        "the rest: the node's"
    );
    assert_eq!(c.tenant[0].budgets.log_bytes_per_second, Some(ByteSize(1 << 20)));
    assert_one(
        &tenant("budgets = { log_lines = 101 }"),
        "tenant[0].budgets.log_lines",
        "above node.budgets.log_lines",
    );
    assert_one(
        &tenant("budgets = { cascade_bytes = \"1GiB\" }"),
        "tenant[0].budgets.cascade_bytes",
        "above_node = true",
    );
    assert!(parse(&tenant("budgets = { log_lines = 101, above_node = true }"), "weir.toml").is_ok());
    assert_one(
        &tenant("budgets = { log_bytes = 0 }"),
        "tenant[0].budgets.log_bytes",
        "is 0",
    );
    assert_one(
        &tenant("budgets = { error_bytes = 10 }"),
        "tenant[0].budgets.error_bytes",
        "128B or more",
    );
    assert_one(
        &tenant("budgets = { log_lines_per_second = 0 }"),
        "tenant[0].budgets.log_lines_per_second",
        "is 0",
    );
    let err = parse(&tenant("budgets = { log_lnes = 1 }"), "weir.toml").unwrap_err();
    assert!(err.to_string().contains("log_lnes"), "{err}");
}

#[test]
fn tenant_handlers_stay_within_their_tenant() {
    let tenant = "[[tenant]]\nname = \"acme\"\nlimits = { memory = \"32MiB\", timeout = \"2s\", fuel = 1000 }\n\
                  allow = { env = [\"REGION\"], dirs = [\"/srv/acme\"] }\n";
    let handler = |extra: &str| {
        format!(
            "[[topology]]\nname = \"orders\"\nslots = 4\n{tenant}\n[[handler]]\nname = \"h\"\n\
             component = \"h.wasm\"\ntopology = \"orders\"\ntenant = \"acme\"\nmessage_types = [\"a\"]\n{extra}"
        )
    };
    // Defaults above the tenant's limits are lowered, not refused.
    parse(&handler(""), "weir.toml").expect("defaults are capped");
    assert_one(
        &handler("limits = { memory = \"48MiB\" }"),
        "handler[0].limits.memory",
        "tenant \"acme\"'s limit",
    );
    assert_one(
        &handler("limits = { timeout = \"3s\" }"),
        "handler[0].limits.timeout",
        "at most that",
    );
    assert_one(
        &handler("limits = { fuel = 2000 }"),
        "handler[0].limits.fuel",
        "above tenant",
    );
    assert_one(
        &handler("wasi = { env = [\"HOME\"] }"),
        "handler[0].wasi.env[0]",
        "\"HOME\" is not allowed",
    );
    assert_one(
        &handler("wasi = { preopens = [{ host = \"/etc\", guest = \"/etc\" }] }"),
        "handler[0].wasi.preopens[0].host",
        "not within",
    );
    assert_one(
        &handler("wasi = { preopens = [{ host = \"/srv/acme/../../etc\", guest = \"/x\" }] }"),
        "handler[0].wasi.preopens[0].host",
        "not within",
    );
    assert_one(
        &handler("wasi = { preopens = [{ host = \"/srv/acme/data\", guest = \"/d\", read_only = false }] }"),
        "handler[0].wasi.preopens[0].read_only",
        "read-only",
    );
    assert_one(
        &handler("wasi = { network = true }"),
        "handler[0].wasi.network",
        "sockets",
    );
    parse(
        &handler("wasi = { env = [\"REGION\"], preopens = [{ host = \"/srv/acme/data\", guest = \"/d\" }] }"),
        "weir.toml",
    )
    .expect("grants within the allowance");
}

#[test]
fn tokens_are_unique_and_tenants_named_once() {
    let issues = invalid(&base(
        "[node]\nadmin_token = \"same-secret-0123456789\"\n[[tenant]]\nname = \"a\"\ntoken = \"same-secret-0123456789\"\n\
         [[tenant]]\nname = \"a\"\nlimits = { concurrency = 0 }\n",
    ));
    let keys: Vec<&str> = issues.iter().map(|v| v.key.as_str()).collect();
    assert_eq!(
        keys,
        ["tenant[0].token", "tenant[1].name", "tenant[1].limits.concurrency"],
        "{issues:#?}"
    );
}

#[test]
fn within_compares_whole_components() {
    assert!(is_within(Path::new("/srv/acme/data"), Path::new("/srv/acme")));
    assert!(is_within(Path::new("/srv/acme"), Path::new("/srv/acme")));
    assert!(is_within(Path::new("/srv/./acme/x"), Path::new("/srv/acme")));
    assert!(!is_within(Path::new("/srv/acme-evil"), Path::new("/srv/acme")));
    assert!(!is_within(Path::new("/srv/acme/../x"), Path::new("/srv/acme")));
    assert!(!is_within(Path::new("/srv"), Path::new("/srv/acme")));
}

#[test]
fn design_example_parses() {
    let c = parse(DESIGN_EXAMPLE, "design-example.toml").expect("the DESIGN.md config parses");
    assert_eq!(c.node.name, "node-a");
    assert_eq!(c.node.admin, Some("127.0.0.1:9464".parse().expect("addr")));
    assert_eq!(c.transport.kind, TransportKind::Rabbitmq);
    assert_eq!(c.transport.prefetch, 256);
    assert_eq!(c.cluster.mode, ClusterMode::Postgres);
    assert_eq!(c.cluster.lease, Duration::from_secs(5));
    assert_eq!(c.topology.len(), 1);
    let t = &c.topology[0];
    assert_eq!(
        (t.name.as_str(), t.slots, t.max_concurrent_groups, t.max_unordered),
        ("orders", 6, 64, 16)
    );
    let p = t.retry_policy(TransportKind::Rabbitmq);
    assert_eq!(p.ladder, [1, 5, 30].map(Duration::from_secs));
    assert_eq!(p.max_deliver, 5);
    assert_eq!(p.max_time_to_dead_letter, Some(Duration::from_secs(600)));
    assert_eq!(p.origin, Origin::Configured);
    let h = &c.handler[0];
    assert_eq!(h.component, PathBuf::from("examples/rust/orders/orders.wasm"));
    assert_eq!(h.message_types, ["order.placed", "order.paid"]);
    assert_eq!(h.tenant.as_deref(), Some("acme"));
    let b = h.batch.as_ref().expect("batch");
    assert_eq!(
        (b.message_types.as_slice(), b.size, b.linger),
        (&["order.line-added".to_string()][..], 100, Duration::from_millis(20))
    );
    assert_eq!(h.limits.memory, ByteSize(64 << 20));
    assert_eq!(h.limits.timeout, Duration::from_secs(5));
    assert_eq!(h.limits.instances, 16);
    assert_eq!(h.config.get("currency").map(String::as_str), Some("EUR"));
    assert_eq!(h.instance_mode, InstanceMode::Reuse);
    assert_eq!(h.wasi, Wasi::default());
    assert_eq!(c.validate().expect("valid"), Vec::<Violation>::new());
}

#[test]
fn an_empty_file_is_a_memory_solo_node() {
    let c = parse("", "<inline>").expect("empty config");
    assert_eq!(c.transport.kind, TransportKind::Memory);
    assert_eq!(c.cluster.mode, ClusterMode::Solo);
    assert!(!c.node.name.is_empty());
    assert!(
        c.node.name.ends_with(&format!("-{}", std::process::id())),
        "{}",
        c.node.name
    );
}

#[test]
fn defaults_fill_every_omitted_key() {
    let c = parse(&base(""), "<inline>").expect("valid");
    let t = &c.topology[0];
    assert_eq!(t.max_concurrent_groups, defaults::MAX_CONCURRENT_GROUPS);
    assert_eq!(t.max_unordered, defaults::MAX_UNORDERED);
    assert_eq!(t.retry_policy(TransportKind::Rabbitmq), RetryPolicy::default());
    let h = &c.handler[0];
    assert_eq!(h.limits.memory, defaults::MEMORY);
    assert_eq!(h.limits.max_stack, None);
    assert_eq!(h.instance_mode, InstanceMode::Reuse);
    assert!(!h.wasi.inherit_stdio && !h.wasi.network && h.wasi.env.is_empty() && h.wasi.preopens.is_empty());
    assert_eq!(c.transport.prefetch, defaults::PREFETCH);
    // a partial retry section keeps the other defaults but counts as configured
    let c = parse(
        &base("").replace("slots = 4\n", "slots = 4\n[topology.retry]\nmax_deliver = 9\n"),
        "<inline>",
    )
    .expect("valid");
    let p = c.topology[0].retry_policy(c.transport.kind);
    assert_eq!((p.ladder.len(), p.max_deliver, p.origin), (3, 9, Origin::Configured));
}

#[test]
fn handler_fields_beyond_the_example_parse() {
    let c = parse(
        &base(
            "instance_mode = \"fresh\"\nlimits = { memory = \"512KiB\", max_stack = 1048576, timeout = \"250ms\" }\n\
             wasi = { env = [\"RUST_LOG\"], inherit_stdio = true, network = true, \
             preopens = [{ host = \"data\", guest = \"/data\" }, { host = \"/tmp\", guest = \"/tmp\", read_only = false }] }\n",
        ),
        "/etc/weir/weir.toml",
    )
    .expect("valid");
    let h = &c.handler[0];
    assert_eq!(h.instance_mode, InstanceMode::Fresh);
    assert_eq!(h.limits.memory, ByteSize(512 * 1024));
    assert_eq!(h.limits.max_stack, Some(ByteSize(1 << 20)));
    assert_eq!(h.limits.timeout, Duration::from_millis(250));
    assert_eq!(h.wasi.env, ["RUST_LOG"]);
    assert!(h.wasi.inherit_stdio && h.wasi.network);
    assert_eq!(h.wasi.preopens[0].host, PathBuf::from("/etc/weir/data"));
    assert!(h.wasi.preopens[0].read_only);
    assert_eq!(h.wasi.preopens[1].host, PathBuf::from("/tmp"));
    assert!(!h.wasi.preopens[1].read_only);
    // component paths are resolved against the config file's directory
    assert_eq!(h.component, PathBuf::from("/etc/weir/h.wasm"));
}

#[test]
fn load_reads_a_file_and_names_it_in_errors() {
    let dir = std::env::temp_dir().join(format!("weir-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tempdir");
    let path = dir.join("weir.toml");
    std::fs::write(&path, base("")).expect("write");
    let c = load(&path).expect("loads");
    assert_eq!(c.handler[0].component, dir.join("h.wasm"));
    assert_eq!(c.origin, path.display().to_string());
    let missing = dir.join("missing.toml");
    let err = load(&missing).expect_err("missing file").to_string();
    assert!(err.contains("missing.toml") && err.contains("cannot read"), "{err}");
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn byte_sizes() {
    for (text, bytes) in [
        ("64MiB", 64u64 << 20),
        ("512KiB", 512 << 10),
        ("1GiB", 1 << 30),
        ("1 GiB", 1 << 30),
        ("4096", 4096),
        ("7B", 7),
        ("2TiB", 2 << 40),
    ] {
        assert_eq!(ByteSize::parse(text), Ok(ByteSize(bytes)), "{text}");
    }
    for bad in ["", "MiB", "64MB", "64 mib", "-1", "1.5GiB", "99999999999999TiB"] {
        assert!(ByteSize::parse(bad).is_err(), "{bad}");
    }
    assert!(ByteSize::parse("64MB").unwrap_err().contains("KiB, MiB"));
    assert_eq!(ByteSize(64 << 20).to_string(), "64MiB");
    assert_eq!(ByteSize(1000).to_string(), "1000B");
}

// ---- syntax-level errors: the toml crate's line/column, prefixed with the file ----

#[test]
fn unknown_key_is_named_with_its_line_and_table() {
    let e = syntax(&base("colour = \"blue\"\n"));
    assert!(e.starts_with("conf/weir.toml: in handler[0]: "), "{e}");
    assert!(e.contains("colour") && e.contains("line 10"), "{e}");
    let e = syntax("[node]\nnmae = \"x\"\n");
    assert!(
        e.contains("in node:") && e.contains("nmae") && e.contains("`admin`"),
        "{e}"
    );
    let e = syntax("[[topology]]\nname = \"a\"\nslots = 1\n[topology.retry]\nladdder = []\n");
    assert!(e.contains("in topology[0].retry:") && e.contains("laddder"), "{e}");
}

#[test]
fn bad_size_names_the_value_and_accepted_units() {
    let text = base("").replace(
        "[[handler]]",
        "[[handler]]\nname = \"x\"\ncomponent = \"x\"\ntopology = \"orders\"\nmessage_types = [\"b\"]\n\n[[handler]]",
    ) + "limits = { memory = \"64 megs\" }\n";
    let e = syntax(&text);
    assert!(e.contains("in handler[1]:"), "{e}");
    assert!(
        e.contains("\"64 megs\"") && e.contains("MiB") && e.contains("memory"),
        "{e}"
    );
}

#[test]
fn bad_duration_names_the_value() {
    let e = syntax("[cluster]\nlease = \"5 parsecs\"\n");
    assert!(
        e.contains("in cluster:") && e.contains("5 parsecs") && e.contains("\"5s\""),
        "{e}"
    );
    let e = syntax("[[topology]]\nname = \"a\"\nslots = 1\nretry = { ladder = [\"1s\", \"soon\"] }\n");
    assert!(e.contains("ladder[1]") && e.contains("soon"), "{e}");
}

#[test]
fn unknown_enum_values_list_the_accepted_ones() {
    let e = syntax("[transport]\nkind = \"kafka\"\n");
    assert!(
        e.contains("kafka") && e.contains("memory") && e.contains("rabbitmq") && e.contains("nats"),
        "{e}"
    );
    let e = syntax("[cluster]\nmode = \"raft\"\n");
    assert!(e.contains("rabbitmq-sac") && e.contains("postgres"), "{e}");
    let e = syntax(&base("instance_mode = \"pooled\"\n"));
    assert!(e.contains("reuse") && e.contains("fresh"), "{e}");
}

#[test]
fn non_string_handler_config_value_names_the_key() {
    let e = syntax(&base("config = { currency = \"EUR\", retries = 3 }\n"));
    assert!(e.contains("config.retries") && e.contains("retries = \"3\""), "{e}");
    assert!(e.contains("in handler[0]"), "{e}");
}

#[test]
fn invalid_toml_keeps_line_and_column() {
    let e = syntax("[node\nname = 1\n");
    assert!(e.starts_with("conf/weir.toml: ") && e.contains("line 1"), "{e}");
}

// ---- validation errors: each names its key ----

#[test]
fn zero_slots() {
    assert_one(
        &base("").replace("slots = 4", "slots = 0"),
        "topology[0].slots",
        "accepted: 1 or more",
    );
}

#[test]
fn topology_name_not_fit_for_broker_objects() {
    let text = base("").replace("\"orders\"", "\"Orders.EU\"");
    assert_one(&text, "topology[0].name", "[a-z0-9_-]+");
}

#[test]
fn duplicate_topology_name() {
    let text = format!("[[topology]]\nname = \"orders\"\nslots = 1\n{}", base(""));
    let issues = invalid(&text);
    assert_eq!(issues.len(), 1, "{issues:#?}");
    assert_eq!(issues[0].key, "topology[1].name");
    assert!(issues[0].message.contains("topology[0]"));
}

#[test]
fn zero_concurrency() {
    assert_one(
        &base("").replace("slots = 4", "slots = 4\nmax_concurrent_groups = 0"),
        "topology[0].max_concurrent_groups",
        "1 or more",
    );
    assert_one(
        &base("").replace("slots = 4", "slots = 4\nmax_unordered = 0"),
        "topology[0].max_unordered",
        "1 or more",
    );
}

#[test]
fn duplicate_handler_name() {
    let text = base("")
        + "\n[[handler]]\nname = \"h\"\ncomponent = \"h2.wasm\"\ntopology = \"orders\"\nmessage_types = [\"b\"]\n";
    assert_one(&text, "handler[1].name", "handler[0]");
}

#[test]
fn bad_handler_name() {
    assert_one(
        &base("").replace("name = \"h\"", "name = \"my handler\""),
        "handler[0].name",
        "letters, digits",
    );
}

#[test]
fn handler_topology_must_exist() {
    assert_one(
        &base("").replace("topology = \"orders\"", "topology = \"order\""),
        "handler[0].topology",
        "[\"orders\"]",
    );
}

#[test]
fn handler_must_bind_a_message_type() {
    assert_one(
        &base("").replace("message_types = [\"a\"]", "message_types = []"),
        "handler[0].message_types",
        "at least one",
    );
    assert_one(
        &base("").replace("[\"a\"]", "[\"a\", \"\"]"),
        "handler[0].message_types[1]",
        "is empty",
    );
    // batch-only handlers are fine
    let text = base("batch = { message_types = [\"b\"] }\n").replace("message_types = [\"a\"]\n", "");
    assert!(parse(&text, "<inline>").is_ok());
}

#[test]
fn a_message_type_bound_twice() {
    let second = "\n[[handler]]\nname = \"h2\"\ncomponent = \"h2.wasm\"\ntopology = \"orders\"\nmessage_types = [\"z\", \"a\"]\n";
    assert_one(
        &(base("") + second),
        "handler[1].message_types[1]",
        "already bound by handler[0].message_types[0]",
    );
    // a batch type clashing with a single type of the same handler
    assert_one(
        &base("batch = { message_types = [\"a\"] }\n"),
        "handler[0].batch.message_types[0]",
        "already bound",
    );
    // another tenant is a different binding
    assert!(parse(&(base("") + second + "tenant = \"acme\"\n"), "<inline>").is_ok());
    // the same tenant twice is not
    let text = base("tenant = \"acme\"\n") + second + "tenant = \"acme\"\n";
    assert_one(&text, "handler[1].message_types[1]", "tenant \"acme\"");
}

#[test]
fn empty_tenant() {
    assert_one(&base("tenant = \"\"\n"), "handler[0].tenant", "is empty");
}

#[test]
fn batch_size_zero_and_empty_batch_types() {
    assert_one(
        &base("batch = { message_types = [\"b\"], size = 0 }\n"),
        "handler[0].batch.size",
        "1 or more",
    );
    assert_one(
        &base("batch = { message_types = [] }\n"),
        "handler[0].batch.message_types",
        "is empty",
    );
}

#[test]
fn zero_limits() {
    assert_one(&base("limits = { memory = 0 }\n"), "handler[0].limits.memory", "64MiB");
    assert_one(
        &base("limits = { timeout = \"0s\" }\n"),
        "handler[0].limits.timeout",
        "positive",
    );
    assert_one(
        &base("limits = { instances = 0 }\n"),
        "handler[0].limits.instances",
        "1 or more",
    );
    assert_one(
        &base("limits = { max_stack = \"0KiB\" }\n"),
        "handler[0].limits.max_stack",
        "512KiB",
    );
}

#[test]
fn wasi_grants_are_checked() {
    assert_one(
        &base("wasi = { env = [\"A=1\"] }\n"),
        "handler[0].wasi.env[0]",
        "no '='",
    );
    assert_one(
        &base("wasi = { preopens = [{ host = \"d\", guest = \"\" }] }\n"),
        "handler[0].wasi.preopens[0].guest",
        "/data",
    );
}

#[test]
fn static_mode_needs_owned_slots_that_exist_in_every_topology() {
    assert_one(
        &base("").replace("[[topology]]", "[cluster]\nmode = \"static\"\n[[topology]]"),
        "cluster.owned_slots",
        "owned_slots = [0, 1]",
    );
    let two = "[cluster]\nmode = \"static\"\nowned_slots = [0, 3]\n[[topology]]\nname = \"small\"\nslots = 2\n";
    let issues = invalid(&(two.to_string() + &base("")));
    assert_eq!(issues.len(), 1, "{issues:#?}");
    assert_eq!(issues[0].key, "cluster.owned_slots[1]");
    assert!(
        issues[0].message.contains("\"small\"") && issues[0].message.contains("0 to 1"),
        "{}",
        issues[0]
    );
    assert_one(
        &base("").replace(
            "[[topology]]",
            "[cluster]\nmode = \"static\"\nowned_slots = [1, 1]\n[[topology]]",
        ),
        "cluster.owned_slots[1]",
        "twice",
    );
    assert_one(
        &base("").replace(
            "[[topology]]",
            "[cluster]\nmode = \"static\"\nowned_slots = []\n[[topology]]",
        ),
        "cluster.owned_slots",
        "at least one",
    );
    assert!(
        parse(
            &base("").replace(
                "[[topology]]",
                "[cluster]\nmode = \"static\"\nowned_slots = [0, 3]\n[[topology]]"
            ),
            "<inline>"
        )
        .is_ok()
    );
}

#[test]
fn owned_slots_outside_static_mode() {
    assert_one(
        &base("").replace("[[topology]]", "[cluster]\nowned_slots = [0]\n[[topology]]"),
        "cluster.owned_slots",
        "only read in static mode",
    );
}

#[test]
fn postgres_mode_needs_database_url() {
    assert_one(
        &base("").replace("[[topology]]", "[cluster]\nmode = \"postgres\"\n[[topology]]"),
        "cluster.database_url",
        "postgres://",
    );
    assert_one(
        &base("").replace(
            "[[topology]]",
            "[cluster]\ndatabase_url = \"postgres://x\"\n[[topology]]",
        ),
        "cluster.database_url",
        "only read in postgres mode",
    );
}

#[test]
fn nats_kv_mode_needs_nats_and_names_a_bucket() {
    // The default transport is the embedded one: no KV bucket there.
    assert_one(
        &base("").replace("[[topology]]", "[cluster]\nmode = \"nats-kv\"\n[[topology]]"),
        "cluster.mode",
        "needs transport.kind = \"nats\"",
    );
    let nats = "[transport]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:4222\"\n";
    let c = parse(
        &base("").replace(
            "[[topology]]",
            &format!("{nats}[cluster]\nmode = \"nats-kv\"\n[[topology]]"),
        ),
        "weir.toml",
    )
    .unwrap();
    assert_eq!(c.cluster.mode, ClusterMode::NatsKv);
    assert_eq!(c.cluster.bucket(), "weir-coordination");
    assert!(c.cluster.leased());
    assert_one(
        &base("").replace(
            "[[topology]]",
            &format!("{nats}[cluster]\nmode = \"nats-kv\"\nbucket = \"a.b\"\n[[topology]]"),
        ),
        "cluster.bucket",
        "cannot name a JetStream KV bucket",
    );
    assert_one(
        &base("").replace("[[topology]]", "[cluster]\nbucket = \"b\"\n[[topology]]"),
        "cluster.bucket",
        "only read in nats-kv mode",
    );
}

#[test]
fn brokers_need_a_url() {
    assert_one(
        &base("").replace("[[topology]]", "[transport]\nkind = \"rabbitmq\"\n[[topology]]"),
        "transport.url",
        "amqp://",
    );
    assert_one(
        &base("").replace(
            "[[topology]]",
            "[transport]\nkind = \"rabbitmq\"\nurl = \"http://x\"\n[[topology]]",
        ),
        "transport.url",
        "amqps://",
    );
    assert_one(
        &base("").replace(
            "[[topology]]",
            "[transport]\nkind = \"nats\"\nurl = \" \"\n[[topology]]",
        ),
        "transport.url",
        "nats://",
    );
    assert!(
        parse(
            &base("").replace(
                "[[topology]]",
                "[transport]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:4222\"\n[[topology]]"
            ),
            "<inline>"
        )
        .is_ok()
    );
}

#[test]
fn memory_url_is_only_a_warning() {
    let c = parse(
        &base("").replace("[[topology]]", "[transport]\nurl = \"x\"\n[[topology]]"),
        "<inline>",
    )
    .expect("valid");
    let w = c.validate().expect("valid");
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].key, "transport.url");
}

#[test]
fn zero_prefetch_and_zero_lease() {
    assert_one(
        &base("").replace("[[topology]]", "[transport]\nprefetch = 0\n[[topology]]"),
        "transport.prefetch",
        "1 or more",
    );
    assert_one(
        &base("").replace("[[topology]]", "[cluster]\nlease = \"0s\"\n[[topology]]"),
        "cluster.lease",
        "positive",
    );
}

#[test]
fn drain_deadline_at_least_the_lease() {
    assert_one(
        &base("").replace(
            "[[topology]]",
            "[cluster]\nlease = \"10s\"\ndrain_deadline = \"3s\"\n[[topology]]",
        ),
        "cluster.drain_deadline",
        "at least 10s",
    );
    let c = parse(
        &base("").replace("[[topology]]", "[cluster]\nlease = \"40s\"\n[[topology]]"),
        "weir.toml",
    )
    .unwrap();
    assert_eq!(
        c.cluster.drain_deadline(),
        Duration::from_secs(40),
        "the default grows with the lease"
    );
    let c = parse(&base(""), "weir.toml").unwrap();
    assert_eq!(c.cluster.drain_deadline(), defaults::DRAIN_DEADLINE);
}

#[test]
fn rabbitmq_sac_needs_rabbitmq() {
    assert_one(
        &base("").replace("[[topology]]", "[cluster]\nmode = \"rabbitmq-sac\"\n[[topology]]"),
        "cluster.mode",
        "transport.kind = \"rabbitmq\"",
    );
}

#[test]
fn empty_node_name() {
    assert_one(&format!("[node]\nname = \"\"\n{}", base("")), "node.name", "non-empty");
}

/// Issue 14 item 14: no ladder on JetStream means AckWait repeated, so
/// `max_deliver = 3` alone is accepted on NATS (it was refused for the
/// default ladder's 3 rungs); elsewhere the default ladder still applies.
#[test]
fn max_deliver_without_a_ladder_on_nats_waits_ack_wait() {
    let text = base("").replace("slots = 4", "slots = 4\n[topology.retry]\nmax_deliver = 3");
    let nats = text.replace(
        "[[topology]]",
        "[transport]\nkind = \"nats\"\nurl = \"nats://n\"\n[[topology]]",
    );
    let c = parse(&nats, "<inline>").unwrap_or_else(|e| panic!("accepted on nats: {e}"));
    let p = c.topology[0].retry_policy(c.transport.kind);
    assert!(p.ladder.is_empty() && p.max_deliver == 3, "{p:?}");
    let c = parse(&text.replace("max_deliver = 3", "max_deliver = 4"), "<inline>").expect("valid");
    assert_eq!(
        c.topology[0].retry_policy(c.transport.kind).ladder.len(),
        3,
        "the default ladder elsewhere"
    );
}

#[test]
fn retry_ladder_longer_than_max_deliver() {
    let text = base("").replace(
        "slots = 4",
        "slots = 4\nretry = { ladder = [\"1s\", \"5s\", \"30s\"], max_deliver = 2 }",
    );
    assert_one(&text, "topology[0].retry.ladder", "at most 2 rungs");
    let equal = base("").replace(
        "slots = 4",
        "slots = 4\nretry = { ladder = [\"1s\", \"5s\"], max_deliver = 2 }",
    );
    assert!(parse(&equal, "<inline>").is_ok());
}

#[test]
fn retry_zero_rung_and_time_bound() {
    let text = base("").replace("slots = 4", "slots = 4\n[topology.retry]\nladder = [\"1s\", \"0s\"]\n");
    assert_one(&text, "topology[0].retry.ladder[1]", "positive");
    let text = base("").replace(
        "slots = 4",
        "slots = 4\n[topology.retry]\nmax_time_to_dead_letter = \"1m\"\n",
    );
    assert_one(
        &text,
        "topology[0].retry.max_time_to_dead_letter",
        "max_time_to_dead_letter >= 1m 6s",
    );
    // on nats the capture reserve moves the handler's last try to 36s, inside a 1m bound
    let nats = text.replace(
        "[[topology]]",
        "[transport]\nkind = \"nats\"\nurl = \"nats://n\"\n[[topology]]",
    );
    assert!(parse(&nats, "<inline>").is_ok());
}

#[test]
fn unlimited_retry_is_accepted_with_warnings() {
    let text = base("").replace(
        "slots = 4",
        "slots = 4\n[topology.retry]\nmax_deliver = 0\nmax_time_to_dead_letter = \"1s\"\n",
    );
    let c = parse(&text, "<inline>").expect("unlimited is not rejected");
    let w = c.validate().expect("valid");
    assert_eq!(
        w.iter().map(|v| v.key.as_str()).collect::<Vec<_>>(),
        ["topology[0].retry.max_time_to_dead_letter"]
    );
}

#[test]
fn no_retry_section_is_never_rejected() {
    for transport in [
        "",
        "[transport]\nkind = \"nats\"\nurl = \"nats://n\"\n",
        "[transport]\nkind = \"rabbitmq\"\nurl = \"amqp://r\"\n",
    ] {
        let text = base("").replace("[[topology]]", &format!("{transport}[[topology]]"));
        let c = parse(&text, "<inline>").expect("valid");
        assert_eq!(c.validate().expect("valid"), Vec::<Violation>::new());
        assert_eq!(c.topology[0].retry_policy(c.transport.kind).origin, Origin::Default);
    }
}

#[test]
fn several_problems_are_reported_together() {
    let text = base("limits = { instances = 0 }\n").replace("slots = 4", "slots = 0");
    let issues = invalid(&text);
    let keys: Vec<&str> = issues.iter().map(|v| v.key.as_str()).collect();
    assert_eq!(keys, ["topology[0].slots", "handler[0].limits.instances"]);
    let rendered = parse(&text, "weir.toml").map(|_| ()).unwrap_err().to_string();
    assert_eq!(rendered.lines().count(), 3, "{rendered}");
}

#[test]
fn section_lookup_follows_arrays_of_tables() {
    let text = "[node]\nname='a'\n[[topology]]\nname='x'\n[[topology]]\n[topology.retry]\nx=1\n[[handler]]\n[[handler]]\ny=2\n";
    let at = |needle: &str| section_at(text, text.find(needle).expect("needle"));
    assert_eq!(at("name='a'").as_deref(), Some("node"));
    assert_eq!(at("name='x'").as_deref(), Some("topology[0]"));
    assert_eq!(at("x=1").as_deref(), Some("topology[1].retry"));
    assert_eq!(at("y=2").as_deref(), Some("handler[1]"));
    assert_eq!(section_at("a = 1\n", 0), None);
}

fn with_transport(transport: &str) -> String {
    base("").replace("[[topology]]", &format!("[transport]\n{transport}\n[[topology]]"))
}

#[test]
fn url_is_one_string_or_a_list_and_every_url_is_checked() {
    let c = parse(
        &with_transport("kind = \"rabbitmq\"\nurl = \"amqp://guest:guest@127.0.0.1:5672/%2f\""),
        "<inline>",
    )
    .expect("one string is the contract");
    assert_eq!(
        c.transport.urls(),
        vec!["amqp://guest:guest@127.0.0.1:5672/%2f".to_owned()]
    );
    let c = parse(
        &with_transport("kind = \"nats\"\nurl = [\"nats://127.0.0.1:1\", \" nats://127.0.0.1:4222 \"]"),
        "<inline>",
    )
    .expect("a list");
    assert_eq!(
        c.transport.urls(),
        vec!["nats://127.0.0.1:1".to_owned(), "nats://127.0.0.1:4222".to_owned()]
    );
    assert_one(&with_transport("kind = \"nats\"\nurl = []"), "transport.url", "nats://");
    assert_one(
        &with_transport("kind = \"rabbitmq\"\nurl = [\"\"]"),
        "transport.url",
        "amqp://",
    );
    // A bad URL of a list is named, with its password hidden.
    let e = parse(
        &with_transport("kind = \"rabbitmq\"\nurl = [\"amqp://h/%2f\", \"http://u:secret@h\"]"),
        "<inline>",
    )
    .expect_err("not AMQP");
    let text = e.to_string();
    assert!(text.contains("transport.url") && text.contains("amqps://"), "{text}");
    assert!(!text.contains("secret"), "the password is shown: {text}");
}

#[test]
fn queue_type_is_classic_by_default_and_quorum_on_request() {
    let c = parse(
        &with_transport("kind = \"rabbitmq\"\nurl = \"amqp://h/%2f\""),
        "<inline>",
    )
    .expect("valid");
    assert_eq!(c.transport.queue_type(), QueueType::Classic);
    let c = parse(
        &with_transport("kind = \"rabbitmq\"\nurl = \"amqp://h/%2f\"\nqueue_type = \"quorum\""),
        "<inline>",
    )
    .expect("valid");
    assert_eq!(c.transport.queue_type(), QueueType::Quorum);
    let e = parse(
        &with_transport("kind = \"rabbitmq\"\nurl = \"amqp://h/%2f\"\nqueue_type = \"stream\""),
        "<inline>",
    )
    .expect_err("not a queue type");
    assert!(e.to_string().contains("queue_type"), "{e}");
}

#[test]
fn queue_type_is_for_rabbitmq_and_replicas_for_nats() {
    assert_one(
        &with_transport("kind = \"nats\"\nurl = \"nats://h\"\nqueue_type = \"quorum\""),
        "transport.queue_type",
        "rabbitmq",
    );
    assert_one(
        &with_transport("kind = \"rabbitmq\"\nurl = \"amqp://h/%2f\"\nreplicas = 3"),
        "transport.replicas",
        "quorum",
    );
    assert_one(
        &with_transport("kind = \"nats\"\nurl = \"nats://h\"\nreplicas = 0"),
        "transport.replicas",
        "1 to 5",
    );
    assert_one(
        &with_transport("kind = \"nats\"\nurl = \"nats://h\"\nreplicas = 7"),
        "transport.replicas",
        "1 to 5",
    );
    let c = parse(
        &with_transport("kind = \"nats\"\nurl = \"nats://h\"\nreplicas = 3"),
        "<inline>",
    )
    .expect("valid");
    assert_eq!(c.transport.replicas(), 3);
    let c = parse(&with_transport("kind = \"nats\"\nurl = \"nats://h\""), "<inline>").expect("valid");
    assert_eq!(c.transport.replicas(), 1);
}

#[test]
fn dedup_needs_a_coordinator_store_and_a_sane_window() {
    // The default mode (solo) keeps nothing shared.
    assert_one(
        &base("dedup = { window = \"10m\" }\n"),
        "handler[0].dedup",
        "needs the coordinator's store",
    );
    let pg = "[cluster]\nmode = \"postgres\"\ndatabase_url = \"postgres://postgres@127.0.0.1/weir\"\n";
    let c = parse(&format!("{pg}{}", base("dedup = { window = \"10m\" }\n")), "weir.toml").unwrap();
    assert_eq!(
        c.handler[0].dedup.map(|d| d.window),
        Some(std::time::Duration::from_secs(600))
    );
    assert_one(
        &format!("{pg}{}", base("dedup = { window = \"0s\" }\n")),
        "handler[0].dedup.window",
        "outside 1s",
    );
    assert!(
        syntax(&format!("{pg}{}", base("dedup = { windw = \"1m\" }\n"))).contains("windw"),
        "an unknown key in dedup is named"
    );
}

#[test]
fn park_is_for_single_messages_and_its_hold_leaves_room_in_the_window() {
    let c = parse(&base("on_failure = \"park\"\n"), "weir.toml").unwrap();
    assert_eq!(c.handler[0].on_failure, OnFailure::Park);
    assert_eq!(
        parse(&base(""), "weir.toml").unwrap().handler[0].on_failure,
        OnFailure::Continue
    );
    // The default hold, capped at half the window.
    assert_eq!(c.topology[0].park_hold(256), 64);
    assert_eq!(c.topology[0].park_hold(16), 8);
    assert_one(
        &base("on_failure = \"park\"\nbatch = { message_types = [\"b\"] }\n"),
        "handler[0].on_failure",
        "a batch fails or succeeds per member",
    );
    assert_one(
        &base("")
            .replace("slots = 4\n", "slots = 4\npark_hold = 200\n")
            .replacen("[[topology]]", "[transport]\nprefetch = 256\n[[topology]]", 1),
        "topology[0].park_hold",
        "accepted: 1 to 128",
    );
    assert!(syntax(&base("on_failure = \"stop\"\n")).contains("on_failure"));
}

/// Issue 32 item 4: the parked groups of a slot hold less than its window
/// together, by default half of it; a bound at or above the window is
/// refused, naming the key.
#[test]
fn the_slot_hold_of_parked_groups_stays_below_the_window() {
    let with = |extra: &str| {
        base("on_failure = \"park\"\n")
            .replace("slots = 4\n", &format!("slots = 4\n{extra}"))
            .replacen("[[topology]]", "[transport]\nprefetch = 256\n[[topology]]", 1)
    };
    let c = parse(&with(""), "weir.toml").unwrap();
    assert_eq!(c.topology[0].park_hold_slot(256), 128, "default: half the window");
    assert_eq!(c.topology[0].park_hold_slot(1), 0, "a window of one holds nothing");
    let c = parse(&with("park_hold_slot = 255\n"), "weir.toml").unwrap();
    assert_eq!(c.topology[0].park_hold_slot(256), 255);
    assert_eq!(
        parse(&with("park_hold_slot = 0\n"), "weir.toml").unwrap().topology[0].park_hold_slot(256),
        0
    );
    for at_or_above in ["256", "1000"] {
        assert_one(
            &with(&format!("park_hold_slot = {at_or_above}\n")),
            "topology[0].park_hold_slot",
            "not below the slot's window (transport.prefetch = 256)",
        );
    }
}
