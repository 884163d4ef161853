//! The Wasm runtime: one engine per process (pooling allocator, epoch
//! interruption), handler versions compiled once and kept as `InstancePre`,
//! and [`Executor`]s that call guests synchronously on worker threads.
//!
//! A trap, a timeout or a cancellation is a [`Fault`]: the instance is
//! discarded and the caller treats every message of that call as `retry`.
//! Routing, lanes and settlement are left to others.

pub mod bindings;
mod host;
pub mod pool;
pub mod stdio;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use sha2::Digest as _;
use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, Trap, UpdateDeadline};

use bindings::weir::handler::types::Failure;
use bindings::{Handler, HandlerPre};
pub use host::{HostState, Interruption, Outgoing};

use crate::envelope::Envelope;

/// How often the epoch advances; the granularity of timeouts and cancellation.
pub const EPOCH_TICK: Duration = Duration::from_millis(5);

/// Default of [`RuntimeOptions::demote_after`]: well above a typical call (micro- to
/// a few milliseconds), far below the timeouts that end runaway ones. A longer call is not
/// stopped by it, only moved behind the short ones for the rest of its run.
pub const DEMOTE_AFTER: Duration = Duration::from_millis(20);

/// Process-wide runtime options.
#[derive(Debug, Clone)]
pub struct RuntimeOptions {
    /// Largest linear memory any instance may have (the pool's slot size).
    pub max_memory: usize,
    /// Instances the pooling allocator keeps room for, each as large as a
    /// Python or JavaScript component (see `Runtime::new`).
    pub pool_instances: u32,
    /// Guest stack limit; deeper recursion traps with a stack overflow.
    pub max_wasm_stack: usize,
    /// Where compiled components are cached by digest (`None`: no cache).
    pub cache_dir: Option<PathBuf>,
    /// Meter fuel, so handlers with `limits.fuel` can be stopped by it (costs every call a
    /// little; on only when some handler or tenant sets fuel).
    pub fuel: bool,
    /// A call that burns more CPU than this loses its worker's normal CPU priority for the
    /// rest of the call, and a fresh worker takes its place (`None`: never).
    pub demote_after: Option<Duration>,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        Self {
            max_memory: 256 << 20,
            pool_instances: 256,
            max_wasm_stack: 512 << 10,
            cache_dir: None,
            fuel: false,
            demote_after: Some(DEMOTE_AFTER),
        }
    }
}

/// Whether an instance is reused across calls or made fresh for each.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum InstanceMode {
    /// Keep one instance per worker and handler version (the default).
    #[default]
    Reuse,
    /// Instantiate for every call: strict isolation between messages.
    Fresh,
}

/// A host directory a handler may see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preopen {
    /// Directory on the host.
    pub host: PathBuf,
    /// Path the guest sees.
    pub guest: String,
    /// Read-only when true.
    pub read_only: bool,
    /// The directory opened when the version was loaded: each instance is
    /// given this handle (re-checked against the tenant's allow list), not `host`.
    pub pinned: Option<Arc<crate::registry::PinnedDir>>,
}

/// WASI capabilities beyond clocks and random; all denied by default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WasiGrants {
    /// Environment variables visible to the guest.
    pub env: Vec<(String, String)>,
    /// Guest stdout/stderr go to the host's.
    pub inherit_stdio: bool,
    /// Directories the guest may open.
    pub preopens: Vec<Preopen>,
    /// TCP/UDP and name lookup to any address.
    pub network: bool,
}

