//! The soak's coordination bucket in `nats-kv` mode: the slot watcher reads
//! it directly (its own connection, not through any node's proxy) the way
//! `weir status` does, and the bucket is deleted at the end.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream;
use parking_lot::Mutex;
use weir::cluster::status::Status;

use crate::slots::{POLL, Row, Slots};

/// Each slot of `topology` in `status`: live when its owner is registered
/// with a lease that has not run out and the slot is not free.
fn rows(status: &Status, topology: &str) -> HashMap<u32, Row> {
    let live: HashMap<&str, bool> = status
        .nodes
        .iter()
        .map(|n| (n.name.as_str(), n.lease_left_s > 0.0))
        .collect();
    status
        .slots
        .iter()
        .filter(|s| s.topology == topology)
        .map(|s| {
            let live_owner = s
                .owner
                .as_deref()
                .filter(|o| live.get(o).copied().unwrap_or(false) && s.state != "free");
            let row = Row {
                owned: live_owner.is_some(),
                releasing: s.state == "releasing",
                owner: live_owner.map(str::to_owned),
            };
            (s.slot, row)
        })
        .collect()
}

/// Read the slots of `topology` from `bucket` every [`POLL`] into `out`
/// until `stop`; a slot without a live owner longer than `threshold` is stuck.
#[allow(clippy::too_many_arguments, reason = "one task's inputs, spelled out")]
pub async fn watch(
    url: String,
    bucket: String,
    lease: Duration,
    topology: String,
    slots: u32,
    threshold: Duration,
    out: Arc<Mutex<Slots>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut kv = None;
    loop {
        if *stop.borrow() {
            return;
        }
        if kv.is_none() {
            kv = weir::cluster::nats_kv::NatsKv::open(std::slice::from_ref(&url), "weir-soak watcher", &bucket, 1)
                .await
                .ok();
        }
        if let Some(store) = kv.as_ref() {
            let read = weir::cluster::nats_kv::status(store, lease);
            match tokio::time::timeout(Duration::from_secs(2), read).await {
                Ok(Ok(status)) => {
                    out.lock()
                        .observe(Instant::now(), slots, &rows(&status, &topology), threshold);
                }
                Ok(Err(_)) | Err(_) => out.lock().read_errors += 1,
            }
        }
        tokio::select! {
            () = tokio::time::sleep(POLL) => {}
            _ = stop.changed() => {}
        }
    }
}

/// Delete bucket `name` (its stream, `KV_<name>`) and the buckets the nodes
/// made beside it.
pub async fn delete(url: &str, name: &str) -> anyhow::Result<()> {
    let client = weir::transport::nats::connect(&[url.to_owned()], "weir-soak cleanup")
        .await
        .with_context(|| format!("connecting to {url} to delete bucket {name}"))?;
    let js = jetstream::new(client.clone());
    for side in weir::node::side_buckets(name) {
        // Absent unless a node made it.
        let _ = js.delete_stream(format!("KV_{side}")).await;
    }
    let stream = format!("KV_{name}");
    js.delete_stream(&stream)
        .await
        .with_context(|| format!("deleting stream {stream}"))?;
    let _ = client.drain().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use weir::cluster::status::{NodeStatus, SlotStatus};

    use super::*;

    fn node(name: &str, left: f64) -> NodeStatus {
        NodeStatus {
            id: uuid::Uuid::new_v4(),
            name: name.into(),
            lease_age_s: 2.0 - left,
            lease_left_s: left,
            leader: false,
        }
    }

    #[test]
    fn a_slot_is_owned_only_by_a_live_node_and_only_when_not_free() {
        let slot =
            |n: u32, owner: Option<&str>, state: &str| SlotStatus::new("t", n, owner.map(str::to_owned), 1, state);
        let status = Status {
            mode: "nats-kv".into(),
            nodes: vec![node("n0", 1.5), node("n1", -0.1)],
            slots: vec![
                slot(0, Some("n0"), "assigned"),
                slot(1, Some("n0"), "releasing"),
                slot(2, Some("n1"), "assigned"),
                slot(3, None, "free"),
                slot(4, Some("n0"), "free"),
                SlotStatus::new("other", 5, Some("n0".into()), 1, "assigned"),
            ],
        };
        let rows = rows(&status, "t");
        let owned = |n: u32| rows.get(&n).map(|r| (r.owned, r.releasing, r.owner.clone()));
        assert_eq!(owned(0), Some((true, false, Some("n0".into()))));
        assert_eq!(owned(1), Some((true, true, Some("n0".into()))));
        assert_eq!(owned(2), Some((false, false, None)), "n1's lease ran out");
        assert_eq!(owned(3), Some((false, false, None)));
        assert_eq!(owned(4), Some((false, false, None)), "a free slot has no owner");
        assert_eq!(owned(5), None, "another topology's slot is not counted");
    }
}
