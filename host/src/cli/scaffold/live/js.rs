//! Live sources for JavaScript: a component built once around `templates/js/dev/live.js.tmpl`,
//! a module that reads the handler's source file from the mounted project before each call
//! and, on the first call and after each save, evaluates it in place of a build.
//!
//! The evaluated source is the handler's one file: its import of `weir:handler/host` becomes
//! a `const` of the same names, and its `export` keywords go. A handler with any other import
//! (another file, another interface) or an export that is not a declaration cannot run so;
//! [`blocker`] says why, and `weir dev` builds each of its saves instead. The component imports
//! `wasi:filesystem` at the version StarlingMonkey itself imports, so the world it is built
//! against is the project's, plus those preopens (the WIT is in `templates/js/dev/wasi/`).

use std::path::Path;
use std::sync::LazyLock;

use anyhow::Context as _;
use regex::Regex;

use super::super::{Project, toolchain};

/// The module the component is built from.
pub(super) const MODULE: &str = "weir_dev_live.js";

/// The module; `{{source}}` is the handler's file and `{{host_import}}` its host import.
const SHIM: &str = include_str!("../../../../templates/js/dev/live.js.tmpl");

/// The world the component targets: the project's, with the project folder's preopens.
const WORLD: &str = "weir-dev";

/// The WASI packages the world's `wasi:filesystem/preopens` needs.
const WASI: [(&str, &str); 3] = [
    (
        "filesystem.wit",
        include_str!("../../../../templates/js/dev/wasi/filesystem.wit"),
    ),
    ("io.wit", include_str!("../../../../templates/js/dev/wasi/io.wit")),
    (
        "clocks.wit",
        include_str!("../../../../templates/js/dev/wasi/clocks.wit"),
    ),
];

/// An import of the host, as the module rewrites it (its `HOST_IMPORT`, the same pattern).
static HOST_IMPORT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r#"import\s*(\{[^}]*\}|\*\s*as\s+[\w$]+)\s*from\s*(?:'(weir:handler/host@[0-9.]+)'|"(weir:handler/host@[0-9.]+)")\s*;?"#,
    )
    .unwrap_or_else(|e| unreachable!("a valid pattern: {e}"))
});

/// Any static import, with what it imports from.
static IMPORT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"(?m)^[ \t]*import\b\s*(?:[^'";]*?\bfrom\s*)?(?:'([^']*)'|"([^"]*)")"#)
        .unwrap_or_else(|e| unreachable!("a valid pattern: {e}"))
});

/// Why `source` cannot run as live sources, if it cannot.
pub(super) fn blocker(source: &str) -> Option<String> {
    let rest = HOST_IMPORT.replace_all(source, "");
    for line in rest.lines() {
        let t = line.trim_start();
        let starts_word = |word: &str, then: &[char]| t.strip_prefix(word).is_some_and(|a| a.starts_with(then));
        if starts_word("import", &[' ', '\t', '{', '*', '\'', '"']) {
            return Some(format!(
                "it has `{}` (live sources run one file, importing only weir:handler/host with {{ … }} or * as)",
                t.trim_end()
            ));
        }
        if starts_word("export", &[' ', '\t', '{', '*']) {
            let after = t["export".len()..].trim_start();
            let declared = ["function", "async function", "const ", "let ", "var ", "class "]
                .iter()
                .any(|k| {
                    after.starts_with(k)
                        || after
                            .strip_prefix("async")
                            .is_some_and(|a| a.trim_start().starts_with(k))
                });
            if !declared {
                return Some(format!(
                    "it has `{}` (live sources take exports that are declarations: export function, export const, …)",
                    t.trim_end()
                ));
            }
        }
    }
    None
}

/// A JavaScript file as the signature sees it: what it imports from, and, for the handler's
/// own file, whether it can run live.
pub(super) fn view(entry: bool, bytes: Vec<u8>) -> Vec<u8> {
    let text = String::from_utf8_lossy(&bytes);
    let mut out: Vec<String> = IMPORT
        .captures_iter(&text)
        .filter_map(|c| c.get(1).or_else(|| c.get(2)).map(|m| m.as_str().to_owned()))
        .collect();
    if entry {
        out.push(blocker(&text).unwrap_or_default());
    }
    out.join("\n").into_bytes()
}

/// The module for `project`, whose handler's source is `source`.
fn shim(project: &Project, source: &str) -> String {
    let host_import = match HOST_IMPORT.captures(source) {
        Some(c) => {
            let specifier = c.get(2).or_else(|| c.get(3)).map_or("", |m| m.as_str());
            format!("import * as host from '{specifier}';")
        }
        None => "const host = {};".to_owned(),
    };
    SHIM.replace("{{source}}", &project.entry)
        .replace("{{host_import}}", &host_import)
}

/// The text of the module (for the signature: a new one builds again).
pub(super) fn template() -> &'static str {
    SHIM
}

