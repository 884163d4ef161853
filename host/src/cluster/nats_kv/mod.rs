//! The JetStream KV coordinator (`cluster.mode = "nats-kv"`): the leased
//! loop of [`crate::cluster::leased`] over a KV bucket, for clusters that
//! run NATS and no database (docs/nats-kv-design.md).
//!
//! Keys of the bucket (`cluster.bucket`, history 1, `transport.replicas`):
//!
//! | key | value | written by |
//! |---|---|---|
//! | `node.<id>` | name, leaving | the node: created at registration, rewritten at each renewal (at its own revision), deleted on leave, or by the leader once expired |
//! | `leader` | node id, term | whoever takes it: `create`, or `update` at the revision read once that entry is older than lease + margin |
//! | `slot.<topology>.<n>` | owner, epoch, state, target | the leader (assign, ask to release), the owner (release) |
//!
//! What JetStream gives instead of a database's transactions:
//! - **Compare-and-set on revision** for every write: a write based on a
//!   stale read fails, and the next pass reads again.
//! - **The server's clock**: every entry carries the time the bucket's
//!   stream stored it. A lease is the age of the node's newest renewal,
//!   judged against the newest time seen in the bucket (a little behind
//!   the server's: an expiry is judged late, never early). The node's own
//!   fence runs on its monotonic clock from before the renewal was sent,
//!   as in `postgres` mode, so it fences before the server could judge it
//!   expired.
//! - **No multi-key transaction**, so the leader lease is fenced as a
//!   node's is: the leader stops writing at its own `lease − margin`
//!   deadline (from before its last leader write was sent), and another
//!   node takes the key only once it is older than lease + margin by the
//!   server's clock. Two leaders never write at once.
//! - **Watches** instead of `LISTEN/NOTIFY` ([`cache`]): every node keeps
//!   the bucket's newest entries and wakes when a slot, the leader or a
//!   node's registration changes (not at each renewal).

pub mod cache;
pub mod keys;
mod leader;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream::{self, kv};
use async_trait::async_trait;
use futures::StreamExt as _;
use futures::stream::BoxStream;
use parking_lot::Mutex;
use tokio::task::JoinHandle;
use uuid::Uuid;

use self::cache::{Cache, View};
#[cfg(test)]
use self::keys::parse_slot_key;
pub use self::keys::{LEADER_KEY, LeaderValue, NodeValue, SlotValue, node_key, slot_key};
use self::keys::{decode, encode};
use super::coordinator::{Coordinator, Start};
#[cfg(test)]
use super::leased::REASSIGN_MARGIN;
use super::leased::{Mine, NotReady, Store, run};
use super::slots::SlotKey;
use super::status::{NodeStatus, SlotStatus, Status};
use crate::config::Config;

/// Reads and compare-and-sets a release tries before it gives up until
/// the next pass.
const RELEASE_TRIES: usize = 3;

/// How long `weir status` waits for the bucket.
const STATUS_LIMIT: Duration = Duration::from_secs(5);

