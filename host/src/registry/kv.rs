//! Handler versions in `nats-kv` mode: two buckets beside the coordination
//! bucket, created by the first node that starts.
//!
//! - `<cluster.bucket>-handlers`: one key per handler, `h.<hex name>`, whose
//!   value is its whole record ([`Doc`]: activations, live canary, how the
//!   last one ended); every change is a compare-and-set on the key's
//!   revision, so two nodes deploying at once each get their own sequence
//!   number and a promotion ends the canary and activates its version in
//!   one write. Canary tallies are `t.<id>.<hex node>`.
//! - `<cluster.bucket>-components`: each version's bytes in chunks of
//!   [`CHUNK`] (a NATS message is at most 1 MiB by default),
//!   `c.<digest>.<i>`, then `c.<digest>` with their count, written last, so
//!   a version whose count is there is whole. Read back, the bytes are
//!   checked against their digest.
//!
//! Nodes follow the handlers bucket with a watch, and poll as a backstop.

use std::time::Duration;

use anyhow::{Context as _, bail};
use async_nats::jetstream::{self, kv};
use async_trait::async_trait;
use futures::StreamExt as _;
use serde::{Deserialize, Serialize};

use super::shared::{Changes, EndedRecord, Shared};
use super::types::{Activation, Canary, Tally, digest};
use crate::dedup::kv::side_bucket;

/// Bytes per component chunk.
pub const CHUNK: usize = 256 * 1024;
/// Compare-and-set attempts before a change gives up (others keep winning).
const CAS_TRIES: usize = 32;
/// Activations kept per handler (the record is one bucket value): older ones
/// are dropped, so rollbacks walk back at most this far.
const KEEP_ACTIVATIONS: usize = 512;

/// The handlers bucket of coordination bucket `bucket`.
pub fn handlers_bucket(bucket: &str) -> String {
    format!("{bucket}-handlers")
}

/// The components bucket of coordination bucket `bucket`.
pub fn components_bucket(bucket: &str) -> String {
    format!("{bucket}-components")
}

/// A handler's record.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct Doc {
    activations: Vec<Activation>,
    canary: Option<Canary>,
    /// The last canary that ended: (canary, outcome, reason, ms).
    ended: Option<(Canary, String, String, i64)>,
    /// The last canary id given.
    canary_ids: i64,
}

/// A component's chunk count and size, written after its chunks.
#[derive(Serialize, Deserialize)]
struct Meta {
    size: usize,
    chunks: usize,
}

/// The version store of a `nats-kv` cluster.
pub struct Buckets {
    handlers: kv::Store,
    components: kv::Store,
}

fn doc_key(name: &str) -> String {
    format!("h.{}", hex::encode(name))
}

fn now_ms() -> i64 {
    super::now_ms()
}

impl Buckets {
    /// The two buckets beside coordination bucket `bucket`, if a node made
    /// them (reads only: `weir status`).
    pub async fn existing(js: &jetstream::Context, bucket: &str) -> anyhow::Result<Option<Self>> {
        let (Ok(handlers), Ok(components)) = (
            js.get_key_value(handlers_bucket(bucket)).await,
            js.get_key_value(components_bucket(bucket)).await,
        ) else {
            return Ok(None);
        };
        Ok(Some(Self { handlers, components }))
    }

    /// Open (or create) the two buckets beside coordination bucket `bucket`.
    pub async fn open(js: &jetstream::Context, bucket: &str, replicas: usize) -> anyhow::Result<Self> {
        let handlers = side_bucket(
            js,
            &handlers_bucket(bucket),
            replicas,
            Duration::ZERO,
            "weir: handler versions and canaries",
        )
        .await?;
        let components = side_bucket(
            js,
            &components_bucket(bucket),
            replicas,
            Duration::ZERO,
            "weir: handler components",
        )
        .await?;
        Ok(Self { handlers, components })
    }

