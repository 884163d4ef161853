//! The Wasm runtime: one engine per process (pooling allocator, epoch
//! interruption), handler versions compiled once and kept as `InstancePre`,
//! and [`Executor`]s that call guests synchronously on worker threads.
//!
//! A trap, a timeout or a cancellation is a [`Fault`]: the instance is
//! discarded and the caller treats every message of that call as `retry`.
//! Routing, lanes and settlement are left to others.
//!
//! The files: [`options`] (engine options and call budgets), [`settings`] (a handler's
//! settings and grants), [`version`] (a compiled handler version), [`engine`] (the
//! [`Runtime`]: engine, linker, epoch ticker, loading), [`call`] (what a call returns),
//! [`instance`] (an instance and a worker's cache of them), [`interrupt`] (a runner's calls,
//! interrupted together), [`executor`] (calls on a worker thread), [`pool`] (the worker threads),
//! `host`, `message` (0.3.0's message resource) and [`stdio`] (the host imports), [`trap_text`] (what a trap's error says),
//! [`grants`] (pinned directories),
//! [`bundled`] (the guests shipped in the binary).

mod blocking;
pub mod bundled;
pub mod call;
pub mod engine;
pub mod executor;
pub mod fault;
pub mod fncache;
pub mod grants;
mod host;
pub mod instance;
pub mod interrupt;
mod message;
pub mod options;
pub mod pool;
pub mod settings;
pub mod stdio;
pub mod trap_text;
pub mod version;

/// The generated bindings, where they were before they moved to [`crate::bindings`].
pub use crate::bindings;
pub use crate::observe::CallObserver;
pub use call::{BatchOutcome, CallOutcome, Fault, FaultKind};
pub use engine::Runtime;
pub use executor::Executor;
pub use host::{HostState, Interruption, Outgoing};
pub use interrupt::Interrupt;
pub use options::{
    BudgetCounters, CACHED_PER_WORKER, CallBudgets, DEMOTE_AFTER, EPOCH_TICK, InstanceMode, RuntimeOptions, cut_text,
    pool_size_for,
};
pub use settings::{HandlerSettings, Preopen, TenantShare, WasiGrants};
pub use version::HandlerVersion;
