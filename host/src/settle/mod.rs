//! Settlement: turn a call's outcome into exactly one broker action. A
//! success publishes its cascades ([`cascades`]) and acks; `retry` climbs the
//! ladder ([`crate::retry::schedule`]) until it is exhausted; `reject`, an
//! exhausted ladder, a trap or a timeout is captured on the dead-letter
//! destination first and acked only then ([`capture`]). Every settlement is
//! counted and told to the observer.
//!
//! The files: [`decide`] (an outcome → ack, retry or capture), [`cascades`]
//! and [`capture`]; this one holds what they are given ([`Sink`], [`Slot`],
//! [`Pending`]).

pub mod capture;
pub mod cascades;
pub mod decide;

use std::sync::Arc;

use crate::observe::stats::{OutcomeCounters, Stats};
use crate::outcome::{Outcome, SettleObserver};
use crate::retry::schedule::Schedule;
use crate::runtime::HandlerVersion;
use crate::transport::{Acker, Transport};

/// Where settlements go: the broker, the counters, the observer.
#[derive(Clone, Copy)]
pub struct Sink<'a> {
    /// The broker.
    pub transport: &'a dyn Transport,
    /// Outcome counters.
    pub stats: &'a Stats,
    /// Told the outcome of every settled message (ledgers, tests).
    pub observer: Option<&'a dyn SettleObserver>,
    /// Where `handler.dedup` records what was handled.
    pub dedup: Option<&'a dyn crate::dedup::Store>,
    /// Seals the retries this node sends back to a slot.
    pub seal: &'a crate::seal::Seal,
}

impl Sink<'_> {
    /// Count `outcome` and tell the observer.
    pub fn record(&self, id: &str, outcome: Outcome) {
        self.stats.record(outcome);
        if let Some(o) = self.observer {
            o.settled(id, outcome);
        }
    }
}

/// One slot's side of settling: where its cascades and dead letters go,
/// its retry ladder, its counters.
#[derive(Clone, Copy)]
pub struct Slot<'a> {
    /// Where settlements go.
    pub sink: Sink<'a>,
    /// Topology name.
    pub topology: &'a str,
    /// Slots in the topology (for cascades).
    pub slots: u32,
    /// The retry ladder as this broker serves it.
    pub schedule: &'a Schedule,
    /// Outcomes of this slot's messages (`weir_slot_messages_total`).
    pub counters: &'a OutcomeCounters,
}

impl Slot<'_> {
    /// [`Sink::record`], also counted for the slot and the handler.
    pub fn record(&self, handler: Option<&HandlerVersion>, id: &str, outcome: Outcome) {
        self.sink.record(id, outcome);
        self.counters.record(outcome);
        if let Some(h) = handler {
            h.settings.metrics.outcomes.record(outcome);
            if h.tallying.load(std::sync::atomic::Ordering::Relaxed) {
                h.tally.outcomes.record(outcome);
                h.failed.note(id, outcome);
            }
        }
    }
}

/// What settling an admitted delivery needs besides its message.
pub struct Pending {
    /// Settles the delivery on the broker.
    pub acker: Box<dyn Acker>,
    /// Queue or subject it was consumed from.
    pub source: Arc<str>,
    /// Broker position.
    pub tag: u64,
    /// The handler version it was routed to.
    pub handler: Arc<HandlerVersion>,
    /// Its `weir.receive` span, when traces are on ([`crate::telemetry`]).
    pub trace: Option<Box<crate::telemetry::Received>>,
}
