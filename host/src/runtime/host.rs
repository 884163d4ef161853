//! Per-instance host state: the WASI context a handler was granted, its
//! memory limiter, and the host imports (`log`, `publish`, `begin-member`,
//! `config`; the 0.1.0 world's are the same without `begin-member`).
//!
//! `publish` only records the message in the outbox, tagged with the batch
//! member it belongs to: the executor gives each message its own publishes,
//! with their ids, after the call; the caller publishes those of a message
//! that succeeded through the broker and drops the others.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use wasmtime::component::ResourceTable;
use wasmtime::{ResourceLimiter, StoreLimits, StoreLimitsBuilder};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use wasmtime::component::Resource;

use super::stdio::CallLog;
use super::{CallBudgets, HandlerSettings};
use crate::bindings::v0_3::weir::handler::types::{Host as TypesHostV3, HostBatch, HostMessage};
use crate::bindings::weir::handler::host::Host;
use crate::bindings::weir::handler::types::{Host as TypesHost, Level};
use crate::bindings::{BatchRef, MessageRef};
use crate::envelope::{self, Envelope, header};

/// A message published by a guest during the current call.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// The message, with id, tenant and attempt filled in (the id once the
    /// call has returned: it derives from the message the publish belongs to).
    pub envelope: Envelope,
    /// The batch member it belongs to (`begin-member`); `None` in `handle`, or
    /// before the first `begin-member` of a `handle-batch` (the whole batch).
    pub(crate) member: Option<u32>,
}

/// Facts about the call being run, for publishes and log fields.
#[derive(Debug, Default, Clone)]
pub(crate) struct CallContext {
    /// The message, or a batch's first member (log field).
    pub message_id: String,
    pub tenant_id: Option<String>,
    /// Members of the current `handle-batch` call; `None` in `handle`.
    pub batch_len: Option<u32>,
    /// The member the next publishes belong to (`begin-member`).
    pub member: Option<u32>,
}

/// The data of one wasmtime `Store`.
pub struct HostState {
    wasi: WasiCtx,
    pub(super) table: ResourceTable,
    limiter: Limiter,
    pub(crate) settings: Arc<HandlerSettings>,
    pub(crate) outbox: Vec<Outgoing>,
    pub(crate) call: CallContext,
    /// When the current call must be interrupted.
    pub(crate) deadline: Option<Instant>,
    /// Set from outside to interrupt the current call (fencing, shutdown).
    pub(crate) cancel: Option<Arc<super::interrupt::Interrupt>>,
    /// Why the last call was interrupted, if it was.
    pub(crate) interrupted: Option<Interruption>,
    /// The guest's stdout/stderr tail, unless it was granted the host's.
    pub(crate) stdio: Option<super::stdio::TailPipe>,
    /// CPU time after which the current call is a long one (`on_long_call`
    /// runs then, once). CPU time, not wall time: a short call that the OS
    /// preempted on a busy machine is not long.
    pub(crate) long_call: Option<std::time::Duration>,
    /// The thread's CPU time at the first epoch tick of the current call.
    pub(crate) cpu_mark: Option<std::time::Duration>,
    /// What a worker does about a long call (demote itself, send a replacement).
    pub(crate) on_long_call: Option<Arc<dyn Fn() + Send + Sync>>,
    /// The thread this call runs on, registered with `cancel` because it
    /// runs below normal priority (a cancel lifts it).
    pub(crate) lowered_tid: Option<i32>,
    /// The call's budgets: the node's, or its tenant's.
    pub(crate) budgets: CallBudgets,
    /// Log lines and bytes of the current call (shared with granted stdio).
    pub(crate) log: Arc<CallLog>,
    /// Bytes the current call's outbox holds.
    pub(crate) cascade_bytes: usize,
    /// Set when a `publish` of the current call was refused for the cascade byte budget.
    pub(crate) cascade_refused: Option<String>,
    /// The current call's messages, for the 0.3.0 world's handles.
    pub(crate) messages: super::message::CallMessages,
}

/// Why the host stopped a running call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interruption {
    /// The handler ran past its timeout.
    Timeout,
    /// The host cancelled the call (lost ownership or shutdown).
    Cancelled,
}