impl WasiGrants {
    fn apply(&self, b: &mut wasmtime_wasi::WasiCtxBuilder) {
        for (k, v) in &self.env {
            b.env(k, v);
        }
        if self.inherit_stdio {
            b.inherit_stdout().inherit_stderr();
        }
        for p in &self.preopens {
            let perms = if p.read_only {
                wasmtime_wasi::FsPerms::ReadOnly
            } else {
                wasmtime_wasi::FsPerms::ReadWrite
            };
            let host = match p.pinned.as_deref().map(crate::registry::PinnedDir::open_path) {
                None => p.host.clone(),
                Some(Ok(handle)) => handle,
                Some(Err(e)) => {
                    tracing::error!(guest = %p.guest, error = %e, "directory grant refused at instantiation; the guest does not see it");
                    continue;
                }
            };
            // Checked by `Runtime::load`, which opens each directory first.
            if let Err(e) = b.preopened_dir(&host, &p.guest, perms) {
                tracing::error!(host = %p.host.display(), error = %e, "preopen failed after validation");
            }
        }
        if self.network {
            b.inherit_network()
                .allow_tcp(true)
                .allow_udp(true)
                .allow_ip_name_lookup(true);
        }
    }
}

/// Everything about a handler that is not its code.
#[derive(Debug, Clone)]
pub struct HandlerSettings {
    /// Handler name from the config.
    pub name: String,
    /// Linear memory limit per instance, bytes.
    pub memory_limit: usize,
    /// Per-call timeout.
    pub timeout: Duration,
    /// Reuse or fresh instances.
    pub instance_mode: InstanceMode,
    /// The handler's own config table, read by the `config` import.
    pub config: BTreeMap<String, String>,
    /// WASI grants.
    pub wasi: WasiGrants,
    /// Upper bound on `publish` calls per handler call.
    pub max_publish_per_call: usize,
    /// Calls of this handler that may run at once on this node (and so
    /// instances in use at once).
    pub max_instances: usize,
    /// Admission shared by every version of this handler (`None`: each
    /// version gets its own, `max_instances` permits).
    pub permits: Option<Arc<tokio::sync::Semaphore>>,
    /// The tenant this handler is bound to, with the tenant's shared admission.
    pub tenant: Option<TenantShare>,
    /// Fuel one call may burn; `None`: unmetered.
    pub fuel: Option<u64>,
    /// Outcomes, call durations and calls in flight, shared by the handler's versions.
    pub metrics: Arc<crate::stats::HandlerMetrics>,
}

/// A tenant's share of the node: calls of all its handlers at once.
#[derive(Debug, Clone)]
pub struct TenantShare {
    /// The tenant id.
    pub name: Arc<str>,
    /// Calls of the tenant's handlers that may run at once (`None`: unbounded).
    pub permits: Option<Arc<tokio::sync::Semaphore>>,
}

impl HandlerSettings {
    /// Defaults for a handler called `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            memory_limit: 64 << 20,
            timeout: Duration::from_secs(5),
            instance_mode: InstanceMode::Reuse,
            config: BTreeMap::new(),
            wasi: WasiGrants::default(),
            max_publish_per_call: 1000,
            max_instances: 16,
            permits: None,
            tenant: None,
            fuel: None,
            metrics: Arc::default(),
        }
    }
}

static NEXT_VERSION: AtomicU64 = AtomicU64::new(1);

/// Bumped whenever a version is retired: executors then drop the instances
/// they keep of retired versions (one load per call to notice).
static RETIREMENTS: AtomicU64 = AtomicU64::new(0);

/// One compiled, validated version of a handler.
pub struct HandlerVersion {
    /// Process-unique id (instance caches key on it).
    pub id: u64,
    /// sha256 of the component bytes, hex.
    pub digest: String,
    /// Size of the component in bytes.
    pub size: usize,
    /// The handler's settings.
    pub settings: Arc<HandlerSettings>,
    /// Admission for calls of this version, `max_instances` permits.
    pub permits: Arc<tokio::sync::Semaphore>,
    pre: HandlerPre<HostState>,
    retired: AtomicBool,
}

impl std::fmt::Debug for HandlerVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerVersion")
            .field("name", &self.settings.name)
            .field("digest", &self.digest)
            .finish()
    }
}

impl HandlerVersion {
    /// Handler name.
    pub fn name(&self) -> &str {
        &self.settings.name
    }

