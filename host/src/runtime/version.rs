//! A handler version: a component compiled once and kept as `InstancePre`, with its digest,
//! settings and admission; retired when a newer one is swapped in.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use wasmtime::Store;
use wasmtime::component::Resource;

use super::host::HostState;
use super::message::{CallMessages, lend};
use super::settings::{HandlerSettings, TenantShare};
use crate::bindings::weir::handler::types::Failure;
use crate::bindings::{Handler, HandlerPre, v0_1, v0_3};
use crate::envelope::Envelope;

pub(super) static NEXT_VERSION: AtomicU64 = AtomicU64::new(1);

/// Bumped whenever a version is retired: executors then drop the instances
/// they keep of retired versions (one load per call to notice).
pub(super) static RETIREMENTS: AtomicU64 = AtomicU64::new(0);

/// One compiled, validated version of a handler.
pub struct HandlerVersion {
    /// Process-unique id (instance caches key on it).
    pub id: u64,
    /// sha256 of the component bytes, hex.
    pub digest: String,
    /// Size of the component in bytes.
    pub size: usize,
    /// How long compiling it took; `None` when it came from the compiled-code cache.
    pub compiled_in: Option<std::time::Duration>,
    /// The handler's settings.
    pub settings: Arc<HandlerSettings>,
    /// Admission for calls of this version, `max_instances` permits.
    pub permits: Arc<tokio::sync::Semaphore>,
    /// What this version alone did (outcomes, call durations) while
    /// `tallying`: a canary's comparison with the stable version reads it.
    pub tally: crate::observe::stats::HandlerMetrics,
    /// Whether calls count in `tally` (while a canary of the handler runs;
    /// otherwise a message pays one load for it, not three atomic adds).
    pub tallying: AtomicBool,
    /// The last messages this version retried and dead-lettered while
    /// `tallying` (the ids a canary's rollback names).
    pub failed: crate::observe::stats::RecentFailures,
    pub(super) pre: Pre,
    pub(super) retired: AtomicBool,
}

/// A version's instantiation, by the world it was built against.
#[derive(Clone)]
pub(super) enum Pre {
    /// `weir:handler@0.3.0`: the message as a host-owned resource.
    V3(v0_3::HandlerPre<HostState>),
    /// `weir:handler@0.2.0`.
    V2(HandlerPre<HostState>),
    /// `weir:handler@0.1.0`: no `begin-member`.
    V1(v0_1::HandlerPre<HostState>),
}

impl Pre {
    pub(super) fn instantiate(&self, store: &mut Store<HostState>) -> wasmtime::Result<Bindings> {
        match self {
            Pre::V3(pre) => pre.instantiate(store).map(Bindings::V3),
            Pre::V2(pre) => pre.instantiate(store).map(Bindings::V2),
            Pre::V1(pre) => pre.instantiate(store).map(Bindings::V1),
        }
    }
}

/// An instance's exports, by world; the result types are shared (0.3.0's
/// converted), and a 0.3.0 call reads the messages through handles.
pub(super) enum Bindings {
    V3(v0_3::Handler),
    V2(Handler),
    V1(v0_1::Handler),
}

impl Bindings {
    pub(super) fn call_handle(
        &self,
        store: &mut Store<HostState>,
        msg: &Envelope,
    ) -> wasmtime::Result<Result<(), Failure>> {
        match self {
            Bindings::V3(b) => lend(store, messages_of, std::slice::from_ref(msg), |store| {
                let handle = Resource::new_borrow(store.data().messages.rep(0));
                b.call_handle(&mut *store, handle).map(|r| r.map_err(failure))
            }),
            Bindings::V2(b) => b.call_handle(store, msg),
            Bindings::V1(b) => b.call_handle(store, msg),
        }
    }

    pub(super) fn call_handle_batch(
        &self,
        store: &mut Store<HostState>,
        batch: &[Envelope],
    ) -> wasmtime::Result<Vec<Result<(), Failure>>> {
        match self {
            Bindings::V3(b) => lend(store, messages_of, batch, |store| {
                let handle = Resource::new_borrow(store.data().messages.rep(0));
                b.call_handle_batch(&mut *store, handle)
                    .map(|rs| rs.into_iter().map(|r| r.map_err(failure)).collect())
            }),
            Bindings::V2(b) => b.call_handle_batch(store, batch),
            Bindings::V1(b) => b.call_handle_batch(store, batch),
        }
    }
}

/// Where a store keeps its call's messages.
fn messages_of(store: &mut Store<HostState>) -> &mut CallMessages {
    &mut store.data_mut().messages
}

/// A 0.3.0 failure as the host's (the same variant, its own type).
fn failure(f: v0_3::weir::handler::types::Failure) -> Failure {
    use v0_3::weir::handler::types::Failure as F3;
    match f {
        F3::Retry(why) => Failure::Retry(why),
        F3::Reject(why) => Failure::Reject(why),
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
            compiled_in: None,
            settings: self.settings.clone(),
            permits: self.permits.clone(),
            tally: Default::default(),
            tallying: AtomicBool::new(false),
            failed: Default::default(),
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

    pub(super) fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }
}
