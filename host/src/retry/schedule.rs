//! Retry ladder arithmetic: the one pure implementation used at start-up, by
//! `weir schedule check`, and by the retry path on every broker (LESSONS.md, "Retries and dead
//! letters"). It owns the delay before each delivery, when deliveries run out, the time to
//! dead-letter and the checks of a policy against broker facts. It does no I/O: fetching a
//! stream's `max_age` or a consumer's `AckWait` and acting on a [`Step`] are the transport's.
//!
//! Vocabulary: *delivery* `n` is the `n`-th time a message is handed to the host (1 on the
//! first; the WIT's `attempt`). The delay before delivery `n >= 2` is rung `n - 1` of the ladder
//! (1-based), i.e. `ladder[n - 2]`: count the rungs *served before* delivery `n`. Once the ladder
//! runs out its last rung repeats.
//!
//! Who waits the delay differs by broker, the arithmetic does not ([`Redelivery`]): on memory and
//! RabbitMQ the host republishes to a delay queue; on JetStream the server redelivers after
//! `BackOff`/`AckWait` and the host does nothing to a retried delivery.

use std::fmt;
use std::time::Duration;

/// The ladder used when a topology has no `[topology.retry]` section.
pub const DEFAULT_LADDER: [Duration; 3] = [Duration::from_secs(1), Duration::from_secs(5), Duration::from_secs(30)];
/// `max_deliver` used when a topology has no `[topology.retry]` section (or the section omits
/// it): the first delivery plus four retries, so every default rung is served at least once.
pub const DEFAULT_MAX_DELIVER: i64 = 5;
/// The NATS server's own `AckWait` default, used when a JetStream consumer has no ladder and its
/// real `AckWait` is not known.
pub const NATS_DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);
/// Deliveries the host keeps back on JetStream for retrying a failed dead-letter capture.
pub const DEFAULT_CAPTURE_RESERVE: u32 = 1;

/// Where a policy came from: checks never reject a policy nobody wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The built-in default, for a topology without a `[topology.retry]` section. Its violations
    /// are reported as warnings, never errors: a config that uses no retry feature is never
    /// rejected (LESSONS.md).
    Default,
    /// Written in the config; violations are errors or warnings as each rule says.
    Configured,
}

/// A topology's retry policy, as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Delay before each redelivery; rung `k` (1-based) is waited before delivery `k + 1`, and
    /// the last rung repeats. Empty: JetStream waits `AckWait`, memory/RabbitMQ retry at once.
    pub ladder: Vec<Duration>,
    /// Deliveries in total, the first included; `<= 0` means unlimited (never exhausted).
    pub max_deliver: i64,
    /// Optional upper bound on the time from first delivery to dead-letter, checked at start.
    pub max_time_to_dead_letter: Option<Duration>,
    /// Whether a person wrote this policy (see [`Origin`]).
    pub origin: Origin,
}

/// The default is `ladder = ["1s", "5s", "30s"]`, `max_deliver = 5`, no time bound, marked
/// [`Origin::Default`]. A poison message is dead-lettered about 66 s after its first delivery
/// (memory/RabbitMQ; on JetStream the capture reserve brings the handler's last try to 36 s)
/// instead of looping forever, and no check can reject it.
impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            ladder: DEFAULT_LADDER.to_vec(),
            max_deliver: DEFAULT_MAX_DELIVER,
            max_time_to_dead_letter: None,
            origin: Origin::Default,
        }
    }
}

impl RetryPolicy {
    /// A configured policy with no time bound.
    pub fn new(ladder: Vec<Duration>, max_deliver: i64) -> Self {
        Self {
            ladder,
            max_deliver,
            max_time_to_dead_letter: None,
            origin: Origin::Configured,
        }
    }

    /// The same policy with a bound on the time to dead-letter.
    pub fn with_max_time_to_dead_letter(mut self, bound: Duration) -> Self {
        self.max_time_to_dead_letter = Some(bound);
        self
    }

    /// Total deliveries allowed, or `None` when unlimited (`max_deliver <= 0`).
    pub fn max_deliveries(&self) -> Option<u32> {
        (self.max_deliver > 0).then(|| u32::try_from(self.max_deliver).unwrap_or(u32::MAX))
    }

    /// This policy as served by a broker.
    pub fn schedule(&self, redelivery: Redelivery) -> Schedule {
        Schedule {
            policy: self.clone(),
            redelivery,
        }
    }
}

/// Who serves the ladder, and the broker facts the arithmetic depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redelivery {
    /// Memory and RabbitMQ: the host republishes to a delay queue with `weir-attempt + 1`.
    /// An empty ladder means an immediate retry.
    Host,
    /// NATS JetStream: the server redelivers once `AckWait` (shaped by `BackOff` = the ladder)
    /// expires, counting deliveries itself against `MaxDeliver` = `max_deliver`.
    JetStream {
        /// The consumer's `AckWait` if known. With a ladder the server replaces it by the first
        /// rung; without one it is the delay between deliveries (`None`: the server default).
        ack_wait: Option<Duration>,
        /// The last deliveries kept for retrying a failed dead-letter capture: the handler runs
        /// on at most `max_deliver - capture_reserve` deliveries (never fewer than 1).
        capture_reserve: u32,
    },
}

