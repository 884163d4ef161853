//! A handler's recent log lines, for `weir logs` and `GET /v1/handlers/{name}/logs`: what
//! its calls wrote through the `log` import, through the host's stdout and stderr when it
//! was granted them, and the failures and faults its calls ended in. One ring per handler (shared by its
//! versions, as its metrics are), bounded in lines and in bytes, so a handler that floods
//! costs the node a fixed amount; each line has a sequence number, so a reader can ask for
//! what came after the last line it saw and be told how many it missed.
//!
//! Lines reach the ring only after the call's log budgets admitted them: a tenant over its
//! rate is cut here as in the node's own log.

use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

/// Lines a ring keeps by default.
pub const DEFAULT_LINES: usize = 512;
/// Bytes of text a ring keeps by default.
pub const DEFAULT_BYTES: usize = 256 << 10;
/// A line longer than this is cut (the node's own log has it whole, within the budget).
pub const LINE_BYTES: usize = 2048;

/// Where a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The `log` import.
    Log,
    /// The guest's stdout (granted the host's).
    Stdout,
    /// The guest's stderr (granted the host's).
    Stderr,
    /// A call that trapped, timed out or ran out of memory: the host's fault text.
    Fault,
    /// A call that returned a failure (`retry` or `reject`): its reason.
    Failure,
}

/// One line.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Line {
    /// Its place in the ring's history, from 1.
    pub seq: u64,
    /// When it was written, ms since the Unix epoch.
    pub at_ms: u64,
    /// `trace`, `debug`, `info`, `warn` or `error`.
    pub level: String,
    pub source: Source,
    /// The message the call was handling (`None` for stdio, which has no call attached).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<String>,
    pub text: String,
}

/// What a reader asked for: lines after `after`, at most `limit`, newest last.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Page {
    pub lines: Vec<Line>,
    /// The sequence number to ask after next time (the last line's, or `after` when there
    /// was nothing new).
    pub next: u64,
    /// Lines after `after` that the ring no longer holds (pushed out by newer ones).
    pub missed: u64,
}

#[derive(Debug, Default)]
struct Inner {
    lines: VecDeque<Line>,
    bytes: usize,
    /// The last sequence number given out.
    last: u64,
}

/// A bounded ring of a handler's recent lines.
#[derive(Debug)]
pub struct LogRing {
    max_lines: usize,
    max_bytes: usize,
    inner: Mutex<Inner>,
}

impl Default for LogRing {
    fn default() -> Self {
        Self::new(DEFAULT_LINES, DEFAULT_BYTES)
    }
}

