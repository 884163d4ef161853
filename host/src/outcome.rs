//! How a delivery ended ([`Outcome`], with the dead-letter [`Reason`]) and
//! who is told ([`SettleObserver`]). A leaf: settlement, the counters, the
//! ledgers and the tests all speak these words, and it imports nothing.

/// Why a message was dead-lettered (`weir-dead-letter-reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The handler answered `reject`.
    Rejected,
    /// Retryable failures used up every delivery.
    Exhausted,
    /// The message could not be decoded (headers missing or invalid).
    Undecodable,
    /// No handler is bound to its (tenant, message type).
    NoHandler,
    /// The last delivery ran past the handler's timeout.
    Timeout,
    /// The last delivery trapped.
    Trap,
    /// Its group was parked (`on_failure = "park"`) and held as many
    /// messages as `topology.park_hold` allows.
    ParkOverflow,
    /// The head of a parked group an operator skipped (`weir groups skip`).
    Skipped,
}

impl Reason {
    /// Every reason, in a fixed order.
    pub const ALL: [Reason; 8] = [
        Reason::Rejected,
        Reason::Exhausted,
        Reason::Undecodable,
        Reason::NoHandler,
        Reason::Timeout,
        Reason::Trap,
        Reason::ParkOverflow,
        Reason::Skipped,
    ];

    /// The header value.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Rejected => "rejected",
            Reason::Exhausted => "exhausted",
            Reason::Undecodable => "undecodable",
            Reason::NoHandler => "no-handler",
            Reason::Timeout => "timeout",
            Reason::Trap => "trap",
            Reason::ParkOverflow => "park-overflow",
            Reason::Skipped => "skipped",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a delivery was settled. Each is counted and logged distinctly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Handler succeeded, cascades confirmed, acknowledged.
    Handled,
    /// Back onto the retry ladder.
    RetryScheduled,
    /// Captured on the dead-letter destination (confirmed) and acknowledged.
    DeadLettered(Reason),
    /// The capture failed and no delivery is left: provably nothing reached
    /// the dead-letter destination.
    Stranded,
    /// The capture was confirmed but the ack's confirmation was lost: the
    /// ack may have landed, and the message may be delivered once more.
    Uncertain,
    /// The capture failed; the message went back to its queue for another try.
    Requeued,
    /// Returned unprocessed (drain, handoff, shutdown).
    Released,
    /// Already handled (`handler.dedup` had a record of it): acknowledged
    /// without a call.
    Deduplicated,
}

impl Outcome {
    /// Its name in traces: `ack`, `retry`, `dead-letter`, `stranded`,
    /// `uncertain`, `requeued`, `release`, `dedup-ack`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Handled => "ack",
            Outcome::RetryScheduled => "retry",
            Outcome::DeadLettered(_) => "dead-letter",
            Outcome::Stranded => "stranded",
            Outcome::Uncertain => "uncertain",
            Outcome::Requeued => "requeued",
            Outcome::Released => "release",
            Outcome::Deduplicated => "dedup-ack",
        }
    }
}

/// Told how each message was settled.
pub trait SettleObserver: Send + Sync {
    /// `id` was settled with `outcome`.
    fn settled(&self, id: &str, outcome: Outcome);

    /// Why `id` failed, right before its [`SettleObserver::settled`], when
    /// the failure was put on the ladder (`retry_in`: the delay before the
    /// next delivery, when the host times it) or dead-lettered (`None`):
    /// the handler's or the host's error text. Only failures pay for it.
    fn failed(&self, _id: &str, _error: &str, _retry_in: Option<std::time::Duration>) {}
}