impl HostState {
    pub(crate) fn new(settings: Arc<HandlerSettings>, budgets: CallBudgets) -> Self {
        let mut wasi = WasiCtx::builder();
        settings.wasi.apply(&mut wasi);
        let rate = settings.tenant.as_ref().and_then(|t| t.log_rate.clone());
        let log = Arc::new(CallLog::new(&budgets).with_rate(rate));
        let stdio = if settings.wasi.inherit_stdio {
            // The host's stdout and stderr, within the call's log budget.
            let ring = settings.logs.clone();
            wasi.stdout(super::stdio::BudgetedStdio::new(log.clone(), false, ring.clone()))
                .stderr(super::stdio::BudgetedStdio::new(log.clone(), true, ring));
            None
        } else {
            let tail = super::stdio::TailPipe::new(4096);
            wasi.stdout(tail.clone()).stderr(tail.clone());
            Some(tail)
        };
        Self {
            wasi: wasi.build(),
            table: ResourceTable::new(),
            limiter: Limiter::new(settings.memory_limit),
            settings,
            outbox: Vec::new(),
            call: CallContext::default(),
            deadline: None,
            cancel: None,
            interrupted: None,
            stdio,
            long_call: None,
            cpu_mark: None,
            on_long_call: None,
            lowered_tid: None,
            budgets,
            log,
            cascade_bytes: 0,
            cascade_refused: None,
            messages: Default::default(),
        }
    }

    pub(crate) fn limiter(&mut self) -> &mut Limiter {
        &mut self.limiter
    }

    /// Whether a memory grow was refused since the flag was last cleared.
    pub(crate) fn take_memory_denied(&mut self) -> bool {
        std::mem::take(&mut self.limiter.denied)
    }

    /// Called on every epoch tick while a guest runs.
    pub(crate) fn should_interrupt(&mut self) -> bool {
        if self.cancel.as_ref().is_some_and(|c| c.is_cancelled()) {
            self.interrupted = Some(Interruption::Cancelled);
            return true;
        }
        let now = Instant::now();
        if self.deadline.is_some_and(|d| now >= d) {
            self.interrupted = Some(Interruption::Timeout);
            return true;
        }
        // Only calls that outlive an epoch tick get here, so only they pay
        // for reading the thread's CPU clock.
        if let Some(budget) = self.long_call {
            let cpu = thread_cpu_time();
            match self.cpu_mark {
                None => self.cpu_mark = Some(cpu),
                Some(mark) if cpu.saturating_sub(mark) >= budget => {
                    self.long_call = None;
                    if let Some(hook) = &self.on_long_call {
                        hook();
                    }
                }
                Some(_) => {}
            }
        }
        // A call running below normal priority: a fence must be able to
        // lift it, or it may not get the CPU to notice the interrupt.
        if self.lowered_tid.is_none()
            && crate::sched::lowered()
            && let Some(cancel) = &self.cancel
        {
            let tid = crate::sched::current_tid();
            self.lowered_tid = Some(tid);
            cancel.lowered(tid);
        }
        false
    }
}

/// CPU time the calling thread has used.
pub(super) fn thread_cpu_time() -> std::time::Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec we own.
    let ok = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0;
    if !ok {
        return std::time::Duration::ZERO;
    }
    std::time::Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl TypesHost for HostState {}

impl Host for HostState {
    fn log(&mut self, level: Level, mut text: String) -> wasmtime::Result<()> {
        // Over the call's budget: dropped (counted; one marker line at the call's end).
        let Some(keep) = self.log.admit_line(text.len()) else {
            return Ok(());
        };
        if keep < text.len() {
            let len = text.len();
            let mut keep = keep;
            while !text.is_char_boundary(keep) {
                keep -= 1;
            }
            text.truncate(keep);
            text.push_str(&format!(" [cut by weir: {len} bytes]"));
        }
        let handler = self.settings.name.as_str();
        let level_name = match level {
            Level::Trace => "trace",
            Level::Debug => "debug",
            Level::Info => "info",
            Level::Warn => "warn",
            Level::Error => "error",
        };
        self.settings.logs.push(
            level_name,
            crate::observe::logring::Source::Log,
            Some(&self.call.message_id),
            &text,
        );
        // Labelled fields (`handler=… message_id=…`): a field called
        // `message` would be taken for the line itself.
        let message_id = self.call.message_id.as_str();
        let tenant = self.call.tenant_id.as_deref().unwrap_or("");
        match level {
            Level::Trace => tracing::trace!(target: "weir::guest", handler, message_id, tenant, "{text}"),
            Level::Debug => tracing::debug!(target: "weir::guest", handler, message_id, tenant, "{text}"),
            Level::Info => tracing::info!(target: "weir::guest", handler, message_id, tenant, "{text}"),
            Level::Warn => tracing::warn!(target: "weir::guest", handler, message_id, tenant, "{text}"),
            Level::Error => tracing::error!(target: "weir::guest", handler, message_id, tenant, "{text}"),
        }
        Ok(())
    }

