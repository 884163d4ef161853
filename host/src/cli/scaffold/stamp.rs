//! A Python or JavaScript build's inputs, hashed, beside its output: componentize-py and
//! ComponentizeJS write a different component on every run from the same sources (their
//! pre-initialisation is not deterministic), so without this an unchanged project would get a
//! new digest each build: a new version to compile and swap, a history of identical code,
//! and `weir dev`'s "unchanged" never said. With it, a build whose inputs are those of the
//! last build keeps the last build's component, byte for byte.
//!
//! The inputs: every file of the project but build output, installed dependencies, version
//! control and components (the folders `weir dev` does not watch), by path and contents; the
//! toolchain's version, the module or source, the WIT folder and world; and this binary's
//! version. The stamp also records the component's sha256, so a component changed or replaced
//! by hand is built again, never trusted.

use std::path::{Path, PathBuf};

use sha2::Digest as _;

/// Folders whose files are not inputs (as `weir dev` watches them).
const NOT_INPUTS: [&str; 6] = ["target", "node_modules", ".git", "__pycache__", ".venv", "dist"];

/// The stamp of `out` (`NAME.wasm`): `.NAME.wasm.inputs`.
pub fn path(out: &Path) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    out.with_file_name(format!(".{name}.inputs"))
}

/// The hash of `dir`'s inputs and `settings` (toolchain version, entry, WIT, world).
pub fn inputs(dir: &Path, settings: &[&str]) -> std::io::Result<String> {
    hash(dir, settings, |_, bytes| bytes)
}

/// [`inputs`], with each file's contents seen through `view` (given its path relative to `dir`).
pub fn hash(dir: &Path, settings: &[&str], view: impl Fn(&Path, Vec<u8>) -> Vec<u8>) -> std::io::Result<String> {
    let mut files = Vec::new();
    collect(dir, dir, &mut files)?;
    files.sort();
    let mut h = sha2::Sha256::new();
    h.update(env!("CARGO_PKG_VERSION").as_bytes());
    for s in settings {
        h.update((s.len() as u64).to_le_bytes());
        h.update(s.as_bytes());
    }
    for rel in files {
        let bytes = view(&rel, std::fs::read(dir.join(&rel))?);
        let rel = rel.to_string_lossy();
        h.update((rel.len() as u64).to_le_bytes());
        h.update(rel.as_bytes());
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(&bytes);
    }
    Ok(hex::encode(h.finalize()))
}

fn collect(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        // Hidden files are editors' and tools' (and this stamp, and `.NAME.wasm.part`).
        if name.starts_with('.') || NOT_INPUTS.contains(&name.as_str()) {
            continue;
        }
        let kind = entry.file_type()?;
        let path = entry.path();
        if kind.is_dir() {
            collect(root, &path, out)?;
        } else if !name.ends_with(".wasm") {
            // A symlink is followed: its target's contents are what the toolchain reads.
            if let Ok(rel) = path.strip_prefix(root) {
                out.push(rel.to_owned());
            }
        }
    }
    Ok(())
}

/// Whether `out` is the component the last build made from `inputs` (its stamp says so, and
/// its bytes are the ones it recorded).
pub fn fresh(out: &Path, inputs: &str) -> bool {
    let Ok(stamp) = std::fs::read_to_string(path(out)) else {
        return false;
    };
    let mut lines = stamp.lines();
    let (Some(recorded_inputs), Some(recorded_output)) = (lines.next(), lines.next()) else {
        return false;
    };
    recorded_inputs == inputs
        && std::fs::read(out).is_ok_and(|b| hex::encode(sha2::Sha256::digest(&b)) == recorded_output)
}

/// Record that `out` (whose bytes are `bytes`) was built from `inputs`. A stamp that cannot be
/// written costs the next build its toolchain run, nothing else.
pub fn record(out: &Path, inputs: &str, bytes: &[u8]) {
    let text = format!("{inputs}\n{}\n", hex::encode(sha2::Sha256::digest(bytes)));
    if let Err(e) = std::fs::write(path(out), text) {
        tracing::debug!(error = %e, "cannot write the build stamp; the next build runs the toolchain again");
    }
}

/// Forget the stamp of `out` (a failed build, or a language without one).
pub fn clear(out: &Path) {
    let _ = std::fs::remove_file(path(out));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_sources_are_fresh_and_any_change_is_not() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        std::fs::write(dir.join("app.py"), "print('a')\n").unwrap();
        std::fs::create_dir_all(dir.join("wit")).unwrap();
        std::fs::write(dir.join("wit/handler.wit"), "package a:b;\n").unwrap();
        std::fs::create_dir_all(dir.join("__pycache__")).unwrap();
        std::fs::write(dir.join("__pycache__/app.pyc"), "x").unwrap();
        let out = dir.join("h.wasm");
        std::fs::write(&out, b"component v1").unwrap();
        let settings = ["componentize-py 0.25.1", "app", "wit", "handler"];
        let first = inputs(dir, &settings).unwrap();
        record(&out, &first, b"component v1");
        assert!(fresh(&out, &inputs(dir, &settings).unwrap()), "nothing changed");

        // Bytecode, editors' files and the component itself are not inputs.
        std::fs::write(dir.join("__pycache__/app.pyc"), "y").unwrap();
        std::fs::write(dir.join(".app.py.swp"), "z").unwrap();
        assert!(fresh(&out, &inputs(dir, &settings).unwrap()));

        // A source, a new file, a setting: not fresh.
        std::fs::write(dir.join("app.py"), "print('b')\n").unwrap();
        assert!(!fresh(&out, &inputs(dir, &settings).unwrap()));
        std::fs::write(dir.join("app.py"), "print('a')\n").unwrap();
        assert!(fresh(&out, &inputs(dir, &settings).unwrap()), "changed back");
        std::fs::write(dir.join("util.py"), "").unwrap();
        assert!(!fresh(&out, &inputs(dir, &settings).unwrap()));
        std::fs::remove_file(dir.join("util.py")).unwrap();
        let other = ["componentize-py 0.26.0", "app", "wit", "handler"];
        assert!(!fresh(&out, &inputs(dir, &other).unwrap()));

        // A component replaced by hand is not trusted.
        std::fs::write(&out, b"something else").unwrap();
        assert!(!fresh(&out, &first));
        clear(&out);
        std::fs::write(&out, b"component v1").unwrap();
        assert!(!fresh(&out, &first), "no stamp, no trust");
    }
}
