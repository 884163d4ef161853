//! `weir new` and `weir build`: a handler project from a template embedded
//! in this binary, and its component built with the language's toolchain.
//!
//! The Rust template vendors the guest SDK (`weir-guest/`, its sources and
//! the WIT it binds, taken from this binary), so a new project builds with
//! nothing but the registries, before `weir-guest` is published.

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
}

/// The SDK's version, as vendored.
const SDK_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The WIT of the contract (the guest SDK binds this copy).
const WIT: &str = include_str!("../../guest-sdk/wit/handler.wit");

/// (path in the project, template); `{{name}}` and `{{sdk_version}}` are filled in.
const RUST: [(&str, &str); 9] = [
    ("Cargo.toml", include_str!("../templates/rust/Cargo.toml.tmpl")),
    ("src/lib.rs", include_str!("../templates/rust/lib.rs.tmpl")),
    ("README.md", include_str!("../templates/rust/README.md.tmpl")),
    (".gitignore", include_str!("../templates/rust/gitignore.tmpl")),
    ("weir.toml", include_str!("../templates/rust/weir.toml.tmpl")),
    (
        "weir-guest/Cargo.toml",
        include_str!("../templates/rust/sdk-Cargo.toml.tmpl"),
    ),
    ("weir-guest/src/lib.rs", include_str!("../../guest-sdk/src/lib.rs")),
    (
        "weir-guest/src/testing.rs",
        include_str!("../../guest-sdk/src/testing.rs"),
    ),
    ("weir-guest/wit/handler.wit", WIT),
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
    let files = match lang {
        Lang::Rust => &RUST,
    };
    for (path, template) in files {
        let file = root.join(path);
        if let Some(parent) = file.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        let text = template
            .replace("{{name}}", name)
            .replace("{{sdk_version}}", SDK_VERSION);
        std::fs::write(&file, text).with_context(|| format!("writing {}", file.display()))?;
    }
    println!("created {} ({lang:?} handler `{name}`):", root.display());
    for (path, _) in files {
        println!("  {path}");
    }
    println!(
        "next:\n  cd {}\n  weir build\n  weir call {name}.wasm --type greeting --payload '{{\"name\":\"Ada\"}}'",
        root.display()
    );
    Ok(root)
}

/// What kind of project `dir` is.
fn detect(dir: &Path) -> anyhow::Result<(Lang, String)> {
    let manifest = dir.join("Cargo.toml");
    if manifest.is_file() {
        let text = std::fs::read_to_string(&manifest).with_context(|| format!("reading {}", manifest.display()))?;
        let doc: toml::Table = text
            .parse()
            .with_context(|| format!("{} is not valid TOML", manifest.display()))?;
        let name = doc
            .get("package")
            .and_then(|p| p.get("name"))
            .and_then(|n| n.as_str())
            .with_context(|| format!("{} has no [package] name", manifest.display()))?;
        return Ok((Lang::Rust, name.to_owned()));
    }
    bail!(
        "{} is not a handler project (no Cargo.toml); make one with `weir new rust NAME`",
        dir.display()
    )
}

/// Run `cmd`, its output passed through; an error that says what to do when it fails.
fn run(cmd: &mut Command, what: &str, fix: &str) -> anyhow::Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("{what}: cannot start {:?}; {fix}", cmd.get_program()))?;
    if !status.success() {
        bail!("{what} failed ({status}); {fix}");
    }
    Ok(())
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
            run(
                Command::new("rustup").args(["target", "add", "wasm32-wasip2"]),
                "rustup target add wasm32-wasip2",
                "check the network, or install the target by hand",
            )
        }
        // No rustup: the toolchain may still have the target; cargo says so if not.
        None => Ok(()),
    }
}

/// `weir build` in `dir`: the component, its path, size and digest.
pub fn build(dir: &Path, offline: bool) -> anyhow::Result<PathBuf> {
    let (lang, name) = detect(dir)?;
    let started = Instant::now();
    let out = dir.join(format!("{name}.wasm"));
    match lang {
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
            run(
                &mut cargo,
                "cargo build",
                "the compiler's messages above say why (install Rust from https://rustup.rs if cargo is missing)",
            )?;
            let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| dir.join("target"), PathBuf::from);
            let built = target
                .join("wasm32-wasip2/release")
                .join(format!("{}.wasm", name.replace('-', "_")));
            std::fs::copy(&built, &out).with_context(|| format!("copying {} to {}", built.display(), out.display()))?;
        }
    }
    let bytes = std::fs::read(&out).with_context(|| format!("reading {}", out.display()))?;
    println!(
        "built {} ({:.1} KiB, sha256 {}) in {:.1} s",
        out.display(),
        bytes.len() as f64 / 1024.0,
        hex::encode(sha2::Sha256::digest(&bytes)),
        started.elapsed().as_secs_f64()
    );
    Ok(out)
}
