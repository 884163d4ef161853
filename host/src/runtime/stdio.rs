//! Where a guest's stdout and stderr go when the handler is not granted the
//! host's: a small ring buffer per instance that keeps the last bytes
//! written, so a trap can be reported with the guest's own last words (a
//! Rust panic message, a Python traceback line) in `weir-error`.

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
}

impl TailPipe {
    /// A pipe keeping the last `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            buffer: Arc::new(Mutex::new(VecDeque::new())),
        }
    }

    fn push(&self, bytes: &[u8]) {
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
}
