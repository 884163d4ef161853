//! Pinned versions: a message redriven with `--handler-version DIGEST`
//! (header `weir-handler-pin`) runs on that version of its handler. A node
//! finds it among the versions it keeps compiled (the current one and a few
//! before it), else compiles it from its store (the configured component,
//! `node.data_dir`, or the database in `postgres` mode) and keeps a few such
//! versions compiled beside the current ones. A version that was never
//! deployed to the handler, or whose bytes are not kept, cannot be pinned.
//!
//! [`stored`] answers the same question without a running node, from what
//! the config's store holds: `weir dead-letters redrive` refuses a pin that
//! a node started from the same config could not honour.

use std::sync::Arc;

use sqlx::PgPool;

use super::store::{DirHistory, Store, pg};
use super::types::digest;
use super::{Grants, Priority, Registry, component_bytes};
use crate::config::Config;
use crate::router::PinResolver;
use crate::runtime::HandlerVersion;

/// Pinned versions kept compiled beside the handlers' current ones (the
/// oldest is retired first).
const KEEP_PINNED: usize = 4;

impl Registry {
    /// Version `digest` of handler `name`, compiled: see the module docs.
    pub async fn pinned_version(&self, name: &str, digest_hex: &str) -> Result<Arc<HandlerVersion>, String> {
        let Some(spec) = self.specs.get(name) else {
            return Err(format!("no handler `{name}` is configured on node {}", self.node));
        };
        if let Some(v) = self.router.version(name).filter(|v| v.digest == digest_hex) {
            return Ok(v);
        }
        // A pin never brings back a capability the handler no longer has:
        // the pinned version's grants must all be the current version's too.
        let current = || {
            self.states
                .lock()
                .get(name)
                .and_then(|s| s.current().map(|a| a.grants.clone()))
                .unwrap_or_else(|| spec.config_grants.clone())
        };
        let allowed = |grants: &Grants| match beyond(grants, &current()) {
            None => Ok(()),
            Some(extra) => Err(format!(
                "version {digest_hex} of handler `{name}` was deployed with {extra}, which the current version does \
                 not have: a pinned version never runs with more than the current one"
            )),
        };
        let find = |this: &Self| {
            let kept = this
                .states
                .lock()
                .get(name)
                .and_then(|s| s.compiled.iter().rev().find(|(_, v)| v.digest == digest_hex).cloned());
            kept.or_else(|| {
                this.pinned
                    .lock()
                    .iter()
                    .find(|(_, v)| v.name() == name && v.digest == digest_hex)
                    .cloned()
            })
        };
        if let Some((grants, v)) = find(self) {
            return allowed(&grants).map(|()| v);
        }
        // One compilation at a time: lanes pinned to the same version wait
        // for it instead of compiling it again.
        let _compiling = self.pin_compiles.lock().await;
        if let Some((grants, v)) = find(self) {
            return allowed(&grants).map(|()| v);
        }
        let mut activations = self
            .states
            .lock()
            .get(name)
            .map(|s| s.activations.clone())
            .unwrap_or_default();
        if let Store::Shared(shared) = &self.store
            && !activations.iter().any(|a| a.digest == digest_hex)
        {
            activations = shared.activations(name).await.map_err(|e| format!("{e:#}"))?;
        }
        let grants = match activations.iter().rev().find(|a| a.digest == digest_hex) {
            Some(a) => a.grants.clone(),
            None if digest(&spec.config_bytes) == digest_hex => spec.config_grants.clone(),
            None => {
                return Err(format!(
                    "version {digest_hex} was never deployed to handler `{name}` on node {} ({})",
                    self.node,
                    known(&activations)
                ));
            }
        };
        allowed(&grants)?;
        let bytes = self.bytes_of(name, digest_hex).await.map_err(|e| format!("{e:#}"))?;
        let origin = format!("version {digest_hex} of `{name}` (pinned)");
        let v = self
            .compile(name, &bytes, &grants, &origin, Priority::Background)
            .await
            .map_err(|e| e.to_string())?;
        tracing::info!(handler = name, digest = digest_hex, "pinned version compiled");
        let mut pinned = self.pinned.lock();
        pinned.push((grants, v.clone()));
        if pinned.len() > KEEP_PINNED {
            // Workers drop the instances they keep of a retired version.
            pinned.remove(0).1.retire();
        }
        Ok(v)
    }

    /// Pinned versions compiled so far and still kept.
    pub fn pinned_kept(&self) -> Vec<Arc<HandlerVersion>> {
        self.pinned.lock().iter().map(|(_, v)| v.clone()).collect()
    }