    fn publish(
        &mut self,
        message_type: String,
        group_id: Option<String>,
        headers: Vec<(String, String)>,
        payload: Vec<u8>,
    ) -> wasmtime::Result<Result<(), String>> {
        if message_type.is_empty() {
            return Ok(Err("publish: message type must not be empty".into()));
        }
        if self.outbox.len() >= self.settings.max_publish_per_call {
            return Ok(Err(format!(
                "publish: at most {} messages per call",
                self.settings.max_publish_per_call
            )));
        }
        if let Some((k, _)) = headers
            .iter()
            .find(|(k, _)| envelope::header::DERIVED.contains(&k.as_str()))
        {
            return Ok(Err(format!("publish: header `{k}` is set by the host")));
        }
        if let Some(why) = &self.cascade_refused {
            return Ok(Err(why.clone()));
        }
        let size = message_type.len()
            + group_id.as_ref().map_or(0, String::len)
            + headers.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
            + payload.len();
        let held = self.cascade_bytes.saturating_add(size);
        if held > self.budgets.cascade_bytes {
            let why = format!(
                "publish: this call's cascades would hold {held} bytes, over the limit of {} \
                 (node.budgets.cascade_bytes, or tenant.budgets.cascade_bytes); none of this call's publishes \
                 will be sent",
                self.budgets.cascade_bytes
            );
            // Release what the call holds now, not when it ends.
            self.outbox = Vec::new();
            self.cascade_refused = Some(why.clone());
            self.settings.budget.cascades_refused.fetch_add(1, Ordering::Relaxed);
            return Ok(Err(why));
        }
        self.cascade_bytes = held;
        // The id derives from the message this belongs to: filled in by the
        // executor once the call has returned.
        let envelope = envelope::new_message(
            String::new(),
            message_type,
            group_id,
            self.call.tenant_id.clone(),
            headers,
            payload,
        );
        self.outbox.push(Outgoing {
            envelope,
            member: self.call.member,
        });
        Ok(Ok(()))
    }

    fn begin_member(&mut self, index: u32) -> wasmtime::Result<()> {
        match self.call.batch_len {
            Some(n) if index < n => self.call.member = Some(index),
            // In `handle` the message is member 0: nothing to switch.
            None if index == 0 => {}
            n => {
                return Err(wasmtime::format_err!(
                    "begin-member({index}): the call has {} member(s), so the index must be below that",
                    n.unwrap_or(1)
                ));
            }
        }
        Ok(())
    }

    fn config(&mut self, key: String) -> wasmtime::Result<Option<String>> {
        Ok(self.settings.config.get(&key).cloned())
    }
}

/// The 0.1.0 world's imports: the same as 0.2.0's, without `begin-member`
/// (so every publish of its `handle-batch` belongs to the whole batch).
impl crate::bindings::v0_1::weir::handler::host::Host for HostState {
    fn log(&mut self, level: Level, text: String) -> wasmtime::Result<()> {
        Host::log(self, level, text)
    }

    fn publish(
        &mut self,
        message_type: String,
        group_id: Option<String>,
        headers: Vec<(String, String)>,
        payload: Vec<u8>,
    ) -> wasmtime::Result<Result<(), String>> {
        Host::publish(self, message_type, group_id, headers, payload)
    }

    fn config(&mut self, key: String) -> wasmtime::Result<Option<String>> {
        Host::config(self, key)
    }
}

/// The 0.3.0 world's imports: the same as 0.2.0's, over its own `level`.
impl crate::bindings::v0_3::weir::handler::host::Host for HostState {
    fn log(&mut self, level: crate::bindings::v0_3::weir::handler::types::Level, text: String) -> wasmtime::Result<()> {
        use crate::bindings::v0_3::weir::handler::types::Level as L3;
        let level = match level {
            L3::Trace => Level::Trace,
            L3::Debug => Level::Debug,
            L3::Info => Level::Info,
            L3::Warn => Level::Warn,
            L3::Error => Level::Error,
        };
        Host::log(self, level, text)
    }

    fn publish(
        &mut self,
        message_type: String,
        group_id: Option<String>,
        headers: Vec<(String, String)>,
        payload: Vec<u8>,
    ) -> wasmtime::Result<Result<(), String>> {
        Host::publish(self, message_type, group_id, headers, payload)
    }

