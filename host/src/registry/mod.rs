//! The handler registry: every configured handler's versions, deploys,
//! rollbacks and where they are kept.
//!
//! A version is a validated component (it compiles, implements the
//! `weir:handler/handler` world, instantiates within its limits, fits
//! `node.max_component_size`) identified by the sha256 of its bytes. A deploy
//! validates first and swaps only then, so a bad upload leaves the running
//! version serving. The swap is one write in the [`Router`]: calls already
//! running finish on the old version, the next call of every lane resolves
//! the new one, so within a group (one lane, one call at a time) no two
//! versions ever run at once and no message is lost or repeated by a swap.
//!
//! Versions are kept in the node's data directory (`node.data_dir`) or, in
//! a coordinated cluster, in a store every node shares ([`shared`]): the
//! coordinator database in `postgres` mode (LISTEN/NOTIFY, with a poll as a
//! backstop), buckets beside the coordination bucket in `nats-kv` mode
//! ([`kv`]: a watch, with the same poll). A deploy to one node reaches every
//! node. A version can also run as a canary on some slots only ([`canary`]).
//! Each activation records the one it replaced: a rollback activates that
//! one again, and rolling back again walks further back.
//!
//! Deploys and rollbacks wait in their caller's queue (one per tenant, one
//! for the operator), so one tenant's long compilations never delay
//! another's, and take a per-handler lock for the change itself. Storing is
//! all or nothing: a failed data-dir or database write changes neither the
//! registry nor the router. Directory grants are opened once per version
//! and checked by where they resolve ([`PinnedDir`]).
//!
//! The files: [`types`] (what callers see: grants, activations, errors),
//! [`deploy`] (deploy, rollback, the swap), [`canary`] (canaries by slot:
//! start, compare, promote, roll back, thresholds), [`pin`] (versions pinned
//! by a redrive, for the router), [`store`] (where versions are kept: the
//! data directory, the database), [`shared`] and [`kv`] (the cluster's
//! store, and its buckets), [`sync`] (following the cluster's deploys and
//! the watched directory); this one loads the configured handlers and
//! answers what the registry holds.

pub mod canary;
pub mod deploy;
pub mod kv;
pub mod pin;
pub mod settings;
pub mod shared;
pub mod store;
pub mod sync;
pub mod types;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use parking_lot::Mutex;

pub use types::{Activation, Caller, DeployError, Deployed, DirGrant, Grants, HandlerInfo, Upload, digest};

use crate::config::{self, Config};
use crate::router::Router;
use crate::runtime::grants::PinnedDir;
use crate::runtime::{self, HandlerSettings, HandlerVersion, Runtime};
use settings::{base_settings, config_grants, tenant_shares};
use store::{DirHistory, Store, write_component, write_dir_history};

pub use settings::{component_bytes, handler_settings};

/// Previously active versions kept compiled per handler, for instant rollbacks.
const KEEP_COMPILED: usize = 3;
/// How often a node of a coordinated cluster looks for deploys it was not notified of.
const SYNC_POLL: Duration = Duration::from_secs(2);
/// How often the components directory is scanned.
const WATCH_POLL: Duration = Duration::from_millis(500);

/// A configured handler: what stays the same across its versions.
struct Spec {
    topology: String,
    /// Slots in its topology (a canary runs on some of them).
    slots: u32,
    tenant: Option<String>,
    /// Limits, config table and shared admission; grants are per version.
    settings: HandlerSettings,
    /// The grants the config file gives it.
    config_grants: Grants,
    /// Whether each configured directory is read-only (`config_grants.dirs` order).
    config_read_only: Vec<bool>,
    /// The component as configured (file or bundled).
    config_bytes: Arc<[u8]>,
    config_origin: String,
}

/// What this node knows about one handler.
#[derive(Default)]
struct State {
    /// Every activation, oldest first (in `postgres` mode: those seen so far).
    activations: Vec<Activation>,
    /// Compiled versions with their grants: the current one and a few before it.
    compiled: Vec<(Grants, Arc<HandlerVersion>)>,
}

impl State {
    fn current(&self) -> Option<&Activation> {
        self.activations.last()
    }

    fn by_seq(&self, seq: i64) -> Option<&Activation> {
        self.activations.iter().find(|a| a.seq == seq)
    }

    fn chain(&self) -> Vec<Activation> {
        let mut out = Vec::new();
        let mut at = self.current().and_then(|a| a.previous);
        while let Some(seq) = at {
            let Some(a) = self.by_seq(seq) else { break };
            out.push(a.clone());
            at = a.previous;
        }
        out
    }

