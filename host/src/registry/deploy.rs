//! Deploys and rollbacks: validate and compile first, store all or nothing,
//! then swap the version in the router in one write.

use std::sync::Arc;

use anyhow::Context as _;

use super::store::{Store, write_component, write_dir_history};
use super::types::digest;
use super::types::{Activation, Caller, DeployError, Deployed, Grants, Upload};
use super::{Priority, Registry, State, now_ms};
use crate::runtime::HandlerVersion;

impl Registry {
    /// Store a version and an activation of it; returns the activation.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn record(
        &self,
        name: &str,
        state: &State,
        v: &HandlerVersion,
        bytes: &[u8],
        grants: &Grants,
        source: &str,
        previous: Option<i64>,
    ) -> anyhow::Result<Activation> {
        let mut a = Activation {
            seq: state.current().map_or(1, |c| c.seq + 1),
            digest: v.digest.clone(),
            size: v.size as u64,
            at_ms: now_ms(),
            source: source.to_owned(),
            node: self.node.clone(),
            previous,
            grants: grants.clone(),
        };
        match &self.store {
            Store::Memory => {}
            Store::Dir(dir) => write_component(dir, &v.digest, bytes)?,
            Store::Shared(shared) => a = shared.activate(name, bytes, a).await?,
        }
        Ok(a)
    }

    /// Validate `bytes` and make them the current version of `name`.
    /// `grants`: the new version's capabilities (`None`: what the config gives).
    pub async fn deploy(
        &self,
        caller: &Caller,
        name: &str,
        bytes: Vec<u8>,
        grants: Option<Grants>,
        source: &str,
    ) -> Result<Deployed, DeployError> {
        self.deploy_from(caller, name, Upload::Bytes(bytes), grants, source)
            .await
    }

    /// [`Registry::deploy`] from bytes in memory or a file (an upload
    /// streamed to disk, read only when its turn in the caller's queue comes).
    pub async fn deploy_from(
        &self,
        caller: &Caller,
        name: &str,
        upload: Upload,
        grants: Option<Grants>,
        source: &str,
    ) -> Result<Deployed, DeployError> {
        let r = self.deploy_inner(caller, name, upload, grants, source).await;
        if r.is_err() {
            self.refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        r
    }

    async fn deploy_inner(
        &self,
        caller: &Caller,
        name: &str,
        upload: Upload,
        grants: Option<Grants>,
        source: &str,
    ) -> Result<Deployed, DeployError> {
        let started = std::time::Instant::now();
        let spec = self.authorize(caller, name)?;
        self.check_size(&upload)?;
        let grants = grants.unwrap_or_else(|| spec.config_grants.clone());
        self.check_grants(spec, &grants)?;
        let _queue = self.queue(caller).lock_owned().await;
        let _changing = self.changing(name).await;
        if let Some(c) = self.canaries.lock().get(name) {
            return Err(DeployError::Conflict(format!(
                "a canary of `{name}` runs (version {}, slots {:?}): promote it or roll it back before deploying",
                c.canary.digest, c.canary.slots
            )));
        }
        let bytes: Arc<[u8]> = Arc::from(self.read_upload(upload).await?);
        let new_digest = digest(&bytes);
        let (current, same) = {
            let states = self.states.lock();
            let cur = states.get(name).and_then(State::current).cloned();
            let same = cur
                .as_ref()
                .is_some_and(|c| c.digest == new_digest && c.grants == grants);
            (cur, same)
        };
        if same {
            return Ok(Deployed {
                handler: name.to_owned(),
                digest: new_digest,
                previous: None,
                swapped: false,
                kept_in: self.store.label(),
                took_ms: elapsed_ms(started),
                compiled_ms: None,
            });
        }
        let origin = format!("upload for handler `{name}` ({} bytes)", bytes.len());
        let version = self
            .compile(name, &bytes, &grants, &origin, Priority::Background)
            .await?;
        let compiled_ms = version
            .compiled_in
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        self.commit(name, version, &bytes, &grants, source, current.as_ref().map(|c| c.seq))
            .await?;
        Ok(Deployed {
            handler: name.to_owned(),
            digest: new_digest,
            previous: current.map(|c| c.digest),
            swapped: true,
            kept_in: self.store.label(),
            took_ms: elapsed_ms(started),
            compiled_ms,
        })
    }

    /// Size checks first: an upload larger than `node.max_component_size` is refused.
    pub(super) fn check_size(&self, upload: &Upload) -> Result<(), DeployError> {
        match upload.size() {
            size if size > self.max_size => Err(DeployError::TooLarge {
                size,
                max: self.max_size,
            }),
            _ => Ok(()),
        }
    }

    /// The upload's bytes (read from its spool file only now, when its turn
    /// in the caller's queue came), checked against `node.max_component_size`.
    pub(super) async fn read_upload(&self, upload: Upload) -> Result<Vec<u8>, DeployError> {
        let bytes = match upload {
            Upload::Bytes(b) => b,
            Upload::File { path, .. } => tokio::task::spawn_blocking(move || std::fs::read(&path))
                .await
                .map_err(|e| DeployError::Store(anyhow::anyhow!("reading the upload: {e}")))?
                .map_err(|e| DeployError::Store(anyhow::Error::from(e).context("reading the upload back from disk")))?,
        };
        if bytes.len() > self.max_size {
            return Err(DeployError::TooLarge {
                size: bytes.len(),
                max: self.max_size,
            });
        }
        Ok(bytes)
    }

    /// Make the version before the current one current again; while a
    /// canary runs, end the canary instead (every slot runs the stable
    /// version again, which stays current).
    pub async fn rollback(&self, caller: &Caller, name: &str) -> Result<Deployed, DeployError> {
        let started = std::time::Instant::now();
        self.authorize(caller, name)?;
        let _queue = self.queue(caller).lock_owned().await;
        let _changing = self.changing(name).await;
        if let Store::Shared(shared) = &self.store {
            // Another node may have deployed since: roll back the cluster's current.
            self.sync_one(shared.as_ref(), name).await.map_err(DeployError::Store)?;
        }
        if let Some(ended) = self.end_canary_locked(name, "operator".into()).await? {
            return Ok(Deployed {
                handler: name.to_owned(),
                digest: self.router.version(name).map(|v| v.digest.clone()).unwrap_or_default(),
                previous: Some(ended.digest),
                swapped: true,
                kept_in: self.store.label(),
                took_ms: elapsed_ms(started),
                compiled_ms: None,
            });
        }
        let (current, target) = {
            let states = self.states.lock();
            let state = states.get(name);
            let current = state.and_then(State::current).cloned();
            let target = current
                .as_ref()
                .and_then(|c| c.previous)
                .and_then(|p| state.and_then(|s| s.by_seq(p)).cloned());
            (current, target)
        };
        let (Some(current), Some(target)) = (current, target) else {
            return Err(DeployError::NoPrevious(format!(
                "handler `{name}` has no earlier version to roll back to"
            )));
        };
        let version = {
            let kept = self
                .states
                .lock()
                .get(name)
                .and_then(|s| s.compiled(&target.digest, &target.grants).cloned());
            match kept {
                Some(v) => v.reissue(),
                None => {
                    let bytes = self.bytes_of(name, &target.digest).await.map_err(DeployError::Store)?;
                    self.compile(
                        name,
                        &bytes,
                        &target.grants,
                        &format!("version {}", target.digest),
                        Priority::Background,
                    )
                    .await?
                }
            }
        };
        let bytes: Arc<[u8]> = match &self.store {
            Store::Shared(_) => Arc::from(Vec::new()), // already stored
            _ => self
                .bytes_of(name, &target.digest)
                .await
                .unwrap_or_else(|_| Arc::from(Vec::new())),
        };
        let compiled_ms = version
            .compiled_in
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        self.commit(name, version, &bytes, &target.grants, "rollback", target.previous)
            .await?;
        Ok(Deployed {
            handler: name.to_owned(),
            digest: target.digest,
            previous: Some(current.digest),
            swapped: true,
            kept_in: self.store.label(),
            took_ms: elapsed_ms(started),
            compiled_ms,
        })
    }

    /// Store `version` and its activation, then swap it in. Nothing is
    /// swapped when storing fails.
    pub(super) async fn commit(
        &self,
        name: &str,
        version: Arc<HandlerVersion>,
        bytes: &[u8],
        grants: &Grants,
        source: &str,
        previous: Option<i64>,
    ) -> Result<(), DeployError> {
        let state = self.snapshot(name);
        let activation = self
            .record(name, &state, &version, bytes, grants, source, previous)
            .await
            .map_err(DeployError::Store)?;
        self.activate(name, version, activation).map_err(DeployError::Store)
    }

    /// Swap: remember the activation and install `version`. In the data
    /// directory the history is written first: when that write fails,
    /// neither the registry nor the router changes (all or nothing), so the
    /// same deploy can be made again.
    pub(super) fn activate(
        &self,
        name: &str,
        version: Arc<HandlerVersion>,
        activation: Activation,
    ) -> anyhow::Result<()> {
        let mut states = self.states.lock();
        let state = states.entry(name.to_owned()).or_default();
        if let Store::Dir(dir) = &self.store {
            let config_digest = digest(&self.specs[name].config_bytes);
            let mut next = state.activations.clone();
            next.push(activation.clone());
            write_dir_history(dir, name, &config_digest, &next)
                .context("storing the deploy in node.data_dir failed; nothing was swapped")?;
        }
        state.activations.push(activation.clone());
        state.keep(&activation.grants, version.clone());
        drop(states);
        self.swap_in(name, version, &activation);
        Ok(())
    }

    /// The swap itself: install `version` in the router (the old one is
    /// retired), count it, say so.
    pub(super) fn swap_in(&self, name: &str, version: Arc<HandlerVersion>, activation: &Activation) {
        // Beside a running canary the stable version counts its calls too.
        if self.canaries.lock().contains_key(name) {
            version.tallying.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let old = self.router.install(version);
        self.swaps.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(
            handler = name,
            digest = %activation.digest,
            previous = old.as_ref().map(|o| o.digest.as_str()).unwrap_or("none"),
            source = %activation.source,
            node = %activation.node,
            "handler version swapped"
        );
    }
}

pub(super) fn elapsed_ms(t: std::time::Instant) -> u64 {
    u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX)
}
