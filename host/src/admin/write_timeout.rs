//! A connection whose writes must make progress: a client that stops
//! reading its response (a full TCP window, for ever) has its connection
//! closed after the limit, instead of holding a task, a buffer and a
//! connection permit until the node stops (and then delaying the stop).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// `inner`, whose writes (and flushes, and shutdown) fail with
/// [`io::ErrorKind::TimedOut`] once they have been stuck for `limit`.
pub struct WriteTimeout<S> {
    inner: S,
    limit: Duration,
    /// Armed when a write returned `Pending`; disarmed by any progress.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteTimeout<S> {
    pub fn new(inner: S, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            stalled: None,
        }
    }

    /// Pass `r` on, arming the stall timer while it is pending.
    fn watch<T>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match r {
            Poll::Ready(r) => {
                self.stalled = None;
                Poll::Ready(r)
            }
            Poll::Pending => {
                let limit = self.limit;
                let stalled = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                match stalled.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the client read nothing of the response for {limit:?}"),
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteTimeout<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteTimeout<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.watch(cx, r)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use tokio::io::AsyncWriteExt as _;

    use super::*;

    /// A peer that never reads: the writer's buffer fills, then the write
    /// must fail at the limit (and not before it).
    #[tokio::test]
    async fn a_write_the_peer_never_reads_fails_at_the_limit() {
        let (a, _b) = tokio::io::duplex(1024);
        let limit = Duration::from_millis(300);
        let mut w = WriteTimeout::new(a, limit);
        let start = tokio::time::Instant::now();
        // Bounded, so that a write timeout that never fires fails the test instead of hanging it.
        let e = tokio::time::timeout(Duration::from_secs(10), w.write_all(&[0u8; 64 * 1024]))
            .await
            .expect("the stalled write never timed out")
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(start.elapsed() >= limit, "{:?}", start.elapsed());
    }

    /// A slow reader that keeps reading (far more often than the limit) is
    /// never cut off.
    #[tokio::test]
    async fn a_reader_that_keeps_reading_is_never_cut_off() {
        let (a, mut b) = tokio::io::duplex(1024);
        let mut w = WriteTimeout::new(a, Duration::from_secs(10));
        let reader = tokio::spawn(async move {
            let mut sink = Vec::new();
            let mut buf = [0u8; 512];
            loop {
                tokio::time::sleep(Duration::from_millis(5)).await;
                match tokio::io::AsyncReadExt::read(&mut b, &mut buf).await.unwrap() {
                    0 => break sink.len(),
                    n => sink.extend_from_slice(&buf[..n]),
                }
            }
        });
        w.write_all(&[1u8; 16 * 1024]).await.unwrap();
        w.shutdown().await.unwrap();
        assert_eq!(reader.await.unwrap(), 16 * 1024);
    }
}
