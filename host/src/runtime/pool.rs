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
        /// Outcomes of the job's first items, when a demoted worker handed the rest back.
        done: Vec<(Envelope, CallOutcome)>,
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
        /// Outcomes of the job's first calls, when a demoted worker handed the rest back.
        done: Vec<(Vec<Envelope>, BatchOutcome)>,
        /// Set to interrupt the running call.
        cancel: Option<Arc<AtomicBool>>,
        /// Each batch's members with its outcome, same order.
        reply: oneshot::Sender<Vec<(Vec<Envelope>, BatchOutcome)>>,
    },
}

/// The worker threads. Dropping the pool lets them finish queued jobs and exit.
///
/// Fair share: a call that outlives the runtime's `demote_after` (a runaway
/// or very heavy guest) moves its thread to the idle scheduling class for
/// the rest of that call, and a fresh worker takes its place in the pool; the
/// demoted thread exits when the call ends. So the pool always has its full
/// number of workers at normal priority for everyone else, while the long
/// call still gets whatever CPU is left over until its timeout ends it.
/// The rest of the demoted worker's job (calls not yet started, of other
/// lanes too) is handed back to the queue for a worker at normal priority.
pub struct WorkerPool {
    tx: Option<crossbeam_channel::Sender<Job>>,
    shared: Arc<Shared>,
    size: usize,
}

struct Shared {
    rx: crossbeam_channel::Receiver<Job>,
    runtime: Arc<Runtime>,
    threads: parking_lot::Mutex<Vec<std::thread::JoinHandle<()>>>,
    spawned: std::sync::atomic::AtomicUsize,
    demoted: std::sync::atomic::AtomicU64,
    /// Where a demoted worker hands back the unstarted rest of its job (`None` once the
    /// pool is dropped: the demoted worker then finishes the job itself).
    handback: parking_lot::Mutex<Option<crossbeam_channel::Sender<Job>>>,
}

thread_local! {
    /// Set on a worker thread that demoted itself during a long call.
    static DEMOTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Shared {
    fn spawn_worker(self: &Arc<Self>) -> anyhow::Result<()> {
        let i = self.spawned.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let shared = self.clone();
        let t = std::thread::Builder::new()
            .name(format!("weir-worker-{i}"))
            .stack_size(8 << 20)
            .spawn(move || shared.work())
            .context("starting a worker thread")?;
        self.threads.lock().push(t);
        Ok(())
    }

    fn work(self: Arc<Self>) {
        let mut exec = Executor::new(self.runtime.clone());
        let me = Arc::downgrade(&self);
        exec.on_long_call(Arc::new(move || {
            if DEMOTED.get() {
                return;
            }
            DEMOTED.set(true);
            // The replacement first: a thread inherits its creator's
            // scheduling class, so one spawned after the demotion would
            // run at idle priority too (and so would every worker after it).
            if let Some(shared) = me.upgrade() {
                shared.demoted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if let Err(e) = shared.spawn_worker() {
                    tracing::error!(error = %e, "cannot replace a demoted worker");
                }
            }
            demote_current_thread();
        }));
        while let Ok(job) = self.rx.recv() {
            run(&mut exec, job, &self);
            if DEMOTED.get() {
                // A replacement runs at normal priority already.
                break;
            }
        }
    }
}

/// Move the calling thread to the idle scheduling class (it then runs only
/// when a core would otherwise idle); nice 19 where that is refused.
fn demote_current_thread() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: plain syscalls on the calling thread (pid 0), with a valid parameter.
        let ok = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } == 0
            || unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 19) } == 0;
        if !ok {
            tracing::warn!("could not lower a long call's worker priority");
        }
    }
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
        let shared = Arc::new(Shared {
            rx,
            runtime,
            threads: parking_lot::Mutex::new(Vec::with_capacity(workers)),
            spawned: std::sync::atomic::AtomicUsize::new(0),
            demoted: std::sync::atomic::AtomicU64::new(0),
            handback: parking_lot::Mutex::new(Some(tx.clone())),
        });
        for _ in 0..workers {
            shared.spawn_worker()?;
        }
        Ok(Self {
            tx: Some(tx),
            shared,
            size: workers,
        })
    }

    /// Calls that outlived `demote_after` and had their worker replaced.
    pub fn demoted(&self) -> u64 {
        self.shared.demoted.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Number of worker threads at normal priority.
    pub fn size(&self) -> usize {
        self.size
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
        self.submit(Job::Each {
            items,
            done: Vec::new(),
            cancel,
            reply,
        });
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
        self.submit(Job::Batches {
            calls,
            done: Vec::new(),
            cancel,
            reply,
        });
        rx.await.context("worker pool stopped during a call")
    }
}

/// Whether this worker was demoted during the job and the pool can take the rest back.
fn hand_back(shared: &Shared) -> Option<crossbeam_channel::Sender<Job>> {
    if DEMOTED.get() {
        shared.handback.lock().clone()
    } else {
        None
    }
}

#[allow(
    clippy::while_let_on_iterator,
    reason = "the rest of the iterator is handed back from inside the loop"
)]
fn run(exec: &mut Executor, job: Job, shared: &Shared) {
    match job {
        Job::Each {
            items,
            mut done,
            cancel,
            reply,
        } => {
            let mut items = items.into_iter();
            while let Some((h, msg)) = items.next() {
                let outcome = exec.call(&h, &msg, &cancel);
                done.push((msg, outcome));
                // Demoted during that call: the calls not started yet go back to the queue
                // for a worker at normal priority, in order, with what is done so far.
                if !items.as_slice().is_empty()
                    && let Some(tx) = hand_back(shared)
                {
                    let rest = Job::Each {
                        items: items.collect(),
                        done,
                        cancel,
                        reply,
                    };
                    if let Err(crossbeam_channel::SendError(rest)) = tx.send(rest) {
                        run_here(exec, rest);
                    }
                    return;
                }
            }
            // The receiver may have gone (shutdown): nothing to settle then.
            let _ = reply.send(done);
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
        Job::Batches {
            calls,
            mut done,
            cancel,
            reply,
        } => {
            let mut calls = calls.into_iter();
            while let Some((h, batch)) = calls.next() {
                let outcome = exec.call_batch(&h, &batch, &cancel);
                done.push((batch, outcome));
                if !calls.as_slice().is_empty()
                    && let Some(tx) = hand_back(shared)
                {
                    let rest = Job::Batches {
                        calls: calls.collect(),
                        done,
                        cancel,
                        reply,
                    };
                    if let Err(crossbeam_channel::SendError(rest)) = tx.send(rest) {
                        run_here(exec, rest);
                    }
                    return;
                }
            }
            let _ = reply.send(done);
        }
    }
}

/// Finish a job on this thread whatever its priority (the pool is shutting down).
fn run_here(exec: &mut Executor, job: Job) {
    let closed = Shared {
        rx: crossbeam_channel::never(),
        runtime: exec.runtime.clone(),
        threads: parking_lot::Mutex::new(Vec::new()),
        spawned: std::sync::atomic::AtomicUsize::new(0),
        demoted: std::sync::atomic::AtomicU64::new(0),
        handback: parking_lot::Mutex::new(None),
    };
    run(exec, job, &closed);
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.tx = None;
        self.shared.handback.lock().take();
        // Demoted workers may start replacements while the queue drains.
        loop {
            let threads = std::mem::take(&mut *self.shared.threads.lock());
            if threads.is_empty() {
                break;
            }
            for t in threads {
                let _ = t.join();
            }
        }
    }
}
