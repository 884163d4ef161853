//! An [`Executor`] calls guests synchronously on one worker thread: it keeps a few instances
//! per version, arms the deadline and the cancel flag, and turns traps into faults.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use wasmtime::Trap;

use super::call::{BatchOutcome, CallOutcome, Fault, FaultKind};
use super::engine::Runtime;
use super::host::{Interruption, Outgoing};
use super::instance::{CacheMap, Cached, Instance, evict_lru};
use super::interrupt::{Entered, Interrupt};
use super::options::{CACHED_PER_WORKER, EPOCH_TICK, InstanceMode, cut_text};
use super::settings::HandlerSettings;
use super::version::{HandlerVersion, RETIREMENTS};
use crate::bindings::weir::handler::types::Failure;
use crate::envelope::Envelope;

/// Whether instantiation failed only because the pool has no free slot.
fn pool_exhausted(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<wasmtime::PoolConcurrencyLimitError>()) || format!("{e:#}").contains("maximum concurrent")
}

/// Calls guests on the current thread, keeping reusable instances (at most
/// [`CACHED_PER_WORKER`]). One per worker thread; not shared. When the pool
/// has no free slot, idle cached instances are evicted, this executor's first,
/// then other executors'; a call never fails because the pool is full.
pub struct Executor {
    pub(super) runtime: Arc<Runtime>,
    /// Run on the worker's own thread when a call outlives `demote_after`.
    pub(super) on_long_call: Option<Arc<dyn Fn() + Send + Sync>>,
    /// Reusable instances; shared with the runtime only so others can evict from it.
    pub(super) cache: Arc<parking_lot::Mutex<CacheMap>>,
    /// Calls made, the clock of the least-recently-used order.
    pub(super) calls: u64,
    /// [`RETIREMENTS`] when the cache was last swept of retired versions.
    pub(super) swept: u64,
    /// The last call wrote more log than its budget allows (see [`Executor::over_budget`]).
    pub(super) over_budget: bool,
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
            over_budget: false,
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

    fn instance(&mut self, version: &Arc<HandlerVersion>, cancel: &Option<Arc<Interrupt>>) -> Result<Instance, Fault> {
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
            let cancelled = cancel.as_ref().is_some_and(|c| c.is_cancelled());
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

    fn arm(&self, inst: &mut Instance, version: &HandlerVersion, msg: &Envelope, cancel: &Option<Arc<Interrupt>>) {
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

    /// The last call went over its log budget (its log was dropped or cut): the worker
    /// pool charges its CPU to its tenant as it does a failure's, so a guest that floods
    /// the log, answering `ok` each time, gets no more than a failing one.
    pub fn over_budget(&self) -> bool {
        self.over_budget
    }

    /// After every call, answered or not: one marker line for the log it dropped. True
    /// when it dropped any.
    fn finish(inst: &mut Instance) -> bool {
        let data = inst.store.data_mut();
        let (lines, bytes) = data.log.reset();
        let over = lines > 0 || bytes > 0;
        if over {
            let counters = &data.settings.budget;
            counters.log_lines_dropped.fetch_add(lines, Ordering::Relaxed);
            counters.log_bytes_dropped.fetch_add(bytes, Ordering::Relaxed);
            tracing::warn!(
                handler = data.settings.name.as_str(),
                message_id = data.call.message_id.as_str(),
                dropped_lines = lines,
                dropped_bytes = bytes,
                log_bytes = data.budgets.log_bytes,
                log_lines = data.budgets.log_lines,
                "guest log over its per-call budget (node.budgets, or its tenant's): the rest of this call's log was dropped or cut"
            );
        }
        over
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
        /// The guest output a trap's text looks through for a panic message.
        const LAST_OUTPUT: usize = 2048;
        /// The guest's last lines kept beside a fault's cause.
        const LAST_WORDS: usize = 512;
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
            // The panic message first (what survives a cut), then the trap, then
            // the guest's own frames.
            _ => {
                let cause = err.root_cause().to_string();
                let cause = cause.lines().next().unwrap_or_default();
                let stdio = data.stdio.as_ref();
                let output = stdio.and_then(|t| t.last_output(LAST_OUTPUT));
                let words = stdio.and_then(|t| t.last_words(LAST_WORDS));
                // What the words show is cut when the pipe dropped the start of
                // the output, or the words reached their own cap.
                let cut_from = stdio
                    .filter(|t| t.written() > t.held() || words.as_ref().is_some_and(|w| w.len() >= LAST_WORDS))
                    .map(super::stdio::TailPipe::written);
                let (text, cut) = super::trap_text::trap_text(
                    cause,
                    output.as_deref(),
                    words.as_deref(),
                    cut_from,
                    &format!("{err:#}"),
                );
                if cut {
                    data.settings.budget.errors_cut.fetch_add(1, Ordering::Relaxed);
                }
                text
            }
        };
        // The guest's last words (a panic message) say more than the trap.
        if (matches!(kind, FaultKind::Timeout | FaultKind::MemoryLimit | FaultKind::Cancelled)
            || matches!(err.downcast_ref::<Trap>(), Some(Trap::StackOverflow | Trap::OutOfFuel)))
            && let Some(words) = data.stdio.as_ref().and_then(|t| t.last_words(LAST_WORDS))
        {
            detail.push_str("; guest output: ");
            detail.push_str(&words);
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
        cancel: &Option<Arc<Interrupt>>,
    ) -> CallOutcome {
        self.over_budget = false;
        let Ok(_entered) = enter(cancel) else {
            return CallOutcome::Fault(Fault::not_started());
        };
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
        let span = crate::telemetry::call(msg, version.name(), &version.digest, None);
        metrics.enter();
        let started = Instant::now();
        let r = inst.bindings.call_handle(&mut inst.store, msg);
        let took = started.elapsed();
        metrics.exit(took);
        if version.tallying.load(std::sync::atomic::Ordering::Relaxed) {
            version.tally.called(took);
        }
        lower_again(&mut inst);
        if let Some(o) = &self.runtime.observer {
            o.after(msg);
        }
        self.over_budget = Self::finish(&mut inst);
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
                let mut published = published;
                traced(span, msg, &result, &mut published);
                CallOutcome::Done { result, published }
            }
            // The instance is dropped here: its state may be corrupt.
            Err(e) => {
                let fault = Self::fault(&mut inst, e);
                if let Some(span) = span {
                    span.end(fault.kind.as_str(), Some(&fault.detail));
                }
                CallOutcome::Fault(fault)
            }
        }
    }

