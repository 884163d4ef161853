//! A job: what one worker runs for a lane. Admit each delivery (route it,
//! or capture what cannot run), take the admission permits, call the
//! handler (or `handle-batch`, replayed member by member when it fails), and
//! hand every outcome to [`crate::settle`].

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::bindings::weir::handler::types::Failure;
use crate::dedup;
use crate::envelope::{Envelope, header};
use crate::observe::stats::FlushReason;
use crate::outcome::{Outcome, Reason};
use crate::retry::schedule::{Redelivery, Schedule};
use crate::router::PinError;
use crate::runtime::{BatchOutcome, CallOutcome, FaultKind, HandlerVersion, Interrupt};
use crate::settle::Pending;
use crate::settle::capture::capture_envelope;
use crate::settle::cascades::{failure_text, publish_cascades};
use crate::settle::decide::settle_all;
use crate::transport::{Delivery, Disposition};

use super::dedup_calls::{acked_as_handled, call_with_dedup, lookup_all};
use super::lane::lane_key;
use super::{Pipeline, SlotSettings};
use super::{admission, call_each};

/// On a broker that counts deliveries itself (JetStream), a delivery past
/// the handler's last only retries the dead-letter capture of a message whose
/// capture failed (`Role::CaptureRetry`): returns the handler's last delivery
/// when `attempt` is such a one.
fn capture_retry(schedule: &Schedule, attempt: u32) -> Option<u32> {
    if !matches!(schedule.redelivery(), Redelivery::JetStream { .. }) {
        return None;
    }
    schedule.handler_deliveries().filter(|last| attempt > *last)
}

/// Take a delivery into a call: a delivery kept in reserve for a capture
/// retry, or one with no handler, is captured here (and `None` returned);
/// otherwise the message and what settling it needs.
async fn admit(p: &Pipeline, s: &SlotSettings, d: Delivery) -> Option<(Envelope, Pending)> {
    let Delivery {
        message,
        source,
        tag,
        acker,
    } = d;
    // Undecodable deliveries never reach a lane.
    let env = message.ok()?;
    if let Some(last) = capture_retry(&s.schedule, env.attempt) {
        let error = format!(
            "delivery {} comes after the handler's last ({last}): it is kept in reserve to retry a \
             dead-letter capture that failed, so the handler does not run again",
            env.attempt
        );
        let cx = p.slot(s);
        let outcome = capture_envelope(&cx, &env, acker, Reason::Exhausted, &error, &source, None, tag).await;
        cx.record(None, &env.id, outcome);
        return None;
    }
    // A message pinned to a version (a redrive's `--handler-version`) runs
    // on it, or is dead-lettered `no-handler` saying why it cannot.
    let routed = match env.header(header::HANDLER_PIN) {
        None => p.router.route(&s.topology, s.slot, &env).ok_or(None),
        Some(pin) => {
            let pin = pin.to_owned();
            match p.router.route_pinned(&s.topology, &env, &pin).await {
                Ok(handler) => Ok(handler),
                Err(PinError::NoHandler) => Err(None),
                Err(PinError::Unresolvable(why)) => Err(Some(format!(
                    "pinned to version {pin} (weir-handler-pin), which cannot run here: {why}"
                ))),
            }
        }
    };
    match routed {
        Ok(handler) => Some(admitted(s, env, handler, acker, source, tag)),
        Err(why) => {
            let error = why.unwrap_or_else(|| {
                format!(
                    "no handler for message type `{}` (tenant {}) in topology `{}`",
                    env.message_type,
                    env.tenant_id.as_deref().unwrap_or("none"),
                    s.topology
                )
            });
            let cx = p.slot(s);
            let outcome = capture_envelope(&cx, &env, acker, Reason::NoHandler, &error, &source, None, tag).await;
            cx.record(None, &env.id, outcome);
            None
        }
    }
}

/// A routed message and what settling it needs.
fn admitted(
    s: &SlotSettings,
    mut env: Envelope,
    handler: Arc<HandlerVersion>,
    acker: Box<dyn crate::transport::Acker>,
    source: Arc<str>,
    tag: u64,
) -> (Envelope, Pending) {
    let trace = crate::telemetry::receive(&mut env, &s.topology, s.slot, handler.name()).map(Box::new);
    let pending = Pending {
        acker,
        source,
        tag,
        handler,
        trace,
    };
    (env, pending)
}

