//! Which handler gets a message: bindings from (topology, tenant, message
//! type) to a handler name, and the current version of each handler.
//! A binding for the message's tenant wins over a binding for any tenant.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::RwLock;

use crate::envelope::Envelope;
use crate::runtime::HandlerVersion;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    topology: String,
    tenant: Option<String>,
    message_type: String,
}

/// Bindings and handler versions. Swapping a version is one write here; the
/// next call of every lane picks it up, calls already running finish on the
/// version they started with.
#[derive(Default)]
pub struct Router {
    bindings: HashMap<Key, String>,
    versions: RwLock<HashMap<String, Arc<HandlerVersion>>>,
}

impl Router {
    /// An empty router.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bind `message_type` of `topology` (for `tenant`, or any tenant) to `handler`.
    /// Returns the handler already bound there, if any.
    pub fn bind(&mut self, topology: &str, tenant: Option<&str>, message_type: &str, handler: &str) -> Option<String> {
        let key = Key {
            topology: topology.to_owned(),
            tenant: tenant.map(str::to_owned),
            message_type: message_type.to_owned(),
        };
        self.bindings.insert(key, handler.to_owned())
    }

    /// Install or replace the current version of a handler; the old one is retired.
    pub fn install(&self, version: Arc<HandlerVersion>) -> Option<Arc<HandlerVersion>> {
        let old = self.versions.write().insert(version.name().to_owned(), version);
        if let Some(o) = &old {
            o.retire();
        }
        old
    }

    /// The current version of `name`.
    pub fn version(&self, name: &str) -> Option<Arc<HandlerVersion>> {
        self.versions.read().get(name).cloned()
    }

    /// Every installed handler.
    pub fn versions(&self) -> Vec<Arc<HandlerVersion>> {
        self.versions.read().values().cloned().collect()
    }

    /// The handler for a message, or `None` (dead-letter `no-handler`).
    pub fn route(&self, topology: &str, env: &Envelope) -> Option<Arc<HandlerVersion>> {
        let mut key = Key {
            topology: topology.to_owned(),
            tenant: env.tenant_id.clone(),
            message_type: env.message_type.clone(),
        };
        let name = match self.bindings.get(&key) {
            Some(n) => n,
            None if key.tenant.is_some() => {
                key.tenant = None;
                self.bindings.get(&key)?
            }
            None => return None,
        };
        self.version(name)
    }
}
