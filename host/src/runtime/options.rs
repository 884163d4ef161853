//! Engine options (one engine per process) and the budgets of one call.

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

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
    /// A red baseline for tests: a 0.3.0 message handle kept from an earlier
    /// call is not checked against the call being run, so it reads that
    /// call's message. Never set outside tests.
    pub negative_control_unchecked_handles: bool,
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
            negative_control_unchecked_handles: false,
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
