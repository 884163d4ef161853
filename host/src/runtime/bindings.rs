//! The one `bindgen!` of the `weir:handler/handler` world. Everything else in
//! the host imports its types from here.

wasmtime::component::bindgen!({
    world: "handler",
    path: "../wit",
    imports: { default: trappable },
});