/// Open the bucket, creating it with `replicas` replicas when it is not there.
pub async fn open_bucket(js: &jetstream::Context, bucket: &str, replicas: usize) -> anyhow::Result<kv::Store> {
    match js.get_key_value(bucket).await {
        Ok(kv) => return Ok(kv),
        Err(e) if matches!(e.kind(), jetstream::context::KeyValueErrorKind::GetBucket) => {}
        Err(e) => {
            return Err(anyhow::Error::new(e).context(format!("cluster.bucket: reading the KV bucket `{bucket}`")));
        }
    }
    // The bucket's stream as a KV bucket is made (one value per key,
    // rollups, direct gets), created with the plain stream API: async-nats's
    // own bucket creation does not parse nats-server 2.9's answer. Created
    // by two nodes at once, the second finds the first's.
    let created = js
        .create_stream(jetstream::stream::Config {
            name: format!("KV_{bucket}"),
            description: Some("weir: nodes, leader and slot owners (cluster.mode = \"nats-kv\")".into()),
            subjects: vec![format!("$KV.{bucket}.>")],
            max_messages_per_subject: 1,
            storage: jetstream::stream::StorageType::File,
            discard: jetstream::stream::DiscardPolicy::New,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            num_replicas: replicas,
            ..Default::default()
        })
        .await;
    let kv = match (created, js.get_key_value(bucket).await) {
        (_, Ok(kv)) => kv,
        (Err(e), Err(_)) => {
            return Err(anyhow::Error::new(e).context(format!(
                "cluster.bucket: creating the KV bucket `{bucket}` ({replicas} replicas)"
            )));
        }
        (Ok(_), Err(e)) => {
            return Err(
                anyhow::Error::new(e).context(format!("cluster.bucket: reading the KV bucket `{bucket}` just created"))
            );
        }
    };
    tracing::info!(bucket, replicas, "coordination bucket ready");
    Ok(kv)
}

/// This node's registration.
#[derive(Debug, Clone)]
struct Registration {
    id: Uuid,
    revision: u64,
    value: NodeValue,
}

/// This node's hold on the leader key.
#[derive(Debug, Clone, Copy)]
struct Leadership {
    id: Uuid,
    revision: u64,
    term: u64,
    /// When the newest successful leader write was sent.
    sent: Instant,
}

/// One node's view of the bucket: the [`Store`] of `nats-kv` mode.
pub struct Bucket {
    kv: kv::Store,
    cache: Cache,
    name: String,
    lease: Duration,
    all_slots: Vec<SlotKey>,
    me: Mutex<Option<Registration>>,
    /// The id of a registration under way (kept across its tries).
    registering: Mutex<Option<Uuid>>,
    /// Renewals and the leaving mark write `node.<id>` one at a time (each
    /// at the revision of the one before).
    writing: tokio::sync::Mutex<()>,
    leader: Mutex<Option<Leadership>>,
    /// The negative control of a test, never set otherwise: the leader
    /// takes a node missing from its view for gone without asking the
    /// server.
    trust_absence: std::sync::atomic::AtomicBool,
}

