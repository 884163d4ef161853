//! NATS JetStream (async-nats). Owns the streams and consumers of a topology,
//! the one connection a node keeps (async-nats reconnects it by itself),
//! publishes that wait for the server's `PubAck`, slot and ingress pull
//! consumers (pull requests driven here, [`Puller`]), the in-progress ticker
//! that keeps a slow call from being redelivered mid-call, the ack-floor
//! pollers, the failure counts of retried messages, the one function that
//! turns a [`Disposition`] into acks ([`acker`]), and the dead-letter tools'
//! reads of `WEIR_T_DLQ` ([`dead_letters`]). Slots, lanes and
//! the ladder arithmetic are left to the layers above.
//!
//! Server objects of topology `T` (names fixed by DESIGN.md):
//! - stream `WEIR_T`, file storage, over `weir.T.slot.*` and `weir.T.ingress`
//!   (see "Subjects" below);
//! - a durable pull consumer `weir-T-n` per slot `n`, filter `weir.T.slot.n`,
//!   explicit ack, `MaxDeliver` -1 (unlimited: the host counts failures, see
//!   "Attempts"), no `BackOff`, `AckWait` = the first rung (30 s without a
//!   ladder), `MaxAckPending` = the node's prefetch. Created or updated by the
//!   node that consumes the slot; a differing consumer is updated and the old
//!   and new values are logged;
//! - a durable pull consumer `weir-T-ingress` on `weir.T.ingress`, whose
//!   messages the host forwards to their slot subject (`PubAck`, then ack),
//!   with `MaxAckPending` 1 so that forwarders on several nodes keep the
//!   ingress order (see "Ingress");
//! - stream `WEIR_T_DLQ` over `weir.T.dead-letter`;
//! - key-value bucket `WEIR_T_ATTEMPTS` (stream `KV_WEIR_T_ATTEMPTS`): the
//!   failures of each retried message (see "Attempts").
//!
//! Subjects: DESIGN.md says `WEIR_T` covers `weir.T.>`. nats-server 2.9
//! refuses two streams with overlapping subjects (error 10065, "subjects
//! overlap with an existing stream"), and `weir.T.>` contains
//! `weir.T.dead-letter`, so `WEIR_T_DLQ` could not exist beside it. `WEIR_T`
//! therefore lists the two subjects publishers use, `weir.T.slot.*` and
//! `weir.T.ingress`; every name of the contract is kept. An existing `WEIR_T`
//! over `weir.T.>` is narrowed to these subjects (logged, messages kept).
//!
//! Attempts: every JetStream redelivery counts against the server's delivery
//! count, also one that only returns a message a draining node never started
//! (`Nak`) or one lost on the wire at a handoff. So the server's count is not
//! the message's attempt, and a server-side `MaxDeliver` would drop messages
//! that never failed. The host counts failures itself: a retryable failure
//! (or a failed dead-letter capture) writes the attempt that failed to the
//! bucket under `<slot>.<stream sequence>` (confirmed by the server) and then
//! naks the delivery with the ladder's delay for the next attempt (the
//! server times it; a plain `Nak` would redeliver at once, LESSONS.md). A
//! redelivery (server count above 1) reads the key: attempt = failures + 1;
//! a first delivery reads nothing (a redelivery the server numbers 1, which
//! nats-server 2.9 was seen to do for a message it had sent into an
//! unsubscribed inbox, is then an extra attempt, never a false exhaustion).
//! Releases write nothing, so they are never
//! failures. The host dead-letters by this count ([`crate::retry::schedule`]);
//! the server never gives up on a message. If the bucket cannot be read, the
//! delivery counts as attempt 1 and if it cannot be written the failure is
//! not counted (both logged): a message may get extra attempts, it is never
//! dropped nor falsely `exhausted`. Entries expire after the bucket's
//! `max_age` (at least a week, twice the schedule's retention otherwise).
//!
//! Pulling: the host sends the pull requests itself
//! (`$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`, one open request of
//! short expiry, on an inbox of its own), so it can stop: at a drain,
//! [`Subscription::stop`] sends no more requests, and the subscription ends
//! once the open request has been fulfilled or has expired (the server's
//! 408). Nothing more is delivered into a draining node, nothing sent to it
//! is lost on the way, and no request of it is left on the server when it
//! releases: nats-server 2.9 still delivers into a waiting request whose
//! inbox was unsubscribed (counting a delivery, then requeueing the message
//! out of order), which is why the drain does not simply unsubscribe.
//!
//! Ingress: a message published to the ingress subject is forwarded to its
//! slot by whichever node the server hands it to. With one unacknowledged
//! ingress message at a time (`MaxAckPending` 1), the next is handed out only
//! after the previous one's forward was confirmed and acked, so forwarders on
//! several nodes keep the order of every group (a redelivery after `AckWait`
//! may still reorder, as any redelivery may). That one message stalls every
//! forwarder while its holder lives, so its `AckWait` is short
//! ([`conn::INGRESS_ACK_WAIT`], 5 s) and the holder keeps it with `+WPI`
//! every quarter of it while the forward is in flight: a node that dies
//! holding it (kill -9) stalls the ingress for 5 s, not the 30 s of the
//! slot consumers' default.

