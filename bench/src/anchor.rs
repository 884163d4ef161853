//! The Wasm anchor of the drains: the bundled noop component called inline
//! by a bare broker client through a plain wasmtime loop — one `Store` and
//! instance per consumer, the message record built from the delivery's
//! headers, `handle` called, the result looked at. It is the work a Weir node
//! cannot avoid per message (the Wasm call and what the guest needs to see),
//! without anything Weir adds (lanes, routing, budgets, settling).

use std::sync::Arc;

use anyhow::{Context as _, bail};
use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Config, Engine, Store};

use weir::bindings::Handler;
use weir::bindings::weir::handler::host::Host;
use weir::bindings::weir::handler::types::{Host as TypesHost, Level};
use weir::envelope::Envelope;

/// What the noop guest may import during a call: nothing is published or
/// logged, `config` has no keys.
struct Imports;

impl TypesHost for Imports {}

impl Host for Imports {
    fn log(&mut self, _level: Level, _text: String) -> wasmtime::Result<()> {
        Ok(())
    }
    fn publish(
        &mut self,
        _message_type: String,
        _group_id: Option<String>,
        _headers: Vec<(String, String)>,
        _payload: Vec<u8>,
    ) -> wasmtime::Result<Result<(), String>> {
        Ok(Err("the anchor does not publish".into()))
    }
    fn begin_member(&mut self, _index: u32) -> wasmtime::Result<()> {
        Ok(())
    }
    fn config(&mut self, _key: String) -> wasmtime::Result<Option<String>> {
        Ok(None)
    }
}

/// The compiled noop component and a linker for it, shared by every caller.
#[derive(Clone)]
pub struct Anchor {
    engine: Engine,
    component: Component,
    linker: Arc<Linker<Imports>>,
}

impl Anchor {
    /// Compile the bundled noop component on a plain engine (epoch
    /// interruption on, as a node needs it for timeouts; no pooling, no fuel).
    pub fn new() -> anyhow::Result<Self> {
        let mut cfg = Config::new();
        cfg.wasm_component_model(true).epoch_interruption(true);
        let engine = Engine::new(&cfg).map_err(anyhow::Error::from)?;
        let component = Component::new(&engine, weir::node::bundled::NOOP)
            .map_err(anyhow::Error::from)
            .context("compiling the noop component for the anchor")?;
        let mut linker = Linker::new(&engine);
        Handler::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s).map_err(anyhow::Error::from)?;
        // WASI is imported but never called by the noop guest.
        linker
            .define_unknown_imports_as_traps(&component)
            .map_err(anyhow::Error::from)?;
        Ok(Self {
            engine,
            component,
            linker: Arc::new(linker),
        })
    }

    /// One caller: its own store and instance (a consumer's worth).
    pub fn caller(&self) -> anyhow::Result<Caller> {
        let mut store = Store::new(&self.engine, Imports);
        store.set_epoch_deadline(u64::MAX / 2);
        let handler = Handler::instantiate(&mut store, &self.component, &self.linker).map_err(anyhow::Error::from)?;
        Ok(Caller { store, handler })
    }
}

/// A store with an instance of the noop guest.
pub struct Caller {
    store: Store<Imports>,
    handler: Handler,
}

impl Caller {
    /// Call `handle` with `msg`; anything but `ok` is an error.
    pub fn call(&mut self, msg: &Envelope) -> anyhow::Result<()> {
        match self.handler.call_handle(&mut self.store, msg) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(f)) => bail!("the noop guest refused a message: {f:?}"),
            Err(e) => bail!("the noop guest trapped: {e:#}"),
        }
    }
}
