//! The one `bindgen!` of the `weir:handler/handler` world (0.2.0). Everything
//! else in the host imports its types from here: the runtime its calls, the
//! envelope its message record.
//!
//! [`v0_1`] links components built against `weir:handler@0.1.0`: the same
//! types (mapped onto this module's with `with:`, so one `Message` serves
//! both), the same host imports without `begin-member`.

wasmtime::component::bindgen!({
    world: "handler",
    path: "../wit",
    imports: { default: trappable },
});

/// `weir:handler@0.1.0`, kept so components built before 0.2.0 still load.
pub mod v0_1 {
    wasmtime::component::bindgen!({
        world: "handler",
        path: "../wit/0.1.0",
        imports: { default: trappable },
        with: { "weir:handler/types@0.1.0": super::weir::handler::types },
    });
}
