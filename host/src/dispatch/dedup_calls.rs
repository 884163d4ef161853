//! The calls of a lane's job when a handler in it keeps `handler.dedup`
//! records. Each such message is looked up right before its call, and its
//! record is written as soon as its call succeeded and its cascades were
//! confirmed, before the job's next call starts. What this job saw is
//! remembered for the rest of it, so a second copy queued behind the first
//! (a producer's double publish, the ingress forwarder's double forward) is
//! acked without a call and without another round trip to the store.
//!
//! Messages of handlers without dedup run as before: the consecutive ones in
//! one hand-off to a worker. Acks stay with [`crate::settle`], after every
//! call of the job: a kill -9 between a record and its ack is what dedup
//! covers; the gap it cannot cover is a call's end → its record, which is
//! now the cascades' confirms and one store write.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::bindings::weir::handler::types::Failure;
use crate::dedup::{self, Key, Store};
use crate::envelope::Envelope;
use crate::outcome::Outcome;
use crate::runtime::{CallOutcome, Fault, HandlerVersion, Interrupt};
use crate::settle::cascades::publish_cascades;
use crate::settle::decide::remember;
use crate::settle::{Pending, Slot};
use crate::transport::Disposition;

use super::{Pipeline, SlotSettings};
use super::{admission, call_each};

/// What this job knows of a key.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Memo {
    /// Handled: recorded by this job, or found recorded.
    Handled,
    /// Looked up and not recorded; its call here did not succeed.
    Absent,
}

/// Calls to settle: each message with its outcome (a success's cascades
/// already confirmed and its record written) and, at the same index, what
/// settling it needs. Messages found handled are acked here and are in
/// neither.
pub(super) type Called = (Vec<(Envelope, CallOutcome)>, Vec<Pending>);

/// Run a lane's job with dedup (see the module docs). `None` when the
/// worker pool is gone: what is not settled yet is left to the broker.
pub(super) async fn call_with_dedup(
    p: &Pipeline,
    s: &SlotSettings,
    cancel: &Arc<Interrupt>,
    store: &dyn Store,
    envs: Vec<Envelope>,
    pending: Vec<Pending>,
) -> Option<Called> {
    let cx = p.slot(s);
    let mut memo: HashMap<Key, Memo> = HashMap::new();
    let mut outcomes = Vec::with_capacity(envs.len());
    let mut settle = Vec::with_capacity(envs.len());
    // Consecutive messages of handlers without dedup, run in one hand-off.
    let mut plain: Vec<(Arc<HandlerVersion>, Envelope)> = Vec::new();
    for (env, pend) in envs.into_iter().zip(pending) {
        let Some(window) = pend.handler.settings.dedup else {
            plain.push((pend.handler.clone(), env));
            settle.push(pend);
            continue;
        };
        if !plain.is_empty() {
            outcomes.extend(admitted(p, std::mem::take(&mut plain), cancel).await?);
        }
        let key = Key::of(&env);
        let known = match memo.get(&key) {
            Some(m) => Some(*m),
            None if cancel.is_stopping() => None,
            None => match lookup(p, s, cancel, store, &key).await {
                Some(true) => Some(Memo::Handled),
                Some(false) => Some(Memo::Absent),
                None => None,
            },
        };
        let outcome = match known {
            Some(Memo::Handled) => {
                memo.insert(key, Memo::Handled);
                acked_as_handled(&cx, &env, pend).await;
                continue;
            }
            // The slot stops (a drain, a fence) or the store would not
            // answer until it did: not started, released.
            None if cancel.is_stopping() => (env, CallOutcome::Fault(Fault::not_started())),
            _ => {
                let (env, outcome) = admitted(p, vec![(pend.handler.clone(), env)], cancel).await?.pop()?;
                let outcome = confirm(&cx, store, &key, window, outcome).await;
                let handled = matches!(&outcome, CallOutcome::Done { result: Ok(()), .. });
                memo.insert(key, if handled { Memo::Handled } else { Memo::Absent });
                (env, outcome)
            }
        };
        outcomes.push(outcome);
        settle.push(pend);
    }
    if !plain.is_empty() {
        outcomes.extend(admitted(p, plain, cancel).await?);
    }
    Some((outcomes, settle))
}

/// [`call_each`] holding the calls' admission permits for the calls alone,
/// not for the job's store round trips.
async fn admitted(
    p: &Pipeline,
    items: Vec<(Arc<HandlerVersion>, Envelope)>,
    cancel: &Arc<Interrupt>,
) -> Option<Vec<(Envelope, CallOutcome)>> {
    let permits = admission(items.iter().map(|(h, _)| h)).await;
    let called = call_each(p, items, cancel.clone()).await;
    drop(permits);
    called
}

/// A call's outcome, with a success's cascades confirmed and its record
/// written: what is left for [`crate::settle`] is the ack. Cascades that
/// the broker did not confirm make the call a retryable failure, as
/// settling would have (and nothing is recorded).
async fn confirm(cx: &Slot<'_>, store: &dyn Store, key: &Key, window: Duration, outcome: CallOutcome) -> CallOutcome {
    let CallOutcome::Done {
        result: Ok(()),
        published,
    } = outcome
    else {
        return outcome;
    };
    if !published.is_empty()
        && let Err(e) = publish_cascades(cx, published.into_iter().map(|o| o.envelope)).await
    {
        return CallOutcome::Done {
            result: Err(Failure::Retry(format!("cascaded publish failed: {e}"))),
            published: Vec::new(),
        };
    }
    remember(cx, store, vec![(key.clone(), window)]).await;
    CallOutcome::Done {
        result: Ok(()),
        published: Vec::new(),
    }
}

/// Ack a message that was handled already, without a call (`deduplicated`).
pub(super) async fn acked_as_handled(cx: &Slot<'_>, env: &Envelope, pend: Pending) {
    tracing::info!(
        handler = pend.handler.name(), message_id = %env.id, group = env.group().unwrap_or(""),
        attempt = env.attempt, "already handled (handler.dedup); acked without a call"
    );
    if let Err(e) = pend.acker.settle(Disposition::Ack).await {
        cx.sink.stats.ack_failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(tag = pend.tag, error = %e, "ack of a deduplicated message failed; it may be delivered again");
    }
    cx.record(Some(&pend.handler), &env.id, Outcome::Deduplicated);
}

/// Whether `key` was recorded. A lookup that fails is tried again (the lane
/// waits: running the group's later messages would break its order) until
/// it answers, or `None` once the slot stops (a drain, a fence).
async fn lookup(p: &Pipeline, s: &SlotSettings, cancel: &Interrupt, store: &dyn Store, key: &Key) -> Option<bool> {
    let seen = lookup_all(p, s, cancel, store, std::slice::from_ref(key)).await?;
    seen.first().copied()
}

/// [`lookup`] for several keys at once (a batch's members), one answer each.
pub(super) async fn lookup_all(
    p: &Pipeline,
    s: &SlotSettings,
    cancel: &Interrupt,
    store: &dyn Store,
    keys: &[Key],
) -> Option<Vec<bool>> {
    let mut wait = Duration::from_millis(100);
    loop {
        match dedup::seen(store, keys).await {
            Ok(seen) => return Some(seen),
            Err(e) => {
                p.stats.dedup_lookup_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    topology = %s.topology, slot = s.slot, messages = keys.len(), error = %format!("{e:#}"),
                    retry_in = ?wait, "dedup lookup failed; the lane waits and asks again"
                );
                if cancel.is_stopping() {
                    return None;
                }
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(2));
                if cancel.is_stopping() {
                    return None;
                }
            }
        }
    }
}
