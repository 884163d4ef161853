//! Where versions are kept: nowhere (memory), the data directory
//! (`node.data_dir`), or the coordinator database in `postgres` mode.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::shared::Shared;
use super::types::Activation;
use super::types::Canary;
use anyhow::Context as _;
use serde::{Deserialize, Serialize};

/// Where versions are kept.
pub enum Store {
    /// Nowhere: deploys last until the process ends.
    Memory,
    /// `node.data_dir`.
    Dir(PathBuf),
    /// Shared by the cluster: the coordinator database (`postgres`) or
    /// buckets beside the coordination bucket (`nats-kv`).
    Shared(Arc<dyn Shared>),
}

impl Store {
    pub fn label(&self) -> &'static str {
        match self {
            Store::Memory => "memory",
            Store::Dir(_) => "data-dir",
            Store::Shared(s) => s.label(),
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

/// `node.data_dir/handlers/{name}.canary.json`: the running canary, or none
/// (the file is removed).
pub fn write_canary(dir: &Path, name: &str, canary: Option<&Canary>) -> anyhow::Result<()> {
    let path = dir.join("handlers").join(format!("{name}.canary.json"));
    match canary {
        Some(c) => write_atomic(&path, &serde_json::to_vec_pretty(c).context("encoding a canary")?),
        None => match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(e).with_context(|| format!("removing {}", path.display()))
            }
            _ => Ok(()),
        },
    }
}

