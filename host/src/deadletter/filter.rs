//! Which dead letters a command applies to: by reason, handler, group,
//! tenant, message type, id or position, and capture time.

use std::time::{Duration, SystemTime};

use crate::envelope::{Wire, header};
use crate::outcome::Reason;
use crate::transport::dead_letters::DeadLetter;

/// What a letter must match (every field that is set). The empty filter
/// matches every letter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// `weir-dead-letter-reason` (`rejected`, `exhausted`, …).
    pub reason: Option<String>,
    /// `weir-handler`: the handler that failed it.
    pub handler: Option<String>,
    /// `weir-group-id`.
    pub group: Option<String>,
    /// `weir-tenant-id`. A tenant's view of the dead letters always sets it.
    pub tenant: Option<String>,
    /// `weir-message-type`.
    pub message_type: Option<String>,
    /// Any of these: a `weir-message-id`, or `#N` for the letter at position `N`.
    pub ids: Vec<String>,
    /// Captured at or after this time (`weir-failed-at`).
    pub since: Option<SystemTime>,
    /// Captured before this time (`weir-failed-at`).
    pub until: Option<SystemTime>,
}

/// A non-empty header value.
pub(super) fn value<'a>(wire: &'a Wire, name: &str) -> Option<&'a str> {
    wire.header(name).filter(|v| !v.is_empty())
}

/// When a letter was captured (`weir-failed-at`), if it says.
pub fn failed_at(wire: &Wire) -> Option<SystemTime> {
    value(wire, header::FAILED_AT).and_then(|v| humantime::parse_rfc3339_weak(v).ok())
}

impl Filter {
    /// Whether the filter's values can match anything: an unknown reason is
    /// an error naming the accepted ones, and so is an empty time range.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(r) = &self.reason
            && !Reason::ALL.iter().any(|k| k.as_str() == r)
        {
            let accepted: Vec<&str> = Reason::ALL.iter().map(|k| k.as_str()).collect();
            return Err(format!(
                "reason {r:?} is not a dead-letter reason; accepted: {accepted:?}"
            ));
        }
        if let (Some(since), Some(until)) = (self.since, self.until)
            && until <= since
        {
            return Err(format!(
                "the time range is empty: until ({}) is not after since ({})",
                humantime::format_rfc3339_seconds(until),
                humantime::format_rfc3339_seconds(since)
            ));
        }
        for id in &self.ids {
            if let Some(n) = id.strip_prefix('#')
                && n.parse::<u64>().is_err()
            {
                return Err(format!(
                    "{id:?} is not a position; accepted: #N (e.g. #3) or a message id"
                ));
            }
        }
        Ok(())
    }

    /// Whether `letter` matches.
    pub fn matches(&self, letter: &DeadLetter) -> bool {
        let w = &letter.wire;
        let is = |want: &Option<String>, name: &str| want.as_deref().is_none_or(|x| value(w, name) == Some(x));
        if !(is(&self.reason, header::DEAD_LETTER_REASON)
            && is(&self.handler, header::HANDLER)
            && is(&self.group, header::GROUP_ID)
            && is(&self.tenant, header::TENANT_ID)
            && is(&self.message_type, header::MESSAGE_TYPE))
        {
            return false;
        }
        if !self.ids.is_empty() {
            let id = value(w, header::MESSAGE_ID);
            let named = self.ids.iter().any(|want| match want.strip_prefix('#') {
                Some(n) => n.parse::<u64>().ok() == Some(letter.position),
                None => id == Some(want.as_str()),
            });
            if !named {
                return false;
            }
        }
        if self.since.is_some() || self.until.is_some() {
            let Some(at) = failed_at(w) else { return false };
            if self.since.is_some_and(|s| at < s) || self.until.is_some_and(|u| at >= u) {
                return false;
            }
        }
        true
    }
}