/// [`admit`]'s common case, without building its future: a decoded
/// message, not kept for a capture retry, not pinned, that has a handler.
/// Anything else comes back for [`admit`].
#[allow(
    clippy::result_large_err,
    reason = "the delivery comes back whole for `admit`; boxing it would cost the common case an allocation"
)]
fn admit_now(p: &Pipeline, s: &SlotSettings, d: Delivery) -> Result<(Envelope, Pending), Delivery> {
    let handler = match &d.message {
        Ok(env) if capture_retry(&s.schedule, env.attempt).is_none() && env.header(header::HANDLER_PIN).is_none() => {
            p.router.route(&s.topology, s.slot, env)
        }
        _ => None,
    };
    match (handler, d) {
        (
            Some(handler),
            Delivery {
                message: Ok(env),
                source,
                tag,
                acker,
            },
        ) => Ok(admitted(s, env, handler, acker, source, tag)),
        (_, d) => Err(d),
    }
}

/// [`admit`] each delivery, in order: the messages that go to a handler
/// and, at the same index, what settling each needs.
async fn admit_all(p: &Pipeline, s: &SlotSettings, run: Vec<Delivery>) -> (Vec<Envelope>, Vec<Pending>) {
    let mut envs = Vec::with_capacity(run.len());
    let mut pending = Vec::with_capacity(run.len());
    for d in run {
        let admitted = match admit_now(p, s, d) {
            Ok(admitted) => Some(admitted),
            Err(d) => admit(p, s, d).await,
        };
        if let Some((env, pend)) = admitted {
            envs.push(env);
            pending.push(pend);
        }
    }
    (envs, pending)
}

/// Drop from a batch what `handler.dedup` says was handled already (one
/// lookup right before the batch's call): each such member is acked without
/// a call (`deduplicated`). A lookup that fails is tried again (the lane
/// waits: running the rest would break its order) until it answers or the
/// slot stops (a drain, a fence), which releases the whole batch unstarted,
/// in arrival order.
async fn skip_handled(
    p: &Pipeline,
    s: &SlotSettings,
    cancel: &Interrupt,
    envs: Vec<Envelope>,
    pending: Vec<Pending>,
) -> (Vec<Envelope>, Vec<Pending>) {
    let Some(store) = p.dedup.as_deref() else {
        return (envs, pending);
    };
    let asks: Vec<usize> = (0..envs.len())
        .filter(|&i| pending[i].handler.settings.dedup.is_some())
        .collect();
    if asks.is_empty() {
        return (envs, pending);
    }
    let keys: Vec<dedup::Key> = asks.iter().map(|&i| dedup::Key::of(&envs[i])).collect();
    let Some(seen) = lookup_all(p, s, cancel, store, &keys).await else {
        release_run(p, pending).await;
        return (Vec::new(), Vec::new());
    };
    let skip: std::collections::HashSet<usize> = asks
        .iter()
        .zip(seen)
        .filter_map(|(&i, seen)| seen.then_some(i))
        .collect();
    if skip.is_empty() {
        return (envs, pending);
    }
    let cx = p.slot(s);
    let mut kept = (Vec::with_capacity(envs.len()), Vec::with_capacity(envs.len()));
    for (i, (env, pend)) in envs.into_iter().zip(pending).enumerate() {
        if skip.contains(&i) {
            acked_as_handled(&cx, &env, pend).await;
        } else {
            kept.0.push(env);
            kept.1.push(pend);
        }
    }
    kept
}

/// Release every delivery of a run, in arrival order (never an attempt).
async fn release_run(p: &Pipeline, mut pending: Vec<Pending>) {
    pending.sort_by_key(|x| x.tag);
    for x in pending {
        if let Err(e) = x.acker.settle(Disposition::Release).await {
            tracing::warn!(tag = x.tag, error = %e, "release failed; the broker redelivers it");
        }
        p.stats.record(Outcome::Released);
    }
}

/// Groups a job parked: (lane key, the group and its failed head).
pub type Parks = Vec<(u64, crate::parked::Record)>;

