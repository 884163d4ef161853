//! A NATS-aware TCP proxy: forwards a client's connection to a nats-server
//! byte for byte, except that it reads the server's side as NATS protocol
//! and can **withhold** chosen messages (`MSG`/`HMSG` frames whose payload
//! contains a pattern) from the client. Withholding a stream's `PubAck`
//! makes a publish time out on the client although the server stored the
//! message: a lost confirm, deterministically.

#![allow(dead_code, reason = "each user needs a different subset")]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// What to withhold: frames whose payload contains `pattern`, `left` more.
#[derive(Default)]
struct Rule {
    pattern: Vec<u8>,
    left: usize,
}

#[derive(Default)]
struct Shared {
    rule: Mutex<Rule>,
    withheld: AtomicUsize,
}

/// See the module docs. Stops (closing everything) when dropped.
pub struct NatsProxy {
    /// The address it listens on (127.0.0.1, a free port).
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl NatsProxy {
    /// Forward 127.0.0.1:(a free port) to the server at `target`.
    pub fn start(target: SocketAddr) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        let shared = Arc::new(Shared::default());
        let keep = shared.clone();
        let (shutdown, shutdown_rx) = tokio::sync::oneshot::channel();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = TcpListener::from_std(listener).unwrap();
                tokio::select! {
                    () = accept_loop(listener, target, keep) => {}
                    _ = shutdown_rx => {}
                }
            });
        });
        Self {
            addr,
            shared,
            shutdown: Some(shutdown),
            thread: Some(thread),
        }
    }

    /// `nats://` URL of the proxy.
    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    /// Withhold the next `n` messages the server sends any client whose
    /// payload contains `pattern` (they are read and discarded).
    pub fn withhold(&self, pattern: &[u8], n: usize) {
        *self.shared.rule.lock().unwrap() = Rule {
            pattern: pattern.to_vec(),
            left: n,
        };
    }

    /// Messages withheld so far.
    pub fn withheld(&self) -> usize {
        self.shared.withheld.load(Ordering::SeqCst)
    }
}

impl Drop for NatsProxy {
    fn drop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn accept_loop(listener: TcpListener, target: SocketAddr, shared: Arc<Shared>) {
    loop {
        let Ok((inbound, _)) = listener.accept().await else {
            return;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let Ok(outbound) = TcpStream::connect(target).await else {
                return;
            };
            let _ = inbound.set_nodelay(true);
            let _ = outbound.set_nodelay(true);
            let (mut ri, mut wi) = inbound.into_split();
            let (ro, wo) = outbound.into_split();
            let up = async move {
                let mut wo = wo;
                let _ = tokio::io::copy(&mut ri, &mut wo).await;
            };
            let down = filter_down(ro, &mut wi, &shared);
            tokio::select! {
                () = up => {}
                () = down => {}
            }
        });
    }
}

/// Copy the server's protocol to the client frame by frame, dropping the
/// `MSG`/`HMSG` frames the rule names.
async fn filter_down(
    mut from: tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    shared: &Shared,
) {
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        // Forward every complete frame in the buffer.
        while let Some(eol) = buf.windows(2).position(|w| w == b"\r\n") {
            let line = &buf[..eol];
            let is_msg = line.starts_with(b"MSG ") || line.starts_with(b"HMSG ");
            let frame_end = if is_msg {
                let total: usize = std::str::from_utf8(line)
                    .ok()
                    .and_then(|l| l.split_whitespace().last())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                let end = eol + 2 + total + 2;
                if buf.len() < end {
                    break;
                }
                end
            } else {
                eol + 2
            };
            let withhold = is_msg && {
                let payload = &buf[eol + 2..frame_end - 2];
                let mut rule = shared.rule.lock().unwrap();
                let hit = rule.left > 0
                    && !rule.pattern.is_empty()
                    && payload.windows(rule.pattern.len()).any(|w| w == rule.pattern);
                if hit {
                    rule.left -= 1;
                    shared.withheld.fetch_add(1, Ordering::SeqCst);
                }
                hit
            };
            if !withhold && to.write_all(&buf[..frame_end]).await.is_err() {
                return;
            }
            buf.drain(..frame_end);
        }
        match from.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}
