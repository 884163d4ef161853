//! Cranelift's incremental compilation cache, in memory: the machine code of each function
//! compiled by this process, keyed by the function's own contents. A new version of a
//! handler compiles only the functions that changed. That is most of the gain for Python and
//! JavaScript guests: a save changes the interpreter's heap snapshot (data), not its code, so
//! the swap of a 17 MiB component costs its few changed functions, not its 30 000 unchanged
//! ones (`weir dev`, and every deploy to a running node).
//!
//! Bounded: when the entries pass [`FunctionCache::cap`] bytes the cache is emptied and fills
//! again with what is compiled next (the versions in use), so memory never grows past the cap
//! plus one component's code.

use std::borrow::Cow;
use std::collections::HashMap;

use parking_lot::Mutex;

/// Bytes of keys and code kept by default.
pub const DEFAULT_CAP: usize = 256 << 20;

/// A bounded in-memory [`wasmtime::CacheStore`].
#[derive(Debug)]
pub struct FunctionCache {
    cap: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<Box<[u8]>, Box<[u8]>>,
    bytes: usize,
    hits: u64,
    misses: u64,
}

impl FunctionCache {
    /// A cache keeping at most `cap` bytes.
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Its bound, bytes.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// (hits, misses) so far.
    pub fn counts(&self) -> (u64, u64) {
        let g = self.inner.lock();
        (g.hits, g.misses)
    }

    /// Bytes held now.
    pub fn bytes(&self) -> usize {
        self.inner.lock().bytes
    }
}

impl wasmtime::CacheStore for FunctionCache {
    fn get(&self, key: &[u8]) -> Option<Cow<'_, [u8]>> {
        let mut g = self.inner.lock();
        // Copied out: the lock is not held while Cranelift reads it.
        let found = g.entries.get(key).map(|v| Cow::Owned(v.to_vec()));
        if found.is_some() {
            g.hits += 1;
        } else {
            g.misses += 1;
        }
        found
    }

    fn insert(&self, key: &[u8], value: Vec<u8>) -> bool {
        let size = key.len() + value.len();
        if size > self.cap {
            return false;
        }
        let mut g = self.inner.lock();
        if g.bytes + size > self.cap {
            g.entries.clear();
            g.bytes = 0;
        }
        if let Some(old) = g.entries.insert(key.into(), value.into_boxed_slice()) {
            g.bytes -= key.len() + old.len();
        }
        g.bytes += size;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasmtime::CacheStore as _;

    #[test]
    fn it_keeps_what_it_is_given_and_empties_itself_at_its_cap() {
        let c = FunctionCache::new(100);
        assert!(c.get(b"a").is_none());
        assert!(c.insert(b"a", vec![1; 40]));
        assert_eq!(c.get(b"a").as_deref(), Some(&[1u8; 40][..]));
        assert!(c.insert(b"a", vec![2; 40]), "a key inserted again replaces its value");
        assert_eq!(c.bytes(), 41);
        assert!(c.insert(b"b", vec![3; 40]));
        assert_eq!(c.bytes(), 82);
        assert!(c.insert(b"c", vec![4; 40]), "over the cap: emptied, then kept");
        assert_eq!(c.bytes(), 41);
        assert!(c.get(b"a").is_none() && c.get(b"c").is_some());
        assert!(!c.insert(b"d", vec![0; 200]), "an entry over the cap is refused");
        assert_eq!(c.counts(), (2, 2));
    }

    /// A second version of a component whose functions did not change compiles from the
    /// cache: every function of the second compile is a hit.
    #[test]
    fn a_recompile_of_unchanged_functions_hits_the_cache() {
        let cache = std::sync::Arc::new(FunctionCache::new(DEFAULT_CAP));
        let mut cfg = wasmtime::Config::new();
        cfg.wasm_component_model(true);
        cfg.enable_incremental_compilation(cache.clone()).unwrap();
        let engine = wasmtime::Engine::new(&cfg).unwrap();
        let wat = |data: &str, factor: u32| {
            format!(
                r#"(component (core module (memory 1) (data (i32.const 0) "{data}")
                     (func (export "f") (param i32) (result i32) local.get 0 i32.const {factor} i32.mul)
                     (func (export "g") (param i32) (result i32) local.get 0 i32.const 3 i32.add)))"#
            )
        };
        wasmtime::component::Component::new(&engine, wat("v1", 7)).unwrap();
        let (hits, misses) = cache.counts();
        assert!(misses >= 2, "{misses}");
        // Only the data changed, as between two saves of a Python handler: at most one
        // entry (measured: one, of the component's glue) is compiled again.
        wasmtime::component::Component::new(&engine, wat("v2", 7)).unwrap();
        let (hits2, misses2) = cache.counts();
        assert!(misses2 - misses <= 1, "{} compiled again", misses2 - misses);
        assert!(hits2 - hits >= hits + misses - 1, "{} found", hits2 - hits);
        // A function that changed is compiled, not taken from the cache.
        wasmtime::component::Component::new(&engine, wat("v2", 9)).unwrap();
        let (_, misses3) = cache.counts();
        assert!(misses3 > misses2, "the changed function was not compiled");
    }
}