    /// The same compiled code as a new version (new id, no cached
    /// instances, not retired): a rollback to code that was retired.
    pub fn reissue(&self) -> Arc<HandlerVersion> {
        Arc::new(HandlerVersion {
            id: NEXT_VERSION.fetch_add(1, Ordering::Relaxed),
            digest: self.digest.clone(),
            size: self.size,
            settings: self.settings.clone(),
            permits: self.permits.clone(),
            pre: self.pre.clone(),
            retired: AtomicBool::new(false),
        })
    }

    /// The tenant this version's handler is bound to.
    pub fn tenant(&self) -> Option<&TenantShare> {
        self.settings.tenant.as_ref()
    }

    /// Whether this version has been replaced.
    pub fn retired(&self) -> bool {
        self.is_retired()
    }

    /// Mark this version as replaced: workers drop their cached instances.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Relaxed);
        RETIREMENTS.fetch_add(1, Ordering::Release);
    }

    fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }
}

/// Observes every guest call (a test ledger or the demo's overlap detector).
pub trait CallObserver: Send + Sync {
    /// Right before [`CallObserver::before`] (and for every member of a
    /// batch): the version about to run `msg`, by digest.
    fn version(&self, _msg: &Envelope, _digest: &str) {}
    /// Right before the guest is entered for `msg`.
    fn before(&self, msg: &Envelope);
    /// Right after it returned, trapped or was interrupted.
    fn after(&self, msg: &Envelope);
    /// Right before `handle-batch` is entered for `batch` (never empty). One
    /// call, so by default it is seen as one call of its first member (a
    /// batch is one (tenant, group)); override to see every member.
    fn before_batch(&self, batch: &[Envelope]) {
        if let Some(first) = batch.first() {
            self.before(first);
        }
    }
    /// Right after `handle-batch` returned, trapped or was interrupted.
    fn after_batch(&self, batch: &[Envelope]) {
        if let Some(first) = batch.first() {
            self.after(first);
        }
    }
}

/// The engine, the linker and the epoch ticker.
pub struct Runtime {
    engine: Engine,
    linker: Linker<HostState>,
    options: RuntimeOptions,
    observer: Option<Arc<dyn CallObserver>>,
    ticker_stop: Arc<AtomicBool>,
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.ticker_stop.store(true, Ordering::Relaxed);
    }
}