impl Redelivery {
    /// JetStream with an unknown `AckWait` and the default capture reserve.
    pub const JETSTREAM: Redelivery = Redelivery::JetStream {
        ack_wait: None,
        capture_reserve: DEFAULT_CAPTURE_RESERVE,
    };
}

/// What to do after a retryable failure of a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Deliver again after this delay. On JetStream the server waits it: the host leaves the
    /// delivery alone (no `Nak`) and lets `AckWait` expire.
    RetryAfter(Duration),
    /// No handler delivery is left: capture on the dead-letter destination (reason `exhausted`).
    Exhausted,
}

/// What a delivery is for, in a [`Schedule::table`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The handler runs; a retryable failure goes back onto the ladder.
    Handler,
    /// The handler's last try; a failure is dead-lettered.
    LastHandler,
    /// Kept in reserve (JetStream): only retries a dead-letter capture that failed.
    CaptureRetry,
}

impl Role {
    /// As a person reads it in `weir schedule check`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Handler => "handler",
            Role::LastHandler => "last handler try (a failure is dead-lettered)",
            Role::CaptureRetry => "reserve (retries a failed dead-letter capture)",
        }
    }
}

/// One line of the schedule table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    /// Delivery number, 1 on the first.
    pub delivery: u32,
    /// Delay between the previous delivery and this one (zero for the first).
    pub delay_before: Duration,
    /// Time from the first delivery to this one (handler run time not included).
    pub since_first: Duration,
    /// What this delivery is for.
    pub role: Role,
}

/// Facts for [`Schedule::check`] beyond the policy and the broker kind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckContext {
    /// The config key of the policy, named in every violation, e.g. `topology[0].retry`.
    pub key: String,
    /// The stream's retention (`max_age`); `None` or zero means unlimited.
    pub stream_max_age: Option<Duration>,
}

impl CheckContext {
    /// A context naming `key`, with no broker facts.
    pub fn new(key: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            stream_max_age: None,
        }
    }
}

/// One finding: the config key at fault and what is wrong and what would be accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The config key, e.g. `topology[0].retry.ladder[1]`.
    pub key: String,
    /// What is wrong and what would be accepted.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

/// The result of [`Schedule::check`]: errors stop the start, warnings are logged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Violations that make the policy unusable (silent data loss, a broker refusal).
    pub errors: Vec<Violation>,
    /// Violations worth a log line that do not stop the start.
    pub warnings: Vec<Violation>,
}

impl Report {
    /// True when there is no error (warnings allowed).
    pub fn is_ok(&self) -> bool {
        self.errors.is_empty()
    }
}

/// A [`RetryPolicy`] as served by one kind of broker: all ladder arithmetic lives here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    policy: RetryPolicy,
    redelivery: Redelivery,
}

impl Schedule {
    /// The policy being served.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// Who serves it.
    pub fn redelivery(&self) -> Redelivery {
        self.redelivery
    }

    /// The delay each redelivery waits when the ladder is empty.
    fn empty_ladder_delay(&self) -> Duration {
        match self.redelivery {
            Redelivery::Host => Duration::ZERO,
            Redelivery::JetStream { ack_wait, .. } => ack_wait.unwrap_or(NATS_DEFAULT_ACK_WAIT),
        }
    }

    /// The delay before delivery `n`: `None` for the first delivery (and for 0, which does not
    /// exist), otherwise rung `n - 1` (1-based, `ladder[n - 2]`), the last rung repeating.
    /// Pure ladder arithmetic: it does not consult `max_deliver`.
    pub fn delay_before(&self, delivery: u32) -> Option<Duration> {
        let served_before = delivery.checked_sub(1).filter(|s| *s >= 1)?;
        let index = usize::try_from(served_before - 1).unwrap_or(usize::MAX);
        let ladder = &self.policy.ladder;
        Some(match ladder.get(index).or_else(|| ladder.last()) {
            Some(rung) => *rung,
            None => self.empty_ladder_delay(),
        })
    }

    /// Time from the first delivery to delivery `n` (zero for `n <= 1`): the sum of the delays
    /// before deliveries `2..=n`. Saturates at `Duration::MAX`.
    pub fn since_first(&self, delivery: u32) -> Duration {
        let rungs = delivery.saturating_sub(1);
        let ladder = &self.policy.ladder;
        let Some(last) = ladder.last() else {
            return self.empty_ladder_delay().checked_mul(rungs).unwrap_or(Duration::MAX);
        };
        let on_ladder = usize::try_from(rungs).unwrap_or(usize::MAX).min(ladder.len());
        let climbed = ladder[..on_ladder]
            .iter()
            .fold(Duration::ZERO, |acc, d| acc.saturating_add(*d));
        // on_ladder <= rungs, so it fits in u32.
        let repeats = rungs - u32::try_from(on_ladder).unwrap_or(rungs);
        climbed.saturating_add(last.checked_mul(repeats).unwrap_or(Duration::MAX))
    }