    async fn doc(&self, name: &str) -> anyhow::Result<(Doc, Option<u64>)> {
        let entry = self
            .handlers
            .entry(doc_key(name))
            .await
            .with_context(|| format!("reading the versions of `{name}` from the bucket"))?;
        match entry {
            Some(e) if !e.value.is_empty() => {
                let doc = serde_json::from_slice(&e.value)
                    .with_context(|| format!("the bucket's record of `{name}` does not decode"))?;
                Ok((doc, Some(e.revision)))
            }
            Some(e) => Ok((Doc::default(), Some(e.revision))),
            None => Ok((Doc::default(), None)),
        }
    }

    /// Change `name`'s record with `f` (which may refuse), compare-and-set,
    /// again on a conflict. Returns what `f` returned.
    async fn change<T>(&self, name: &str, mut f: impl FnMut(&mut Doc) -> anyhow::Result<T>) -> anyhow::Result<T> {
        for _ in 0..CAS_TRIES {
            let (mut doc, revision) = self.doc(name).await?;
            let out = f(&mut doc)?;
            let value = serde_json::to_vec(&doc).context("encoding a handler record")?;
            let written = match revision {
                Some(r) => self
                    .handlers
                    .update(doc_key(name), value.into(), r)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
                None => self
                    .handlers
                    .create(doc_key(name), value.into())
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
            };
            match written {
                Ok(()) => return Ok(out),
                Err(e) => tracing::debug!(handler = name, error = %e, "handler record changed meanwhile; again"),
            }
        }
        bail!("the bucket's record of `{name}` kept changing under {CAS_TRIES} attempts; try again")
    }

    async fn store_component(&self, digest_hex: &str, bytes: &[u8]) -> anyhow::Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        let meta = format!("c.{digest_hex}");
        if self.components.get(&meta).await.ok().flatten().is_some() {
            return Ok(());
        }
        let chunks = bytes.chunks(CHUNK);
        let count = chunks.len();
        for (i, c) in chunks.enumerate() {
            self.components
                .put(format!("c.{digest_hex}.{i}"), c.to_vec().into())
                .await
                .with_context(|| format!("storing chunk {i} of {count} of version {digest_hex}"))?;
        }
        let m = serde_json::to_vec(&Meta {
            size: bytes.len(),
            chunks: count,
        })?;
        self.components
            .put(meta, m.into())
            .await
            .with_context(|| format!("storing version {digest_hex}"))?;
        Ok(())
    }
}