/// Build the live component of `project` (in `dir`) into `out`, its inputs written in `place`.
pub(super) fn build(project: &Project, dir: &Path, place: &Path, out: &Path, offline: bool) -> anyhow::Result<()> {
    let source_path = dir.join(&project.entry);
    let source = std::fs::read_to_string(&source_path).with_context(|| format!("reading {}", source_path.display()))?;
    if let Some(why) = blocker(&source) {
        anyhow::bail!("{} cannot run as live sources: {why}", project.entry);
    }
    // The project's WIT, the world that adds the preopens, and the WASI packages it needs.
    let wit = place.join("wit");
    let _ = std::fs::remove_dir_all(&wit);
    copy_dir(&dir.join(&project.wit), &wit)?;
    let deps = wit.join("deps");
    std::fs::create_dir_all(&deps).with_context(|| format!("creating {}", deps.display()))?;
    for (file, text) in WASI {
        let at = deps.join(format!("weir-dev-wasi-{file}"));
        std::fs::write(&at, text).with_context(|| format!("writing {}", at.display()))?;
    }
    let world = format!(
        "world {WORLD} {{\n    include {};\n    import wasi:filesystem/preopens@0.2.10;\n}}\n",
        project.world
    );
    std::fs::write(wit.join("weir-dev.wit"), world).with_context(|| format!("writing {}", wit.display()))?;
    let module = place.join(MODULE);
    std::fs::write(&module, shim(project, &source)).with_context(|| format!("writing {}", module.display()))?;
    let cli = toolchain::componentize_js(offline)?;
    super::super::componentize_js(&cli, &module, &wit, WORLD, out)
}

/// The folder the node mounts: the handler's file as [`serve`] last copied it.
pub(super) fn serving(place: &Path) -> std::path::PathBuf {
    place.join("serving")
}

/// Copy the handler's file of `project` (in `dir`) to [`serving`], whole or not at all: the
/// module may read it at any moment.
pub(super) fn serve(project: &Project, dir: &Path, place: &Path) -> anyhow::Result<()> {
    let (from, to) = (dir.join(&project.entry), serving(place).join(&project.entry));
    let parent = to.parent().unwrap_or(place);
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let part = to.with_extension("js.part");
    std::fs::copy(&from, &part).with_context(|| format!("copying {} to {}", from.display(), part.display()))?;
    std::fs::rename(&part, &to).with_context(|| format!("renaming {} to {}", part.display(), to.display()))
}

fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry.with_context(|| format!("reading {}", from.display()))?;
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        if src.is_dir() {
            copy_dir(&src, &dst)?;
        } else {
            std::fs::copy(&src, &dst).with_context(|| format!("copying {} to {}", src.display(), dst.display()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_handler_runs_live_and_one_with_another_import_does_not() {
        let template = include_str!("../../../../templates/js/handler.js.tmpl");
        assert_eq!(blocker(template), None);
        let multi = "import {\n  log,\n  publish as send,\n} from \"weir:handler/host@0.3.0\";\nexport async function handle(m) {}\n";
        assert_eq!(blocker(multi), None);
        let other = "import { log } from 'weir:handler/host@0.2.0';\nimport { helper } from './helper.js';\n";
        assert!(blocker(other).unwrap().contains("./helper.js"), "{:?}", blocker(other));
        let default = "export default { handle() {} };\n";
        assert!(blocker(default).unwrap().contains("export default"));
        let listed = "function handle() {}\nexport { handle };\n";
        assert!(blocker(listed).is_some());
    }

    #[test]
    fn the_signature_sees_what_a_file_imports_from_not_what_it_names() {
        let a = view(
            true,
            b"import { log } from 'weir:handler/host@0.2.0';\nexport function handle() { log('a'); }\n".to_vec(),
        );
        let b = view(
            true,
            b"import { log, publish } from 'weir:handler/host@0.2.0';\nexport function handle() { publish(); }\n"
                .to_vec(),
        );
        assert_eq!(a, b, "a new name from the same import needs no build");
        let c = view(
            true,
            b"import { log } from 'weir:handler/host@0.2.0';\nimport x from './x.js';\n".to_vec(),
        );
        assert_ne!(a, c, "a new import does");
        let d = view(
            true,
            b"import { log } from 'weir:handler/host@0.2.0';\nexport default {};\n".to_vec(),
        );
        assert_ne!(a, d, "an export that cannot run live does");
    }

    #[test]
    fn the_module_imports_the_host_at_the_version_the_handler_does() {
        let project = Project {
            lang: super::super::super::Lang::Js,
            name: "x".into(),
            entry: "handler.js".into(),
            wit: "wit".into(),
            world: "handler".into(),
        };
        let text = shim(&project, "import { log } from 'weir:handler/host@0.3.0';\n");
        assert!(
            text.contains("import * as host from 'weir:handler/host@0.3.0';"),
            "{text}"
        );
        assert!(text.contains("const SOURCE = 'handler.js';"));
        assert!(shim(&project, "export function handle() {}\n").contains("const host = {};"));
    }
}
