//! `weir new` and `weir build`: a handler project from a template embedded
//! in this binary, and its component built with the language's toolchain.
//!
//! The Rust template vendors the guest SDK (`weir-guest/`, its sources and
//! the WIT it binds, taken from this binary), so a new project builds with
//! nothing but the registries, before `weir-guest` is published. The Python
//! and JavaScript templates carry the WIT and a native test host; their
//! toolchains (componentize-py, ComponentizeJS) are installed into a cache on
//! first build ([`toolchain`]).
//!
//! A project is known by its manifest: `Cargo.toml` (Rust), `pyproject.toml`
//! with a `[tool.weir]` table (Python), `package.json` with a `"weir"` key
//! (JavaScript). `weir dev` finds the project and its sources through
//! [`detect`].

pub mod live;
mod stamp;
mod toolchain;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context as _, bail};
use sha2::Digest as _;

/// The languages `weir new` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    /// Rust with the `weir-guest` SDK, built for wasm32-wasip2.
    Rust,
    /// Python, built with componentize-py (installed by `weir build`).
    Python,
    /// JavaScript, built with ComponentizeJS (installed by `weir build`).
    #[value(alias = "javascript")]
    Js,
}

impl Lang {
    /// How the CLI names it.
    pub fn as_str(self) -> &'static str {
        match self {
            Lang::Rust => "rust",
            Lang::Python => "python",
            Lang::Js => "js",
        }
    }

    /// Is `file` (relative to the project) something a build of this
    /// language reads? `weir dev` rebuilds on a change of one. Rust: every
    /// file (build scripts may read anything); Python and JavaScript: their
    /// sources, their manifest and the WIT.
    pub fn is_source(self, file: &Path) -> bool {
        let ext = file.extension().and_then(|e| e.to_str()).unwrap_or("");
        let name = file.file_name().and_then(|n| n.to_str()).unwrap_or("");
        match self {
            Lang::Rust => true,
            Lang::Python => matches!(ext, "py" | "wit") || name == "pyproject.toml",
            Lang::Js => matches!(ext, "js" | "mjs" | "cjs" | "wit") || name == "package.json",
        }
    }
}

/// The SDK's version, as vendored.
const SDK_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The WIT the Rust SDK binds (0.3.0: the message as a host-owned resource).
const WIT: &str = include_str!("../../../guest-sdk/wit/handler.wit");

/// The WIT the Python and JavaScript templates bind (0.2.0: the message as
/// a record), until their shims move to 0.3.0.
const WIT_RECORD: &str = include_str!("../../../wit/handler.wit");

/// (path in the project, template); `{{name}}` and `{{sdk_version}}` are filled in.
const RUST: [(&str, &str); 9] = [
    ("Cargo.toml", include_str!("../../templates/rust/Cargo.toml.tmpl")),
    ("src/lib.rs", include_str!("../../templates/rust/lib.rs.tmpl")),
    ("README.md", include_str!("../../templates/rust/README.md.tmpl")),
    (".gitignore", include_str!("../../templates/rust/gitignore.tmpl")),
    ("weir.toml", include_str!("../../templates/rust/weir.toml.tmpl")),
    (
        "weir-guest/Cargo.toml",
        include_str!("../../templates/rust/sdk-Cargo.toml.tmpl"),
    ),
    ("weir-guest/src/lib.rs", include_str!("../../../guest-sdk/src/lib.rs")),
    (
        "weir-guest/src/testing.rs",
        include_str!("../../../guest-sdk/src/testing.rs"),
    ),
    ("weir-guest/wit/handler.wit", WIT),
];

/// (path in the project, template); `{{name}}` and `{{componentize_py}}` are filled in.
const PYTHON: [(&str, &str); 8] = [
    (
        "pyproject.toml",
        include_str!("../../templates/python/pyproject.toml.tmpl"),
    ),
    ("app.py", include_str!("../../templates/python/app.py.tmpl")),
    ("test_app.py", include_str!("../../templates/python/test_app.py.tmpl")),
    (
        "weir_testing.py",
        include_str!("../../templates/python/weir_testing.py.tmpl"),
    ),
    ("README.md", include_str!("../../templates/python/README.md.tmpl")),
    (".gitignore", include_str!("../../templates/python/gitignore.tmpl")),
    ("weir.toml", include_str!("../../templates/rust/weir.toml.tmpl")),
    ("wit/handler.wit", WIT_RECORD),
];

