//! Settling a JetStream delivery: the one function that turns a
//! [`Disposition`] into acks ([`NatsAcker::settle`]), the failure counts of
//! retried messages, and the in-progress ticker that keeps a slow call from
//! being redelivered mid-call.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::Subject;
use async_nats::jetstream::{self, AckKind, kv};
use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;

use super::conn::SYSTEM;
use super::names;
use crate::envelope::header;
use crate::retry::schedule::NATS_DEFAULT_ACK_WAIT;
use crate::transport::{Acker, Disposition, ErrorKind, TransportError};

/// Deliveries in flight on one subscription, kept alive with `+WPI` by the
/// ticker until they are settled (or dropped unsettled).
#[derive(Default)]
pub(super) struct Progress {
    pub(super) inflight: Mutex<HashMap<u64, (Subject, Instant), nohash_hasher::BuildNoHashHasher<u64>>>,
    pub(super) next: AtomicU64,
}

impl Progress {
    pub(super) fn track(&self, reply: Subject) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.inflight.lock().insert(id, (reply, Instant::now()));
        id
    }

    pub(super) fn untrack(&self, id: u64) {
        self.inflight.lock().remove(&id);
    }

    /// The deliveries held for at least `period` since their last sign of
    /// life; their clocks restart now.
    pub(super) fn due(&self, period: Duration) -> Vec<Subject> {
        let now = Instant::now();
        let mut due = Vec::new();
        for (reply, since) in self.inflight.lock().values_mut() {
            if now.saturating_duration_since(*since) >= period {
                *since = now;
                due.push(reply.clone());
            }
        }
        due
    }
}

/// Every `period` (a quarter of `AckWait`), tell the server that each
/// delivery held longer than that is still being worked on (`+WPI`), so a
/// slow call, or a message queued behind its group's lane, is not redelivered
/// while this node still holds it. Settling a delivery stops it.
pub(super) async fn progress_ticker(client: async_nats::Client, progress: Arc<Progress>, period: Duration) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        for reply in progress.due(period) {
            let body: Bytes = AckKind::Progress.into();
            if let Err(e) = client.publish(reply, body).await {
                tracing::debug!(messaging.system = SYSTEM, error = %e, "in-progress signal not sent");
            }
        }
    }
}

/// What a subscription's ackers share.
pub(super) struct Shared {
    pub(super) topology: Arc<str>,
    /// `None` for the ingress.
    pub(super) slot: Option<u32>,
    pub(super) subject: Arc<str>,
    pub(super) stream: Arc<str>,
    pub(super) consumer: Arc<str>,
    /// The failure-count bucket (slots only).
    pub(super) attempts: Option<kv::Store>,
    /// The ladder, for the delay of a deferred capture.
    pub(super) schedule: crate::retry::schedule::Schedule,
    pub(super) progress: Arc<Progress>,
}

/// Settles one JetStream delivery.
pub(super) struct NatsAcker {
    pub(super) acker: jetstream::message::Acker,
    pub(super) shared: Arc<Shared>,
    /// Its entry in the in-progress ticker.
    pub(super) track: Option<u64>,
    pub(super) sequence: u64,
    pub(super) delivered: u32,
    /// The host's attempt: failures so far + 1 (module docs, "Attempts").
    pub(super) attempt: u32,
}

impl Drop for NatsAcker {
    fn drop(&mut self) {
        // Settled or not: the ticker stops vouching for it.
        if let Some(id) = self.track.take() {
            self.shared.progress.untrack(id);
        }
    }
}

impl NatsAcker {
    /// The retry path on JetStream: count this attempt as failed (confirmed
    /// by the server before anything else), then `Nak` with the ladder's
    /// delay, which the server waits before it redelivers. A plain `Nak`
    /// would redeliver at once and burn the ladder in milliseconds
    /// (LESSONS.md); the gaps are pinned by
    /// `nats_compliance::retry_gaps_follow_the_backoff`. If the count cannot
    /// be written the failure is not counted (an extra attempt, logged); if
    /// the `Nak` cannot be sent the server redelivers after `AckWait`.
    async fn fail(mut self: Box<Self>, delay: Duration) -> Result<(), TransportError> {
        if let Some(id) = self.track.take() {
            self.shared.progress.untrack(id);
        }
        let s = &self.shared;
        if let (Some(kv), Some(slot)) = (&s.attempts, s.slot) {
            let key = names::attempts_key(slot, self.sequence);
            if let Err(e) = kv.put(key.as_str(), Bytes::from(self.attempt.to_string())).await {
                tracing::warn!(
                    messaging.system = SYSTEM, topology = %s.topology, slot, sequence = self.sequence,
                    attempt = self.attempt, error = %e,
                    "failure count not written; the next delivery repeats this attempt"
                );
            }
        }
        self.acker
            .ack_with(AckKind::Nak(Some(delay)))
            .await
            .map_err(|e| self.err("delayed nak", &e))
    }

    fn err(&self, what: &str, e: &async_nats::Error) -> TransportError {
        TransportError::new(
            ErrorKind::Connection,
            format!(
                "{what} of stream sequence {} on consumer {}: {e}; the server redelivers it",
                self.sequence, self.shared.consumer
            ),
        )
    }
}

#[async_trait]
impl Acker for NatsAcker {
    async fn settle(self: Box<Self>, disposition: Disposition) -> Result<(), TransportError> {
        match disposition {
            Disposition::Ack => self.acker.ack().await.map_err(|e| self.err("ack", &e)),
            Disposition::AckCaptured => self.acker.double_ack().await.map_err(|e| {
                TransportError::new(
                    ErrorKind::Timeout,
                    format!(
                        "ack of stream sequence {seq} on consumer {c} (stream {s}) was not confirmed: {e}. \
                         It may have landed: check whether the consumer's ack floor passed stream sequence {seq} \
                         (`nats consumer info {s} {c}`); if not, it is delivered and captured again",
                        seq = self.sequence,
                        c = self.shared.consumer,
                        s = self.shared.stream,
                    ),
                )
            }),
            Disposition::Retry { delay, .. } => self.fail(delay).await,
            Disposition::Defer => {
                let delay = self
                    .shared
                    .schedule
                    .delay_before(self.attempt.saturating_add(1))
                    .unwrap_or(NATS_DEFAULT_ACK_WAIT);
                self.fail(delay).await
            }
            // Not a failure: nothing is counted, and the message is handed
            // out again at once (the draining node pulls no more).
            Disposition::Release => self
                .acker
                .ack_with(AckKind::Nak(None))
                .await
                .map_err(|e| self.err("nak", &e)),
        }
    }

    /// `None`: the server never gives up on a slot message (`MaxDeliver`
    /// -1), so a failed capture is always retried on a later delivery.
    fn deliveries_left(&self) -> Option<u32> {
        None
    }

    fn provenance(&self) -> Vec<(&'static str, String)> {
        vec![
            (header::STREAM_SEQUENCE, self.sequence.to_string()),
            (header::DELIVERY_COUNT, self.delivered.to_string()),
        ]
    }
}
