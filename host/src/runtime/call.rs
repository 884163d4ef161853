//! What a call returns: the guest's answer with what it published, or a [`Fault`].

use super::host::Outgoing;
use crate::bindings::weir::handler::types::Failure;

/// What went wrong in a call, beyond the guest's own answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The guest trapped (panic, unreachable, stack overflow, bad access).
    Trap,
    /// The guest exceeded its memory limit (and then trapped).
    MemoryLimit,
    /// The call ran past the handler's timeout and was interrupted.
    Timeout,
    /// The host interrupted the call (ownership lost, shutdown).
    Cancelled,
    /// A fresh instance could not be made.
    Instantiate,
}

impl FaultKind {
    /// Its name in traces: `trap`, `memory-limit`, `timeout`, `cancelled`, `instantiate`.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Trap => "trap",
            FaultKind::MemoryLimit => "memory-limit",
            FaultKind::Timeout => "timeout",
            FaultKind::Cancelled => "cancelled",
            FaultKind::Instantiate => "instantiate",
        }
    }
}

/// A call that did not produce the guest's answer.
#[derive(Debug, Clone)]
pub struct Fault {
    /// The class of fault.
    pub kind: FaultKind,
    /// Human-readable detail (the trap message).
    pub detail: String,
}

/// The detail of a call the host refused before it began (a fence, a drain).
const NOT_STARTED: &str = "cancelled by the host before the call started";

impl Fault {
    /// A call the host refused before it began: its runner was fenced, or
    /// is draining. Never a failure of the guest.
    pub fn not_started() -> Self {
        Self {
            kind: FaultKind::Cancelled,
            detail: NOT_STARTED.to_owned(),
        }
    }

    /// Whether this is [`Fault::not_started`].
    pub fn is_not_started(&self) -> bool {
        self.kind == FaultKind::Cancelled && self.detail == NOT_STARTED
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.kind {
            FaultKind::Trap => "handler trapped",
            FaultKind::MemoryLimit => "handler exceeded its memory limit",
            FaultKind::Timeout => "handler timed out",
            FaultKind::Cancelled => "call cancelled by the host",
            FaultKind::Instantiate => "handler could not be instantiated",
        };
        write!(f, "{what}: {}", self.detail)
    }
}

/// The result of handing one message to `handle`.
#[derive(Debug)]
pub enum CallOutcome {
    /// The guest answered. Messages it published are in `published` (only
    /// when it answered `Ok`; a failed call's publishes are dropped).
    Done {
        /// The guest's answer.
        result: Result<(), Failure>,
        /// Cascaded messages to publish before acknowledging.
        published: Vec<Outgoing>,
    },
    /// No answer: treat as `retry`.
    Fault(Fault),
}

/// The result of one `handle-batch` call.
#[derive(Debug)]
pub enum BatchOutcome {
    /// One answer per message, in order, and what the call published.
    Done {
        /// Answers, same order as the batch.
        results: Vec<Result<(), Failure>>,
        /// Each member's cascades (`begin-member`), same order as the batch;
        /// empty for a member that did not answer `Ok`.
        published: Vec<Vec<Outgoing>>,
        /// Cascades published before the call named a member (every publish
        /// of a 0.1.0 component): they belong to the whole batch, so they may
        /// go out only if every member succeeded.
        unattributed: Vec<Outgoing>,
    },
    /// No answers: replay members one by one.
    Fault(Fault),
}
