//! Which handler gets a message: bindings from (topology, tenant, message
//! type) to a handler name, and the current version of each handler.
//! A binding for the message's tenant wins over a binding for any tenant.
//! A binding may be batched ([`BatchRule`]): its messages go to `handle-batch`.
//! A message pinned to a version (`weir-handler-pin`, set by a redrive) runs
//! on that version, found by a [`PinResolver`] (the registry), and alone
//! through `handle`, never in a batch with messages of another version.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;

use crate::config::{Config, OnFailure};
use crate::envelope::{Envelope, header};
use crate::runtime::HandlerVersion;

/// Every message looks its (topology, type, tenant) and its handler up in
/// these maps, twice: SipHash over those names cost more than the rest of
/// routing. Their keys come from the configuration, so no publisher can
/// choose colliding ones; foldhash, randomly seeded, is enough.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// Finds a handler's version by digest, for pinned messages: the registry,
/// which keeps earlier versions (compiled, or their bytes in its store).
#[async_trait::async_trait]
pub trait PinResolver: Send + Sync {
    /// Version `digest` of handler `handler`, compiled; or why it cannot be had.
    async fn pinned(&self, handler: &str, digest: &str) -> Result<Arc<HandlerVersion>, String>;
}

/// Why a pinned message has no version to run on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PinError {
    /// No handler is bound to its (tenant, message type).
    NoHandler,
    /// Its handler cannot run the pinned version: the reason.
    Unresolvable(String),
}

/// How a batched binding collects its messages (`handler.batch`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchRule {
    /// The handler whose `handle-batch` gets the batch.
    pub handler: Arc<str>,
    /// Most members in one batch (at least 1).
    pub size: usize,
    /// Longest a member waits for more to join before the batch runs.
    pub linger: Duration,
}

/// Where one (topology, tenant, message type) goes.
struct Binding {
    handler: String,
    batch: Option<Arc<BatchRule>>,
    /// `on_failure = "park"`.
    park: bool,
}

impl Binding {
    fn single(handler: &str) -> Self {
        Self {
            handler: handler.to_owned(),
            batch: None,
            park: false,
        }
    }
}

/// Handlers of one message type: per tenant, and for any tenant.
#[derive(Default)]
struct ByTenant {
    any: Option<Binding>,
    tenants: HashMap<String, Binding>,
}

/// A handler's versions in the router: the stable one, and a canary that
/// runs instead of it on some slots of the handler's topology.
struct Installed {
    stable: Arc<HandlerVersion>,
    /// The canary and, by slot, whether it runs there.
    canary: Option<(Arc<HandlerVersion>, Arc<[bool]>)>,
}

impl Installed {
    fn on(&self, slot: u32) -> &Arc<HandlerVersion> {
        match &self.canary {
            Some((v, slots)) if slots.get(slot as usize).copied().unwrap_or(false) => v,
            _ => &self.stable,
        }
    }
}

/// Bindings and handler versions. Swapping a version is one write here; the
/// next call of every lane picks it up, calls already running finish on the
/// version they started with.
#[derive(Default)]
pub struct Router {
    /// topology → message type → handler names. Looked up with borrowed
    /// keys: routing a message allocates nothing.
    bindings: HashMap<String, HashMap<String, ByTenant>>,
    versions: RwLock<HashMap<String, Installed>>,
    /// Finds pinned versions (set once the registry exists).
    resolver: RwLock<Option<std::sync::Weak<dyn PinResolver>>>,
}

