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
//! `postgres` cluster mode, in the coordinator database, where a deploy to
//! one node reaches every node (LISTEN/NOTIFY, with a poll as a backstop).
//! Each activation records the one it replaced: a rollback activates that
//! one again, and rolling back again walks further back.
//!
//! Deploys and rollbacks wait in their caller's queue (one per tenant, one
//! for the operator), so one tenant's long compilations never delay
//! another's, and take a per-handler lock for the change itself. Storing is
//! all or nothing: a failed data-dir or database write changes neither the
//! registry nor the router. Directory grants are opened once per version
//! and checked by where they resolve ([`PinnedDir`]).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use sha2::Digest as _;
use sqlx::PgPool;
use tokio::sync::watch;

use crate::config::{self, Config};
use crate::router::Router;
use crate::runtime::{self, HandlerSettings, HandlerVersion, Runtime, TenantShare};

/// Previously active versions kept compiled per handler, for instant rollbacks.
const KEEP_COMPILED: usize = 3;
/// How often a `postgres`-mode node looks for deploys it was not notified of.
const SYNC_POLL: Duration = Duration::from_secs(2);
/// How often the components directory is scanned.
const WATCH_POLL: Duration = Duration::from_millis(500);

/// Capabilities of one version beyond clocks and random.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grants {
    /// Host environment variables the guest sees (names; values are read at load).
    #[serde(default)]
    pub env: Vec<String>,
    /// Host directories the guest may read.
    #[serde(default)]
    pub dirs: Vec<DirGrant>,
}

/// A read-only directory grant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirGrant {
    /// The path the guest sees.
    pub guest: String,
    /// The host directory.
    pub host: PathBuf,
}

/// A directory grant opened once, when its version is loaded (deploy,
/// start, rollback, a cluster sync). The guest is given this handle (as
/// `/proc/self/fd/N`, which opens the very directory the handle holds,
/// never walking the granted path again), so a symlink swapped after the
/// check cannot redirect the grant: there is no window between check and
/// open. Where the handle is now (its `/proc/self/fd` link) is checked
/// against the tenant's allow list (symlinks resolved) when it is opened
/// and again at every instantiation, so a granted directory moved out of
/// the allow list later is not given to new instances either. Linux only.
pub struct PinnedDir {
    dir: std::fs::File,
    granted: PathBuf,
    /// The tenant's `allow.dirs`, resolved; `None`: no allow list (a handler of no tenant).
    within: Option<Vec<PathBuf>>,
}

impl std::fmt::Debug for PinnedDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedDir")
            .field("granted", &self.granted)
            .field("fd", &std::os::fd::AsRawFd::as_raw_fd(&self.dir))
            .finish()
    }
}

/// Two pins are equal only when they are the same handle.
impl PartialEq for PinnedDir {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}
impl Eq for PinnedDir {}

impl PinnedDir {
    /// Open `granted` (following symlinks) and check where the handle landed.
    pub fn open(granted: &Path, within: Option<Vec<PathBuf>>) -> Result<Self, String> {
        let dir = std::fs::File::open(granted).map_err(|e| format!("{}: cannot be opened: {e}", granted.display()))?;
        let is_dir = dir.metadata().map(|m| m.is_dir()).unwrap_or(false);
        if !is_dir {
            return Err(format!("{}: not a directory; accepted: a directory", granted.display()));
        }
        let pin = Self {
            dir,
            granted: granted.to_owned(),
            within,
        };
        pin.location()?;
        Ok(pin)
    }

    fn fd_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&self.dir)))
    }

    /// Where the directory is now, refused when that is outside the allow list.
    pub fn location(&self) -> Result<PathBuf, String> {
        let now = std::fs::read_link(self.fd_path()).map_err(|e| {
            format!(
                "{}: cannot tell where the opened directory is: {e}",
                self.granted.display()
            )
        })?;
        if let Some(roots) = &self.within
            && !roots.iter().any(|r| config::is_within(&now, r))
        {
            return Err(format!(
                "{} resolves to {}, which is not within a directory the tenant may grant; accepted: one of {:?} \
                 (tenant.allow.dirs, symlinks resolved) or below",
                self.granted.display(),
                now.display(),
                roots
            ));
        }
        Ok(now)
    }

    /// The path that opens this very directory, after checking where it is now.
    pub fn open_path(&self) -> Result<PathBuf, String> {
        self.location()?;
        Ok(self.fd_path())
    }

    /// The path the grant named.
    pub fn granted(&self) -> &Path {
        &self.granted
    }
}

