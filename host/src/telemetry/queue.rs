//! The export queue toward the collector: bounded, and dropping with a count.
//! Ended spans wait in a queue of [`QUEUE_SPANS`]; one thread exports them
//! in batches of at most [`BATCH_SPANS`] (never more than the queue holds),
//! every [`EXPORT_EVERY`] or as soon as a batch is full, so at most a queue
//! and a batch are held. A collector that is slow or never answers holds that
//! thread (each export is bounded by the HTTP client's timeout), the queue
//! fills, and every span that finds it full is dropped and counted
//! (`weir_trace_spans_dropped_total`), never held: a node's memory does not
//! grow with the collector's delay.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use opentelemetry::Context;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};

/// Spans that wait for export, at most.
pub const QUEUE_SPANS: usize = 2048;
/// Spans in one export, at most.
pub const BATCH_SPANS: usize = 512;
/// A partial batch is exported after this long.
pub const EXPORT_EVERY: Duration = Duration::from_secs(1);

/// Spans dropped because the queue was full, since the process started.
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Spans dropped because the export queue was full (the collector slow or
/// unreachable), since the process started.
pub fn spans_dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// What the exporting thread is asked besides exporting.
enum Control {
    /// Export what is queued now, then answer.
    Flush(SyncSender<OTelSdkResult>),
    /// Export what is queued, shut the exporter down, answer and stop.
    Shutdown(SyncSender<OTelSdkResult>),
}

/// A [`SpanProcessor`] with a bounded queue (module docs).
#[derive(Debug)]
pub struct BoundedQueue<E: SpanExporter + 'static> {
    spans: SyncSender<SpanData>,
    control: Mutex<Sender<Control>>,
    exporter: Arc<Mutex<E>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    stopped: AtomicBool,
    /// Spans that found the queue full (this queue's share of [`spans_dropped`]).
    dropped: AtomicU64,
}

impl<E: SpanExporter + 'static> BoundedQueue<E> {
    /// A queue of `capacity` spans in front of `exporter`, exported by a
    /// thread of its own.
    pub fn new(exporter: E, capacity: usize) -> std::io::Result<Self> {
        let (spans, queued) = mpsc::sync_channel(capacity.max(1));
        let (control, asked) = mpsc::channel();
        let exporter = Arc::new(Mutex::new(exporter));
        let worker = Worker {
            exporter: exporter.clone(),
            queued,
            asked,
            batch: BATCH_SPANS.min(capacity.max(1)),
        };
        let thread = std::thread::Builder::new()
            .name("weir-trace-export".into())
            .spawn(move || worker.run())?;
        Ok(Self {
            spans,
            control: Mutex::new(control),
            exporter,
            thread: Mutex::new(Some(thread)),
            stopped: AtomicBool::new(false),
            dropped: AtomicU64::new(0),
        })
    }

    /// Spans this queue dropped.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    fn ask(&self, what: fn(SyncSender<OTelSdkResult>) -> Control, timeout: Duration) -> OTelSdkResult {
        let (tx, rx) = mpsc::sync_channel(1);
        let sent = self
            .control
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(what(tx));
        if sent.is_err() {
            return Err(OTelSdkError::AlreadyShutdown);
        }
        rx.recv_timeout(timeout).map_err(|_| OTelSdkError::Timeout(timeout))?
    }
}

impl<E: SpanExporter + 'static> SpanProcessor for BoundedQueue<E> {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if self.stopped.load(Ordering::Relaxed) {
            return;
        }
        match self.spans.try_send(span) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                if self.dropped.fetch_add(1, Ordering::Relaxed) == 0 {
                    tracing::warn!(
                        queue = QUEUE_SPANS,
                        "the trace collector is not keeping up: spans are dropped while the export queue is full \
                         (counted in weir_trace_spans_dropped_total)"
                    );
                }
                DROPPED.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Disconnected(_)) => {}
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.ask(Control::Flush, Duration::from_secs(30))
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        if self.stopped.swap(true, Ordering::Relaxed) {
            return Err(OTelSdkError::AlreadyShutdown);
        }
        let answer = self.ask(Control::Shutdown, timeout);
        if answer.is_ok()
            && let Some(t) = self.thread.lock().unwrap_or_else(PoisonError::into_inner).take()
        {
            let _ = t.join();
        }
        answer
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.exporter
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .set_resource(resource);
    }
}