impl LogRing {
    /// A ring keeping at most `max_lines` lines and `max_bytes` bytes of text.
    pub fn new(max_lines: usize, max_bytes: usize) -> Self {
        Self {
            max_lines: max_lines.max(1),
            max_bytes: max_bytes.max(LINE_BYTES),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Keep `text` (cut at [`LINE_BYTES`], on a character boundary), pushing out the
    /// oldest lines while the ring is over either bound.
    pub fn push(&self, level: &str, source: Source, message_id: Option<&str>, text: &str) {
        let text = cut(text.trim_end_matches(['\n', '\r']));
        let at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let mut g = self.inner.lock();
        g.last += 1;
        let line = Line {
            seq: g.last,
            at_ms,
            level: level.to_owned(),
            source,
            message_id: message_id.map(|m| cut(m).into_owned()),
            text: text.into_owned(),
        };
        g.bytes += line.text.len();
        g.lines.push_back(line);
        while g.lines.len() > self.max_lines || g.bytes > self.max_bytes {
            let Some(old) = g.lines.pop_front() else { break };
            g.bytes -= old.text.len();
        }
    }

    /// Each line of `chunk` (granted stdio writes in chunks; a line split across two
    /// writes is kept as two).
    pub fn push_chunk(&self, source: Source, chunk: &[u8]) {
        let level = if source == Source::Stderr { "warn" } else { "info" };
        for l in String::from_utf8_lossy(chunk).split('\n') {
            if !l.trim().is_empty() {
                self.push(level, source, None, l);
            }
        }
    }

    /// The lines after sequence number `after` (0: from the oldest held), at most `limit`,
    /// the newest ones when there are more.
    pub fn page(&self, after: u64, limit: usize) -> Page {
        let g = self.inner.lock();
        // Past the last line given out: the node restarted and its ring with it.
        let after = if after > g.last { 0 } else { after };
        let oldest = g.lines.front().map_or(g.last + 1, |l| l.seq);
        let newer: Vec<&Line> = g.lines.iter().filter(|l| l.seq > after).collect();
        let skip = newer.len().saturating_sub(limit);
        let lines: Vec<Line> = newer[skip..].iter().map(|l| (*l).clone()).collect();
        Page {
            next: lines.last().map_or(after, |l| l.seq),
            missed: oldest.saturating_sub(after + 1) + skip as u64,
            lines,
        }
    }

    /// Lines held now.
    pub fn len(&self) -> usize {
        self.inner.lock().lines.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `text` cut to [`LINE_BYTES`] on a character boundary, with a marker saying so.
fn cut(text: &str) -> std::borrow::Cow<'_, str> {
    if text.len() <= LINE_BYTES {
        return text.into();
    }
    let mut end = LINE_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{} [cut by weir: {} bytes]", &text[..end], text.len()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_gets_what_came_after_its_last_line_and_is_told_what_it_missed() {
        let ring = LogRing::new(3, 1 << 20);
        for i in 1..=5 {
            ring.push("info", Source::Log, Some("m"), &format!("line {i}"));
        }
        let all = ring.page(0, 100);
        let texts: Vec<&str> = all.lines.iter().map(|l| l.text.as_str()).collect();
        assert_eq!(texts, ["line 3", "line 4", "line 5"], "the newest three are kept");
        assert_eq!(all.missed, 2, "lines 1 and 2 were pushed out");
        assert_eq!(all.next, 5);
        let none = ring.page(5, 100);
        assert!(none.lines.is_empty());
        assert_eq!((none.next, none.missed), (5, 0), "nothing new, nothing missed");
        ring.push("warn", Source::Log, None, "line 6");
        let one = ring.page(5, 100);
        assert_eq!(one.lines.len(), 1);
        assert_eq!((one.lines[0].seq, one.next, one.missed), (6, 6, 0));
        let last = ring.page(0, 1);
        assert_eq!(last.lines[0].text, "line 6", "a limit keeps the newest");
        assert_eq!(last.missed, 5, "3 pushed out and 2 over the limit");
        let restarted = ring.page(99, 100);
        assert_eq!(restarted.lines.len(), 3, "after a restart's numbering: from the oldest");
    }

    #[test]
    fn a_flood_costs_the_ring_its_bounds_and_a_long_line_is_cut() {
        let ring = LogRing::new(1000, 8 * LINE_BYTES);
        let long = "é".repeat(LINE_BYTES); // two bytes a character
        for _ in 0..100 {
            ring.push("info", Source::Log, None, &long);
        }
        let page = ring.page(0, usize::MAX);
        let bytes: usize = page.lines.iter().map(|l| l.text.len()).sum();
        assert!(bytes <= 8 * LINE_BYTES, "held {bytes} bytes");
        assert!(page.lines.len() >= 7, "held {} lines", page.lines.len());
        assert!(
            page.lines[0]
                .text
                .ends_with(&format!("[cut by weir: {} bytes]", 2 * LINE_BYTES))
        );
        assert_eq!(page.missed as usize + page.lines.len(), 100);
    }

    #[test]
    fn stdio_chunks_are_split_into_lines_and_blank_ones_dropped() {
        let ring = LogRing::default();
        ring.push_chunk(Source::Stderr, b"Traceback:\n  File \"app.py\"\n\nValueError: no\n");
        let page = ring.page(0, 10);
        let texts: Vec<&str> = page.lines.iter().map(|l| l.text.as_str()).collect();
        assert_eq!(texts, ["Traceback:", "  File \"app.py\"", "ValueError: no"]);
        assert!(page.lines.iter().all(|l| l.level == "warn" && l.message_id.is_none()));
    }
}