impl Runtime {
    /// Build the engine (pooling allocator, epoch interruption) and linker.
    pub fn new(options: RuntimeOptions) -> anyhow::Result<Arc<Self>> {
        // Sized so that `pool_instances` instances of a large guest fit, not only
        // Rust ones. Measured on the orders handler, (core instances, instance
        // metadata, table elements): Rust 3, 8 KiB, 110; JavaScript
        // (ComponentizeJS) 4, 204 KiB, 7,691; Python (componentize-py) 14,
        // 390 KiB, 5,674, and each native extension module a Python guest
        // links adds a core instance, metadata and table elements. Each has
        // one memory and two tables. The core-instance counts and the two size
        // limits are checks, not reservations; table elements reserve address
        // space, 8 bytes each per table in the pool.
        const CORE_INSTANCES_PER_COMPONENT: u32 = 128;
        const TABLE_ELEMENTS: usize = 64 << 10;
        const CORE_INSTANCE_SIZE: usize = 4 << 20;
        const COMPONENT_INSTANCE_SIZE: usize = 16 << 20;
        let mut pool = PoolingAllocationConfig::default();
        pool.total_component_instances(options.pool_instances)
            .total_core_instances(options.pool_instances.saturating_mul(CORE_INSTANCES_PER_COMPONENT))
            .max_core_instances_per_component(CORE_INSTANCES_PER_COMPONENT)
            .total_memories(options.pool_instances * 2)
            .total_tables(options.pool_instances * 4)
            .table_elements(TABLE_ELEMENTS)
            .max_core_instance_size(CORE_INSTANCE_SIZE)
            .max_component_instance_size(COMPONENT_INSTANCE_SIZE)
            .max_memory_size(options.max_memory);
        let mut cfg = wasmtime::Config::new();
        cfg.wasm_component_model(true)
            .epoch_interruption(true)
            .consume_fuel(options.fuel)
            .concurrency_support(false)
            .max_wasm_stack(options.max_wasm_stack)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&cfg)
            .map_err(anyhow::Error::from)
            .context("configuring the wasmtime engine")?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)
            .map_err(anyhow::Error::from)
            .context("linking WASI")?;
        Handler::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
            .map_err(anyhow::Error::from)
            .context("linking weir:handler/host")?;

        let ticker_stop = Arc::new(AtomicBool::new(false));
        let (e, stop) = (engine.clone(), ticker_stop.clone());
        std::thread::Builder::new()
            .name("weir-epoch".into())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    e.increment_epoch();
                }
            })
            .context("starting the epoch ticker")?;
        Ok(Arc::new(Self {
            engine,
            linker,
            options,
            observer: None,
            ticker_stop,
        }))
    }

    /// Same as [`Runtime::new`] with an observer around every guest call.
    pub fn with_observer(options: RuntimeOptions, observer: Arc<dyn CallObserver>) -> anyhow::Result<Arc<Self>> {
        let rt = Self::new(options)?;
        let mut rt = Arc::into_inner(rt).context("runtime is shared already")?;
        rt.observer = Some(observer);
        Ok(Arc::new(rt))
    }

    /// The options the engine was built with.
    pub fn options(&self) -> &RuntimeOptions {
        &self.options
    }

    /// The wasmtime engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Compile and validate a component: it must be a component exporting
    /// the `weir:handler/handler` world and fit the limits. `origin` names
    /// the file or upload in errors.
    pub fn load(&self, bytes: &[u8], settings: HandlerSettings, origin: &str) -> anyhow::Result<Arc<HandlerVersion>> {
        let digest = hex::encode(sha2::Sha256::digest(bytes));
        if settings.memory_limit > self.options.max_memory {
            anyhow::bail!(
                "handler `{}`: limits.memory {} exceeds the node's largest instance memory {} bytes",
                settings.name,
                settings.memory_limit,
                self.options.max_memory
            );
        }
        for p in &settings.wasi.preopens {
            std::fs::read_dir(&p.host).with_context(|| {
                format!(
                    "handler `{}`: wasi preopen {:?} cannot be opened",
                    settings.name,
                    p.host.display()
                )
            })?;
        }
        let component = self
            .compile(bytes, &digest)
            .with_context(|| format!("{origin} is not a valid WebAssembly component"))?;
        let pre = self
            .linker
            .instantiate_pre(&component)
            .and_then(HandlerPre::new)
            .map_err(anyhow::Error::from)
            .with_context(|| {
                format!("{origin} does not implement the weir:handler/handler world (imports or exports differ)")
            })?;
        if settings.fuel.is_some() && !self.options.fuel {
            anyhow::bail!(
                "handler `{}`: limits.fuel is set but this node started without fuel metering \
                 (it is switched on at start when any configured handler or tenant sets fuel)",
                settings.name
            );
        }
        let version = HandlerVersion {
            permits: settings
                .permits
                .clone()
                .unwrap_or_else(|| Arc::new(tokio::sync::Semaphore::new(settings.max_instances.max(1)))),
            id: NEXT_VERSION.fetch_add(1, Ordering::Relaxed),
            digest,
            size: bytes.len(),
            settings: Arc::new(settings),
            pre,
            retired: AtomicBool::new(false),
        };
        // Instantiate once now, so a component that traps in its start
        // function or needs more memory than allowed is refused at load.
        let mut probe = Instance::new(&self.engine, &version, self.options.fuel)
            .with_context(|| format!("{origin}: instantiating handler `{}`", version.name()))?;
        drop(probe.store.data_mut().outbox.drain(..));
        Ok(Arc::new(version))
    }

    fn compile(&self, bytes: &[u8], digest: &str) -> anyhow::Result<Component> {
        let Some(dir) = &self.options.cache_dir else {
            return Component::new(&self.engine, bytes).map_err(anyhow::Error::from);
        };
        let mut hasher = std::hash::DefaultHasher::new();
        std::hash::Hash::hash(&self.engine.precompile_compatibility_hash(), &mut hasher);
        let key = std::hash::Hasher::finish(&hasher);
        let path = dir.join(format!("{digest}-{key:016x}.cwasm"));
        if path.exists() {
            // SAFETY: the file was written by `precompile_component` of an
            // engine with the same compatibility hash, into the node's own
            // data directory, under the digest of the bytes being loaded.
            match unsafe { Component::deserialize_file(&self.engine, &path) } {
                Ok(c) => return Ok(c),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "ignoring unusable compiled-code cache entry")
                }
            }
        }
        let code = self.engine.precompile_component(bytes).map_err(anyhow::Error::from)?;
        std::fs::create_dir_all(dir).with_context(|| format!("creating cache dir {}", dir.display()))?;
        let tmp = path.with_extension(format!("{}.tmp", uuid::Uuid::new_v4()));
        std::fs::write(&tmp, &code).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
        // SAFETY: just produced by this engine's `precompile_component`.
        Ok(unsafe { Component::deserialize(&self.engine, &code).map_err(anyhow::Error::from)? })
    }
}

