//! `rabbitmq-drain`: a backlog of N persistent messages on the slot queues of
//! a fresh topology, drained (1) by a bare lapin consumer per slot queue with
//! a no-op native handler that acks with `multiple` every 128 deliveries,
//! (2) by the same consumer calling the noop component inline through a
//! plain wasmtime loop ([`crate::anchor`]) before it counts a delivery, and
//! (3) by a Weir node with the noop guest; same prefetch, same backlog shape,
//! in one run. Each drain gets its own topology, deleted afterwards.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context as _, bail};
use futures::StreamExt as _;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};

use weir::config::{self, Config};
use weir::transport::rabbitmq::{RabbitMq, names};
use weir::transport::{TopologySpec, Transport};

/// Acks of the bare consumer: one `multiple` ack per this many deliveries.
const BARE_ACK_EVERY: u64 = 128;

pub use crate::Drain;

async fn preload(url: &str, topo: &str, slots: u32, n: u64, groups: u64) -> anyhow::Result<()> {
    let t = RabbitMq::new(url, "weir-bench preload");
    crate::preload_on(&t, topo, slots, n, groups).await?;
    t.close().await;
    Ok(())
}

pub(crate) async fn cleanup(url: &str, topo: &str, slots: u32) {
    let rungs = weir::transport::rabbitmq::rungs(&TopologySpec::new(topo, slots));
    let Ok(conn) = Connection::connect(url, ConnectionProperties::default()).await else {
        return;
    };
    if let Ok(ch) = conn.create_channel().await {
        for q in names::queues(topo, slots, &rungs) {
            let _ = ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await;
        }
        for e in names::exchanges(topo, &rungs) {
            let _ = ch.exchange_delete(e.as_str().into(), Default::default()).await;
        }
    }
    let _ = conn.close(200, "bench done".into()).await;
}

/// Messages ready in a queue (passive declare).
async fn depth(ch: &lapin::Channel, queue: &str) -> anyhow::Result<u64> {
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("inspecting {queue}"))?;
    Ok(u64::from(q.message_count()))
}

/// The envelope the anchor hands the guest: Weir's own decode of the
/// delivery's header table (text values only, which is all the bench sends),
/// the body moved in.
fn envelope_of(d: lapin::message::Delivery) -> anyhow::Result<weir::envelope::Envelope> {
    use lapin::types::AMQPValue;
    let pairs = d
        .properties
        .headers()
        .as_ref()
        .into_iter()
        .flat_map(|t| t.inner().iter())
        .filter_map(|(k, v)| match v {
            AMQPValue::LongString(s) => Some((k.as_str(), String::from_utf8_lossy(s.as_bytes()))),
            _ => None,
        });
    let mut env = weir::envelope::decode_pairs(pairs, weir::envelope::fresh_id, None)
        .context("a bench message did not decode")?;
    env.payload = d.data;
    Ok(env)
}

/// The bare consumer: one channel and consumer per slot queue, no-op handler
/// (or, with `wasm`, the noop component called inline on the decoded
/// envelope), `multiple` ack every 128 deliveries and at the end.
pub async fn bare(
    url: &str,
    slots: u32,
    n: u64,
    groups: u64,
    prefetch: u16,
    wasm: Option<&crate::anchor::Anchor>,
) -> anyhow::Result<Drain> {
    let topo = crate::drain_topology();
    preload(url, &topo, slots, n, groups).await?;
    let result = async {
        let conn = Connection::connect(url, ConnectionProperties::default()).await?;
        let probe = conn.create_channel().await?;
        let mut counts = Vec::new();
        for s in 0..slots {
            counts.push(depth(&probe, &names::slot_queue(&topo, s)).await?);
        }
        let t0 = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for (s, count) in counts.into_iter().enumerate() {
            let ch = conn.create_channel().await?;
            ch.basic_qos(prefetch, BasicQosOptions::default()).await?;
            let queue = names::slot_queue(&topo, u32::try_from(s)?);
            let mut consumer = ch
                .basic_consume(
                    queue.as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            let mut caller = wasm.map(crate::anchor::Anchor::caller).transpose()?;
            tasks.spawn(async move {
                let mut got = 0u64;
                while got < count {
                    let d = consumer.next().await.context("consumer ended")??;
                    got += 1;
                    let tag = d.delivery_tag;
                    match &mut caller {
                        Some(c) => c.call(&envelope_of(d)?)?,
                        None => drop(std::hint::black_box(d)),
                    }
                    if got.is_multiple_of(BARE_ACK_EVERY) || got == count {
                        ch.basic_ack(tag, BasicAckOptions { multiple: true }).await?;
                    }
                }
                anyhow::Ok(())
            });
        }
        while let Some(r) = tasks.join_next().await {
            r??;
        }
        let wall = t0.elapsed();
        let _ = conn.close(200, "bench done".into()).await;
        anyhow::Ok(Drain { wall })
    }
    .await;
    cleanup(url, &topo, slots).await;
    result
}

pub(crate) fn weir_config(url: &str, topo: &str, slots: u32, prefetch: u32, batch: Option<u32>) -> Config {
    let mut handler = config::Handler::new("noop", "bundled:noop", topo, vec![crate::MESSAGE_TYPE.into()]);
    if let Some(size) = batch {
        handler.message_types.clear();
        handler.batch = Some(config::Batch {
            message_types: vec![crate::MESSAGE_TYPE.into()],
            size,
            linger: crate::bench_linger(),
        });
    }
    let mut t = config::Topology::new(topo, slots);
    t.max_concurrent_groups = 256;
    Config {
        node: config::Node {
            name: "bench".into(),
            admin: None,
            ..config::Node::default()
        },
        transport: config::Transport {
            kind: config::TransportKind::Rabbitmq,
            url: Some(url.into()),
            prefetch,
            ..Default::default()
        },
        cluster: config::Cluster::default(),
        topology: vec![t],
        handler: vec![handler],
        tenant: Vec::new(),
        telemetry: Default::default(),
        origin: "<weir-bench rabbitmq-drain>".into(),
    }
}

/// Weir with the noop guest on the same backlog; wall time from the node
/// being up until every message was handled.
#[allow(clippy::too_many_arguments)]
pub async fn weir(
    url: &str,
    slots: u32,
    n: u64,
    groups: u64,
    prefetch: u16,
    workers: usize,
    cache: Option<std::path::PathBuf>,
    batch: Option<u32>,
) -> anyhow::Result<Drain> {
    let topo = crate::drain_topology();
    preload(url, &topo, slots, n, groups).await?;
    let result = async {
        let cfg = weir_config(url, &topo, slots, u32::from(prefetch), batch);
        let transport: Arc<dyn Transport> = Arc::new(RabbitMq::new(url, "weir-bench node"));
        let wall = crate::drain_with_weir("rabbitmq-drain", &cfg, transport, workers, cache, n).await?;
        let conn = Connection::connect(url, ConnectionProperties::default()).await?;
        let probe = conn.create_channel().await?;
        let mut left = 0;
        for s in 0..slots {
            left += depth(&probe, &names::slot_queue(&topo, s)).await?;
        }
        let _ = conn.close(200, "bench done".into()).await;
        if left != 0 {
            bail!("rabbitmq-drain: {left} messages still queued after all were handled");
        }
        anyhow::Ok(Drain { wall })
    }
    .await;
    cleanup(url, &topo, slots).await;
    result
}
