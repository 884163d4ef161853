//! The [`Runtime`]: the engine (pooling allocator, epoch interruption), the linker with the host
//! imports, the epoch ticker, and loading a component into a [`HandlerVersion`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use sha2::Digest as _;
use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use super::blocking;
use super::host::HostState;
use super::instance::{CacheMap, Instance};
use super::options::{EPOCH_TICK, RuntimeOptions, cut_text};
use super::settings::HandlerSettings;
use super::version::{HandlerVersion, NEXT_VERSION, Pre};
use crate::bindings::{Handler, HandlerPre, v0_1, v0_3};
use crate::observe::CallObserver;

/// A compile in progress: a line when it starts (a large component takes
/// seconds, Python and JavaScript ones a minute on a busy machine) and one
/// with its time when it ends.
struct Compiling<'a> {
    origin: &'a str,
    started: std::time::Instant,
    functions: &'a super::fncache::FunctionCache,
    /// The function cache's (hits, misses) at the start.
    counts: (u64, u64),
}

impl<'a> Compiling<'a> {
    fn start(origin: &'a str, size: usize, cached: bool, functions: &'a super::fncache::FunctionCache) -> Self {
        let size = match size {
            n if n < 1 << 20 => format!("{:.1} KiB", n as f64 / 1024.0),
            n => format!("{:.1} MiB", n as f64 / (1 << 20) as f64),
        };
        if cached {
            tracing::info!(component = origin, "compiling {origin} ({size}); cached after this");
        } else {
            tracing::info!(component = origin, "compiling {origin} ({size})");
        }
        Self {
            origin,
            started: std::time::Instant::now(),
            functions,
            counts: functions.counts(),
        }
    }
}

impl Drop for Compiling<'_> {
    fn drop(&mut self) {
        let secs = self.started.elapsed().as_secs_f64();
        let (hits, misses) = self.functions.counts();
        let (hits, misses) = (hits - self.counts.0, misses - self.counts.1);
        tracing::info!(
            component = self.origin,
            seconds = secs,
            functions_compiled = misses,
            functions_reused = hits,
            "compiled {} in {secs:.1} s ({misses} function(s) compiled, {hits} found compiled already)",
            self.origin
        );
    }
}

/// Longest compile error kept in a refused load's answer.
const LOAD_ERROR_BYTES: usize = 2048;