impl Bucket {
    /// The bucket `kv` for node `name` (lease `lease`, the config's slots).
    pub fn new(kv: kv::Store, name: &str, lease: Duration, all_slots: Vec<SlotKey>) -> Self {
        Self {
            cache: Cache::start(kv.clone()),
            kv,
            name: name.to_owned(),
            lease,
            all_slots,
            me: Mutex::new(None),
            registering: Mutex::new(None),
            writing: tokio::sync::Mutex::new(()),
            leader: Mutex::new(None),
            trust_absence: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// `f` of the cached view, once it is current.
    fn read<T>(&self, f: impl FnOnce(&View) -> T) -> anyhow::Result<T> {
        self.cache.with(|v| v.current.then(|| f(v))).ok_or_else(|| {
            anyhow::Error::new(NotReady(format!(
                "the coordination bucket `{}` is not read yet",
                self.kv.name
            )))
        })
    }

    /// Rewrite `node.<id>` at the registration's revision: as it is
    /// (a renewal), or marked leaving. The value is read under the write
    /// lock, so that a renewal queued behind the leaving mark does not
    /// write the node back as staying.
    async fn write_node(&self, id: Uuid, leaving: bool) -> anyhow::Result<bool> {
        self.write_node_as(id, leaving, None).await
    }

    /// [`Bucket::write_node`]; `early` is the value read before the lock, for
    /// the negative control of the test that shows why it must not be.
    async fn write_node_as(&self, id: Uuid, leaving: bool, early: Option<NodeValue>) -> anyhow::Result<bool> {
        let _one = self.writing.lock().await;
        let Some(reg) = self.me.lock().clone().filter(|r| r.id == id) else {
            return Ok(false);
        };
        let value = early.unwrap_or_else(|| NodeValue {
            leaving: reg.value.leaving || leaving,
            ..reg.value.clone()
        });
        let key = node_key(id);
        match self.kv.update(&key, encode(&value), reg.revision).await {
            Ok(revision) => {
                *self.me.lock() = Some(Registration { id, revision, value });
                Ok(true)
            }
            Err(e) => {
                // Gone (deleted by the leader once expired): register again.
                // Written at another revision: an earlier write that timed
                // out here landed there; take it up.
                let now = self.kv.entry(key.as_str()).await.context("reading this node's key")?;
                match now {
                    Some(en) if en.operation == kv::Operation::Put && en.revision != reg.revision => {
                        if let Some(r) = self.me.lock().as_mut().filter(|r| r.id == id) {
                            r.revision = en.revision;
                        }
                        Err(anyhow::Error::new(e).context("renewing: an earlier write landed late; taken up"))
                    }
                    Some(en) if en.operation == kv::Operation::Put => {
                        Err(anyhow::Error::new(e).context("renewing this node's key"))
                    }
                    _ => Ok(false),
                }
            }
        }
    }

    /// One try at [`Store::release`]: `None` when the slot changed between
    /// the read and the write.
    async fn release_once(&self, id: Uuid, key: &SlotKey, epoch: i64) -> anyhow::Result<Option<bool>> {
        let k = slot_key(key);
        let Some(e) = self
            .kv
            .entry(k.as_str())
            .await
            .with_context(|| format!("reading slot {} of `{}`", key.1, key.0))?
            .filter(|e| e.operation == kv::Operation::Put)
        else {
            return Ok(Some(false));
        };
        let Some(slot) = decode::<SlotValue>(&e.value).filter(|s| s.owner == Some(id) && s.epoch == epoch) else {
            return Ok(Some(false));
        };
        let live_target = slot.target.filter(|t| self.cache.with(|v| v.live(*t, self.lease)));
        let next = match live_target {
            Some(t) => SlotValue {
                owner: Some(t),
                epoch: epoch + 1,
                state: "assigned".into(),
                target: None,
            },
            None => SlotValue::free(epoch),
        };
        match self.kv.update(&k, encode(&next), e.revision).await {
            Ok(_) => Ok(Some(true)),
            Err(err) if err.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(None),
            Err(err) => Err(anyhow::Error::new(err).context(format!("releasing slot {} of `{}`", key.1, key.0))),
        }
    }
}

#[async_trait]
impl Store for Bucket {
    fn what(&self) -> &'static str {
        "NATS"
    }

    /// A registration that timed out may have landed: the next try uses
    /// the same id and takes the key up if it is there, instead of leaving
    /// an orphan the leader gives slots to until it expires (seen at the
    /// 100-node start: 20 slots waited a lease).
    async fn register(&self) -> anyhow::Result<Uuid> {
        let id = *self.registering.lock().get_or_insert_with(Uuid::now_v7);
        let value = NodeValue {
            name: self.name.clone(),
            leaving: false,
        };
        let revision = match self.kv.create(node_key(id), encode(&value)).await {
            Ok(r) => r,
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => self
                .kv
                .entry(node_key(id))
                .await
                .context("reading this node's key, made by an earlier try")?
                .filter(|e| e.operation == kv::Operation::Put)
                .map(|e| e.revision)
                .context("this node's key, made by an earlier try, is gone")?,
            Err(e) => return Err(anyhow::Error::new(e).context("registering this node in the coordination bucket")),
        };
        *self.registering.lock() = None;
        *self.me.lock() = Some(Registration { id, revision, value });
        Ok(id)
    }

    async fn renew(&self, id: Uuid) -> anyhow::Result<bool> {
        self.write_node(id, false).await
    }

    async fn mark_leaving(&self, id: Uuid) -> anyhow::Result<()> {
        anyhow::ensure!(self.write_node(id, true).await?, "this node's registration is gone");
        Ok(())
    }

    async fn leave(&self, id: Uuid) -> anyhow::Result<()> {
        self.kv.delete(node_key(id)).await.context("deleting this node's key")?;
        *self.me.lock() = None;
        let left: Vec<(SlotKey, i64, u64)> = self.cache.with(|v| {
            v.owned
                .get(&id)
                .into_iter()
                .flatten()
                .filter_map(|k| v.slots.get(k).map(|s| (k.clone(), s.value.epoch, s.revision)))
                .collect()
        });
        for (key, epoch, revision) in left {
            let _ = self
                .kv
                .update(slot_key(&key), encode(&SlotValue::free(epoch)), revision)
                .await;
        }
        let held = self.leader.lock().take();
        if let Some(l) = held.filter(|l| l.id == id) {
            let _ = self.kv.delete_expect_revision(LEADER_KEY, Some(l.revision)).await;
        }
        Ok(())
    }

    async fn try_lead(&self, id: Uuid) -> anyhow::Result<bool> {
        Bucket::try_lead(self, id).await
    }

    async fn lead(&self, id: Uuid) -> anyhow::Result<()> {
        Bucket::lead(self, id).await
    }

    async fn mine(&self, id: Uuid) -> anyhow::Result<Mine> {
        self.read(|v| {
            v.owned
                .get(&id)
                .into_iter()
                .flatten()
                .filter_map(|k| {
                    let s = &v.slots.get(k)?.value;
                    Some((k.clone(), (s.epoch, s.state == "releasing")))
                })
                .collect()
        })
    }

    async fn release(&self, id: Uuid, key: &SlotKey, epoch: i64) -> anyhow::Result<bool> {
        // The leader may change the target between our read and our write
        // (another node joined): read again and retry, a few times.
        for _ in 0..RELEASE_TRIES - 1 {
            if let Some(done) = self.release_once(id, key, epoch).await? {
                return Ok(done);
            }
        }
        self.release_once(id, key, epoch)
            .await?
            .with_context(|| format!("releasing slot {} of `{}`: it kept changing", key.1, key.0))
    }

    async fn changes(&self) -> anyhow::Result<BoxStream<'static, ()>> {
        let rx = self.cache.changes();
        Ok(futures::stream::unfold(rx, |mut rx| async move { rx.changed().await.ok().map(|()| ((), rx)) }).boxed())
    }
}