    fn compiled(&self, digest: &str, grants: &Grants) -> Option<&Arc<HandlerVersion>> {
        self.compiled
            .iter()
            .find(|(g, v)| v.digest == digest && g == grants)
            .map(|(_, v)| v)
    }

    fn keep(&mut self, grants: &Grants, v: Arc<HandlerVersion>) {
        self.compiled.retain(|(g, c)| !(c.digest == v.digest && g == grants));
        self.compiled.push((grants.clone(), v));
        if self.compiled.len() > KEEP_COMPILED {
            self.compiled.remove(0);
        }
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// How urgently a component is compiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Priority {
    /// At start, before any message: all the CPU there is.
    Start,
    /// While serving: only what the calls leave.
    Background,
}

/// Threads that compile deployed components at nice 10 (Cranelift compiles
/// functions in parallel on the rayon pool it runs in). `None` if they cannot start.
fn background_compiler() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("weir-compile-{i}"))
            .start_handler(|_| {
                let _ = crate::sched::nice_current_thread(10);
            })
            .build()
            .map_err(|e| tracing::warn!(error = %e, "no background compiler threads; compiling at normal priority"))
            .ok()
    })
    .as_ref()
}

/// The handlers of a node and their versions.
pub struct Registry {
    runtime: Arc<Runtime>,
    router: Arc<Router>,
    node: String,
    specs: BTreeMap<String, Spec>,
    tenants: HashMap<String, config::Tenant>,
    store: Store,
    max_size: usize,
    states: Mutex<HashMap<String, State>>,
    /// Deploy queues: one per caller (each tenant, the operator), so one
    /// tenant's deploys (compiling for minutes) never delay another's.
    queues: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// One change at a time per handler (a tenant's deploy, the operator's, a cluster sync).
    changing: HashMap<String, Arc<tokio::sync::Mutex<()>>>,
    swaps: std::sync::atomic::AtomicU64,
    refused: std::sync::atomic::AtomicU64,
    /// Versions compiled for pinned messages ([`pin`]), oldest first.
    pinned: Mutex<Vec<(Grants, Arc<HandlerVersion>)>>,
    /// One pinned version compiles at a time.
    pin_compiles: tokio::sync::Mutex<()>,
    /// Canaries this node runs, by handler ([`canary`]).
    canaries: Mutex<HashMap<String, canary::Running>>,
    /// How each handler's last canary ended.
    ended: Mutex<HashMap<String, canary::Ended>>,
    /// Canary ids outside `postgres` mode.
    canary_ids: std::sync::atomic::AtomicI64,
}

impl Registry {
    /// Load every configured handler — its deployed version when the data
    /// directory or the database has one, else the configured component —
    /// and install it in `router`. Fails on the first handler that cannot be
    /// loaded, naming it.
    pub async fn start(
        config: &Config,
        runtime: Arc<Runtime>,
        router: Arc<Router>,
        shared: Option<Arc<dyn shared::Shared>>,
    ) -> anyhow::Result<Arc<Self>> {
        let shares = tenant_shares(config);
        let mut specs = BTreeMap::new();
        for (i, h) in config.handler.iter().enumerate() {
            let bytes = component_bytes(h, i)?;
            specs.insert(
                h.name.clone(),
                Spec {
                    topology: h.topology.clone(),
                    slots: config
                        .topology
                        .iter()
                        .find(|t| t.name == h.topology)
                        .map_or(1, |t| t.slots),
                    tenant: h.tenant.clone(),
                    settings: base_settings(h, config, &shares),
                    config_grants: config_grants(h),
                    config_read_only: h.wasi.preopens.iter().map(|p| p.read_only).collect(),
                    config_bytes: Arc::from(bytes),
                    config_origin: format!("handler[{i}].component ({})", h.component.display()),
                },
            );
        }
        let store = match (shared, &config.node.data_dir) {
            (Some(shared), _) => Store::Shared(shared),
            (None, Some(dir)) => {
                for sub in ["components", "handlers"] {
                    std::fs::create_dir_all(dir.join(sub))
                        .with_context(|| format!("node.data_dir: cannot create {}", dir.join(sub).display()))?;
                }
                Store::Dir(dir.clone())
            }
            (None, None) => Store::Memory,
        };
        let specs_names: Vec<String> = specs.keys().cloned().collect();
        let registry = Arc::new(Self {
            runtime,
            router,
            node: config.node.name.clone(),
            specs,
            tenants: config.tenant.iter().map(|t| (t.name.clone(), t.clone())).collect(),
            store,
            max_size: usize::try_from(config.node.max_component_size.bytes()).unwrap_or(usize::MAX),
            states: Mutex::new(HashMap::new()),
            queues: Mutex::new(HashMap::new()),
            changing: specs_names.iter().map(|n| (n.clone(), Arc::default())).collect(),
            swaps: std::sync::atomic::AtomicU64::new(0),
            refused: std::sync::atomic::AtomicU64::new(0),
            pinned: Mutex::new(Vec::new()),
            pin_compiles: tokio::sync::Mutex::new(()),
            canaries: Mutex::new(HashMap::new()),
            ended: Mutex::new(HashMap::new()),
            canary_ids: std::sync::atomic::AtomicI64::new(0),
        });
        let resolver: Arc<dyn crate::router::PinResolver> = registry.clone();
        registry.router.set_resolver(Arc::downgrade(&resolver));
        for name in registry.specs.keys() {
            registry
                .restore(name)
                .await
                .with_context(|| format!("loading handler `{name}`"))?;
        }
        Ok(registry)
    }

