//! The bucket as this node last saw it: every key's newest entry, kept
//! current by a watch (`LastPerSubject`, then every change), and the newest
//! server time seen. The loop reads it instead of asking the server for
//! 1 000 keys a tick; every write is a compare-and-set on the revision
//! read here, so a stale read costs a failed write and a later pass, never
//! a wrong one.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv;
use bytes::Bytes;
use futures::StreamExt as _;
use parking_lot::Mutex;
use tokio::sync::watch;
use uuid::Uuid;

use super::keys::{NodeValue, SlotValue, decode, parse_slot_key};
use crate::cluster::slots::SlotKey;

/// One key's newest entry.
#[derive(Debug, Clone)]
pub struct Entry {
    pub value: Bytes,
    pub revision: u64,
    /// When the bucket's stream stored it (the server's clock), in ns since the epoch.
    pub created: i128,
}

/// A registered node, as its key holds it.
#[derive(Debug, Clone)]
pub struct NodeEntry {
    pub value: NodeValue,
    pub revision: u64,
    pub created: i128,
}

/// A slot, as its key holds it.
#[derive(Debug, Clone)]
pub struct SlotEntry {
    pub value: SlotValue,
    pub revision: u64,
}

/// What the watch has delivered: every key's newest entry, and the nodes
/// and slots decoded once, when they change (a loop turn reads them
/// without decoding or copying the bucket: at 100 nodes × 1 024 slots it
/// did, and the coordinators' CPU starved their own renewals).
#[derive(Debug, Clone, Default)]
pub struct View {
    pub entries: HashMap<String, Entry>,
    pub nodes: BTreeMap<Uuid, NodeEntry>,
    pub slots: BTreeMap<SlotKey, SlotEntry>,
    /// The slots each node owns.
    pub owned: HashMap<Uuid, BTreeSet<SlotKey>>,
    /// Every key's newest entry as of the watch's start has arrived.
    pub current: bool,
    /// The newest `created` seen: the server's clock, a little behind.
    pub now: i128,
}

impl View {
    /// The age of `e` on the server's clock (never negative).
    pub fn age(&self, e: &Entry) -> Duration {
        self.age_of(e.created)
    }

    /// The age of an entry stored at `created` on the server's clock.
    pub fn age_of(&self, created: i128) -> Duration {
        let ns = (self.now - created).max(0);
        Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
    }

    /// Is `id` registered, its lease not run out, and not leaving?
    pub fn live(&self, id: Uuid, lease: Duration) -> bool {
        self.nodes
            .get(&id)
            .is_some_and(|n| self.age_of(n.created) <= lease && !n.value.leaving)
    }

    fn apply(&mut self, e: kv::Entry) -> bool {
        let created = e.created.unix_timestamp_nanos();
        self.now = self.now.max(created);
        match e.operation {
            kv::Operation::Put => {
                let entry = Entry {
                    value: e.value,
                    revision: e.revision,
                    created,
                };
                let changed = self.entries.get(&e.key).is_none_or(|old| old.value != entry.value);
                self.parse(&e.key, &entry, changed);
                self.entries.insert(e.key, entry);
                // A renewal rewrites the same bytes: no one needs waking.
                changed
            }
            kv::Operation::Delete | kv::Operation::Purge => {
                self.forget_parsed(&e.key);
                self.entries.remove(&e.key).is_some()
            }
        }
    }

    /// Keep the decoded nodes and slots in step with `key`'s new entry
    /// (decoded only when its bytes `changed`).
    fn parse(&mut self, key: &str, e: &Entry, changed: bool) {
        if let Some(id) = key.strip_prefix("node.").and_then(|i| i.parse::<Uuid>().ok()) {
            match self.nodes.get_mut(&id) {
                Some(n) if !changed => {
                    n.revision = e.revision;
                    n.created = e.created;
                }
                _ => match decode::<NodeValue>(&e.value) {
                    Some(value) => {
                        self.nodes.insert(
                            id,
                            NodeEntry {
                                value,
                                revision: e.revision,
                                created: e.created,
                            },
                        );
                    }
                    None => {
                        undecodable(key, e);
                        self.nodes.remove(&id);
                    }
                },
            }
        } else if let Some(slot) = parse_slot_key(key) {
            if !changed && let Some(s) = self.slots.get_mut(&slot) {
                s.revision = e.revision;
                return;
            }
            self.forget_parsed(key);
            let Some(value) = decode::<SlotValue>(&e.value) else {
                undecodable(key, e);
                return;
            };
            if let Some(o) = value.owner {
                self.owned.entry(o).or_default().insert(slot.clone());
            }
            self.slots.insert(
                slot,
                SlotEntry {
                    value,
                    revision: e.revision,
                },
            );
        }
    }

