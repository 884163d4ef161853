//! A fixed pool of worker threads, each with its own [`Executor`]. Lanes hand
//! it work as [`Job`]s; a job's calls run one after another on one thread, so
//! a lane that submits one job at a time never runs two of its messages at
//! once. Wasm calls are synchronous and never block the async runtime.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::Context as _;
use tokio::sync::oneshot;

use super::{BatchOutcome, CallOutcome, Executor, HandlerVersion, Runtime};
use crate::envelope::Envelope;

/// Work for one worker: calls that must run in order, on one thread.
pub enum Job {
    /// Call `handle` for each message in turn.
    Each {
        /// (handler, message) in lane order.
        items: Vec<(Arc<HandlerVersion>, Envelope)>,
        /// Set to interrupt the running call.
        cancel: Option<Arc<AtomicBool>>,
        /// Messages come back with their outcomes, same order.
        reply: oneshot::Sender<Vec<(Envelope, CallOutcome)>>,
    },
    /// Call `handle-batch` once.
    Batch {
        /// The handler.
        handler: Arc<HandlerVersion>,
        /// Its members.
        batch: Vec<Envelope>,
        /// Set to interrupt the call.
        cancel: Option<Arc<AtomicBool>>,
        /// Members come back with the outcome.
        reply: oneshot::Sender<(Vec<Envelope>, BatchOutcome)>,
    },
    /// Call `handle-batch` once per batch, in order (batches of several
    /// lanes sharing one hand-off).
    Batches {
        /// (handler, members) per call.
        calls: Vec<(Arc<HandlerVersion>, Vec<Envelope>)>,
        /// Set to interrupt the running call.
        cancel: Option<Arc<AtomicBool>>,
        /// Each batch's members with its outcome, same order.
        reply: oneshot::Sender<Vec<(Vec<Envelope>, BatchOutcome)>>,
    },
}

/// The worker threads. Dropping the pool lets them finish queued jobs and exit.
pub struct WorkerPool {
    tx: Option<crossbeam_channel::Sender<Job>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl WorkerPool {
    /// Start `workers` threads (0 = one per core).
    pub fn new(runtime: Arc<Runtime>, workers: usize) -> anyhow::Result<Self> {
        let workers = if workers == 0 {
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2)
        } else {
            workers
        };
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let mut threads = Vec::with_capacity(workers);
        for i in 0..workers {
            let rx = rx.clone();
            let rt = runtime.clone();
            let t = std::thread::Builder::new()
                .name(format!("weir-worker-{i}"))
                .stack_size(8 << 20)
                .spawn(move || {
                    let mut exec = Executor::new(rt);
                    for job in rx {
                        run(&mut exec, job);
                    }
                })
                .context("starting a worker thread")?;
            threads.push(t);
        }
        Ok(Self { tx: Some(tx), threads })
    }

    /// Number of worker threads.
    pub fn size(&self) -> usize {
        self.threads.len()
    }

    /// Queue a job. The queue is unbounded on purpose: what is in flight is
    /// bounded by the broker (prefetch), and a bounded queue here would form
    /// a cycle with the lanes that wait on it.
    pub fn submit(&self, job: Job) {
        if let Some(tx) = &self.tx
            && tx.send(job).is_err()
        {
            tracing::error!("worker pool is gone; job dropped (its messages stay unacknowledged)");
        }
    }

    /// Run `handle` for each item in order; resolves with the outcomes.
    pub async fn run_each(
        &self,
        items: Vec<(Arc<HandlerVersion>, Envelope)>,
        cancel: Option<Arc<AtomicBool>>,
    ) -> anyhow::Result<Vec<(Envelope, CallOutcome)>> {
        let (reply, rx) = oneshot::channel();
        self.submit(Job::Each { items, cancel, reply });
        rx.await.context("worker pool stopped during a call")
    }

    /// Run `handle-batch` once; resolves with the members and the outcome.
    pub async fn run_batch(
        &self,
        handler: Arc<HandlerVersion>,
        batch: Vec<Envelope>,
        cancel: Option<Arc<AtomicBool>>,
    ) -> anyhow::Result<(Vec<Envelope>, BatchOutcome)> {
        let (reply, rx) = oneshot::channel();
        self.submit(Job::Batch {
            handler,
            batch,
            cancel,
            reply,
        });
        rx.await.context("worker pool stopped during a call")
    }
}

impl WorkerPool {
    /// Run `handle-batch` once for each of `calls`, in order, on one worker.
    pub async fn run_batches(
        &self,
        calls: Vec<(Arc<HandlerVersion>, Vec<Envelope>)>,
        cancel: Option<Arc<AtomicBool>>,
    ) -> anyhow::Result<Vec<(Vec<Envelope>, BatchOutcome)>> {
        let (reply, rx) = oneshot::channel();
        self.submit(Job::Batches { calls, cancel, reply });
        rx.await.context("worker pool stopped during a call")
    }
}

fn run(exec: &mut Executor, job: Job) {
    match job {
        Job::Each { items, cancel, reply } => {
            let out = items
                .into_iter()
                .map(|(h, msg)| {
                    let outcome = exec.call(&h, &msg, &cancel);
                    (msg, outcome)
                })
                .collect();
            // The receiver may have gone (shutdown): nothing to settle then.
            let _ = reply.send(out);
        }
        Job::Batch {
            handler,
            batch,
            cancel,
            reply,
        } => {
            let outcome = exec.call_batch(&handler, &batch, &cancel);
            let _ = reply.send((batch, outcome));
        }
        Job::Batches { calls, cancel, reply } => {
            let out = calls
                .into_iter()
                .map(|(h, batch)| {
                    let outcome = exec.call_batch(&h, &batch, &cancel);
                    (batch, outcome)
                })
                .collect();
            let _ = reply.send(out);
        }
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
