//! The slots a node runs, started and stopped one at a time: the static
//! modes start them all at once; the coordinator starts, drains and fences
//! them as assignments change.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::lanes::{Pipeline, RunnerReport, SlotSettings};

/// (topology, slot).
pub type SlotKey = (String, u32);

/// The running runner's cancel flag; replaced each time its supervisor
/// starts a new runner (after a connection fault).
pub type CancelCell = Arc<Mutex<Arc<AtomicBool>>>;

struct Running {
    stop: watch::Sender<bool>,
    cancel: CancelCell,
    task: Option<JoinHandle<anyhow::Result<RunnerReport>>>,
}

/// See the module docs.
pub struct SlotSet {
    pipeline: Arc<Pipeline>,
    /// Settings per topology; the slot number is filled in at start.
    templates: HashMap<String, SlotSettings>,
    running: Mutex<BTreeMap<SlotKey, Running>>,
}

impl SlotSet {
    /// A set with nothing running.
    pub fn new(pipeline: Arc<Pipeline>, templates: HashMap<String, SlotSettings>) -> Self {
        Self {
            pipeline,
            templates,
            running: Mutex::new(BTreeMap::new()),
        }
    }

    /// Start consuming `key` (no-op if it runs or its topology is unknown).
    pub fn start(&self, key: &SlotKey) -> bool {
        let Some(template) = self.templates.get(&key.0) else {
            tracing::error!(topology = %key.0, slot = key.1, "asked to run a slot of a topology this node does not have");
            return false;
        };
        let mut running = self.running.lock();
        if running.contains_key(key) {
            return false;
        }
        let mut settings = template.clone();
        settings.slot = key.1;
        settings.counters = self.pipeline.stats.slot(&settings.topology, key.1);
        let (stop, stop_rx) = watch::channel(false);
        let cancel: CancelCell = Arc::new(Mutex::new(Arc::new(AtomicBool::new(false))));
        let task = tokio::spawn(crate::node::supervise_slot(
            self.pipeline.clone(),
            settings,
            stop_rx,
            cancel.clone(),
        ));
        running.insert(
            key.clone(),
            Running {
                stop,
                cancel,
                task: Some(task),
            },
        );
        true
    }

    /// True while `key` runs (or drains).
    pub fn is_running(&self, key: &SlotKey) -> bool {
        self.running.lock().contains_key(key)
    }

    /// The slots that run (or drain), in order.
    pub fn running(&self) -> Vec<SlotKey> {
        self.running.lock().keys().cloned().collect()
    }

    /// Stop taking messages of `key`, return unstarted ones, wait for every
    /// running call, stop consuming. `None` if it did not run.
    pub async fn drain(&self, key: &SlotKey) -> Option<RunnerReport> {
        let task = {
            let mut running = self.running.lock();
            let r = running.get_mut(key)?;
            let _ = r.stop.send(true);
            r.task.take()
        };
        let report = match task {
            Some(t) => join(key, t).await,
            // Someone else is draining it; they remove it.
            None => return None,
        };
        self.running.lock().remove(key);
        Some(report)
    }

    /// Interrupt the running calls of `key`, then drain it (ownership lost).
    pub async fn fence(&self, key: &SlotKey) -> Option<RunnerReport> {
        if let Some(r) = self.running.lock().get(key) {
            r.cancel.lock().store(true, Ordering::Relaxed);
        }
        self.drain(key).await
    }

    /// Drain every slot at once; reports in slot order.
    pub async fn drain_all(&self) -> Vec<RunnerReport> {
        let keys = self.running();
        let drains = keys.iter().map(|k| self.drain(k));
        futures::future::join_all(drains).await.into_iter().flatten().collect()
    }

    /// Fence every slot at once.
    pub async fn fence_all(&self) -> Vec<RunnerReport> {
        for r in self.running.lock().values() {
            r.cancel.lock().store(true, Ordering::Relaxed);
        }
        self.drain_all().await
    }
}

async fn join(key: &SlotKey, task: JoinHandle<anyhow::Result<RunnerReport>>) -> RunnerReport {
    match task.await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            tracing::error!(topology = %key.0, slot = key.1, error = %format!("{e:#}"), "slot runner failed");
            RunnerReport::default()
        }
        Err(e) => {
            tracing::error!(topology = %key.0, slot = key.1, error = %e, "slot runner panicked");
            RunnerReport::default()
        }
    }
}