/// One deploy or rollback that made a version current.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Activation {
    /// Increasing per handler (per cluster in `postgres` mode).
    pub seq: i64,
    /// sha256 of the component, hex.
    pub digest: String,
    /// Component size in bytes.
    pub size: u64,
    /// Milliseconds since the Unix epoch.
    pub at_ms: i64,
    /// `config`, `admin`, `watch` or `rollback`.
    pub source: String,
    /// The node that made it.
    pub node: String,
    /// The activation it replaced.
    pub previous: Option<i64>,
    /// What the version was granted.
    #[serde(default)]
    pub grants: Grants,
}

/// Why a deploy or rollback was refused. The running version stays.
#[derive(Debug, thiserror::Error)]
pub enum DeployError {
    /// No `[[handler]]` of that name.
    #[error("no handler named `{0}` is configured on this node")]
    UnknownHandler(String),
    /// A tenant token asked for a handler that is not its tenant's, or for
    /// none at all: both answer alike (404, the same text).
    #[error("no handler named `{0}` is visible to this token (a tenant token sees only its own tenant's handlers)")]
    NotVisible(String),
    /// The caller may not change this handler, or asked for grants beyond its tenant's.
    #[error("{0}")]
    Forbidden(String),
    /// Larger than `node.max_component_size`.
    #[error("component is {size} bytes; node.max_component_size allows at most {max}")]
    TooLarge {
        /// Upload size.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// It does not compile, is not a component, exports another world or cannot instantiate.
    #[error("{0}")]
    Invalid(String),
    /// A rollback with nothing to roll back to.
    #[error("{0}")]
    NoPrevious(String),
    /// The data directory or the database failed; nothing was swapped.
    #[error("{0:#}")]
    Store(anyhow::Error),
}

/// The component a deploy brings.
#[derive(Debug)]
pub enum Upload {
    /// In memory.
    Bytes(Vec<u8>),
    /// In a file of `size` bytes (the admin listener's spooled upload).
    File {
        /// The file.
        path: PathBuf,
        /// Its length.
        size: usize,
    },
}

impl Upload {
    fn size(&self) -> usize {
        match self {
            Upload::Bytes(b) => b.len(),
            Upload::File { size, .. } => *size,
        }
    }
}

/// What a deploy or rollback did.
#[derive(Debug, Clone, Serialize)]
pub struct Deployed {
    /// The handler.
    pub handler: String,
    /// The version now current.
    pub digest: String,
    /// The version it replaced.
    pub previous: Option<String>,
    /// False when the upload was the current version already.
    pub swapped: bool,
    /// Where the version is kept: `data-dir`, `database` or `memory` (lost at restart).
    pub kept_in: &'static str,
    /// Milliseconds from receiving the request to the swap (validation and compilation).
    pub took_ms: u64,
}

/// A handler as `GET /v1/handlers` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct HandlerInfo {
    /// Its name.
    pub name: String,
    /// Its topology.
    pub topology: String,
    /// The tenant it is bound to (`null`: any tenant without a binding of its own).
    pub tenant: Option<String>,
    /// The current version.
    pub current: Activation,
    /// Earlier activations, newest first (what rollbacks would walk back to).
    pub history: Vec<Activation>,
}

/// A configured handler: what stays the same across its versions.
struct Spec {
    topology: String,
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

/// Where versions are kept.
enum Store {
    /// Nowhere: deploys last until the process ends.
    Memory,
    /// `node.data_dir`.
    Dir(PathBuf),
    /// The coordinator database (`postgres` cluster mode).
    Postgres(PgPool),
}

impl Store {
    fn label(&self) -> &'static str {
        match self {
            Store::Memory => "memory",
            Store::Dir(_) => "data-dir",
            Store::Postgres(_) => "database",
        }
    }
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

/// sha256 of `bytes`, hex.
pub fn digest(bytes: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(bytes))
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
                // SAFETY: setpriority on the calling thread (who = 0) only.
                #[cfg(target_os = "linux")]
                unsafe {
                    libc::setpriority(libc::PRIO_PROCESS, 0, 10);
                }
            })
            .build()
            .map_err(|e| tracing::warn!(error = %e, "no background compiler threads; compiling at normal priority"))
            .ok()
    })
    .as_ref()
}

