//! Which handler gets a message: bindings from (topology, tenant, message
//! type) to a handler name, and the current version of each handler.
//! A binding for the message's tenant wins over a binding for any tenant.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::RwLock;

use crate::envelope::Envelope;
use crate::runtime::HandlerVersion;

/// Handlers of one message type: per tenant, and for any tenant.
#[derive(Default)]
struct ByTenant {
    any: Option<String>,
    tenants: HashMap<String, String>,
}

/// Bindings and handler versions. Swapping a version is one write here; the
/// next call of every lane picks it up, calls already running finish on the
/// version they started with.
#[derive(Default)]
pub struct Router {
    /// topology → message type → handler names. Looked up with borrowed
    /// keys: routing a message allocates nothing.
    bindings: HashMap<String, HashMap<String, ByTenant>>,
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
        let by_tenant = self
            .bindings
            .entry(topology.to_owned())
            .or_default()
            .entry(message_type.to_owned())
            .or_default();
        match tenant {
            Some(t) => by_tenant.tenants.insert(t.to_owned(), handler.to_owned()),
            None => by_tenant.any.replace(handler.to_owned()),
        }
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
        self.version(self.handler_name(topology, env)?)
    }

    /// The name of the handler bound for a message.
    pub fn handler_name(&self, topology: &str, env: &Envelope) -> Option<&str> {
        let by_tenant = self.bindings.get(topology)?.get(env.message_type.as_str())?;
        let name = env
            .tenant_id
            .as_deref()
            .and_then(|t| by_tenant.tenants.get(t))
            .or(by_tenant.any.as_ref())?;
        Some(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope;

    fn msg(t: &str, tenant: Option<&str>) -> Envelope {
        envelope::new_message("id".into(), t, None, tenant.map(str::to_owned), vec![], vec![])
    }

    #[test]
    fn tenant_binding_wins_over_any_tenant_and_others_fall_back() {
        let mut r = Router::new();
        assert_eq!(r.bind("t", None, "a", "generic"), None);
        assert_eq!(r.bind("t", Some("acme"), "a", "acme-only"), None);
        let key = |m: &Envelope| r.handler_name("t", m).map(str::to_owned);
        assert_eq!(key(&msg("a", Some("acme"))).as_deref(), Some("acme-only"));
        assert_eq!(key(&msg("a", Some("other"))).as_deref(), Some("generic"));
        assert_eq!(key(&msg("a", None)).as_deref(), Some("generic"));
        assert_eq!(key(&msg("b", None)), None);
        assert_eq!(r.handler_name("other-topology", &msg("a", None)), None);
        assert_eq!(r.bind("t", None, "a", "again").as_deref(), Some("generic"));
    }
}
