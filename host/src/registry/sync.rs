//! Following changes made elsewhere: deploys and canaries on other nodes
//! (`postgres`: LISTEN/NOTIFY; `nats-kv`: a watch of the handlers bucket;
//! both with a poll as a backstop) and components dropped into the watched
//! directory (`node.components_dir`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use futures::StreamExt as _;
use tokio::sync::watch;

use super::shared::{Changes, Shared};
use super::store::Store;
use super::types::Caller;
use super::{Priority, Registry, SYNC_POLL, WATCH_POLL};

impl Registry {
    /// Follow deploys, promotions and canaries made on other nodes
    /// (`postgres`, `nats-kv`) until `stop`.
    pub fn follow(self: &Arc<Self>, stop: watch::Receiver<bool>) -> Option<tokio::task::JoinHandle<()>> {
        let Store::Shared(shared) = &self.store else {
            return None;
        };
        let (me, shared) = (self.clone(), shared.clone());
        Some(tokio::spawn(async move { me.follow_loop(shared, stop).await }))
    }

    async fn follow_loop(self: Arc<Self>, shared: Arc<dyn Shared>, mut stop: watch::Receiver<bool>) {
        let mut changes: Option<Changes> = None;
        loop {
            if *stop.borrow() {
                return;
            }
            if changes.is_none() {
                match shared.changes().await {
                    Ok(c) => changes = c,
                    Err(e) => tracing::warn!(error = %format!("{e:#}"), "no notifications of deploys; polling"),
                }
            }
            for name in self.specs.keys() {
                let _changing = self.changing(name).await;
                if let Err(e) = self.sync_one(shared.as_ref(), name).await {
                    tracing::error!(handler = %name, error = %format!("{e:#}"), "cannot apply the cluster's version; the running version stays");
                }
            }
            let wake = async {
                match changes.as_mut() {
                    Some(c) => c.next().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                woke = wake => if woke.is_none() {
                    tracing::warn!("deploy notifications lost; listening again");
                    changes = None;
                },
                () = tokio::time::sleep(SYNC_POLL) => {}
                _ = stop.changed() => {}
            }
        }
    }

    /// Apply the cluster's current version of `name` if it is newer than
    /// ours, and run its canary (or stop running the one that ended).
    pub(super) async fn sync_one(&self, shared: &dyn Shared, name: &str) -> anyhow::Result<()> {
        self.sync_current(shared, name).await?;
        let live = shared.live_canary(name).await?;
        let ours = self.canaries.lock().get(name).map(|r| r.canary.id);
        if ours.is_some()
            && live.as_ref().map(|c| c.id) != ours
            && let Some((c, outcome, reason, at_ms)) = shared.last_ended(name).await?
            && Some(c.id) == ours
        {
            self.ended.lock().insert(
                name.to_owned(),
                super::types::Ended {
                    digest: c.digest,
                    slots: c.slots,
                    outcome: if outcome == "promoted" {
                        "promoted"
                    } else {
                        "rolled-back"
                    },
                    reason,
                    at_ms,
                    compare: self.canary(name).map(|v| v.compare),
                },
            );
        }
        let stable = self
            .router
            .version(name)
            .ok_or_else(|| anyhow::anyhow!("handler `{name}` has no version installed"))?;
        self.follow_canary(name, stable, live).await
    }

    async fn sync_current(&self, shared: &dyn Shared, name: &str) -> anyhow::Result<()> {
        let activations = shared.activations(name).await?;
        let Some(latest) = activations.last().cloned() else {
            return Ok(());
        };
        let ours = self.states.lock().get(name).and_then(|s| s.current().map(|c| c.seq));
        if ours.is_some_and(|s| s >= latest.seq) {
            return Ok(());
        }
        let kept = self
            .states
            .lock()
            .get(name)
            .and_then(|s| s.compiled(&latest.digest, &latest.grants).cloned());
        // A promoted canary: its compiled code becomes the stable version.
        let kept = kept.or_else(|| {
            self.canaries
                .lock()
                .get(name)
                .filter(|r| r.canary.digest == latest.digest && r.canary.grants == latest.grants)
                .map(|r| r.version.clone())
        });
        let version = match kept {
            Some(v) => v.reissue(),
            None => {
                let bytes = self.bytes_of(name, &latest.digest).await?;
                self.compile(
                    name,
                    &bytes,
                    &latest.grants,
                    &format!("cluster version {}", latest.digest),
                    Priority::Background,
                )
                .await?
            }
        };
        let mut states = self.states.lock();
        let state = states.entry(name.to_owned()).or_default();
        state.activations = activations;
        state.keep(&latest.grants, version.clone());
        drop(states);
        self.swap_in(name, version, &latest);
        Ok(())
    }

    /// Deploy `{handler}.wasm` files that appear or change in `dir` until `stop`.
    pub fn watch(self: &Arc<Self>, dir: PathBuf, stop: watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move { me.watch_loop(dir, stop).await })
    }

    async fn watch_loop(self: Arc<Self>, dir: PathBuf, mut stop: watch::Receiver<bool>) {
        // (len, mtime) of each file as last acted on.
        let mut seen: HashMap<PathBuf, (u64, Option<SystemTime>)> = HashMap::new();
        tracing::info!(dir = %dir.display(), "watching for components");
        loop {
            if *stop.borrow() {
                return;
            }
            for (path, name, stamp) in scan(&dir) {
                if seen.get(&path) == Some(&stamp) {
                    continue;
                }
                seen.insert(path.clone(), stamp);
                if !self.specs.contains_key(&name) {
                    tracing::warn!(file = %path.display(), "no handler named `{name}`: file ignored");
                    continue;
                }
                let bytes = match std::fs::read(&path) {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::warn!(file = %path.display(), error = %e, "cannot read");
                        continue;
                    }
                };
                match self.deploy(&Caller::Operator, &name, bytes, None, "watch").await {
                    Ok(d) if d.swapped => {
                        tracing::info!(file = %path.display(), handler = %name, digest = %d.digest, "deployed from the components directory")
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::error!(file = %path.display(), handler = %name, error = %e, "refused; the running version stays")
                    }
                }
            }
            tokio::select! {
                () = tokio::time::sleep(WATCH_POLL) => {}
                _ = stop.changed() => {}
            }
        }
    }
}

/// `{name}.wasm` files in `dir` with their (len, mtime).
fn scan(dir: &Path) -> Vec<(PathBuf, String, (u64, Option<SystemTime>))> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let path = e.path();
            if path.extension()? != "wasm" {
                return None;
            }
            let name = path.file_stem()?.to_str()?.to_owned();
            let meta = e.metadata().ok()?;
            Some((path, name, (meta.len(), meta.modified().ok())))
        })
        .collect()
}
