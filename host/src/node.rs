//! One `weir` node: loads the handlers of a [`Config`], declares the
//! topologies, decides which slots it owns, runs a [`SlotRunner`] per owned
//! slot, and on [`Node::shutdown`] drains every runner before returning.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::{Context as _, bail};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::admin::{self, AdminState};
use crate::cluster::postgres::Member;
use crate::cluster::slots::SlotSet;
use crate::config::{ClusterMode, Config, TransportKind};
use crate::dispatch::{InjectedPanic, Pipeline, RunnerReport, SlotSettings};
use crate::envelope::Envelope;
use crate::ingress::forward_ingress;
use crate::observe::CallObserver;
use crate::observe::stats::Stats;
use crate::outcome::SettleObserver;
use crate::registry::Registry;
use crate::router::Router;
use crate::runtime::pool::WorkerPool;
use crate::runtime::{Runtime, RuntimeOptions};
use crate::transport::memory::MemoryBroker;
use crate::transport::nats::Nats;
use crate::transport::rabbitmq::RabbitMq;
use crate::transport::{TopologySpec, Transport, TransportError};

pub use crate::runtime::bundled;
/// Publish a message through a broker to the slot of its group.
pub use crate::transport::publish_to_slot as publish;

/// Knobs that are not part of the config file (tests, demo, benchmarks).
#[derive(Clone, Default)]
pub struct NodeOptions {
    /// Wasm worker threads (0 = one per core).
    pub workers: usize,
    /// Engine options.
    pub runtime: RuntimeOptions,
    /// Watches every guest call.
    pub call_observer: Option<Arc<dyn CallObserver>>,
    /// Told every settlement.
    pub settle_observer: Option<Arc<dyn SettleObserver>>,
    /// Messages of one lane per worker job (0 = default 32).
    pub max_run: usize,
    /// Negative control for tests: ignore groups. Never in production.
    #[doc(hidden)]
    pub bypass_lanes: bool,
    /// Negative control for tests: batches run outside their group's lane.
    #[doc(hidden)]
    pub bypass_batch_lanes: bool,
    /// Fault injection for tests: the job holding the first message of this
    /// type panics, once. Never in production.
    #[doc(hidden)]
    pub inject_panic_on: Option<String>,
}

/// A running node.
pub struct Node {
    pipeline: Arc<Pipeline>,
    stop: watch::Sender<bool>,
    /// The slots this node runs now.
    slots: Arc<SlotSet>,
    /// The coordinator loop (`postgres` mode): it drains the slots and
    /// leaves the cluster when `stop` turns true.
    coordinator: Option<JoinHandle<anyhow::Result<()>>>,
    /// The admin listener, when configured; stops with `stop`.
    admin: Option<JoinHandle<()>>,
    /// `GET /ready`.
    ready: Arc<AtomicBool>,
    /// Ingress forwarders, one per topology (not part of the slot reports).
    forwarders: JoinSet<anyhow::Result<RunnerReport>>,
    topologies: HashMap<String, u32>,
    /// Handler versions: deploys, rollbacks, the cluster's and the watched directory's.
    registry: Arc<Registry>,
    /// Following the cluster's deploys, watching the components directory.
    followers: Vec<JoinHandle<()>>,
}

/// Threads for the async side (broker I/O, lanes, settlement). The Wasm
/// workers take one thread per core; the async side needs far less, and on a
/// 2-core machine one thread beat two by 20 % end to end (BENCHMARKS.md).
pub fn async_threads() -> usize {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
    (cores / 2).max(1)
}

/// The async runtime `weir` runs on (see [`async_threads`]).
pub fn async_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(async_threads())
        .enable_all()
        .build()
}

