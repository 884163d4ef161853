//! `weir-bench dedup`: what `handler.dedup` costs per message, or with
//! `--feature park` what `on_failure = "park"` costs when nothing fails
//! (a message that parks on failure runs alone in its job, and each job
//! of them is checked for groups to park), or with `--feature canary` what a
//! canary on half the slots costs (both versions count their outcomes and
//! call durations while it runs; the canary is a copy of the noop component
//! with one more custom section, started in the store before the node
//! starts, which runs it from its first message).
//!
//! A Weir node (in this process) drains a backlog of N noop messages from
//! the real broker, coordinated by the real store, with and without
//! `dedup = { window = "10m" }` on its handler; the runs alternate, and the
//! figures are the medians of their throughputs and of the per-run ratio
//! (dedup on / off, from runs next to each other). `--store postgres` runs
//! RabbitMQ with `cluster.mode = "postgres"` (records in `weir_dedup`, a
//! database per run), `--store nats-kv` NATS with `cluster.mode = "nats-kv"`
//! (records in a bucket beside the coordination bucket, one per run). The
//! node's start (registration, first assignment) is in both walls alike.
//!
//! ```text
//! weir-bench dedup [--feature dedup|park|canary] [--store postgres|nats-kv] [--messages N] [--runs R] [--groups G]
//!                  [--amqp URL] [--nats URL] [--pg URL]
//! ```

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use sqlx::Connection as _;

use weir::config::{self, Config};
use weir::transport::Transport;
use weir::transport::nats::Nats;
use weir::transport::rabbitmq::RabbitMq;

const SLOTS: u32 = 4;
const WINDOW: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Store {
    Postgres,
    NatsKv,
}

/// What is measured, on against off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Feature {
    Dedup,
    Park,
    Canary,
}

struct Opts {
    feature: Feature,
    store: Store,
    messages: u64,
    runs: usize,
    groups: u64,
    amqp: String,
    nats: String,
    pg: String,
}