/// Who is asking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// The operator token: everything.
    Operator,
    /// A tenant token: that tenant's handlers only.
    Tenant(String),
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
}

/// The admission a tenant's handlers share, one per `[[tenant]]`.
fn tenant_shares(config: &Config) -> HashMap<String, TenantShare> {
    config
        .tenant
        .iter()
        .map(|t| {
            let share = TenantShare {
                name: Arc::from(t.name.as_str()),
                permits: t
                    .limits
                    .concurrency
                    .map(|n| Arc::new(tokio::sync::Semaphore::new(n.max(1) as usize))),
                log_rate: tenant_log_rate(t),
            };
            (t.name.clone(), share)
        })
        .collect()
}

/// A tenant's log budget over time, when it sets one.
fn tenant_log_rate(t: &config::Tenant) -> Option<Arc<runtime::stdio::LogRate>> {
    let (bytes, lines) = (t.budgets.log_bytes_per_second, t.budgets.log_lines_per_second);
    if bytes.is_none() && lines.is_none() {
        return None;
    }
    Some(Arc::new(runtime::stdio::LogRate::new(
        Arc::from(t.name.as_str()),
        bytes.map(|b| b.bytes()),
        lines.map(u64::from),
    )))
}

/// The runtime settings of a configured handler, without grants: limits
/// (capped by its tenant's), config table, admission shared by its versions.
fn base_settings(h: &config::Handler, config: &Config, shares: &HashMap<String, TenantShare>) -> HandlerSettings {
    let mut s = HandlerSettings::new(&h.name);
    s.memory_limit = usize::try_from(h.limits.memory.bytes()).unwrap_or(usize::MAX);
    s.timeout = h.limits.timeout;
    s.instance_mode = match h.instance_mode {
        config::InstanceMode::Reuse => runtime::InstanceMode::Reuse,
        config::InstanceMode::Fresh => runtime::InstanceMode::Fresh,
    };
    s.config = h.config.clone();
    s.max_instances = h.limits.instances as usize;
    s.permits = Some(Arc::new(tokio::sync::Semaphore::new(s.max_instances.max(1))));
    s.fuel = h.limits.fuel;
    s.wasi.inherit_stdio = h.wasi.inherit_stdio;
    s.wasi.network = h.wasi.network;
    if let Some(t) = h.tenant.as_deref() {
        s.tenant = Some(shares.get(t).cloned().unwrap_or_else(|| TenantShare {
            name: Arc::from(t),
            permits: None,
            log_rate: None,
        }));
        if let Some(tenant) = config.tenant(t) {
            s.budgets = config.call_budgets(Some(tenant));
            if let Some(m) = tenant.limits.memory {
                s.memory_limit = s.memory_limit.min(usize::try_from(m.bytes()).unwrap_or(usize::MAX));
            }
            if let Some(d) = tenant.limits.timeout {
                s.timeout = s.timeout.min(d);
            }
            if let Some(f) = tenant.limits.fuel {
                s.fuel = Some(s.fuel.map_or(f, |x| x.min(f)));
            }
        }
    }
    s
}

fn config_grants(h: &config::Handler) -> Grants {
    Grants {
        env: h.wasi.env.clone(),
        dirs: h
            .wasi
            .preopens
            .iter()
            .map(|p| DirGrant {
                guest: p.guest.clone(),
                host: p.host.clone(),
            })
            .collect(),
    }
}