/// Build the transport a config asks for.
pub fn transport_for(config: &Config) -> anyhow::Result<Arc<dyn Transport>> {
    match config.transport.kind {
        TransportKind::Memory => Ok(Arc::new(MemoryBroker::new())),
        TransportKind::Rabbitmq => {
            let url = config.transport.url.as_deref().filter(|u| !u.is_empty()).with_context(|| {
                format!(
                    "{}: transport.url is required for transport.kind = \"rabbitmq\", e.g. \"amqp://guest:guest@127.0.0.1:5672/%2f\"",
                    config.origin
                )
            })?;
            Ok(Arc::new(RabbitMq::new(url, format!("weir {}", config.node.name))))
        }
        TransportKind::Nats => {
            let url = config
                .transport
                .url
                .as_deref()
                .filter(|u| !u.is_empty())
                .with_context(|| {
                    format!(
                        "{}: transport.url is required for transport.kind = \"nats\", e.g. \"nats://127.0.0.1:4222\"",
                        config.origin
                    )
                })?;
            Ok(Arc::new(Nats::new(url, format!("weir {}", config.node.name))))
        }
    }
}

/// Check topology `index`'s retry schedule against what the broker reports
/// (stream retention, consumer `AckWait`): errors refuse the start, warnings
/// are logged. Brokers without such facts are not asked twice: the config's
/// own validation already checked the schedule without them.
async fn check_schedule_with_broker(config: &Config, index: usize, transport: &dyn Transport) -> anyhow::Result<()> {
    let t = &config.topology[index];
    let Some(facts) = transport.retry_facts(&t.name).await.with_context(|| {
        format!(
            "reading the retry facts of topology[{index}] `{}` on {}",
            t.name,
            transport.system()
        )
    })?
    else {
        return Ok(());
    };
    let ctx = crate::retry::schedule::CheckContext {
        key: Config::retry_key(index),
        stream_max_age: facts.stream_max_age,
    };
    let report = t.schedule(config.transport.kind, facts.ack_wait).check(&ctx);
    for w in &report.warnings {
        tracing::warn!(key = %w.key, topology = %t.name, "{}", w.message);
    }
    if !report.is_ok() {
        let errors: Vec<String> = report.errors.iter().map(ToString::to_string).collect();
        bail!(
            "{}: the retry schedule of topology[{index}] `{}` does not fit the broker: {}",
            config.origin,
            t.name,
            errors.join("; ")
        );
    }
    Ok(())
}

