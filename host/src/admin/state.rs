//! What the admin routes read.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use super::auth::Auth;
use super::limits::Limits;
use crate::cluster::coordinator::Coordinator;
use crate::cluster::slots::SlotSet;
use crate::observe::stats::Stats;
use crate::transport::Transport;

/// What the admin routes read.
pub struct AdminState {
    /// This node's name.
    pub node: String,
    /// Outcome counters.
    pub stats: Arc<Stats>,
    /// The slots this node runs.
    pub slots: Arc<SlotSet>,
    /// The broker (lag per slot, ack floors).
    pub transport: Arc<dyn Transport>,
    /// Who decides which slots this node runs (the cluster's view, if any).
    pub coordinator: Arc<dyn Coordinator>,
    /// False while the node cannot take work (starting, fenced, stopping).
    pub ready: Arc<AtomicBool>,
    /// Handler versions.
    pub registry: Arc<crate::registry::Registry>,
    /// What the listener allows a client.
    pub limits: Limits,
    /// Who may do what.
    pub auth: Auth,
    /// `cluster.mode`, as written.
    pub mode: &'static str,
    /// The slot count of each topology of the config, by name (publishing).
    pub topologies: std::collections::HashMap<String, u32>,
    /// Seals what a redrive sends (its count, provenance and pin).
    pub seal: crate::seal::Seal,
    /// Negative controls for tests (all off in production).
    pub controls: NegativeControls,
}

/// Negative controls for tests: each switches one admin fix off, so a test
/// can show the attack it stops. All off by default; never in production.
#[derive(Debug, Clone, Copy, Default)]
pub struct NegativeControls {
    /// `GET /v1/dead-letters` (and redrive, purge) count every tenant's
    /// letters in `read` for a tenant token, as before issue 32.
    pub unscoped_read_count: bool,
    /// `POST /v1/topologies/{T}/messages` takes any header name (CR/LF,
    /// spaces, `:`), as before issue 32.
    pub unchecked_header_names: bool,
}