/// Read a handler's configured component: a file, or `bundled:NAME`.
pub fn component_bytes(h: &config::Handler, index: usize) -> anyhow::Result<Vec<u8>> {
    let raw = h.component.to_string_lossy();
    if let Some(name) = raw.rsplit("bundled:").next().filter(|_| raw.contains("bundled:")) {
        return crate::node::bundled::get(name).map(<[u8]>::to_vec).with_context(|| {
            format!("handler[{index}].component = {raw:?}: no bundled component called `{name}` (accepted: bundled:orders, bundled:noop, or a file path)")
        });
    }
    std::fs::read(&h.component)
        .with_context(|| format!("handler[{index}].component: cannot read {}", h.component.display()))
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
        database: Option<PgPool>,
    ) -> anyhow::Result<Arc<Self>> {
        let shares = tenant_shares(config);
        let mut specs = BTreeMap::new();
        for (i, h) in config.handler.iter().enumerate() {
            let bytes = component_bytes(h, i)?;
            specs.insert(
                h.name.clone(),
                Spec {
                    topology: h.topology.clone(),
                    tenant: h.tenant.clone(),
                    settings: base_settings(h, config, &shares),
                    config_grants: config_grants(h),
                    config_read_only: h.wasi.preopens.iter().map(|p| p.read_only).collect(),
                    config_bytes: Arc::from(bytes),
                    config_origin: format!("handler[{i}].component ({})", h.component.display()),
                },
            );
        }
        let store = match (database, &config.node.data_dir) {
            (Some(pool), _) => Store::Postgres(pool),
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
        });
        for name in registry.specs.keys() {
            registry
                .restore(name)
                .await
                .with_context(|| format!("loading handler `{name}`"))?;
        }
        Ok(registry)
    }

    /// Each handler's metrics: (name, tenant, metrics).
    pub fn metrics(&self) -> Vec<(&str, Option<&str>, Arc<crate::stats::HandlerMetrics>)> {
        self.specs
            .iter()
            .map(|(n, s)| (n.as_str(), s.tenant.as_deref(), s.settings.metrics.clone()))
            .collect()
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
            Store::Postgres(pool) => pg::activations(pool, name).await?,
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
                Store::Postgres(pool) => {
                    pg::activate(pool, name, &spec.config_bytes, base).await?;
                    activations = pg::activations(pool, name).await?;
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
        self.router.install(version);
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
            Store::Postgres(pool) => pg::component(pool, name, digest_hex).await.map(Arc::from),
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

    /// Store a version and an activation of it; returns the activation.
    #[allow(clippy::too_many_arguments)]
    async fn record(
        &self,
        name: &str,
        state: &State,
        v: &HandlerVersion,
        bytes: &[u8],
        grants: &Grants,
        source: &str,
        previous: Option<i64>,
    ) -> anyhow::Result<Activation> {
        let mut a = Activation {
            seq: state.current().map_or(1, |c| c.seq + 1),
            digest: v.digest.clone(),
            size: v.size as u64,
            at_ms: now_ms(),
            source: source.to_owned(),
            node: self.node.clone(),
            previous,
            grants: grants.clone(),
        };
        match &self.store {
            Store::Memory => {}
            Store::Dir(dir) => write_component(dir, &v.digest, bytes)?,
            Store::Postgres(pool) => a = pg::activate(pool, name, bytes, a).await?,
        }
        Ok(a)
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

    /// Validate `bytes` and make them the current version of `name`.
    /// `grants`: the new version's capabilities (`None`: what the config gives).
    pub async fn deploy(
        &self,
        caller: &Caller,
        name: &str,
        bytes: Vec<u8>,
        grants: Option<Grants>,
        source: &str,
    ) -> Result<Deployed, DeployError> {
        self.deploy_from(caller, name, Upload::Bytes(bytes), grants, source)
            .await
    }

    /// [`Registry::deploy`] from bytes in memory or a file (an upload
    /// streamed to disk, read only when its turn in the caller's queue comes).
    pub async fn deploy_from(
        &self,
        caller: &Caller,
        name: &str,
        upload: Upload,
        grants: Option<Grants>,
        source: &str,
    ) -> Result<Deployed, DeployError> {
        let r = self.deploy_inner(caller, name, upload, grants, source).await;
        if r.is_err() {
            self.refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        r
    }

    async fn deploy_inner(
        &self,
        caller: &Caller,
        name: &str,
        upload: Upload,
        grants: Option<Grants>,
        source: &str,
    ) -> Result<Deployed, DeployError> {
        let started = std::time::Instant::now();
        let spec = self.authorize(caller, name)?;
        let size = upload.size();
        if size > self.max_size {
            return Err(DeployError::TooLarge {
                size,
                max: self.max_size,
            });
        }
        let grants = grants.unwrap_or_else(|| spec.config_grants.clone());
        self.check_grants(spec, &grants)?;
        let _queue = self.queue(caller).lock_owned().await;
        let _changing = self.changing(name).await;
        let bytes = match upload {
            Upload::Bytes(b) => b,
            Upload::File { path, .. } => tokio::task::spawn_blocking(move || std::fs::read(&path))
                .await
                .map_err(|e| DeployError::Store(anyhow::anyhow!("reading the upload: {e}")))?
                .map_err(|e| DeployError::Store(anyhow::Error::from(e).context("reading the upload back from disk")))?,
        };
        if bytes.len() > self.max_size {
            return Err(DeployError::TooLarge {
                size: bytes.len(),
                max: self.max_size,
            });
        }
        let bytes: Arc<[u8]> = Arc::from(bytes);
        let new_digest = digest(&bytes);
        let (current, same) = {
            let states = self.states.lock();
            let cur = states.get(name).and_then(State::current).cloned();
            let same = cur
                .as_ref()
                .is_some_and(|c| c.digest == new_digest && c.grants == grants);
            (cur, same)
        };
        if same {
            return Ok(Deployed {
                handler: name.to_owned(),
                digest: new_digest,
                previous: None,
                swapped: false,
                kept_in: self.store.label(),
                took_ms: elapsed_ms(started),
            });
        }
        let origin = format!("upload for handler `{name}` ({} bytes)", bytes.len());
        let version = self
            .compile(name, &bytes, &grants, &origin, Priority::Background)
            .await?;
        self.commit(name, version, &bytes, &grants, source, current.as_ref().map(|c| c.seq))
            .await?;
        Ok(Deployed {
            handler: name.to_owned(),
            digest: new_digest,
            previous: current.map(|c| c.digest),
            swapped: true,
            kept_in: self.store.label(),
            took_ms: elapsed_ms(started),
        })
    }

    /// Make the version before the current one current again.
    pub async fn rollback(&self, caller: &Caller, name: &str) -> Result<Deployed, DeployError> {
        let started = std::time::Instant::now();
        self.authorize(caller, name)?;
        let _queue = self.queue(caller).lock_owned().await;
        let _changing = self.changing(name).await;
        if let Store::Postgres(pool) = &self.store {
            // Another node may have deployed since: roll back the cluster's current.
            self.sync_one(pool, name).await.map_err(DeployError::Store)?;
        }
        let (current, target) = {
            let states = self.states.lock();
            let state = states.get(name);
            let current = state.and_then(State::current).cloned();
            let target = current
                .as_ref()
                .and_then(|c| c.previous)
                .and_then(|p| state.and_then(|s| s.by_seq(p)).cloned());
            (current, target)
        };
        let (Some(current), Some(target)) = (current, target) else {
            return Err(DeployError::NoPrevious(format!(
                "handler `{name}` has no earlier version to roll back to"
            )));
        };
        let version = {
            let kept = self
                .states
                .lock()
                .get(name)
                .and_then(|s| s.compiled(&target.digest, &target.grants).cloned());
            match kept {
                Some(v) => v.reissue(),
                None => {
                    let bytes = self.bytes_of(name, &target.digest).await.map_err(DeployError::Store)?;
                    self.compile(
                        name,
                        &bytes,
                        &target.grants,
                        &format!("version {}", target.digest),
                        Priority::Background,
                    )
                    .await?
                }
            }
        };
        let bytes: Arc<[u8]> = match &self.store {
            Store::Postgres(_) => Arc::from(Vec::new()), // already stored
            _ => self
                .bytes_of(name, &target.digest)
                .await
                .unwrap_or_else(|_| Arc::from(Vec::new())),
        };
        self.commit(name, version, &bytes, &target.grants, "rollback", target.previous)
            .await?;
        Ok(Deployed {
            handler: name.to_owned(),
            digest: target.digest,
            previous: Some(current.digest),
            swapped: true,
            kept_in: self.store.label(),
            took_ms: elapsed_ms(started),
        })
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

    /// Store `version` and its activation, then swap it in. Nothing is
    /// swapped when storing fails.
    async fn commit(
        &self,
        name: &str,
        version: Arc<HandlerVersion>,
        bytes: &[u8],
        grants: &Grants,
        source: &str,
        previous: Option<i64>,
    ) -> Result<(), DeployError> {
        let state = self.snapshot(name);
        let activation = self
            .record(name, &state, &version, bytes, grants, source, previous)
            .await
            .map_err(DeployError::Store)?;
        self.activate(name, version, activation).map_err(DeployError::Store)
    }

    /// Swap: remember the activation and install `version`. In the data
    /// directory the history is written first: when that write fails,
    /// neither the registry nor the router changes (all or nothing), so the
    /// same deploy can be made again.
    fn activate(&self, name: &str, version: Arc<HandlerVersion>, activation: Activation) -> anyhow::Result<()> {
        let mut states = self.states.lock();
        let state = states.entry(name.to_owned()).or_default();
        if let Store::Dir(dir) = &self.store {
            let config_digest = digest(&self.specs[name].config_bytes);
            let mut next = state.activations.clone();
            next.push(activation.clone());
            write_dir_history(dir, name, &config_digest, &next)
                .context("storing the deploy in node.data_dir failed; nothing was swapped")?;
        }
        state.activations.push(activation.clone());
        state.keep(&activation.grants, version.clone());
        drop(states);
        self.swap_in(name, version, &activation);
        Ok(())
    }

    /// The swap itself: install `version` in the router (the old one is
    /// retired), count it, say so.
    fn swap_in(&self, name: &str, version: Arc<HandlerVersion>, activation: &Activation) {
        let old = self.router.install(version);
        self.swaps.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(
            handler = name,
            digest = %activation.digest,
            previous = old.as_ref().map(|o| o.digest.as_str()).unwrap_or("none"),
            source = %activation.source,
            node = %activation.node,
            "handler version swapped"
        );
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
                })
            })
            .collect()
    }

    /// Follow deploys made on other nodes (`postgres` mode) until `stop`.
    pub fn follow(self: &Arc<Self>, stop: watch::Receiver<bool>) -> Option<tokio::task::JoinHandle<()>> {
        let Store::Postgres(pool) = &self.store else {
            return None;
        };
        let (me, pool) = (self.clone(), pool.clone());
        Some(tokio::spawn(async move { me.follow_loop(pool, stop).await }))
    }

    async fn follow_loop(self: Arc<Self>, pool: PgPool, mut stop: watch::Receiver<bool>) {
        let mut listener = None;
        loop {
            if *stop.borrow() {
                return;
            }
            if listener.is_none() {
                match sqlx::postgres::PgListener::connect_with(&pool).await {
                    Ok(mut l) => match l.listen(pg::CHANNEL).await {
                        Ok(()) => listener = Some(l),
                        Err(e) => tracing::warn!(error = %e, "LISTEN {} failed; polling", pg::CHANNEL),
                    },
                    Err(e) => tracing::warn!(error = %e, "cannot listen for deploys; polling"),
                }
            }
            {
                for name in self.specs.keys() {
                    let _changing = self.changing(name).await;
                    if let Err(e) = self.sync_one(&pool, name).await {
                        tracing::error!(handler = %name, error = %format!("{e:#}"), "cannot apply the cluster's version; the running version stays");
                    }
                }
            }
            let wake = async {
                match listener.as_mut() {
                    Some(l) => l.recv().await.map(|_| ()).map_err(|e| e.to_string()),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = wake => if let Err(e) = r {
                    tracing::warn!(error = %e, "deploy notifications lost; reconnecting");
                    listener = None;
                },
                () = tokio::time::sleep(SYNC_POLL) => {}
                _ = stop.changed() => {}
            }
        }
    }

    /// Apply the cluster's current version of `name` if it is newer than ours.
    async fn sync_one(&self, pool: &PgPool, name: &str) -> anyhow::Result<()> {
        let activations = pg::activations(pool, name).await?;
        let Some(latest) = activations.last().cloned() else {
            return Ok(());
        };
        let ours = self.states.lock().get(name).and_then(|s| s.current().map(|c| c.seq));
        if ours.is_some_and(|s| s >= latest.seq) {
            return Ok(());
        }
        let kept = self
            .states
            .lock()
            .get(name)
            .and_then(|s| s.compiled(&latest.digest, &latest.grants).cloned());
        let version = match kept {
            Some(v) => v.reissue(),
            None => {
                let bytes = self.bytes_of(name, &latest.digest).await?;
                self.compile(
                    name,
                    &bytes,
                    &latest.grants,
                    &format!("cluster version {}", latest.digest),
                    Priority::Background,
                )
                .await?
            }
        };
        let mut states = self.states.lock();
        let state = states.entry(name.to_owned()).or_default();
        state.activations = activations;
        state.keep(&latest.grants, version.clone());
        drop(states);
        self.swap_in(name, version, &latest);
        Ok(())
    }

    /// Deploy `{handler}.wasm` files that appear or change in `dir` until `stop`.
    pub fn watch(self: &Arc<Self>, dir: PathBuf, stop: watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move { me.watch_loop(dir, stop).await })
    }

    async fn watch_loop(self: Arc<Self>, dir: PathBuf, mut stop: watch::Receiver<bool>) {
        // (len, mtime) of each file as last acted on.
        let mut seen: HashMap<PathBuf, (u64, Option<SystemTime>)> = HashMap::new();
        tracing::info!(dir = %dir.display(), "watching for components");
        loop {
            if *stop.borrow() {
                return;
            }
            for (path, name, stamp) in scan(&dir) {
                if seen.get(&path) == Some(&stamp) {
                    continue;
                }
                seen.insert(path.clone(), stamp);
                if !self.specs.contains_key(&name) {
                    tracing::warn!(file = %path.display(), "no handler named `{name}`: file ignored");
                    continue;
                }
                let bytes = match std::fs::read(&path) {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::warn!(file = %path.display(), error = %e, "cannot read");
                        continue;
                    }
                };
                match self.deploy(&Caller::Operator, &name, bytes, None, "watch").await {
                    Ok(d) if d.swapped => {
                        tracing::info!(file = %path.display(), handler = %name, digest = %d.digest, "deployed from the components directory")
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::error!(file = %path.display(), handler = %name, error = %e, "refused; the running version stays")
                    }
                }
            }
            tokio::select! {
                () = tokio::time::sleep(WATCH_POLL) => {}
                _ = stop.changed() => {}
            }
        }
    }
}

