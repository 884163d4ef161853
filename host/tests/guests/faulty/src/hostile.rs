//! Hostile behaviours (issue 15), chosen by a `hostile.` message type: a guest that blocks in
//! WASI past its timeout, publishes more cascade bytes than any budget, floods the log or its
//! stdout, or answers with an oversized failure text. The payload is the size or count.
//!
//! | type                      | payload        | does                                                |
//! |---------------------------|----------------|-----------------------------------------------------|
//! | `hostile.sleep`           | ms             | logs `hostile.sleep: sleeping`, `std::thread::sleep`s, answers `Ok` |
//! | `hostile.publish-bytes`   | `SIZE COUNT`   | publishes COUNT messages of SIZE bytes; rejects with `published=N refused=M first=ERR` |
//! | `hostile.publish-ok`      | `SIZE COUNT`   | same publishes, ignores refusals and answers `Ok`   |
//! | `hostile.log-bytes`       | bytes          | one `log` call of that many bytes (several lines)   |
//! | `hostile.log-lines`       | count          | that many short `log` calls                          |
//! | `hostile.print-lines`     | count          | that many lines on stdout                            |
//! | `hostile.reject-bytes`    | bytes          | rejects with a multi-line text of that size          |
//! | `hostile.retry-bytes`     | bytes          | retries with a multi-line text of that size          |
//! | `hostile.panic-bytes`     | bytes          | panics with a message of that size                   |
//! | `hostile.forge-cascade`   | type           | cascades that type (same group, payload of header `x-cascade-payload`) carrying forged `weir-*` provenance and the pin of header `x-pin` |
//! | `batch.hostile.keep-handle` | -            | in `handle-batch`: keeps the member (its 0.3.0 handle, unread) past the call, answers `Ok` |
//! | `hostile.use-kept`        | -              | reads the payload of the member kept last; rejects with what it read |

use std::cell::RefCell;
use std::time::Duration;

use weir_guest::{Failure, Message};

thread_local! {
    /// A batch member kept past its call (`batch.hostile.keep-handle`).
    static KEPT: RefCell<Option<Message>> = const { RefCell::new(None) };
}

/// Keep `msg` (and its host handle) past the call it was given to.
pub fn keep(msg: Message) {
    KEPT.with(|k| *k.borrow_mut() = Some(msg));
}

/// Handle a `hostile.` type (`kind` is the part after the prefix).
pub fn handle(kind: &str, msg: &Message) -> Result<(), Failure> {
    if kind == "use-kept" {
        let kept = KEPT.with(|k| k.borrow_mut().take());
        return match kept {
            Some(m) => Err(Failure::reject(format!(
                "read a kept handle: {}",
                String::from_utf8_lossy(m.payload())
            ))),
            None => Err(Failure::reject("hostile.use-kept: nothing was kept")),
        };
    }
    let text = msg.text()?.trim().to_owned();
    let number = |t: &str| -> Result<usize, Failure> {
        t.parse()
            .map_err(|e| Failure::reject(format!("hostile.{kind}: {t:?} is not a number: {e}")))
    };
    match kind {
        "sleep" => {
            let ms = number(&text)?;
            weir_guest::log::info(&format!("hostile.sleep: sleeping {ms} ms, message {}", msg.id()));
            std::thread::sleep(Duration::from_millis(ms as u64));
            Ok(())
        }
        "net-read" => net_read(&text),
        "publish-bytes" | "publish-ok" => {
            let (size, count) = text
                .split_once(' ')
                .ok_or_else(|| Failure::reject(format!("hostile.{kind}: payload {text:?} is not `SIZE COUNT`")))?;
            let (size, count) = (number(size)?, number(count)?);
            let buffer = vec![b'c'; size];
            let (mut published, mut refused, mut first) = (0usize, 0usize, None);
            for _ in 0..count {
                match weir_guest::publish("ok", msg.group_id(), &[], &buffer) {
                    Ok(()) => published += 1,
                    Err(e) => {
                        refused += 1;
                        first.get_or_insert(e.reason().to_owned());
                    }
                }
            }
            if kind == "publish-ok" {
                return Ok(());
            }
            Err(Failure::reject(format!(
                "published={published} refused={refused} first={first:?}"
            )))
        }
        "log-bytes" => {
            let n = number(&text)?;
            let line: String = (0..n).map(|i| if i % 100 == 99 { '\n' } else { 'l' }).collect();
            weir_guest::log::info(&line);
            Ok(())
        }
        "log-lines" => {
            for i in 0..number(&text)? {
                weir_guest::log::info(&format!("flood line {i}"));
            }
            Ok(())
        }
        "print-lines" => {
            for i in 0..number(&text)? {
                println!("stdout flood line {i}");
            }
            Ok(())
        }
        "reject-bytes" => Err(Failure::reject(big_text(number(&text)?))),
        "retry-bytes" => Err(Failure::retry(big_text(number(&text)?))),
        "panic-bytes" => panic!("{}", big_text(number(&text)?)),
        "forge-cascade" => forge_cascade(&text, msg),
        other => Err(Failure::reject(format!("faulty: unknown hostile behaviour {other:?}"))),
    }
}

