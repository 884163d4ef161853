//! Parked groups in a JetStream KV bucket, `<cluster.bucket>-parked`: one
//! key per group, `p.<slot>.<group>` (each part 64 or 128 bits of SHA-256),
//! its value the record as JSON.

use anyhow::Context as _;
use async_nats::jetstream::{self, kv};
use async_trait::async_trait;
use futures::TryStreamExt as _;
use sha2::Digest as _;

use super::{Record, Store};

/// The parked-groups bucket of coordination bucket `bucket`.
pub fn bucket_name(bucket: &str) -> String {
    format!("{bucket}-parked")
}

fn hash(parts: &[&str], bytes: usize) -> String {
    let mut h = sha2::Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0]);
    }
    hex::encode(&h.finalize()[..bytes])
}

fn slot_prefix(topology: &str, slot: u32) -> String {
    format!("p.{}.", hash(&[topology, &slot.to_string()], 8))
}

fn key(r: &Record) -> String {
    format!(
        "{}{}",
        slot_prefix(&r.topology, r.slot),
        hash(&[&r.tenant, &r.group], 16)
    )
}

/// Records in a bucket.
pub struct Bucket {
    kv: kv::Store,
}

impl Bucket {
    /// Open (or create) bucket `name` with `replicas`.
    pub async fn open(js: &jetstream::Context, name: &str, replicas: usize) -> anyhow::Result<Self> {
        let kv = crate::dedup::kv::side_bucket(
            js,
            name,
            replicas,
            std::time::Duration::ZERO,
            "weir: parked groups (on_failure = \"park\")",
        )
        .await?;
        Ok(Self { kv })
    }
}

#[async_trait]
impl Store for Bucket {
    async fn park(&self, r: &Record) -> anyhow::Result<()> {
        let value = serde_json::to_vec(r)?;
        self.kv
            .put(key(r), value.into())
            .await
            .context("writing the parked-groups bucket")?;
        Ok(())
    }

    async fn release(&self, r: &Record) -> anyhow::Result<()> {
        self.kv
            .purge(key(r))
            .await
            .context("deleting from the parked-groups bucket")?;
        Ok(())
    }

    async fn parked(&self, topology: &str, slot: u32) -> anyhow::Result<Vec<Record>> {
        let prefix = slot_prefix(topology, slot);
        let keys: Vec<String> = self
            .kv
            .keys()
            .await
            .context("listing the parked-groups bucket")?
            .try_filter(|k| std::future::ready(k.starts_with(&prefix)))
            .try_collect()
            .await
            .context("listing the parked-groups bucket")?;
        let mut out = Vec::new();
        for k in keys {
            if let Some(v) = self.kv.get(&k).await.context("reading the parked-groups bucket")? {
                match serde_json::from_slice::<Record>(&v) {
                    Ok(r) => out.push(r),
                    Err(e) => {
                        tracing::warn!(key = k, error = %e, "a parked-groups record that does not decode is skipped")
                    }
                }
            }
        }
        Ok(out)
    }
}