/// A time as a person gives it: an RFC 3339 time (`2025-03-01T12:00:00Z`),
/// a date (`2025-03-01`, midnight UTC), or a duration back from `now`
/// (`90m`, `2h`, `7d`).
pub fn parse_time(text: &str, now: SystemTime) -> Result<SystemTime, String> {
    let t = text.trim();
    let accepted = "accepted: an RFC 3339 time (2025-03-01T12:00:00Z), a date (2025-03-01, midnight UTC) \
                    or a duration back from now (90m, 2h, 7d)";
    if t.is_empty() {
        return Err(format!("an empty time; {accepted}"));
    }
    if let Ok(d) = humantime::parse_duration(t) {
        return now
            .checked_sub(d)
            .ok_or_else(|| format!("{text:?} reaches back before 1970; {accepted}"));
    }
    let full = if t.len() == 10 {
        format!("{t}T00:00:00Z")
    } else {
        t.to_owned()
    };
    humantime::parse_rfc3339_weak(&full).map_err(|e| format!("{text:?} is not a time ({e}); {accepted}"))
}

/// How long ago `at` was, rounded to seconds, for people.
pub fn ago(at: SystemTime, now: SystemTime) -> String {
    let d = now.duration_since(at).unwrap_or(Duration::ZERO);
    humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter(position: u64, h: &[(&str, &str)]) -> DeadLetter {
        DeadLetter {
            position,
            wire: Wire {
                headers: h.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
                body: Vec::new(),
            },
        }
    }

    #[test]
    fn every_set_field_must_match() {
        let l = letter(
            7,
            &[
                (header::MESSAGE_ID, "m-1"),
                (header::MESSAGE_TYPE, "order.placed"),
                (header::GROUP_ID, "g"),
                (header::TENANT_ID, "acme"),
                (header::DEAD_LETTER_REASON, "rejected"),
                (header::HANDLER, "orders"),
                (header::FAILED_AT, "2025-03-01T12:00:00.123456789Z"),
            ],
        );
        assert!(Filter::default().matches(&l));
        let f = |f: Filter| f.matches(&l);
        assert!(f(Filter {
            reason: Some("rejected".into()),
            handler: Some("orders".into()),
            group: Some("g".into()),
            tenant: Some("acme".into()),
            message_type: Some("order.placed".into()),
            ..Filter::default()
        }));
        assert!(!f(Filter {
            tenant: Some("globex".into()),
            ..Filter::default()
        }));
        assert!(!f(Filter {
            reason: Some("exhausted".into()),
            ..Filter::default()
        }));
        assert!(f(Filter {
            ids: vec!["nope".into(), "m-1".into()],
            ..Filter::default()
        }));
        assert!(f(Filter {
            ids: vec!["#7".into()],
            ..Filter::default()
        }));
        assert!(!f(Filter {
            ids: vec!["#8".into()],
            ..Filter::default()
        }));
        let at = |s: &str| parse_time(s, SystemTime::now()).unwrap();
        assert!(f(Filter {
            since: Some(at("2025-03-01")),
            until: Some(at("2025-03-02")),
            ..Filter::default()
        }));
        assert!(!f(Filter {
            since: Some(at("2025-03-01T12:00:01Z")),
            ..Filter::default()
        }));
        assert!(!f(Filter {
            until: Some(at("2025-03-01T12:00:00Z")),
            ..Filter::default()
        }));
        // A letter without a capture time matches no time range.
        let bare = letter(1, &[(header::MESSAGE_TYPE, "t")]);
        assert!(
            !Filter {
                since: Some(at("2000-01-01")),
                ..Filter::default()
            }
            .matches(&bare)
        );
    }

    #[test]
    fn bad_values_are_named_with_what_is_accepted() {
        let e = Filter {
            reason: Some("boom".into()),
            ..Filter::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.contains("\"boom\"") && e.contains("rejected"), "{e}");
        let now = SystemTime::now();
        let e = parse_time("yesterday", now).unwrap_err();
        assert!(e.contains("\"yesterday\"") && e.contains("RFC 3339"), "{e}");
        assert_eq!(parse_time("2h", now).unwrap(), now - Duration::from_secs(7200));
        let e = Filter {
            since: Some(now),
            until: Some(now),
            ..Filter::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.contains("empty"), "{e}");
        assert!(
            Filter {
                ids: vec!["#x".into()],
                ..Filter::default()
            }
            .validate()
            .is_err()
        );
    }
}
