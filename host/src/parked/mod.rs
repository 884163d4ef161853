//! Parked groups (`on_failure = "park"`) kept where the next owner of their
//! slot finds them: a slot changing owner (a handoff, a restart, a failover)
//! would otherwise hand the group's held messages to a node that does not
//! know they must wait, and they would run before their head comes back
//! from the ladder.
//!
//! A job that parks a group writes its record before it returns, and the
//! job that ends its head any other way deletes it; one lane runs one job
//! at a time, so a group's writes never cross. A runner reads its slot's
//! records before it consumes. A record read that way whose head does not
//! come back within the ladder's longest rung plus [`GRACE`] is stale (its
//! node died between the head's end and the delete) and is dropped with a
//! warning.
//!
//! Kept in the coordinator's store: [`pg`] (`postgres` mode) and [`kv`]
//! (`nats-kv` mode). In modes without one, a parked group lives as long as
//! its node.

pub mod kv;
pub mod pg;

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

/// Negative control for the handoff test, never for production: with this
/// environment variable set to `1` a runner does not read its slot's parked
/// groups at start, so a handoff loses them.
pub const NEGATIVE_CONTROL_NOT_CARRIED: &str = "WEIR_NEGATIVE_CONTROL_PARK_NOT_CARRIED";

/// How long past the ladder's longest rung a read record waits for its head.
pub const GRACE: Duration = Duration::from_secs(30);

/// How long one read or write may take.
pub const STORE_TIMEOUT: Duration = Duration::from_secs(5);

/// One parked group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Topology.
    pub topology: String,
    /// Slot.
    pub slot: u32,
    /// `weir-tenant-id`, or empty.
    pub tenant: String,
    /// `weir-group-id`.
    pub group: String,
    /// The failed head's message id.
    pub head: String,
}

/// Where the records live.
#[async_trait]
pub trait Store: Send + Sync {
    /// Record (or replace) a parked group.
    async fn park(&self, r: &Record) -> anyhow::Result<()>;
    /// Forget the parked group of `r` (its head ended).
    async fn release(&self, r: &Record) -> anyhow::Result<()>;
    /// Every parked group of a slot.
    async fn parked(&self, topology: &str, slot: u32) -> anyhow::Result<Vec<Record>>;
}

/// `op`, bounded by [`STORE_TIMEOUT`].
pub async fn bounded<T>(what: &str, op: impl std::future::Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    tokio::time::timeout(STORE_TIMEOUT, op)
        .await
        .map_err(|_| anyhow::anyhow!("{what} took longer than {STORE_TIMEOUT:?}"))?
}

/// Both stores against the real servers (`WEIR_TEST_PG_URL`,
/// `WEIR_TEST_NATS_URL`), through the same checks.
#[cfg(test)]
mod tests {

    use super::*;

    fn record(slot: u32, tenant: &str, group: &str, head: &str) -> Record {
        Record {
            topology: "t".into(),
            slot,
            tenant: tenant.into(),
            group: group.into(),
            head: head.into(),
        }
    }

    /// Parked per slot and (tenant, group); a new head replaces the old;
    /// a release forgets only its own group.
    async fn keeps_a_slots_parked_groups(store: &dyn Store) {
        assert!(store.parked("t", 0).await.unwrap().is_empty());
        store.park(&record(0, "", "a", "1")).await.unwrap();
        store.park(&record(0, "x", "a", "2")).await.unwrap();
        store.park(&record(1, "", "a", "3")).await.unwrap();
        store.park(&record(0, "", "a", "4")).await.unwrap();
        let mut heads: Vec<String> = store
            .parked("t", 0)
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.head)
            .collect();
        heads.sort();
        assert_eq!(heads, ["2", "4"]);
        store.release(&record(0, "", "a", "4")).await.unwrap();
        assert_eq!(store.parked("t", 0).await.unwrap(), [record(0, "x", "a", "2")]);
        assert_eq!(store.parked("t", 1).await.unwrap(), [record(1, "", "a", "3")]);
        assert!(store.parked("other", 0).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn postgres_keeps_a_slots_parked_groups() {
        let db = crate::cluster::postgres::ScratchDb::new("weir_p").await;
        let pool = db.pool.clone();
        keeps_a_slots_parked_groups(&pg::Postgres::new(pool.clone())).await;
        db.drop().await;
    }

    #[tokio::test]
    async fn a_bucket_keeps_a_slots_parked_groups() {
        let server = std::env::var("WEIR_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
        let name = format!("weir-p-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let js = async_nats::jetstream::new(async_nats::connect(&server).await.unwrap());
        keeps_a_slots_parked_groups(&kv::Bucket::open(&js, &name, 1).await.unwrap()).await;
        let _ = js.delete_stream(format!("KV_{name}")).await;
    }
}
