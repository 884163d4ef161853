//! Where a guest's stdout and stderr go. Not granted the host's: a small ring buffer per
//! instance that keeps the last bytes written, so a trap can be reported with the guest's own
//! last words (a Rust panic message, a Python traceback line) in `weir-error`. Granted: the
//! host's stdout and stderr, within the call's log budget ([`CallLog`], shared with the `log`
//! import), so a flood is cut to a bounded number of lines and bytes per call.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::io::AsyncWrite;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamError};

/// Keeps the last `capacity` bytes written; never blocks, never fails.
#[derive(Debug, Clone)]
pub struct TailPipe {
    capacity: usize,
    buffer: Arc<Mutex<VecDeque<u8>>>,
    /// Bytes written since the last [`TailPipe::clear`], kept or not.
    written: Arc<std::sync::atomic::AtomicUsize>,
}

impl TailPipe {
    /// A pipe keeping the last `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            buffer: Arc::new(Mutex::new(VecDeque::new())),
            written: Arc::default(),
        }
    }

    fn push(&self, bytes: &[u8]) {
        self.written
            .fetch_add(bytes.len(), std::sync::atomic::Ordering::Relaxed);
        let mut b = self.buffer.lock();
        let bytes = &bytes[bytes.len().saturating_sub(self.capacity)..];
        let overflow = (b.len() + bytes.len()).saturating_sub(self.capacity);
        let len = b.len();
        b.drain(..overflow.min(len));
        b.extend(bytes);
    }

    /// Forget what was written (at the start of each call).
    pub fn clear(&self) {
        self.buffer.lock().clear();
        self.written.store(0, std::sync::atomic::Ordering::Relaxed);
    }

    /// Bytes held now (the last of what was written, at most the capacity).
    pub fn held(&self) -> usize {
        self.buffer.lock().len()
    }

    /// Bytes written since the last [`TailPipe::clear`], including those no longer kept.
    pub fn written(&self) -> usize {
        self.written.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The last `max` bytes of what the guest wrote, as it wrote them
    /// (lines intact, lossy UTF-8); `None` when it wrote nothing.
    pub fn last_output(&self, max: usize) -> Option<String> {
        let mut b = self.buffer.lock();
        let bytes = b.make_contiguous();
        let tail = &bytes[bytes.len().saturating_sub(max)..];
        let text = String::from_utf8_lossy(tail).into_owned();
        (!text.trim().is_empty()).then_some(text)
    }

    /// The last non-empty lines written, joined with " | ", at most `max` chars.
    pub fn last_words(&self, max: usize) -> Option<String> {
        let mut b = self.buffer.lock();
        let text = String::from_utf8_lossy(b.make_contiguous()).into_owned();
        let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
        if lines.is_empty() {
            return None;
        }
        let mut out = String::new();
        for line in lines.iter().rev() {
            if out.len() + line.len() + 3 > max && !out.is_empty() {
                break;
            }
            out = if out.is_empty() {
                (*line).to_owned()
            } else {
                format!("{line} | {out}")
            };
        }
        out.truncate(max);
        Some(out)
    }
}