/// The cluster as `weir status` shows it, read from the bucket.
pub async fn status(kv: &kv::Store, lease: Duration) -> anyhow::Result<Status> {
    let v = cache::snapshot(kv, STATUS_LIMIT).await?;
    let leader = v
        .entries
        .get(LEADER_KEY)
        .filter(|e| v.age(e) <= lease)
        .and_then(|e| decode::<LeaderValue>(&e.value))
        .map(|l| l.node);
    let mut nodes: Vec<NodeStatus> = v
        .nodes
        .iter()
        .map(|(id, n)| {
            let age = v.age_of(n.created).as_secs_f64();
            NodeStatus {
                id: *id,
                name: n.value.name.clone(),
                lease_age_s: age,
                lease_left_s: lease.as_secs_f64() - age,
                leader: leader == Some(*id),
            }
        })
        .collect();
    nodes.sort_by(|a, b| (&a.name, a.id).cmp(&(&b.name, b.id)));
    let slots = v
        .slots
        .iter()
        .map(|(k, s)| {
            let owner = s
                .value
                .owner
                .and_then(|o| v.nodes.get(&o))
                .map(|n| n.value.name.clone());
            SlotStatus::new(k.0.clone(), k.1, owner, s.value.epoch, s.value.state.clone())
        })
        .collect();
    Ok(Status {
        mode: "nats-kv".into(),
        nodes,
        slots,
    })
}