/// (path in the project, template); `{{name}}` and `{{componentize_js}}` are filled in.
const JS: [(&str, &str); 10] = [
    ("package.json", include_str!("../../templates/js/package.json.tmpl")),
    ("handler.js", include_str!("../../templates/js/handler.js.tmpl")),
    (
        "handler.test.js",
        include_str!("../../templates/js/handler.test.js.tmpl"),
    ),
    (
        "testing/host.js",
        include_str!("../../templates/js/testing-host.js.tmpl"),
    ),
    (
        "testing/register.js",
        include_str!("../../templates/js/testing-register.js.tmpl"),
    ),
    (
        "testing/hooks.js",
        include_str!("../../templates/js/testing-hooks.js.tmpl"),
    ),
    ("README.md", include_str!("../../templates/js/README.md.tmpl")),
    (".gitignore", include_str!("../../templates/js/gitignore.tmpl")),
    ("weir.toml", include_str!("../../templates/rust/weir.toml.tmpl")),
    ("wit/handler.wit", WIT_RECORD),
];

/// A project name: what Cargo, PyPI and npm all accept.
fn check_name(name: &str) -> anyhow::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_');
    if !ok {
        bail!(
            "{name:?} is not a usable project name: use lowercase letters, digits, `-` and `_`, \
             starting with a letter (it names the crate, the component and the handler)"
        );
    }
    Ok(())
}

/// `weir new LANG NAME`: the project in `dir/NAME` (which must not exist).
pub fn new(lang: Lang, name: &str, dir: &Path) -> anyhow::Result<PathBuf> {
    check_name(name)?;
    let root = dir.join(name);
    if root.exists() {
        bail!("{} already exists: choose another name or remove it", root.display());
    }
    let files: &[(&str, &str)] = match lang {
        Lang::Rust => &RUST,
        Lang::Python => &PYTHON,
        Lang::Js => &JS,
    };
    for (path, template) in files {
        let file = root.join(path);
        if let Some(parent) = file.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        let text = template
            .replace("{{name}}", name)
            .replace("{{sdk_version}}", SDK_VERSION)
            .replace("{{componentize_py}}", toolchain::COMPONENTIZE_PY)
            .replace("{{componentize_js}}", toolchain::COMPONENTIZE_JS);
        std::fs::write(&file, text).with_context(|| format!("writing {}", file.display()))?;
    }
    println!("created {} ({} handler `{name}`):", root.display(), lang.as_str());
    for (path, _) in files {
        println!("  {path}");
    }
    let test = match lang {
        Lang::Rust => "cargo test",
        Lang::Python => "python3 -m unittest",
        Lang::Js => "node --test",
    };
    println!(
        "next:\n  cd {}\n  {test}\n  weir build\n  weir call {name}.wasm --type greeting --payload '{{\"name\":\"Ada\"}}'\n  weir dev",
        root.display()
    );
    Ok(root)
}

/// A handler project, as its manifest describes it.
#[derive(Debug, Clone)]
pub struct Project {
    /// Its language.
    pub lang: Lang,
    /// Its name: the component is `NAME.wasm` in the project folder.
    pub name: String,
    /// Python: the module defining `WitWorld`; JavaScript: the source file.
    entry: String,
    /// The WIT folder, relative to the project.
    wit: String,
    /// The world the component targets.
    world: String,
}

/// Read `file` as text.
fn read(file: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))
}

/// A `[tool.weir]` / `"weir"` setting: the string given, else `default`.
fn setting(value: Option<Option<&str>>, file: &Path, key: &str, default: &str) -> anyhow::Result<String> {
    match value {
        None => Ok(default.to_owned()),
        Some(Some(v)) if !v.is_empty() => Ok(v.to_owned()),
        Some(_) => bail!("{}: `{key}` must be a non-empty string", file.display()),
    }
}