/// `first line of the reason` then lines of `r` up to `n` bytes in all.
fn big_text(n: usize) -> String {
    let mut s = String::from("first line of the reason\n");
    while s.len() < n {
        s.push_str(&"r".repeat(99));
        s.push('\n');
    }
    s.truncate(n.max(1));
    s
}

/// Connect to `addr` (`a.b.c.d:port`, a node granted the network) and wait in WASI's
/// `blocking-read` for a byte the peer never sends.
fn net_read(addr: &str) -> Result<(), Failure> {
    use wasip2::sockets::network::{IpAddressFamily, IpSocketAddress, Ipv4SocketAddress};
    let bad = |e: String| Failure::reject(format!("hostile.net-read {addr}: {e}"));
    let (ip, port) = addr.split_once(':').ok_or_else(|| bad("want a.b.c.d:port".into()))?;
    let octets: Vec<u8> = ip
        .split('.')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .map_err(|e| bad(format!("{e}")))?;
    let [a, b, c, d] = octets[..] else {
        return Err(bad("want four octets".into()));
    };
    let port: u16 = port.parse().map_err(|e| bad(format!("{e}")))?;
    let network = wasip2::sockets::instance_network::instance_network();
    let socket = wasip2::sockets::tcp_create_socket::create_tcp_socket(IpAddressFamily::Ipv4)
        .map_err(|e| bad(format!("create: {e:?}")))?;
    let to = IpSocketAddress::Ipv4(Ipv4SocketAddress {
        port,
        address: (a, b, c, d),
    });
    socket
        .start_connect(&network, to)
        .map_err(|e| bad(format!("connect: {e:?}")))?;
    let (input, _output) = loop {
        match socket.finish_connect() {
            Ok(streams) => break streams,
            Err(wasip2::sockets::network::ErrorCode::WouldBlock) => socket.subscribe().block(),
            Err(e) => return Err(bad(format!("connect: {e:?}"))),
        }
    };
    weir_guest::log::info(&format!("hostile.net-read: connected to {addr}, reading"));
    match input.blocking_read(1) {
        Ok(bytes) => Err(bad(format!("read {} bytes", bytes.len()))),
        Err(e) => Err(bad(format!("read: {e:?}"))),
    }
}

/// `hostile.forge-cascade`: a cascade that claims to be Weir's own work (a
/// redriven, pinned, already-failed message). `weir-attempt` is not among
/// them: `publish` refuses the headers the host derives.
fn forge_cascade(message_type: &str, msg: &Message) -> Result<(), Failure> {
    let pin = msg.header("x-pin").unwrap_or("").to_owned();
    let payload = msg.header("x-cascade-payload").unwrap_or("").to_owned();
    let mut headers = vec![
        ("weir-handler-version", "forged-version"),
        ("weir-redrive-count", "4294967295"),
        ("weir-redrive-reason", "forged-reason"),
        ("weir-dead-letter-reason", "forged-reason"),
        ("weir-error", "forged: the operator reads the attacker's story"),
    ];
    if !pin.is_empty() {
        headers.push(("weir-handler-pin", &pin));
    }
    weir_guest::publish(message_type, msg.group_id(), &headers, payload.as_bytes())
}
