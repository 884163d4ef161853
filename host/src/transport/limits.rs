//! The header rules of each broker, in one place, applied before any bytes
//! reach a broker client (lapin panics on a header name over 255 bytes,
//! async-nats on CR/LF in a value or a name that is not printable ASCII;
//! a RabbitMQ content header over `frame_max` closes the whole connection,
//! a NATS message over `max_payload` is refused by the client).
//!
//! Two ways to apply them:
//! - [`Limits::check`] for what Weir forwards on someone's behalf (a guest's
//!   cascade, an ingress forward, a retry): anything that does not fit is an
//!   [`ErrorKind::Invalid`](super::ErrorKind::Invalid) error naming the
//!   header and the limit, and nothing is sent;
//! - [`Limits::fit`] for dead letters, which must always go out: names and
//!   values are repaired and the longest texts (`weir-error` or any user header) are cut
//!   to fit, each cut value keeping its start and ending with a
//!   [`cut_marker`] that says it was cut and how long it was.

use crate::envelope::{Wire, header};

/// AMQP short strings (header names, the `message-id` property) hold at most this many bytes.
pub const AMQP_SHORT_STRING_MAX: usize = 255;

/// RabbitMQ's default `frame_max`, used until a connection says otherwise.
pub const AMQP_DEFAULT_FRAME_MAX: usize = 131_072;

/// Bytes of an AMQP content-header frame besides the properties: frame
/// header (7) and end (1), class, weight, body size and property flags (14).
const AMQP_CONTENT_HEADER_OVERHEAD: usize = 22;

/// Room left on NATS for what this module does not count (the AMQP count
/// is exact: frame overhead, delivery mode, the headers table and the
/// `message-id` property, which is all Weir writes).
const SLACK: usize = 256;

/// JetStream refuses a message whose header block is over 64 KiB (error
/// 10097, "header size exceeds maximum allowed of 64k"), whatever `max_payload` is.
pub const JETSTREAM_MAX_HEADER: usize = 64 * 1024;

/// A cut value keeps at least this many bytes of its start, when the limit allows.
const MIN_KEPT: usize = 64;

/// The text a cut value ends with: says it was cut and how long the value was.
pub fn cut_marker(total: usize) -> String {
    format!(" [weir: cut, {total} bytes in all]")
}

/// Which broker's rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rules {
    /// AMQP 0-9-1: names are short strings; the properties (headers
    /// included) travel in one content-header frame of at most `frame_max`.
    Amqp {
        /// The connection's negotiated `frame_max`.
        frame_max: usize,
    },
    /// NATS: names are printable ASCII without `:`, values have no CR/LF;
    /// headers and payload together at most `max_payload`, and the header
    /// block at most [`JETSTREAM_MAX_HEADER`].
    Nats {
        /// The server's `max_payload` (from its INFO).
        max_payload: usize,
    },
}

/// A broker's header limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The rules.
    pub rules: Rules,
}

impl Limits {
    /// AMQP limits for a connection with this `frame_max` (0: the AMQP
    /// "no limit", treated as RabbitMQ's default).
    pub fn amqp(frame_max: usize) -> Self {
        let frame_max = if frame_max == 0 {
            AMQP_DEFAULT_FRAME_MAX
        } else {
            frame_max
        };
        Self {
            rules: Rules::Amqp { frame_max },
        }
    }

    /// NATS limits for a server with this `max_payload`.
    pub fn nats(max_payload: usize) -> Self {
        Self {
            rules: Rules::Nats { max_payload },
        }
    }

    /// Bytes `wire` takes against the limit: the AMQP content-header frame
    /// (properties as Weir writes them), or the NATS header block plus payload.
    pub fn size(&self, wire: &Wire) -> usize {
        match self.rules {
            Rules::Amqp { .. } => {
                // delivery mode (1) + the headers table (4 + per entry:
                // name length (1) + name + type (1) + long string (4 + len)).
                let table: usize = wire.headers.iter().map(|(k, v)| 1 + k.len() + 1 + 4 + v.len()).sum();
                let message_id = wire
                    .header(header::MESSAGE_ID)
                    .filter(|id| id.len() <= AMQP_SHORT_STRING_MAX)
                    .map_or(0, |id| 1 + id.len());
                AMQP_CONTENT_HEADER_OVERHEAD + 1 + 4 + table + message_id
            }
            Rules::Nats { .. } => nats_header_block(wire) + wire.body.len(),
        }
    }

    /// Bytes over the limits (0: it fits): the larger excess of the total
    /// and, on NATS, of the header block.
    fn over(&self, wire: &Wire) -> usize {
        let total = self.size(wire).saturating_sub(self.budget());
        match self.rules {
            Rules::Amqp { .. } => total,
            Rules::Nats { .. } => total.max(nats_header_block(wire).saturating_sub(JETSTREAM_MAX_HEADER - SLACK)),
        }
    }