/// A Python project in `pyproject`, if its `[tool.weir]` table makes it one.
fn detect_python(pyproject: &Path) -> anyhow::Result<Option<Project>> {
    let doc: toml::Table = read(pyproject)?
        .parse()
        .with_context(|| format!("{} is not valid TOML", pyproject.display()))?;
    if let Some(weir) = doc.get("tool").and_then(|t| t.get("weir")) {
        let weir = weir
            .as_table()
            .with_context(|| format!("{}: [tool.weir] must be a table", pyproject.display()))?;
        if let Some(key) = weir.keys().find(|k| !["module", "wit", "world"].contains(&k.as_str())) {
            bail!(
                "{}: [tool.weir] has an unknown key `{key}` (known: module, wit, world)",
                pyproject.display()
            );
        }
        let get = |key: &str, default: &str| {
            setting(
                weir.get(key).map(|v| v.as_str()),
                pyproject,
                &format!("tool.weir.{key}"),
                default,
            )
        };
        let name = doc
            .get("project")
            .and_then(|p| p.get("name"))
            .and_then(|n| n.as_str())
            .with_context(|| format!("{} has no [project] name", pyproject.display()))?;
        check_name(name).with_context(|| format!("{}: [project] name", pyproject.display()))?;
        return Ok(Some(Project {
            lang: Lang::Python,
            name: name.to_owned(),
            entry: get("module", "app")?,
            wit: get("wit", "wit")?,
            world: get("world", "handler")?,
        }));
    }
    Ok(None)
}

/// What kind of project `dir` is: the first of `Cargo.toml`, `pyproject.toml`
/// with `[tool.weir]`, `package.json` with `"weir"`.
pub fn detect(dir: &Path) -> anyhow::Result<Project> {
    let manifest = dir.join("Cargo.toml");
    if manifest.is_file() {
        let doc: toml::Table = read(&manifest)?
            .parse()
            .with_context(|| format!("{} is not valid TOML", manifest.display()))?;
        let name = doc
            .get("package")
            .and_then(|p| p.get("name"))
            .and_then(|n| n.as_str())
            .with_context(|| format!("{} has no [package] name", manifest.display()))?;
        return Ok(Project {
            lang: Lang::Rust,
            name: name.to_owned(),
            entry: String::new(),
            wit: String::new(),
            world: String::new(),
        });
    }
    let mut unmarked = Vec::new();
    let pyproject = dir.join("pyproject.toml");
    if pyproject.is_file() {
        if let Some(project) = detect_python(&pyproject)? {
            return Ok(project);
        }
        unmarked.push("pyproject.toml has no [tool.weir] table");
    }
    let package = dir.join("package.json");
    if package.is_file() {
        let doc: serde_json::Value = serde_json::from_str(&read(&package)?)
            .with_context(|| format!("{} is not valid JSON", package.display()))?;
        if let Some(weir) = doc.get("weir") {
            let weir = weir
                .as_object()
                .with_context(|| format!("{}: \"weir\" must be an object", package.display()))?;
            if let Some(key) = weir.keys().find(|k| !["source", "wit", "world"].contains(&k.as_str())) {
                bail!(
                    "{}: \"weir\" has an unknown key {key:?} (known: source, wit, world)",
                    package.display()
                );
            }
            let get = |key: &str, default: &str| {
                setting(
                    weir.get(key).map(|v| v.as_str()),
                    &package,
                    &format!("weir.{key}"),
                    default,
                )
            };
            let full = doc
                .get("name")
                .and_then(|n| n.as_str())
                .with_context(|| format!("{} has no \"name\"", package.display()))?;
            // `@scope/name` names the component `name`.
            let name = full.rsplit('/').next().unwrap_or(full);
            check_name(name).with_context(|| format!("{}: \"name\"", package.display()))?;
            return Ok(Project {
                lang: Lang::Js,
                name: name.to_owned(),
                entry: get("source", "handler.js")?,
                wit: get("wit", "wit")?,
                world: get("world", "handler")?,
            });
        }
        unmarked.push("package.json has no \"weir\" key");
    }
    let found = if unmarked.is_empty() {
        "no Cargo.toml, pyproject.toml or package.json".to_owned()
    } else {
        unmarked.join("; ")
    };
    bail!(
        "{} is not a handler project ({found}); make one with `weir new <rust|python|js> NAME`",
        dir.display()
    )
}