    /// Each handler's metrics: (name, tenant, metrics).
    pub fn metrics(&self) -> Vec<(&str, Option<&str>, Arc<crate::observe::stats::HandlerMetrics>)> {
        self.specs
            .iter()
            .map(|(n, s)| (n.as_str(), s.tenant.as_deref(), s.settings.metrics.clone()))
            .collect()
    }

    /// A handler's recent log lines, if `caller` may see the handler.
    pub fn logs(&self, caller: &Caller, name: &str) -> Result<Arc<crate::observe::logring::LogRing>, DeployError> {
        self.authorize(caller, name).map(|s| s.settings.logs.clone())
    }

    /// Swaps so far (deploys and rollbacks that changed a version).
    pub fn swaps(&self) -> u64 {
        self.swaps.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Deploys refused so far (admin uploads and the components directory).
    pub fn refused(&self) -> u64 {
        self.refused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The tenant a handler is bound to.
    pub fn tenant_of(&self, name: &str) -> Option<Option<&str>> {
        self.specs.get(name).map(|s| s.tenant.as_deref())
    }

    /// Where versions are kept.
    pub fn kept_in(&self) -> &'static str {
        self.store.label()
    }

    /// The first version of a handler at start: the last one activated, when
    /// the data directory or the database has one, else the configured one.
    async fn restore(&self, name: &str) -> anyhow::Result<()> {
        let spec = &self.specs[name];
        let config_digest = digest(&spec.config_bytes);
        let mut activations = match &self.store {
            Store::Memory => Vec::new(),
            Store::Dir(dir) => {
                let path = dir.join("handlers").join(format!("{name}.json"));
                match std::fs::read(&path) {
                    Ok(b) => {
                        let h: DirHistory = serde_json::from_slice(&b)
                            .with_context(|| format!("node.data_dir: {} is not a handler history", path.display()))?;
                        if h.config_digest == config_digest {
                            h.activations
                        } else {
                            tracing::warn!(
                                handler = name,
                                config = %config_digest,
                                "the configured component changed since the last deploy: serving the configured one and starting a new history"
                            );
                            Vec::new()
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
                    Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
                }
            }
            Store::Shared(shared) => shared.activations(name).await?,
        };
        if activations.is_empty() {
            let base = Activation {
                seq: 1,
                digest: config_digest.clone(),
                size: spec.config_bytes.len() as u64,
                at_ms: now_ms(),
                source: "config".into(),
                node: self.node.clone(),
                previous: None,
                grants: spec.config_grants.clone(),
            };
            match &self.store {
                Store::Memory => activations.push(base),
                Store::Dir(dir) => {
                    write_component(dir, &config_digest, &spec.config_bytes)?;
                    activations.push(base);
                }
                // The first node to start records the configured version
                // for the whole cluster; the others serve what is there.
                Store::Shared(shared) => {
                    shared.activate(name, &spec.config_bytes, base).await?;
                    activations = shared.activations(name).await?;
                }
            }
        }
        let current = activations.last().cloned().context("no activation")?;
        let origin = if current.digest == config_digest {
            spec.config_origin.clone()
        } else {
            tracing::info!(handler = name, digest = %current.digest, source = %current.source, "serving the deployed version, not the configured component");
            format!("deployed version {} of `{name}`", current.digest)
        };
        let bytes = self.bytes_of(name, &current.digest).await?;
        let version = self
            .compile(name, &bytes, &current.grants, &origin, Priority::Start)
            .await?;
        tracing::info!(handler = name, digest = %version.digest, bytes = version.size, "handler loaded");
        let mut state = State {
            activations,
            compiled: Vec::new(),
        };
        state.keep(&current.grants, version.clone());
        if let Store::Dir(dir) = &self.store {
            write_dir_history(dir, name, &config_digest, &state.activations)?;
        }
        self.states.lock().insert(name.to_owned(), state);
        self.router.install(version.clone());
        let canary = match &self.store {
            Store::Memory => None,
            Store::Dir(dir) => store::read_canary(dir, name)?,
            Store::Shared(shared) => shared.live_canary(name).await?,
        };
        if let Some(c) = &canary {
            self.canary_ids.fetch_max(c.id, std::sync::atomic::Ordering::Relaxed);
            if let Err(e) = self.follow_canary(name, version, canary.clone()).await {
                tracing::error!(handler = name, digest = %c.digest, error = %format!("{e:#}"), "cannot run the stored canary; every slot runs the stable version");
            }
        }
        Ok(())
    }

    /// The component bytes of `digest`, from wherever versions are kept.
    async fn bytes_of(&self, name: &str, digest_hex: &str) -> anyhow::Result<Arc<[u8]>> {
        let spec = &self.specs[name];
        if digest(&spec.config_bytes) == digest_hex {
            return Ok(spec.config_bytes.clone());
        }
        match &self.store {
            Store::Memory => anyhow::bail!("version {digest_hex} of `{name}` is no longer kept (no node.data_dir)"),
            Store::Dir(dir) => {
                let path = dir.join("components").join(format!("{digest_hex}.wasm"));
                let b = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
                anyhow::ensure!(
                    digest(&b) == digest_hex,
                    "{} does not hold version {digest_hex} (its digest differs): the data directory was altered",
                    path.display()
                );
                Ok(Arc::from(b))
            }
            Store::Shared(shared) => shared.component(name, digest_hex).await.map(Arc::from),
        }
    }

    /// Validate and compile (off the async threads: compiling takes a
    /// while). While the node serves ([`Priority::Background`]) the compiler
    /// runs at a low CPU priority, so a deploy does not take the cores from
    /// the calls of the version it replaces.
    async fn compile(
        &self,
        name: &str,
        bytes: &Arc<[u8]>,
        grants: &Grants,
        origin: &str,
        priority: Priority,
    ) -> Result<Arc<HandlerVersion>, DeployError> {
        let settings = self.settings(name, grants)?;
        let (rt, bytes, origin) = (self.runtime.clone(), bytes.clone(), origin.to_owned());
        tokio::task::spawn_blocking(move || match (priority, background_compiler()) {
            (Priority::Background, Some(pool)) => pool.install(|| rt.load(&bytes, settings, &origin)),
            _ => rt.load(&bytes, settings, &origin),
        })
        .await
        .map_err(|e| DeployError::Invalid(format!("compiling a component: {e}")))?
        .map_err(|e| DeployError::Invalid(format!("{e:#}")))
    }

    /// The runtime settings of a version with `grants`. Each granted
    /// directory is opened here, once ([`PinnedDir`]): refused when it
    /// resolves outside the tenant's `allow.dirs`.
    fn settings(&self, name: &str, grants: &Grants) -> Result<HandlerSettings, DeployError> {
        let spec = &self.specs[name];
        let mut s = spec.settings.clone();
        s.wasi.env = grants
            .env
            .iter()
            .filter_map(|k| std::env::var(k).ok().map(|v| (k.clone(), v)))
            .collect();
        let within = spec.tenant.as_deref().map(|t| {
            self.tenants
                .get(t)
                .map(config::Tenant::resolved_allow_dirs)
                .unwrap_or_default()
        });
        // The configured grants keep the modes the config gives (an
        // operator's read-write directory); deployed grants are read-only.
        let configured = *grants == spec.config_grants;
        let mut refused = Vec::new();
        for (k, d) in grants.dirs.iter().enumerate() {
            let read_only = !configured || spec.config_read_only.get(k).copied().unwrap_or(true);
            match PinnedDir::open(&d.host, within.clone()) {
                Ok(pin) => s.wasi.preopens.push(runtime::Preopen {
                    host: pin.location().unwrap_or_else(|_| d.host.clone()),
                    guest: d.guest.clone(),
                    read_only,
                    pinned: Some(Arc::new(pin)),
                }),
                Err(e) => refused.push(format!("dirs[{k}] (guest {:?}): {e}", d.guest)),
            }
        }
        if refused.is_empty() {
            Ok(s)
        } else {
            Err(DeployError::Forbidden(format!(
                "grants refused: {}",
                refused.join("; ")
            )))
        }
    }

    fn authorize(&self, caller: &Caller, name: &str) -> Result<&Spec, DeployError> {
        let spec = self.specs.get(name);
        match (caller, spec) {
            (Caller::Operator, Some(spec)) => Ok(spec),
            (Caller::Operator, None) => Err(DeployError::UnknownHandler(name.to_owned())),
            (Caller::Tenant(t), Some(spec)) if spec.tenant.as_deref() == Some(t.as_str()) => Ok(spec),
            // Another tenant's handler and no handler at all answer alike,
            // so a tenant token cannot learn which names exist.
            (Caller::Tenant(_), _) => Err(DeployError::NotVisible(name.to_owned())),
        }
    }

    /// Whether `caller` may see and change handler `name`: `UnknownHandler`
    /// (operator) or `NotVisible` (tenant, whether it exists or not) if not.
    pub fn access(&self, caller: &Caller, name: &str) -> Result<(), DeployError> {
        self.authorize(caller, name).map(|_| ())
    }

    /// Whether `caller` may see handler `name`.
    pub fn visible(&self, caller: &Caller, name: &str) -> bool {
        self.authorize(caller, name).is_ok()
    }

    /// The deploy queue of `caller`: each tenant has its own, the operator too.
    fn queue(&self, caller: &Caller) -> Arc<tokio::sync::Mutex<()>> {
        let key = match caller {
            Caller::Operator => "operator".to_owned(),
            Caller::Tenant(t) => format!("tenant:{t}"),
        };
        self.queues.lock().entry(key).or_default().clone()
    }

    async fn changing(&self, name: &str) -> Option<tokio::sync::OwnedMutexGuard<()>> {
        match self.changing.get(name) {
            Some(m) => Some(m.clone().lock_owned().await),
            None => None,
        }
    }

    /// Hold `caller`'s deploy queue (tests: a deploy of that caller that
    /// compiles for ever). Deploys of other callers must not wait for it.
    #[doc(hidden)]
    pub async fn hold_queue(&self, caller: &Caller) -> tokio::sync::OwnedMutexGuard<()> {
        self.queue(caller).lock_owned().await
    }

    fn check_grants(&self, spec: &Spec, grants: &Grants) -> Result<(), DeployError> {
        let Some(tenant) = spec.tenant.as_deref() else {
            return Ok(());
        };
        let default = config::Tenant {
            name: tenant.to_owned(),
            ..config::Tenant::default()
        };
        let policy = self.tenants.get(tenant).unwrap_or(&default);
        let dirs: Vec<(String, PathBuf, bool)> = grants
            .dirs
            .iter()
            .map(|d| (d.guest.clone(), d.host.clone(), true))
            .collect();
        let refused = policy.check_grants(&grants.env, &dirs);
        if refused.is_empty() {
            Ok(())
        } else {
            let lines: Vec<String> = refused.into_iter().map(|(k, m)| format!("{k}: {m}")).collect();
            Err(DeployError::Forbidden(format!("grants refused: {}", lines.join("; "))))
        }
    }

    /// A copy of what `record` needs (the current seq) without holding the lock across awaits.
    fn snapshot(&self, name: &str) -> State {
        let states = self.states.lock();
        State {
            activations: states.get(name).and_then(State::current).cloned().into_iter().collect(),
            compiled: Vec::new(),
        }
    }

    /// Handlers `caller` may see, by name.
    pub fn list(&self, caller: &Caller) -> Vec<HandlerInfo> {
        let states = self.states.lock();
        self.specs
            .iter()
            .filter(|(name, _)| self.visible(caller, name))
            .filter_map(|(name, spec)| {
                let state = states.get(name)?;
                Some(HandlerInfo {
                    name: name.clone(),
                    topology: spec.topology.clone(),
                    tenant: spec.tenant.clone(),
                    current: state.current()?.clone(),
                    history: state.chain(),
                    canary: None,
                    last_canary: None,
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|mut h| {
                h.canary = self.canary(&h.name);
                h.last_canary = self.last_canary(&h.name);
                h
            })
            .collect()
    }
}
