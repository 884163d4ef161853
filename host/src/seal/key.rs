//! Where the sealing key comes from: the file `cluster.seal_key_file` names
//! when set; else the cluster's store, so every node and every command of
//! one cluster seals alike (`postgres`: the table `weir_seal_key`;
//! `nats-kv`: the bucket `<cluster.bucket>-seal`); else `node.data_dir/seal.key`;
//! else a key of this process alone. Whoever comes first makes the key
//! (32 random bytes); the others read it.

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream;

use super::Seal;
use crate::config::{ClusterMode, Config};

/// The file in `node.data_dir` that holds the key of a `solo` or `static` node.
pub const DATA_DIR_FILE: &str = "seal.key";
/// The key's name in the `nats-kv` seal bucket.
const KV_KEY: &str = "key";

/// The seal bucket of coordination bucket `bucket`.
pub fn bucket_name(bucket: &str) -> String {
    format!("{bucket}-seal")
}

/// Is the key of `config` shared by every node and command of its cluster
/// (not a key of one process)?
pub fn shared(config: &Config) -> bool {
    config.cluster.seal_key_file.is_some() || config.cluster.leased() || config.node.data_dir.is_some()
}

/// The sealing key of `config`'s cluster (see the module docs); `database`
/// is the coordinator's pool, which `cluster.mode = "postgres"` needs.
pub async fn load(config: &Config, database: Option<&sqlx::PgPool>) -> anyhow::Result<Seal> {
    if let Some(path) = &config.cluster.seal_key_file {
        let bytes = read_key_file(path).with_context(|| format!("{}: cluster.seal_key_file", config.origin))?;
        return Seal::new(&bytes, format!("cluster.seal_key_file {}", path.display()));
    }
    match config.cluster.mode {
        ClusterMode::Postgres => {
            let pool = database.context("reading the sealing key: no connection to cluster.database_url")?;
            let key = from_postgres(pool)
                .await
                .context("reading the sealing key (table weir_seal_key)")?;
            return Seal::new(&key, "the coordinator database (weir_seal_key)");
        }
        ClusterMode::NatsKv => {
            let name = bucket_name(config.cluster.bucket());
            let client =
                crate::transport::nats::connect(&config.transport.urls(), &format!("weir {} seal", config.node.name))
                    .await?;
            let key = from_bucket(&jetstream::new(client), &name, config.transport.replicas())
                .await
                .with_context(|| format!("reading the sealing key (bucket `{name}`)"))?;
            return Seal::new(&key, format!("the bucket `{name}`"));
        }
        _ => {}
    }
    if let Some(dir) = &config.node.data_dir {
        let path = dir.join(DATA_DIR_FILE);
        let key = from_file(&path).with_context(|| format!("node.data_dir: the sealing key {}", path.display()))?;
        return Seal::new(&key, format!("{}", path.display()));
    }
    Ok(Seal::ephemeral())
}

/// A configured key file: 64 or more hex digits, or 32 or more raw bytes.
fn read_key_file(path: &Path) -> anyhow::Result<Vec<u8>> {
    let raw = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let text = std::str::from_utf8(&raw).map(str::trim).unwrap_or("");
    let key = match hex::decode(text) {
        Ok(k) if !text.is_empty() => k,
        _ => raw,
    };
    anyhow::ensure!(
        key.len() >= 32,
        "{} holds {} bytes of key; accepted: at least 32 bytes (64 hex digits, e.g. `openssl rand -hex 32`)",
        path.display(),
        key.len()
    );
    Ok(key)
}

/// `node.data_dir`'s key: read it, or make it (readable by its owner only).
fn from_file(path: &Path) -> anyhow::Result<Vec<u8>> {
    use std::io::Write as _;
    match std::fs::read_to_string(path) {
        Ok(text) => return hex::decode(text.trim()).with_context(|| format!("{} is not hex", path.display())),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
        Err(_) => {}
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let key: [u8; 32] = rand::random();
    let mut open = std::fs::OpenOptions::new();
    open.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
    match open.open(path) {
        Ok(mut f) => {
            f.write_all(hex::encode(key).as_bytes())?;
            f.sync_all()?;
            Ok(key.to_vec())
        }
        // Another process of this data dir made it first: read theirs.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let text = std::fs::read_to_string(path)?;
            hex::decode(text.trim()).with_context(|| format!("{} is not hex", path.display()))
        }
        Err(e) => Err(e.into()),
    }
}

async fn from_postgres(pool: &sqlx::PgPool) -> anyhow::Result<Vec<u8>> {
    let key: [u8; 32] = rand::random();
    sqlx::query("INSERT INTO weir_seal_key (id, key) VALUES (1, $1) ON CONFLICT (id) DO NOTHING")
        .bind(key.as_slice())
        .execute(pool)
        .await?;
    let (stored,): (Vec<u8>,) = sqlx::query_as("SELECT key FROM weir_seal_key WHERE id = 1")
        .fetch_one(pool)
        .await?;
    Ok(stored)
}

async fn from_bucket(js: &jetstream::Context, name: &str, replicas: usize) -> anyhow::Result<Vec<u8>> {
    let kv =
        crate::dedup::kv::side_bucket(js, name, replicas, Duration::ZERO, "weir: the cluster's sealing key").await?;
    for _ in 0..3 {
        if let Some(stored) = kv.get(KV_KEY).await? {
            return Ok(stored.to_vec());
        }
        let key: [u8; 32] = rand::random();
        if kv.create(KV_KEY, key.to_vec().into()).await.is_ok() {
            return Ok(key.to_vec());
        }
        // Another node made it first: read theirs.
    }
    anyhow::bail!("the bucket `{name}` neither holds a key nor takes one")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_data_dir_key_is_made_once_and_read_after() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join(DATA_DIR_FILE);
        let first = from_file(&path).unwrap();
        assert_eq!(first.len(), 32);
        assert_eq!(from_file(&path).unwrap(), first);
    }

    #[tokio::test]
    async fn postgres_nodes_share_the_first_key() {
        let db = crate::cluster::postgres::ScratchDb::new("weir_s").await;
        let pool = db.pool.clone();
        let (a, b) = tokio::join!(from_postgres(&pool), from_postgres(&pool));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a.len(), 32);
        assert_eq!(a, b, "two nodes at once: one key");
        assert_eq!(from_postgres(&pool).await.unwrap(), a);
        db.drop().await;
    }

    #[tokio::test]
    async fn nats_kv_nodes_share_the_first_key() {
        let server = std::env::var("WEIR_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
        let name = format!("weir-s-{}-seal", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let js = jetstream::new(async_nats::connect(&server).await.unwrap());
        let (a, b) = tokio::join!(from_bucket(&js, &name, 1), from_bucket(&js, &name, 1));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a.len(), 32);
        assert_eq!(a, b, "two nodes at once: one key");
        assert_eq!(from_bucket(&js, &name, 1).await.unwrap(), a);
        let _ = js.delete_stream(format!("KV_{name}")).await;
    }

    #[test]
    fn a_configured_key_file_must_hold_32_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let short = dir.path().join("short");
        std::fs::write(&short, "abcd").unwrap();
        let err = format!("{:#}", read_key_file(&short).unwrap_err());
        assert!(err.contains("at least 32 bytes"), "{err}");
        let good = dir.path().join("good");
        std::fs::write(&good, format!("{}\n", "0f".repeat(32))).unwrap();
        assert_eq!(read_key_file(&good).unwrap(), vec![0x0f; 32]);
    }
}