/// The canary `write_canary` left, if any.
pub fn read_canary(dir: &Path, name: &str) -> anyhow::Result<Option<Canary>> {
    let path = dir.join("handlers").join(format!("{name}.canary.json"));
    match std::fs::read(&path) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .with_context(|| format!("node.data_dir: {} is not a canary", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
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

    use super::super::shared::{Changes, EndedRecord, Shared};
    use super::super::types::{Activation, Grants};
    use super::super::types::{Canary, Tally};

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
        let mut tx = begin(pool, name).await?;
        let a = activate_in(&mut tx, name, bytes, a).await?;
        notify(&mut tx, name).await?;
        tx.commit().await.context("deploying: commit failed")?;
        Ok(a)
    }

    type Tx = sqlx::Transaction<'static, sqlx::Postgres>;

    /// A transaction holding the handler's lock (one change at a time per handler, cluster-wide).
    async fn begin(pool: &PgPool, name: &str) -> anyhow::Result<Tx> {
        let mut tx = pool.begin().await.context("deploying: database unavailable")?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('weir_handler:' || $1))")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        Ok(tx)
    }

    async fn notify(tx: &mut Tx, name: &str) -> anyhow::Result<()> {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(CHANNEL)
            .bind(name)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn store_version(tx: &mut Tx, name: &str, digest: &str, bytes: &[u8]) -> anyhow::Result<()> {
        sqlx::query(
            "INSERT INTO weir_handler_versions (name, digest, component, size) VALUES ($1, $2, $3, $4)
             ON CONFLICT (name, digest) DO NOTHING",
        )
        .bind(name)
        .bind(digest)
        .bind(bytes)
        .bind(i64::try_from(bytes.len()).unwrap_or(i64::MAX))
        .execute(&mut **tx)
        .await
        .context("storing the component")?;
        Ok(())
    }

    async fn activate_in(tx: &mut Tx, name: &str, bytes: &[u8], a: Activation) -> anyhow::Result<Activation> {
        if !bytes.is_empty() {
            store_version(tx, name, &a.digest, bytes).await?;
        }
        let tx = &mut **tx;
        let current: Option<i64> = sqlx::query_scalar("SELECT max(seq) FROM weir_handler_activations WHERE name = $1")
            .bind(name)
            .fetch_one(&mut *tx)
            .await?;
        if a.source == "config" && current.is_some() {
            // Another node recorded the cluster's first version already.
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
        Ok(Activation { seq, previous, ..a })
    }

    const CANARY_COLUMNS: &str =
        "id, digest, slots, thresholds, grants, node, (extract(epoch FROM started_at) * 1000)::bigint AS started_ms";

    fn canary_of(r: &sqlx::postgres::PgRow) -> anyhow::Result<Canary> {
        let slots: Vec<i32> = r.try_get("slots")?;
        Ok(Canary {
            id: r.try_get("id")?,
            digest: r.try_get("digest")?,
            slots: slots.into_iter().filter_map(|s| u32::try_from(s).ok()).collect(),
            thresholds: serde_json::from_value(r.try_get("thresholds")?).unwrap_or_default(),
            grants: serde_json::from_value(r.try_get("grants")?).unwrap_or_default(),
            started_ms: r.try_get("started_ms")?,
            node: r.try_get("node")?,
        })
    }

    /// Store the canary's version and start it; refused when one is live.
    pub async fn start_canary(pool: &PgPool, name: &str, bytes: &[u8], c: Canary) -> anyhow::Result<Canary> {
        let mut tx = begin(pool, name).await?;
        store_version(&mut tx, name, &c.digest, bytes).await?;
        let slots: Vec<i32> = c.slots.iter().map(|s| *s as i32).collect();
        let row = sqlx::query(&format!(
            "INSERT INTO weir_handler_canaries (name, digest, slots, thresholds, grants, node)
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING RETURNING {CANARY_COLUMNS}"
        ))
        .bind(name)
        .bind(&c.digest)
        .bind(&slots)
        .bind(serde_json::to_value(&c.thresholds)?)
        .bind(serde_json::to_value(&c.grants)?)
        .bind(&c.node)
        .fetch_optional(&mut *tx)
        .await
        .context("recording the canary")?
        .with_context(|| format!("another node started a canary of `{name}` meanwhile"))?;
        notify(&mut tx, name).await?;
        tx.commit().await.context("starting the canary: commit failed")?;
        canary_of(&row)
    }

    /// The live canary of `name`, if any.
    pub async fn live_canary(pool: &PgPool, name: &str) -> anyhow::Result<Option<Canary>> {
        let row = sqlx::query(&format!(
            "SELECT {CANARY_COLUMNS} FROM weir_handler_canaries WHERE name = $1 AND ended_at IS NULL"
        ))
        .bind(name)
        .fetch_optional(pool)
        .await
        .with_context(|| format!("reading the canary of `{name}` from the database"))?;
        row.as_ref().map(canary_of).transpose()
    }

    /// How the latest ended canary of `name` ended: (canary, outcome, reason, ended at ms).
    pub async fn last_ended(pool: &PgPool, name: &str) -> anyhow::Result<Option<EndedRecord>> {
        let row = sqlx::query(&format!(
            "SELECT {CANARY_COLUMNS}, outcome, reason, (extract(epoch FROM ended_at) * 1000)::bigint AS ended_ms
             FROM weir_handler_canaries WHERE name = $1 AND ended_at IS NOT NULL ORDER BY ended_at DESC LIMIT 1"
        ))
        .bind(name)
        .fetch_optional(pool)
        .await?;
        row.map(|r| {
            Ok((
                canary_of(&r)?,
                r.try_get("outcome")?,
                r.try_get("reason")?,
                r.try_get("ended_ms")?,
            ))
        })
        .transpose()
    }

    /// End canary `id` of `name` (still live) as `outcome`.
    async fn end_in(tx: &mut Tx, name: &str, id: i64, outcome: &str, reason: &str) -> anyhow::Result<()> {
        let n = sqlx::query(
            "UPDATE weir_handler_canaries SET ended_at = now(), outcome = $3, reason = $4
             WHERE name = $1 AND id = $2 AND ended_at IS NULL",
        )
        .bind(name)
        .bind(id)
        .bind(outcome)
        .bind(reason)
        .execute(&mut **tx)
        .await
        .context("ending the canary")?
        .rows_affected();
        anyhow::ensure!(n == 1, "the canary of `{name}` was ended meanwhile, on another node");
        Ok(())
    }

    /// Roll back canary `id` of `name`.
    pub async fn end_canary(pool: &PgPool, name: &str, id: i64, outcome: &str, reason: &str) -> anyhow::Result<()> {
        let mut tx = begin(pool, name).await?;
        end_in(&mut tx, name, id, outcome, reason).await?;
        notify(&mut tx, name).await?;
        tx.commit().await.context("ending the canary: commit failed")
    }

    /// Promote canary `id`: end it and activate its version, in one transaction.
    pub async fn promote(pool: &PgPool, name: &str, id: i64, a: Activation) -> anyhow::Result<Activation> {
        let mut tx = begin(pool, name).await?;
        end_in(&mut tx, name, id, "promoted", "operator").await?;
        let a = activate_in(&mut tx, name, &[], a).await?;
        notify(&mut tx, name).await?;
        tx.commit().await.context("promoting: commit failed")?;
        Ok(a)
    }

    /// Write this node's tally of canary `id`; returns the cluster's sums (canary, stable).
    pub async fn tally_canary(
        pool: &PgPool,
        id: i64,
        node: &str,
        canary: &Tally,
        stable: &Tally,
    ) -> anyhow::Result<(Tally, Tally)> {
        sqlx::query(
            "INSERT INTO weir_handler_canary_tallies (canary, node, canary_tally, stable_tally) VALUES ($1, $2, $3, $4)
             ON CONFLICT (canary, node) DO UPDATE SET canary_tally = $3, stable_tally = $4, at = now()",
        )
        .bind(id)
        .bind(node)
        .bind(serde_json::to_value(canary)?)
        .bind(serde_json::to_value(stable)?)
        .execute(pool)
        .await
        .context("writing the canary's tally")?;
        canary_tallies(pool, id).await
    }

    /// The cluster's sums of canary `id`'s tallies: (canary, stable).
    pub async fn canary_tallies(pool: &PgPool, id: i64) -> anyhow::Result<(Tally, Tally)> {
        let rows = sqlx::query("SELECT canary_tally, stable_tally FROM weir_handler_canary_tallies WHERE canary = $1")
            .bind(id)
            .fetch_all(pool)
            .await
            .context("reading the canary's tallies")?;
        let mut sum = (Tally::default(), Tally::default());
        for r in rows {
            let c: Tally = serde_json::from_value(r.try_get("canary_tally")?).unwrap_or_default();
            let s: Tally = serde_json::from_value(r.try_get("stable_tally")?).unwrap_or_default();
            sum = (sum.0.plus(c), sum.1.plus(s));
        }
        Ok(sum)
    }

    /// The coordinator database as the cluster's version store.
    pub struct Database(pub PgPool);

    #[async_trait::async_trait]
    impl Shared for Database {
        fn label(&self) -> &'static str {
            "database"
        }
        async fn activations(&self, name: &str) -> anyhow::Result<Vec<Activation>> {
            activations(&self.0, name).await
        }
        async fn component(&self, name: &str, digest: &str) -> anyhow::Result<Vec<u8>> {
            component(&self.0, name, digest).await
        }
        async fn activate(&self, name: &str, bytes: &[u8], a: Activation) -> anyhow::Result<Activation> {
            activate(&self.0, name, bytes, a).await
        }
        async fn start_canary(&self, name: &str, bytes: &[u8], c: Canary) -> anyhow::Result<Canary> {
            start_canary(&self.0, name, bytes, c).await
        }
        async fn live_canary(&self, name: &str) -> anyhow::Result<Option<Canary>> {
            live_canary(&self.0, name).await
        }
        async fn last_ended(&self, name: &str) -> anyhow::Result<Option<EndedRecord>> {
            last_ended(&self.0, name).await
        }
        async fn end_canary(&self, name: &str, id: i64, reason: &str) -> anyhow::Result<()> {
            end_canary(&self.0, name, id, "rolled-back", reason).await
        }
        async fn promote(&self, name: &str, id: i64, a: Activation) -> anyhow::Result<Activation> {
            promote(&self.0, name, id, a).await
        }
        async fn tally_canary(
            &self,
            id: i64,
            node: &str,
            canary: &Tally,
            stable: &Tally,
        ) -> anyhow::Result<(Tally, Tally)> {
            tally_canary(&self.0, id, node, canary, stable).await
        }
        async fn canary_tallies(&self, id: i64) -> anyhow::Result<(Tally, Tally)> {
            canary_tallies(&self.0, id).await
        }
        async fn changes(&self) -> anyhow::Result<Option<Changes>> {
            let mut l = sqlx::postgres::PgListener::connect_with(&self.0)
                .await
                .context("cannot listen for deploys")?;
            l.listen(CHANNEL).await.with_context(|| format!("LISTEN {CHANNEL}"))?;
            // An error ends the stream: the follower listens again.
            Ok(Some(Box::pin(futures::StreamExt::map(
                futures::StreamExt::take_while(l.into_stream(), |n| std::future::ready(n.is_ok())),
                |_| (),
            ))))
        }
    }
}
