//! Ingress: every node forwards each topology's ingress to its slot queues,
//! in order. Each message is published through the broker to the slot of
//! its group (or of its id) and acked once that publish is confirmed; one
//! that does not decode, or can never be sent, is dead-lettered, never
//! dropped.
//!
//! The RabbitMQ ingress queue has a single active consumer, and the
//! JetStream consumer hands out one unacknowledged message at a time
//! (`transport::nats`, "Ingress"), so forwarders on several nodes never
//! reorder it.

use std::sync::Arc;

use tokio::sync::watch;

use crate::dispatch::backoff::{Backoff, stopping};
use crate::dispatch::{Pipeline, RunnerReport};
use crate::envelope::{self, DecodeError};
use crate::outcome::Outcome;
use crate::settle::capture::capture_raw;
use crate::transport::{self, Delivery, Disposition, ErrorKind, Subscription};

/// Forward the topology's ingress to the slot queues until the node stops:
/// each message is published to the slot of its group (or of its id) through
/// the broker, and acked once that publish is confirmed. A message that does
/// not decode is dead-lettered `undecodable`, never dropped.
pub async fn forward_ingress(
    p: Arc<Pipeline>,
    topology: Arc<str>,
    slots: u32,
    prefetch: u32,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<RunnerReport> {
    let mut total = RunnerReport::default();
    let mut backoff = Backoff::default();
    let system = p.transport.system();
    while !stopping(&stop) {
        let mut sub = match p.transport.subscribe_ingress(&topology, prefetch).await {
            Ok(None) => return Ok(total),
            Ok(Some(sub)) => sub,
            Err(e) => {
                tracing::warn!(messaging.system = system, topology = %topology, error = %e, backoff = ?backoff.delay(), "cannot consume the ingress; retrying");
                if backoff.wait(&mut stop).await {
                    break;
                }
                continue;
            }
        };
        backoff.reset();
        loop {
            let next = tokio::select! {
                biased;
                changed = stop.changed() => if changed.is_err() || *stop.borrow() { break } else { continue },
                next = sub.next() => next,
            };
            match next {
                Some(Ok(d)) => {
                    total.received += 1;
                    if !forward_one(&p, &topology, slots, d).await && backoff.pause(&mut stop).await {
                        break;
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(messaging.system = system, topology = %topology, error = %e, "ingress consumer ended; resubscribing");
                    break;
                }
                None => break,
            }
        }
        drain_ingress(sub.as_mut(), &mut total).await;
        sub.close().await;
        if !stopping(&stop) && backoff.pause(&mut stop).await {
            break;
        }
    }
    Ok(total)
}

/// Release what the ingress subscription already holds, before it is dropped.
async fn drain_ingress(sub: &mut dyn Subscription, total: &mut RunnerReport) {
    while let Some(Ok(d)) = sub.try_next() {
        total.released += 1;
        let _ = d.acker.settle(Disposition::Release).await;
    }
}

/// Forward one ingress delivery; false when it had to be returned (publish failed).
async fn forward_one(p: &Pipeline, topology: &str, slots: u32, d: Delivery) -> bool {
    let Delivery {
        message,
        source,
        tag,
        acker,
    } = d;
    let system = p.transport.system();
    match message {
        Ok(env) => {
            match transport::publish_to_slot(p.transport.as_ref(), topology, slots, &env).await {
                Ok(()) => {
                    if let Err(e) = acker.settle(Disposition::Ack).await {
                        let slot = transport::slot_of(&env, slots);
                        tracing::warn!(messaging.system = system, topology, slot, tag, error = %e, "ingress ack failed after the forward was confirmed; it may be forwarded twice");
                    }
                    true
                }
                Err(e) if e.kind == ErrorKind::Invalid => {
                    // It can never be forwarded (its headers do not fit the
                    // broker's rules): returning it would loop for ever.
                    let err = DecodeError::Unsendable(e.detail);
                    let mut wire = envelope::encode(&env);
                    // Nothing Weir sends goes to an ingress: its weir-* headers are a publisher's.
                    p.seal.admit_raw(&mut wire);
                    let outcome = capture_raw(p.sink(), topology, wire, &err, &source, tag, acker).await;
                    !matches!(outcome, Outcome::Requeued)
                }
                Err(e) => {
                    let slot = transport::slot_of(&env, slots);
                    tracing::warn!(messaging.system = system, topology, slot, tag, error = %e, "forwarding an ingress message failed; returning it");
                    if let Err(e) = acker.settle(Disposition::Release).await {
                        tracing::warn!(messaging.system = system, topology, tag, error = %e, "release of an ingress message failed; the broker redelivers it");
                    }
                    false
                }
            }
        }
        Err((mut wire, err)) => {
            p.seal.admit_raw(&mut wire);
            let outcome = capture_raw(p.sink(), topology, wire, &err, &source, tag, acker).await;
            !matches!(outcome, Outcome::Requeued)
        }
    }
}
