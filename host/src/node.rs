//! One `weir` node: loads the handlers of a [`Config`], declares the
//! topologies, decides which slots it owns, runs a [`SlotRunner`] per owned
//! slot, and on [`Node::shutdown`] drains every runner before returning.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use futures::FutureExt as _;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::admin::{self, AdminState};
use crate::cluster::postgres::Coordinator;
use crate::cluster::slots::{CancelCell, SlotSet};
use crate::config::{ClusterMode, Config, TransportKind};
use crate::envelope::{self, Envelope};
use crate::lanes::{Pipeline, RunnerReport, SettleObserver, SlotRunner, SlotSettings};
use crate::partition;
use crate::registry::Registry;
use crate::retry::capture::Outcome;
use crate::router::Router;
use crate::runtime::pool::WorkerPool;
use crate::runtime::{CallObserver, Runtime, RuntimeOptions};
use crate::stats::Stats;
use crate::transport::memory::MemoryBroker;
use crate::transport::nats::Nats;
use crate::transport::rabbitmq::RabbitMq;
use crate::transport::{Delivery, Disposition, Subscription, TopologySpec, Transport, TransportError};

/// Components shipped inside the `weir` binary, addressable in a config as
/// `component = "bundled:NAME"`.
pub mod bundled {
    mod paths {
        #![allow(dead_code)]
        include!(concat!(env!("OUT_DIR"), "/guests.rs"));
    }
    /// The example orders handler.
    pub const ORDERS: &[u8] = paths::ORDERS_BYTES;
    /// The no-op handler (benchmarks).
    pub const NOOP: &[u8] = paths::NOOP_BYTES;
    /// Path of the test guest with faults on demand (tests only).
    pub const FAULTY_PATH: &str = paths::FAULTY;

