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

/// A Python exception in a guest's last output: the traceback
/// componentize-py prints before its runtime panics ("Python function threw
/// an unexpected exception", which names neither the exception nor where).
/// Returns `ExcType: message (at FILE:LINE in FUNCTION)` and the frames,
/// most recent call last, as `FILE:LINE in FUNCTION`.
pub fn python_exception(output: &str) -> Option<(String, Vec<String>)> {
    let lines: Vec<&str> = output.lines().collect();
    // The last traceback (a chained one ends with the exception that
    // escaped); a traceback whose start the pipe dropped begins at its
    // first frame.
    let start = match lines
        .iter()
        .rposition(|l| l.trim_end() == "Traceback (most recent call last):")
    {
        Some(t) => t + 1,
        None => lines.iter().position(|l| l.starts_with("  File \""))?,
    };
    let end = lines[start..]
        .iter()
        .position(|l| l.contains("panicked at "))
        .map_or(lines.len(), |p| start + p);
    let block = &lines[start..end];
    let last_frame = block.iter().rposition(|l| l.starts_with("  File \""))?;
    let frames: Vec<String> = block[..=last_frame].iter().filter_map(|l| python_frame(l)).collect();
    // After the last frame: its source line, if the component kept the
    // sources (indented), then the exception, on one line or more.
    let exception: Vec<&str> = block[last_frame + 1..]
        .iter()
        .filter(|l| !l.starts_with("  ") && !l.trim().is_empty())
        .map(|l| l.trim())
        .collect();
    if exception.is_empty() {
        return None;
    }
    let mut text = exception.join(" / ");
    if let Some(at) = frames.last() {
        text.push_str(&format!(" (at {at})"));
    }
    Some((text, frames))
}

/// `  File "/0/app.py", line 171, in explode` as `app.py:171 in explode`
/// (componentize-py mounts the application's directory at `/0`).
fn python_frame(line: &str) -> Option<String> {
    let rest = line.trim().strip_prefix("File \"")?;
    let (path, rest) = rest.split_once("\", line ")?;
    let (number, function) = rest.split_once(", in ").unwrap_or((rest, "?"));
    let path = match path.strip_prefix('/').and_then(|p| p.split_once('/')) {
        Some((root, inner)) if root.chars().all(|c| c.is_ascii_digit()) => inner,
        _ => path,
    };
    Some(format!("{path}:{} in {}", number.trim(), function.trim()))
}

/// A JavaScript exception that escaped `handle`. ComponentizeJS takes any
/// thrown value for a `failure` and cannot lower one that is not
/// (`invalid variant tag value \`undefined\` (received \`TypeError: …\`)
/// specified for \`Failure\``): the thrown value as it printed it, and the
/// frames of the last stack the guest wrote before it (the templates write an
/// unexpected error's `stack` to stderr), most recent call first, as
/// `FILE:LINE in FUNCTION`, the bindings' own frames left out.
pub fn js_exception(output: &str) -> Option<(String, Vec<String>)> {
    const RECEIVED: &str = "(received `";
    const FOR_FAILURE: &str = "`) specified for `Failure`";
    let received = output.rfind(RECEIVED)?;
    let rest = &output[received + RECEIVED.len()..];
    let thrown = &rest[..rest.find(FOR_FAILURE)?];
    let thrown = thrown.lines().map(str::trim).collect::<Vec<_>>().join(" / ");
    // The last block of frame lines before the bindings' message.
    let before: Vec<&str> = output[..received].lines().collect();
    let end = before.iter().rposition(|l| js_frame(l).is_some()).map_or(0, |e| e + 1);
    let start = before[..end]
        .iter()
        .rposition(|l| js_frame(l).is_none())
        .map_or(0, |s| s + 1);
    let frames = before[start..end].iter().filter_map(|l| js_frame(l)).collect();
    Some((thrown, frames))
}