    fn begin_member(&mut self, index: u32) -> wasmtime::Result<()> {
        Host::begin_member(self, index)
    }

    fn config(&mut self, key: String) -> wasmtime::Result<Option<String>> {
        Host::config(self, key)
    }
}

/// The 0.3.0 world's resources: accessors of the call's messages (see
/// `super::message`).
impl TypesHostV3 for HostState {}

impl HostMessage for HostState {
    fn id(&mut self, m: Resource<MessageRef>) -> wasmtime::Result<String> {
        Ok(self.messages.get(m.rep())?.id.clone())
    }

    fn message_type(&mut self, m: Resource<MessageRef>) -> wasmtime::Result<String> {
        Ok(self.messages.get(m.rep())?.message_type.clone())
    }

    fn group_id(&mut self, m: Resource<MessageRef>) -> wasmtime::Result<Option<String>> {
        Ok(self.messages.get(m.rep())?.group_id.clone())
    }

    fn tenant_id(&mut self, m: Resource<MessageRef>) -> wasmtime::Result<Option<String>> {
        Ok(self.messages.get(m.rep())?.tenant_id.clone())
    }

    fn attempt(&mut self, m: Resource<MessageRef>) -> wasmtime::Result<u32> {
        Ok(self.messages.get(m.rep())?.attempt)
    }

    fn header(&mut self, m: Resource<MessageRef>, name: String) -> wasmtime::Result<Option<String>> {
        let msg = self.messages.get(m.rep())?;
        // The five the accessors carry answer by name too, as delivered.
        Ok(match name.as_str() {
            header::MESSAGE_ID => Some(msg.id.clone()),
            header::MESSAGE_TYPE => Some(msg.message_type.clone()),
            header::GROUP_ID => msg.group_id.clone(),
            header::TENANT_ID => msg.tenant_id.clone(),
            header::ATTEMPT => Some(msg.attempt.to_string()),
            _ => msg.headers.iter().find(|(k, _)| *k == name).map(|(_, v)| v.clone()),
        })
    }

    fn headers(&mut self, m: Resource<MessageRef>) -> wasmtime::Result<Vec<(String, String)>> {
        Ok(self.messages.get(m.rep())?.headers.clone())
    }

    fn payload(&mut self, m: Resource<MessageRef>) -> wasmtime::Result<Vec<u8>> {
        Ok(self.messages.get(m.rep())?.payload.clone())
    }

    fn payload_len(&mut self, m: Resource<MessageRef>) -> wasmtime::Result<u64> {
        Ok(u64::try_from(self.messages.get(m.rep())?.payload.len()).unwrap_or(u64::MAX))
    }

    fn drop(&mut self, _m: Resource<MessageRef>) -> wasmtime::Result<()> {
        // The host owns the message: a guest's handle going away frees nothing.
        Ok(())
    }
}

impl HostBatch for HostState {
    fn len(&mut self, b: Resource<BatchRef>) -> wasmtime::Result<u32> {
        self.messages.get(b.rep())?;
        Ok(u32::try_from(self.messages.len()).unwrap_or(u32::MAX))
    }

    fn member(&mut self, b: Resource<BatchRef>, index: u32) -> wasmtime::Result<Resource<MessageRef>> {
        self.messages.get(b.rep())?;
        if index as usize >= self.messages.len() {
            return Err(wasmtime::format_err!(
                "batch.member({index}): the batch has {} member(s), so the index must be below that",
                self.messages.len()
            ));
        }
        Ok(Resource::new_own(self.messages.rep(index)))
    }

    fn drop(&mut self, _b: Resource<BatchRef>) -> wasmtime::Result<()> {
        Ok(())
    }
}

/// Memory limits per instance; remembers a refused grow so a trap that
/// follows can be reported as "memory limit exceeded".
pub(crate) struct Limiter {
    inner: StoreLimits,
    denied: bool,
}

impl Limiter {
    fn new(memory: usize) -> Self {
        Self {
            inner: StoreLimitsBuilder::new().memory_size(memory).build(),
            denied: false,
        }
    }
}

impl ResourceLimiter for Limiter {
    fn memory_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        let ok = self.inner.memory_growing(current, desired, maximum)?;
        if !ok {
            self.denied = true;
        }
        Ok(ok)
    }

    fn table_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        self.inner.table_growing(current, desired, maximum)
    }
}
