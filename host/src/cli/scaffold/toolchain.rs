//! The Python and JavaScript toolchains `weir build` runs: componentize-py in
//! a venv and ComponentizeJS installed with `npm ci`, each pinned and kept in
//! `$XDG_CACHE_HOME/weir/toolchains/<tool>-<version>/` (else `~/.cache/…`),
//! installed on first use. The pins are the ones `host/build.rs` builds the
//! bundled examples with (`examples/python/orders/requirements.txt`,
//! `examples/js/orders/package-lock.json`).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};

/// componentize-py, as pinned in `examples/python/orders/requirements.txt`.
pub const COMPONENTIZE_PY: &str = "0.25.1";

/// ComponentizeJS, as pinned in `examples/js/orders/package.json`.
pub const COMPONENTIZE_JS: &str = "0.23.0";

/// The `npm ci` inputs of the ComponentizeJS install (its lockfile pins every
/// transitive package, including the preview2 shim it imports).
const JS_PACKAGE: &str = include_str!("../../../../examples/js/orders/package.json");
const JS_LOCK: &str = include_str!("../../../../examples/js/orders/package-lock.json");

/// Written last into a toolchain's folder: an install that stopped halfway has none.
const INSTALLED: &str = ".weir-installed";

/// `$XDG_CACHE_HOME/weir/toolchains`, else `~/.cache/weir/toolchains`.
pub fn cache_root() -> anyhow::Result<PathBuf> {
    crate::cli::call::cache_dir()
        .map(|d| d.join("toolchains"))
        .context("neither XDG_CACHE_HOME nor HOME is set, so there is no cache to install the toolchain into")
}

/// Print one step of the build.
fn step(text: &str) {
    eprintln!("weir build: {text}");
}

/// Run `cmd`, its output passed through to stderr (stdout is for the
/// build's result); on failure say what to do. It reads no input: `weir dev`
/// reads its terminal while it builds, and a child sharing that input could
/// take its lines, or (node does) set it non-blocking, which ends weir dev's
/// reading of it.
pub fn run(cmd: &mut Command, what: &str, fix: &str) -> anyhow::Result<()> {
    let status = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::io::stderr())
        .status()
        .with_context(|| format!("{what}: cannot start {:?}; {fix}", cmd.get_program()))?;
    if !status.success() {
        bail!("{what} failed ({status}); {fix}");
    }
    Ok(())
}

/// The folder of `tool-version` in the cache, installed by `install` first
/// when it is not there. A lock beside it keeps two builds from installing
/// into it at once; a folder left by an install that stopped is started over.
fn installed(
    tool: &str,
    version: &str,
    offline: bool,
    install: impl FnOnce(&Path) -> anyhow::Result<()>,
) -> anyhow::Result<PathBuf> {
    let root = cache_root()?;
    let dir = root.join(format!("{tool}-{version}"));
    if dir.join(INSTALLED).is_file() {
        return Ok(dir);
    }
    std::fs::create_dir_all(&root).with_context(|| format!("creating the toolchain cache {}", root.display()))?;
    let lock_path = root.join(format!(".{tool}-{version}.lock"));
    let lock = std::fs::File::create(&lock_path).with_context(|| format!("creating {}", lock_path.display()))?;
    lock.lock()
        .with_context(|| format!("locking {}", lock_path.display()))?;
    // Another build may have installed it while this one waited.
    if dir.join(INSTALLED).is_file() {
        return Ok(dir);
    }
    if dir.exists() {
        step(&format!(
            "{} is incomplete (an install stopped); starting over",
            dir.display()
        ));
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    let mode = if offline { ", offline" } else { "" };
    step(&format!(
        "installing {tool} {version} into {} (once{mode}) …",
        dir.display()
    ));
    install(&dir)?;
    std::fs::write(dir.join(INSTALLED), format!("{tool} {version}\n"))
        .with_context(|| format!("writing {}", dir.join(INSTALLED).display()))?;
    Ok(dir)
}

/// The Python that runs componentize-py: `$WEIR_PYTHON`, else `python3`.
fn python() -> OsString {
    std::env::var_os("WEIR_PYTHON").unwrap_or_else(|| "python3".into())
}

/// componentize-py (its venv's script), installed when missing.
pub fn componentize_py(offline: bool) -> anyhow::Result<PathBuf> {
    let py = python();
    let shown = py.to_string_lossy().into_owned();
    let venv = cache_root()?.join(format!("componentize-py-{COMPONENTIZE_PY}"));
    let by_hand = format!(
        "{shown} -m venv {v} && {v}/bin/pip install componentize-py=={COMPONENTIZE_PY} && touch {v}/{INSTALLED}",
        v = venv.display()
    );
    if !venv.join(INSTALLED).is_file() {
        // The interpreter is needed only to install: the venv has its own after.
        let check = Command::new(&py)
            .args([
                "-c",
                "import sys; print('%d.%d' % sys.version_info[:2]); sys.exit(sys.version_info < (3, 10))",
            ])
            .output();
        match check {
            Err(e) => bail!(
                "a Python handler is built with componentize-py, which needs Python 3.10 or newer, and `{shown}` \
                 cannot be run ({e}): install Python 3 (e.g. `apt install python3 python3-venv`, or from \
                 https://www.python.org/downloads/), or set WEIR_PYTHON to an interpreter"
            ),
            Ok(o) if !o.status.success() => bail!(
                "`{shown}` is Python {}; componentize-py needs 3.10 or newer: install a newer Python, or set \
                 WEIR_PYTHON to one",
                String::from_utf8_lossy(&o.stdout).trim()
            ),
            Ok(_) => {}
        }
    }
    let dir = installed("componentize-py", COMPONENTIZE_PY, offline, |venv| {
        step(&format!("  creating a venv: {shown} -m venv {}", venv.display()));
        run(
            Command::new(&py).arg("-m").arg("venv").arg(venv),
            &format!("`{shown} -m venv`"),
            "on Debian and Ubuntu the venv module is its own package: `apt install python3-venv`",
        )?;
        step(&format!(
            "  pip install componentize-py=={COMPONENTIZE_PY}{}",
            if offline {
                " --no-index (PIP_FIND_LINKS)"
            } else {
                " (from PyPI)"
            }
        ));
        let mut pip = Command::new(venv.join("bin/python"));
        pip.args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--quiet",
            "--progress-bar",
            "off",
        ]);
        if offline {
            pip.arg("--no-index");
        }
        pip.arg(format!("componentize-py=={COMPONENTIZE_PY}"));
        run(
            &mut pip,
            &format!("installing componentize-py {COMPONENTIZE_PY} with pip"),
            &format!(
                "pip's message above says why: with no network, install it where there is one or point pip at a \
                 mirror or wheel folder (PIP_INDEX_URL, PIP_FIND_LINKS); by hand: {by_hand}"
            ),
        )
    })?;
    Ok(dir.join("bin/componentize-py"))
}