fn parse(mut args: impl Iterator<Item = String>) -> anyhow::Result<Opts> {
    let mut o = Opts {
        feature: Feature::Dedup,
        store: Store::Postgres,
        messages: 20_000,
        runs: 3,
        groups: 1_000,
        amqp: std::env::var("WEIR_BENCH_AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
        nats: std::env::var("WEIR_BENCH_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into()),
        pg: std::env::var("WEIR_BENCH_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into()),
    };
    let usage = "usage: weir-bench dedup [--feature dedup|park|canary] [--store postgres|nats-kv] [--messages N] [--runs R] [--groups G] \
                 [--amqp URL] [--nats URL] [--pg URL]";
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(|| format!("{a} needs a value\n{usage}"));
        match a.as_str() {
            "--feature" => {
                o.feature = match value()?.as_str() {
                    "dedup" => Feature::Dedup,
                    "park" => Feature::Park,
                    "canary" => Feature::Canary,
                    other => bail!("--feature {other:?}: accepted: dedup, park, canary"),
                }
            }
            "--store" => {
                o.store = match value()?.as_str() {
                    "postgres" => Store::Postgres,
                    "nats-kv" => Store::NatsKv,
                    other => bail!("--store {other:?}: accepted: postgres, nats-kv"),
                }
            }
            "--messages" => o.messages = value()?.parse().context("--messages")?,
            "--runs" => o.runs = value()?.parse::<usize>().context("--runs")?.max(1),
            "--groups" => o.groups = value()?.parse::<u64>().context("--groups")?.max(1),
            "--amqp" => o.amqp = value()?,
            "--nats" => o.nats = value()?,
            "--pg" => o.pg = value()?,
            "-h" | "--help" => {
                println!("{usage}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}\n{usage}"),
        }
    }
    Ok(o)
}

pub fn main(args: impl Iterator<Item = String>) -> anyhow::Result<()> {
    let o = parse(args)?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(run(&o))
}

/// One drain of `o.messages` with dedup on or off; messages per second.
async fn drain(o: &Opts, dedup: bool) -> anyhow::Result<f64> {
    let tag = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let topo = crate::drain_topology();
    let (mut cfg, transport, db): (Config, Arc<dyn Transport>, Option<String>) = match o.store {
        Store::Postgres => {
            let db = format!("weir_bench_{tag}");
            let mut admin = sqlx::PgConnection::connect(&format!("{}/postgres", o.pg))
                .await
                .with_context(|| format!("--pg {}: connecting", o.pg))?;
            sqlx::query(&format!("CREATE DATABASE {db}"))
                .execute(&mut admin)
                .await?;
            let mut cfg = crate::rabbit::weir_config(&o.amqp, &topo, SLOTS, 256, None);
            cfg.cluster = config::Cluster {
                mode: config::ClusterMode::Postgres,
                database_url: Some(format!("{}/{db}", o.pg)),
                ..config::Cluster::default()
            };
            (cfg, Arc::new(RabbitMq::new(&o.amqp, "weir-bench dedup node")), Some(db))
        }
        Store::NatsKv => {
            let mut cfg = crate::natsb::weir_config(&o.nats, &topo, SLOTS, 256);
            cfg.cluster = config::Cluster {
                mode: config::ClusterMode::NatsKv,
                bucket: Some(format!("weir-bench-{tag}")),
                ..config::Cluster::default()
            };
            (cfg, Arc::new(Nats::new(&o.nats, "weir-bench dedup node")), None)
        }
    };
    let result = async {
        match (dedup, o.feature) {
            (false, _) => {}
            (true, Feature::Dedup) => cfg.handler[0].dedup = Some(config::Dedup { window: WINDOW }),
            (true, Feature::Park) => cfg.handler[0].on_failure = config::OnFailure::Park,
            (true, Feature::Canary) => start_canary(&cfg).await?,
        }
        crate::preload_on(transport.as_ref(), &topo, SLOTS, o.messages, o.groups).await?;
        let label = if dedup { "dedup-on" } else { "dedup-off" };
        let wall = crate::drain_with_weir(label, &cfg, transport.clone(), 0, None, o.messages).await?;
        anyhow::Ok(o.messages as f64 / wall.as_secs_f64())
    }
    .await;
    match o.store {
        Store::Postgres => {
            crate::rabbit::cleanup(&o.amqp, &topo, SLOTS).await;
            if let Some(db) = db
                && let Ok(mut admin) = sqlx::PgConnection::connect(&format!("{}/postgres", o.pg)).await
            {
                let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
                    .execute(&mut admin)
                    .await;
            }
        }
        Store::NatsKv => {
            crate::natsb::cleanup(&o.nats, &topo).await;
            if let Ok(client) = async_nats::connect(&o.nats).await {
                let js = async_nats::jetstream::new(client);
                let bucket = format!("weir-bench-{tag}");
                let _ = js.delete_stream(format!("KV_{bucket}")).await;
                for side in weir::node::side_buckets(&bucket) {
                    let _ = js.delete_stream(format!("KV_{side}")).await;
                }
            }
        }
    }
    result
}

/// Start a canary of the config's handler on slots 0 and 1, in the store
/// the config names, before its node starts.
async fn start_canary(cfg: &Config) -> anyhow::Result<()> {
    use weir::registry::shared::Shared;
    let store: Box<dyn Shared> = match cfg.cluster.mode {
        config::ClusterMode::Postgres => Box::new(weir::registry::store::pg::Database(
            weir::cluster::postgres::connect(cfg.cluster.database_url.as_deref().unwrap_or_default()).await?,
        )),
        _ => {
            let client = weir::transport::nats::connect(&cfg.transport.urls(), "weir-bench canary").await?;
            Box::new(
                weir::registry::kv::Buckets::open(&async_nats::jetstream::new(client), cfg.cluster.bucket(), 1).await?,
            )
        }
    };
    // The noop component with a custom section more: another digest, the same code.
    let mut bytes = weir::node::bundled::NOOP.to_vec();
    bytes.extend_from_slice(&[0, 7, 6]);
    bytes.extend_from_slice(b"canary");
    let canary = weir::registry::canary::Canary {
        id: 0,
        digest: weir::registry::digest(&bytes),
        slots: vec![0, 1],
        grants: Default::default(),
        thresholds: Default::default(),
        started_ms: 0,
        node: "weir-bench".into(),
    };
    store.start_canary(&cfg.handler[0].name, &bytes, canary).await?;
    Ok(())
}

async fn run(o: &Opts) -> anyhow::Result<()> {
    let store = match o.store {
        Store::Postgres => "postgres (RabbitMQ)",
        Store::NatsKv => "nats-kv (NATS)",
    };
    let mut off = Vec::new();
    let mut on = Vec::new();
    let mut ratios = Vec::new();
    for r in 0..o.runs {
        let a = drain(o, false).await?;
        eprintln!(
            "[weir-bench dedup] run {}/{}: {store}, off: {a:.0} msg/s",
            r + 1,
            o.runs
        );
        let b = drain(o, true).await?;
        eprintln!(
            "[weir-bench dedup] run {}/{}: {store}, on:  {b:.0} msg/s",
            r + 1,
            o.runs
        );
        off.push(a);
        on.push(b);
        ratios.push(b / a);
    }
    let (off, on, ratio) = (crate::median(&off), crate::median(&on), crate::median(&ratios));
    let added_us = (1.0 / on - 1.0 / off) * 1e6;
    let feature = match o.feature {
        Feature::Dedup => "handler.dedup",
        Feature::Park => "on_failure = \"park\"",
        Feature::Canary => "a canary on half the slots",
    };
    println!(
        "{feature} on {store}: {} messages over {} groups, {SLOTS} slots, median of {} runs",
        o.messages, o.groups, o.runs
    );
    println!("  off              {off:>10.0} msg/s");
    println!("  on               {on:>10.0} msg/s");
    println!("  on / off         {ratio:>10.2} (median of the per-run ratios)");
    println!("  added per message {added_us:>9.1} µs of wall time");
    Ok(())
}
