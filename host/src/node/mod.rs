//! The composition root: one `weir` node, wired from a [`Config`]. It starts
//! the engine, binds the handlers, declares the topologies (so a broker that
//! is down is said before any compile), loads the handlers' versions,
//! forwards their ingress, lets the [`Coordinator`] of its
//! cluster mode decide which slots it runs, serves the admin listener, and
//! on [`Node::shutdown`] drains every slot before returning. It owns no
//! logic of its own beyond that order; no other module imports it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::{Context as _, bail};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::admin::{self, AdminState};
use crate::cluster::slots::{SlotKey, SlotSet};
use crate::cluster::{self, Coordinator, Start};
use crate::config::Config;
use crate::dispatch::{InjectedPanic, Pipeline, RunnerReport, TopologySettings};
use crate::envelope::Envelope;
use crate::ingress::forward_ingress;
use crate::observe::CallObserver;
use crate::observe::stats::Stats;
use crate::outcome::SettleObserver;
use crate::registry::Registry;
use crate::router::Router;
use crate::runtime::pool::WorkerPool;
use crate::runtime::{Runtime, RuntimeOptions};
use crate::transport::{TopologySpec, Transport, TransportError};

mod shared;

pub use shared::side_buckets;
use shared::{connect_database, open_bucket, open_dedup, open_parked, open_versions};

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
    /// Negative control for tests: every `weir-*` header of every delivery
    /// is believed, sealed or not (as before `weir::seal`). Never in production.
    #[doc(hidden)]
    pub negative_control_trust_weir_headers: bool,
    /// Fault injection for tests: the job holding the first message of this
    /// type panics, once. Never in production.
    #[doc(hidden)]
    pub inject_panic_on: Option<String>,
    /// Negative controls for tests: admin fixes switched off. Never in production.
    #[doc(hidden)]
    pub admin_controls: crate::admin::NegativeControls,
    /// Negative control for tests: the slot bound of parked groups' held
    /// messages, taken as is instead of `topology.park_hold_slot` (which is
    /// refused at or above `transport.prefetch`). Set to the prefetch, held
    /// messages may fill the slot's window: issue 32's wedged slot. Never in
    /// production.
    #[doc(hidden)]
    pub park_hold_slot_unchecked: Option<usize>,
}

/// A handle on a node that is leaving ([`Node::draining`]): the calls it
/// still waits for, and a way to stop waiting.
#[derive(Clone)]
pub struct Draining {
    slots: Arc<SlotSet>,
    registry: Arc<Registry>,
}