#[async_trait]
impl Shared for Buckets {
    fn label(&self) -> &'static str {
        "bucket"
    }

    async fn activations(&self, name: &str) -> anyhow::Result<Vec<Activation>> {
        Ok(self.doc(name).await?.0.activations)
    }

    async fn component(&self, name: &str, digest_hex: &str) -> anyhow::Result<Vec<u8>> {
        let meta = self
            .components
            .get(format!("c.{digest_hex}"))
            .await
            .with_context(|| format!("reading version {digest_hex} of `{name}` from the bucket"))?
            .with_context(|| format!("the bucket has no version {digest_hex} of `{name}`"))?;
        let meta: Meta = serde_json::from_slice(&meta).context("a component's chunk count does not decode")?;
        let mut out = Vec::with_capacity(meta.size);
        for i in 0..meta.chunks {
            let c = self
                .components
                .get(format!("c.{digest_hex}.{i}"))
                .await
                .with_context(|| format!("reading chunk {i} of version {digest_hex}"))?
                .with_context(|| format!("chunk {i} of version {digest_hex} is missing from the bucket"))?;
            out.extend_from_slice(&c);
        }
        anyhow::ensure!(
            digest(&out) == digest_hex,
            "the bucket's version {digest_hex} of `{name}` does not match its digest (altered or torn)"
        );
        Ok(out)
    }

    async fn activate(&self, name: &str, bytes: &[u8], a: Activation) -> anyhow::Result<Activation> {
        self.store_component(&a.digest, bytes).await?;
        self.change(name, |doc| {
            if a.source == "config" && !doc.activations.is_empty() {
                return Ok(a.clone());
            }
            Ok(push_activation(doc, a.clone()))
        })
        .await
    }

    async fn start_canary(&self, name: &str, bytes: &[u8], c: Canary) -> anyhow::Result<Canary> {
        self.store_component(&c.digest, bytes).await?;
        self.change(name, |doc| {
            if doc.canary.is_some() {
                bail!("another node started a canary of `{name}` meanwhile");
            }
            doc.canary_ids += 1;
            let started = Canary {
                id: doc.canary_ids,
                started_ms: now_ms(),
                ..c.clone()
            };
            doc.canary = Some(started.clone());
            Ok(started)
        })
        .await
    }

    async fn live_canary(&self, name: &str) -> anyhow::Result<Option<Canary>> {
        Ok(self.doc(name).await?.0.canary)
    }

    async fn last_ended(&self, name: &str) -> anyhow::Result<Option<EndedRecord>> {
        Ok(self.doc(name).await?.0.ended)
    }

    async fn end_canary(&self, name: &str, id: i64, reason: &str) -> anyhow::Result<()> {
        self.change(name, |doc| end(doc, name, id, "rolled-back", reason))
            .await?;
        self.forget_tallies(id).await;
        Ok(())
    }

    async fn promote(&self, name: &str, id: i64, a: Activation) -> anyhow::Result<Activation> {
        let a = self
            .change(name, |doc| {
                end(doc, name, id, "promoted", "operator")?;
                Ok(push_activation(doc, a.clone()))
            })
            .await?;
        self.forget_tallies(id).await;
        Ok(a)
    }

    async fn tally_canary(
        &self,
        id: i64,
        node: &str,
        canary: &Tally,
        stable: &Tally,
    ) -> anyhow::Result<(Tally, Tally)> {
        let value = serde_json::to_vec(&(canary, stable))?;
        self.handlers
            .put(format!("t.{id}.{}", hex::encode(node)), value.into())
            .await
            .context("writing the canary's tally")?;
        self.canary_tallies(id).await
    }

    async fn canary_tallies(&self, id: i64) -> anyhow::Result<(Tally, Tally)> {
        let mut sum = (Tally::default(), Tally::default());
        for key in self.tally_keys(id).await? {
            if let Some(v) = self.handlers.get(&key).await.context("reading a canary tally")?
                && let Ok((c, s)) = serde_json::from_slice::<(Tally, Tally)>(&v)
            {
                sum = (sum.0.plus(c), sum.1.plus(s));
            }
        }
        Ok(sum)
    }

    async fn changes(&self) -> anyhow::Result<Option<Changes>> {
        let watch = self
            .handlers
            .watch("h.>")
            .await
            .context("watching the handlers bucket")?;
        // An error ends the stream: the follower watches again.
        Ok(Some(Box::pin(
            watch.take_while(|e| std::future::ready(e.is_ok())).map(|_| ()),
        )))
    }
}

impl Buckets {
    async fn tally_keys(&self, id: i64) -> anyhow::Result<Vec<String>> {
        let prefix = format!("t.{id}.");
        let keys = self.handlers.keys().await.context("listing canary tallies")?;
        Ok(keys
            .filter_map(|k| std::future::ready(k.ok().filter(|k| k.starts_with(&prefix))))
            .collect()
            .await)
    }

    /// Delete an ended canary's tallies (best effort: left ones are never read again).
    async fn forget_tallies(&self, id: i64) {
        if let Ok(keys) = self.tally_keys(id).await {
            for k in keys {
                let _ = self.handlers.purge(&k).await;
            }
        }
    }
}

/// Append activation `a` with the next sequence number; `previous`: `a`'s
/// for a rollback, else the current one.
fn push_activation(doc: &mut Doc, a: Activation) -> Activation {
    let current = doc.activations.iter().map(|x| x.seq).max();
    let a = Activation {
        seq: current.map_or(1, |s| s + 1),
        previous: if a.source == "rollback" { a.previous } else { current },
        at_ms: now_ms(),
        ..a
    };
    doc.activations.push(a.clone());
    let over = doc.activations.len().saturating_sub(KEEP_ACTIVATIONS);
    doc.activations.drain(..over);
    a
}

fn end(doc: &mut Doc, name: &str, id: i64, outcome: &str, reason: &str) -> anyhow::Result<()> {
    match doc.canary.take() {
        Some(c) if c.id == id => {
            doc.ended = Some((c, outcome.to_owned(), reason.to_owned(), now_ms()));
            Ok(())
        }
        _ => bail!("the canary of `{name}` was ended meanwhile, on another node"),
    }
}