    /// The most [`Limits::size`] may be.
    pub fn budget(&self) -> usize {
        match self.rules {
            Rules::Amqp { frame_max } => frame_max,
            Rules::Nats { max_payload } => max_payload.saturating_sub(SLACK),
        }
    }

    /// What is wrong with header name `name`, if anything.
    fn name_fault(&self, name: &str) -> Option<String> {
        match self.rules {
            Rules::Amqp { .. } if name.len() > AMQP_SHORT_STRING_MAX => Some(format!(
                "is {} bytes; AMQP header names hold at most {AMQP_SHORT_STRING_MAX}",
                name.len()
            )),
            Rules::Nats { .. } if name.is_empty() => Some("is empty; NATS header names need a character".into()),
            Rules::Nats { .. } if !name.bytes().all(|b| b.is_ascii_graphic() && b != b':') => {
                Some("has a character NATS header names cannot hold (accepted: printable ASCII except `:`)".into())
            }
            _ => None,
        }
    }

    /// Whether header value `value` can be written as it is.
    fn value_ok(&self, value: &str) -> bool {
        match self.rules {
            Rules::Amqp { .. } => true,
            Rules::Nats { .. } => !value.contains(['\r', '\n']),
        }
    }

    /// Refuse `wire` unless every header name and value and the total size
    /// fit: the error names the header (or the size) and the limit.
    pub fn check(&self, wire: &Wire) -> Result<(), String> {
        for (k, v) in &wire.headers {
            if let Some(fault) = self.name_fault(k) {
                return Err(format!("header name {:?} {fault}", shown(k)));
            }
            if !self.value_ok(v) {
                return Err(format!(
                    "header {:?} has a value with CR or LF, which NATS header values cannot hold",
                    shown(k)
                ));
            }
        }
        let (size, budget) = (self.size(wire), self.budget());
        if self.over(wire) > 0 {
            let largest = wire.headers.iter().max_by_key(|(k, v)| k.len() + v.len());
            let what = match self.rules {
                Rules::Amqp { frame_max } => {
                    format!(
                        "headers take {size} bytes of the AMQP content header; the connection's frame_max {frame_max} leaves {budget}"
                    )
                }
                Rules::Nats { max_payload } => format!(
                    "headers take {} bytes, with the payload {size}; JetStream allows {} bytes of headers and the server's max_payload {max_payload} leaves {budget} in all",
                    nats_header_block(wire),
                    JETSTREAM_MAX_HEADER - SLACK
                ),
            };
            let largest = largest.map_or_else(String::new, |(k, v)| {
                format!(" (largest header: {:?}, {} bytes)", shown(k), k.len() + v.len())
            });
            return Err(format!("{what}{largest}"));
        }
        Ok(())
    }

    /// Make `wire` fit, changing as little as possible: invalid names are
    /// repaired (characters replaced by `_`, long names cut), CR/LF in NATS
    /// values written as the two characters `\r` / `\n`, and while the total
    /// is over the budget the longest value (user header or `weir-error`) is cut with
    /// a [`cut_marker`]. Returns what it changed, for the log; empty when
    /// `wire` already fitted. Only a payload that alone is over a NATS
    /// `max_payload` can still not fit afterwards (the broker refuses it).
    pub fn fit(&self, wire: &mut Wire) -> Vec<String> {
        let mut notes = Vec::new();
        for (k, v) in &mut wire.headers {
            if self.name_fault(k).is_some() {
                let fixed = self.repair_name(k);
                notes.push(format!("header name {:?} written as {fixed:?}", shown(k)));
                *k = fixed;
            }
            if !self.value_ok(v) {
                *v = v.replace('\r', "\\r").replace('\n', "\\n");
                notes.push(format!("CR/LF in header {k:?} written as \\r/\\n"));
            }
        }
        // The longest value first (a long `weir-error` is the usual one),
        // never the derived or provenance headers (short, and must stay whole).
        let protected = |k: &str| header::DERIVED.contains(&k) || (k.starts_with("weir-") && k != header::ERROR);
        let mut done = vec![false; wire.headers.len()];
        loop {
            let over = self.over(wire);
            if over == 0 {
                break;
            }
            let victim = wire
                .headers
                .iter()
                .enumerate()
                .filter(|(i, (k, v))| !done[*i] && !protected(k) && v.len() > MIN_KEPT)
                .max_by_key(|(_, (_, v))| v.len())
                .map(|(i, _)| i);
            let Some(i) = victim else {
                break;
            };
            done[i] = true;
            let (k, v) = &mut wire.headers[i];
            let total = v.len();
            let marker = cut_marker(total);
            let keep = total.saturating_sub(over + marker.len()).max(MIN_KEPT);
            if keep + marker.len() >= total {
                // Cutting would not make this one shorter: try the next.
                continue;
            }
            let cut = floor_char_boundary(v, keep);
            v.truncate(cut);
            v.push_str(&marker);
            notes.push(format!("header {k:?} cut from {total} to {cut} bytes"));
        }
        notes
    }