fn elapsed_ms(t: std::time::Instant) -> u64 {
    u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// `{name}.wasm` files in `dir` with their (len, mtime).
fn scan(dir: &Path) -> Vec<(PathBuf, String, (u64, Option<SystemTime>))> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let path = e.path();
            if path.extension()? != "wasm" {
                return None;
            }
            let name = path.file_stem()?.to_str()?.to_owned();
            let meta = e.metadata().ok()?;
            Some((path, name, (meta.len(), meta.modified().ok())))
        })
        .collect()
}

/// `node.data_dir/handlers/{name}.json`.
#[derive(Serialize, Deserialize)]
struct DirHistory {
    /// Digest of the configured component when this history began.
    config_digest: String,
    activations: Vec<Activation>,
}

fn write_dir_history(dir: &Path, name: &str, config_digest: &str, activations: &[Activation]) -> anyhow::Result<()> {
    let h = DirHistory {
        config_digest: config_digest.to_owned(),
        activations: activations.to_vec(),
    };
    let bytes = serde_json::to_vec_pretty(&h).context("encoding a handler history")?;
    write_atomic(&dir.join("handlers").join(format!("{name}.json")), &bytes)
}

/// `node.data_dir/components/{digest}.wasm`, once.
fn write_component(dir: &Path, digest_hex: &str, bytes: &[u8]) -> anyhow::Result<()> {
    let path = dir.join("components").join(format!("{digest_hex}.wasm"));
    if bytes.is_empty() || path.exists() {
        return Ok(());
    }
    write_atomic(&path, bytes)
}

