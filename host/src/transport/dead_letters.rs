//! Reading and removing what sits on a topology's dead-letter destination:
//! the broker seam of the dead-letter tools ([`crate::deadletter`]). A
//! [`DeadLetterSession`] reads the letters present when it opened, in the
//! destination's order, removes the ones it is told to (each removal
//! confirmed by the broker), and on [`DeadLetterSession::close`] leaves
//! every other letter where it was, in its place. Re-publishing is not
//! here: it goes through [`super::Transport::publish`] like any send.
//!
//! What "reading" costs differs by broker (each implementation says how):
//! JetStream browses the stream by sequence without touching anything; the
//! memory broker copies its list; RabbitMQ, which has no browse, takes the
//! letters as unacknowledged deliveries of an exclusive consumer and gives
//! back the ones it keeps by closing its channel (the broker puts each back
//! in its own place, marked redelivered).

use async_trait::async_trait;

use super::TransportError;
use crate::envelope::Wire;

/// One dead letter as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// Its place on the dead-letter destination, increasing in the
    /// destination's order (the order the letters were captured in):
    /// JetStream, the sequence in `WEIR_T_DLQ` (stable); RabbitMQ, its place
    /// in `weir.T.dead-letter` when read (1 = the head; the places of later
    /// letters move when one before them is removed); memory, the capture's
    /// number (stable).
    pub position: u64,
    /// Every header and the payload, as captured.
    pub wire: Wire,
}

/// An open view of one topology's dead letters (see the module docs).
#[async_trait]
pub trait DeadLetterSession: Send {
    /// How many letters the destination held when the session opened, when
    /// the broker says (for progress).
    fn expected(&self) -> Option<u64>;

    /// The next letter, in the destination's order; `None` once every
    /// letter present when the session opened has been read. Letters
    /// captured since may or may not be read.
    async fn next(&mut self) -> Result<Option<DeadLetter>, TransportError>;

    /// Remove the letter at `position` (read by this session), and return
    /// once the broker confirms it is gone (RabbitMQ: a round trip on the
    /// channel after the ack; JetStream: the delete's reply).
    async fn remove(&mut self, position: u64) -> Result<(), TransportError>;

    /// Remove every letter of `positions` (read by this session), confirmed
    /// once for all of them at the end. A failure part way may leave some
    /// of them in place; none other is touched.
    async fn remove_all(&mut self, positions: &[u64]) -> Result<(), TransportError> {
        for p in positions {
            self.remove(*p).await?;
        }
        Ok(())
    }

    /// End the session: every letter not removed stays, in its place.
    /// Dropping a session without closing it has the same effect, later
    /// (RabbitMQ: when the channel's close reaches the broker).
    async fn close(self: Box<Self>) -> Result<(), TransportError>;
}

/// A broker's dead-letter destinations.
#[async_trait]
pub trait DeadLetterStore: Send + Sync {
    /// Open a session over `topology`'s dead letters. The topology must be
    /// declared on this transport (its destination exists).
    async fn open(&self, topology: &str) -> Result<Box<dyn DeadLetterSession>, TransportError>;

    /// The topologies this transport has declared, with their slot counts
    /// (where a redrive may send letters).
    fn topologies(&self) -> Vec<(String, u32)>;
}
