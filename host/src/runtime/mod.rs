//! The Wasm runtime: one engine per process (pooling allocator, epoch
//! interruption), handler versions compiled once and kept as `InstancePre`,
//! and [`Executor`]s that call guests synchronously on worker threads.
//!
//! A trap, a timeout or a cancellation is a [`Fault`]: the instance is
//! discarded and the caller treats every message of that call as `retry`.
//! Routing, lanes and settlement are left to others.

mod blocking;
pub mod bundled;
pub mod grants;
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

/// The generated bindings, where they were before they moved to [`crate::bindings`].
pub use crate::bindings;
use crate::bindings::weir::handler::types::Failure;
use crate::bindings::{Handler, HandlerPre, v0_1};
pub use host::{HostState, Interruption, Outgoing};

use crate::envelope::Envelope;
pub use crate::observe::CallObserver;

/// How often the epoch advances; the granularity of timeouts and cancellation.
pub const EPOCH_TICK: Duration = Duration::from_millis(5);

/// Default of [`RuntimeOptions::demote_after`]: well above a typical call (micro- to
/// a few milliseconds), far below the timeouts that end runaway ones. A longer call is not
/// stopped by it, only moved behind the short ones for the rest of its run.
pub const DEMOTE_AFTER: Duration = Duration::from_millis(20);

/// Instances one worker keeps cached at most (its least recently used one goes first).
pub const CACHED_PER_WORKER: usize = 8;

/// The pool size a node with `workers` worker threads (0: one per core) and `handlers`
/// handlers needs so that no call waits for an instance: every worker's cache full, one
/// instance in use each, as many again for demoted workers finishing long calls; at least
/// [`crate::config::defaults::INSTANCE_POOL_MIN`], at most `INSTANCE_POOL_MAX`. Beyond that,
/// cached instances are evicted (see [`Executor`]).
pub fn pool_size_for(workers: usize, handlers: usize) -> u32 {
    use crate::config::defaults::{INSTANCE_POOL_MAX, INSTANCE_POOL_MIN};
    let workers = if workers == 0 {
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2)
    } else {
        workers
    };
    let per_worker = handlers.clamp(1, CACHED_PER_WORKER) + 1;
    let want = workers.saturating_mul(2).saturating_mul(per_worker);
    u32::try_from(want)
        .unwrap_or(u32::MAX)
        .clamp(INSTANCE_POOL_MIN, INSTANCE_POOL_MAX)
}

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
    /// What one call may produce besides its answer: cascade bytes, log, error text.
    pub budgets: CallBudgets,
}

/// Per-call budgets for what a guest hands the host (`[node.budgets]`; defaults in
/// [`crate::config::defaults`]). What is over a budget is refused or cut at the runtime seam,
/// so a hostile guest cannot make the host hold or write unbounded bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallBudgets {
    /// Bytes of cascaded messages one call may hold (payloads, headers, types, group ids).
    /// A `publish` beyond it is refused and everything the call published is dropped at once.
    pub cascade_bytes: usize,
    /// Bytes the guest may write to the host's log in one call (`log` and granted stdio).
    pub log_bytes: usize,
    /// Lines the guest may write to the host's log in one call.
    pub log_lines: usize,
    /// Longest log line kept; a longer one is cut with a marker.
    pub log_line_bytes: usize,
    /// Longest failure text kept (a `retry`/`reject` reason, a trap's detail).
    pub error_bytes: usize,
}

impl crate::config::Budgets {
    /// The runtime's form of these budgets (here, not in `config`: the
    /// runtime reads the config, never the other way round).
    pub fn to_runtime(&self) -> CallBudgets {
        let size = |b: crate::config::ByteSize| usize::try_from(b.bytes()).unwrap_or(usize::MAX);
        CallBudgets {
            cascade_bytes: size(self.cascade_bytes),
            log_bytes: size(self.log_bytes),
            log_lines: self.log_lines as usize,
            log_line_bytes: size(self.log_line_bytes),
            error_bytes: size(self.error_bytes),
        }
    }
}