/// `rustup target add wasm32-wasip2` when the target is missing.
fn ensure_wasm_target() -> anyhow::Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l.trim() == "wasm32-wasip2")
        });
    match installed {
        Some(true) => Ok(()),
        Some(false) => {
            eprintln!("weir build: adding the wasm32-wasip2 target (rustup target add wasm32-wasip2) …");
            toolchain::run(
                Command::new("rustup").args(["target", "add", "wasm32-wasip2"]),
                "rustup target add wasm32-wasip2",
                "check the network, or install the target by hand",
            )
        }
        // No rustup: the toolchain may still have the target; cargo says so if not.
        None => Ok(()),
    }
}

/// `weir build` in `dir`: the component, its path, size and digest. The
/// component is written to `.NAME.wasm.part` and renamed to `NAME.wasm`, so
/// a failed build leaves the last good one in place.
pub fn build(dir: &Path, offline: bool) -> anyhow::Result<PathBuf> {
    let project = detect(dir)?;
    let name = &project.name;
    let started = Instant::now();
    let out = dir.join(format!("{name}.wasm"));
    // Python and JavaScript toolchains are not reproducible: unchanged inputs keep the last
    // build's component (`stamp`). Inputs that cannot be read: built, not stamped.
    let toolchain = match project.lang {
        Lang::Rust => None,
        Lang::Python => Some(format!("componentize-py {}", toolchain::COMPONENTIZE_PY)),
        Lang::Js => Some(format!("ComponentizeJS {}", toolchain::COMPONENTIZE_JS)),
    };
    let inputs = toolchain.and_then(|t| stamp::inputs(dir, &[&t, &project.entry, &project.wit, &project.world]).ok());
    if let Some(i) = &inputs
        && stamp::fresh(&out, i)
    {
        let bytes = std::fs::read(&out).with_context(|| format!("reading {}", out.display()))?;
        report(
            &out,
            &bytes,
            started,
            " (sources unchanged since the last build: its component, as it was)",
        );
        return Ok(out);
    }
    eprintln!(
        "weir build: building {} component {name} (in {}) …",
        project.lang.as_str(),
        dir.canonicalize().as_deref().unwrap_or(dir).display()
    );
    let part = dir.join(format!(".{name}.wasm.part"));
    let _ = std::fs::remove_file(&part);
    let built = build_into(&project, dir, &part, offline);
    if let Err(e) = built.and_then(|()| {
        std::fs::rename(&part, &out).with_context(|| format!("renaming {} to {}", part.display(), out.display()))
    }) {
        let _ = std::fs::remove_file(&part);
        return Err(e);
    }
    let bytes = std::fs::read(&out).with_context(|| format!("reading {}", out.display()))?;
    match &inputs {
        Some(i) => stamp::record(&out, i, &bytes),
        None => stamp::clear(&out),
    }
    report(&out, &bytes, started, "");
    Ok(out)
}

/// `built NAME.wasm (size, sha256 …) in S s`, and `note`.
fn report(out: &Path, bytes: &[u8], started: Instant, note: &str) {
    let size = bytes.len() as f64;
    let size = if size < 1024.0 * 1024.0 {
        format!("{:.1} KiB", size / 1024.0)
    } else {
        format!("{:.1} MiB", size / (1024.0 * 1024.0))
    };
    println!(
        "built {} ({size}, sha256 {}) in {:.1} s{note}",
        out.strip_prefix(".").unwrap_or(out).display(),
        hex::encode(sha2::Sha256::digest(bytes)),
        started.elapsed().as_secs_f64()
    );
}

