//! Where a coordinated cluster keeps its slot owners, as the cluster tests
//! read it: a PostgreSQL database of the test ([`super::pg::TestDb`]) or a
//! JetStream KV bucket of the test ([`KvBucket`]). The same test runs
//! against either; `cluster(url)` gives the `[cluster]` lines of a node's
//! config.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream;

/// Slot owners and the leader, read from outside the nodes.
pub trait Registry {
    /// What a node's config names it by: a PostgreSQL URL, or
    /// `nats-kv:<bucket>` ([`cluster`] turns either into `[cluster]` lines).
    fn url(&self) -> String;
    /// Assigned slots whose owner's lease is live, by node name.
    fn slot_owners(&self) -> HashMap<u32, String>;
    /// The node that holds a live leader lease.
    fn leader(&self) -> Option<String>;
}

impl Registry for super::pg::TestDb {
    fn url(&self) -> String {
        super::pg::TestDb::url(self)
    }
    fn slot_owners(&self) -> HashMap<u32, String> {
        super::pg::TestDb::slot_owners(self)
    }
    fn leader(&self) -> Option<String> {
        self.query(
            "SELECT n.name FROM weir_leader l JOIN weir_nodes n ON n.node_id = l.node_id WHERE l.lease_until > now()",
        )
        .into_iter()
        .next()
        .and_then(|r| r[0].clone())
    }
}

/// The `[cluster]` lines (mode and where) for a registry's `url`.
pub fn cluster(url: &str) -> String {
    match url.strip_prefix("nats-kv:") {
        Some(bucket) => format!("mode = \"nats-kv\"\nbucket = \"{bucket}\"\n"),
        None => format!("mode = \"postgres\"\ndatabase_url = \"{url}\"\n"),
    }
}

/// A KV bucket of this test (`weir-t-<uuid8>`), deleted on drop with its
/// `handler.dedup` and parked-groups buckets. The nodes
/// create it; this reads it with Weir's own reader, as `weir status` does.
pub struct KvBucket {
    pub bucket: String,
    /// The servers.
    pub urls: Vec<String>,
    lease: Duration,
    rt: tokio::runtime::Runtime,
}

impl KvBucket {
    /// A bucket name on the test server, for nodes of lease `lease`.
    pub fn new(lease: Duration) -> Self {
        Self::on(vec![super::nats::url()], lease)
    }

    /// A bucket name on the servers at `urls`.
    pub fn on(urls: Vec<String>, lease: Duration) -> Self {
        Self {
            bucket: format!("weir-t-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]),
            urls,
            lease,
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
        }
    }

    /// The cluster as `weir status` shows it; `None` while the bucket is not
    /// there or cannot be read.
    pub fn status(&self) -> Option<weir::cluster::status::Status> {
        self.rt.block_on(async {
            let client = async_nats::ConnectOptions::new()
                .connection_timeout(Duration::from_secs(2))
                .connect(self.urls.as_slice())
                .await
                .ok()?;
            let kv = jetstream::new(client).get_key_value(&self.bucket).await.ok()?;
            weir::cluster::nats_kv::status(&kv, self.lease).await.ok()
        })
    }
}

impl Registry for KvBucket {
    fn url(&self) -> String {
        format!("nats-kv:{}", self.bucket)
    }

    fn slot_owners(&self) -> HashMap<u32, String> {
        let Some(st) = self.status() else {
            return HashMap::new();
        };
        let live: Vec<&str> = st
            .nodes
            .iter()
            .filter(|n| n.lease_left_s > 0.0)
            .map(|n| n.name.as_str())
            .collect();
        st.slots
            .iter()
            .filter(|s| s.state == "assigned")
            .filter_map(|s| Some((s.slot, s.owner.clone().filter(|o| live.contains(&o.as_str()))?)))
            .collect()
    }

    fn leader(&self) -> Option<String> {
        self.status()?.nodes.into_iter().find(|n| n.leader).map(|n| n.name)
    }
}

impl Drop for KvBucket {
    fn drop(&mut self) {
        let (urls, bucket) = (self.urls.clone(), self.bucket.clone());
        super::clean_up_on_a_thread(move || async move {
            if let Ok(c) = async_nats::connect(urls.as_slice()).await {
                let js = jetstream::new(c);
                let _ = js.delete_key_value(&bucket).await;
                // The buckets the nodes made beside it.
                for side in weir::node::side_buckets(&bucket) {
                    let _ = js.delete_stream(format!("KV_{side}")).await;
                }
            }
        });
    }
}
