//! `handler.dedup`: no second call for a message whose handler already
//! succeeded. Right before a message's call, the host looks it up in the
//! coordinator's store; one already recorded is acked without a call. As
//! soon as the call succeeded and its cascades were confirmed, before the
//! next call of its job, the host records (tenant, group, message id) for
//! the handler's `window`; the ack comes after. So a kill -9 between a
//! success and its ack costs no second call on the next owner, and a copy
//! queued behind the first in the same job is caught from the job's own
//! memory, with no round trip ([`crate::dispatch`]'s `dedup_calls`).
//!
//! What it cannot cover: a crash after the handler's effects but before the
//! record lands (its cascades' confirms and one write), a record that could
//! not be written (counted and logged; the message is acked all the same),
//! two copies running at once (messages without a group, in two jobs), two
//! copies in one `handle-batch` call, and a redelivery after `window`.
//!
//! One lookup and one write per message, in both stores: [`pg`] (a table,
//! `cluster.mode = "postgres"`, expired rows deleted every second) and
//! [`kv`] (a bucket beside the coordination bucket, `cluster.mode =
//! "nats-kv"`, whose `max_age` is the longest window). The lookups and
//! writes of every lane of a node are merged ([`Coalesced`]).

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

/// Lookups (and, apart, writes) a node has in flight at once: the
/// PostgreSQL pool's connections are shared by both kinds.
pub const PARALLEL: usize = 2;

/// Most keys one coalesced lookup or write carries.
const MOST_KEYS: usize = 4096;

type Reply<T> = tokio::sync::oneshot::Sender<Result<T, String>>;
/// A request to the merging task: its keys, and where its answer goes.
type Request<K, T> = (Vec<K>, Reply<T>);

/// A store whose lookups and writes from every lane of the node are merged:
/// while `parallel` operations of a kind are in flight, the requests that
/// arrive wait, and go out together as one operation when one ends (one
/// query for many jobs on PostgreSQL). Wraps the store a node uses.
pub struct Coalesced {
    what: &'static str,
    seen: tokio::sync::mpsc::UnboundedSender<Request<Key, Vec<bool>>>,
    record: tokio::sync::mpsc::UnboundedSender<Request<(Key, Duration), ()>>,
}

impl Coalesced {
    /// Merge the operations on `inner`, at most `parallel` of each kind at
    /// once (its connections). Spawns two tasks on the current runtime; they
    /// end when this is dropped.
    pub fn new(inner: std::sync::Arc<dyn Store>, parallel: usize) -> Self {
        let (seen, seen_rx) = tokio::sync::mpsc::unbounded_channel();
        let (record, record_rx) = tokio::sync::mpsc::unbounded_channel();
        let what = inner.what();
        let lookups = inner.clone();
        tokio::spawn(merge(seen_rx, parallel, move |keys: Vec<Key>| {
            let inner = lookups.clone();
            async move { inner.seen(&keys).await }
        }));
        tokio::spawn(merge(record_rx, parallel, move |mut keys: Vec<(Key, Duration)>| {
            let inner = inner.clone();
            async move {
                keys.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
                keys.dedup_by(|a, b| a.0 == b.0);
                inner.record(&keys).await
            }
        }));
        Self { what, seen, record }
    }
}

/// What one merged operation answers each request with.
trait Split: Sized {
    fn split(self, sizes: &[usize]) -> Vec<Self>;
}

impl Split for () {
    fn split(self, sizes: &[usize]) -> Vec<Self> {
        vec![(); sizes.len()]
    }
}

impl Split for Vec<bool> {
    fn split(self, sizes: &[usize]) -> Vec<Self> {
        let mut rest = self.into_iter();
        sizes.iter().map(|n| rest.by_ref().take(*n).collect()).collect()
    }
}

