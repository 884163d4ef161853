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
}