pub mod acker;
pub mod conn;
pub mod dead_letters;
pub mod declare;
pub mod floor;
pub mod names;
pub mod pull;
pub mod subscription;
pub mod wire;

use async_trait::async_trait;

pub use conn::{Nats, NatsOptions, connect};

use crate::envelope::Wire;
use crate::transport::{
    ErrorKind, Landed, RetryFacts, RetryOwner, Subscription, TopologySpec, Transport, TransportError,
};
use conn::{REQUEST_TIMEOUT, SYSTEM};
use declare::{ingress_consumer_config, slot_consumer_config};
use floor::FloorState;
use wire::{is_not_found, is_stream_not_found};

#[async_trait]
impl Transport for Nats {
    fn system(&self) -> &'static str {
        SYSTEM
    }

    fn retry_owner(&self) -> RetryOwner {
        RetryOwner::Broker
    }

    async fn declare(&self, spec: &TopologySpec) -> Result<(), TransportError> {
        if let Some(existing) = self.inner.topologies.lock().get(&spec.name)
            && existing.slots != spec.slots
        {
            return Err(TransportError::new(
                ErrorKind::Invalid,
                format!(
                    "topology `{}` is declared with {} slots, not {}",
                    spec.name, existing.slots, spec.slots
                ),
            ));
        }
        let conn = self.conn().await?;
        self.declare_streams(&conn, spec).await?;
        self.inner.topologies.lock().insert(spec.name.clone(), spec.clone());
        tracing::debug!(messaging.system = SYSTEM, topology = %spec.name, slots = spec.slots, "topology declared");
        Ok(())
    }

    async fn subscribe(
        &self,
        topology: &str,
        slot: u32,
        prefetch: u32,
    ) -> Result<Box<dyn Subscription>, TransportError> {
        let spec = self.spec(topology)?;
        if slot >= spec.slots {
            return Err(TransportError::new(
                ErrorKind::Invalid,
                format!(
                    "slot {slot} does not exist in topology `{topology}` ({} slots)",
                    spec.slots
                ),
            ));
        }
        let desired = slot_consumer_config(&spec, slot, prefetch);
        self.subscribe_consumer(&spec, desired, Some(slot), prefetch).await
    }

    async fn subscribe_ingress(
        &self,
        topology: &str,
        prefetch: u32,
    ) -> Result<Option<Box<dyn Subscription>>, TransportError> {
        let spec = self.spec(topology)?;
        let _ = prefetch;
        let desired = ingress_consumer_config(topology, self.inner.options.ingress_ack_wait);
        self.subscribe_consumer(&spec, desired, None, 1).await.map(Some)
    }

    async fn publish(&self, topology: &str, slot: u32, wire: Wire) -> Result<(), TransportError> {
        self.check_slot(topology, slot)?;
        let subject = names::slot_subject(topology, slot);
        let target = format!("subject {subject} (stream {})", names::stream(topology));
        self.publish_to(subject, wire, &target, false, None).await.map(drop)
    }

    async fn publish_cascade(&self, topology: &str, slot: u32, wire: Wire, id: &str) -> Result<Landed, TransportError> {
        self.check_slot(topology, slot)?;
        let subject = names::slot_subject(topology, slot);
        let target = format!("subject {subject} (stream {})", names::stream(topology));
        let id = self.inner.options.cascade_msg_ids.then_some(id);
        self.publish_to(subject, wire, &target, false, id).await
    }

    async fn publish_dead_letter(&self, topology: &str, wire: Wire) -> Result<(), TransportError> {
        let subject = names::dead_letter(topology);
        let target = format!(
            "dead-letter subject {subject} (stream {})",
            names::dead_letter_stream(topology)
        );
        self.publish_to(subject, wire, &target, true, None).await.map(drop)
    }

    async fn retry_facts(&self, topology: &str) -> Result<Option<RetryFacts>, TransportError> {
        let conn = self.conn().await?;
        let name = names::stream(topology);
        let stream = match conn.js.get_stream(&name).await {
            Ok(s) => s,
            Err(e) if is_stream_not_found(&e) => return Ok(Some(RetryFacts::default())),
            Err(e) => {
                return Err(TransportError::new(
                    ErrorKind::Connection,
                    format!("reading stream {name}: {e}"),
                ));
            }
        };
        let max_age = Some(stream.cached_info().config.max_age).filter(|a| !a.is_zero());
        let consumer = names::slot_consumer(topology, 0);
        let ack_wait = match conn
            .js
            .get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(&consumer, &name)
            .await
        {
            Ok(c) => Some(c.cached_info().config.ack_wait),
            Err(e) if is_not_found(&e) => None,
            Err(e) => {
                return Err(TransportError::new(
                    ErrorKind::Connection,
                    format!("reading consumer {consumer} of stream {name}: {e}"),
                ));
            }
        };
        Ok(Some(RetryFacts {
            stream_max_age: max_age,
            ack_wait,
        }))
    }

    async fn backlog(&self, topology: &str, slot: u32) -> Result<Option<u64>, TransportError> {
        let conn = self.conn().await?;
        let (stream, consumer) = (names::stream(topology), names::slot_consumer(topology, slot));
        match conn
            .js
            .get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(&consumer, &stream)
            .await
        {
            Ok(c) => Ok(Some(c.cached_info().num_pending)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(TransportError::new(
                ErrorKind::Connection,
                format!("reading consumer {consumer} of stream {stream}: {e}"),
            )),
        }
    }

    async fn consumers(&self, topology: &str, slot: u32) -> Result<Option<u32>, TransportError> {
        let conn = self.conn().await?;
        let (stream, consumer) = (names::stream(topology), names::slot_consumer(topology, slot));
        match conn
            .js
            .get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(&consumer, &stream)
            .await
        {
            Ok(c) => Ok(Some(u32::try_from(c.cached_info().num_waiting).unwrap_or(u32::MAX))),
            Err(e) if is_not_found(&e) => Ok(Some(0)),
            Err(e) => Err(TransportError::new(
                ErrorKind::Connection,
                format!("reading consumer {consumer} of stream {stream}: {e}"),
            )),
        }
    }

    fn ack_floor(&self) -> Vec<FloorState> {
        self.inner.floor.snapshot()
    }

    fn dead_letters(&self) -> Option<&dyn crate::transport::dead_letters::DeadLetterStore> {
        Some(self)
    }

    /// Acks and naks are published without an answer, so when the node
    /// stops they may still sit in the client's buffer, or in a socket or a
    /// network that stalls: flush the connection, then wait for the answer
    /// to a request sent after them (the server reads a connection in
    /// order, so once it answers it has every ack). Bounded: see
    /// [`crate::transport::confirm_acks`].
    async fn close(&self) {
        let conn = self.inner.conn.lock().await.clone();
        let Some(conn) = conn else { return };
        if crate::transport::unconfirmed_acks() {
            if let Err(e) = tokio::time::timeout(REQUEST_TIMEOUT, conn.client.flush())
                .await
                .map_err(|_| "timed out".to_owned())
                .and_then(|r| r.map_err(|e| e.to_string()))
            {
                tracing::warn!(messaging.system = SYSTEM, error = %e, "flushing the connection at shutdown failed; acks not yet sent are redelivered");
            }
            return;
        }
        let confirm = async {
            conn.client.flush().await.map_err(|e| format!("flushing: {e}"))?;
            conn.js
                .query_account()
                .await
                .map(drop)
                .map_err(|e| format!("the round trip after the acks ($JS.API.INFO): {e}"))
        };
        crate::transport::confirm_acks(SYSTEM, "every ack and release of this connection", confirm).await;
    }
}