/// The engine, the linker and the epoch ticker.
pub struct Runtime {
    pub(super) engine: Engine,
    pub(super) linker: Linker<HostState>,
    pub(super) options: RuntimeOptions,
    pub(super) observer: Option<Arc<dyn CallObserver>>,
    pub(super) ticker_stop: Arc<AtomicBool>,
    /// Every executor's instance cache, so a full pool can evict idle instances anywhere.
    pub(super) caches: parking_lot::Mutex<Vec<std::sync::Weak<parking_lot::Mutex<CacheMap>>>>,
    /// Compiled functions, by their contents, for the next version's compile.
    pub(super) functions: Arc<super::fncache::FunctionCache>,
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
        // A Rust guest's stack, data and first heap pages.
        const MEMORY_KEEP_RESIDENT: usize = 2 << 20;
        const TABLE_KEEP_RESIDENT: usize = 64 << 10;
        let mut pool = PoolingAllocationConfig::default();
        pool.total_component_instances(options.pool_instances)
            .total_core_instances(options.pool_instances.saturating_mul(CORE_INSTANCES_PER_COMPONENT))
            .max_core_instances_per_component(CORE_INSTANCES_PER_COMPONENT)
            .total_memories(options.pool_instances * 2)
            .total_tables(options.pool_instances * 4)
            .table_elements(TABLE_ELEMENTS)
            .max_core_instance_size(CORE_INSTANCE_SIZE)
            .max_component_instance_size(COMPONENT_INSTANCE_SIZE)
            .max_memory_size(options.max_memory)
            // A slot returned to the pool is reset by `memset` of the pages
            // the instance touched (found with PAGEMAP_SCAN where the kernel
            // has it, 6.7+), up to these sizes, instead of `madvise`: a
            // fresh instance per message then costs no page faults and no
            // TLB shootdown on the other cores. Reset all the same, so no
            // byte of one instance is visible to the next.
            .linear_memory_keep_resident(MEMORY_KEEP_RESIDENT)
            .table_keep_resident(TABLE_KEEP_RESIDENT)
            .pagemap_scan(wasmtime::Enabled::Auto);
        let mut cfg = wasmtime::Config::new();
        cfg.wasm_component_model(true)
            .epoch_interruption(true)
            .consume_fuel(options.fuel)
            .concurrency_support(false)
            .max_wasm_stack(options.max_wasm_stack)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        // A new version compiles only the functions it changed (see `fncache`).
        let functions = Arc::new(super::fncache::FunctionCache::new(super::fncache::DEFAULT_CAP));
        cfg.enable_incremental_compilation(functions.clone())
            .map_err(anyhow::Error::from)
            .context("configuring the incremental compilation cache")?;
        let engine = Engine::new(&cfg)
            .map_err(anyhow::Error::from)
            .context("configuring the wasmtime engine")?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)
            .map_err(anyhow::Error::from)
            .context("linking WASI")?;
        blocking::shadow_poll(&mut linker)?;
        blocking::shadow_streams(&mut linker)?;
        Handler::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
            .map_err(anyhow::Error::from)
            .context("linking weir:handler/host@0.2.0")?;
        v0_1::Handler::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
            .map_err(anyhow::Error::from)
            .context("linking weir:handler/host@0.1.0")?;
        v0_3::Handler::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
            .map_err(anyhow::Error::from)
            .context("linking weir:handler/host@0.3.0")?;

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
            functions,
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
        if let Some(why) = not_binary_component(bytes) {
            anyhow::bail!("{origin} is not a valid WebAssembly component: {why}");
        }
        // The parser's error may quote the upload (a run of zeros): cut it,
        // so a bad upload's answer and log line stay small.
        let (component, compiled_in) = self.compile(bytes, &digest, origin).map_err(|e| {
            let mut why = format!("{e:#}");
            cut_text(&mut why, LOAD_ERROR_BYTES);
            anyhow::anyhow!("{origin} is not a valid WebAssembly component: {why}")
        })?;
        let pre = self.linker.instantiate_pre(&component).map_err(anyhow::Error::from);
        let pre = pre
            .and_then(|pre| match HandlerPre::new(pre.clone()) {
                Ok(v2) => Ok(Pre::V2(v2)),
                Err(e) => v0_3::HandlerPre::new(pre.clone())
                    .map(Pre::V3)
                    .or_else(|_| v0_1::HandlerPre::new(pre).map(Pre::V1))
                    .map_err(|_| e.into()),
            })
            .with_context(|| {
                format!(
                    "{origin} does not implement the weir:handler/handler world, version 0.3.0, 0.2.0 or 0.1.0 \
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
            compiled_in,
            settings: Arc::new(settings),
            tally: Default::default(),
            tallying: AtomicBool::new(false),
            failed: Default::default(),
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

    /// The component, and how long compiling it took (`None`: from the cache).
    fn compile(&self, bytes: &[u8], digest: &str, origin: &str) -> anyhow::Result<(Component, Option<Duration>)> {
        let Some(dir) = &self.options.cache_dir else {
            let compiling = Compiling::start(origin, bytes.len(), false, &self.functions);
            let c = Component::new(&self.engine, bytes).map_err(anyhow::Error::from)?;
            return Ok((c, Some(compiling.started.elapsed())));
        };
        let mut hasher = std::hash::DefaultHasher::new();
        std::hash::Hash::hash(&self.engine.precompile_compatibility_hash(), &mut hasher);
        let key = std::hash::Hasher::finish(&hasher);
        let path = dir.join(format!("{digest}-{key:016x}.cwasm"));
        if path.exists() {
            // SAFETY: the file was written by `precompile_component` of an
            // engine with the same compatibility hash, into the node's data
            // directory or the user's cache (`weir run` without a data
            // directory, `weir call`), under the digest of the bytes being
            // loaded: whoever can write there runs as this user already.
            match unsafe { Component::deserialize_file(&self.engine, &path) } {
                Ok(c) => return Ok((c, None)),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "ignoring unusable compiled-code cache entry")
                }
            }
        }
        let compiling = Compiling::start(origin, bytes.len(), true, &self.functions);
        let code = self.engine.precompile_component(bytes).map_err(anyhow::Error::from)?;
        let took = compiling.started.elapsed();
        drop(compiling);
        // The cache is an optimisation: a directory that cannot be written
        // (a read-only home, a full disk) costs the next start a compile, not this one.
        let tmp = path.with_extension(format!("{}.tmp", uuid::Uuid::new_v4()));
        let kept = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&tmp, &code))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = kept {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(dir = %dir.display(), error = %e, "cannot keep compiled code in the cache; it is compiled again next start");
        }
        // SAFETY: just produced by this engine's `precompile_component`.
        let c = unsafe { Component::deserialize(&self.engine, &code).map_err(anyhow::Error::from)? };
        Ok((c, Some(took)))
    }
}

/// Why `bytes` are not a binary component, before any parser sees them (the
/// engine would also take WAT text, and a text file or random bytes would
/// get a text parser's error): `None` when they start like one.
pub fn not_binary_component(bytes: &[u8]) -> Option<String> {
    const MAGIC: &[u8] = b"\0asm";
    const COMPONENT: [u8; 4] = [0x0d, 0x00, 0x01, 0x00];
    if !bytes.starts_with(MAGIC) {
        let looks = match std::str::from_utf8(&bytes[..bytes.len().min(512)]) {
            Ok(_) if bytes.is_empty() => "it is empty",
            Ok(_) => "it looks like text",
            Err(_) => "its first bytes are not \\0asm",
        };
        return Some(format!(
            "it is not WebAssembly at all ({looks}); a handler is the binary component `weir build` makes (NAME.wasm)"
        ));
    }
    match bytes.get(4..8) {
        Some(v) if v == COMPONENT => None,
        Some([1, 0, 0, 0]) => Some(
            "it is a core WebAssembly module, not a component: build it for wasm32-wasip2 (`weir build`), or \
             make a component of it with `wasm-tools component new`"
                .to_owned(),
        ),
        _ => Some("its WebAssembly header is cut short or of an unknown version".to_owned()),
    }
}