/// Write via a temporary file and a rename, so a crash leaves the old file or the new one.
fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", uuid::Uuid::new_v4()));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("syncing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

/// Versions in the coordinator database.
mod pg {
    use anyhow::Context as _;
    use sqlx::{PgPool, Row as _};

    use super::{Activation, Grants};

    /// Notified with the handler name after every activation.
    pub const CHANNEL: &str = "weir_handlers";

    pub async fn activations(pool: &PgPool, name: &str) -> anyhow::Result<Vec<Activation>> {
        let rows = sqlx::query(
            "SELECT seq, a.digest, v.size, (extract(epoch FROM a.at) * 1000)::bigint AS at_ms, source, node, previous, grants
             FROM weir_handler_activations a JOIN weir_handler_versions v USING (name, digest)
             WHERE name = $1 ORDER BY seq",
        )
        .bind(name)
        .fetch_all(pool)
        .await
        .with_context(|| format!("reading the versions of `{name}` from the database"))?;
        rows.into_iter()
            .map(|r| {
                let grants: serde_json::Value = r.try_get("grants")?;
                Ok(Activation {
                    seq: r.try_get("seq")?,
                    digest: r.try_get("digest")?,
                    size: u64::try_from(r.try_get::<i64, _>("size")?).unwrap_or(0),
                    at_ms: r.try_get("at_ms")?,
                    source: r.try_get("source")?,
                    node: r.try_get("node")?,
                    previous: r.try_get("previous")?,
                    grants: serde_json::from_value::<Grants>(grants).unwrap_or_default(),
                })
            })
            .collect()
    }