impl crate::config::Config {
    /// The per-call budgets of `tenant`'s handlers when it sets its own (`tenant.budgets`,
    /// the node's for each key it leaves out); `None`: the node's apply.
    pub fn call_budgets(&self, tenant: Option<&crate::config::Tenant>) -> Option<CallBudgets> {
        let t = tenant.filter(|t| t.budgets.overrides_per_call())?;
        Some(self.node.budgets.for_tenant(&t.budgets).to_runtime())
    }
}

impl Default for CallBudgets {
    fn default() -> Self {
        use crate::config::defaults;
        let size = |b: crate::config::ByteSize| usize::try_from(b.bytes()).unwrap_or(usize::MAX);
        Self {
            cascade_bytes: size(defaults::CASCADE_BYTES),
            log_bytes: size(defaults::LOG_BYTES),
            log_lines: defaults::LOG_LINES as usize,
            log_line_bytes: size(defaults::LOG_LINE_BYTES),
            error_bytes: size(defaults::ERROR_BYTES),
        }
    }
}

/// Longest compile error kept in a refused load's answer.
const LOAD_ERROR_BYTES: usize = 2048;

/// Cut `text` to at most `budget` bytes when it is longer: its first line (as much of it as
/// fits), then a marker with the original length. Shorter texts are left alone.
pub fn cut_text(text: &mut String, budget: usize) {
    if text.len() <= budget {
        return;
    }
    let marker = format!(" [cut by weir: {} bytes, limit {budget}]", text.len());
    let first = text.lines().next().unwrap_or_default();
    let mut keep = first.len().min(budget.saturating_sub(marker.len()));
    while !first.is_char_boundary(keep) {
        keep -= 1;
    }
    let mut out = String::with_capacity(keep + marker.len());
    out.push_str(&first[..keep]);
    out.push_str(&marker);
    *text = out;
}

