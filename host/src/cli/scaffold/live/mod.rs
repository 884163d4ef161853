//! Live sources for a Python or JavaScript handler in `weir dev`: a save runs at once, without
//! a build.
//!
//! componentize-py and ComponentizeJS take seconds to tens of seconds for every build (they
//! pre-initialise the interpreter with the handler loaded), and the node then compiles the new
//! component. In `weir dev` the component is instead built once around a small entry module of
//! weir's (below, per language), and the node mounts the sources read-only at `/0`. Before
//! each call the entry module looks at the source files: one saved since it was loaded is
//! loaded again. So a save is seen by the next message, with no build and no compile.
//!
//! - Python ([`python`]): componentize-py mounted the project at `/0` at build time too, and
//!   the entry module imports the handler's module then, so the component holds it and all it
//!   imports; a changed module is imported again from the mount.
//! - JavaScript ([`js`]): the entry module reads the handler's file from the mount and
//!   evaluates it. The mount is a copy `weir dev` makes of each save it can run ([`serve`]).
//!   It runs a handler whose one file imports only `weir:handler/host`; [`unsupported`] says
//!   when a project cannot run so, and `weir dev` builds its saves.
//!
//! What a component cannot load at run time is a module it does not hold (componentize-py
//! keeps no standard library for run time; StarlingMonkey evaluates one file). So `weir dev`
//! builds again when a source's imports change, or anything else the build reads (the WIT,
//! `pyproject.toml`, `package.json`): [`signature`] is what must stay the same for a save to
//! need no build, and the component built for one signature is kept in the user's cache and
//! used again. Until a new build is swapped in, a Python reload that meets a module the
//! component lacks keeps the previous sources serving, as a failed build does. The component
//! is `weir dev`'s own; `NAME.wasm`, which `weir build` makes for a deploy, is never this one.

mod js;
mod python;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context as _;

use super::{Lang, stamp, toolchain};

/// Where the sources are mounted in the component, at run time ([`mount`]; for Python at
/// build time too: the first `--python-path` of componentize-py).
pub const GUEST_DIR: &str = "/0";

/// Why the project in `dir` cannot run with live sources, if it cannot.
pub fn unsupported(dir: &Path) -> anyhow::Result<Option<String>> {
    let project = super::detect(dir)?;
    Ok(match project.lang {
        Lang::Rust => Some("a Rust handler is built on each save (it builds in seconds)".to_owned()),
        Lang::Python => None,
        Lang::Js => {
            let path = dir.join(&project.entry);
            let source = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            js::blocker(&source).map(|why| format!("{}: {why}", project.entry))
        }
    })
}

/// What must stay the same for a save to need no build: the project's files as a build reads
/// them, except that a source file counts by what it imports alone.
pub fn signature(dir: &Path) -> anyhow::Result<String> {
    let project = super::detect(dir)?;
    let entry = Path::new(&project.entry);
    let settings: [&str; 2] = match project.lang {
        Lang::Js => [toolchain::COMPONENTIZE_JS, js::template()],
        _ => [toolchain::COMPONENTIZE_PY, python::SHIM],
    };
    let ext = |rel: &Path, exts: &[&str]| rel.extension().is_some_and(|e| exts.iter().any(|x| e == *x));
    super::stamp::hash(dir, &settings, |rel, bytes| match project.lang {
        Lang::Python if ext(rel, &["py"]) => python::view(bytes),
        Lang::Js if ext(rel, &["js", "mjs", "cjs"]) => js::view(rel == entry, bytes),
        _ => bytes,
    })
    .with_context(|| format!("reading the sources of {}", dir.display()))
}

/// The live component of the project in `dir`, in the user's cache, with its [`signature`]:
/// built, unless the one built for this signature is there.
pub fn build(dir: &Path, offline: bool) -> anyhow::Result<(PathBuf, String)> {
    let project = super::detect(dir)?;
    let signature = signature(dir)?;
    let root = std::fs::canonicalize(dir).with_context(|| format!("reading {}", dir.display()))?;
    let place = place(&project, &root);
    std::fs::create_dir_all(&place).with_context(|| format!("creating {}", place.display()))?;
    let out = place.join(format!("{}.wasm", project.name));
    let started = Instant::now();
    if stamp::fresh(&out, &signature) {
        serve(dir)?;
        let bytes = std::fs::read(&out).with_context(|| format!("reading {}", out.display()))?;
        super::report(
            &out,
            &bytes,
            started,
            " (weir dev's own, with live sources: built before for these imports)",
        );
        return Ok((out, signature));
    }
    eprintln!(
        "weir dev: building {} with live sources (a save runs at once; a new import rebuilds) …",
        project.name
    );
    let built = match project.lang {
        Lang::Python => {
            let module = place.join(format!("{}.py", python::MODULE));
            std::fs::write(&module, python::shim(&project)).with_context(|| format!("writing {}", module.display()))?;
            let componentize = toolchain::componentize_py(offline)?;
            super::componentize_py(&componentize, &project, dir, &[&root, &place], python::MODULE, &out)
        }
        Lang::Js => js::build(&project, dir, &place, &out, offline),
        Lang::Rust => Err(anyhow::anyhow!("live sources are for Python and JavaScript handlers")),
    };
    if let Err(e) = built {
        stamp::clear(&out);
        return Err(e);
    }
    serve(dir)?;
    let bytes = std::fs::read(&out).with_context(|| format!("reading {}", out.display()))?;
    stamp::record(&out, &signature, &bytes);
    super::report(&out, &bytes, started, " (weir dev's own, with live sources)");
    Ok((out, signature))
}