impl Node {
    /// Load handlers, declare topologies, and start consuming the owned slots.
    pub async fn start(config: &Config, transport: Arc<dyn Transport>, opts: NodeOptions) -> anyhow::Result<Self> {
        let mut rt_opts = opts.runtime.clone();
        let largest = config
            .handler
            .iter()
            .map(|h| h.limits.memory.bytes())
            .max()
            .unwrap_or(0);
        rt_opts.max_memory = rt_opts.max_memory.max(usize::try_from(largest).unwrap_or(usize::MAX));
        // The Wasm stack limit is engine-wide: the largest any handler asks for.
        if let Some(stack) = config
            .handler
            .iter()
            .filter_map(|h| h.limits.max_stack)
            .map(|b| b.bytes())
            .max()
        {
            rt_opts.max_wasm_stack = usize::try_from(stack).unwrap_or(usize::MAX);
        }
        // Fuel metering costs every call a little: on only when asked for.
        rt_opts.fuel |= config.handler.iter().any(|h| h.limits.fuel.is_some())
            || config.tenant.iter().any(|t| t.limits.fuel.is_some());
        if rt_opts.cache_dir.is_none() {
            rt_opts.cache_dir = config.node.data_dir.as_ref().map(|d| d.join("cache"));
        }
        rt_opts.budgets = config.node.budgets.to_runtime();
        rt_opts.pool_instances = match config.node.instance_pool {
            Some(n) => n,
            None => rt_opts
                .pool_instances
                .max(crate::runtime::pool_size_for(opts.workers, config.handler.len())),
        };
        let runtime = match opts.call_observer.clone() {
            Some(o) => Runtime::with_observer(rt_opts, o)?,
            None => Runtime::new(rt_opts)?,
        };

        let mut router = Router::new();
        for (i, h) in config.handler.iter().enumerate() {
            let types = h
                .message_types
                .iter()
                .chain(h.batch.iter().flat_map(|b| b.message_types.iter()));
            for t in types {
                if let Some(prev) = router.bind(&h.topology, h.tenant.as_deref(), t, &h.name)
                    && prev != h.name
                {
                    bail!("handler[{i}].message_types: `{t}` is already bound to handler `{prev}`");
                }
            }
            if let Some(b) = &h.batch {
                let rule = crate::router::BatchRule {
                    handler: Arc::from(h.name.as_str()),
                    size: b.size as usize,
                    linger: b.linger,
                };
                router.batch(&h.topology, h.tenant.as_deref(), &b.message_types, rule);
            }
        }
        let router = Arc::new(router);
        let postgres = config.cluster.mode == ClusterMode::Postgres;
        let database = if postgres {
            let url = config.cluster.database_url.as_deref().unwrap_or_default();
            Some(
                crate::cluster::postgres::connect(url)
                    .await
                    .with_context(|| format!("{}: cluster.mode = \"postgres\"", config.origin))?,
            )
        } else {
            None
        };
        let registry = Registry::start(config, runtime.clone(), router.clone(), database.clone()).await?;

        let pool = Arc::new(WorkerPool::new(runtime, opts.workers)?);
        let pipeline = Arc::new(Pipeline {
            transport: transport.clone(),
            pool,
            router,
            stats: Arc::new(Stats::default()),
            observer: opts.settle_observer.clone(),
        });

        let (stop, stop_rx) = watch::channel(false);
        let mut forwarders = JoinSet::new();
        let mut topologies = HashMap::new();
        let mut templates = HashMap::new();
        let inject_panic = opts.inject_panic_on.as_ref().map(|t| {
            Arc::new(InjectedPanic {
                message_type: t.clone(),
                ..Default::default()
            })
        });
        let mut owned = Vec::new();
        let mut all_slots = Vec::new();
        for (ti, t) in config.topology.iter().enumerate() {
            check_schedule_with_broker(config, ti, transport.as_ref()).await?;
            transport
                .declare(&TopologySpec {
                    name: t.name.clone(),
                    slots: t.slots,
                    retry: t.retry_policy(config.transport.kind),
                })
                .await
                .with_context(|| format!("declaring topology[{ti}] `{}` on {}", t.name, transport.system()))?;
            topologies.insert(t.name.clone(), t.slots);
            let slots: Vec<u32> = match config.cluster.mode {
                ClusterMode::Solo => (0..t.slots).collect(),
                ClusterMode::Static => config
                    .cluster
                    .owned_slots
                    .iter()
                    .flatten()
                    .copied()
                    .filter(|s| *s < t.slots)
                    .collect(),
                // Every node subscribes to every slot; each slot queue has a
                // single active consumer, so the broker picks one node per
                // slot and activates another when that one goes away.
                ClusterMode::RabbitmqSac => (0..t.slots).collect(),
                // The coordinator starts slots as it is assigned them.
                ClusterMode::Postgres => Vec::new(),
            };
            let schedule = t.schedule(config.transport.kind, None);
            templates.insert(
                t.name.clone(),
                SlotSettings {
                    topology: Arc::from(t.name.as_str()),
                    slot: 0,
                    counters: Arc::default(),
                    slots: t.slots,
                    max_concurrent_groups: t.max_concurrent_groups as usize,
                    max_unordered: t.max_unordered as usize,
                    prefetch: config.transport.prefetch,
                    max_run: if opts.max_run == 0 { 32 } else { opts.max_run },
                    schedule,
                    bypass_lanes: opts.bypass_lanes,
                    bypass_batch_lanes: opts.bypass_batch_lanes,
                    inject_panic: inject_panic.clone(),
                },
            );
            owned.extend(slots.into_iter().map(|slot| (t.name.clone(), slot)));
            all_slots.extend((0..t.slots).map(|slot| (t.name.clone(), slot)));
            // Every node forwards the ingress, in order: the RabbitMQ queue
            // has a single active consumer, and the JetStream consumer hands
            // out one unacknowledged message at a time (transport::nats,
            // "Ingress"), so forwarders on several nodes never reorder it.
            forwarders.spawn(forward_ingress(
                pipeline.clone(),
                Arc::from(t.name.as_str()),
                t.slots,
                config.transport.prefetch,
                stop_rx.clone(),
            ));
        }
        let slots = Arc::new(SlotSet::new(pipeline.clone(), templates));
        for key in &owned {
            slots.start(key);
        }
        let ready = Arc::new(AtomicBool::new(!postgres));
        let coordinator = if let Some(p) = database.clone() {
            let c = Member::new(
                p,
                &config.node.name,
                config.cluster.lease,
                config.cluster.drain_deadline(),
                all_slots,
                slots.clone(),
                ready.clone(),
            );
            Some(tokio::spawn(crate::cluster::postgres::run::run(c, stop_rx.clone())))
        } else {
            None
        };
        let admin = match config.node.admin {
            Some(addr) => {
                let state = Arc::new(AdminState {
                    node: config.node.name.clone(),
                    stats: pipeline.stats.clone(),
                    slots: slots.clone(),
                    transport: transport.clone(),
                    coordinator: database.clone(),
                    ready: ready.clone(),
                    registry: registry.clone(),
                    auth: admin::Auth::from_config(config),
                    limits: admin::Limits::from_config(config),
                });
                Some(admin::serve(addr, state, stop_rx.clone()).await?)
            }
            None => None,
        };
        let mut followers: Vec<JoinHandle<()>> = registry.follow(stop_rx.clone()).into_iter().collect();
        if let Some(dir) = &config.node.components_dir {
            followers.push(registry.watch(dir.clone(), stop_rx.clone()));
        }
        tracing::info!(node = %config.node.name, slots = owned.len(), mode = ?config.cluster.mode, transport = transport.system(), "node started");
        Ok(Self {
            pipeline,
            stop,
            slots,
            coordinator,
            admin,
            ready,
            forwarders,
            topologies,
            registry,
            followers,
        })
    }

