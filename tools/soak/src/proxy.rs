//! A TCP fault proxy on a loopback port, one per (node, upstream): it
//! forwards bytes both ways until told to **cut** (close every connection
//! it carries and refuse new ones until restored) or to **stall** (hold
//! every byte, in both directions, until released; then deliver them).
//! Connections made before a cut are never revived by a restore.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// The proxy's switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct State {
    /// Bumped at every cut: connections of an older generation close.
    generation: u64,
    /// Refuse new connections.
    refusing: bool,
    /// Hold bytes.
    stalled: bool,
}

/// A running proxy; dropping it closes every connection it carries.
pub struct Proxy {
    /// The loopback port it listens on.
    pub port: u16,
    ctl: watch::Sender<State>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listen on `127.0.0.1:0` and forward to `upstream` (a loopback address).
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        anyhow::ensure!(
            upstream.ip().is_loopback(),
            "proxy upstream {upstream} is not a loopback address; the soak only talks to 127.0.0.1/::1"
        );
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding a proxy on 127.0.0.1:0")?;
        let port = listener.local_addr().context("the proxy's local address")?.port();
        let (ctl, rx) = watch::channel(State {
            generation: 0,
            refusing: false,
            stalled: false,
        });
        let accept = tokio::spawn(accept_loop(listener, upstream, rx));
        Ok(Self { port, ctl, accept })
    }

    /// Close every connection and refuse new ones until [`Proxy::restore`].
    pub fn cut(&self) {
        self.ctl.send_modify(|s| {
            s.generation += 1;
            s.refusing = true;
            s.stalled = false;
        });
    }

    /// Accept and forward again (after a cut or a stall).
    pub fn restore(&self) {
        self.ctl.send_modify(|s| {
            s.refusing = false;
            s.stalled = false;
        });
    }

    /// Hold every byte until [`Proxy::restore`] (connections stay open).
    pub fn stall(&self) {
        self.ctl.send_modify(|s| s.stalled = true);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

async fn accept_loop(listener: TcpListener, upstream: SocketAddr, rx: watch::Receiver<State>) {
    loop {
        let Ok((inbound, _)) = listener.accept().await else {
            // Out of descriptors or similar: back off, bounded by the task's abort.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let state = *rx.borrow();
        if state.refusing {
            drop(inbound);
            continue;
        }
        let rx = rx.clone();
        tokio::spawn(async move {
            let Ok(Ok(outbound)) = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(upstream)).await
            else {
                return;
            };
            let _ = inbound.set_nodelay(true);
            let _ = outbound.set_nodelay(true);
            let (ir, iw) = inbound.into_split();
            let (or, ow) = outbound.into_split();
            let generation = state.generation;
            // Either direction ending ends the connection (both halves drop).
            tokio::select! {
                () = pipe(ir, ow, rx.clone(), generation) => {}
                () = pipe(or, iw, rx, generation) => {}
            }
        });
    }
}

/// Wait until the connection of `generation` is cut (or the proxy is gone).
async fn until_cut(rx: &mut watch::Receiver<State>, generation: u64) {
    loop {
        if rx.borrow_and_update().generation != generation {
            return;
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}

async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut rx: watch::Receiver<State>, generation: u64) {
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        let n = {
            let mut watch = rx.clone();
            tokio::select! {
                r = from.read(&mut buf) => match r {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                },
                () = until_cut(&mut watch, generation) => return,
            }
        };
        // Held while stalled; dropped on a cut.
        loop {
            let s = *rx.borrow_and_update();
            if s.generation != generation {
                return;
            }
            if !s.stalled {
                break;
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