/// Run one lane's messages (in order, on one worker) and settle each;
/// returns the groups to park (`on_failure = "park"`): those whose message
/// went to the retry ladder. `returning`: parked heads back from the ladder
/// in this run. Parks and releases are written to the store (when there is
/// one) before this returns, so the slot's next owner finds them.
pub(super) async fn run_lane(
    p: Arc<Pipeline>,
    s: Arc<SlotSettings>,
    cancel: Arc<Interrupt>,
    run: Vec<Delivery>,
    returning: Vec<String>,
) -> Parks {
    let (envs, pending) = admit_all(&p, &s, run).await;
    if envs.is_empty() {
        return Parks::new();
    }
    // `handler.dedup`: looked up and recorded message by message, around
    // each call (see `dedup_calls`).
    let dedup = p
        .dedup
        .clone()
        .filter(|_| pending.iter().any(|x| x.handler.settings.dedup.is_some()));
    if let Some(i) = &s.inject_panic {
        i.fire(&envs);
    }
    let parkable: Vec<(u64, crate::parked::Record)> = envs
        .iter()
        .zip(&pending)
        .filter(|(_, x)| x.handler.settings.park)
        .filter_map(|(e, _)| {
            let group = e.group()?;
            let record = crate::parked::Record {
                topology: s.topology.to_string(),
                slot: s.slot,
                tenant: e.tenant_id.clone().unwrap_or_default(),
                group: group.to_owned(),
                head: e.id.clone(),
            };
            Some((lane_key(e.tenant_id.as_deref(), group), record))
        })
        .collect();
    // With dedup, each call takes its own admission, so a lane waiting on
    // the store holds no instance another lane could call in.
    let permits = match dedup {
        None => admission(pending.iter().map(|x| &x.handler)).await,
        Some(_) => Vec::new(),
    };
    let mut cx = p.slot(&s);
    let called = match dedup.as_deref() {
        None => {
            let items = pending.iter().map(|x| x.handler.clone()).zip(envs).collect();
            call_each(&p, items, cancel).await.map(|outcomes| (outcomes, pending))
        }
        Some(store) => {
            // Recorded already, call by call: settling only acks.
            cx.sink.dedup = None;
            call_with_dedup(&p, &s, &cancel, store, envs, pending).await
        }
    };
    let Some((outcomes, pending)) = called else {
        return Parks::new();
    };
    drop(permits);
    let unusual = settle_all(&cx, outcomes, pending).await;
    let outcome_of = |id: &str| unusual.iter().find(|(x, _)| x == id).map(|(_, o)| *o);
    let mut parks = Parks::new();
    for (key, record) in parkable {
        let outcome = outcome_of(&record.head);
        let parks_now = matches!(outcome, Some(Outcome::RetryScheduled | Outcome::Requeued));
        // A head given back unfinished (a drain, a fence) stays parked.
        let ended = !parks_now && outcome != Some(Outcome::Released);
        if let Some(store) = p.parked.as_deref() {
            let write = if parks_now {
                crate::parked::bounded("recording a parked group", store.park(&record)).await
            } else if ended && returning.contains(&record.head) {
                crate::parked::bounded("forgetting a parked group", store.release(&record)).await
            } else {
                Ok(())
            };
            if let Err(e) = write {
                tracing::warn!(
                    topology = %s.topology, slot = s.slot, group = %record.group, message_id = %record.head,
                    error = %format!("{e:#}"),
                    "the parked-groups store did not take this change; the group is parked or released here, \
                     but a handoff before the next change would not carry it"
                );
            }
        }
        if parks_now {
            parks.push((key, record));
        }
    }
    parks
}

