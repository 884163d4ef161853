//! What a trap's `weir-error` says, in the order a person reads it: the
//! guest's panic message and where it happened, then the trap, then a short
//! wasm backtrace of the guest's own frames (the panic machinery left out).

/// Frames of the wasm backtrace kept.
pub const BACKTRACE_FRAMES: usize = 6;

/// A frame's function as people write it: without the `module.wasm!`
/// prefix and the `[hash]` disambiguators of Rust's symbol names.
fn function(frame: &str) -> String {
    let name = frame.split_once(".wasm!").map_or(frame, |(_, name)| name);
    // `{err:#}` appends the causes to the last frame (`handle: wasm trap: …`).
    let name = name.split_once(": ").map_or(name, |(name, _)| name);
    // The legacy mangling's `::h0123456789abcdef`.
    let name = match name.rsplit_once("::h") {
        Some((head, hash)) if hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()) => head,
        _ => name,
    };
    let mut out = String::with_capacity(name.len());
    let mut depth = 0usize;
    let mut chars = name.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '[' if depth > 0 || chars.peek().is_some_and(char::is_ascii_hexdigit) => depth += 1,
            ']' if depth > 0 => depth -= 1,
            _ if depth > 0 => {}
            c => out.push(c),
        }
    }
    out
}

/// Frames that are the standard library's panic and abort machinery (or
/// its other internals), not the guest's code.
fn machinery(function: &str) -> bool {
    const PREFIXES: [&str; 10] = [
        "std::",
        "core::",
        "alloc::",
        "__rustc::",
        "panic_abort::",
        "<std::",
        "<core::",
        "<alloc::",
        "dlmalloc",
        "wasi::",
    ];
    const EXACT: [&str; 4] = ["abort", "__rust_start_panic", "rust_begin_unwind", "rust_panic"];
    PREFIXES.iter().any(|p| function.starts_with(p)) || EXACT.contains(&function)
}

/// The panic in a guest's last output (`thread '…' panicked at LOC:` and the
/// message lines after it, up to Rust's `note: run with RUST_BACKTRACE`):
/// `panicked at LOC: MESSAGE`, one line.
pub fn panic_message(output: &str) -> Option<String> {
    let lines: Vec<&str> = output.lines().collect();
    let start = lines.iter().rposition(|l| l.contains("panicked at "))?;
    let head = lines[start];
    let at = &head[head.find("panicked at ")?..];
    let mut text = at.trim_end().trim_end_matches(':').to_owned();
    let message: Vec<&str> = lines[start + 1..]
        .iter()
        .take_while(|l| !l.starts_with("note: run with `RUST_BACKTRACE"))
        .map(|l| l.trim())
        .filter(|l| !l.is_empty())
        .collect();
    if !message.is_empty() {
        text.push_str(": ");
        text.push_str(&message.join(" / "));
    }
    Some(text)
}

/// The guest's own frames of a wasmtime error's wasm backtrace (`N: 0x… - name`
/// lines), at most [`BACKTRACE_FRAMES`], renumbered, and how many were left out.
pub fn guest_frames(error: &str) -> (Vec<String>, usize) {
    let frames: Vec<String> = error
        .lines()
        .map(str::trim)
        .filter_map(|l| {
            let (n, rest) = l.split_once(':')?;
            n.parse::<u32>().ok()?;
            let (_, name) = rest.split_once(" - ")?;
            Some(function(name.trim()))
        })
        .collect();
    let total = frames.len();
    let kept: Vec<String> = frames
        .into_iter()
        .filter(|f| !machinery(f))
        .take(BACKTRACE_FRAMES)
        .collect();
    let left = total - kept.len();
    (kept, left)
}