impl Nats {
    /// An error naming the slot when `topology` is declared here without it.
    fn check_slot(&self, topology: &str, slot: u32) -> Result<(), TransportError> {
        let slots = self.inner.topologies.lock().get(topology).map(|t| t.slots);
        match slots {
            Some(slots) if slot >= slots => Err(TransportError::new(
                ErrorKind::Invalid,
                format!("slot {slot} does not exist in topology `{topology}` ({slots} slots)"),
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use async_nats::Subject;
    use async_nats::jetstream::consumer::AckPolicy;
    use bytes::Bytes;

    use super::acker::Progress;
    use super::declare::default_warn_after;
    use super::wire::{headers_of, wire_of};
    use super::*;
    use crate::envelope::header;
    use crate::retry::schedule::{NATS_DEFAULT_ACK_WAIT, RetryPolicy};

    #[test]
    fn names_follow_the_contract() {
        assert_eq!(names::stream("orders"), "WEIR_orders");
        assert_eq!(names::slot_subject("orders", 3), "weir.orders.slot.3");
        assert_eq!(names::slot_consumer("orders", 3), "weir-orders-3");
        assert_eq!(names::ingress("orders"), "weir.orders.ingress");
        assert_eq!(names::dead_letter("orders"), "weir.orders.dead-letter");
        assert_eq!(names::dead_letter_stream("orders"), "WEIR_orders_DLQ");
        // the work stream does not cover the dead-letter subject (module docs)
        assert!(!names::stream_subjects("orders").iter().any(|s| s.ends_with('>')));
    }

    /// The duplicate window covers the ladder up to the handler's last try,
    /// plus a call's time per try; never below the server's default; capped
    /// at `max_age` (the server refuses more).
    #[test]
    fn the_duplicate_window_covers_the_retry_ladder() {
        use super::declare::duplicate_window;
        let s = |secs: u64| Duration::from_secs(secs);
        let mut spec = TopologySpec::new("t", 1);
        // The default ladder (1 s, 5 s, 30 s; 5 deliveries, 4 for the
        // handler): 1 + 5 + 30 s to the last try, plus 4 × 30 s.
        assert_eq!(duplicate_window(&spec, Duration::ZERO), s(36 + 120));
        spec.retry = RetryPolicy::new(vec![s(60), s(600)], 6);
        // 60 + 600 + 600 + 600 s to the 5th delivery, plus 5 × 30 s.
        assert_eq!(duplicate_window(&spec, Duration::ZERO), s(1860 + 150));
        assert_eq!(duplicate_window(&spec, s(900)), s(900), "capped at max_age");
        spec.retry = RetryPolicy::new(vec![s(1)], 2);
        assert_eq!(
            duplicate_window(&spec, Duration::ZERO),
            s(120),
            "never below the server's default"
        );
        spec.retry = RetryPolicy::new(vec![s(1)], 0);
        assert_eq!(
            duplicate_window(&spec, Duration::ZERO),
            s(24 * 3600),
            "unlimited deliveries"
        );
    }

    #[test]
    fn slot_consumer_leaves_the_ladder_to_the_host() {
        let mut spec = TopologySpec::new("t", 2);
        spec.retry = RetryPolicy::new(vec![Duration::from_secs(1), Duration::from_secs(2)], 4);
        let c = slot_consumer_config(&spec, 1, 64);
        assert_eq!(c.durable_name.as_deref(), Some("weir-t-1"));
        assert_eq!(c.filter_subject, "weir.t.slot.1");
        assert_eq!(c.ack_wait, Duration::from_secs(1));
        // The host counts failures and times retries: the server never gives up.
        assert_eq!(c.max_deliver, -1);
        assert!(c.backoff.is_empty());
        assert_eq!(c.max_ack_pending, 64);
        assert_eq!(c.ack_policy, AckPolicy::Explicit);
        spec.retry = RetryPolicy::new(vec![Duration::from_secs(1)], 0);
        assert_eq!(slot_consumer_config(&spec, 0, 1).max_deliver, -1);
        spec.retry = RetryPolicy::new(vec![], 0);
        let c = slot_consumer_config(&spec, 0, 0);
        assert_eq!(c.ack_wait, NATS_DEFAULT_ACK_WAIT);
        assert_eq!(c.max_deliver, -1);
        assert_eq!(c.max_ack_pending, 1);
    }

    #[test]
    fn headers_round_trip() {
        let wire = Wire {
            headers: vec![
                (header::MESSAGE_ID.into(), "m-1".into()),
                (header::MESSAGE_TYPE.into(), "ok".into()),
            ],
            body: b"x".to_vec(),
        };
        let h = headers_of(&wire).unwrap();
        let back = wire_of(Some(&h), Bytes::from_static(b"x"));
        assert_eq!(back.header(header::MESSAGE_ID), Some("m-1"));
        assert_eq!(back.header(header::MESSAGE_TYPE), Some("ok"));
        assert_eq!(back.body, b"x");
    }

    #[test]
    fn floor_warning_waits_for_the_ladder() {
        let mut spec = TopologySpec::new("t", 1);
        spec.retry = RetryPolicy::new(vec![Duration::from_secs(10), Duration::from_secs(100)], 4);
        // last delivery at 10 + 100 + 100 = 210s, plus AckWait 10s
        assert_eq!(default_warn_after(&spec), Duration::from_secs(220));
        spec.retry = RetryPolicy::new(vec![Duration::from_secs(1)], 2);
        assert_eq!(default_warn_after(&spec), Duration::from_secs(60));
    }

    #[test]
    fn progress_reports_only_deliveries_held_long_enough() {
        let p = Progress::default();
        let a = p.track(Subject::from("a"));
        assert!(p.due(Duration::from_secs(60)).is_empty());
        assert_eq!(p.due(Duration::ZERO).len(), 1);
        p.untrack(a);
        assert!(p.due(Duration::ZERO).is_empty());
    }
}