    /// Deliveries on which the handler runs, or `None` when unlimited. On JetStream the capture
    /// reserve is held back, but the handler always gets at least one delivery.
    pub fn handler_deliveries(&self) -> Option<u32> {
        let max = self.policy.max_deliveries()?;
        Some(match self.redelivery {
            Redelivery::Host => max,
            Redelivery::JetStream { capture_reserve, .. } => max.saturating_sub(capture_reserve).max(1),
        })
    }

    /// True when a retryable failure on this delivery must be dead-lettered (reason
    /// `exhausted`), also for deliveries past the handler's last, which only retry a capture.
    pub fn is_last_delivery(&self, attempt: u32) -> bool {
        self.handler_deliveries().is_some_and(|last| attempt >= last)
    }

    /// True when the broker will make another delivery after `attempt` if this one is not
    /// settled: what a failed dead-letter capture relies on. False means the message would be
    /// `stranded`.
    pub fn has_delivery_after(&self, attempt: u32) -> bool {
        self.policy.max_deliveries().is_none_or(|max| attempt < max)
    }

    /// What follows a retryable failure of delivery `attempt`.
    pub fn next_step(&self, attempt: u32) -> Step {
        if self.is_last_delivery(attempt) {
            return Step::Exhausted;
        }
        let next = attempt.max(1).saturating_add(1);
        Step::RetryAfter(self.delay_before(next).unwrap_or(Duration::ZERO))
    }

    /// Time from the first delivery to the handler's last try, after which a failure is
    /// dead-lettered; `None` when unlimited.
    pub fn time_to_dead_letter(&self) -> Option<Duration> {
        self.handler_deliveries().map(|n| self.since_first(n))
    }

    /// Time from the first delivery to the last delivery the broker makes (capture retries
    /// included): how long the message must stay retained. `None` when unlimited.
    pub fn retention_needed(&self) -> Option<Duration> {
        self.policy.max_deliveries().map(|n| self.since_first(n))
    }

    /// The schedule as a table: deliveries `1..=max_deliver`, at most `max_rows` of them (when
    /// unlimited, `max_rows` rows; `ladder.len() + 2` shows the repeating tail).
    pub fn table(&self, max_rows: u32) -> Vec<Row> {
        let rows = self.policy.max_deliveries().map_or(max_rows, |max| max.min(max_rows));
        let handler = self.handler_deliveries();
        (1..=rows)
            .map(|n| Row {
                delivery: n,
                delay_before: self.delay_before(n).unwrap_or(Duration::ZERO),
                since_first: self.since_first(n),
                role: match handler {
                    Some(last) if n > last => Role::CaptureRetry,
                    Some(last) if n == last => Role::LastHandler,
                    _ => Role::Handler,
                },
            })
            .collect()
    }

    /// Checks the policy against the broker and `ctx`'s facts. Every violation names a key under
    /// `ctx.key` and says what would be accepted. Rules:
    /// - a zero-length rung: error;
    /// - `max_deliver > 0` and more rungs than `max_deliver`: error (the server refuses
    ///   `len(BackOff) > MaxDeliver`; equal is fine on memory and RabbitMQ, but an error on
    ///   JetStream, whose server 2.9 also refuses `len(BackOff) == MaxDeliver`, error 10116);
    /// - JetStream with a known `AckWait` that differs from the first rung: warning (the server
    ///   normalises `AckWait` to the first rung);
    /// - limited, and the last delivery comes no earlier than the stream's `max_age` after the
    ///   first: error (the message expires before it can be retried or dead-lettered: silent
    ///   loss; equal counts, since the message was already older than zero at first delivery);
    /// - limited, and the handler's last try comes after `max_time_to_dead_letter`: error;
    /// - unlimited (`max_deliver <= 0`): no duration check rejects; a bound is ignored (warning),
    ///   and a finite stream `max_age` lets a failing message expire (warning);
    /// - memory/RabbitMQ with an empty ladder: warning (retries are immediate);
    /// - JetStream with no delivery left for the capture reserve: warning;
    /// - a policy of [`Origin::Default`] (no retry section) is never rejected: every error above
    ///   becomes a warning.
    pub fn check(&self, ctx: &CheckContext) -> Report {
        let key = ctx.key.as_str();
        let policy = &self.policy;
        let mut report = Report::default();
        let mut warnings = Vec::new();
        self.check_ladder(key, &mut report.errors);
        self.check_ack_wait(key, &mut warnings);
        self.check_time_to_dead_letter(ctx, &mut report.errors, &mut warnings);
        self.check_capture_reserve(key, &mut warnings);

        report.warnings.extend(warnings);
        if policy.origin == Origin::Default {
            let demoted = std::mem::take(&mut report.errors).into_iter().map(|v| Violation {
                key: v.key,
                message: format!(
                    "(default retry policy: the topology has no [topology.retry] section) {}; \
                     add a retry section to choose",
                    v.message
                ),
            });
            report.warnings.extend(demoted);
        }
        report
    }

