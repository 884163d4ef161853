//! What `weir dev` watches, and what a change does: a build and a deploy, or with a Python
//! project's live sources nothing at all when the running component can load it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;

use super::CONFIG_FILE;
use crate::cli::{deploy, scaffold};

/// The project `weir dev` runs: its language, directory and name.
#[derive(Clone)]
pub(super) struct Project {
    pub(super) lang: scaffold::Lang,
    pub(super) dir: PathBuf,
    pub(super) name: String,
}

/// Directories of a project that hold no sources: build output, installed
/// dependencies, version control.
const NOT_SOURCES: [&str; 6] = ["target", "node_modules", ".git", "__pycache__", ".venv", "dist"];

impl Project {
    /// Is `path` a source whose change means a rebuild? Everything in the
    /// project but build output, dependencies, hidden files, components and
    /// `weir.toml` (a config change needs a restart: said at start) that the
    /// language's build reads ([`scaffold::Lang::is_source`]).
    pub(super) fn is_source(&self, path: &Path) -> bool {
        let Ok(rel) = path.strip_prefix(&self.dir) else {
            return false;
        };
        let hidden_or_built = rel.components().any(|c| {
            let c = c.as_os_str().to_string_lossy();
            c.starts_with('.') || NOT_SOURCES.contains(&c.as_ref())
        });
        let name = rel
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        !hidden_or_built
            && !name.ends_with(".wasm")
            && !name.ends_with('~')
            && !name.ends_with(".swp")
            && name != CONFIG_FILE
            && !rel.as_os_str().is_empty()
            && self.lang.is_source(rel)
    }

    pub(super) fn watched_label(&self) -> String {
        format!(
            "{} (all but {}, *.wasm and {CONFIG_FILE}; restart for a {CONFIG_FILE} change)",
            self.dir.display(),
            NOT_SOURCES.join(", ")
        )
    }
}

/// Watch the project's sources; a change sends on `changed` (coalesced).
pub(super) fn watch(
    project: &Project,
    changed: tokio::sync::mpsc::Sender<()>,
) -> anyhow::Result<notify::RecommendedWatcher> {
    use notify::Watcher as _;
    let relevant = project.clone();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else { return };
        if matches!(event.kind, notify::EventKind::Access(_)) {
            return;
        }
        if event.paths.iter().any(|p| relevant.is_source(p)) {
            // Full: a rebuild is already due; it will see this change too.
            let _ = changed.try_send(());
        }
    })
    .context("starting the file watcher")?;
    watcher
        .watch(&project.dir, notify::RecursiveMode::Recursive)
        .with_context(|| format!("watching {}", project.dir.display()))?;
    Ok(watcher)
}

/// How long a burst of file events is let settle before a rebuild (an
/// editor's save is several events).
const SETTLE: Duration = Duration::from_millis(300);

/// What the rebuild loop needs.
pub(super) struct Rebuild {
    pub(super) dir: PathBuf,
    pub(super) offline: bool,
    pub(super) admin: String,
    pub(super) token: String,
    pub(super) handler: String,
    /// Live sources: the signature of the sources the running component was built from.
    pub(super) live: Option<String>,
}

/// Rebuild and deploy on each change, one at a time; with live sources, only a change
/// that a running component cannot load needs it.
pub(super) async fn rebuild_loop(mut changed: tokio::sync::mpsc::Receiver<()>, mut r: Rebuild) {
    while changed.recv().await.is_some() {
        // Let the burst end, then take what arrived meanwhile.
        tokio::time::sleep(SETTLE).await;
        while changed.try_recv().is_ok() {}
        if let Some(built) = &r.live {
            match scaffold::live::signature(&r.dir) {
                Ok(now) if now == *built => {
                    match scaffold::live::serve(&r.dir) {
                        Ok(()) => println!("weir dev: saved; the next message runs it (live sources: no build)"),
                        Err(e) => println!("weir dev: saved, but not served, the previous sources still run: {e:#}"),
                    }
                    continue;
                }
                Ok(_) => println!("weir dev: an import or a file other than the sources changed; rebuilding …"),
                Err(e) => println!("weir dev: {e:#}; rebuilding …"),
            }
        } else {
            println!("weir dev: sources changed; rebuilding …");
        }
        let (dir, offline, live) = (r.dir.clone(), r.offline, r.live.is_some());
        let (admin, token, handler) = (r.admin.clone(), r.token.clone(), r.handler.clone());
        let done = tokio::task::spawn_blocking(move || -> anyhow::Result<(bool, Option<String>)> {
            let live = live && {
                let why = scaffold::live::unsupported(&dir)?;
                if let Some(why) = &why {
                    println!("weir dev: from now on each save is built: {why}");
                }
                why.is_none()
            };
            let (wasm, signature) = if live {
                let (wasm, signature) = scaffold::live::build(&dir, offline)?;
                (wasm, Some(signature))
            } else {
                (scaffold::build(&dir, offline)?, None)
            };
            let swapped = deploy::deploy(
                &deploy::Target {
                    admin: &admin,
                    token: &token,
                    handler: &handler,
                },
                &wasm,
                &[],
                &[],
                &deploy::CanaryArgs::default(),
            )?;
            Ok((swapped, signature))
        })
        .await;
        match done {
            Ok(Ok((swapped, signature))) => {
                // Live sources, rebuilt for their new imports; or no longer (`unsupported`).
                r.live = signature;
                if swapped {
                    println!("weir dev: swapped; new messages run the new version");
                } else {
                    println!("weir dev: the build is the version already running; nothing to swap");
                }
            }
            Ok(Err(e)) => println!("weir dev: not swapped, the previous version still runs: {e:#}"),
            Err(e) => println!("weir dev: the rebuild task failed: {e}"),
        }
    }
}