/// The whole text: `panic` (or `cause` when the guest said nothing), the
/// trap's cause in brackets, and the trimmed backtrace; and whether the
/// guest output it quotes was cut.
///
/// `output` is the guest's last output as written (looked through for the
/// panic); `words`, its last lines joined on one line ([`TailPipe::last_words`]),
/// is what stands after the cause when there is no panic, marked as cut when
/// `cut_from` gives how many bytes the guest wrote in all (more than the
/// words show).
///
/// [`TailPipe::last_words`]: super::stdio::TailPipe::last_words
pub fn trap_text(
    cause: &str,
    output: Option<&str>,
    words: Option<&str>,
    cut_from: Option<usize>,
    error: &str,
) -> (String, bool) {
    let panic = output.and_then(panic_message);
    let mut cut = false;
    let mut text = match &panic {
        Some(p) => format!("{p} [{cause}]"),
        None => cause.to_owned(),
    };
    if panic.is_none()
        && let Some(words) = words.filter(|w| !w.is_empty())
    {
        text.push_str("; guest output: ");
        text.push_str(words);
        if let Some(written) = cut_from {
            cut = true;
            text.push_str(&format!(
                " [cut by weir: {written} bytes of guest output, the last lines shown]"
            ));
        }
    }
    let (frames, left) = guest_frames(error);
    if !frames.is_empty() {
        text.push_str("\nwasm backtrace: ");
        text.push_str(&frames.join(" <- "));
        if left > 0 {
            text.push_str(&format!(" ({left} more frames not shown)"));
        }
    }
    (text, cut)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUTPUT: &str = "thread '<unnamed>' panicked at src/lib.rs:14:13:\nprice list missing\nnote: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n";
    /// What wasmtime 48 prints for a Rust guest's panic (the faulty test guest's, shortened).
    const ERROR: &str = "error while executing at wasm backtrace:\n    0: 0x1a2b - orders.wasm!abort\n    1: 0x1a2c - orders.wasm!std[d123b7a1a2ed1472]::sys::pal::wasi::helpers::abort_internal\n    2: 0x1b00 - orders.wasm!__rustc[b7974e8690430dd9]::rust_panic\n    3: 0x1c00 - orders.wasm!core[0a1b2c3d4e5f6789]::panicking::panic_fmt\n    4: 0x2000 - orders.wasm!orders::Orders::price\n    5: 0x2100 - orders.wasm!<orders::Orders as weir_guest[abcdef0123456789]::Handler>::handle::ha7f21247313ff345\n    6: 0x2200 - orders.wasm!weir_guest::__private::export: wasm trap: wasm `unreachable` instruction executed\n\nCaused by:\n    wasm trap: wasm `unreachable` instruction executed";

    #[test]
    fn the_panic_comes_first_and_the_backtrace_keeps_the_guests_frames() {
        let (text, cut) = trap_text(
            "wasm trap: wasm `unreachable` instruction executed",
            Some(OUTPUT),
            Some("the joined lines, unused when there is a panic"),
            None,
            ERROR,
        );
        assert!(!cut, "{text}");
        assert!(
            text.starts_with("panicked at src/lib.rs:14:13: price list missing [wasm trap: wasm `unreachable`"),
            "{text}"
        );
        assert!(!text.contains("RUST_BACKTRACE"), "{text}");
        assert!(!text.contains("__rust_start_panic"), "{text}");
        assert!(
            text.contains(
                "wasm backtrace: orders::Orders::price <- <orders::Orders as weir_guest::Handler>::handle <- \
                 weir_guest::__private::export (4 more frames not shown)"
            ),
            "{text}"
        );
        assert!(!text.contains("d123b7a1") && !text.contains(".wasm!"), "{text}");
    }

    #[test]
    fn without_a_panic_the_cause_and_output_stay() {
        let (text, cut) = trap_text(
            "wasm trap: out of bounds memory access",
            Some("half a line\n"),
            Some("half a line"),
            None,
            ERROR,
        );
        assert!(!cut, "{text}");
        assert!(
            text.starts_with("wasm trap: out of bounds memory access; guest output: half a line"),
            "{text}"
        );
        assert_eq!(panic_message("no panic here"), None);
        // The pipe held only the end of what the guest wrote: said so.
        let (text, cut) = trap_text(
            "wasm trap: unreachable",
            Some("rrrr\n"),
            Some("rrrr"),
            Some(102_400),
            "",
        );
        assert!(
            cut && text.ends_with("[cut by weir: 102400 bytes of guest output, the last lines shown]"),
            "{text}"
        );
    }
}