    /// Call `handle-batch` once for all of `batch`.
    pub fn call_batch(
        &mut self,
        version: &Arc<HandlerVersion>,
        batch: &[Envelope],
        cancel: &Option<Arc<Interrupt>>,
    ) -> BatchOutcome {
        let Some(first) = batch.first() else {
            return BatchOutcome::Done {
                results: Vec::new(),
                published: Vec::new(),
                unattributed: Vec::new(),
            };
        };
        self.over_budget = false;
        let Ok(_entered) = enter(cancel) else {
            return BatchOutcome::Fault(Fault::not_started());
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
        let span = crate::telemetry::call(first, version.name(), &version.digest, Some(batch.len()));
        metrics.enter();
        let started = Instant::now();
        let r = inst.bindings.call_handle_batch(&mut inst.store, batch);
        let took = started.elapsed();
        metrics.exit(took);
        if version.tallying.load(std::sync::atomic::Ordering::Relaxed) {
            version.tally.called(took);
        }
        lower_again(&mut inst);
        if let Some(o) = &self.runtime.observer {
            o.after_batch(batch);
        }
        self.over_budget = Self::finish(&mut inst);
        let mut outcome = match r {
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
        };
        traced_batch(span, batch, &mut outcome);
        outcome
    }
}

/// End a call's span with its outcome and make it the parent of the
/// cascades; with traces off, the cascades continue the message's trace.
fn traced(
    span: Option<crate::telemetry::Call>,
    msg: &Envelope,
    result: &Result<(), Failure>,
    cascades: &mut [Outgoing],
) {
    match span {
        Some(span) => {
            span.parent_of(cascades.iter_mut().map(|o| &mut o.envelope));
            let (outcome, error) = match result {
                Ok(()) => ("ok", None),
                Err(Failure::Retry(why)) => ("retry", Some(why.as_str())),
                Err(Failure::Reject(why)) => ("reject", Some(why.as_str())),
            };
            span.end(outcome, error);
        }
        None if !cascades.is_empty() => crate::telemetry::inherit(msg, cascades.iter_mut().map(|o| &mut o.envelope)),
        None => {}
    }
}

/// [`traced`] for a `handle-batch` call: its cascades are the batch span's
/// children (or continue their member's trace when traces are off).
fn traced_batch(span: Option<crate::telemetry::Call>, batch: &[Envelope], outcome: &mut BatchOutcome) {
    match (span, outcome) {
        (
            span,
            BatchOutcome::Done {
                results,
                published,
                unattributed,
            },
        ) => match span {
            Some(span) => {
                let all = published.iter_mut().flatten().chain(unattributed.iter_mut());
                span.parent_of(all.map(|o| &mut o.envelope));
                let failed = results.iter().filter(|r| r.is_err()).count();
                let error = (failed > 0).then(|| format!("{failed} of {} members failed", results.len()));
                span.end(if failed == 0 { "ok" } else { "some-failed" }, error.as_deref());
            }
            None => {
                for (member, out) in batch.iter().zip(published.iter_mut()).filter(|(_, o)| !o.is_empty()) {
                    crate::telemetry::inherit(member, out.iter_mut().map(|o| &mut o.envelope));
                }
                if let Some(first) = batch.first().filter(|_| !unattributed.is_empty()) {
                    crate::telemetry::inherit(first, unattributed.iter_mut().map(|o| &mut o.envelope));
                }
            }
        },
        (Some(span), BatchOutcome::Fault(f)) => span.end(f.kind.as_str(), Some(&f.detail)),
        (None, BatchOutcome::Fault(_)) => {}
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

/// Count a call into its runner's interrupt before any guest code runs
/// (instantiation included): `Err` once the interrupt was cancelled, and the
/// call must not start. A call without an interrupt always enters.
fn enter(cancel: &Option<Arc<Interrupt>>) -> Result<Option<Entered<'_>>, ()> {
    match cancel {
        None => Ok(None),
        Some(i) => i.enter().map(Some).ok_or(()),
    }
}

/// The call ended: a thread that ran it below normal priority, and that a
/// fence lifted meanwhile, lowers itself again.
fn lower_again(inst: &mut Instance) {
    let data = inst.store.data_mut();
    if let Some(tid) = data.lowered_tid.take() {
        let still_lowered = data.cancel.as_ref().is_some_and(|c| c.forget(tid));
        if !still_lowered {
            crate::sched::lower_again();
        }
    }
}
