//! Components shipped inside the `weir` binary, addressable in a config as
//! `component = "bundled:NAME"`.

mod paths {
    #![allow(dead_code)]
    include!(concat!(env!("OUT_DIR"), "/guests.rs"));
}

/// The example orders handler.
pub const ORDERS: &[u8] = paths::ORDERS_BYTES;
/// The no-op handler (benchmarks).
pub const NOOP: &[u8] = paths::NOOP_BYTES;
/// Path of the test guest with faults on demand (tests only).
pub const FAULTY_PATH: &str = paths::FAULTY;

/// A bundled component by name.
pub fn get(name: &str) -> Option<&'static [u8]> {
    match name {
        "orders" => Some(ORDERS),
        "noop" => Some(NOOP),
        _ => None,
    }
}
