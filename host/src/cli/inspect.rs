//! `weir inspect FILE.wasm` (what a component is: world, version, imports,
//! exports, size, digest, read without compiling it) and `weir config check
//! FILE` (a config validated as `weir run` would, without running a node).

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context as _;
use sha2::Digest as _;
use weir::config;

/// A component's top-level imports and exports, by name.
struct Shape {
    imports: Vec<String>,
    exports: Vec<String>,
}

/// Read the top-level import and export names of the component `bytes`
/// (nested modules and components are skipped, and so are types: a 0.3.0
/// world's `use types.{message, …}` imports the types by name at the top).
fn shape(bytes: &[u8]) -> anyhow::Result<Shape> {
    use wasmparser::{Parser, Payload};
    let mut shape = Shape {
        imports: Vec::new(),
        exports: Vec::new(),
    };
    let mut depth = 0usize;
    for payload in Parser::new(0).parse_all(bytes) {
        match payload.context("reading the component")? {
            Payload::ModuleSection { .. } | Payload::ComponentSection { .. } => depth += 1,
            Payload::End(_) => depth = depth.saturating_sub(1),
            Payload::ComponentImportSection(s) if depth == 0 => {
                for i in s {
                    let i = i.context("reading an import")?;
                    if !matches!(i.ty, wasmparser::ComponentTypeRef::Type(_)) {
                        shape.imports.push(i.name.name.to_owned());
                    }
                }
            }
            Payload::ComponentExportSection(s) if depth == 0 => {
                for e in s {
                    let e = e.context("reading an export")?;
                    if e.kind != wasmparser::ComponentExternalKind::Type {
                        shape.exports.push(e.name.name.to_owned());
                    }
                }
            }
            _ => {}
        }
    }
    Ok(shape)
}

/// The `weir:handler` version a component was built against, from its
/// imports (`weir:handler/host@X`), if it names one.
fn handler_version(shape: &Shape) -> Option<&str> {
    shape.imports.iter().chain(&shape.exports).find_map(|n| {
        n.strip_prefix("weir:handler/")
            .and_then(|r| r.split_once('@'))
            .map(|(_, v)| v)
    })
}

/// `weir inspect FILE`.
pub fn inspect(file: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    if let Some(why) = weir::runtime::engine::not_binary_component(&bytes) {
        anyhow::bail!("{} is not a valid WebAssembly component: {why}", file.display());
    }
    let shape = shape(&bytes).with_context(|| format!("{} is not a valid WebAssembly component", file.display()))?;
    let digest = hex::encode(sha2::Sha256::digest(&bytes));
    let version = handler_version(&shape);
    let handler = shape.exports.iter().any(|e| e == "handle") && shape.exports.iter().any(|e| e == "handle-batch");
    let world = match (handler, version) {
        (true, Some(v)) => format!("weir:handler/handler@{v}"),
        (true, None) => "weir:handler/handler (version not named: it imports nothing of weir's)".to_owned(),
        (false, _) => "not a Weir handler (it does not export handle and handle-batch)".to_owned(),
    };
    if json {
        let out = serde_json::json!({
            "file": file.display().to_string(),
            "size": bytes.len(),
            "sha256": digest,
            "world": world,
            "handler": handler,
            "version": version,
            "imports": shape.imports,
            "exports": shape.exports,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("{}", file.display());
        println!("  world    {world}");
        println!("  size     {} bytes", bytes.len());
        println!("  sha256   {digest}");
        println!("  imports  {}", list(&shape.imports));
        println!("  exports  {}", list(&shape.exports));
    }
    Ok(if handler { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn list(names: &[String]) -> String {
    if names.is_empty() {
        "(none)".to_owned()
    } else {
        names.join(", ")
    }
}

/// `weir config check FILE`: exit 0 when a node could start from it (as far
/// as can be told without the broker), 1 with every error otherwise.
pub fn config_check(file: &Path) -> anyhow::Result<ExitCode> {
    let cfg = config::load(file)?;
    let mut errors = 0;
    for w in cfg.validate().unwrap_or_default() {
        println!("  warning {}: {}", w.key, w.message);
    }
    for (i, h) in cfg.handler.iter().enumerate() {
        match weir::registry::component_bytes(h, i) {
            Err(e) => {
                println!("  error   {e:#}");
                errors += 1;
            }
            Ok(bytes) => {
                if let Some(why) = weir::runtime::engine::not_binary_component(&bytes) {
                    println!("  error   handler[{i}].component {}: {why}", h.component.display());
                    errors += 1;
                }
            }
        }
    }
    for (i, t) in cfg.topology.iter().enumerate() {
        let ctx = weir::retry::schedule::CheckContext::new(config::Config::retry_key(i));
        let report = t.schedule(cfg.transport.kind, None).check(&ctx);
        for v in &report.errors {
            println!("  error   {v}");
            errors += 1;
        }
    }
    if errors > 0 {
        println!("{}: {errors} error(s)", cfg.origin);
        return Ok(ExitCode::FAILURE);
    }
    let topologies: Vec<String> = cfg
        .topology
        .iter()
        .map(|t| format!("{} ({} slots)", t.name, t.slots))
        .collect();
    let handlers: Vec<String> = cfg
        .handler
        .iter()
        .map(|h| format!("{} ({} on {})", h.name, h.message_types.join(", "), h.topology))
        .collect();
    println!(
        "{}: valid: transport {}, cluster mode {}; topologies: {}; handlers: {}",
        cfg.origin,
        cfg.transport.kind.as_str(),
        cfg.cluster.mode.as_str(),
        list(&topologies),
        list(&handlers)
    );
    println!("(the broker and the database were not contacted: `weir schedule check` asks the broker too)");
    Ok(ExitCode::SUCCESS)
}