/// The folder the node mounts at [`GUEST_DIR`] for the live component of the project in
/// `dir`: the project itself for Python; for JavaScript the copy [`serve`] keeps.
pub fn mount(dir: &Path) -> anyhow::Result<PathBuf> {
    let project = super::detect(dir)?;
    let root = std::fs::canonicalize(dir).with_context(|| format!("reading {}", dir.display()))?;
    Ok(match project.lang {
        Lang::Js => js::serving(&place(&project, &root)),
        _ => root,
    })
}

/// Make the project's sources as they are now the ones the next call runs, when they were
/// saved with the same [`signature`] as the running component's. Python reads the project
/// itself; a JavaScript handler's file is copied where the node mounts it, so a save that the
/// component cannot run (a new import, being built) never reaches it, and the previous
/// sources keep serving until the new build is swapped in.
pub fn serve(dir: &Path) -> anyhow::Result<()> {
    let project = super::detect(dir)?;
    if project.lang != Lang::Js {
        return Ok(());
    }
    let root = std::fs::canonicalize(dir).with_context(|| format!("reading {}", dir.display()))?;
    js::serve(&project, dir, &place(&project, &root))
}

/// Where the live component of `project` (at `root`, canonical) and its inputs are kept.
fn place(project: &super::Project, root: &Path) -> PathBuf {
    crate::cli::call::cache_dir()
        .unwrap_or_else(std::env::temp_dir)
        .join("dev")
        .join(format!("{}-{}", project.name, &hex::encode(sha2_of(root))[..12]))
}

fn sha2_of(path: &Path) -> Vec<u8> {
    use sha2::Digest as _;
    sha2::Sha256::digest(path.as_os_str().as_encoded_bytes()).to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_save_needs_a_build_only_when_an_import_or_a_file_that_is_not_python_changes() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("app.py"), "import json\n\ndef f():\n    return 'Hello'\n").unwrap();
        std::fs::write(d.join("pyproject.toml"), "[project]\nname = \"x\"\n[tool.weir]\n").unwrap();
        let first = signature(d).unwrap();
        std::fs::write(d.join("app.py"), "import json\n\ndef f():\n    return 'Howdy'\n").unwrap();
        assert_eq!(signature(d).unwrap(), first, "a changed body needs no build");
        std::fs::write(
            d.join("app.py"),
            "import json\nimport decimal\n\ndef f():\n    return 'Howdy'\n",
        )
        .unwrap();
        let imported = signature(d).unwrap();
        assert_ne!(imported, first, "a new import needs a build");
        std::fs::write(d.join("pyproject.toml"), "[project]\nname = \"y\"\n[tool.weir]\n").unwrap();
        assert_ne!(
            signature(d).unwrap(),
            imported,
            "a changed pyproject.toml needs a build"
        );
        std::fs::write(d.join("helpers.py"), "X = 1\n").unwrap();
        let added = signature(d).unwrap();
        std::fs::write(d.join("helpers.py"), "X = 2\n").unwrap();
        assert_eq!(signature(d).unwrap(), added, "a module's body needs no build");
    }

    #[test]
    fn a_javascript_save_needs_a_build_only_when_what_it_imports_from_changes() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let package = r#"{"name": "x", "weir": {"source": "handler.js"}}"#;
        std::fs::write(d.join("package.json"), package).unwrap();
        let host = "import { log } from 'weir:handler/host@0.2.0';\n";
        std::fs::write(
            d.join("handler.js"),
            format!("{host}export function handle() {{ log('a'); }}\n"),
        )
        .unwrap();
        let first = signature(d).unwrap();
        assert_eq!(unsupported(d).unwrap(), None);
        std::fs::write(
            d.join("handler.js"),
            format!("{host}export function handle() {{ log('b'); }}\n"),
        )
        .unwrap();
        assert_eq!(signature(d).unwrap(), first, "a changed body needs no build");
        std::fs::write(
            d.join("handler.js"),
            format!("{host}import {{ x }} from './x.js';\nexport function handle() {{ log(x); }}\n"),
        )
        .unwrap();
        assert_ne!(signature(d).unwrap(), first, "a new import needs a build");
        assert!(
            unsupported(d).unwrap().is_some_and(|why| why.contains("./x.js")),
            "and it cannot run live"
        );
    }
}
