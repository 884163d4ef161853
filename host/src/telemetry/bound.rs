//! Bounds on what a publisher controls, wherever traces copy it: a
//! `traceparent` is copied only when it is valid W3C trace context, a
//! `tracestate` is cut to the W3C limits (at most [`TRACESTATE_MEMBERS`]
//! list members and [`TRACESTATE_BYTES`] bytes), and span attribute values
//! taken from a message (its id, type, group, tenant) are cut to
//! [`ATTRIBUTE_BYTES`].

/// Most bytes of a `tracestate` that is propagated (W3C: "at least 512").
pub const TRACESTATE_BYTES: usize = 512;
/// Most list members of a `tracestate` (W3C: 32).
pub const TRACESTATE_MEMBERS: usize = 32;
/// Members longer than this are dropped first when a `tracestate` is cut
/// (W3C: "entries larger than 128 characters long SHOULD be removed first").
const LONG_MEMBER: usize = 128;
/// Most bytes of a span attribute value copied from a message.
pub const ATTRIBUTE_BYTES: usize = 256;

/// `value` if it is a valid W3C `traceparent`: version (two lowercase hex
/// digits, not `ff`), a 32-digit trace id and a 16-digit parent id (neither
/// all zeros) and flags, joined by `-`. Version `00` is exactly 55 bytes; a
/// later version may carry more after a `-`, which is cut off.
pub fn traceparent(value: &str) -> Option<&str> {
    let head = value.get(..55)?;
    let rest = &value[55..];
    let parts: Vec<&str> = head.split('-').collect();
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let zeros = |s: &str| s.bytes().all(|b| b == b'0');
    let valid = parts.len() == 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && hex(parts[1], 32)
        && !zeros(parts[1])
        && hex(parts[2], 16)
        && !zeros(parts[2])
        && hex(parts[3], 2);
    let tail_ok = rest.is_empty() || (parts.first() != Some(&"00") && rest.starts_with('-'));
    (valid && tail_ok).then_some(head)
}

/// One `tracestate` list member, `key=value`, as W3C allows (keys: lowercase
/// letters, digits and `_-*/@`, at most 256; values: printable ASCII but
/// `,` and `=`, at most 256, not ending in a space).
fn valid_member(member: &str) -> bool {
    let Some((key, value)) = member.split_once('=') else {
        return false;
    };
    let key_ok = !key.is_empty()
        && key.len() <= 256
        && key
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-*/@".contains(&b));
    let value_ok = !value.is_empty()
        && value.len() <= 256
        && !value.ends_with(' ')
        && value
            .bytes()
            .all(|b| (0x20..=0x7e).contains(&b) && b != b',' && b != b'=');
    key_ok && value_ok
}

/// A `tracestate` within the W3C limits: invalid members left out, at most
/// [`TRACESTATE_MEMBERS`] members, and, when longer than
/// [`TRACESTATE_BYTES`], members over 128 bytes removed first, then members
/// from the end. `None` when nothing is left.
pub fn tracestate(value: &str) -> Option<String> {
    let mut members: Vec<&str> = value
        .split(',')
        .map(|m| m.trim_matches([' ', '\t']))
        .filter(|m| valid_member(m))
        .take(TRACESTATE_MEMBERS)
        .collect();
    let len = |m: &[&str]| m.iter().map(|s| s.len()).sum::<usize>() + m.len().saturating_sub(1);
    if len(&members) > TRACESTATE_BYTES {
        members.retain(|m| m.len() <= LONG_MEMBER);
    }
    while len(&members) > TRACESTATE_BYTES {
        members.pop();
    }
    (!members.is_empty()).then(|| members.join(","))
}

/// `value` cut to [`ATTRIBUTE_BYTES`] on a character boundary, with `…`
/// when cut.
pub fn attribute(value: &str) -> String {
    if value.len() <= ATTRIBUTE_BYTES {
        return value.to_owned();
    }
    let mut end = ATTRIBUTE_BYTES - '…'.len_utf8();
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &value[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn only_a_valid_traceparent_is_copied() {
        assert_eq!(traceparent(TP), Some(TP));
        let huge = format!("{TP}{}", "x".repeat(100_000 - TP.len() + 3));
        assert_eq!(traceparent(&huge), None, "version 00 is exactly 55 bytes");
        let later = format!("01{}-future", &TP[2..]);
        assert_eq!(
            traceparent(&later),
            Some(&later[..55]),
            "a later version's extra fields are cut"
        );
        for bad in [
            "",
            "00-a-b-01",
            &TP.to_uppercase(),
            &format!("ff{}", &TP[2..]),
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0g",
            &format!("{TP}-"),
        ] {
            assert_eq!(traceparent(bad), None, "{bad:?}");
        }
        // A multi-byte character where the cut would fall is no panic.
        assert_eq!(traceparent(&format!("{}é{}", &TP[..54], "x")), None);
    }

    #[test]
    fn a_tracestate_is_cut_to_the_w3c_limits() {
        assert_eq!(tracestate("a=1, b=2 ,c=3").as_deref(), Some("a=1,b=2,c=3"));
        assert_eq!(
            tracestate("A=1,b=,=3,c=x=y,d=ok").as_deref(),
            Some("d=ok"),
            "invalid members left out"
        );
        assert_eq!(tracestate("").as_deref(), None);
        let many: Vec<String> = (0..40).map(|i| format!("k{i}=v")).collect();
        let cut = tracestate(&many.join(",")).unwrap();
        assert_eq!(cut.split(',').count(), TRACESTATE_MEMBERS);
        assert!(cut.starts_with("k0=v,k1=v"), "the first members are kept");
        let huge = format!("a=1,b={},c=3", "v".repeat(120_000));
        assert_eq!(
            tracestate(&huge).as_deref(),
            Some("a=1,c=3"),
            "a value over 256 bytes is invalid"
        );
        let long: Vec<String> = (0..6).map(|i| format!("k{i}={}", "v".repeat(200))).collect();
        let mut mixed = long.clone();
        mixed.insert(1, "short=1".into());
        let cut = tracestate(&mixed.join(",")).unwrap();
        assert_eq!(cut, "short=1", "members over 128 bytes go first");
        let mid: Vec<String> = (0..10).map(|i| format!("k{i}={}", "v".repeat(100))).collect();
        let cut = tracestate(&mid.join(",")).unwrap();
        assert!(
            cut.len() <= TRACESTATE_BYTES && cut.starts_with("k0="),
            "{} bytes",
            cut.len()
        );
        assert_eq!(cut.split(',').count(), 4, "members removed from the end");
    }

    #[test]
    fn attributes_are_cut_on_a_character_boundary() {
        assert_eq!(attribute("g-1"), "g-1");
        let cut = attribute(&"é".repeat(100_000));
        assert!(
            cut.len() <= ATTRIBUTE_BYTES && cut.ends_with('…'),
            "{} bytes",
            cut.len()
        );
        assert_eq!(attribute(&"x".repeat(ATTRIBUTE_BYTES)).len(), ATTRIBUTE_BYTES);
    }
}