    /// The handler that messages of `message_type` (tenant `tenant`) on
    /// `topology` are bound to.
    pub fn handler_for(&self, topology: &str, tenant: Option<&str>, message_type: &str) -> Option<String> {
        let probe = crate::envelope::new_message(
            String::new(),
            message_type,
            None,
            tenant.map(str::to_owned),
            Vec::new(),
            Vec::new(),
        );
        self.router.handler_name(topology, &probe).map(str::to_owned)
    }
}

/// The first grant of `pinned` that `current` lacks, described; `None` when
/// `pinned` grants nothing more than `current`.
fn beyond(pinned: &Grants, current: &Grants) -> Option<String> {
    if let Some(d) = pinned.dirs.iter().find(|d| !current.dirs.contains(d)) {
        return Some(format!("the directory grant {} (host {})", d.guest, d.host.display()));
    }
    pinned
        .env
        .iter()
        .find(|e| !current.env.contains(e))
        .map(|e| format!("the environment variable grant {e}"))
}

/// The versions `activations` name, for an error.
fn known(activations: &[super::Activation]) -> String {
    let mut digests: Vec<&str> = activations.iter().rev().map(|a| a.digest.as_str()).collect();
    digests.dedup();
    if digests.is_empty() {
        "it has no recorded versions".into()
    } else {
        format!("its versions, newest first: {}", digests.join(", "))
    }
}

#[async_trait::async_trait]
impl PinResolver for Registry {
    async fn pinned(&self, handler: &str, digest: &str) -> Result<Arc<HandlerVersion>, String> {
        self.pinned_version(handler, digest).await
    }
}

/// Whether a node started from `config` could run version `digest_hex` of
/// handler `name`: it is the configured component, or the store the config
/// names holds it as a version of that handler (`node.data_dir`, or the
/// coordinator database `database`, in `postgres` mode). Reads only; the
/// error says why not.
pub async fn stored(config: &Config, database: Option<&PgPool>, name: &str, digest_hex: &str) -> Result<(), String> {
    let (i, h) = config
        .handler
        .iter()
        .enumerate()
        .find(|(_, h)| h.name == name)
        .ok_or_else(|| format!("no [[handler]] `{name}` in {}", config.origin))?;
    let config_digest = digest(&component_bytes(h, i).map_err(|e| format!("{e:#}"))?);
    if config_digest == digest_hex {
        return Ok(());
    }
    if let Some(pool) = database {
        let activations = pg::activations(pool, name).await.map_err(|e| format!("{e:#}"))?;
        return match activations.iter().any(|a| a.digest == digest_hex) {
            true => Ok(()),
            false => Err(format!(
                "the coordinator database has no version {digest_hex} of handler `{name}` ({})",
                known(&activations)
            )),
        };
    }
    let Some(dir) = &config.node.data_dir else {
        return Err(format!(
            "version {digest_hex} is not handler `{name}`'s configured component, and {} keeps no other versions \
             (no node.data_dir, not cluster.mode = \"postgres\"): a running node may still have it; redrive through \
             its admin API (POST /v1/dead-letters/redrive?handler_version=…), which asks the node",
            config.origin
        ));
    };
    let path = dir.join("handlers").join(format!("{name}.json"));
    let history: DirHistory = std::fs::read(&path)
        .map_err(|e| format!("node.data_dir: reading {}: {e}", path.display()))
        .and_then(|b| {
            serde_json::from_slice(&b)
                .map_err(|e| format!("node.data_dir: {} is not a handler history: {e}", path.display()))
        })?;
    if history.config_digest != config_digest {
        return Err(format!(
            "node.data_dir: the history of handler `{name}` ({}) began with another configured component, so a node \
             started from {} serves only its configured version {config_digest}",
            path.display(),
            config.origin
        ));
    }
    if !history.activations.iter().any(|a| a.digest == digest_hex) {
        return Err(format!(
            "node.data_dir has no version {digest_hex} of handler `{name}` ({})",
            known(&history.activations)
        ));
    }
    let component = dir.join("components").join(format!("{digest_hex}.wasm"));
    match std::fs::read(&component) {
        Ok(b) if digest(&b) == digest_hex => Ok(()),
        Ok(_) => Err(format!(
            "{} does not hold version {digest_hex} (its digest differs): the data directory was altered",
            component.display()
        )),
        Err(e) => Err(format!("node.data_dir: reading {}: {e}", component.display())),
    }
}