/// Run batches (each of one tenant, group and handler, in order) through
/// `handle-batch`, all on one worker, then settle each member by its own
/// result. A call that traps or times out gives no results: its members are
/// replayed one at a time through `handle`, unchanged (group, tenant,
/// attempt), and settled by those calls. A cancelled call releases its
/// members.
pub(super) async fn run_batches(
    p: Arc<Pipeline>,
    s: Arc<SlotSettings>,
    cancel: Arc<Interrupt>,
    batches: Vec<(Vec<Delivery>, FlushReason)>,
) {
    let mut calls = Vec::with_capacity(batches.len());
    let mut pendings = Vec::with_capacity(batches.len());
    for (members, reason) in batches {
        let (batch, pending) = admit_all(&p, &s, members).await;
        let (batch, pending) = skip_handled(&p, &s, &cancel, batch, pending).await;
        // Every member routes to the same handler; one version runs them
        // all (a swap between two lookups must not split the batch).
        let Some(handler) = pending.first().map(|x| x.handler.clone()) else {
            continue;
        };
        p.stats.record_batch(batch.len(), reason);
        calls.push((handler, batch));
        pendings.push(pending);
    }
    if calls.is_empty() {
        return;
    }
    let permits = admission(calls.iter().map(|(h, _)| h)).await;
    let handlers: Vec<Arc<HandlerVersion>> = calls.iter().map(|(h, _)| h.clone()).collect();
    let results = match p.pool.run_batches(calls, Some(cancel.clone())).await {
        Ok(o) => o,
        Err(e) => {
            tracing::error!(error = %e, "worker pool unavailable; leaving batch members unsettled");
            return;
        }
    };
    let mut settled = Vec::with_capacity(results.len());
    for ((batch, outcome), handler) in results.into_iter().zip(handlers) {
        let Some(outcomes) = batch_outcomes(&p, &s, &handler, batch, outcome, &cancel).await else {
            return;
        };
        settled.push(outcomes);
    }
    drop(permits);
    for (outcomes, pending) in settled.into_iter().zip(pendings) {
        settle_all(&p.slot(&s), outcomes, pending).await;
    }
}

/// One outcome per member of a batch call: its own result with its own
/// cascades (published by [`settle`] before that member's ack, so a member
/// that answered `retry` or `reject` sends nothing), the replay's result after
/// a trap or timeout, or the cancellation. A call that published for the
/// whole batch (before naming a member: every 0.1.0 component) sends those
/// cascades before any ack when every member succeeded, and is replayed
/// member by member through `handle` otherwise, since nobody can tell whose
/// they were. `None` when the pool is gone.
async fn batch_outcomes(
    p: &Arc<Pipeline>,
    s: &Arc<SlotSettings>,
    handler: &Arc<HandlerVersion>,
    batch: Vec<Envelope>,
    outcome: BatchOutcome,
    cancel: &Arc<Interrupt>,
) -> Option<Vec<(Envelope, CallOutcome)>> {
    match outcome {
        BatchOutcome::Done {
            results, unattributed, ..
        } if !unattributed.is_empty() && !results.iter().all(Result::is_ok) => {
            p.stats.batch_replays.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                handler = handler.name(),
                group = batch.first().and_then(|e| e.group()),
                members = batch.len(),
                unattributed = unattributed.len(),
                "handle-batch published for no member in particular (no begin-member first) and not every \
                 member succeeded; replaying its members one at a time through handle"
            );
            let items = batch.into_iter().map(|env| (handler.clone(), env)).collect();
            call_each(p, items, cancel.clone()).await
        }
        BatchOutcome::Done {
            results,
            published,
            unattributed,
        } => {
            // Whole-batch cascades (every member succeeded) go out before any
            // member is acked; if they cannot, every member is retried like a
            // single message whose cascade failed.
            let cascade_error = if unattributed.is_empty() {
                None
            } else {
                publish_cascades(&p.slot(s), unattributed.into_iter().map(|o| o.envelope))
                    .await
                    .err()
            };
            let outcomes = batch
                .into_iter()
                .zip(results.into_iter().zip(published))
                .map(|(env, (result, published))| {
                    let done = match (result, &cascade_error) {
                        (Ok(()), Some(e)) => CallOutcome::Done {
                            result: Err(Failure::Retry(format!(
                                "{} (a cascade of its whole batch)",
                                failure_text(e)
                            ))),
                            published: Vec::new(),
                        },
                        (result, _) => CallOutcome::Done { result, published },
                    };
                    (env, done)
                })
                .collect();
            Some(outcomes)
        }
        BatchOutcome::Fault(f) if f.kind == FaultKind::Cancelled => Some(
            batch
                .into_iter()
                .map(|env| (env, CallOutcome::Fault(f.clone())))
                .collect(),
        ),
        BatchOutcome::Fault(f) => {
            p.stats.faults.fetch_add(1, Ordering::Relaxed);
            p.stats.batch_replays.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                handler = handler.name(), group = batch.first().and_then(|e| e.group()), members = batch.len(),
                fault = %f, "handle-batch failed; replaying its members one at a time through handle"
            );
            let items = batch.into_iter().map(|env| (handler.clone(), env)).collect();
            call_each(p, items, cancel.clone()).await
        }
    }
}