/// What went wrong in a call, beyond the guest's own answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The guest trapped (panic, unreachable, stack overflow, bad access).
    Trap,
    /// The guest exceeded its memory limit (and then trapped).
    MemoryLimit,
    /// The call ran past the handler's timeout and was interrupted.
    Timeout,
    /// The host interrupted the call (ownership lost, shutdown).
    Cancelled,
    /// A fresh instance could not be made.
    Instantiate,
}

/// A call that did not produce the guest's answer.
#[derive(Debug, Clone)]
pub struct Fault {
    /// The class of fault.
    pub kind: FaultKind,
    /// Human-readable detail (the trap message).
    pub detail: String,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.kind {
            FaultKind::Trap => "handler trapped",
            FaultKind::MemoryLimit => "handler exceeded its memory limit",
            FaultKind::Timeout => "handler timed out",
            FaultKind::Cancelled => "call cancelled by the host",
            FaultKind::Instantiate => "handler could not be instantiated",
        };
        write!(f, "{what}: {}", self.detail)
    }
}

/// The result of handing one message to `handle`.
#[derive(Debug)]
pub enum CallOutcome {
    /// The guest answered. Messages it published are in `published` (only
    /// when it answered `Ok`; a failed call's publishes are dropped).
    Done {
        /// The guest's answer.
        result: Result<(), Failure>,
        /// Cascaded messages to publish before acknowledging.
        published: Vec<Outgoing>,
    },
    /// No answer: treat as `retry`.
    Fault(Fault),
}

/// The result of one `handle-batch` call.
#[derive(Debug)]
pub enum BatchOutcome {
    /// One answer per message, in order, and everything the call published.
    Done {
        /// Answers, same order as the batch.
        results: Vec<Result<(), Failure>>,
        /// Cascaded messages of the whole call.
        published: Vec<Outgoing>,
    },
    /// No answers: replay members one by one.
    Fault(Fault),
}

struct Instance {
    store: Store<HostState>,
    bindings: Handler,
}

impl Instance {
    fn new(engine: &Engine, version: &HandlerVersion, fuel: bool) -> anyhow::Result<Self> {
        let mut store = Store::new(engine, HostState::new(version.settings.clone()));
        if fuel {
            // Instantiation (start functions) is metered like a call.
            store
                .set_fuel(version.settings.fuel.unwrap_or(u64::MAX))
                .map_err(anyhow::Error::from)?;
        }
        store.limiter(|s| s.limiter());
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(|ctx| {
            if ctx.data_mut_should_interrupt() {
                Ok(UpdateDeadline::Interrupt)
            } else {
                Ok(UpdateDeadline::Continue(1))
            }
        });
        let bindings = version.pre.instantiate(&mut store).map_err(anyhow::Error::from)?;
        Ok(Self { store, bindings })
    }
}