/// Run componentize-py on `project` in `dir`: `module` (defining `WitWorld`) found on
/// `python_path` (the first is mounted at `/0`), the component written to `out`. Every path
/// is given as it is (no current_dir): `dir` may be relative.
fn componentize_py(
    componentize: &Path,
    project: &Project,
    dir: &Path,
    python_path: &[&Path],
    module: &str,
    out: &Path,
) -> anyhow::Result<()> {
    let mut cmd = Command::new(componentize);
    cmd.arg("--wit-path")
        .arg(dir.join(&project.wit))
        .args(["--world", &project.world, "--quiet", "componentize"]);
    for p in python_path {
        cmd.arg("--python-path").arg(p);
    }
    cmd.arg(module).arg("--output").arg(out);
    toolchain::run(
        &mut cmd,
        "componentize-py",
        "its message above says why (a Python error in the handler, or a WIT that does not match it)",
    )
}

/// Run ComponentizeJS (`cli`, with `node`): `source` against `world` in `wit`, the component
/// written to `out`.
fn componentize_js(cli: &Path, source: &Path, wit: &Path, world: &str, out: &Path) -> anyhow::Result<()> {
    let mut node = Command::new("node");
    node.arg(cli)
        .arg(source)
        .arg("--wit")
        .arg(wit)
        .args(["--world-name", world, "--disable", "http", "fetch-event", "--out"])
        .arg(out);
    toolchain::run(
        &mut node,
        "ComponentizeJS",
        "its message above says why (a JavaScript error in the handler, or exports that do not match the WIT)",
    )
}

/// Build `project` into `part` with its language's toolchain.
fn build_into(project: &Project, dir: &Path, part: &Path, offline: bool) -> anyhow::Result<()> {
    let name = &project.name;
    match project.lang {
        Lang::Rust => {
            ensure_wasm_target()?;
            eprintln!(
                "weir build: cargo build --release --target wasm32-wasip2 (in {}) …",
                dir.display()
            );
            let mut cargo = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
            cargo
                .current_dir(dir)
                .args(["build", "--release", "--target", "wasm32-wasip2"]);
            if offline {
                cargo.arg("--offline");
            }
            toolchain::run(
                &mut cargo,
                "cargo build",
                "the compiler's messages above say why (install Rust from https://rustup.rs if cargo is missing)",
            )?;
            let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| dir.join("target"), PathBuf::from);
            let built = target
                .join("wasm32-wasip2/release")
                .join(format!("{}.wasm", name.replace('-', "_")));
            std::fs::copy(&built, part)
                .with_context(|| format!("copying {} to {}", built.display(), part.display()))?;
        }
        Lang::Python => {
            let componentize = toolchain::componentize_py(offline)?;
            let module = dir.join(format!("{}.py", project.entry));
            if !module.is_file() && !dir.join(&project.entry).join("__init__.py").is_file() {
                bail!(
                    "{}: [tool.weir] module = {:?}, and there is no {} (the module that defines `class WitWorld`)",
                    dir.join("pyproject.toml").display(),
                    project.entry,
                    module.display()
                );
            }
            eprintln!(
                "weir build: componentize-py {}: module `{}` against {}/ (world `{}`) …",
                toolchain::COMPONENTIZE_PY,
                project.entry,
                project.wit,
                project.world
            );
            componentize_py(&componentize, project, dir, &[dir], &project.entry, part)?;
        }
        Lang::Js => {
            let cli = toolchain::componentize_js(offline)?;
            let source = dir.join(&project.entry);
            if !source.is_file() {
                bail!(
                    "{}: \"weir\": {{ \"source\": {:?} }}, and there is no {}",
                    dir.join("package.json").display(),
                    project.entry,
                    source.display()
                );
            }
            eprintln!(
                "weir build: ComponentizeJS {}: {} against {}/ (world `{}`) …",
                toolchain::COMPONENTIZE_JS,
                project.entry,
                project.wit,
                project.world
            );
            componentize_js(&cli, &source, &dir.join(&project.wit), &project.world, part)?;
        }
    }
    if !part.is_file() {
        bail!(
            "the {} toolchain reported success but wrote no {}",
            project.lang.as_str(),
            part.display()
        );
    }
    Ok(())
}
