//! An outcome becomes one broker action: ack (after the cascades), a retry
//! on the ladder, or a confirmed capture; a cancelled call is released.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::capture::capture_envelope;
use super::cascades::publish_cascades;
use super::{Pending, Slot};
use crate::bindings::weir::handler::types::Failure;
use crate::dedup;
use crate::envelope::Envelope;
use crate::observe::logring::Source;
use crate::outcome::{Outcome, Reason};
use crate::retry::schedule::Step;
use crate::runtime::{CallOutcome, FaultKind, HandlerVersion};
use crate::transport::{Acker, Disposition};

/// Settle every message of a call by its outcome (the one path single
/// messages and batch members share); returns the id and outcome of each
/// that was not simply handled and acked (what parks a group, or leaves it
/// parked: `on_failure = "park"`).
pub async fn settle_all(
    cx: &Slot<'_>,
    outcomes: Vec<(Envelope, CallOutcome)>,
    pending: Vec<Pending>,
) -> Vec<(String, Outcome)> {
    // The common case, handled with nothing to publish, only needs its ack:
    // settle those in order right here. Everything else (cascades to
    // confirm, retries, captures) may wait on the broker, so those settle
    // concurrently, each boxed so this future stays small.
    if let Some(store) = cx.sink.dedup {
        // What will be acked below without a cascade is recorded first, in
        // one write; successes with cascades are recorded in `settle`, once
        // their cascades are confirmed.
        let keys: Vec<(dedup::Key, Duration)> = outcomes
            .iter()
            .zip(&pending)
            .filter(|((_, o), _)| matches!(o, CallOutcome::Done { result: Ok(()), published } if published.is_empty()))
            .filter_map(|((env, _), pend)| Some((dedup::Key::of(env), pend.handler.settings.dedup?)))
            .collect();
        remember(cx, store, keys).await;
    }
    let mut slow = Vec::new();
    for ((mut env, outcome), mut pend) in outcomes.into_iter().zip(pending) {
        // Traced: what is retried or dead-lettered carries the context it
        // arrived with, and the settlement gets its span.
        let trace = pend.trace.take().map(|t| {
            t.restore(&mut env);
            (t, std::time::SystemTime::now())
        });
        match outcome {
            CallOutcome::Done {
                result: Ok(()),
                published,
            } if published.is_empty() => {
                crate::runtime::fault::before_ack();
                let acked = match pend.acker.ack_now() {
                    Some(acked) => acked,
                    None => pend.acker.settle(Disposition::Ack).await,
                };
                if let Err(e) = acked {
                    cx.sink.stats.ack_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(tag = pend.tag, error = %e, "ack of a handled message failed; it may be delivered again");
                }
                cx.record(Some(&pend.handler), &env.id, Outcome::Handled);
                if let Some((t, started)) = trace {
                    t.settled(Outcome::Handled, started);
                }
            }
            outcome => {
                slow.push(Box::pin(async move {
                    let id = env.id.clone();
                    let handler = pend.handler.clone();
                    let o = settle(cx, env, outcome, pend).await;
                    cx.record(Some(&handler), &id, o);
                    if let Some((t, started)) = trace {
                        t.settled(o, started);
                    }
                    (id, o)
                }));
            }
        }
    }
    if slow.is_empty() {
        return Vec::new();
    }
    futures::future::join_all(slow).await
}

/// Record `keys` as handled (`handler.dedup`), before their acks. A write
/// that fails is counted and logged, and the messages are acked all the
/// same: holding them would not make the record land.
pub(crate) async fn remember(cx: &Slot<'_>, store: &dyn dedup::Store, keys: Vec<(dedup::Key, Duration)>) {
    if keys.is_empty() {
        return;
    }
    let n = keys.len() as u64;
    if let Err(e) = dedup::record(store, keys).await {
        cx.sink.stats.dedup_record_failures.fetch_add(n, Ordering::Relaxed);
        tracing::warn!(
            topology = cx.topology, messages = n, error = %format!("{e:#}"),
            "recording handled messages (handler.dedup) failed; they are acked, and would run again if that ack were lost"
        );
    }
}

/// Negative control for the fence tests, never for production: with this
/// environment variable set to `1` a call the host cancelled (a fence, a
/// drain deadline, a lost subscription) and the calls after it in its job
/// count as failed attempts (as a timeout does) instead of being released.
pub const NEGATIVE_CONTROL_CANCEL_FAILS: &str = "WEIR_NEGATIVE_CONTROL_CANCEL_FAILS";

fn cancel_fails() -> bool {
    static SET: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SET.get_or_init(|| {
        let set = std::env::var(NEGATIVE_CONTROL_CANCEL_FAILS).is_ok_and(|v| v == "1");
        if set {
            tracing::error!(
                "{NEGATIVE_CONTROL_CANCEL_FAILS}=1: cancelled calls count as FAILED attempts (a test's negative control; never in production)"
            );
        }
        set
    })
}