impl IsTerminal for TailPipe {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for TailPipe {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[async_trait::async_trait]
impl OutputStream for TailPipe {
    fn write(&mut self, bytes: Bytes) -> Result<(), StreamError> {
        self.push(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), StreamError> {
        Ok(())
    }

    fn check_write(&mut self) -> Result<usize, StreamError> {
        Ok(64 * 1024)
    }
}

#[async_trait::async_trait]
impl Pollable for TailPipe {
    async fn ready(&mut self) {}
}

impl AsyncWrite for TailPipe {
    fn poll_write(self: Pin<&mut Self>, _cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.push(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// What one call has written to the host's log and stdio, against its budgets. Lines over
/// the budget are dropped and counted; the executor writes one marker line per call. Lines
/// within it are then held to the tenant's budget over time ([`LogRate`]), if it has one.
#[derive(Debug)]
pub struct CallLog {
    max_bytes: usize,
    max_lines: usize,
    line_bytes: usize,
    count: Mutex<LogCount>,
    rate: Option<Arc<LogRate>>,
}

/// A tenant's log budget over time (`tenant.budgets.log_bytes_per_second`,
/// `log_lines_per_second`), shared by all its calls: a bucket of bytes and one of lines,
/// refilled at their rates and holding at most one second's worth. A line is written while
/// both buckets hold something (it may take the bytes bucket below zero); otherwise it is
/// dropped and counted, with one marker line a second at most for the whole tenant.
#[derive(Debug)]
pub struct LogRate {
    tenant: Arc<str>,
    bytes_per_second: Option<u64>,
    lines_per_second: Option<u64>,
    state: Mutex<RateState>,
    /// Lines dropped over the rate, all the tenant's calls.
    pub dropped_lines: std::sync::atomic::AtomicU64,
    /// Bytes of those lines.
    pub dropped_bytes: std::sync::atomic::AtomicU64,
}

#[derive(Debug)]
struct RateState {
    bytes: f64,
    lines: f64,
    at: std::time::Instant,
    /// When the last marker line was written.
    marked: Option<std::time::Instant>,
    /// Dropped since that marker.
    unmarked: (u64, u64),
}

impl LogRate {
    /// A budget of `bytes_per_second` and `lines_per_second` (each `None`: unlimited).
    pub fn new(tenant: Arc<str>, bytes_per_second: Option<u64>, lines_per_second: Option<u64>) -> Self {
        let full = |r: Option<u64>| r.map_or(f64::INFINITY, |r| r as f64);
        Self {
            tenant,
            bytes_per_second,
            lines_per_second,
            state: Mutex::new(RateState {
                bytes: full(bytes_per_second),
                lines: full(lines_per_second),
                at: std::time::Instant::now(),
                marked: None,
                unmarked: (0, 0),
            }),
            dropped_lines: std::sync::atomic::AtomicU64::new(0),
            dropped_bytes: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// A line of `len` bytes: true to write it (its bytes and line taken), false when it is
    /// over the rate (counted; a marker line if none was written in the last second).
    pub fn admit(&self, len: usize) -> bool {
        use std::sync::atomic::Ordering;
        let now = std::time::Instant::now();
        let mut st = self.state.lock();
        let secs = now.saturating_duration_since(st.at).as_secs_f64();
        st.at = now;
        if let Some(r) = self.bytes_per_second {
            st.bytes = (st.bytes + secs * r as f64).min(r as f64);
        }
        if let Some(r) = self.lines_per_second {
            st.lines = (st.lines + secs * r as f64).min(r as f64);
        }
        if st.bytes > 0.0 && st.lines >= 1.0 {
            st.bytes -= len as f64;
            st.lines -= 1.0;
            return true;
        }
        self.dropped_lines.fetch_add(1, Ordering::Relaxed);
        self.dropped_bytes.fetch_add(len as u64, Ordering::Relaxed);
        st.unmarked.0 += 1;
        st.unmarked.1 += len as u64;
        if st
            .marked
            .is_none_or(|m| now.saturating_duration_since(m) >= std::time::Duration::from_secs(1))
        {
            let (lines, bytes) = std::mem::take(&mut st.unmarked);
            st.marked = Some(now);
            drop(st);
            tracing::warn!(
                tenant = &*self.tenant,
                dropped_lines = lines,
                dropped_bytes = bytes,
                log_bytes_per_second = self.bytes_per_second,
                log_lines_per_second = self.lines_per_second,
                "tenant's guest log over its budget per second (tenant.budgets): lines dropped since the last notice"
            );
        }
        false
    }

    /// Take `len` more bytes of a line already admitted (a stdio line written in pieces).
    fn charge(&self, len: usize) {
        if self.bytes_per_second.is_some() {
            self.state.lock().bytes -= len as f64;
        }
    }
}

#[derive(Debug, Default)]
struct LogCount {
    bytes: usize,
    lines: usize,
    dropped_lines: u64,
    dropped_bytes: u64,
    /// A stdio line is open: `Some(true)` kept so far (with its length), `Some(false)` dropped.
    open: Option<bool>,
    open_len: usize,
    /// The open line was dropped for the tenant's rate (its bytes are counted there).
    open_over_rate: bool,
}

impl CallLog {
    /// Accounting with `budgets`' log limits.
    pub fn new(budgets: &super::CallBudgets) -> Self {
        Self {
            max_bytes: budgets.log_bytes,
            max_lines: budgets.log_lines,
            line_bytes: budgets.log_line_bytes,
            count: Mutex::new(LogCount::default()),
            rate: None,
        }
    }

    /// The same, with the tenant's budget over time after the call's own.
    pub fn with_rate(mut self, rate: Option<Arc<LogRate>>) -> Self {
        self.rate = rate;
        self
    }

    /// Start a new call; returns what the last one dropped (lines, bytes).
    pub fn reset(&self) -> (u64, u64) {
        let mut c = self.count.lock();
        let dropped = (c.dropped_lines, c.dropped_bytes);
        *c = LogCount::default();
        dropped
    }

    /// A line of `len` bytes: how many of its bytes to write, or `None` to drop it.
    pub fn admit_line(&self, len: usize) -> Option<usize> {
        let mut c = self.count.lock();
        if c.lines >= self.max_lines || c.bytes >= self.max_bytes {
            c.dropped_lines += 1;
            c.dropped_bytes += len as u64;
            return None;
        }
        let keep = len.min(self.line_bytes).min(self.max_bytes - c.bytes);
        // Over the tenant's rate: dropped and counted there, not against the call's budget.
        if let Some(rate) = &self.rate
            && !rate.admit(keep)
        {
            return None;
        }
        c.lines += 1;
        c.bytes += keep;
        c.dropped_bytes += (len - keep) as u64;
        Some(keep)
    }

    /// A chunk of stdio output: the part of it to forward (lines over the budget dropped,
    /// long lines cut).
    pub fn admit_chunk(&self, bytes: &[u8]) -> Vec<u8> {
        let mut c = self.count.lock();
        let mut out = Vec::new();
        for piece in bytes.split_inclusive(|b| *b == b'\n') {
            let ends = piece.last() == Some(&b'\n');
            let body = if ends { &piece[..piece.len() - 1] } else { piece };
            if c.open.is_none() {
                if c.lines >= self.max_lines || c.bytes >= self.max_bytes {
                    c.dropped_lines += 1;
                    c.open = Some(false);
                } else if self.rate.as_ref().is_some_and(|r| !r.admit(0)) {
                    // Over the tenant's rate: counted there, not against the call's budget.
                    c.open = Some(false);
                    c.open_over_rate = true;
                } else {
                    c.lines += 1;
                    c.open = Some(true);
                    c.open_len = 0;
                }
            }
            if c.open == Some(true) {
                let room = (self.line_bytes - c.open_len.min(self.line_bytes))
                    .min(self.max_bytes - c.bytes.min(self.max_bytes));
                let keep = body.len().min(room);
                if let Some(rate) = &self.rate {
                    rate.charge(keep);
                }
                out.extend_from_slice(&body[..keep]);
                c.bytes += keep;
                c.open_len += keep;
                c.dropped_bytes += (body.len() - keep) as u64;
                if ends {
                    out.push(b'\n');
                }
            } else if c.open_over_rate {
                if let Some(rate) = &self.rate {
                    rate.dropped_bytes
                        .fetch_add(body.len() as u64, std::sync::atomic::Ordering::Relaxed);
                }
            } else {
                c.dropped_bytes += body.len() as u64;
            }
            if ends {
                c.open = None;
                c.open_over_rate = false;
            }
        }
        out
    }
}

/// The host's stdout or stderr, written through the call's [`CallLog`], and kept in the
/// handler's ring of recent lines.
#[derive(Debug, Clone)]
pub struct BudgetedStdio {
    log: Arc<CallLog>,
    stderr: bool,
    ring: Arc<crate::observe::logring::LogRing>,
}

impl BudgetedStdio {
    /// The host's stderr when `stderr`, else its stdout.
    pub fn new(log: Arc<CallLog>, stderr: bool, ring: Arc<crate::observe::logring::LogRing>) -> Self {
        Self { log, stderr, ring }
    }

    fn forward(&self, bytes: &[u8]) {
        use crate::observe::logring::Source;
        use std::io::Write as _;
        let out = self.log.admit_chunk(bytes);
        if out.is_empty() {
            return;
        }
        self.ring
            .push_chunk(if self.stderr { Source::Stderr } else { Source::Stdout }, &out);
        // The host's own streams failing is no reason to fail the guest.
        let _ = if self.stderr {
            std::io::stderr().lock().write_all(&out)
        } else {
            std::io::stdout().lock().write_all(&out)
        };
    }
}

impl IsTerminal for BudgetedStdio {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for BudgetedStdio {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[async_trait::async_trait]
impl OutputStream for BudgetedStdio {
    fn write(&mut self, bytes: Bytes) -> Result<(), StreamError> {
        self.forward(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), StreamError> {
        Ok(())
    }

    fn check_write(&mut self) -> Result<usize, StreamError> {
        Ok(64 * 1024)
    }
}

#[async_trait::async_trait]
impl Pollable for BudgetedStdio {
    async fn ready(&mut self) {}
}

impl AsyncWrite for BudgetedStdio {
    fn poll_write(self: Pin<&mut Self>, _cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.forward(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_the_tail_and_reports_the_last_lines() {
        let p = TailPipe::new(64);
        p.push(b"first line\n");
        p.push(&[b'x'; 100]);
        p.push(b"\npanicked at src/lib.rs:3:5:\nboom\n");
        let words = p.last_words(200).unwrap_or_default();
        assert!(words.ends_with("panicked at src/lib.rs:3:5: | boom"), "{words}");
        assert!(!words.contains("first line"));
        p.clear();
        assert_eq!(p.last_words(200), None);
    }

    #[test]
    fn call_log_keeps_the_budget_and_counts_the_rest() {
        let budgets = crate::runtime::CallBudgets {
            log_bytes: 100,
            log_lines: 3,
            log_line_bytes: 40,
            ..crate::runtime::CallBudgets::default()
        };
        let log = CallLog::new(&budgets);
        assert_eq!(log.admit_line(10), Some(10));
        assert_eq!(log.admit_line(1000), Some(40), "a long line is cut");
        let out = log.admit_chunk(b"abc\ndef\nghi\n");
        assert_eq!(out, b"abc\n", "the third line fills the line budget");
        assert_eq!(log.admit_line(5), None);
        let (lines, bytes) = log.reset();
        assert_eq!((lines, bytes), (3, 960 + 3 + 3 + 5));
        assert_eq!(log.admit_line(5), Some(5), "a new call has a new budget");
    }

    #[test]
    fn a_tenants_rate_is_shared_by_its_calls_and_not_charged_to_a_call() {
        let rate = Arc::new(LogRate::new(Arc::from("t"), Some(100), None));
        let budgets = crate::runtime::CallBudgets::default();
        let (a, b) = (
            CallLog::new(&budgets).with_rate(Some(rate.clone())),
            CallLog::new(&budgets).with_rate(Some(rate.clone())),
        );
        assert_eq!(a.admit_line(60), Some(60));
        assert_eq!(
            b.admit_line(60),
            Some(60),
            "a bucket with bytes left admits a line whole"
        );
        assert_eq!(a.admit_line(10), None, "the bucket is shared: empty for every call");
        assert_eq!(b.admit_chunk(b"abc\n"), b"", "stdio too");
        assert_eq!(rate.dropped_lines.load(std::sync::atomic::Ordering::Relaxed), 2);
        assert_eq!(rate.dropped_bytes.load(std::sync::atomic::Ordering::Relaxed), 13);
        assert_eq!(a.reset(), (0, 0), "over the rate is not over the call's budget");
        assert_eq!(b.reset(), (0, 0));
    }
}