/// `cluster.mode = "nats-kv"`: slots are assigned through the bucket;
/// nothing runs until this node is given some.
pub struct NatsKv {
    urls: Vec<String>,
    bucket: String,
    replicas: usize,
    setup: run::Setup,
    /// The bucket as `weir status` reads it, on the node's runtime.
    observer: tokio::sync::OnceCell<kv::Store>,
}

impl NatsKv {
    /// This node's membership, from `config` (`transport.url`, `cluster.bucket`);
    /// `bucket` is the bucket opened at start on the node's runtime, for `weir status`.
    pub fn new(config: &Config, bucket: Option<kv::Store>) -> Self {
        Self {
            urls: config.transport.urls(),
            bucket: config.cluster.bucket().to_owned(),
            replicas: config.transport.replicas(),
            setup: run::Setup::of(config),
            observer: tokio::sync::OnceCell::new_with(bucket),
        }
    }

    /// Connect (as `weir <what> <node>`) and open the bucket.
    pub async fn open(urls: &[String], what: &str, bucket: &str, replicas: usize) -> anyhow::Result<kv::Store> {
        let client = crate::transport::nats::connect(urls, what).await?;
        open_bucket(&jetstream::new(client), bucket, replicas).await
    }
}

#[async_trait]
impl Coordinator for NatsKv {
    fn initial_slots(&self, _slots: u32) -> Vec<u32> {
        Vec::new()
    }

    fn ready_at_start(&self) -> bool {
        false
    }

    /// The loop runs on a thread of its own ([`run::spawn`]), with a NATS
    /// connection of its own.
    fn start(&self, start: Start) -> Option<JoinHandle<anyhow::Result<()>>> {
        let (urls, bucket, replicas) = (self.urls.clone(), self.bucket.clone(), self.replicas);
        Some(run::spawn(self.setup.clone(), start, move |setup, all| {
            let (urls, bucket, setup, all) = (urls.clone(), bucket.clone(), setup.clone(), all.to_vec());
            Box::pin(async move {
                let what = format!("weir coordinator {}", setup.name);
                let kv = Self::open(&urls, &what, &bucket, replicas).await?;
                let store: Arc<dyn Store> = Arc::new(Bucket::new(kv, &setup.name, setup.lease, all));
                Ok(store)
            })
        }))
    }