    /// Each rung positive, and no more rungs than the deliveries serve (on
    /// JetStream, fewer: the server refuses a BackOff as long as MaxDeliver).
    fn check_ladder(&self, key: &str, errors: &mut Vec<Violation>) {
        let policy = &self.policy;
        let mut error = |k: String, m: String| errors.push(Violation { key: k, message: m });
        for (i, rung) in policy.ladder.iter().enumerate() {
            if rung.is_zero() {
                error(
                    format!("{key}.ladder[{i}]"),
                    "a rung of 0s redelivers at once and burns the ladder; \
                     use a positive duration such as \"1s\""
                        .to_string(),
                );
            }
        }

        let rungs = policy.ladder.len();
        let jetstream = matches!(self.redelivery, Redelivery::JetStream { .. });
        if let Some(max) = policy.max_deliveries() {
            if rungs > max as usize {
                error(
                    format!("{key}.ladder"),
                    format!(
                        "has {rungs} rungs but max_deliver = {max} serves at most {max} \
                         (the broker refuses a BackOff longer than MaxDeliver); accepted: at most \
                         {max} rungs, or max_deliver >= {rungs}, or max_deliver = 0 for unlimited"
                    ),
                );
            } else if jetstream && rungs == max as usize {
                // Stricter than LESSONS.md ("equal is fine"): nats-server 2.9 refuses
                // len(BackOff) == MaxDeliver with error 10116, pinned by
                // tests/nats_compliance.rs.
                error(
                    format!("{key}.ladder"),
                    format!(
                        "has {rungs} rungs and max_deliver = {max}: NATS JetStream refuses a BackOff \
                         as long as MaxDeliver (server error 10116, \"max deliver is required to be > \
                         length of backoff values\"); accepted: at most {} rungs, or max_deliver >= {}, \
                         or max_deliver = 0 for unlimited",
                        max - 1,
                        rungs + 1
                    ),
                );
            }
        }
    }

    /// On JetStream, an AckWait the first rung replaces.
    fn check_ack_wait(&self, key: &str, warnings: &mut Vec<Violation>) {
        let policy = &self.policy;
        let mut warn = |k: String, m: String| warnings.push(Violation { key: k, message: m });
        if let Redelivery::JetStream {
            ack_wait: Some(ack_wait),
            ..
        } = self.redelivery
            && let Some(first) = policy.ladder.first()
            && ack_wait != *first
        {
            warn(
                format!("{key}.ladder[0]"),
                format!(
                    "the JetStream consumer's AckWait is {} but the first rung is {}; the server \
                     replaces AckWait by the first rung, so the first redelivery comes {} after \
                     the first delivery, not {}; accepted silently: AckWait equal to the first rung",
                    show(ack_wait),
                    show(*first),
                    show(*first),
                    show(ack_wait),
                ),
            );
        }
    }

    /// The last delivery and the dead letter against the stream's `max_age`
    /// and `max_time_to_dead_letter` (and what unlimited deliveries leave
    /// unbounded).
    fn check_time_to_dead_letter(
        &self,
        ctx: &CheckContext,
        errors: &mut Vec<Violation>,
        warnings: &mut Vec<Violation>,
    ) {
        let key = ctx.key.as_str();
        let policy = &self.policy;
        let mut error = |k: String, m: String| errors.push(Violation { key: k, message: m });
        let mut warn = |k: String, m: String| warnings.push(Violation { key: k, message: m });
        let max_age = ctx.stream_max_age.filter(|age| !age.is_zero());
        match (self.retention_needed(), self.time_to_dead_letter()) {
            (Some(retention), Some(to_dead_letter)) => {
                if let Some(age) = max_age
                    && retention >= age
                {
                    error(
                        key.to_string(),
                        format!(
                            "the last delivery comes {} after the first, but the stream keeps a \
                             message for max_age = {}: it would expire before it is retried or \
                             dead-lettered (silent loss); accepted: a ladder and max_deliver \
                             whose last delivery comes before {}, or a stream max_age above {}",
                            show(retention),
                            show(age),
                            show(age),
                            show(retention),
                        ),
                    );
                }
                if let Some(bound) = policy.max_time_to_dead_letter
                    && to_dead_letter > bound
                {
                    error(
                        format!("{key}.max_time_to_dead_letter"),
                        format!(
                            "a failing message is dead-lettered {} after its first delivery \
                             (ladder {} with max_deliver = {}), over the bound of {}; accepted: \
                             max_time_to_dead_letter >= {}, or a shorter ladder or lower \
                             max_deliver",
                            show(to_dead_letter),
                            show_ladder(&policy.ladder),
                            policy.max_deliver,
                            show(bound),
                            show(to_dead_letter),
                        ),
                    );
                }
            }
            _ => {
                if let Some(bound) = policy.max_time_to_dead_letter {
                    warn(
                        format!("{key}.max_time_to_dead_letter"),
                        format!(
                            "{} is ignored: max_deliver = {} means unlimited deliveries, so \
                             nothing is dead-lettered for exhaustion; set max_deliver >= 1 to \
                             enforce it",
                            show(bound),
                            policy.max_deliver,
                        ),
                    );
                }
                if let Some(age) = max_age {
                    warn(
                        format!("{key}.max_deliver"),
                        format!(
                            "unlimited deliveries with a stream max_age of {}: a message that \
                             keeps failing expires from the stream without a dead letter; set \
                             max_deliver >= 1 to bound it",
                            show(age),
                        ),
                    );
                }
            }
        }
    }

