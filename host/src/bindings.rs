//! The one `bindgen!` of the `weir:handler/handler` world (0.2.0). Everything
//! else in the host imports its types from here: the runtime its calls, the
//! envelope its message record.
//!
//! [`v0_1`] links components built against `weir:handler@0.1.0`: the same
//! types (mapped onto this module's with `with:`, so one `Message` serves
//! both), the same host imports without `begin-member`.
//!
//! [`v0_3`] links components built against `weir:handler@0.3.0`, where the
//! message is a resource the host owns ([`MessageRef`], [`BatchRef`]): the
//! guest reads what it needs through accessors, and nothing is lowered
//! ahead of the call but one handle.

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

/// The host side of a 0.3.0 `message` handle. It holds nothing: the handle's
/// `rep` names a message of the call being run (see `runtime::message`).
#[derive(Debug)]
pub struct MessageRef;

/// The host side of a 0.3.0 `batch` handle: the members of the call being run.
#[derive(Debug)]
pub struct BatchRef;

/// `weir:handler@0.3.0`: the message as a host-owned resource.
pub mod v0_3 {
    wasmtime::component::bindgen!({
        world: "handler",
        path: "../wit/0.3.0",
        imports: { default: trappable },
        with: {
            "weir:handler/types.message": super::MessageRef,
            "weir:handler/types.batch": super::BatchRef,
        },
    });
}
