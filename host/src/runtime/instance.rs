//! One instance of a handler version in its own store, and a worker's cache of them (least
//! recently used first out).

use std::collections::HashMap;
use std::sync::Arc;

use wasmtime::{Engine, Store, UpdateDeadline};

use super::host::HostState;
use super::options::RuntimeOptions;
use super::version::{Bindings, HandlerVersion};

pub(super) struct Instance {
    pub(super) store: Store<HostState>,
    pub(super) bindings: Bindings,
}

impl Instance {
    pub(super) fn new(engine: &Engine, version: &HandlerVersion, options: &RuntimeOptions) -> anyhow::Result<Self> {
        let budgets = version.settings.budgets.unwrap_or(options.budgets);
        let mut store = Store::new(engine, HostState::new(version.settings.clone(), budgets));
        store.data_mut().messages.unchecked = options.negative_control_unchecked_handles;
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

pub(super) trait ShouldInterrupt {
    fn data_mut_should_interrupt(self) -> bool;
}

impl ShouldInterrupt for wasmtime::StoreContextMut<'_, HostState> {
    fn data_mut_should_interrupt(mut self) -> bool {
        self.data_mut().should_interrupt()
    }
}

/// One executor's cached instances by version id (ids are unique: no hashing needed).
pub(super) type CacheMap = HashMap<u64, Cached, nohash_hasher::BuildNoHashHasher<u64>>;

/// An idle instance kept for the next call of its version.
pub(super) struct Cached {
    pub(super) version: Arc<HandlerVersion>,
    pub(super) inst: Instance,
    /// The executor's call counter when it was last used (least recently used goes first).
    pub(super) used: u64,
}

/// Remove the least recently used instance of `cache`; false when it is empty.
pub(super) fn evict_lru(cache: &mut CacheMap) -> Option<Cached> {
    let key = cache.iter().min_by_key(|(_, c)| c.used).map(|(k, _)| *k)?;
    cache.remove(&key)
}