impl Router {
    /// Every handler of `config` bound: its message types, batch rules and park rule.
    pub fn from_config(config: &Config) -> anyhow::Result<Router> {
        let mut router = Router::new();
        for (i, h) in config.handler.iter().enumerate() {
            let types = h
                .message_types
                .iter()
                .chain(h.batch.iter().flat_map(|b| b.message_types.iter()));
            for t in types {
                if let Some(prev) = router.bind(&h.topology, h.tenant.as_deref(), t, &h.name)
                    && prev != h.name
                {
                    anyhow::bail!("handler[{i}].message_types: `{t}` is already bound to handler `{prev}`");
                }
            }
            if let Some(b) = &h.batch {
                let rule = BatchRule {
                    handler: Arc::from(h.name.as_str()),
                    size: b.size as usize,
                    linger: b.linger,
                };
                router.batch(&h.topology, h.tenant.as_deref(), &b.message_types, rule);
            }
            if h.on_failure == OnFailure::Park {
                router.park(&h.topology, h.tenant.as_deref(), &h.message_types, &h.name);
            }
        }
        Ok(router)
    }

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
        let old = match tenant {
            Some(t) => by_tenant.tenants.insert(t.to_owned(), Binding::single(handler)),
            None => by_tenant.any.replace(Binding::single(handler)),
        };
        old.map(|b| b.handler)
    }

    /// Deliver the already bound `message_types` of `topology` (for `tenant`,
    /// or any tenant) in batches by `rule`. Types bound to another handler
    /// than `rule.handler` are left alone; returns how many became batched.
    pub fn batch(&mut self, topology: &str, tenant: Option<&str>, message_types: &[String], rule: BatchRule) -> usize {
        let rule = Arc::new(BatchRule {
            size: rule.size.max(1),
            ..rule
        });
        let Some(types) = self.bindings.get_mut(topology) else {
            return 0;
        };
        let mut n = 0;
        for t in message_types {
            let Some(by_tenant) = types.get_mut(t.as_str()) else {
                continue;
            };
            let binding = match tenant {
                Some(x) => by_tenant.tenants.get_mut(x),
                None => by_tenant.any.as_mut(),
            };
            if let Some(b) = binding.filter(|b| *b.handler == *rule.handler) {
                b.batch = Some(rule.clone());
                n += 1;
            }
        }
        n
    }

    /// Install or replace the current (stable) version of a handler; the
    /// old one is retired. A canary, if any, stays on its slots.
    pub fn install(&self, version: Arc<HandlerVersion>) -> Option<Arc<HandlerVersion>> {
        let mut versions = self.versions.write();
        let canary = versions.get(version.name()).and_then(|i| i.canary.clone());
        self.replace(&mut versions, version, canary).0
    }

    /// Install `stable` and `canary` (on `slots` of the handler's topology)
    /// in one write, so no call sees one without the other; the versions they
    /// replace are retired. Returns the replaced (stable, canary).
    pub fn install_with_canary(
        &self,
        stable: Arc<HandlerVersion>,
        canary: Option<(Arc<HandlerVersion>, &[u32])>,
    ) -> (Option<Arc<HandlerVersion>>, Option<Arc<HandlerVersion>>) {
        let canary = canary.map(|(v, slots)| {
            let len = slots.iter().max().map_or(0, |m| *m as usize + 1);
            let mut on = vec![false; len];
            for s in slots {
                on[*s as usize] = true;
            }
            (v, Arc::from(on))
        });
        self.replace(&mut self.versions.write(), stable, canary)
    }

    fn replace(
        &self,
        versions: &mut HashMap<String, Installed>,
        stable: Arc<HandlerVersion>,
        canary: Option<(Arc<HandlerVersion>, Arc<[bool]>)>,
    ) -> (Option<Arc<HandlerVersion>>, Option<Arc<HandlerVersion>>) {
        let keep: Vec<u64> = std::iter::once(stable.id)
            .chain(canary.as_ref().map(|(v, _)| v.id))
            .collect();
        let old = versions.insert(stable.name().to_owned(), Installed { stable, canary });
        let Some(old) = old else {
            return (None, None);
        };
        let old_canary = old.canary.map(|(v, _)| v);
        for v in std::iter::once(&old.stable).chain(old_canary.as_ref()) {
            if !keep.contains(&v.id) {
                v.retire();
            }
        }
        (Some(old.stable), old_canary)
    }

    /// Where pinned versions come from (the registry; held weakly, since
    /// the registry holds the router).
    pub fn set_resolver(&self, resolver: std::sync::Weak<dyn PinResolver>) {
        *self.resolver.write() = Some(resolver);
    }

    /// The version a message pinned to `digest` runs on: its handler's
    /// current one when that is the digest, else what the resolver finds.
    pub async fn route_pinned(
        &self,
        topology: &str,
        env: &Envelope,
        digest: &str,
    ) -> Result<Arc<HandlerVersion>, PinError> {
        let name = self.handler_name(topology, env).ok_or(PinError::NoHandler)?;
        if let Some(current) = self
            .version(name)
            .filter(|v| v.digest == digest)
            .or_else(|| self.canary(name).filter(|v| v.digest == digest))
        {
            return Ok(current);
        }
        let resolver = self.resolver.read().as_ref().and_then(std::sync::Weak::upgrade);
        let Some(resolver) = resolver else {
            return Err(PinError::Unresolvable(format!(
                "handler `{name}` runs {} and this node keeps no other versions",
                self.version(name).map(|v| v.digest.clone()).unwrap_or_default()
            )));
        };
        resolver.pinned(name, digest).await.map_err(PinError::Unresolvable)
    }

    /// The current (stable) version of `name`.
    pub fn version(&self, name: &str) -> Option<Arc<HandlerVersion>> {
        self.versions.read().get(name).map(|i| i.stable.clone())
    }

    /// The canary of `name`, if one runs.
    pub fn canary(&self, name: &str) -> Option<Arc<HandlerVersion>> {
        self.versions.read().get(name)?.canary.as_ref().map(|(v, _)| v.clone())
    }

    /// Every installed version: each handler's stable one and its canary.
    pub fn versions(&self) -> Vec<Arc<HandlerVersion>> {
        self.versions
            .read()
            .values()
            .flat_map(|i| std::iter::once(i.stable.clone()).chain(i.canary.as_ref().map(|(v, _)| v.clone())))
            .collect()
    }

    /// The version a message of slot `slot` runs on (its handler's canary on
    /// the canary's slots, else the stable one), or `None` (dead-letter
    /// `no-handler`).
    pub fn route(&self, topology: &str, slot: u32, env: &Envelope) -> Option<Arc<HandlerVersion>> {
        let name = self.handler_name(topology, env)?;
        self.versions.read().get(name).map(|i| i.on(slot).clone())
    }

    /// Park the group of a failed message (`on_failure = "park"`) for the
    /// already bound `message_types` of `topology` (for `tenant`, or any
    /// tenant) that go to `handler`; returns how many.
    pub fn park(&mut self, topology: &str, tenant: Option<&str>, message_types: &[String], handler: &str) -> usize {
        let mut n = 0;
        for t in message_types {
            let Some(by_tenant) = self.bindings.get_mut(topology).and_then(|m| m.get_mut(t.as_str())) else {
                continue;
            };
            let binding = match tenant {
                Some(x) => by_tenant.tenants.get_mut(x),
                None => by_tenant.any.as_mut(),
            };
            if let Some(b) = binding.filter(|b| b.handler == handler) {
                b.park = true;
                n += 1;
            }
        }
        n
    }

    /// Whether a failed message parks its group (`on_failure = "park"`).
    pub fn parks(&self, topology: &str, env: &Envelope) -> bool {
        self.binding(topology, env).is_some_and(|b| b.park)
    }

    /// The name of the handler bound for a message.
    pub fn handler_name(&self, topology: &str, env: &Envelope) -> Option<&str> {
        Some(self.binding(topology, env)?.handler.as_str())
    }

    /// How a message is batched, or `None` when it goes to `handle` alone
    /// (as a pinned message always does: it runs on a version of its own).
    pub fn batch_rule(&self, topology: &str, env: &Envelope) -> Option<&Arc<BatchRule>> {
        if env.header(header::HANDLER_PIN).is_some() {
            return None;
        }
        self.binding(topology, env)?.batch.as_ref()
    }

    /// [`Router::batch_rule`] and [`Router::parks`] in one lookup (a
    /// runner asks both of every delivery).
    pub fn lane_rule(&self, topology: &str, env: &Envelope) -> (Option<&Arc<BatchRule>>, bool) {
        let Some(b) = self.binding(topology, env) else {
            return (None, false);
        };
        let batch = b.batch.as_ref().filter(|_| env.header(header::HANDLER_PIN).is_none());
        (batch, b.park)
    }

    fn binding(&self, topology: &str, env: &Envelope) -> Option<&Binding> {
        let by_tenant = self.bindings.get(topology)?.get(env.message_type.as_str())?;
        env.tenant_id
            .as_deref()
            .and_then(|t| by_tenant.tenants.get(t))
            .or(by_tenant.any.as_ref())
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

    #[test]
    fn batch_rules_follow_the_binding_of_their_tenant_and_handler() {
        let mut r = Router::new();
        r.bind("t", None, "line", "orders");
        r.bind("t", Some("acme"), "line", "acme-orders");
        r.bind("t", None, "single", "orders");
        let rule = BatchRule {
            handler: Arc::from("orders"),
            size: 0,
            linger: Duration::from_millis(20),
        };
        // Only the any-tenant binding of `line` belongs to `orders`.
        assert_eq!(r.batch("t", None, &["line".into(), "unbound".into()], rule), 1);
        let got = r.batch_rule("t", &msg("line", Some("other"))).expect("batched");
        assert_eq!((got.size, &*got.handler), (1, "orders"), "size 0 is raised to 1");
        assert!(
            r.batch_rule("t", &msg("line", Some("acme"))).is_none(),
            "acme's own binding is not batched"
        );
        assert!(r.batch_rule("t", &msg("single", None)).is_none());
        assert!(r.batch_rule("other", &msg("line", None)).is_none());
    }

    #[test]
    fn a_pinned_message_is_never_batched() {
        let mut r = Router::new();
        r.bind("t", None, "line", "orders");
        let rule = BatchRule {
            handler: Arc::from("orders"),
            size: 10,
            linger: Duration::from_millis(20),
        };
        assert_eq!(r.batch("t", None, &["line".into()], rule), 1);
        assert!(r.batch_rule("t", &msg("line", None)).is_some());
        let mut pinned = msg("line", None);
        pinned.headers.push((header::HANDLER_PIN.into(), "ab".repeat(32)));
        assert!(
            r.batch_rule("t", &pinned).is_none(),
            "it runs alone, on its own version"
        );
        assert_eq!(r.handler_name("t", &pinned), Some("orders"), "still its handler's");
    }
}