/// Take requests from `rx`; whenever fewer than `parallel` operations run,
/// send everything waiting as one `op`, and answer each request its part.
async fn merge<K, T, F, Fut>(mut rx: tokio::sync::mpsc::UnboundedReceiver<(Vec<K>, Reply<T>)>, parallel: usize, op: F)
where
    K: Send + 'static,
    T: Split + Send + 'static,
    F: Fn(Vec<K>) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>> + Send + 'static,
{
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(parallel.max(1)));
    while let Some(first) = rx.recv().await {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let mut reqs = vec![first];
        let mut n = reqs[0].0.len();
        while n < MOST_KEYS {
            match rx.try_recv() {
                Ok(r) => {
                    n += r.0.len();
                    reqs.push(r);
                }
                Err(_) => break,
            }
        }
        let sizes: Vec<usize> = reqs.iter().map(|r| r.0.len()).collect();
        let mut keys = Vec::with_capacity(n);
        let mut replies = Vec::with_capacity(reqs.len());
        for (k, reply) in reqs {
            keys.extend(k);
            replies.push(reply);
        }
        let fut = op(keys);
        tokio::spawn(async move {
            match fut.await {
                Ok(all) => {
                    for (part, reply) in all.split(&sizes).into_iter().zip(replies) {
                        let _ = reply.send(Ok(part));
                    }
                }
                Err(e) => {
                    let text = format!("{e:#}");
                    for reply in replies {
                        let _ = reply.send(Err(text.clone()));
                    }
                }
            }
            drop(permit);
        });
    }
}