trait ShouldInterrupt {
    fn data_mut_should_interrupt(self) -> bool;
}

impl ShouldInterrupt for wasmtime::StoreContextMut<'_, HostState> {
    fn data_mut_should_interrupt(mut self) -> bool {
        self.data_mut().should_interrupt()
    }
}

/// Calls guests on the current thread, keeping reusable instances.
/// One per worker thread; not shared.
pub struct Executor {
    runtime: Arc<Runtime>,
    /// Run on the worker's own thread when a call outlives `demote_after`.
    on_long_call: Option<Arc<dyn Fn() + Send + Sync>>,
    /// Reusable instances by version id (ids are unique: no hashing needed).
    cache: HashMap<u64, (Arc<HandlerVersion>, Instance), nohash_hasher::BuildNoHashHasher<u64>>,
    /// [`RETIREMENTS`] when the cache was last swept of retired versions.
    swept: u64,
}

impl Executor {
    /// An executor with an empty instance cache.
    pub fn new(runtime: Arc<Runtime>) -> Self {
        Self {
            runtime,
            on_long_call: None,
            cache: HashMap::default(),
            swept: 0,
        }
    }

    /// Run `hook` on this executor's thread, from inside the call, when a call
    /// outlives the runtime's `demote_after` (once per call).
    pub fn on_long_call(&mut self, hook: Arc<dyn Fn() + Send + Sync>) {
        self.on_long_call = Some(hook);
    }

    fn instance(&mut self, version: &Arc<HandlerVersion>) -> Result<Instance, Fault> {
        if version.settings.instance_mode == InstanceMode::Reuse
            && let Some((_, inst)) = self.cache.remove(&version.id)
        {
            return Ok(inst);
        }
        Instance::new(&self.runtime.engine, version, self.runtime.options.fuel).map_err(|e| Fault {
            kind: FaultKind::Instantiate,
            detail: format!("{e:#}"),
        })
    }

    fn keep(&mut self, version: &Arc<HandlerVersion>, inst: Instance) {
        if version.settings.instance_mode == InstanceMode::Reuse && !version.is_retired() {
            self.cache.insert(version.id, (version.clone(), inst));
        }
        // After a swap, free the old version's instances (a Python guest's
        // is tens of MiB) instead of keeping them until the cache fills.
        let retirements = RETIREMENTS.load(Ordering::Acquire);
        if retirements != self.swept || self.cache.len() > 8 {
            self.swept = retirements;
            self.cache.retain(|_, (v, _)| !v.is_retired());
        }
    }

    fn arm(&self, inst: &mut Instance, version: &HandlerVersion, msg: &Envelope, cancel: &Option<Arc<AtomicBool>>) {
        if self.runtime.options.fuel {
            // Unmetered handlers get all the fuel there is.
            let fuel = version.settings.fuel.unwrap_or(u64::MAX);
            if let Err(e) = inst.store.set_fuel(fuel) {
                tracing::error!(error = %e, "setting fuel");
            }
        }
        let data = inst.store.data_mut();
        data.deadline = Some(Instant::now() + version.settings.timeout);
        data.long_call = self.runtime.options.demote_after;
        data.cpu_mark = None;
        data.on_long_call.clone_from(&self.on_long_call);
        data.cancel.clone_from(cancel);
        data.interrupted = None;
        data.take_memory_denied();
        if let Some(tail) = &data.stdio {
            tail.clear();
        }
        data.call.message_id.clone_from(&msg.id);
        data.call.tenant_id.clone_from(&msg.tenant_id);
        data.outbox.clear();
    }