    /// A bundled component by name.
    pub fn get(name: &str) -> Option<&'static [u8]> {
        match name {
            "orders" => Some(ORDERS),
            "noop" => Some(NOOP),
            _ => None,
        }
    }
}

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
            Arc::new(crate::lanes::InjectedPanic {
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
            let c = Coordinator::new(
                p,
                &config.node.name,
                config.cluster.lease,
                config.cluster.drain_deadline(),
                all_slots,
                slots.clone(),
                ready.clone(),
            );
            Some(tokio::spawn(crate::cluster::postgres::run(c, stop_rx.clone())))
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
    pub fn ack_floor(&self) -> Vec<crate::floor::FloorState> {
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

/// Publish `env` through `transport` to the slot of its group (or of its id
/// when it has none), waiting for the broker's confirm.
pub async fn publish(
    transport: &dyn Transport,
    topology: &str,
    slots: u32,
    env: &Envelope,
) -> Result<(), TransportError> {
    let slot = partition::slot_for(env.group(), &env.id, slots);
    transport.publish(topology, slot, envelope::encode(env)).await
}

/// True once the node is stopping (stop sent, or its sender gone).
fn stopping(stop: &watch::Receiver<bool>) -> bool {
    *stop.borrow() || stop.has_changed().is_err()
}

/// Sleep `delay`, or less if the node stops; true when it stopped.
async fn pause(stop: &mut watch::Receiver<bool>, delay: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(delay) => stopping(stop),
        changed = stop.changed() => changed.is_err() || *stop.borrow(),
    }
}

const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// A slot marked failing counts as healthy again after its restarted runner
/// ran this long without failing.
const HEALTHY_AFTER: Duration = Duration::from_secs(10);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

fn merge(total: &mut RunnerReport, r: RunnerReport) {
    total.received += r.received;
    total.released += r.released;
    total.drained.extend(r.drained);
}

/// Run a slot until the node stops. A runner whose subscription ends without
/// a stop (connection lost, consumer cancelled) has drained already; it is
/// started again after a backoff, which reconnects and re-declares.
pub(crate) async fn supervise_slot(
    p: Arc<Pipeline>,
    settings: SlotSettings,
    mut stop: watch::Receiver<bool>,
    cancel: CancelCell,
) -> anyhow::Result<RunnerReport> {
    let mut total = RunnerReport::default();
    let mut backoff = BACKOFF_MIN;
    let system = p.transport.system();
    loop {
        let started = Instant::now();
        let runner = SlotRunner::new(p.clone(), settings.clone());
        let interrupt = runner.cancel_handle();
        *cancel.lock() = interrupt.clone();
        let run = std::panic::AssertUnwindSafe(runner.run(stop.clone())).catch_unwind();
        tokio::pin!(run);
        // A slot marked failing is healthy again once its new runner has
        // run this long without failing.
        let mut healthy_at = p
            .stats
            .failing()
            .iter()
            .any(|((t, s), _)| **t == *settings.topology && *s == settings.slot)
            .then(|| tokio::time::Instant::now() + HEALTHY_AFTER);
        let result = loop {
            tokio::select! {
                r = &mut run => break r,
                () = tokio::time::sleep_until(healthy_at.unwrap_or_else(tokio::time::Instant::now)), if healthy_at.is_some() => {
                    healthy_at = None;
                    p.stats.clear_failing(&settings.topology, settings.slot);
                    tracing::info!(messaging.system = system, topology = %settings.topology, slot = settings.slot, "slot runner healthy again");
                }
            }
        };
        let result = match result {
            Ok(r) => r,
            Err(panic) => {
                // The runner itself panicked (not one of its jobs, which it
                // catches): interrupt whatever it had handed to a worker, so
                // nothing of it runs beside the redelivery.
                interrupt.store(true, std::sync::atomic::Ordering::Relaxed);
                let text = crate::lanes::panic_text(panic.as_ref());
                p.stats.runner_panics.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                p.stats.mark_failing(&settings.topology, settings.slot, &text);
                tracing::error!(messaging.system = system, topology = %settings.topology, slot = settings.slot, panic = %text, "slot runner panicked; restarting it");
                Err(anyhow::anyhow!("slot runner panicked: {text}"))
            }
        };
        let error = match result {
            Ok(r) => {
                merge(&mut total, r);
                None
            }
            Err(e) if stopping(&stop) => return Err(e),
            Err(e) => Some(e),
        };
        if stopping(&stop) {
            return Ok(total);
        }
        if started.elapsed() > Duration::from_secs(30) {
            backoff = BACKOFF_MIN;
        }
        tracing::warn!(
            messaging.system = system, topology = %settings.topology, slot = settings.slot,
            error = error.map(|e| format!("{e:#}")).unwrap_or_else(|| "subscription ended".into()),
            ?backoff, "slot runner stopped without a stop request; restarting"
        );
        if pause(&mut stop, backoff).await {
            return Ok(total);
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// Forward the topology's ingress to the slot queues until the node stops:
/// each message is published to the slot of its group (or of its id) through
/// the broker, and acked once that publish is confirmed. A message that does
/// not decode is dead-lettered `undecodable`, never dropped.
async fn forward_ingress(
    p: Arc<Pipeline>,
    topology: Arc<str>,
    slots: u32,
    prefetch: u32,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<RunnerReport> {
    let mut total = RunnerReport::default();
    let mut backoff = BACKOFF_MIN;
    let system = p.transport.system();
    while !stopping(&stop) {
        let mut sub = match p.transport.subscribe_ingress(&topology, prefetch).await {
            Ok(None) => return Ok(total),
            Ok(Some(sub)) => sub,
            Err(e) => {
                tracing::warn!(messaging.system = system, topology = %topology, error = %e, ?backoff, "cannot consume the ingress; retrying");
                if pause(&mut stop, backoff).await {
                    break;
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
        };
        backoff = BACKOFF_MIN;
        loop {
            let next = tokio::select! {
                biased;
                changed = stop.changed() => if changed.is_err() || *stop.borrow() { break } else { continue },
                next = sub.next() => next,
            };
            match next {
                Some(Ok(d)) => {
                    total.received += 1;
                    if !forward_one(&p, &topology, slots, d).await && pause(&mut stop, backoff).await {
                        break;
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(messaging.system = system, topology = %topology, error = %e, "ingress consumer ended; resubscribing");
                    break;
                }
                None => break,
            }
        }
        drain_ingress(sub.as_mut(), &mut total).await;
        sub.close().await;
        if !stopping(&stop) && pause(&mut stop, backoff).await {
            break;
        }
    }
    Ok(total)
}

/// Release what the ingress subscription already holds, before it is dropped.
async fn drain_ingress(sub: &mut dyn Subscription, total: &mut RunnerReport) {
    while let Some(Ok(d)) = sub.try_next() {
        total.released += 1;
        let _ = d.acker.settle(Disposition::Release).await;
    }
}

/// Forward one ingress delivery; false when it had to be returned (publish failed).
async fn forward_one(p: &Pipeline, topology: &str, slots: u32, d: Delivery) -> bool {
    let Delivery {
        message,
        source,
        tag,
        acker,
    } = d;
    let system = p.transport.system();
    match message {
        Ok(env) => {
            let slot = partition::slot_for(env.group(), &env.id, slots);
            match p.transport.publish(topology, slot, envelope::encode(&env)).await {
                Ok(()) => {
                    if let Err(e) = acker.settle(Disposition::Ack).await {
                        tracing::warn!(messaging.system = system, topology, slot, tag, error = %e, "ingress ack failed after the forward was confirmed; it may be forwarded twice");
                    }
                    true
                }
                Err(e) if e.kind == crate::transport::ErrorKind::Invalid => {
                    // It can never be forwarded (its headers do not fit the
                    // broker's rules): returning it would loop for ever.
                    let err = envelope::DecodeError::Unsendable(e.detail);
                    let wire = envelope::encode(&env);
                    let outcome = crate::lanes::capture_raw(p, topology, wire, &err, &source, tag, acker).await;
                    !matches!(outcome, Outcome::Requeued)
                }
                Err(e) => {
                    tracing::warn!(messaging.system = system, topology, slot, tag, error = %e, "forwarding an ingress message failed; returning it");
                    if let Err(e) = acker.settle(Disposition::Release).await {
                        tracing::warn!(messaging.system = system, topology, tag, error = %e, "release of an ingress message failed; the broker redelivers it");
                    }
                    false
                }
            }
        }
        Err((wire, err)) => {
            let outcome = crate::lanes::capture_raw(p, topology, wire, &err, &source, tag, acker).await;
            !matches!(outcome, Outcome::Requeued)
        }
    }
}