    /// Handler versions: deploy, roll back, list.
    pub fn registry(&self) -> Arc<Registry> {
        self.registry.clone()
    }

    /// Long calls whose worker was demoted and replaced (fair share).
    pub fn demoted_calls(&self) -> u64 {
        self.pipeline.pool.demoted()
    }

    /// Outcome counters.
    pub fn stats(&self) -> Arc<Stats> {
        self.pipeline.stats.clone()
    }

    /// The ack floor of every slot consumer this node watches (JetStream;
    /// empty on other brokers). Observe only.
    pub fn ack_floor(&self) -> Vec<crate::transport::nats::floor::FloorState> {
        self.pipeline.transport.ack_floor()
    }

    /// The (topology, slot) pairs this node consumes now.
    pub fn owned_slots(&self) -> Vec<(String, u32)> {
        self.slots.running()
    }

    /// Publish a message through the broker to the slot of its group.
    pub async fn publish(&self, topology: &str, env: &Envelope) -> Result<(), TransportError> {
        let slots = self.topologies.get(topology).copied().unwrap_or(1);
        publish(self.pipeline.transport.as_ref(), topology, slots, env).await
    }

    /// Stop taking messages, return unstarted ones, wait for every call in
    /// flight, and stop consuming. Returns what each runner did.
    pub async fn shutdown(mut self) -> anyhow::Result<Vec<RunnerReport>> {
        self.ready.store(false, std::sync::atomic::Ordering::Relaxed);
        let _ = self.stop.send(true);
        // The coordinator drains its slots before it gives them up (it
        // interrupts what still runs at `cluster.drain_deadline`, and gives
        // up on a drain a lease later: then the slots are not waited for).
        let mut gave_up = false;
        if let Some(c) = self.coordinator.take() {
            match c.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    gave_up = true;
                    tracing::error!(error = %format!("{e:#}"), "the coordinator stopped with an error");
                }
                Err(e) => tracing::error!(error = %e, "the coordinator panicked"),
            }
        }
        let reports = if gave_up {
            Vec::new()
        } else {
            self.slots.drain_all().await
        };
        for f in self.followers.drain(..) {
            let _ = f.await;
        }
        if let Some(a) = self.admin.take() {
            let _ = a.await;
        }
        while let Some(r) = self.forwarders.join_next().await {
            let report = r.context("an ingress forwarder panicked")??;
            tracing::debug!(
                forwarded = report.received,
                released = report.released,
                "ingress forwarder stopped"
            );
        }
        // Acks published without an answer must have left before the exit.
        self.pipeline.transport.close().await;
        Ok(reports)
    }
}
