//! Weir: a WebAssembly-hosted message-handler platform. This crate is the
//! native host (`weir`): transports, slots, lanes, retries and the runtime
//! that calls handlers compiled to WebAssembly components.

pub mod admin;
pub mod cluster;
pub mod config;
pub mod demo;
pub mod envelope;
pub mod floor;
pub mod journal;
pub mod lanes;
pub mod ledger;
pub mod node;
pub mod partition;
pub mod registry;
pub mod retry;
pub mod router;
pub mod runtime;
pub mod stats;
pub mod transport;