/// Counters of what the per-call budgets refused or cut, for one handler.
#[derive(Debug, Default)]
pub struct BudgetCounters {
    /// Log lines (and stdio lines) dropped over a call's budget.
    pub log_lines_dropped: AtomicU64,
    /// Log bytes dropped over a call's budget (cut parts of long lines included).
    pub log_bytes_dropped: AtomicU64,
    /// `publish` calls refused for the cascade byte budget.
    pub cascades_refused: AtomicU64,
    /// Failure texts cut to `error_bytes`.
    pub errors_cut: AtomicU64,
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
            budgets: CallBudgets::default(),
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
    pub pinned: Option<Arc<grants::PinnedDir>>,
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
        // `inherit_stdio` is applied by `HostState::new`: the host's streams within the
        // call's log budget.
        for p in &self.preopens {
            let perms = if p.read_only {
                wasmtime_wasi::FsPerms::ReadOnly
            } else {
                wasmtime_wasi::FsPerms::ReadWrite
            };
            let host = match p.pinned.as_deref().map(grants::PinnedDir::open_path) {
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
    pub metrics: Arc<crate::observe::stats::HandlerMetrics>,
    /// What the per-call budgets refused or cut for this handler.
    pub budget: Arc<BudgetCounters>,
    /// Per-call budgets of its own (its tenant's, `tenant.budgets`); `None`: the node's
    /// ([`RuntimeOptions::budgets`]).
    pub budgets: Option<CallBudgets>,
}

/// A tenant's share of the node: calls of all its handlers at once.
#[derive(Debug, Clone)]
pub struct TenantShare {
    /// The tenant id.
    pub name: Arc<str>,
    /// Calls of the tenant's handlers that may run at once (`None`: unbounded).
    pub permits: Option<Arc<tokio::sync::Semaphore>>,
    /// The tenant's log budget over time, shared by all its calls (`None`: none).
    pub log_rate: Option<Arc<stdio::LogRate>>,
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
            budget: Arc::default(),
            budgets: None,
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
    pre: Pre,
    retired: AtomicBool,
}

/// A version's instantiation, by the world it was built against.
#[derive(Clone)]
enum Pre {
    /// `weir:handler@0.2.0`.
    V2(HandlerPre<HostState>),
    /// `weir:handler@0.1.0`: no `begin-member`.
    V1(v0_1::HandlerPre<HostState>),
}

impl Pre {
    fn instantiate(&self, store: &mut Store<HostState>) -> wasmtime::Result<Bindings> {
        match self {
            Pre::V2(pre) => pre.instantiate(store).map(Bindings::V2),
            Pre::V1(pre) => pre.instantiate(store).map(Bindings::V1),
        }
    }
}

/// An instance's exports, by world; the message and result types are shared.
enum Bindings {
    V2(Handler),
    V1(v0_1::Handler),
}

impl Bindings {
    fn call_handle(&self, store: &mut Store<HostState>, msg: &Envelope) -> wasmtime::Result<Result<(), Failure>> {
        match self {
            Bindings::V2(b) => b.call_handle(store, msg),
            Bindings::V1(b) => b.call_handle(store, msg),
        }
    }

    fn call_handle_batch(
        &self,
        store: &mut Store<HostState>,
        batch: &[Envelope],
    ) -> wasmtime::Result<Vec<Result<(), Failure>>> {
        match self {
            Bindings::V2(b) => b.call_handle_batch(store, batch),
            Bindings::V1(b) => b.call_handle_batch(store, batch),
        }
    }
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

/// The engine, the linker and the epoch ticker.
pub struct Runtime {
    engine: Engine,
    linker: Linker<HostState>,
    options: RuntimeOptions,
    observer: Option<Arc<dyn CallObserver>>,
    ticker_stop: Arc<AtomicBool>,
    /// Every executor's instance cache, so a full pool can evict idle instances anywhere.
    caches: parking_lot::Mutex<Vec<std::sync::Weak<parking_lot::Mutex<CacheMap>>>>,
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
        blocking::shadow_poll(&mut linker)?;
        Handler::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
            .map_err(anyhow::Error::from)
            .context("linking weir:handler/host@0.2.0")?;
        v0_1::Handler::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
            .map_err(anyhow::Error::from)
            .context("linking weir:handler/host@0.1.0")?;

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
            caches: parking_lot::Mutex::new(Vec::new()),
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
        // The parser's error may quote the upload (a text module, a run of
        // zeros): cut it, so a bad upload's answer and log line stay small.
        let component = self.compile(bytes, &digest).map_err(|e| {
            let mut why = format!("{e:#}");
            cut_text(&mut why, LOAD_ERROR_BYTES);
            anyhow::anyhow!("{origin} is not a valid WebAssembly component: {why}")
        })?;
        let pre = self.linker.instantiate_pre(&component).map_err(anyhow::Error::from);
        let pre = pre
            .and_then(|pre| match HandlerPre::new(pre.clone()) {
                Ok(v2) => Ok(Pre::V2(v2)),
                Err(e) => v0_1::HandlerPre::new(pre).map(Pre::V1).map_err(|_| e.into()),
            })
            .with_context(|| {
                format!(
                    "{origin} does not implement the weir:handler/handler world, version 0.2.0 or 0.1.0 \
                     (imports or exports differ)"
                )
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
        let mut probe = Instance::new(&self.engine, &version, &self.options)
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
    /// One answer per message, in order, and what the call published.
    Done {
        /// Answers, same order as the batch.
        results: Vec<Result<(), Failure>>,
        /// Each member's cascades (`begin-member`), same order as the batch;
        /// empty for a member that did not answer `Ok`.
        published: Vec<Vec<Outgoing>>,
        /// Cascades published before the call named a member (every publish
        /// of a 0.1.0 component): they belong to the whole batch, so they may
        /// go out only if every member succeeded.
        unattributed: Vec<Outgoing>,
    },
    /// No answers: replay members one by one.
    Fault(Fault),
}

struct Instance {
    store: Store<HostState>,
    bindings: Bindings,
}

impl Instance {
    fn new(engine: &Engine, version: &HandlerVersion, options: &RuntimeOptions) -> anyhow::Result<Self> {
        let budgets = version.settings.budgets.unwrap_or(options.budgets);
        let mut store = Store::new(engine, HostState::new(version.settings.clone(), budgets));
        if options.fuel {
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

/// One executor's cached instances by version id (ids are unique: no hashing needed).
type CacheMap = HashMap<u64, Cached, nohash_hasher::BuildNoHashHasher<u64>>;

/// An idle instance kept for the next call of its version.
struct Cached {
    version: Arc<HandlerVersion>,
    inst: Instance,
    /// The executor's call counter when it was last used (least recently used goes first).
    used: u64,
}

/// Whether instantiation failed only because the pool has no free slot.
fn pool_exhausted(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<wasmtime::PoolConcurrencyLimitError>()) || format!("{e:#}").contains("maximum concurrent")
}

/// Remove the least recently used instance of `cache`; false when it is empty.
fn evict_lru(cache: &mut CacheMap) -> Option<Cached> {
    let key = cache.iter().min_by_key(|(_, c)| c.used).map(|(k, _)| *k)?;
    cache.remove(&key)
}

/// Calls guests on the current thread, keeping reusable instances (at most
/// [`CACHED_PER_WORKER`]). One per worker thread; not shared. When the pool
/// has no free slot, idle cached instances are evicted, this executor's first,
/// then other executors'; a call never fails because the pool is full.
pub struct Executor {
    runtime: Arc<Runtime>,
    /// Run on the worker's own thread when a call outlives `demote_after`.
    on_long_call: Option<Arc<dyn Fn() + Send + Sync>>,
    /// Reusable instances; shared with the runtime only so others can evict from it.
    cache: Arc<parking_lot::Mutex<CacheMap>>,
    /// Calls made, the clock of the least-recently-used order.
    calls: u64,
    /// [`RETIREMENTS`] when the cache was last swept of retired versions.
    swept: u64,
}

impl Executor {
    /// An executor with an empty instance cache.
    pub fn new(runtime: Arc<Runtime>) -> Self {
        let cache = Arc::new(parking_lot::Mutex::new(CacheMap::default()));
        {
            let mut caches = runtime.caches.lock();
            caches.retain(|w| w.strong_count() > 0);
            caches.push(Arc::downgrade(&cache));
        }
        Self {
            runtime,
            on_long_call: None,
            cache,
            calls: 0,
            swept: 0,
        }
    }

    /// Run `hook` on this executor's thread, from inside the call, when a call
    /// outlives the runtime's `demote_after` (once per call).
    pub fn on_long_call(&mut self, hook: Arc<dyn Fn() + Send + Sync>) {
        self.on_long_call = Some(hook);
    }

    /// Free one idle instance, this executor's least recently used first, then any other
    /// executor's (skipping one whose cache is locked this instant); false when none is idle.
    fn evict_one(&self) -> bool {
        let evicted = evict_lru(&mut self.cache.lock());
        if evicted.is_some() {
            return true;
        }
        let others: Vec<_> = self
            .runtime
            .caches
            .lock()
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .collect();
        for other in others.iter().filter(|c| !Arc::ptr_eq(c, &self.cache)) {
            let evicted = other.try_lock().and_then(|mut c| evict_lru(&mut c));
            if evicted.is_some() {
                return true;
            }
        }
        false
    }

    fn instance(&mut self, version: &Arc<HandlerVersion>, cancel: &Option<Arc<AtomicBool>>) -> Result<Instance, Fault> {
        if version.settings.instance_mode == InstanceMode::Reuse
            && let Some(c) = self.cache.lock().remove(&version.id)
        {
            return Ok(c.inst);
        }
        let give_up = Instant::now() + version.settings.timeout;
        loop {
            let e = match Instance::new(&self.runtime.engine, version, &self.runtime.options) {
                Ok(inst) => return Ok(inst),
                Err(e) => e,
            };
            if !pool_exhausted(&e) {
                return Err(Fault {
                    kind: FaultKind::Instantiate,
                    detail: format!("{e:#}"),
                });
            }
            if self.evict_one() {
                continue;
            }
            // Every instance is in a running call: wait for one to end, as long as a call
            // of this handler may run. Then the message goes back unharmed: the node's pool
            // is full, which is no fault of the guest's.
            let cancelled = cancel.as_ref().is_some_and(|c| c.load(Ordering::Relaxed));
            if cancelled || Instant::now() >= give_up {
                tracing::warn!(
                    handler = version.name(),
                    pool = self.runtime.options.pool_instances,
                    "no free instance in the pool (node.instance_pool): every one is in a running call; \
                     the message is released for redelivery"
                );
                return Err(Fault {
                    kind: FaultKind::Cancelled,
                    detail: format!(
                        "no free instance: all {} of the pool (node.instance_pool) are in running calls",
                        self.runtime.options.pool_instances
                    ),
                });
            }
            std::thread::sleep(EPOCH_TICK);
        }
    }

    fn keep(&mut self, version: &Arc<HandlerVersion>, inst: Instance) {
        self.calls += 1;
        let mut cache = self.cache.lock();
        if version.settings.instance_mode == InstanceMode::Reuse && !version.is_retired() {
            cache.insert(
                version.id,
                Cached {
                    version: version.clone(),
                    inst,
                    used: self.calls,
                },
            );
        }
        // After a swap, free the old version's instances (a Python guest's
        // is tens of MiB) instead of keeping them until the cache fills.
        let retirements = RETIREMENTS.load(Ordering::Acquire);
        if retirements != self.swept {
            self.swept = retirements;
            cache.retain(|_, c| !c.version.is_retired());
        }
        while cache.len() > CACHED_PER_WORKER {
            drop(evict_lru(&mut cache));
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
        data.call.batch_len = None;
        data.call.member = None;
        data.outbox.clear();
        data.cascade_bytes = 0;
        data.cascade_refused = None;
        data.log.reset();
    }

    /// After every call, answered or not: one marker line for the log it dropped.
    fn finish(inst: &mut Instance) {
        let data = inst.store.data_mut();
        let (lines, bytes) = data.log.reset();
        if lines > 0 || bytes > 0 {
            let counters = &data.settings.budget;
            counters.log_lines_dropped.fetch_add(lines, Ordering::Relaxed);
            counters.log_bytes_dropped.fetch_add(bytes, Ordering::Relaxed);
            tracing::warn!(
                handler = data.settings.name.as_str(),
                message = data.call.message_id.as_str(),
                dropped_lines = lines,
                dropped_bytes = bytes,
                log_bytes = data.budgets.log_bytes,
                log_lines = data.budgets.log_lines,
                "guest log over its per-call budget (node.budgets, or its tenant's): the rest of this call's log was dropped or cut"
            );
        }
    }

    /// A failure text cut to the error budget, counted when cut.
    fn cut_failure(&self, settings: &HandlerSettings, failure: &mut Failure) {
        let budget = settings.budgets.unwrap_or(self.runtime.options.budgets).error_bytes;
        let (Failure::Retry(text) | Failure::Reject(text)) = failure;
        if text.len() > budget {
            cut_text(text, budget);
            settings.budget.errors_cut.fetch_add(1, Ordering::Relaxed);
        }
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
            // The cause on the first line (what survives a cut), the backtrace after.
            _ => err
                .root_cause()
                .to_string()
                .lines()
                .next()
                .unwrap_or_default()
                .to_owned(),
        };
        // The guest's last words (a panic message) say more than the trap.
        if let Some(words) = data.stdio.as_ref().and_then(|t| t.last_words(512)) {
            detail.push_str("; guest output: ");
            detail.push_str(&words);
        }
        if kind == FaultKind::Trap && err.downcast_ref::<Trap>().is_none_or(|t| *t != Trap::StackOverflow) {
            detail.push('\n');
            detail.push_str(&format!("{err:#}"));
        }
        let budget = data.budgets.error_bytes;
        if detail.len() > budget {
            cut_text(&mut detail, budget);
            data.settings.budget.errors_cut.fetch_add(1, Ordering::Relaxed);
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
        let mut inst = match self.instance(version, cancel) {
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
        Self::finish(&mut inst);
        match r {
            Ok(mut result) => {
                let data = inst.store.data_mut();
                // A call whose publish was refused for the cascade byte budget is rejected
                // unless it failed by itself: the host never sends part of a call's cascades,
                // and a retry would publish the same bytes again.
                if let (Ok(()), Some(why)) = (&result, data.cascade_refused.take()) {
                    result = Err(Failure::Reject(why));
                }
                let mut outbox = std::mem::take(&mut data.outbox);
                let published = if result.is_ok() {
                    for (i, o) in outbox.iter_mut().enumerate() {
                        o.envelope.id = crate::envelope::cascade_id(msg, i);
                    }
                    outbox
                } else {
                    Vec::new()
                };
                if let Err(f) = &mut result {
                    self.cut_failure(&version.settings, f);
                }
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
                unattributed: Vec::new(),
            };
        };
        let mut inst = match self.instance(version, cancel) {
            Ok(i) => i,
            Err(f) => return BatchOutcome::Fault(f),
        };
        self.arm(&mut inst, version, first, cancel);
        inst.store.data_mut().call.batch_len = Some(u32::try_from(batch.len()).unwrap_or(u32::MAX));
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
        Self::finish(&mut inst);
        match r {
            // Over the cascade byte budget: the members are replayed one by one, so the
            // budget lands on the member that exceeds it.
            Ok(_) if inst.store.data().cascade_refused.is_some() => {
                let detail = inst.store.data_mut().cascade_refused.take().unwrap_or_default();
                self.keep(version, inst);
                BatchOutcome::Fault(Fault {
                    kind: FaultKind::Trap,
                    detail,
                })
            }
            Ok(mut results) if results.len() == batch.len() => {
                let outbox = std::mem::take(&mut inst.store.data_mut().outbox);
                for f in results.iter_mut().filter_map(|r| r.as_mut().err()) {
                    self.cut_failure(&version.settings, f);
                }
                self.keep(version, inst);
                let (published, unattributed) = split_outbox(outbox, batch, &results);
                BatchOutcome::Done {
                    results,
                    published,
                    unattributed,
                }
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

/// A batch call's outbox by member, with ids: each member's publishes, with
/// ids derived from that member's message (dropped for a member that did not
/// succeed), and those made before the first `begin-member`, with ids of the
/// batch's first member (see [`crate::envelope::batch_cascade_id`]).
fn split_outbox(
    outbox: Vec<Outgoing>,
    batch: &[Envelope],
    results: &[Result<(), Failure>],
) -> (Vec<Vec<Outgoing>>, Vec<Outgoing>) {
    let mut published: Vec<Vec<Outgoing>> = (0..batch.len()).map(|_| Vec::new()).collect();
    let mut unattributed = Vec::new();
    if outbox.is_empty() {
        return (published, unattributed);
    }
    // Every member's publishes are numbered (and so named) even when the
    // member failed, so that one that succeeds on a retry gets the same ids.
    let mut seen = vec![0usize; batch.len()];
    for mut o in outbox {
        let Some(i) = o.member.map(|m| m as usize).filter(|&i| i < batch.len()) else {
            if let Some(first) = batch.first() {
                o.envelope.id = crate::envelope::batch_cascade_id(first, unattributed.len());
            }
            unattributed.push(o);
            continue;
        };
        o.envelope.id = crate::envelope::cascade_id(&batch[i], seen[i]);
        seen[i] += 1;
        if results.get(i).is_some_and(Result::is_ok) {
            published[i].push(o);
        }
    }
    (published, unattributed)
}
