//! Weir: a WebAssembly-hosted message-handler platform. This crate is the
//! native host (`weir`).
//!
//! The modules are listed in the order a message travels through them. A
//! message arrives on a broker ([`transport`]) as an [`envelope`], is
//! forwarded from the topology's ingress to the slot of its group
//! ([`ingress`], [`partition`]), is routed to a handler version ([`router`]),
//! waits in its group's lane and runs on a worker ([`dispatch`], [`runtime`]),
//! and its [`outcome`] is settled on the broker exactly once ([`settle`],
//! [`retry`]). Beside that path: what is counted and observed ([`observe`]),
//! which versions are deployed ([`registry`]), which node runs which slot
//! ([`cluster`]), the operator's HTTP face ([`admin`]), and the composition
//! root that wires one node together ([`node`]). Each module imports only
//! modules above it in the flow or leaves beside it, never `node`: what composes
//! nodes (the `weir` binary's `cli/`, `weir demo` among it, and the tests) is outside
//! the library.

// A function over 100 lines is a room to split (clippy.toml sets the threshold); tests
// are exempt, the product code is not.
#![deny(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]

/// The config file: types, defaults, validation, units.
pub mod config;

/// Weir's own headers are Weir's: the seal over what it writes onto a
/// message, checked before anything reads a `weir-*` header (a leaf).
pub mod seal;

/// Thread priorities (a leaf).
pub mod sched;

/// The generated WIT bindings of the handler world (the message record).
pub mod bindings;

/// A message and its wire form (headers + body).
pub mod envelope;

/// Which slot a group (or an id) belongs to.
pub mod partition;

/// The broker seam: memory, RabbitMQ, NATS JetStream.
pub mod transport;

/// Ingress → slot queues, in order.
pub mod ingress;

/// (topology, tenant, message type) → handler version, batch rules.
pub mod router;

/// Slot runner, lanes, scheduling, batches, jobs, supervisor.
pub mod dispatch;

/// The Wasm engine, handler versions, workers, host imports.
pub mod runtime;

/// How a delivery ended, and who is told (a leaf).
pub mod outcome;

/// Outcome → ack, retry, cascades, dead-letter capture.
pub mod settle;

/// `handler.dedup`: records of handled messages in the coordinator's store.
pub mod dedup;

/// `on_failure = "park"`: parked groups kept for the next owner of their slot.
pub mod parked;

/// The retry ladder (pure arithmetic).
pub mod retry;

/// Dead letters: list, show, redrive (in order, confirmed before removal), purge.
pub mod deadletter;

/// Counters, ledgers, the soak's journal.
pub mod observe;

/// Handler versions: deploy, rollback, store, cluster sync.
pub mod registry;

/// Traces: OpenTelemetry spans per message, `traceparent` through cascades.
pub mod telemetry;

/// Who runs which slot: the coordinator modes.
pub mod cluster;

/// The admin HTTP listener: routes, auth, metrics.
pub mod admin;

/// The composition root: one running node.
pub mod node;