    async fn status(&self) -> anyhow::Result<Option<Status>> {
        let what = format!("weir status {}", self.setup.name);
        let kv = self
            .observer
            .get_or_try_init(|| Self::open(&self.urls, &what, &self.bucket, self.replicas))
            .await?;
        status(kv, self.setup.lease).await.map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server() -> String {
        std::env::var("WEIR_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
    }

    /// A bucket of its own on the test server; deleted by [`drop_bucket`].
    async fn bucket() -> (String, kv::Store) {
        let name = format!("weir-u-{}", &Uuid::new_v4().simple().to_string()[..8]);
        let kv = NatsKv::open(&[server()], "weir unit test", &name, 1).await.unwrap();
        (name, kv)
    }

    async fn drop_bucket(name: &str) {
        let client = async_nats::connect(server()).await.unwrap();
        let _ = jetstream::new(client).delete_key_value(name).await;
    }

    fn node(kv: &kv::Store, name: &str, lease: Duration) -> Bucket {
        Bucket::new(kv.clone(), name, lease, vec![("t".to_owned(), 0), ("t".to_owned(), 1)])
    }

    async fn leaving_in_bucket(kv: &kv::Store, id: Uuid) -> bool {
        let e = kv.entry(node_key(id)).await.unwrap().unwrap();
        decode::<NodeValue>(&e.value).unwrap().leaving
    }

    /// A renewal that starts while the leaving mark waits for the write
    /// lock (renewals go out every tenth of the lease, two at a time):
    /// with the value read under the lock, it writes the node as leaving;
    /// `early` reads it before, as a first version did.
    async fn renewal_behind_the_leaving_mark(early: bool) -> (bool, bool) {
        let (name, kv) = bucket().await;
        let b = Arc::new(node(&kv, "n", Duration::from_secs(5)));
        let id = b.register().await.unwrap();
        let held = b.writing.lock().await;
        let mark = tokio::spawn({
            let b = b.clone();
            async move { b.mark_leaving(id).await }
        });
        // The mark is queued on the lock before the renewal starts (one
        // thread: a yield runs the spawned task up to the lock).
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        assert!(!mark.is_finished());
        let renewal = tokio::spawn({
            let b = b.clone();
            async move {
                let value = early.then(|| b.me.lock().as_ref().map(|r| r.value.clone())).flatten();
                b.write_node_as(id, false, value).await
            }
        });
        tokio::task::yield_now().await;
        drop(held);
        mark.await.unwrap().unwrap();
        assert!(renewal.await.unwrap().unwrap());
        let stored = leaving_in_bucket(&kv, id).await;
        let kept = b.me.lock().as_ref().is_some_and(|r| r.value.leaving);
        drop(b);
        drop_bucket(&name).await;
        (stored, kept)
    }

    #[tokio::test]
    async fn a_renewal_queued_behind_the_leaving_mark_keeps_it() {
        assert_eq!(renewal_behind_the_leaving_mark(false).await, (true, true));
    }

    /// The negative control: a renewal that read the value before the lock
    /// writes the node back as staying, and every renewal after it too; the
    /// leader then gives the leaving node slots again, for ever.
    #[tokio::test]
    async fn a_renewal_that_read_early_undoes_the_leaving_mark() {
        assert_eq!(renewal_behind_the_leaving_mark(true).await, (false, false));
    }

    /// A watch started while others write is current only once it has
    /// every key that was in the bucket when it started.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cache_is_current_only_with_every_key() {
        let (name, kv) = bucket().await;
        for i in 0..300 {
            kv.put(format!("slot.t.{i}"), encode(&SlotValue::free(0)))
                .await
                .unwrap();
        }
        let writer = tokio::spawn({
            let kv = kv.clone();
            async move {
                for i in 0u64.. {
                    let _ = kv
                        .put(format!("node.w{}", i % 7), bytes::Bytes::from(i.to_string()))
                        .await;
                }
            }
        });
        for _ in 0..5 {
            let cache = Cache::start(kv.clone());
            let start = Instant::now();
            let v = loop {
                let v = cache.view();
                if v.current {
                    break v;
                }
                assert!(start.elapsed() < Duration::from_secs(10), "never current");
                tokio::time::sleep(Duration::from_millis(5)).await;
            };
            let slots = v.entries.keys().filter(|k| k.starts_with("slot.")).count();
            assert_eq!(slots, 300, "a current view has every key");
        }
        writer.abort();
        drop_bucket(&name).await;
    }

    /// A leader whose view lacks a live owner's key (a watch catching up)
    /// leaves its slot alone; with `trust_absence` it reassigns it, which
    /// would let two nodes run the slot.
    /// Returns whether the owner still owns its slot after the pass.
    async fn a_slot_of_an_owner_missing_from_the_view(trust_absence: bool) -> bool {
        let lease = Duration::from_secs(5);
        let (name, kv) = bucket().await;
        let owner = node(&kv, "owner", lease);
        let leader = node(&kv, "leader", lease);
        let (io, il) = (owner.register().await.unwrap(), leader.register().await.unwrap());
        kv.put(slot_key(&("t".to_owned(), 0)), encode(&assigned_to(io)))
            .await
            .unwrap();
        kv.put(slot_key(&("t".to_owned(), 1)), encode(&assigned_to(il)))
            .await
            .unwrap();
        while !leader.cache.with(|v| v.current && v.entries.len() == 4) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        leader.cache.forget(&node_key(io));
        leader
            .trust_absence
            .store(trust_absence, std::sync::atomic::Ordering::Relaxed);
        assert!(leader.try_lead(il).await.unwrap());
        leader.lead(il).await.unwrap();
        let e = kv.entry(slot_key(&("t".to_owned(), 0))).await.unwrap().unwrap();
        drop((owner, leader));
        drop_bucket(&name).await;
        decode::<SlotValue>(&e.value).and_then(|s| s.owner) == Some(io)
    }

    fn assigned_to(n: Uuid) -> SlotValue {
        SlotValue {
            owner: Some(n),
            epoch: 1,
            state: "assigned".into(),
            target: None,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_leader_asks_the_server_before_it_takes_an_owner_for_gone() {
        assert!(a_slot_of_an_owner_missing_from_the_view(false).await);
    }

    /// The negative control: trusting the view, the leader gives the slot
    /// of a live node to another.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn trusting_the_view_a_leader_takes_a_live_slot_away() {
        assert!(!a_slot_of_an_owner_missing_from_the_view(true).await);
    }

    /// A registration whose first try landed but timed out here is taken
    /// up by the next try, not left as an orphan with a second id.
    #[tokio::test]
    async fn a_registration_that_landed_is_taken_up() {
        let (name, kv) = bucket().await;
        let b = node(&kv, "n", Duration::from_secs(5));
        let id = Uuid::now_v7();
        *b.registering.lock() = Some(id);
        let landed = kv
            .create(
                node_key(id),
                encode(&NodeValue {
                    name: "n".into(),
                    leaving: false,
                }),
            )
            .await
            .unwrap();
        assert_eq!(b.register().await.unwrap(), id);
        assert_eq!(b.me.lock().as_ref().map(|r| r.revision), Some(landed));
        assert!(b.renew(id).await.unwrap(), "renewed at the revision taken up");
        // The next registration (after an expiry) is a new node.
        assert_ne!(b.register().await.unwrap(), id);
        drop(b);
        drop_bucket(&name).await;
    }

    /// Another node takes the leader key only once its entry is older than
    /// lease + margin by the server's clock, and then with the next term.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_leader_key_is_taken_over_only_after_lease_and_margin() {
        let lease = Duration::from_secs(1);
        let (name, kv) = bucket().await;
        let a = node(&kv, "a", lease);
        let b = node(&kv, "b", lease);
        let (ia, ib) = (a.register().await.unwrap(), b.register().await.unwrap());
        let current = |n: &Bucket| n.cache.with(|v| v.current);
        while !current(&a) || !current(&b) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(a.try_lead(ia).await.unwrap());
        let first = kv.entry(LEADER_KEY).await.unwrap().unwrap();
        // b keeps renewing (its entries move the bucket's clock on); a stops.
        let start = Instant::now();
        while !b.try_lead(ib).await.unwrap() {
            b.renew(ib).await.unwrap();
            assert!(start.elapsed() < Duration::from_secs(10), "never taken over");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let second = kv.entry(LEADER_KEY).await.unwrap().unwrap();
        let apart = Duration::from_nanos(
            u64::try_from(second.created.unix_timestamp_nanos() - first.created.unix_timestamp_nanos()).unwrap(),
        );
        assert!(
            apart > lease + REASSIGN_MARGIN,
            "taken over {apart:?} after it was written"
        );
        assert!(
            apart < lease + REASSIGN_MARGIN + Duration::from_secs(2),
            "taken over {apart:?} after it was written"
        );
        assert_eq!(
            decode::<LeaderValue>(&second.value),
            Some(LeaderValue { node: ib, term: 2 })
        );
        // a's own deadline passed long before: it writes nothing more.
        assert!(!a.leads(ia));
        drop((a, b));
        drop_bucket(&name).await;
    }

    #[test]
    fn slot_keys_read_back() {
        let k = ("orders-eu_2".to_owned(), 17);
        assert_eq!(slot_key(&k), "slot.orders-eu_2.17");
        assert_eq!(parse_slot_key(&slot_key(&k)), Some(k));
        assert_eq!(parse_slot_key("node.x"), None);
        assert_eq!(parse_slot_key("slot.t.x"), None);
    }
}
