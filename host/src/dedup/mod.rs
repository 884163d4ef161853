//! `handler.dedup`: no second call for a message whose handler already
//! succeeded. After a success (its cascades confirmed) and before its ack,
//! the host records (tenant, group, message id) in the coordinator's store
//! for the handler's `window`; before a call, it looks the message up, and
//! one already recorded is acked without a call. So a kill -9 between a
//! success and its ack costs no second call on the next owner.
//!
//! What it cannot cover: a crash after the handler's effects but before the
//! record lands (the same gap as any effect outside the broker), a record
//! that could not be written (counted and logged; the message is acked all
//! the same), and a redelivery after `window`.
//!
//! One lookup per job and one write per job's successes, in both stores:
//! [`pg`] (a table, `cluster.mode = "postgres"`) and [`kv`] (a bucket beside
//! the coordination bucket, `cluster.mode = "nats-kv"`).

pub mod kv;
pub mod pg;

use std::time::Duration;

use async_trait::async_trait;

use crate::envelope::Envelope;

/// How long one lookup or write may take before it counts as failed (a
/// stalled store must not hold a lane for ever).
pub const STORE_TIMEOUT: Duration = Duration::from_secs(5);

/// What identifies a handled message: its tenant, its group and its id
/// (absent tenant or group: empty).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    /// `weir-tenant-id`, or empty.
    pub tenant: String,
    /// `weir-group-id`, or empty.
    pub group: String,
    /// `weir-message-id`.
    pub id: String,
}

impl Key {
    /// The key of `env`.
    pub fn of(env: &Envelope) -> Self {
        Self {
            tenant: env.tenant_id.clone().unwrap_or_default(),
            group: env.group().unwrap_or_default().to_owned(),
            id: env.id.clone(),
        }
    }
}

/// Where the records live.
#[async_trait]
pub trait Store: Send + Sync {
    /// For logs: `postgres` or `nats-kv`.
    fn what(&self) -> &'static str;

    /// For each key, whether a record of it is still within its window.
    async fn seen(&self, keys: &[Key]) -> anyhow::Result<Vec<bool>>;

    /// Record each key for its window (a key already there gets the new window).
    async fn record(&self, keys: &[(Key, Duration)]) -> anyhow::Result<()>;
}

/// [`Store::seen`], bounded by [`STORE_TIMEOUT`].
pub async fn seen(store: &dyn Store, keys: &[Key]) -> anyhow::Result<Vec<bool>> {
    tokio::time::timeout(STORE_TIMEOUT, store.seen(keys))
        .await
        .map_err(|_| anyhow::anyhow!("the {} dedup lookup took longer than {STORE_TIMEOUT:?}", store.what()))?
}

/// [`Store::record`], bounded by [`STORE_TIMEOUT`]; each key once, with
/// its longest window.
pub async fn record(store: &dyn Store, mut keys: Vec<(Key, Duration)>) -> anyhow::Result<()> {
    keys.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
    keys.dedup_by(|a, b| a.0 == b.0);
    tokio::time::timeout(STORE_TIMEOUT, store.record(&keys))
        .await
        .map_err(|_| anyhow::anyhow!("the {} dedup write took longer than {STORE_TIMEOUT:?}", store.what()))?
}

/// Both stores against the real servers (`WEIR_TEST_PG_URL`,
/// `WEIR_TEST_NATS_URL`), through the same checks.
#[cfg(test)]
mod tests {
    use sqlx::Connection as _;

    use super::*;

    fn key(tenant: &str, group: &str, id: &str) -> Key {
        Key {
            tenant: tenant.into(),
            group: group.into(),
            id: id.into(),
        }
    }

    /// What was recorded is seen within its window and only then, per
    /// (tenant, group, id); a key twice in one write is fine.
    async fn remembers_within_the_window(store: &dyn Store) {
        let short = key("t", "g", "1");
        let long = key("t", "g", "2");
        let other_tenant = key("u", "g", "1");
        let no_group = key("t", "", "1");
        let all = [short.clone(), long.clone(), other_tenant.clone(), no_group.clone()];
        assert_eq!(seen(store, &all).await.unwrap(), [false; 4]);
        record(
            store,
            vec![
                (short.clone(), Duration::from_secs(1)),
                (long.clone(), Duration::from_secs(600)),
                (long.clone(), Duration::from_secs(60)),
            ],
        )
        .await
        .unwrap();
        assert_eq!(seen(store, &all).await.unwrap(), [true, true, false, false]);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(
            seen(store, &all).await.unwrap(),
            [false, true, false, false],
            "a record is forgotten after its window, the longer one is kept"
        );
    }

    #[tokio::test]
    async fn postgres_remembers_within_the_window() {
        let server = std::env::var("WEIR_TEST_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
        let name = format!("weir_d_{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let mut admin = sqlx::PgConnection::connect(&format!("{server}/postgres"))
            .await
            .unwrap();
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .await
            .unwrap();
        let pool = crate::cluster::postgres::connect(&format!("{server}/{name}"))
            .await
            .unwrap();
        remembers_within_the_window(&pg::Postgres::new(pool.clone())).await;
        pool.close().await;
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .execute(&mut admin)
            .await;
    }

    #[tokio::test]
    async fn a_bucket_remembers_within_the_window() {
        let server = std::env::var("WEIR_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
        let name = format!("weir-d-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let client = async_nats::connect(&server).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let bucket = kv::Bucket::open(&js, &name, 1, Duration::from_secs(600)).await.unwrap();
        remembers_within_the_window(&bucket).await;
        // Opened again with a longer window, the bucket keeps records longer.
        kv::Bucket::open(&js, &name, 1, Duration::from_secs(1200))
            .await
            .unwrap();
        let mut stream = js.get_stream(format!("KV_{name}")).await.unwrap();
        assert_eq!(stream.info().await.unwrap().config.max_age, Duration::from_secs(1200));
        let _ = js.delete_stream(format!("KV_{name}")).await;
    }
}