/// `greet@/tmp/…/sources/handler.js:52:11` as `handler.js:52 in greet`
/// (ComponentizeJS copies the sources to a temporary `sources/` folder); the
/// bindings' `initializer.js` is not the guest's code, nor is `weir dev`'s module of
/// live sources, `weir_dev_live.js`.
fn js_frame(line: &str) -> Option<String> {
    let (function, place) = line.trim().split_once('@')?;
    let (place, _column) = place.rsplit_once(':')?;
    let (path, number) = place.rsplit_once(':')?;
    if number.is_empty() || !number.chars().all(|c| c.is_ascii_digit()) || function.contains(' ') {
        return None;
    }
    let path = path.strip_prefix("file://").unwrap_or(path);
    let path = path.rsplit_once("/sources/").map_or(path, |(_, inner)| inner);
    if path == "initializer.js" || path == "weir_dev_live.js" {
        return None;
    }
    let function = if function.is_empty() { "?" } else { function };
    Some(format!("{path}:{number} in {function}"))
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
    // A Python exception says what happened and where; the panic of the
    // runtime it escaped through and that runtime's wasm frames do not.
    if let Some((exception, frames)) = output.and_then(python_exception) {
        let mut text = format!("{exception} [Python exception; {cause}]");
        if frames.len() > 1 {
            text.push_str("\nPython traceback (most recent call last): ");
            text.push_str(&frames.join(" -> "));
        }
        return (text, false);
    }
    // The same for JavaScript, whose stack the bindings do not keep (the
    // frames they print are their own): the guest's, when it wrote it.
    if let Some((thrown, frames)) = output.and_then(js_exception) {
        let mut text = thrown;
        if let Some(at) = frames.first() {
            text.push_str(&format!(" (at {at})"));
        }
        text.push_str(&format!(" [JavaScript exception thrown out of the handler; {cause}]"));
        if frames.len() > 1 {
            text.push_str("\nJavaScript stack (most recent call first): ");
            text.push_str(&frames.join(" <- "));
        }
        return (text, false);
    }
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

    /// What a componentize-py guest wrote when `handle` raised (captured
    /// from a component built with the pinned componentize-py).
    const PYTHON: &str = "Traceback (most recent call last):\n  File \"/0/app.py\", line 180, in handle\n  File \"/0/app.py\", line 171, in explode\nValueError: price list missing for call-1\n\nthread '<unnamed>' (1) panicked at runtime/src/lib.rs:1293:29:\nPython function threw an unexpected exception\nnote: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n";
    const PYTHON_ERROR: &str = "error while executing at wasm backtrace:\n    0: 0x1 - libc.so!abort\n    1: 0x2 - libc.so!wit_dylib_export_call\n    2: 0x3 - <unknown>!handle\n\nCaused by:\n    wasm trap: wasm `unreachable` instruction executed";

    #[test]
    fn a_python_exception_names_its_type_message_file_and_line() {
        let cause = "wasm trap: wasm `unreachable` instruction executed";
        let (text, cut) = trap_text(cause, Some(PYTHON), Some("unused"), None, PYTHON_ERROR);
        assert!(!cut);
        assert_eq!(
            text,
            "ValueError: price list missing for call-1 (at app.py:171 in explode) \
             [Python exception; wasm trap: wasm `unreachable` instruction executed]\n\
             Python traceback (most recent call last): app.py:180 in handle -> app.py:171 in explode"
        );
        // The red baseline: read as a panic, the same output names neither
        // the exception nor where it was raised.
        let panic = panic_message(PYTHON).unwrap();
        assert!(!panic.contains("ValueError") && !panic.contains("app.py"), "{panic}");
    }

    #[test]
    fn a_chained_or_cut_python_traceback_reports_the_exception_that_escaped() {
        let chained = "Traceback (most recent call last):\n  File \"/0/app.py\", line 5, in load\nKeyError: 'eur'\n\n\
                       During handling of the above exception, another exception occurred:\n\n\
                       Traceback (most recent call last):\n  File \"/0/app.py\", line 9, in handle\n    price(msg)\n\
                       RuntimeError: no price\nfor this order\nthread '<unnamed>' panicked at x.rs:1:1:\nPython function threw\n";
        let (text, frames) = python_exception(chained).unwrap();
        assert_eq!(text, "RuntimeError: no price / for this order (at app.py:9 in handle)");
        assert_eq!(frames, ["app.py:9 in handle"]);
        // The pipe kept only the end: the frames it holds still count.
        let cut = "  File \"/0/app.py\", line 171, in explode\nValueError: boom\n";
        assert_eq!(
            python_exception(cut).unwrap().0,
            "ValueError: boom (at app.py:171 in explode)"
        );
        // A Rust panic is not a Python exception.
        assert_eq!(python_exception(OUTPUT), None);
    }

    #[test]
    fn a_javascript_exception_names_its_type_and_message() {
        // What a ComponentizeJS guest wrote when `handle` threw a TypeError
        // (captured from a component built with the pinned ComponentizeJS).
        let output = "invalid variant tag value `undefined` (received `TypeError: price list missing for call-1`) \
                      specified for `Failure`\nStack:\n  export_handle@/tmp/8f185ab952e7/sources/initializer.js:445:17\n\
                      Redirecting call to abort() to mozalloc_abort\n";
        let cause = "wasm trap: wasm `unreachable` instruction executed";
        let (text, _) = trap_text(cause, Some(output), Some("unused"), None, PYTHON_ERROR);
        assert_eq!(
            text,
            "TypeError: price list missing for call-1 [JavaScript exception thrown out of the handler; \
             wasm trap: wasm `unreachable` instruction executed]"
        );
        // The red baseline: without a panic, the words stood after the cause.
        assert_eq!(panic_message(output), None);
        assert_eq!(js_exception("a guest's own log line"), None);
    }

    #[test]
    fn a_javascript_stack_the_guest_wrote_names_where_it_was_thrown() {
        // The template writes an unexpected error's stack before rethrowing it.
        let output = "greeting Ada (attempt 1)\nnot@a frame\n\
                      greet@/tmp/1c2d/sources/handler.js:52:11\n\
                      handle@/tmp/1c2d/sources/handler.js:37:5\n\
                      handle@/tmp/1c2d/sources/weir_dev_live.js:85:10\n\
                      export_handle@/tmp/1c2d/sources/initializer.js:445:17\n\
                      invalid variant tag value `undefined` (received `TypeError: no greeting for Boom`) \
                      specified for `Failure`\nStack:\n  export_handle@/tmp/1c2d/sources/initializer.js:445:17\n";
        let cause = "wasm trap: wasm `unreachable` instruction executed";
        let (text, _) = trap_text(cause, Some(output), None, None, PYTHON_ERROR);
        assert_eq!(
            text,
            "TypeError: no greeting for Boom (at handler.js:52 in greet) [JavaScript exception thrown \
             out of the handler; wasm trap: wasm `unreachable` instruction executed]\n\
             JavaScript stack (most recent call first): handler.js:52 in greet <- handler.js:37 in handle"
        );
        // Without the stack, the message alone, as before.
        let (bare, _) = trap_text(cause, Some(&output[output.find("invalid").unwrap()..]), None, None, "");
        assert!(
            bare.starts_with("TypeError: no greeting for Boom [JavaScript"),
            "{bare}"
        );
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