#[async_trait]
impl Store for Coalesced {
    fn what(&self) -> &'static str {
        self.what
    }

    async fn seen(&self, keys: &[Key]) -> anyhow::Result<Vec<bool>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.seen
            .send((keys.to_vec(), tx))
            .map_err(|_| anyhow::anyhow!("the dedup lookups have stopped"))?;
        rx.await
            .map_err(|_| anyhow::anyhow!("the dedup lookups have stopped"))?
            .map_err(anyhow::Error::msg)
    }

    async fn record(&self, keys: &[(Key, Duration)]) -> anyhow::Result<()> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.record
            .send((keys.to_vec(), tx))
            .map_err(|_| anyhow::anyhow!("the dedup writes have stopped"))?;
        rx.await
            .map_err(|_| anyhow::anyhow!("the dedup writes have stopped"))?
            .map_err(anyhow::Error::msg)
    }
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
        let db = crate::cluster::postgres::ScratchDb::new("weir_d").await;
        let pool = db.pool.clone();
        remembers_within_the_window(&pg::Postgres::new(pool.clone())).await;
        sqlx::query("DELETE FROM weir_dedup").execute(&pool).await.unwrap();
        // The same through the merging wrapper a node uses, with many
        // lookups at once: each gets its own answer.
        let merged = Coalesced::new(std::sync::Arc::new(pg::Postgres::new(pool.clone())), 1);
        remembers_within_the_window(&merged).await;
        let keys: Vec<Key> = (0..64).map(|i| key("t", "many", &i.to_string())).collect();
        record(
            &merged,
            keys.iter()
                .step_by(2)
                .map(|k| (k.clone(), Duration::from_secs(60)))
                .collect(),
        )
        .await
        .unwrap();
        let answers = futures::future::join_all(keys.chunks(3).map(|c| seen(&merged, c))).await;
        let flat: Vec<bool> = answers.into_iter().flat_map(Result::unwrap).collect();
        assert_eq!(flat, (0..64).map(|i| i % 2 == 0).collect::<Vec<_>>());
        db.drop().await;
    }

    /// Records written at a steady rate for `for_` with a window of
    /// `window`, on a store purging every `purge`: the rows when the writes
    /// end, how many were written, and the rate.
    async fn write_steadily(
        store: &dyn Store,
        pool: &sqlx::PgPool,
        window: Duration,
        for_: Duration,
    ) -> (i64, usize, f64) {
        let started = std::time::Instant::now();
        let mut written = 0;
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        while started.elapsed() < for_ {
            tick.tick().await;
            let keys: Vec<(Key, Duration)> = (0..100)
                .map(|i| (key("t", "steady", &format!("{written}-{i}")), window))
                .collect();
            written += keys.len();
            record(store, keys).await.unwrap();
        }
        let rate = written as f64 / started.elapsed().as_secs_f64();
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM weir_dedup")
            .fetch_one(pool)
            .await
            .unwrap();
        (rows, written, rate)
    }

    /// Issue 33 item 4: expired records are deleted, so a steady stream of
    /// writes leaves about rate × window in the table, not every record
    /// ever written; and after the writes stop, no record stays long past
    /// its window. Its red baseline: without the purge, everything stays.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_holds_about_rate_times_window() {
        let db = crate::cluster::postgres::ScratchDb::new("weir_d").await;
        let pool = db.pool.clone();
        let window = Duration::from_millis(500);
        let store = pg::Postgres::with_purge(pool.clone(), Some(Duration::from_millis(250)));
        let (rows, written, rate) = write_steadily(&store, &pool, window, Duration::from_secs(4)).await;
        let expected = rate * (window + Duration::from_millis(250)).as_secs_f64();
        eprintln!(
            "purged: {written} written at {rate:.0}/s, {rows} rows left (rate × (window + period) = {expected:.0})"
        );
        assert!(
            (rows as f64) < 2.0 * expected && (rows as usize) < written / 2,
            "{rows} rows left of {written} written at {rate:.0}/s: expected about {expected:.0}"
        );
        let start = std::time::Instant::now();
        loop {
            let stale: i64 =
                sqlx::query_scalar("SELECT count(*) FROM weir_dedup WHERE expires_at < now() - interval '1 second'")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            if stale == 0 {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(15),
                "{stale} records stayed past their window"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        drop(store);
        sqlx::query("DELETE FROM weir_dedup").execute(&pool).await.unwrap();
        // The red baseline: no purge, every record stays.
        let store = pg::Postgres::with_purge(pool.clone(), None);
        let (rows, written, _) = write_steadily(&store, &pool, window, Duration::from_secs(2)).await;
        assert_eq!(rows as usize, written, "without the purge every record stays");
        db.drop().await;
    }

    /// Issue 33 item 4 on NATS: the bucket keeps records for the config's
    /// longest window, set at every open (down as well as up), so a bucket
    /// made with a long window and reopened with a short one empties after
    /// it. Its red baseline, a bucket left at the long window, keeps all.
    #[tokio::test]
    async fn a_bucket_forgets_after_the_window() {
        let server = std::env::var("WEIR_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
        let js = async_nats::jetstream::new(async_nats::connect(&server).await.unwrap());
        let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
        let (short, long) = (format!("weir-d-s{suffix}"), format!("weir-d-l{suffix}"));
        kv::Bucket::open(&js, &short, 1, Duration::from_secs(600))
            .await
            .unwrap();
        let window = Duration::from_secs(1);
        let shortened = kv::Bucket::open(&js, &short, 1, window).await.unwrap();
        let kept = kv::Bucket::open(&js, &long, 1, Duration::from_secs(600)).await.unwrap();
        let keys: Vec<(Key, Duration)> = (0..500).map(|i| (key("t", "g", &i.to_string()), window)).collect();
        record(&shortened, keys.clone()).await.unwrap();
        record(&kept, keys).await.unwrap();
        let count = |name: String| {
            let js = js.clone();
            async move {
                let mut s = js.get_stream(format!("KV_{name}")).await.unwrap();
                s.info().await.unwrap().state.messages
            }
        };
        let start = std::time::Instant::now();
        while count(short.clone()).await > 0 {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the shortened bucket kept its records"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert_eq!(
            count(long.clone()).await,
            500,
            "the red baseline: a long max_age keeps every record"
        );
        let _ = js.delete_stream(format!("KV_{short}")).await;
        let _ = js.delete_stream(format!("KV_{long}")).await;
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
