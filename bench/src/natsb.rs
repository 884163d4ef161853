//! `nats-drain`: a backlog of N messages preloaded into the file-backed
//! stream of a fresh topology, drained (1) by a bare async-nats pull consumer
//! per slot (batches of 256, one explicit ack per message, no-op native
//! handler), (2) by the same consumer calling the noop component inline
//! through a plain wasmtime loop ([`crate::anchor`]) before each ack, and
//! (3) by a Weir node with the noop guest; same
//! max-ack-pending, same backlog shape, in one run. Each drain gets its own
//! topology, whose streams are deleted afterwards.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context as _, bail};
use async_nats::jetstream::{self, consumer::pull};
use futures::StreamExt as _;

use weir::config::{self, Config};
use weir::transport::Transport;
use weir::transport::nats::{Nats, names};

/// Messages asked for in one pull request by the bare consumer.
const BARE_BATCH: usize = 256;

pub use crate::Drain;

async fn preload(url: &str, topo: &str, slots: u32, n: u64, groups: u64) -> anyhow::Result<()> {
    let t = Nats::new(url, "weir-bench preload");
    crate::preload_on(&t, topo, slots, n, groups).await?;
    Ok(())
}

pub(crate) async fn cleanup(url: &str, topo: &str) {
    let Ok(client) = async_nats::connect(url).await else {
        return;
    };
    let js = jetstream::new(client);
    for s in [names::stream(topo), names::dead_letter_stream(topo)] {
        let _ = js.delete_stream(&s).await;
    }
}

/// The envelope the anchor hands the guest: Weir's own decode of the
/// message's headers, the payload moved in.
fn envelope_of(m: &async_nats::Message) -> anyhow::Result<weir::envelope::Envelope> {
    let pairs = m.headers.iter().flat_map(|h| {
        h.iter().flat_map(|(name, values)| {
            values
                .iter()
                .map(move |v| (AsRef::<str>::as_ref(name), std::borrow::Cow::Borrowed(v.as_str())))
        })
    });
    let mut env = weir::envelope::decode_pairs(pairs, weir::envelope::fresh_id, None)
        .context("a bench message did not decode")?;
    env.payload = Vec::from(m.payload.clone());
    Ok(env)
}

/// The bare consumer: one durable pull consumer per slot (Weir's names and
/// filter, explicit ack), batches of 256, one `+ACK` per message; with
/// `wasm`, the noop component is called on the decoded envelope before it.
pub async fn bare(
    url: &str,
    slots: u32,
    n: u64,
    groups: u64,
    prefetch: u32,
    wasm: Option<&crate::anchor::Anchor>,
) -> anyhow::Result<Drain> {
    let topo = crate::drain_topology();
    preload(url, &topo, slots, n, groups).await?;
    let result = async {
        let js = jetstream::new(async_nats::connect(url).await?);
        let stream = names::stream(&topo);
        let mut consumers = Vec::new();
        for s in 0..slots {
            let c: jetstream::consumer::PullConsumer = js
                .create_consumer_on_stream(
                    pull::Config {
                        durable_name: Some(names::slot_consumer(&topo, s)),
                        filter_subject: names::slot_subject(&topo, s),
                        ack_policy: jetstream::consumer::AckPolicy::Explicit,
                        max_ack_pending: i64::from(prefetch),
                        ..pull::Config::default()
                    },
                    &stream,
                )
                .await?;
            let count = c.cached_info().num_pending;
            consumers.push((c, count));
        }
        let t0 = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for (c, count) in consumers {
            let mut caller = wasm.map(crate::anchor::Anchor::caller).transpose()?;
            tasks.spawn(async move {
                let mut messages = c.stream().max_messages_per_batch(BARE_BATCH).messages().await?;
                let mut got = 0u64;
                while got < count {
                    let m = messages
                        .next()
                        .await
                        .context("consumer ended")?
                        .map_err(|e| anyhow::anyhow!("{e}"))?;
                    got += 1;
                    match &mut caller {
                        Some(c) => c.call(&envelope_of(&m)?)?,
                        None => drop(std::hint::black_box(&m.payload)),
                    }
                    m.ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
                }
                anyhow::Ok(())
            });
        }
        while let Some(r) = tasks.join_next().await {
            r??;
        }
        anyhow::Ok(Drain { wall: t0.elapsed() })
    }
    .await;
    cleanup(url, &topo).await;
    result
}

pub(crate) fn weir_config(url: &str, topo: &str, slots: u32, prefetch: u32) -> Config {
    let handler = config::Handler::new("noop", "bundled:noop", topo, vec![crate::MESSAGE_TYPE.into()]);
    let mut t = config::Topology::new(topo, slots);
    t.max_concurrent_groups = 256;
    Config {
        node: config::Node {
            name: "bench".into(),
            admin: None,
            ..config::Node::default()
        },
        transport: config::Transport {
            kind: config::TransportKind::Nats,
            url: Some(url.into()),
            prefetch,
            ..Default::default()
        },
        cluster: config::Cluster::default(),
        topology: vec![t],
        handler: vec![handler],
        tenant: Vec::new(),
        telemetry: Default::default(),
        origin: "<weir-bench nats-drain>".into(),
    }
}

/// Weir with the noop guest on the same backlog; wall time from the node
/// being up until every message was handled, then every consumer is checked
/// to have nothing pending.
pub async fn weir(
    url: &str,
    slots: u32,
    n: u64,
    groups: u64,
    prefetch: u32,
    workers: usize,
    cache: Option<std::path::PathBuf>,
) -> anyhow::Result<Drain> {
    let topo = crate::drain_topology();
    preload(url, &topo, slots, n, groups).await?;
    let result = async {
        let cfg = weir_config(url, &topo, slots, prefetch);
        let transport: Arc<dyn Transport> = Arc::new(Nats::new(url, "weir-bench node"));
        let wall = crate::drain_with_weir("nats-drain", &cfg, transport, workers, cache, n).await?;
        let js = jetstream::new(async_nats::connect(url).await?);
        let stream = names::stream(&topo);
        for s in 0..slots {
            let info = js
                .get_consumer_from_stream::<pull::Config, _, _>(names::slot_consumer(&topo, s), &stream)
                .await?
                .get_info()
                .await?;
            if info.num_pending != 0 {
                bail!("nats-drain: slot {s} still has {} messages pending", info.num_pending);
            }
        }
        anyhow::Ok(Drain { wall })
    }
    .await;
    cleanup(url, &topo).await;
    result
}
