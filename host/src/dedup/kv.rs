//! Dedup records in a JetStream KV bucket (`cluster.mode = "nats-kv"`):
//! `<cluster.bucket>-dedup`, beside the coordination bucket, one key per
//! record (`d.` and 128 bits of SHA-256 of the tenant, group and id), its
//! value the window in milliseconds. The bucket's `max_age` is the longest
//! window of the config (set to it at every start, up or down), so the
//! server deletes records that every handler has forgotten and the bucket
//! holds about rate × window (nats-server 2.9 has no per-key TTL); a
//! shorter window is judged on the entry's server time.

use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use async_nats::jetstream::{self, kv};
use async_trait::async_trait;
use futures::future::try_join_all;
use sha2::Digest as _;

use super::{Key, Store};

/// The dedup bucket of coordination bucket `bucket`.
pub fn bucket_name(bucket: &str) -> String {
    format!("{bucket}-dedup")
}

/// The record key of `key`.
fn record_key(key: &Key) -> String {
    let mut h = sha2::Sha256::new();
    for part in [&key.tenant, &key.group, &key.id] {
        h.update(part.as_bytes());
        // NUL never occurs in a header value, so the parts cannot run together.
        h.update([0]);
    }
    format!("d.{}", hex::encode(&h.finalize()[..16]))
}

/// Records in a bucket.
pub struct Bucket {
    kv: kv::Store,
}

impl Bucket {
    /// Open (or create) bucket `name` with `replicas`, keeping records for
    /// `longest` (a bucket that keeps them for more or less is set to it:
    /// the node started last sets it).
    pub async fn open(js: &jetstream::Context, name: &str, replicas: usize, longest: Duration) -> anyhow::Result<Self> {
        let kv = side_bucket(js, name, replicas, longest, "weir: handled messages (handler.dedup)").await?;
        let stream = format!("KV_{name}");
        let mut s = js
            .get_stream(&stream)
            .await
            .with_context(|| format!("reading stream {stream}"))?;
        let info = s.info().await.with_context(|| format!("reading stream {stream}"))?;
        if info.config.max_age != longest {
            let mut config = info.config.clone();
            config.max_age = longest;
            // The server refuses a duplicate window longer than max_age.
            if !longest.is_zero() {
                config.duplicate_window = config.duplicate_window.min(longest);
            }
            js.update_stream(config)
                .await
                .with_context(|| format!("setting the max_age of {stream} to the longest dedup window"))?;
        }
        Ok(Self { kv })
    }
}

/// Open (or create) bucket `name` beside the coordination bucket, with
/// `replicas`, keeping each key `max_age` (zero: for ever; a bucket that
/// keeps them for less is raised to it). Made with the plain stream API,
/// as the coordination bucket is (async-nats cannot parse nats-server
/// 2.9's answer to its own bucket creation); two nodes at once: one wins.
pub async fn side_bucket(
    js: &jetstream::Context,
    name: &str,
    replicas: usize,
    max_age: Duration,
    description: &str,
) -> anyhow::Result<kv::Store> {
    let stream = format!("KV_{name}");
    match js.get_stream(&stream).await {
        Ok(mut s) => {
            let info = s.info().await.with_context(|| format!("reading stream {stream}"))?;
            let keeps = info.config.max_age;
            if !keeps.is_zero() && (max_age.is_zero() || keeps < max_age) {
                let mut config = info.config.clone();
                config.max_age = max_age;
                js.update_stream(config)
                    .await
                    .with_context(|| format!("raising the max_age of {stream}"))?;
            }
        }
        Err(_) => {
            let made = js
                .create_stream(jetstream::stream::Config {
                    name: stream.clone(),
                    description: Some(description.into()),
                    subjects: vec![format!("$KV.{name}.>")],
                    max_messages_per_subject: 1,
                    max_age,
                    storage: jetstream::stream::StorageType::File,
                    discard: jetstream::stream::DiscardPolicy::New,
                    allow_rollup: true,
                    allow_direct: true,
                    num_replicas: replicas,
                    ..Default::default()
                })
                .await;
            if let Err(e) = made
                && js.get_stream(&stream).await.is_err()
            {
                return Err(anyhow::Error::new(e).context(format!("creating the bucket `{name}`")));
            }
        }
    }
    js.get_key_value(name)
        .await
        .with_context(|| format!("opening the bucket `{name}`"))
}

#[async_trait]
impl Store for Bucket {
    fn what(&self) -> &'static str {
        "nats-kv"
    }

    async fn seen(&self, keys: &[Key]) -> anyhow::Result<Vec<bool>> {
        let now = SystemTime::now();
        try_join_all(keys.iter().map(|k| async move {
            let entry = self.kv.entry(record_key(k)).await.context("reading the dedup bucket")?;
            let Some(e) = entry.filter(|e| e.operation == kv::Operation::Put) else {
                return Ok(false);
            };
            let window = std::str::from_utf8(&e.value)
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .map_or(Duration::MAX, Duration::from_millis);
            let created = SystemTime::from(e.created);
            Ok(now.duration_since(created).unwrap_or_default() < window)
        }))
        .await
    }

    async fn record(&self, keys: &[(Key, Duration)]) -> anyhow::Result<()> {
        try_join_all(keys.iter().map(|(k, w)| async move {
            self.kv
                .put(record_key(k), w.as_millis().to_string().into())
                .await
                .context("writing the dedup bucket")
        }))
        .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_keys_are_valid_subjects_and_keep_the_parts_apart() {
        let k = |t: &str, g: &str, i: &str| Key {
            tenant: t.into(),
            group: g.into(),
            id: i.into(),
        };
        let a = record_key(&k("ab", "c", "1"));
        assert_ne!(a, record_key(&k("a", "bc", "1")));
        assert_ne!(a, record_key(&k("ab", "c", "2")));
        assert_eq!(a, record_key(&k("ab", "c", "1")));
        assert_eq!(a.len(), 2 + 32);
        assert!(a[2..].chars().all(|c| c.is_ascii_hexdigit()));
    }
}
