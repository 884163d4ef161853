//! Behaviours for the hostile-bytes tests (types `bytes.*`): guests whose
//! error texts or cascade headers do not fit a broker's header rules. The
//! payload, where used, is a size in bytes.

use weir_guest::{Failure, Message};

/// A text of exactly `n` bytes that starts with `start` and has line breaks.
fn big_text(start: &str, n: usize) -> String {
    let mut s = String::with_capacity(n);
    s.push_str(start);
    while s.len() < n {
        s.push_str(if s.len().is_multiple_of(64) { "\r\n" } else { "x" });
    }
    s.truncate(n);
    s
}

fn size(msg: &Message) -> Result<usize, Failure> {
    let text = msg.text()?;
    text.trim()
        .parse()
        .map_err(|e| Failure::reject(format!("bytes: payload {text:?} is not a size: {e}")))
}

/// Dispatch a `bytes.` type (the prefix already stripped).
pub fn handle(kind: &str, msg: &Message) -> Result<(), Failure> {
    match kind {
        // A reject reason of `payload` bytes with CR/LF in it.
        "reject-big" => Err(Failure::reject(big_text("big reject reason:", size(msg)?))),
        // A retry reason of `payload` bytes with CR/LF in it (exhausts).
        "retry-big" => Err(Failure::retry(big_text("big retry reason:", size(msg)?))),
        // A short multi-line reject reason (a backtrace's shape).
        "reject-lines" => Err(Failure::reject("first line\nsecond line\r\nthird line")),
        // A cascade whose header name is longer than an AMQP short string.
        "cascade-long-name" => {
            let name = "n".repeat(300);
            weir_guest::publish("ok", msg.group_id(), &[(name.as_str(), "v")], b"x")
        }
        // A cascade whose header value has a line break.
        "cascade-crlf" => weir_guest::publish("ok", msg.group_id(), &[("x-evil", "a\r\nPUB x 1")], b"x"),
        // A cascade whose header name NATS refuses (space, colon).
        "cascade-bad-name" => weir_guest::publish("ok", msg.group_id(), &[("bad name: x", "v")], b"x"),
        // A cascade with `payload` bytes of headers (over any frame).
        "cascade-huge" => {
            let value = "h".repeat(size(msg)?);
            weir_guest::publish("ok", msg.group_id(), &[("x-huge", value.as_str())], b"x")
        }
        other => Err(Failure::reject(format!("faulty: unknown bytes type {other:?}"))),
    }
}
