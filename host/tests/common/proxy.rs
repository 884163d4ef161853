//! A TCP fault proxy, for a database or a broker: forwards every connection
//! to a target address, and on demand **freezes** (holds every byte in both
//! directions, connections stay open: a stalled server or network), **cuts**
//! (closes every connection and refuses new ones: a server that went away),
//! or forwards again. It runs on a thread and a runtime of its own, so both
//! sync and async tests can drive it.
//!
//! Self-contained (std and tokio only) so other crates can reuse it with
//! `#[path = ".../common/proxy.rs"] mod proxy;`.

#![allow(dead_code, reason = "each user needs a different subset")]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Bytes flow.
    Forward,
    /// Bytes are read and held, nothing is written; new connections are
    /// accepted and held too. Back to [`Mode::Forward`]: what was held flows.
    Freeze,
    /// Every connection is closed; new ones are closed at once.
    Cut,
}

/// An armed [`FaultProxy::freeze_after`]: freeze once a client connection
/// has sent a chunk containing `pattern` and then `more` chunks after it.
struct Trigger {
    pattern: Vec<u8>,
    more: usize,
}

type Armed = Arc<Mutex<Option<Trigger>>>;

/// See the module docs. Stops (closing everything) when dropped.
pub struct FaultProxy {
    /// The address it listens on (127.0.0.1, a free port).
    pub addr: SocketAddr,
    mode: Arc<watch::Sender<Mode>>,
    armed: Armed,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FaultProxy {
    /// Forward 127.0.0.1:(a free port) to `target`.
    pub fn start(target: SocketAddr) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("the proxy binds a port");
        let addr = listener.local_addr().expect("the proxy has an address");
        listener.set_nonblocking(true).expect("non-blocking listener");
        let (mode, mode_rx) = watch::channel(Mode::Forward);
        let mode = Arc::new(mode);
        let armed: Armed = Arc::default();
        let (tx, trigger) = (mode.clone(), armed.clone());
        let (shutdown, shutdown_rx) = tokio::sync::oneshot::channel();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("the proxy's runtime starts");
            rt.block_on(async move {
                let listener = TcpListener::from_std(listener).expect("tokio listener");
                tokio::select! {
                    () = accept_loop(listener, target, mode_rx, tx, trigger) => {}
                    _ = shutdown_rx => {}
                }
            });
        });
        Self {
            addr,
            mode,
            armed,
            shutdown: Some(shutdown),
            thread: Some(thread),
        }
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Switch to `mode` (takes effect on every connection at once).
    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// Hold every byte (see [`Mode::Freeze`]).
    pub fn freeze(&self) {
        self.set(Mode::Freeze);
    }

    /// Close everything and refuse (see [`Mode::Cut`]).
    pub fn cut(&self) {
        self.set(Mode::Cut);
    }

    /// Forward again.
    pub fn forward(&self) {
        self.set(Mode::Forward);
    }

    /// Freeze (everything, as [`FaultProxy::freeze`]) at a chosen point of
    /// a client's conversation: once one client connection has sent a chunk
    /// containing `pattern` and then `more` further chunks, each forwarded
    /// before the freeze. A database client that waits for each answer
    /// sends one statement per chunk: freezing after `BEGIN` and a few
    /// chunks stops it inside its transaction, with what it locked held.
    pub fn freeze_after(&self, pattern: &[u8], more: usize) {
        *self.armed.lock().unwrap() = Some(Trigger {
            pattern: pattern.to_vec(),
            more,
        });
    }

    /// True while a [`FaultProxy::freeze_after`] has not fired yet.
    pub fn armed(&self) -> bool {
        self.armed.lock().unwrap().is_some()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: SocketAddr,
    mode: watch::Receiver<Mode>,
    set: Arc<watch::Sender<Mode>>,
    armed: Armed,
) {
    loop {
        let Ok((inbound, _)) = listener.accept().await else {
            return;
        };
        let mode = mode.clone();
        let watch = Some((set.clone(), armed.clone()));
        tokio::spawn(async move {
            let mut m = mode.clone();
            // Held while frozen, closed when cut.
            let Ok(now) = m.wait_for(|v| *v != Mode::Freeze).await.map(|v| *v) else {
                return;
            };
            if now == Mode::Cut {
                return;
            }
            let Ok(outbound) = TcpStream::connect(target).await else {
                return;
            };
            let _ = inbound.set_nodelay(true);
            let _ = outbound.set_nodelay(true);
            let (ri, wi) = inbound.into_split();
            let (ro, wo) = outbound.into_split();
            let up = pump(ri, wo, mode.clone(), watch);
            let down = pump(ro, wi, mode.clone(), None);
            // Either direction ending (EOF, error, cut) closes both.
            tokio::select! {
                () = up => {}
                () = down => {}
            }
        });
    }
}

/// Copy `from` to `to` while the mode allows; returns on EOF, an error or a
/// cut. `trigger`: the client's direction, watched for a
/// [`FaultProxy::freeze_after`].
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
    trigger: Option<(Arc<watch::Sender<Mode>>, Armed)>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    // Chunks forwarded since this connection sent the trigger's pattern.
    let mut since: Option<usize> = None;
    loop {
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            cut = mode.wait_for(|v| *v == Mode::Cut) => {
                let _ = cut;
                return;
            }
        };
        // Hold the bytes while frozen; drop them when cut.
        match mode.wait_for(|v| *v != Mode::Freeze).await.map(|v| *v) {
            Ok(Mode::Forward) => {}
            _ => return,
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
        if let Some((set, armed)) = &trigger {
            let mut armed = armed.lock().unwrap();
            if let Some(t) = armed.as_ref() {
                match since {
                    None if buf[..n].windows(t.pattern.len()).any(|w| w == t.pattern) => since = Some(0),
                    None => {}
                    Some(k) => since = Some(k + 1),
                }
                if since.is_some_and(|k| k >= t.more) {
                    set.send_replace(Mode::Freeze);
                    *armed = None;
                }
            }
        }
    }
}

/// Wait (polling `probe` every 10 ms, up to `timeout`) until it is true.
pub fn wait_until(timeout: Duration, mut probe: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < timeout {
        if probe() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    probe()
}