/// Turn a call's outcome into a settled delivery.
async fn settle(cx: &Slot<'_>, env: Envelope, outcome: CallOutcome, pend: Pending) -> Outcome {
    let Pending {
        acker,
        source,
        tag,
        handler,
        trace: _,
    } = pend;
    let (error, final_reason) = match outcome {
        CallOutcome::Done {
            result: Ok(()),
            published,
        } => match publish_cascades(cx, published.into_iter().map(|o| o.envelope)).await {
            Ok(()) => {
                if let (Some(store), Some(window)) = (cx.sink.dedup, handler.settings.dedup) {
                    remember(cx, store, vec![(dedup::Key::of(&env), window)]).await;
                }
                crate::runtime::fault::before_ack();
                if let Err(e) = acker.settle(Disposition::Ack).await {
                    cx.sink.stats.ack_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(tag, error = %e, "ack of a handled message failed; it may be delivered again");
                }
                return Outcome::Handled;
            }
            Err(e) => (super::cascades::failure_text(&e), Reason::Exhausted),
        },
        CallOutcome::Done {
            result: Err(Failure::Reject(reason)),
            ..
        } => {
            handler
                .settings
                .logs
                .push("warn", Source::Failure, Some(&env.id), &format!("rejected: {reason}"));
            return capture_envelope(cx, &env, acker, Reason::Rejected, &reason, &source, Some(&handler), tag).await;
        }
        CallOutcome::Done {
            result: Err(Failure::Retry(reason)),
            ..
        } => {
            handler
                .settings
                .logs
                .push("warn", Source::Failure, Some(&env.id), &format!("retry: {reason}"));
            (reason, Reason::Exhausted)
        }
        CallOutcome::Fault(f) if f.is_not_started() && !cancel_fails() => {
            // Refused before it began (a fence, a drain): no fault, no attempt.
            tracing::debug!(handler = handler.name(), message_id = %env.id, "not started; released to the broker");
            if let Err(e) = acker.settle(Disposition::Release).await {
                tracing::warn!(tag, error = %e, "release of a message not started failed; the broker redelivers it");
            }
            return Outcome::Released;
        }
        CallOutcome::Fault(f) => {
            cx.sink.stats.faults.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(handler = handler.name(), message_id = %env.id, attempt = env.attempt, fault = %f, "guest fault");
            if f.kind != FaultKind::Cancelled {
                handler
                    .settings
                    .logs
                    .push("error", Source::Fault, Some(&env.id), &f.to_string());
            }
            match f.kind {
                FaultKind::Cancelled if cancel_fails() => (f.to_string(), Reason::Timeout),
                FaultKind::Cancelled => {
                    if let Err(e) = acker.settle(Disposition::Release).await {
                        tracing::warn!(tag, error = %e, "release of a cancelled call failed; the broker redelivers it");
                    }
                    return Outcome::Released;
                }
                FaultKind::Timeout => (f.to_string(), Reason::Timeout),
                FaultKind::Trap | FaultKind::MemoryLimit | FaultKind::Instantiate => (f.to_string(), Reason::Trap),
            }
        }
    };
    match cx.schedule.next_step(env.attempt) {
        Step::RetryAfter(delay) => schedule_retry(cx, env, delay, acker, &handler, (&error, final_reason), tag).await,
        Step::Exhausted => capture_envelope(cx, &env, acker, final_reason, &error, &source, Some(&handler), tag).await,
    }
}

/// Put `env` back on the ladder for its next attempt after `delay`.
/// `failure`: the failure's text, and the reason it is dead-lettered for
/// once the ladder is exhausted.
async fn schedule_retry(
    cx: &Slot<'_>,
    env: Envelope,
    delay: Duration,
    acker: Box<dyn Acker>,
    handler: &HandlerVersion,
    (error, final_reason): (&str, Reason),
    tag: u64,
) -> Outcome {
    let mut next = env;
    next.attempt += 1;
    if cx.sink.transport.retry_owner() == crate::transport::RetryOwner::Host {
        // The attempt travels in a header the host reads back: sealed,
        // so a publisher's `weir-attempt` is never taken for one.
        cx.sink.seal.sign(&mut next, true);
    }
    let (id, group, next_attempt) = (next.id.clone(), next.group_id.clone(), next.attempt);
    match acker.settle(Disposition::Retry { envelope: next, delay }).await {
        Ok(()) => {
            // One line per retry: who, why, and when it runs again
            // (on brokers that time redeliveries, the broker's delay).
            tracing::info!(
                handler = handler.name(),
                message_id = %id,
                group = group.as_deref().unwrap_or(""),
                failure = match final_reason {
                    Reason::Exhausted => "retry",
                    other => other.as_str(),
                },
                next_attempt,
                delay = %humantime::format_duration(delay),
                error = %super::capture::cut_text(error, 1024),
                "retry scheduled"
            );
            if let Some(o) = cx.sink.observer {
                o.failed(&id, error, Some(delay));
            }
            Outcome::RetryScheduled
        }
        Err(e) => {
            tracing::warn!(tag, error = %e, "scheduling a retry failed; the broker redelivers the original");
            Outcome::Requeued
        }
    }
}