/// The exporting thread's side.
struct Worker<E: SpanExporter> {
    exporter: Arc<Mutex<E>>,
    queued: Receiver<SpanData>,
    asked: Receiver<Control>,
    /// Spans in one export, at most.
    batch: usize,
}

impl<E: SpanExporter> Worker<E> {
    fn run(self) {
        let mut batch = Vec::with_capacity(self.batch);
        let mut due = Instant::now() + EXPORT_EVERY;
        loop {
            while let Ok(c) = self.asked.try_recv() {
                let stop = matches!(c, Control::Shutdown(_));
                self.drain(&mut batch);
                let mut answer = self.export(&mut batch);
                let reply = match c {
                    Control::Flush(r) => r,
                    Control::Shutdown(r) => {
                        let shut = self.exporter.lock().unwrap_or_else(PoisonError::into_inner).shutdown();
                        answer = answer.and(shut);
                        r
                    }
                };
                let _ = reply.send(answer);
                if stop {
                    return;
                }
            }
            let wait = due
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(100));
            match self.queued.recv_timeout(wait) {
                Ok(span) => batch.push(span),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    let _ = self.export(&mut batch);
                    return;
                }
            }
            if batch.len() >= self.batch || Instant::now() >= due {
                let _ = self.export(&mut batch);
                due = Instant::now() + EXPORT_EVERY;
            }
        }
    }

    /// Move everything queued now into `batch`, exporting full batches.
    fn drain(&self, batch: &mut Vec<SpanData>) {
        while let Ok(span) = self.queued.try_recv() {
            batch.push(span);
            if batch.len() >= self.batch {
                let _ = self.export(batch);
            }
        }
    }

    fn export(&self, batch: &mut Vec<SpanData>) -> OTelSdkResult {
        if batch.is_empty() {
            return Ok(());
        }
        let spans = std::mem::replace(batch, Vec::with_capacity(self.batch));
        let n = spans.len();
        let exporter = self.exporter.lock().unwrap_or_else(PoisonError::into_inner);
        let result = futures::executor::block_on(exporter.export(spans));
        if let Err(e) = &result {
            tracing::debug!(spans = n, error = %e, "exporting spans to the collector failed; they are dropped");
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use opentelemetry::trace::{Span as _, Tracer as _, TracerProvider as _};
    use opentelemetry_sdk::trace::SdkTracerProvider;

    use super::*;

    /// A collector that never answers: every export says it started, then
    /// blocks until released.
    #[derive(Debug, Clone)]
    struct Stuck {
        started: SyncSender<()>,
        release: Arc<(Mutex<bool>, std::sync::Condvar)>,
        exported: Arc<AtomicUsize>,
    }

    impl SpanExporter for Stuck {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            let _ = self.started.try_send(());
            let (lock, cv) = &*self.release;
            let mut open = lock.lock().unwrap();
            while !*open {
                open = cv.wait(open).unwrap();
            }
            self.exported.fetch_add(batch.len(), Ordering::SeqCst);
            Ok(())
        }
    }

    #[test]
    fn a_stuck_collector_fills_the_queue_and_further_spans_are_dropped_and_counted() {
        let (started, export_began) = mpsc::sync_channel(16);
        let stuck = Stuck {
            started,
            release: Arc::default(),
            exported: Arc::default(),
        };
        let queue = BoundedQueue::new(stuck.clone(), 8).unwrap();
        let provider = SdkTracerProvider::builder().with_span_processor(queue).build();
        let tracer = provider.tracer("test");
        let before = spans_dropped();
        // A full batch (8) goes to the collector, which holds it.
        for _ in 0..8 {
            tracer.start("s").end();
        }
        export_began.recv_timeout(Duration::from_secs(10)).unwrap();
        // The queue takes 8 more; the other 92 are dropped, and counted.
        for _ in 0..100 {
            tracer.start("s").end();
        }
        assert_eq!(spans_dropped() - before, 92);
        let (lock, cv) = &*stuck.release;
        *lock.lock().unwrap() = true;
        cv.notify_all();
        provider.shutdown().unwrap();
        assert_eq!(
            stuck.exported.load(Ordering::SeqCst),
            16,
            "what was held is exported once released"
        );
    }
}
