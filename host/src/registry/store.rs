//! Where versions are kept: nowhere (memory), the data directory
//! (`node.data_dir`), or the coordinator database in `postgres` mode.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use super::types::Activation;

/// Where versions are kept.
pub enum Store {
    /// Nowhere: deploys last until the process ends.
    Memory,
    /// `node.data_dir`.
    Dir(PathBuf),
    /// The coordinator database (`postgres` cluster mode).
    Postgres(PgPool),
}

impl Store {
    pub fn label(&self) -> &'static str {
        match self {
            Store::Memory => "memory",
            Store::Dir(_) => "data-dir",
            Store::Postgres(_) => "database",
        }
    }
}

/// `node.data_dir/handlers/{name}.json`.
#[derive(Serialize, Deserialize)]
pub struct DirHistory {
    /// Digest of the configured component when this history began.
    pub config_digest: String,
    pub activations: Vec<Activation>,
}

pub fn write_dir_history(
    dir: &Path,
    name: &str,
    config_digest: &str,
    activations: &[Activation],
) -> anyhow::Result<()> {
    let h = DirHistory {
        config_digest: config_digest.to_owned(),
        activations: activations.to_vec(),
    };
    let bytes = serde_json::to_vec_pretty(&h).context("encoding a handler history")?;
    write_atomic(&dir.join("handlers").join(format!("{name}.json")), &bytes)
}

/// `node.data_dir/components/{digest}.wasm`, once.
pub fn write_component(dir: &Path, digest_hex: &str, bytes: &[u8]) -> anyhow::Result<()> {
    let path = dir.join("components").join(format!("{digest_hex}.wasm"));
    if bytes.is_empty() || path.exists() {
        return Ok(());
    }
    write_atomic(&path, bytes)
}

/// Write via a temporary file and a rename, so a crash leaves the old file or the new one.
fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", uuid::Uuid::new_v4()));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("syncing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

/// Versions in the coordinator database.
pub mod pg {
    use anyhow::Context as _;
    use sqlx::{PgPool, Row as _};

    use super::super::types::{Activation, Grants};

    /// Notified with the handler name after every activation.
    pub const CHANNEL: &str = "weir_handlers";

    pub async fn activations(pool: &PgPool, name: &str) -> anyhow::Result<Vec<Activation>> {
        let rows = sqlx::query(
            "SELECT seq, a.digest, v.size, (extract(epoch FROM a.at) * 1000)::bigint AS at_ms, source, node, previous, grants
             FROM weir_handler_activations a JOIN weir_handler_versions v USING (name, digest)
             WHERE name = $1 ORDER BY seq",
        )
        .bind(name)
        .fetch_all(pool)
        .await
        .with_context(|| format!("reading the versions of `{name}` from the database"))?;
        rows.into_iter()
            .map(|r| {
                let grants: serde_json::Value = r.try_get("grants")?;
                Ok(Activation {
                    seq: r.try_get("seq")?,
                    digest: r.try_get("digest")?,
                    size: u64::try_from(r.try_get::<i64, _>("size")?).unwrap_or(0),
                    at_ms: r.try_get("at_ms")?,
                    source: r.try_get("source")?,
                    node: r.try_get("node")?,
                    previous: r.try_get("previous")?,
                    grants: serde_json::from_value::<Grants>(grants).unwrap_or_default(),
                })
            })
            .collect()
    }

    pub async fn component(pool: &PgPool, name: &str, digest: &str) -> anyhow::Result<Vec<u8>> {
        sqlx::query_scalar("SELECT component FROM weir_handler_versions WHERE name = $1 AND digest = $2")
            .bind(name)
            .bind(digest)
            .fetch_optional(pool)
            .await
            .with_context(|| format!("reading version {digest} of `{name}` from the database"))?
            .with_context(|| format!("the database has no version {digest} of `{name}`"))
    }

    /// Store the version (once) and append an activation whose `previous` is
    /// `a.previous`, or, for a deploy, the cluster's current one.
    pub async fn activate(pool: &PgPool, name: &str, bytes: &[u8], a: Activation) -> anyhow::Result<Activation> {
        let mut tx = pool.begin().await.context("deploying: database unavailable")?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('weir_handler:' || $1))")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        if !bytes.is_empty() {
            sqlx::query(
                "INSERT INTO weir_handler_versions (name, digest, component, size) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (name, digest) DO NOTHING",
            )
            .bind(name)
            .bind(&a.digest)
            .bind(bytes)
            .bind(i64::try_from(bytes.len()).unwrap_or(i64::MAX))
            .execute(&mut *tx)
            .await
            .context("storing the component")?;
        }
        let current: Option<i64> = sqlx::query_scalar("SELECT max(seq) FROM weir_handler_activations WHERE name = $1")
            .bind(name)
            .fetch_one(&mut *tx)
            .await?;
        if a.source == "config" && current.is_some() {
            // Another node recorded the cluster's first version already.
            tx.commit().await?;
            return Ok(a);
        }
        let previous = if a.source == "rollback" { a.previous } else { current };
        let grants = serde_json::to_value(&a.grants).context("encoding grants")?;
        let seq: i64 = sqlx::query_scalar(
            "INSERT INTO weir_handler_activations (name, digest, previous, source, node, grants)
             VALUES ($1, $2, $3, $4, $5, $6) RETURNING seq",
        )
        .bind(name)
        .bind(&a.digest)
        .bind(previous)
        .bind(&a.source)
        .bind(&a.node)
        .bind(grants)
        .fetch_one(&mut *tx)
        .await
        .context("recording the activation")?;
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(CHANNEL)
            .bind(name)
            .execute(&mut *tx)
            .await?;
        tx.commit().await.context("deploying: commit failed")?;
        Ok(Activation { seq, previous, ..a })
    }
}