    fn repair_name(&self, name: &str) -> String {
        match self.rules {
            Rules::Amqp { .. } => {
                let marker = "~cut";
                let cut = floor_char_boundary(name, AMQP_SHORT_STRING_MAX - marker.len());
                format!("{}{marker}", &name[..cut])
            }
            Rules::Nats { .. } if name.is_empty() => "_".into(),
            Rules::Nats { .. } => name
                .chars()
                .map(|c| if c.is_ascii_graphic() && c != ':' { c } else { '_' })
                .collect(),
        }
    }
}

/// Bytes of the NATS header block of `wire` ("NATS/1.0", each "name: value", CRLFs).
fn nats_header_block(wire: &Wire) -> usize {
    let block: usize = wire.headers.iter().map(|(k, v)| k.len() + 2 + v.len() + 2).sum();
    "NATS/1.0\r\n\r\n".len() + block
}

/// The largest index `<= at` on a char boundary of `s`.
fn floor_char_boundary(s: &str, at: usize) -> usize {
    let mut i = at.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// A header name for an error text: at most 80 bytes of it.
fn shown(name: &str) -> String {
    if name.len() <= 80 {
        return name.to_owned();
    }
    format!("{}…({} bytes)", &name[..floor_char_boundary(name, 80)], name.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire(h: &[(&str, &str)]) -> Wire {
        Wire {
            headers: h.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
            body: b"body".to_vec(),
        }
    }

    #[test]
    fn amqp_refuses_long_names_and_frames_over_frame_max() {
        let l = Limits::amqp(131_072);
        assert!(l.check(&wire(&[("x", "y")])).is_ok());
        let long = "n".repeat(256);
        let e = l.check(&wire(&[(long.as_str(), "v")])).unwrap_err();
        assert!(e.contains("256 bytes") && e.contains("255"), "{e}");
        let big = "v".repeat(131_060);
        let e = l.check(&wire(&[("x-big", big.as_str())])).unwrap_err();
        assert!(e.contains("frame_max 131072") && e.contains("x-big"), "{e}");
    }

    #[test]
    fn nats_refuses_crlf_and_bad_names() {
        let l = Limits::nats(1 << 20);
        assert!(l.check(&wire(&[("x-a", "a\nb")])).unwrap_err().contains("CR or LF"));
        assert!(
            l.check(&wire(&[("bad name", "v")]))
                .unwrap_err()
                .contains("printable ASCII")
        );
        assert!(l.check(&wire(&[("a:b", "v")])).is_err());
        assert!(l.check(&wire(&[("x-a", "ok")])).is_ok());
    }

    #[test]
    fn fit_cuts_the_longest_and_keeps_its_start_and_length() {
        let l = Limits::amqp(131_072);
        let reason = format!("start of it{}", "x".repeat(1 << 20));
        let mut w = wire(&[
            (header::MESSAGE_ID, "m"),
            ("x-user", &"u".repeat(1000)),
            (header::ERROR, &reason),
        ]);
        let notes = l.fit(&mut w);
        assert!(!notes.is_empty());
        assert!(l.check(&w).is_ok());
        let e = w.header(header::ERROR).unwrap();
        assert!(e.starts_with("start of it"), "keeps the start");
        assert!(
            e.ends_with(&cut_marker(reason.len())),
            "says it was cut and how long it was"
        );
        assert_eq!(
            w.header("x-user").map(str::len),
            Some(1000),
            "the user header was not touched"
        );
    }

    #[test]
    fn fit_repairs_what_nats_cannot_carry() {
        let l = Limits::nats(1 << 20);
        let mut w = wire(&[(header::ERROR, "a\r\nb"), ("bad name", "v")]);
        l.fit(&mut w);
        assert!(l.check(&w).is_ok());
        assert_eq!(w.header(header::ERROR), Some("a\\r\\nb"));
        assert_eq!(w.header("bad_name"), Some("v"));
    }

    #[test]
    fn fit_cuts_other_headers_when_the_error_is_not_enough() {
        let l = Limits::nats(4096);
        let mut w = wire(&[(header::ERROR, "short"), ("x-big", &"b".repeat(10_000))]);
        l.fit(&mut w);
        assert!(l.check(&w).is_ok(), "{}", l.size(&w));
        assert!(w.header("x-big").unwrap().ends_with(&cut_marker(10_000)));
        // JetStream's 64 KiB of headers, under a large max_payload.
        let l = Limits::nats(8 << 20);
        let mut w = wire(&[("x-big", &"b".repeat(100_000))]);
        assert!(l.check(&w).unwrap_err().contains("JetStream allows"));
        l.fit(&mut w);
        assert!(l.check(&w).is_ok());
        let mut long = wire(&[(&"n".repeat(300), "v")]);
        Limits::amqp(131_072).fit(&mut long);
        assert!(Limits::amqp(131_072).check(&long).is_ok());
    }
}
