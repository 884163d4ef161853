//! The seam between a node and whoever decides which slots it consumes.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use async_trait::async_trait;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::slots::{SlotKey, SlotSet};
use super::status::Status;

/// What a coordinator is given when the node starts.
pub struct Start {
    /// The slots this node runs; the coordinator starts and stops them.
    pub slots: Arc<SlotSet>,
    /// Every (topology, slot) of the config, in order.
    pub all: Vec<SlotKey>,
    /// `GET /ready`: false while the node cannot take work.
    pub ready: Arc<AtomicBool>,
    /// Turns true when the node stops.
    pub stop: watch::Receiver<bool>,
}

/// Decides which slots this node consumes (`cluster.mode`). A mode that
/// decides once, at start, answers [`Coordinator::initial_slots`] and has no
/// loop; a mode that assigns slots as nodes come and go starts them itself
/// from [`Coordinator::start`], and drains them before its loop ends.
#[async_trait]
pub trait Coordinator: Send + Sync {
    /// The slots of a topology of `slots` slots this node consumes from the
    /// start.
    fn initial_slots(&self, slots: u32) -> Vec<u32>;

    /// May the node take work as soon as it started (`GET /ready`)?
    fn ready_at_start(&self) -> bool {
        true
    }

    /// Start the mode's loop, if it has one; it ends after the stop, once it
    /// drained its slots and left the cluster.
    fn start(&self, _start: Start) -> Option<JoinHandle<anyhow::Result<()>>> {
        None
    }

    /// The cluster as `weir status` shows it; `None` when this node alone
    /// knows its slots.
    async fn status(&self) -> anyhow::Result<Option<Status>> {
        Ok(None)
    }
}