    pub async fn component(pool: &PgPool, name: &str, digest: &str) -> anyhow::Result<Vec<u8>> {
        sqlx::query_scalar("SELECT component FROM weir_handler_versions WHERE name = $1 AND digest = $2")
            .bind(name)
            .bind(digest)
            .fetch_optional(pool)
            .await
            .with_context(|| format!("reading version {digest} of `{name}` from the database"))?
            .with_context(|| format!("the database has no version {digest} of `{name}`"))
    }

    /// Store the version (once) and append an activation whose `previous` is
    /// `a.previous`, or, for a deploy, the cluster's current one.
    pub async fn activate(pool: &PgPool, name: &str, bytes: &[u8], a: Activation) -> anyhow::Result<Activation> {
        let mut tx = pool.begin().await.context("deploying: database unavailable")?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('weir_handler:' || $1))")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        if !bytes.is_empty() {
            sqlx::query(
                "INSERT INTO weir_handler_versions (name, digest, component, size) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (name, digest) DO NOTHING",
            )
            .bind(name)
            .bind(&a.digest)
            .bind(bytes)
            .bind(i64::try_from(bytes.len()).unwrap_or(i64::MAX))
            .execute(&mut *tx)
            .await
            .context("storing the component")?;
        }
        let current: Option<i64> = sqlx::query_scalar("SELECT max(seq) FROM weir_handler_activations WHERE name = $1")
            .bind(name)
            .fetch_one(&mut *tx)
            .await?;
        if a.source == "config" && current.is_some() {
            // Another node recorded the cluster's first version already.
            tx.commit().await?;
            return Ok(a);
        }
        let previous = if a.source == "rollback" { a.previous } else { current };
        let grants = serde_json::to_value(&a.grants).context("encoding grants")?;
        let seq: i64 = sqlx::query_scalar(
            "INSERT INTO weir_handler_activations (name, digest, previous, source, node, grants)
             VALUES ($1, $2, $3, $4, $5, $6) RETURNING seq",
        )
        .bind(name)
        .bind(&a.digest)
        .bind(previous)
        .bind(&a.source)
        .bind(&a.node)
        .bind(grants)
        .fetch_one(&mut *tx)
        .await
        .context("recording the activation")?;
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(CHANNEL)
            .bind(name)
            .execute(&mut *tx)
            .await?;
        tx.commit().await.context("deploying: commit failed")?;
        Ok(Activation { seq, previous, ..a })
    }
}
