//! A version store the whole cluster shares: the coordinator database in
//! `postgres` mode ([`super::store::pg`]), or two buckets beside the
//! coordination bucket in `nats-kv` mode ([`super::kv`]). A deploy,
//! promotion or rollback on any node is recorded here, and every node
//! follows it: notified at once where the store can notify, and by a poll
//! every few seconds as a backstop.

use std::pin::Pin;

use async_trait::async_trait;
use futures::Stream;

use super::types::{Activation, Canary, Tally};

/// Wakes a follower when a handler's versions may have changed.
pub type Changes = Pin<Box<dyn Stream<Item = ()> + Send>>;

/// How a canary ended: (the canary, `promoted` or `rolled-back`, why, when in ms).
pub type EndedRecord = (Canary, String, String, i64);

/// What the registry asks of a store shared by the cluster.
#[async_trait]
pub trait Shared: Send + Sync {
    /// `database` or `bucket` (where `GET /v1/handlers` says versions are kept).
    fn label(&self) -> &'static str;
    /// Every activation of handler `name`, oldest first.
    async fn activations(&self, name: &str) -> anyhow::Result<Vec<Activation>>;
    /// The component bytes of version `digest` of `name`.
    async fn component(&self, name: &str, digest: &str) -> anyhow::Result<Vec<u8>>;
    /// Store the version (once; `bytes` empty: stored already) and append an
    /// activation whose `previous` is `a.previous` (a rollback) or the
    /// cluster's current one. A `config` activation is recorded only when
    /// the handler has none (the first node to start records it).
    async fn activate(&self, name: &str, bytes: &[u8], a: Activation) -> anyhow::Result<Activation>;
    /// Store the canary's version and start it (its id and start time set
    /// here); refused when a canary of `name` is live.
    async fn start_canary(&self, name: &str, bytes: &[u8], c: Canary) -> anyhow::Result<Canary>;
    /// The live canary of `name`.
    async fn live_canary(&self, name: &str) -> anyhow::Result<Option<Canary>>;
    /// How the latest ended canary of `name` ended.
    async fn last_ended(&self, name: &str) -> anyhow::Result<Option<EndedRecord>>;
    /// Roll back live canary `id` of `name`; refused when it is not live.
    async fn end_canary(&self, name: &str, id: i64, reason: &str) -> anyhow::Result<()>;
    /// End live canary `id` as promoted and activate its version, at once.
    async fn promote(&self, name: &str, id: i64, a: Activation) -> anyhow::Result<Activation>;
    /// The cluster's sums of canary `id`'s tallies: (canary, stable).
    async fn canary_tallies(&self, id: i64) -> anyhow::Result<(Tally, Tally)>;
    /// Record `node`'s tally of canary `id`; the cluster's sums (canary, stable).
    async fn tally_canary(&self, id: i64, node: &str, canary: &Tally, stable: &Tally)
    -> anyhow::Result<(Tally, Tally)>;
    /// Notifications of changes, when the store has them (`None`: poll only).
    async fn changes(&self) -> anyhow::Result<Option<Changes>>;
}