impl Draining {
    /// Calls running now, by handler (`handler@tenant` for a tenant's), busiest first.
    pub fn in_flight(&self) -> Vec<(String, i64)> {
        let mut calls: Vec<(String, i64)> = self
            .registry
            .metrics()
            .into_iter()
            .map(|(name, tenant, m)| {
                let name = match tenant {
                    Some(t) => format!("{name}@{t}"),
                    None => name.to_owned(),
                };
                (name, m.in_flight())
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        calls.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        calls
    }

    /// Interrupt the calls still running: they are released to the broker
    /// unfinished (as a fence does), so the drain ends now.
    pub fn interrupt(&self) {
        self.slots.interrupt_all();
    }
}

/// A running node.
pub struct Node {
    pipeline: Arc<Pipeline>,
    stop: watch::Sender<bool>,
    /// The slots this node runs now.
    slots: Arc<SlotSet>,
    /// The coordinator's loop, if its mode has one (`postgres`): it drains
    /// the slots and leaves the cluster when `stop` turns true.
    coordinator: Option<JoinHandle<anyhow::Result<()>>>,
    /// The admin and metrics listeners, those configured; they stop with `stop`.
    admin: Vec<JoinHandle<()>>,
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

/// The engine options a config asks for: memory and stack of its largest
/// handler, fuel only when a limit asks for it, the cache under the data
/// directory, the call budgets and the instance pool.
fn runtime_options(config: &Config, opts: &NodeOptions) -> RuntimeOptions {
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
    rt_opts.fuel |=
        config.handler.iter().any(|h| h.limits.fuel.is_some()) || config.tenant.iter().any(|t| t.limits.fuel.is_some());
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
    rt_opts
}

/// Start the engine.
fn start_runtime(config: &Config, opts: &NodeOptions) -> anyhow::Result<Arc<Runtime>> {
    let rt_opts = runtime_options(config, opts);
    Ok(match opts.call_observer.clone() {
        Some(o) => Runtime::with_observer(rt_opts, o)?,
        None => Runtime::new(rt_opts)?,
    })
}

/// Check every topology's retry schedule against the broker and declare it;
/// the slot count of each, by name.
async fn declare_topologies(config: &Config, transport: &dyn Transport) -> anyhow::Result<HashMap<String, u32>> {
    declare_each(config, transport)
        .await
        .map_err(|e| crate::transport::connect::unreachable(config, transport.system(), e))
}

async fn declare_each(config: &Config, transport: &dyn Transport) -> anyhow::Result<HashMap<String, u32>> {
    let mut topologies = HashMap::new();
    for (ti, t) in config.topology.iter().enumerate() {
        check_schedule_with_broker(config, ti, transport).await?;
        let policy = t.retry_policy(config.transport.kind);
        let schedule = t.schedule(config.transport.kind, None);
        if let (Some(max), Some(tries)) = (policy.max_deliveries(), schedule.handler_deliveries())
            && tries < max
        {
            // The same max_deliver gives the handler fewer tries here than on
            // RabbitMQ: say so once, at start, instead of leaving it to surprise.
            tracing::info!(
                topology = %t.name,
                max_deliver = max,
                handler_attempts = tries,
                "retry.max_deliver = {max} gives the handler {tries} attempt(s) on {}: the last {} deliver(ies) \
                 are kept in reserve to retry a dead-letter capture that failed (weir schedule check shows each)",
                transport.system(),
                max - tries
            );
        }
        transport
            .declare(&TopologySpec {
                name: t.name.clone(),
                slots: t.slots,
                retry: t.retry_policy(config.transport.kind),
            })
            .await
            .with_context(|| format!("declaring topology[{ti}] `{}` on {}", t.name, transport.system()))?;
        topologies.insert(t.name.clone(), t.slots);
    }
    Ok(topologies)
}

/// How the slots of each topology run.
fn topology_settings(config: &Config, opts: &NodeOptions) -> HashMap<String, TopologySettings> {
    let inject_panic = opts.inject_panic_on.as_ref().map(|t| {
        Arc::new(InjectedPanic {
            message_type: t.clone(),
            ..Default::default()
        })
    });
    config
        .topology
        .iter()
        .map(|t| {
            let settings = TopologySettings {
                topology: Arc::from(t.name.as_str()),
                slots: t.slots,
                max_concurrent_groups: t.max_concurrent_groups as usize,
                max_unordered: t.max_unordered as usize,
                prefetch: config.transport.prefetch,
                park_hold: t.park_hold(config.transport.prefetch),
                park_hold_slot: opts
                    .park_hold_slot_unchecked
                    .inspect(|n| {
                        tracing::error!(
                            topology = %t.name,
                            "the slot bound of parked groups is {n}, unchecked (a test's negative control; never in production)"
                        );
                    })
                    .unwrap_or_else(|| t.park_hold_slot(config.transport.prefetch)),
                max_run: if opts.max_run == 0 { 32 } else { opts.max_run },
                schedule: t.schedule(config.transport.kind, None),
                bypass_lanes: opts.bypass_lanes,
                bypass_batch_lanes: opts.bypass_batch_lanes,
                inject_panic: inject_panic.clone(),
            };
            (t.name.clone(), settings)
        })
        .collect()
}

/// Forward every topology's ingress to its slot queues, one forwarder each.
fn forward_ingresses(
    config: &Config,
    pipeline: &Arc<Pipeline>,
    stop: &watch::Receiver<bool>,
) -> JoinSet<anyhow::Result<RunnerReport>> {
    let mut forwarders = JoinSet::new();
    for t in &config.topology {
        forwarders.spawn(forward_ingress(
            pipeline.clone(),
            Arc::from(t.name.as_str()),
            t.slots,
            config.transport.prefetch,
            stop.clone(),
        ));
    }
    forwarders
}

/// Start the slots the coordinator gives this node from the start; their number.
fn start_initial_slots(config: &Config, coordinator: &dyn Coordinator, slots: &SlotSet) -> usize {
    let mut started = 0;
    for t in &config.topology {
        for slot in coordinator.initial_slots(t.slots) {
            slots.start(&(t.name.clone(), slot));
            started += 1;
        }
    }
    started
}

/// Every (topology, slot) of the config, in order.
fn all_slots(config: &Config) -> Vec<SlotKey> {
    config
        .topology
        .iter()
        .flat_map(|t| (0..t.slots).map(|slot| (t.name.clone(), slot)))
        .collect()
}

/// Follow the cluster's deploys, and watch the components directory.
fn follow_registry(config: &Config, registry: &Arc<Registry>, stop: &watch::Receiver<bool>) -> Vec<JoinHandle<()>> {
    let mut followers: Vec<JoinHandle<()>> = registry.follow(stop.clone()).into_iter().collect();
    followers.push(registry.guard(stop.clone()));
    if let Some(dir) = &config.node.components_dir {
        followers.push(registry.watch(dir.clone(), stop.clone()));
    }
    followers
}

impl Node {
    /// Declare topologies, load handlers, and start consuming the owned slots.
    pub async fn start(config: &Config, transport: Arc<dyn Transport>, opts: NodeOptions) -> anyhow::Result<Self> {
        let runtime = start_runtime(config, &opts)?;
        let router = Arc::new(Router::from_config(config)?);
        let database = connect_database(config).await?;
        // The broker before the handlers: a broker that is down is said at once, not after
        // seconds of compiling (a Python or JavaScript handler's first compile).
        let topologies = declare_topologies(config, transport.as_ref()).await?;
        let versions = open_versions(config, database.as_ref()).await?;
        let registry = Registry::start(config, runtime.clone(), router.clone(), versions).await?;
        let bucket = open_bucket(config).await?;
        let mut seal = crate::seal::key::load(config, database.as_ref()).await?;
        if opts.negative_control_trust_weir_headers {
            tracing::error!(
                "every weir-* header of every delivery is believed (a test's negative control; never in production)"
            );
            seal = seal.negative_control_trusting_everything();
        }
        if crate::seal::key::shared(config) || config.transport.kind == crate::config::TransportKind::Memory {
            tracing::debug!(key = seal.origin(), "weir-* headers sealed");
        } else {
            tracing::info!(
                "weir-* headers are sealed with a key of this process: a retry or redrive in flight when it restarts \
                 loses its attempt count and pin (set node.data_dir to keep the key)"
            );
        }
        let pipeline = Arc::new(Pipeline {
            transport: transport.clone(),
            pool: Arc::new(WorkerPool::new(runtime, opts.workers)?),
            router,
            stats: Arc::new(Stats::default()),
            observer: opts.settle_observer.clone(),
            dedup: open_dedup(config).await?,
            parked: open_parked(config, database.as_ref()).await?,
            orders: Default::default(),
            seal,
        });
        let coordinator = cluster::coordinator(config, database, bucket)?;
        let (stop, stop_rx) = watch::channel(false);
        let forwarders = forward_ingresses(config, &pipeline, &stop_rx);
        let slots = Arc::new(SlotSet::new(pipeline.clone(), topology_settings(config, &opts)));
        let started = start_initial_slots(config, coordinator.as_ref(), &slots);
        let ready = Arc::new(AtomicBool::new(coordinator.ready_at_start()));
        let coordinating = coordinator.start(Start {
            slots: slots.clone(),
            all: all_slots(config),
            ready: ready.clone(),
            stop: stop_rx.clone(),
        });
        // What the admin listener and the metrics listener read.
        let state = (config.node.admin.is_some() || config.node.metrics.is_some()).then(|| {
            Arc::new(AdminState {
                node: config.node.name.clone(),
                stats: pipeline.stats.clone(),
                slots: slots.clone(),
                transport: transport.clone(),
                coordinator,
                ready: ready.clone(),
                registry: registry.clone(),
                auth: admin::Auth::from_config(config),
                limits: admin::Limits::from_config(config),
                topologies: topologies.clone(),
                mode: config.cluster.mode.as_str(),
                seal: pipeline.seal.clone(),
                controls: opts.admin_controls,
            })
        });
        let mut admin = Vec::new();
        if let (Some(addr), Some(state)) = (config.node.admin, &state) {
            admin.push(admin::serve(addr, state.clone(), stop_rx.clone()).await?);
        }
        if let (Some(addr), Some(state)) = (config.node.metrics, &state) {
            admin.push(admin::serve_metrics(addr, state.clone(), stop_rx.clone()).await?);
        }
        let followers = follow_registry(config, &registry, &stop_rx);
        tracing::info!(node = %config.node.name, slots = started, mode = config.cluster.mode.as_str(), transport = transport.system(), "node started");
        Ok(Self {
            pipeline,
            stop,
            slots,
            coordinator: coordinating,
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

    /// What `weir run` watches while this node drains.
    pub fn draining(&self) -> Draining {
        Draining {
            slots: self.slots.clone(),
            registry: self.registry.clone(),
        }
    }

    /// Stop taking messages, return unstarted ones, wait for every call in
    /// flight, and stop consuming. Returns what each runner did.
    pub async fn shutdown(mut self) -> anyhow::Result<Vec<RunnerReport>> {
        self.ready.store(false, std::sync::atomic::Ordering::Relaxed);
        // The coordinator's leave drains the slots before this does: keep
        // every slot's report, whoever drains it, for the summary.
        self.slots.leave();
        let _ = self.stop.send(true);
        // A coordinator loop drains its slots before it gives them up (it
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
        if !gave_up {
            self.slots.drain_all().await;
        }
        let reports = self.slots.left();
        for f in self.followers.drain(..) {
            let _ = f.await;
        }
        for a in self.admin.drain(..) {
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