    fn forget_parsed(&mut self, key: &str) {
        if let Some(id) = key.strip_prefix("node.").and_then(|i| i.parse::<Uuid>().ok()) {
            self.nodes.remove(&id);
        } else if let Some(slot) = parse_slot_key(key)
            && let Some(old) = self.slots.remove(&slot)
            && let Some(o) = old.value.owner
            && let Some(set) = self.owned.get_mut(&o)
        {
            set.remove(&slot);
            if set.is_empty() {
                self.owned.remove(&o);
            }
        }
    }
}

/// The cache, fed by a task of its own; the task ends when this is dropped.
pub struct Cache {
    view: Arc<Mutex<View>>,
    changed: watch::Receiver<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Cache {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Cache {
    /// Watch `kv` from now on.
    pub fn start(kv: kv::Store) -> Self {
        let view = Arc::new(Mutex::new(View::default()));
        let (tx, changed) = watch::channel(0u64);
        let task = tokio::spawn(follow(kv, view.clone(), tx));
        Self { view, changed, task }
    }

    /// A copy of the view.
    pub fn view(&self) -> View {
        self.view.lock().clone()
    }

    /// Read `f` of the view without copying it.
    pub fn with<T>(&self, f: impl FnOnce(&View) -> T) -> T {
        f(&self.view.lock())
    }

    /// Drop `key` from the view, as a watch catching up can lack it (tests).
    #[cfg(test)]
    pub(crate) fn forget(&self, key: &str) {
        let mut v = self.view.lock();
        v.forget_parsed(key);
        v.entries.remove(key);
    }

    /// Ticks at every change that matters (not at a renewal).
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changed.clone()
    }
}

/// Keep `view` current; start over whenever the watch ends.
async fn follow(kv: kv::Store, view: Arc<Mutex<View>>, tx: watch::Sender<u64>) {
    loop {
        if let Err(e) = watch_once(&kv, &view, &tx).await {
            tracing::warn!(error = %format!("{e:#}"), bucket = %kv.name, "watching the coordination bucket failed; watching again");
        }
        view.lock().current = false;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn watch_once(kv: &kv::Store, view: &Mutex<View>, tx: &watch::Sender<u64>) -> anyhow::Result<()> {
    let mut watch = kv.watch_with_history(">").await?;
    let mut owed = Bound::of(kv).await?;
    let mut fresh = View::default();
    let mut started = false;
    let swap_in = |fresh: &mut View| {
        fresh.current = true;
        let mut v = view.lock();
        fresh.now = fresh.now.max(v.now);
        *v = std::mem::take(fresh);
        drop(v);
        tx.send_modify(|n| *n += 1);
    };
    if owed.is_none() {
        swap_in(&mut fresh);
        started = true;
    }
    while let Some(e) = watch.next().await {
        let e = e?;
        if started {
            let woke = view.lock().apply(e);
            if woke {
                tx.send_modify(|n| *n += 1);
            }
            continue;
        }
        // Building the view of a (re)start: swapped in whole once current,
        // so that the loop never sees half of it.
        let done = owed.as_mut().is_none_or(|o| o.arrived(&e));
        fresh.apply(e);
        if done {
            swap_in(&mut fresh);
            started = true;
        }
    }
    anyhow::bail!("the watch ended")
}

/// What a watch owes before its view is current: every key the bucket
/// held at some moment after the watch started, and an entry of at least
/// the bucket's newest revision then. `None`: the bucket held nothing.
///
/// Both are needed, and neither is what the server's pending count says.
/// The bucket keeps one entry per key, so a key rewritten while the watch
/// catches up (renewals: all the time) loses its old entry before the watch
/// reaches it and comes back only after the newest revision; a watch that
/// stopped at that revision would miss it (its test has the negative
/// control). The pending count sent with each entry reaches 0 before the end
/// under concurrent writes, or never does (nats-server 2.9). And asked
/// before the watch starts, the bound misses keys made in between.
///
/// Even a current view may hold an older entry of a key than the server
/// (it is a cache): every write made from it is a compare-and-set, and the
/// one decision made from a key's *absence* (an owner no longer registered)
/// is checked against the server first ([`super::leader`]).
pub(crate) struct Bound {
    through: u64,
    keys: HashSet<String>,
}

impl Bound {
    /// Ask the bucket (after the watch started).
    async fn of(kv: &kv::Store) -> anyhow::Result<Option<Self>> {
        let mut stream = kv.stream.clone();
        let info = stream.info().await?;
        if info.state.messages == 0 {
            return Ok(None);
        }
        let through = info.state.last_sequence;
        let mut keys = HashSet::new();
        let mut subjects = stream.info_with_subjects(format!("{}>", kv.prefix)).await?;
        while let Some(s) = subjects.next().await {
            let (subject, _) = s?;
            if let Some(k) = subject.strip_prefix(kv.prefix.as_str()) {
                keys.insert(k.to_owned());
            }
        }
        Ok(Some(Self { through, keys }))
    }

    /// `e` arrived: true once everything owed has.
    fn arrived(&mut self, e: &kv::Entry) -> bool {
        self.keys.remove(&e.key);
        if e.revision >= self.through {
            self.through = 0;
        }
        self.through == 0 && self.keys.is_empty()
    }
}

/// Every key's newest entry, read once (`weir status`, tests): a watch read
/// until it is current, within `limit`.
pub async fn snapshot(kv: &kv::Store, limit: Duration) -> anyhow::Result<View> {
    read_all(kv, limit, false).await
}

/// [`snapshot`]; `revision_only` waits for the newest revision alone, not
/// for every key: the mistake the negative control of its test shows.
async fn read_all(kv: &kv::Store, limit: Duration, revision_only: bool) -> anyhow::Result<View> {
    let read = async {
        let mut v = View::default();
        let mut watch = kv.watch_with_history(">").await?;
        let mut bound = Bound::of(kv).await?;
        if revision_only && let Some(b) = bound.as_mut() {
            b.keys.clear();
        }
        let Some(mut owed) = bound else {
            v.current = true;
            return anyhow::Ok(v);
        };
        while let Some(e) = watch.next().await {
            let e = e?;
            let last = owed.arrived(&e);
            v.apply(e);
            if last {
                v.current = true;
                return Ok(v);
            }
        }
        anyhow::bail!("the watch ended before the bucket was read")
    };
    tokio::time::timeout(limit, read)
        .await
        .map_err(|_| anyhow::anyhow!("the coordination bucket `{}` was not read within {limit:?}", kv.name))?
}

/// A node or slot key whose value does not decode (written by hand, or by
/// another program): it is left out of the view, so a slot stays
/// unassigned until the value is fixed or the key deleted. Said once per
/// change of the key.
fn undecodable(key: &str, e: &Entry) {
    tracing::warn!(
        key,
        revision = e.revision,
        bytes = e.value.len(),
        "a coordination bucket value that does not decode is ignored; a slot key like this stays unassigned \
         until the value is fixed or the key is deleted"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server() -> String {
        std::env::var("WEIR_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
    }

    /// 300 keys written once and 7 rewritten all the time: how many of the
    /// 20 reads (waiting for the newest revision alone, or not) missed a key.
    async fn reads_missing_a_key(revision_only: bool) -> usize {
        let name = format!("weir-u-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let client = async_nats::connect(server()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let kv = crate::cluster::nats_kv::open_bucket(&js, &name, 1).await.unwrap();
        for i in 0..300 {
            kv.put(format!("slot.t.{i}"), Bytes::from_static(b"x")).await.unwrap();
        }
        for i in 0..7 {
            kv.put(format!("node.w{i}"), Bytes::from_static(b"0")).await.unwrap();
        }
        let writer = tokio::spawn({
            let kv = kv.clone();
            async move {
                for i in 0u64.. {
                    let _ = kv.put(format!("node.w{}", i % 7), Bytes::from(i.to_string())).await;
                }
            }
        });
        let mut missing = 0;
        for _ in 0..20 {
            let v = read_all(&kv, Duration::from_secs(10), revision_only).await.unwrap();
            if v.entries.len() < 307 {
                missing += 1;
            }
        }
        writer.abort();
        let _ = js.delete_key_value(&name).await;
        missing
    }

    /// A read is current only with every key, however fast some are
    /// rewritten meanwhile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_is_current_only_with_every_key() {
        assert_eq!(reads_missing_a_key(false).await, 0);
    }

    /// The negative control: a read that stops at the newest revision misses
    /// the keys rewritten while it caught up.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_up_to_the_newest_revision_alone_misses_keys() {
        assert!(reads_missing_a_key(true).await > 0);
    }
}