/// Node's major version, or what to install.
fn node_major() -> anyhow::Result<u32> {
    const FIX: &str = "a JavaScript handler is built with ComponentizeJS, which needs Node.js 18 or newer and npm: \
                       install them (https://nodejs.org/, or e.g. `apt install nodejs npm`)";
    let out = Command::new("node")
        .arg("--version")
        .output()
        .with_context(|| format!("`node` cannot be run; {FIX}"))?;
    let version = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let major = version
        .trim_start_matches('v')
        .split('.')
        .next()
        .and_then(|m| m.parse::<u32>().ok())
        .with_context(|| format!("`node --version` said {version:?}; {FIX}"))?;
    if major < 18 {
        bail!("`node` is {version}; {FIX}");
    }
    Ok(major)
}

/// ComponentizeJS's command-line script, installed when missing.
pub fn componentize_js(offline: bool) -> anyhow::Result<PathBuf> {
    node_major()?;
    let root = cache_root()?;
    if !root
        .join(format!("componentize-js-{COMPONENTIZE_JS}"))
        .join(INSTALLED)
        .is_file()
    {
        let npm = Command::new("npm").arg("--version").output();
        if !npm.is_ok_and(|o| o.status.success()) {
            bail!(
                "`npm` cannot be run, and it is needed once, to install ComponentizeJS {COMPONENTIZE_JS}: install \
                 npm (it comes with Node.js from https://nodejs.org/; on Debian and Ubuntu `apt install npm`)"
            );
        }
    }
    let dir = installed("componentize-js", COMPONENTIZE_JS, offline, |dir| {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (file, text) in [("package.json", JS_PACKAGE), ("package-lock.json", JS_LOCK)] {
            std::fs::write(dir.join(file), text).with_context(|| format!("writing {}", dir.join(file).display()))?;
        }
        step(&format!(
            "  npm ci (@bytecodealliance/componentize-js {COMPONENTIZE_JS}, from {})",
            if offline {
                "npm's cache only"
            } else {
                "the npm registry"
            }
        ));
        let mut npm = Command::new("npm");
        npm.args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
            .current_dir(dir);
        if offline {
            npm.arg("--offline");
        }
        run(
            &mut npm,
            &format!("installing ComponentizeJS {COMPONENTIZE_JS} with `npm ci`"),
            &format!(
                "npm's message above says why: it needs npm (with Node.js 18 or newer) and the npm registry (no \
                 network? set npm's registry or proxy, or run `npm ci` in {} where there is one, then `touch {}`)",
                dir.display(),
                dir.join(INSTALLED).display()
            ),
        )
    })?;
    Ok(dir.join("node_modules/@bytecodealliance/componentize-js/src/cli.js"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pins_are_the_examples() {
        let requirements = include_str!("../../../../examples/python/orders/requirements.txt");
        assert!(
            requirements.contains(&format!("componentize-py=={COMPONENTIZE_PY}")),
            "{requirements}"
        );
        assert!(
            JS_PACKAGE.contains(&format!("\"@bytecodealliance/componentize-js\": \"{COMPONENTIZE_JS}\"")),
            "{JS_PACKAGE}"
        );
    }
}