    fn fault(inst: &mut Instance, err: wasmtime::Error) -> Fault {
        let data = inst.store.data_mut();
        let memory = data.take_memory_denied();
        let kind = match (data.interrupted.take(), memory) {
            (Some(Interruption::Timeout), _) => FaultKind::Timeout,
            (Some(Interruption::Cancelled), _) => FaultKind::Cancelled,
            (None, true) => FaultKind::MemoryLimit,
            (None, false) => FaultKind::Trap,
        };
        let mut detail = match (kind, err.downcast_ref::<Trap>()) {
            (FaultKind::Timeout, _) => format!("interrupted after {:?}", data.settings.timeout),
            (FaultKind::MemoryLimit, _) => {
                format!("limit {} bytes; {err}", data.settings.memory_limit)
            }
            (_, Some(Trap::StackOverflow)) => "stack overflow".to_owned(),
            (_, Some(Trap::OutOfFuel)) => format!(
                "ran out of fuel (limit {} per call)",
                data.settings.fuel.unwrap_or(u64::MAX)
            ),
            _ => format!("{err:#}"),
        };
        // The guest's last words (a panic message) say more than the trap.
        if let Some(words) = data.stdio.as_ref().and_then(|t| t.last_words(512)) {
            detail.push_str("; guest output: ");
            detail.push_str(&words);
        }
        Fault { kind, detail }
    }

    /// Call `handle` for one message.
    pub fn call(
        &mut self,
        version: &Arc<HandlerVersion>,
        msg: &Envelope,
        cancel: &Option<Arc<AtomicBool>>,
    ) -> CallOutcome {
        let mut inst = match self.instance(version) {
            Ok(i) => i,
            Err(f) => return CallOutcome::Fault(f),
        };
        self.arm(&mut inst, version, msg, cancel);
        if let Some(o) = &self.runtime.observer {
            o.version(msg, &version.digest);
            o.before(msg);
        }
        let metrics = &version.settings.metrics;
        metrics.enter();
        let started = Instant::now();
        let r = inst.bindings.call_handle(&mut inst.store, msg);
        metrics.exit(started.elapsed());
        if let Some(o) = &self.runtime.observer {
            o.after(msg);
        }
        match r {
            Ok(result) => {
                let published = match result {
                    Ok(()) => std::mem::take(&mut inst.store.data_mut().outbox),
                    Err(_) => Vec::new(),
                };
                self.keep(version, inst);
                CallOutcome::Done { result, published }
            }
            // The instance is dropped here: its state may be corrupt.
            Err(e) => CallOutcome::Fault(Self::fault(&mut inst, e)),
        }
    }

    /// Call `handle-batch` once for all of `batch`.
    pub fn call_batch(
        &mut self,
        version: &Arc<HandlerVersion>,
        batch: &[Envelope],
        cancel: &Option<Arc<AtomicBool>>,
    ) -> BatchOutcome {
        let Some(first) = batch.first() else {
            return BatchOutcome::Done {
                results: Vec::new(),
                published: Vec::new(),
            };
        };
        let mut inst = match self.instance(version) {
            Ok(i) => i,
            Err(f) => return BatchOutcome::Fault(f),
        };
        self.arm(&mut inst, version, first, cancel);
        if let Some(o) = &self.runtime.observer {
            for m in batch {
                o.version(m, &version.digest);
            }
            o.before_batch(batch);
        }
        let metrics = &version.settings.metrics;
        metrics.enter();
        let started = Instant::now();
        let r = inst.bindings.call_handle_batch(&mut inst.store, batch);
        metrics.exit(started.elapsed());
        if let Some(o) = &self.runtime.observer {
            o.after_batch(batch);
        }
        match r {
            Ok(results) if results.len() == batch.len() => {
                let published = std::mem::take(&mut inst.store.data_mut().outbox);
                self.keep(version, inst);
                BatchOutcome::Done { results, published }
            }
            Ok(results) => BatchOutcome::Fault(Fault {
                kind: FaultKind::Trap,
                detail: format!(
                    "handle-batch returned {} results for {} messages",
                    results.len(),
                    batch.len()
                ),
            }),
            Err(e) => BatchOutcome::Fault(Self::fault(&mut inst, e)),
        }
    }
}