    /// What the broker's redelivery leaves: an empty ladder on the host's
    /// ladder, room for a failed capture's retry on JetStream.
    fn check_capture_reserve(&self, key: &str, warnings: &mut Vec<Violation>) {
        let policy = &self.policy;
        let mut warn = |k: String, m: String| warnings.push(Violation { key: k, message: m });
        match self.redelivery {
            Redelivery::Host if policy.ladder.is_empty() => warn(
                format!("{key}.ladder"),
                "is empty: on memory and RabbitMQ a retry is redelivered at once; accepted: \
                 rungs such as [\"1s\", \"5s\", \"30s\"]"
                    .to_string(),
            ),
            Redelivery::JetStream { capture_reserve, .. } if capture_reserve > 0 => {
                if let Some(max) = policy.max_deliveries()
                    && max <= capture_reserve
                {
                    warn(
                        format!("{key}.max_deliver"),
                        format!(
                            "max_deliver = {max} leaves no delivery to retry a failed \
                             dead-letter capture on JetStream, so such a message is stranded; \
                             accepted: max_deliver >= {}",
                            u64::from(capture_reserve) + 1,
                        ),
                    );
                }
            }
            _ => {}
        }
    }
}

/// A duration as a humantime string ("1m 30s"), the syntax the config accepts.
fn show(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

fn show_ladder(ladder: &[Duration]) -> String {
    let rungs: Vec<String> = ladder.iter().map(|d| format!("{:?}", show(*d))).collect();
    format!("[{}]", rungs.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    fn ladder(secs: &[u64]) -> Vec<Duration> {
        secs.iter().map(|x| s(*x)).collect()
    }

    fn host(secs: &[u64], max_deliver: i64) -> Schedule {
        RetryPolicy::new(ladder(secs), max_deliver).schedule(Redelivery::Host)
    }

    fn jetstream(secs: &[u64], max_deliver: i64, ack_wait: Option<u64>) -> Schedule {
        RetryPolicy::new(ladder(secs), max_deliver).schedule(Redelivery::JetStream {
            ack_wait: ack_wait.map(s),
            capture_reserve: 1,
        })
    }

    fn ctx() -> CheckContext {
        CheckContext::new("topology[0].retry")
    }

    fn keys(v: &[Violation]) -> Vec<&str> {
        v.iter().map(|v| v.key.as_str()).collect()
    }

    // ---- arithmetic ----

    #[test]
    fn first_delivery_has_no_delay() {
        let sch = host(&[1, 5, 30], 5);
        assert_eq!(sch.delay_before(0), None);
        assert_eq!(sch.delay_before(1), None);
        assert_eq!(sch.since_first(1), Duration::ZERO);
        assert_eq!(sch.since_first(0), Duration::ZERO);
    }

    #[test]
    fn delivery_two_waits_the_first_rung_not_the_second() {
        let sch = host(&[1, 5, 30], 5);
        assert_eq!(sch.delay_before(2), Some(s(1)));
        assert_eq!(sch.delay_before(3), Some(s(5)));
        assert_eq!(sch.delay_before(4), Some(s(30)));
    }

    #[test]
    fn last_rung_repeats_once_the_ladder_runs_out() {
        let sch = host(&[1, 5, 30], 0);
        let k = 3u32;
        // delivery k+1 is the last rung itself, k+2 is its first repeat.
        assert_eq!(sch.delay_before(k + 1), Some(s(30)));
        assert_eq!(sch.delay_before(k + 2), Some(s(30)));
        assert_eq!(sch.delay_before(k + 3), Some(s(30)));
        assert_eq!(sch.delay_before(1_000_000), Some(s(30)));
        assert_eq!(sch.delay_before(u32::MAX), Some(s(30)));
        assert_eq!(sch.since_first(k + 1), s(36));
        assert_eq!(sch.since_first(k + 2), s(66));
        assert_eq!(sch.since_first(k + 3), s(96));
        assert_eq!(sch.since_first(1_000_000), s(36 + 30 * (1_000_000 - 4)));
    }

    #[test]
    fn single_rung_ladder_repeats_from_delivery_two() {
        let sch = host(&[7], 0);
        for n in 2..10 {
            assert_eq!(sch.delay_before(n), Some(s(7)));
            assert_eq!(sch.since_first(n), s(7 * u64::from(n - 1)));
        }
    }

    #[test]
    fn empty_ladder_waits_ack_wait_on_jetstream_and_nothing_on_host() {
        let js = jetstream(&[], 5, Some(12));
        assert_eq!(js.delay_before(2), Some(s(12)));
        assert_eq!(js.delay_before(9), Some(s(12)));
        assert_eq!(js.since_first(4), s(36));
        let js_default = jetstream(&[], 5, None);
        assert_eq!(js_default.delay_before(2), Some(NATS_DEFAULT_ACK_WAIT));
        let h = host(&[], 5);
        assert_eq!(h.delay_before(2), Some(Duration::ZERO));
        assert_eq!(h.since_first(5), Duration::ZERO);
    }

    #[test]
    fn with_a_ladder_jetstream_ack_wait_does_not_change_delays() {
        let js = jetstream(&[1, 5], 4, Some(30));
        assert_eq!(js.delay_before(2), Some(s(1)));
        assert_eq!(js.delay_before(3), Some(s(5)));
    }

    #[test]
    fn huge_counts_saturate_instead_of_overflowing() {
        let sch = RetryPolicy::new(vec![Duration::MAX], 0).schedule(Redelivery::Host);
        assert_eq!(sch.since_first(3), Duration::MAX);
        let sch = host(&[u64::MAX / 2], 0);
        assert_eq!(sch.since_first(u32::MAX), Duration::MAX);
    }

    #[test]
    fn next_step_on_host_uses_every_delivery() {
        let sch = host(&[1, 5, 30], 5);
        assert_eq!(sch.handler_deliveries(), Some(5));
        assert_eq!(sch.next_step(1), Step::RetryAfter(s(1)));
        assert_eq!(sch.next_step(2), Step::RetryAfter(s(5)));
        assert_eq!(sch.next_step(3), Step::RetryAfter(s(30)));
        assert_eq!(sch.next_step(4), Step::RetryAfter(s(30)));
        assert!(!sch.is_last_delivery(4));
        assert!(sch.is_last_delivery(5));
        assert_eq!(sch.next_step(5), Step::Exhausted);
        assert_eq!(sch.next_step(6), Step::Exhausted);
        assert!(sch.has_delivery_after(4));
        assert!(!sch.has_delivery_after(5));
        // attempt 0 does not exist; treat it like the first.
        assert_eq!(sch.next_step(0), Step::RetryAfter(s(1)));
    }

    #[test]
    fn jetstream_keeps_a_capture_reserve() {
        let sch = jetstream(&[1, 5, 30], 5, None);
        assert_eq!(sch.handler_deliveries(), Some(4));
        assert_eq!(sch.next_step(3), Step::RetryAfter(s(30)));
        assert!(sch.is_last_delivery(4));
        assert_eq!(sch.next_step(4), Step::Exhausted);
        // delivery 5 only retries a failed capture; after it nothing is left.
        assert!(sch.is_last_delivery(5));
        assert!(sch.has_delivery_after(4));
        assert!(!sch.has_delivery_after(5));
        assert_eq!(sch.time_to_dead_letter(), Some(s(36)));
        assert_eq!(sch.retention_needed(), Some(s(66)));
    }

    #[test]
    fn jetstream_handler_gets_at_least_one_delivery() {
        let sch = jetstream(&[], 1, None);
        assert_eq!(sch.handler_deliveries(), Some(1));
        assert_eq!(sch.next_step(1), Step::Exhausted);
        let big_reserve = RetryPolicy::new(vec![], 3).schedule(Redelivery::JetStream {
            ack_wait: None,
            capture_reserve: 10,
        });
        assert_eq!(big_reserve.handler_deliveries(), Some(1));
    }

    #[test]
    fn unlimited_never_exhausts() {
        for max in [0, -1, i64::MIN] {
            let sch = host(&[1, 5], max);
            assert_eq!(sch.policy().max_deliveries(), None);
            assert_eq!(sch.handler_deliveries(), None);
            assert_eq!(sch.time_to_dead_letter(), None);
            assert_eq!(sch.retention_needed(), None);
            assert!(!sch.is_last_delivery(u32::MAX));
            assert!(sch.has_delivery_after(u32::MAX));
            assert_eq!(sch.next_step(1_000), Step::RetryAfter(s(5)));
        }
    }

    #[test]
    fn max_deliver_beyond_u32_is_clamped() {
        let sch = host(&[1], i64::MAX);
        assert_eq!(sch.policy().max_deliveries(), Some(u32::MAX));
    }

    #[test]
    fn time_to_dead_letter_of_the_default_policy() {
        let sch = RetryPolicy::default().schedule(Redelivery::Host);
        assert_eq!(sch.time_to_dead_letter(), Some(s(1 + 5 + 30 + 30)));
    }

    #[test]
    fn table_lists_delays_cumulative_time_and_roles() {
        let sch = jetstream(&[1, 5, 30], 5, None);
        let rows = sch.table(100);
        assert_eq!(rows.len(), 5);
        let got: Vec<(u32, u64, u64, Role)> = rows
            .iter()
            .map(|r| (r.delivery, r.delay_before.as_secs(), r.since_first.as_secs(), r.role))
            .collect();
        assert_eq!(
            got,
            vec![
                (1, 0, 0, Role::Handler),
                (2, 1, 1, Role::Handler),
                (3, 5, 6, Role::Handler),
                (4, 30, 36, Role::LastHandler),
                (5, 30, 66, Role::CaptureRetry),
            ]
        );
        assert_eq!(sch.table(2).len(), 2);
        let unlimited = host(&[1, 5, 30], 0).table(5);
        assert_eq!(unlimited.len(), 5);
        assert!(unlimited.iter().all(|r| r.role == Role::Handler));
    }

    // ---- checks ----

    #[test]
    fn a_sound_policy_has_no_violation() {
        let r = host(&[1, 5, 30], 5).check(&ctx());
        assert_eq!(r, Report::default());
        let r = jetstream(&[1, 5, 30], 5, Some(1)).check(&ctx());
        assert_eq!(r, Report::default());
    }

    #[test]
    fn ladder_longer_than_max_deliver_is_an_error_and_equal_is_fine() {
        let r = host(&[1, 5, 30], 2).check(&ctx());
        assert_eq!(keys(&r.errors), ["topology[0].retry.ladder"]);
        assert!(r.errors[0].message.contains("at most 2 rungs"), "{}", r.errors[0]);
        assert!(r.errors[0].message.contains("max_deliver >= 3"), "{}", r.errors[0]);
        assert!(host(&[1, 5, 30], 3).check(&ctx()).is_ok());
        assert!(host(&[1, 5, 30], 4).check(&ctx()).is_ok());
        // unlimited allows any ladder
        assert!(host(&[1, 5, 30], 0).check(&ctx()).is_ok());
        assert!(host(&[1, 5, 30], -1).check(&ctx()).is_ok());
    }

    #[test]
    fn on_jetstream_a_ladder_as_long_as_max_deliver_is_an_error() {
        // nats-server 2.9: error 10116 "max deliver is required to be > length of backoff values"
        let r = jetstream(&[1, 2, 3], 3, None).check(&ctx());
        assert_eq!(keys(&r.errors), ["topology[0].retry.ladder"]);
        assert!(r.errors[0].message.contains("10116"), "{}", r.errors[0]);
        assert!(r.errors[0].message.contains("max_deliver >= 4"), "{}", r.errors[0]);
        assert!(jetstream(&[1, 2, 3], 4, None).check(&ctx()).is_ok());
        assert!(jetstream(&[1, 2, 3], 0, None).check(&ctx()).is_ok());
        // the same policy stays valid where the host serves the ladder
        assert!(host(&[1, 2, 3], 3).check(&ctx()).is_ok());
    }

    #[test]
    fn zero_rung_is_an_error_naming_the_rung() {
        let r = host(&[1, 0, 30], 5).check(&ctx());
        assert_eq!(keys(&r.errors), ["topology[0].retry.ladder[1]"]);
        assert!(r.errors[0].message.contains("positive duration"));
        let r = RetryPolicy::new(vec![Duration::from_millis(1)], 5)
            .schedule(Redelivery::Host)
            .check(&ctx());
        assert!(r.is_ok());
    }

    #[test]
    fn ack_wait_different_from_first_rung_is_a_warning() {
        let r = jetstream(&[1, 5], 5, Some(30)).check(&ctx());
        assert!(r.is_ok());
        assert_eq!(keys(&r.warnings), ["topology[0].retry.ladder[0]"]);
        assert!(r.warnings[0].message.contains("AckWait is 30s"), "{}", r.warnings[0]);
        assert!(jetstream(&[1, 5], 5, Some(1)).check(&ctx()).warnings.is_empty());
        // unknown AckWait, or no ladder (AckWait is the delay): nothing to normalise
        assert!(jetstream(&[1, 5], 5, None).check(&ctx()).warnings.is_empty());
        assert!(jetstream(&[], 5, Some(30)).check(&ctx()).warnings.is_empty());
    }

    #[test]
    fn outliving_the_stream_max_age_is_an_error_at_the_boundary() {
        // jetstream [1,5,30] max 5: last delivery at 66s.
        let sch = jetstream(&[1, 5, 30], 5, None);
        let mut c = ctx();
        c.stream_max_age = Some(s(67));
        assert!(sch.check(&c).is_ok());
        c.stream_max_age = Some(s(66));
        let r = sch.check(&c);
        assert_eq!(keys(&r.errors), ["topology[0].retry"]);
        assert!(r.errors[0].message.contains("max_age = 1m 6s"), "{}", r.errors[0]);
        assert!(r.errors[0].message.contains("silent loss"));
        c.stream_max_age = Some(s(10));
        assert!(!sch.check(&c).is_ok());
        // zero or absent max_age is unlimited retention
        c.stream_max_age = Some(Duration::ZERO);
        assert!(sch.check(&c).is_ok());
        c.stream_max_age = None;
        assert!(sch.check(&c).is_ok());
    }

    #[test]
    fn exceeding_max_time_to_dead_letter_is_an_error_at_the_boundary() {
        let policy = RetryPolicy::new(ladder(&[1, 5, 30]), 5); // 66s on host
        let ok = policy
            .clone()
            .with_max_time_to_dead_letter(s(66))
            .schedule(Redelivery::Host);
        assert!(ok.check(&ctx()).is_ok());
        let bad = policy.with_max_time_to_dead_letter(s(65)).schedule(Redelivery::Host);
        let r = bad.check(&ctx());
        assert_eq!(keys(&r.errors), ["topology[0].retry.max_time_to_dead_letter"]);
        assert!(
            r.errors[0].message.contains("max_time_to_dead_letter >= 1m 6s"),
            "{}",
            r.errors[0]
        );
    }

    #[test]
    fn unlimited_skips_duration_checks_with_warnings_only() {
        let sch = RetryPolicy::new(ladder(&[1, 5, 30]), 0)
            .with_max_time_to_dead_letter(s(1))
            .schedule(Redelivery::JETSTREAM);
        let mut c = ctx();
        c.stream_max_age = Some(s(2));
        let r = sch.check(&c);
        assert!(r.is_ok(), "{r:?}");
        assert_eq!(
            keys(&r.warnings),
            [
                "topology[0].retry.max_time_to_dead_letter",
                "topology[0].retry.max_deliver"
            ]
        );
    }

    #[test]
    fn empty_ladder_on_host_is_a_warning() {
        let r = host(&[], 5).check(&ctx());
        assert!(r.is_ok());
        assert_eq!(keys(&r.warnings), ["topology[0].retry.ladder"]);
        assert!(jetstream(&[], 5, None).check(&ctx()).warnings.is_empty());
    }

    #[test]
    fn no_capture_reserve_left_is_a_warning() {
        // (no ladder: a one-rung ladder with max_deliver = 1 is refused by the server, error 10116)
        let r = jetstream(&[], 1, None).check(&ctx());
        assert!(r.is_ok());
        assert_eq!(keys(&r.warnings), ["topology[0].retry.max_deliver"]);
        assert!(r.warnings[0].message.contains("max_deliver >= 2"));
        assert!(jetstream(&[1], 2, None).check(&ctx()).warnings.is_empty());
    }

    #[test]
    fn the_default_policy_is_never_rejected() {
        let policy = RetryPolicy::default();
        assert_eq!(policy.origin, Origin::Default);
        for redelivery in [
            Redelivery::Host,
            Redelivery::JETSTREAM,
            Redelivery::JetStream {
                ack_wait: Some(s(30)),
                capture_reserve: 1,
            },
        ] {
            for age in [None, Some(Duration::ZERO), Some(s(1)), Some(s(66)), Some(s(3600))] {
                let c = CheckContext {
                    key: "topology[3].retry".into(),
                    stream_max_age: age,
                };
                let r = policy.schedule(redelivery).check(&c);
                assert!(r.is_ok(), "{redelivery:?} {age:?}: {r:?}");
            }
        }
        // the demoted error is still reported, as a warning that says why
        let c = CheckContext {
            key: "topology[3].retry".into(),
            stream_max_age: Some(s(5)),
        };
        let r = policy.schedule(Redelivery::JETSTREAM).check(&c);
        assert_eq!(keys(&r.warnings), ["topology[3].retry"]);
        assert!(r.warnings[0].message.contains("no [topology.retry] section"));
    }

    #[test]
    fn violations_display_key_then_message() {
        let v = Violation {
            key: "topology[0].retry.ladder".into(),
            message: "bad".into(),
        };
        assert_eq!(v.to_string(), "topology[0].retry.ladder: bad");
    }

    proptest! {
        #[test]
        fn cumulative_time_is_monotonic_and_the_sum_of_delays(
            rungs in proptest::collection::vec(0u64..100_000, 0..8),
            js in any::<bool>(),
            ack_wait in 1u64..1000,
            upto in 1u32..64,
        ) {
            let policy = RetryPolicy::new(rungs.iter().map(|ms| Duration::from_millis(*ms)).collect(), 0);
            let redelivery = if js {
                Redelivery::JetStream { ack_wait: Some(Duration::from_millis(ack_wait)), capture_reserve: 1 }
            } else {
                Redelivery::Host
            };
            let sch = policy.schedule(redelivery);
            let mut sum = Duration::ZERO;
            let mut previous = Duration::ZERO;
            for n in 1..=upto {
                if let Some(d) = sch.delay_before(n) {
                    sum += d;
                }
                let cumulative = sch.since_first(n);
                prop_assert_eq!(cumulative, sum, "delivery {}", n);
                prop_assert!(cumulative >= previous);
                previous = cumulative;
            }
        }

        #[test]
        fn table_agrees_with_the_point_functions(
            rungs in proptest::collection::vec(1u64..1000, 0..6),
            max in 1i64..20,
        ) {
            let sch = RetryPolicy::new(rungs.iter().map(|x| Duration::from_secs(*x)).collect(), max)
                .schedule(Redelivery::JETSTREAM);
            let rows = sch.table(u32::MAX);
            prop_assert_eq!(rows.len() as i64, max);
            let last = rows.last().map(|r| r.since_first);
            prop_assert_eq!(last, sch.retention_needed());
            for r in &rows {
                prop_assert_eq!(r.since_first, sch.since_first(r.delivery));
            }
        }
    }
}
