//! Reading a config file: parse, resolve paths, validate; the error that names the file, the
//! key and what would be accepted.

use std::collections::HashMap;
use std::path::Path;

use super::Config;
use crate::retry::schedule::Violation;

/// Why a config cannot be used. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{origin}: cannot read the config file: {source}")]
    Read {
        /// The path.
        origin: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Not valid TOML, an unknown key, or a value of the wrong shape; `message` is the toml
    /// crate's text with line, column and the offending key or value.
    #[error("{origin}: {}{message}", section.as_deref().map(|s| format!("in {s}: ")).unwrap_or_default())]
    Syntax {
        /// The file or label.
        origin: String,
        /// The enclosing table, e.g. `handler[1]`, when it could be found.
        section: Option<String>,
        /// The parser's message.
        message: String,
    },
    /// Well-formed but inconsistent: one violation per key at fault.
    #[error("{origin}: invalid config:\n{}", list(issues))]
    Invalid {
        /// The file or label.
        origin: String,
        /// Each key at fault, with what would be accepted.
        issues: Vec<Violation>,
    },
}

fn list(issues: &[Violation]) -> String {
    let lines: Vec<String> = issues.iter().map(|v| format!("  {v}")).collect();
    lines.join("\n")
}

/// Reads, parses and validates the config at `path` (see [`parse`]).
pub fn load(path: &Path) -> anyhow::Result<Config> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        origin: origin.clone(),
        source,
    })?;
    Ok(parse(&text, &origin)?)
}

/// Parses and validates `text`. `origin` is the file's path, named in errors; relative
/// component and preopen paths are resolved against its directory (a label with no directory,
/// like `"<inline>"`, leaves them as written). Warnings are not returned here: call
/// [`Config::validate`] to log them.
pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
    let mut config: Config = toml::from_str(text).map_err(|e| ConfigError::Syntax {
        origin: origin.to_string(),
        section: e.span().and_then(|span| section_at(text, span.start)),
        message: e.to_string().trim_end().to_string(),
    })?;
    config.origin = origin.to_string();
    if let Some(base) = Path::new(origin).parent().filter(|p| !p.as_os_str().is_empty()) {
        config.resolve_paths(base);
    }
    config.validate()?;
    Ok(config)
}

/// The table enclosing byte `offset` of `text`, from the headers before it: `node`,
/// `topology[2].retry`, `handler[1]`, …
pub(super) fn section_at(text: &str, offset: usize) -> Option<String> {
    let mut counts: HashMap<String, usize> = HashMap::new();
    let mut current: Option<String> = None;
    let mut arrays: HashMap<String, String> = HashMap::new();
    let mut start = 0;
    for line in text.split_inclusive('\n') {
        if start > offset {
            break;
        }
        start += line.len();
        let code = line.split('#').next().unwrap_or("").trim();
        let (array, inner) = if let Some(i) = code.strip_prefix("[[").and_then(|c| c.strip_suffix("]]")) {
            (true, i)
        } else if let Some(i) = code.strip_prefix('[').and_then(|c| c.strip_suffix(']')) {
            (false, i)
        } else {
            continue;
        };
        let name = inner.trim();
        let is_header = !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
        if !is_header {
            continue;
        }
        // Qualify with the index of the innermost array of tables it extends.
        let (parent, leaf) = name.rsplit_once('.').map_or(("", name), |(p, l)| (p, l));
        let qualified_parent = arrays.get(parent).cloned().unwrap_or_else(|| parent.to_string());
        let base = if parent.is_empty() {
            leaf.to_string()
        } else {
            format!("{qualified_parent}.{leaf}")
        };
        if array {
            let n = counts.entry(name.to_string()).or_insert(0);
            let q = format!("{base}[{n}]");
            *n += 1;
            arrays.insert(name.to_string(), q.clone());
            current = Some(q);
        } else {
            current = Some(base);
        }
    }
    current
}
