//! The layout keeps its shape: no import circle between the top-level
//! modules of `host/src`, none between its files, and nothing imports
//! `node` (the composition root) but the demo; and `main.rs` (the `weir`
//! binary) parses and hands its command to `cli/`, the command line's wing.
//!
//! It reads the sources, not the compiler: every `crate::…` and `super::…`
//! path outside comments and `#[cfg(test)]` blocks (in `use` trees and in
//! code) is resolved to the deepest module file it names, starting from the
//! `mod` declarations of `lib.rs`. A `mod child;` line is a declaration, not
//! an import, and a `pub use child::X` in a module is its face (it hands a
//! name of its own part on), not an import: every other `use` and path is.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One module file of the library: its module path and its source.
struct Module {
    path: Vec<String>,
    file: PathBuf,
    source: String,
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The file of module `path` (`a/b.rs` or `a/b/mod.rs`), if there is one.
fn module_file(path: &[String]) -> Option<PathBuf> {
    let root = src_dir();
    if path.is_empty() {
        return Some(root.join("lib.rs"));
    }
    let joined: PathBuf = path.iter().collect();
    let flat = root.join(&joined).with_extension("rs");
    let nested = root.join(&joined).join("mod.rs");
    [flat, nested].into_iter().find(|p| p.is_file())
}

/// Remove comments, string and char literals (their text could look like a path).
fn strip(source: &str) -> String {
    let b = source.as_bytes();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                i += 1;
            }
            i += 2;
        } else if b[i] == b'r' && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#')) && !ident(b, i) {
            // A raw string: r"…" or r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(b[i] as char);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == b'"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&b'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if b[i] == b'\'' && b.get(i + 2) == Some(&b'\'') {
            out.push_str("' '");
            i += 3;
        } else if b[i] == b'\'' && b.get(i + 1) == Some(&b'\\') {
            // '\n', '\'', '\u{..}'
            let mut j = i + 2;
            while j < b.len() && b[j] != b'\'' {
                j += 1;
            }
            out.push_str("' '");
            i = j + 1;
        } else {
            let ch = source[i..].chars().next().unwrap_or(' ');
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

fn ident(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

/// Cut every `#[cfg(test)]` item (a `mod tests { … }` or a single item) out.
fn without_tests(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        // The item ends at the `;` or the brace that closes its first `{`.
        let mut depth = 0usize;
        let mut end = after.len();
        for (i, c) in after.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = i + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// The `mod NAME;` declarations of a source (children in their own files).
fn child_modules(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in code.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some(pos) = words.iter().position(|w| *w == "mod") else {
            continue;
        };
        if let Some(name) = words.get(pos + 1).and_then(|n| n.strip_suffix(';')) {
            let is_vis = words[..pos].iter().all(|w| w.starts_with("pub") || w.starts_with('#'));
            if is_vis {
                out.push(name.to_owned());
            }
        }
    }
    out
}

/// Every module of the library, from `lib.rs` down.
fn modules() -> Vec<Module> {
    let mut out = Vec::new();
    let mut todo = vec![Vec::<String>::new()];
    while let Some(path) = todo.pop() {
        let Some(file) = module_file(&path) else {
            continue;
        };
        let source = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
        let code = without_tests(&strip(&source));
        for child in child_modules(&code) {
            let mut p = path.clone();
            p.push(child);
            todo.push(p);
        }
        out.push(Module {
            path,
            file,
            source: code,
        });
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

/// Expand a `use` tree (`a::{b, c::{d, e}}`) into its paths.
fn expand(tree: &str) -> Vec<String> {
    // Drop the renames (`x as y`), then the whitespace.
    let words: Vec<&str> = tree.split_whitespace().collect();
    let mut kept = String::new();
    let mut i = 0;
    while i < words.len() {
        if words[i] == "as" {
            // Keep what followed the new name (`}`, `,`).
            let tail = words
                .get(i + 1)
                .map_or("", |w| w.trim_start_matches(|c: char| c.is_alphanumeric() || c == '_'));
            kept.push_str(tail);
            i += 2;
            continue;
        }
        kept.push_str(words[i]);
        i += 1;
    }
    let tree = kept;
    let mut out = Vec::new();
    expand_into("", &tree, &mut out);
    out
}

fn expand_into(prefix: &str, tree: &str, out: &mut Vec<String>) {
    if let Some(open) = tree.find('{') {
        let head = &tree[..open];
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        let mut depth = 0;
        let mut start = 0;
        let mut parts = Vec::new();
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&inner[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        parts.push(&inner[start..]);
        for p in parts.into_iter().filter(|p| !p.is_empty()) {
            expand_into(&format!("{prefix}{head}"), p, out);
        }
    } else {
        out.push(format!("{prefix}{tree}"));
    }
}

/// A path a module names, and whether a `pub use` names it (a re-export).
struct Named {
    path: String,
    reexport: bool,
}

/// The paths a module names: `use` trees and paths in code.
fn named_paths(code: &str) -> Vec<Named> {
    let mut out = Vec::new();
    // `use` items, possibly over several lines.
    let mut rest = code;
    while let Some(at) = find_word(rest, "use") {
        let before = rest[..at].trim_end();
        let reexport = before.ends_with("pub") || before.ends_with(')') && before.contains("pub(");
        let after = &rest[at + 3..];
        let end = after.find(';').unwrap_or(after.len());
        out.extend(expand(&after[..end]).into_iter().map(|path| Named { path, reexport }));
        rest = &after[end..];
    }
    // Paths in code: `crate::a::b`, `super::a`.
    let b = code.as_bytes();
    for start in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(at) = code[from..].find(start) {
            let i = from + at;
            from = i + start.len();
            if ident(b, i) || (i >= 2 && &code[i - 2..i] == "::") {
                continue;
            }
            let path: String = code[i..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            let path = path.trim_end_matches(':').to_owned();
            out.push(Named { path, reexport: false });
        }
    }
    out
}

/// Does a module use the name a re-export of `path` hands on, beyond the
/// re-export itself? Then it depends on that part like any importer.
fn uses_itself(code: &str, path: &str) -> bool {
    let name = path.rsplit("::").next().unwrap_or(path);
    if name.is_empty() || name == "self" || name == "*" {
        return true;
    }
    find_ident(&without_declarations(code), name).is_some()
}

/// `code` without its `use` items and `mod NAME;` declarations: what is left
/// is what the module does with the names.
fn without_declarations(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = find_word(rest, "use") {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        rest = &after[after.find(';').map_or(after.len(), |e| e + 1)..];
    }
    out.push_str(rest);
    out.lines()
        .filter(|l| {
            let t = l.trim_start();
            !(t.starts_with("mod ") || t.starts_with("pub mod ") || t.starts_with("pub(crate) mod ")) || t.contains('{')
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The next occurrence of `name` as a whole identifier.
fn find_ident(s: &str, name: &str) -> Option<usize> {
    let b = s.as_bytes();
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut from = 0;
    while let Some(at) = s[from..].find(name) {
        let i = from + at;
        let end = i + name.len();
        if (i == 0 || !is_ident(b[i - 1])) && b.get(end).is_none_or(|c| !is_ident(*c)) {
            return Some(i);
        }
        from = end;
    }
    None
}

fn find_word(s: &str, word: &str) -> Option<usize> {
    let b = s.as_bytes();
    let mut from = 0;
    while let Some(at) = s[from..].find(word) {
        let i = from + at;
        let end = i + word.len();
        let before_ok = i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
        let after_ok = b.get(end).is_some_and(|c| c.is_ascii_whitespace());
        if before_ok && after_ok {
            return Some(i);
        }
        from = end;
    }
    None
}

/// The module a path in module `here` names: the deepest module with a file
/// of its own along it (`None` for paths outside the crate).
fn resolve(here: &[String], is_mod_rs: bool, path: &str) -> Option<Vec<String>> {
    let segments: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
    let (mut base, rest): (Vec<String>, &[&str]) = match segments.first() {
        Some(&"crate") => (Vec::new(), &segments[1..]),
        Some(&"super") => {
            // `super` of a file module is its parent; repeated `super`s climb.
            let mut base = here.to_vec();
            let mut i = 0;
            while segments.get(i) == Some(&"super") {
                base.pop();
                i += 1;
            }
            let _ = is_mod_rs;
            (base, &segments[i..])
        }
        Some(&"self") => (here.to_vec(), &segments[1..]),
        _ => return None,
    };
    for s in rest {
        let mut next = base.clone();
        next.push((*s).to_owned());
        if module_file(&next).is_some() {
            base = next;
        } else {
            break;
        }
    }
    Some(base)
}

/// A relative `use child::…` inside a module (a child or a sibling item).
fn resolve_relative(here: &[String], path: &str) -> Option<Vec<String>> {
    let first = path.split("::").next()?;
    if matches!(first, "crate" | "super" | "self" | "std" | "core" | "alloc") || first.is_empty() {
        return None;
    }
    let mut p = here.to_vec();
    p.push(first.to_owned());
    module_file(&p)?;
    resolve(here, false, &format!("self::{path}"))
}

type Graph = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

/// Edges between files and between top-level modules, each with the paths that make it.
fn graphs() -> (Graph, Graph) {
    let mods = modules();
    let name = |p: &[String]| if p.is_empty() { "lib".to_owned() } else { p.join("::") };
    let mut files: Graph = BTreeMap::new();
    let mut tops: Graph = BTreeMap::new();
    for m in &mods {
        let from = name(&m.path);
        files.entry(from.clone()).or_default();
        let is_mod_rs = m.file.ends_with("mod.rs");
        for Named { path, reexport } in named_paths(&m.source) {
            let target = resolve(&m.path, is_mod_rs, &path).or_else(|| resolve_relative(&m.path, &path));
            let Some(target) = target else { continue };
            if target == m.path || target.is_empty() {
                continue;
            }
            // A module's face: `pub use child::Name` hands a name of its own
            // part on; whoever imports it depends on the child, not the
            // parent on it.
            if reexport && target.starts_with(&m.path) && !uses_itself(&m.source, &path) {
                continue;
            }
            files
                .entry(from.clone())
                .or_default()
                .entry(name(&target))
                .or_default()
                .insert(path.clone());
            if let (Some(a), Some(b)) = (m.path.first(), target.first())
                && a != b
            {
                tops.entry(a.clone())
                    .or_default()
                    .entry(b.clone())
                    .or_default()
                    .insert(format!("{from}: {path}"));
            }
        }
    }
    (files, tops)
}

/// The first cycle found, as a list of nodes (first == last), if any.
fn find_cycle(g: &Graph) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    fn visit(n: &str, g: &Graph, marks: &mut BTreeMap<String, Mark>, stack: &mut Vec<String>) -> Option<Vec<String>> {
        marks.insert(n.to_owned(), Mark::Open);
        stack.push(n.to_owned());
        for next in g
            .get(n)
            .map(|e| e.keys().cloned().collect::<Vec<_>>())
            .unwrap_or_default()
        {
            match marks.get(&next).copied().unwrap_or(Mark::New) {
                Mark::Open => {
                    let at = stack.iter().position(|s| *s == next).unwrap_or(0);
                    let mut cycle = stack[at..].to_vec();
                    cycle.push(next);
                    return Some(cycle);
                }
                Mark::New => {
                    if let Some(c) = visit(&next, g, marks, stack) {
                        return Some(c);
                    }
                }
                Mark::Done => {}
            }
        }
        stack.pop();
        marks.insert(n.to_owned(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for n in g.keys() {
        if marks.get(n).copied().unwrap_or(Mark::New) == Mark::New
            && let Some(c) = visit(n, g, &mut marks, &mut Vec::new())
        {
            return Some(c);
        }
    }
    None
}

fn describe(g: &Graph, cycle: &[String]) -> String {
    let mut out = format!("import cycle: {}\n", cycle.join(" -> "));
    for pair in cycle.windows(2) {
        let why = g
            .get(&pair[0])
            .and_then(|e| e.get(&pair[1]))
            .map(|s| s.iter().cloned().collect::<Vec<_>>().join(", "))
            .unwrap_or_default();
        out.push_str(&format!("  {} -> {}: {why}\n", pair[0], pair[1]));
    }
    out
}

#[test]
fn the_sources_are_read() {
    let (files, tops) = graphs();
    // A parser that saw nothing would pass every check below.
    assert!(
        files.len() > 40,
        "only {} module files found under {}",
        files.len(),
        src_dir().display()
    );
    assert!(
        tops.get("dispatch").is_some_and(|e| e.contains_key("settle")),
        "the parser missed dispatch -> settle: {:?}",
        tops.get("dispatch")
    );
}

#[test]
fn no_cycle_between_top_level_modules() {
    let (_, tops) = graphs();
    if let Some(cycle) = find_cycle(&tops) {
        panic!("{}", describe(&tops, &cycle));
    }
}

#[test]
fn no_cycle_between_files() {
    let (files, _) = graphs();
    if let Some(cycle) = find_cycle(&files) {
        panic!("{}", describe(&files, &cycle));
    }
}

/// `node` composes the library's modules into a running node; only what runs nodes (the
/// binary's `cli/`, which is not in this graph, and the tests) may import it.
#[test]
fn nothing_in_the_library_imports_node() {
    let (_, tops) = graphs();
    assert!(tops.contains_key("node"), "the graph has no node module");
    let importers: Vec<&String> = tops
        .iter()
        .filter(|(from, edges)| edges.contains_key("node") && from.as_str() != "node")
        .map(|(from, _)| from)
        .collect();
    assert!(importers.is_empty(), "library modules importing node: {importers:?}");
}

#[test]
fn admin_reads_the_cluster_through_its_seam() {
    let (files, _) = graphs();
    let reached: Vec<&String> = files
        .iter()
        .filter(|(from, _)| from.starts_with("admin"))
        .flat_map(|(_, edges)| edges.keys())
        .filter(|to| {
            to.starts_with("cluster")
                && !matches!(
                    to.as_str(),
                    "cluster::coordinator" | "cluster::status" | "cluster::slots"
                )
        })
        .collect();
    assert!(reached.is_empty(), "admin reaches into {reached:?}");
}

#[test]
fn the_cycle_check_sees_a_cycle() {
    // Negative control for the checker itself.
    let mut g: Graph = BTreeMap::new();
    for (a, b) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")] {
        g.entry(a.into())
            .or_default()
            .entry(b.into())
            .or_default()
            .insert("x".into());
    }
    let cycle = find_cycle(&g).unwrap_or_default();
    assert_eq!(cycle, ["a", "b", "c", "a"]);
    assert_eq!(
        expand("crate::a::{b, c::{d, e as f}}"),
        ["crate::a::b", "crate::a::c::d", "crate::a::c::e"]
    );
}

/// The guest SDK binds its own copy of the contract (so `cargo package -p
/// weir-guest` and `weir new` projects carry it): it must be the contract's
/// newest version, 0.3.0.
#[test]
fn the_guest_sdk_binds_the_same_wit_as_the_host() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let host = std::fs::read_to_string(root.join("wit/0.3.0/handler.wit")).unwrap();
    let sdk = std::fs::read_to_string(root.join("guest-sdk/wit/handler.wit")).unwrap();
    assert!(
        host == sdk,
        "guest-sdk/wit/handler.wit differs from wit/0.3.0/handler.wit: copy wit/0.3.0/handler.wit over it"
    );
}

/// What `main.rs` may hold besides comments: `mod cli;` as its only module
/// (every subcommand lives in the command line's wing, `cli/`) and `main` as
/// its only function (parse, set up logging, hand the command over).
fn main_shape(source: &str) -> Result<(), String> {
    let code = strip(source);
    let mods = child_modules(&code);
    if mods != ["cli"] {
        return Err(format!(
            "main.rs declares the modules {mods:?}; only `cli` belongs there"
        ));
    }
    let fns: Vec<&str> = code
        .split("fn ")
        .skip(1)
        .filter_map(|rest| rest.split(['(', '<']).next())
        .collect();
    if fns != ["main"] {
        return Err(format!(
            "main.rs defines the functions {fns:?}; only `main` belongs there"
        ));
    }
    Ok(())
}

#[test]
fn main_rs_parses_and_hands_the_command_to_cli() {
    let main = std::fs::read_to_string(src_dir().join("main.rs")).unwrap();
    main_shape(&main).unwrap_or_else(|e| panic!("{e}"));
    // Negative control: the shape main.rs had grown to (a subcommand's
    // module beside `cli`, and the command's work in its own functions).
    let grown = "mod call;\nmod cli;\nfn main() {}\nfn run(cli: Cli) {}\n";
    assert!(main_shape(grown).is_err());
    assert!(main_shape("mod cli;\nfn main() {}\nfn drain() {}\n").is_err());
}

/// A file's lines of code that is not its tests': those before its `#[cfg(test)]` module.
fn code_lines(source: &str) -> usize {
    source.lines().take_while(|l| !l.starts_with("#[cfg(test)]")).count()
}

/// Issue 35: rooms stop growing back. A file of `host/src` (the library and the command line)
/// over 600 lines of non-test code is split by concern; `tests.rs` files are tests.
#[test]
fn no_source_file_passes_600_lines_of_code() {
    let mut over = Vec::new();
    let mut seen = 0;
    let mut todo = vec![src_dir()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") && !path.ends_with("tests.rs") {
                seen += 1;
                let n = code_lines(&std::fs::read_to_string(&path).unwrap());
                if n > 600 {
                    over.push(format!("{} ({n})", path.strip_prefix(src_dir()).unwrap().display()));
                }
            }
        }
    }
    assert!(
        seen > 100,
        "only {seen} source files found under {}",
        src_dir().display()
    );
    assert!(
        over.is_empty(),
        "files over 600 lines of non-test code; split them by concern: {over:?}"
    );
    // Negative control: a file that grew, with its tests after it.
    let grown = format!("{}#[cfg(test)]\nmod tests {{\n}}\n", "fn f() {}\n".repeat(601));
    assert_eq!(code_lines(&grown), 601);
}
