//! A delivery's way into the slot runner: its `weir-*` headers are admitted
//! against the seal, then it is routed to its lane (or to the unordered
//! queue, or dead-lettered at once), and queued there, subject to the hold
//! bounds of a parked group.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::outcome::Reason;
use crate::router::BatchRule;
use crate::settle::capture::capture_undecodable;
use crate::transport::Delivery;

use super::job::Parks;
use super::lane::{BYPASS_SALT, Lane, Queued, lane_key, loose_key};
use super::runner::{Bound, Done, SlotRunner};

/// Where a delivery goes: its lane's key, its batch rule, whether the lane
/// is a loose one (batches without a group), and whether its binding parks
/// the group when it fails.
struct Route {
    key: u64,
    batch: Option<Arc<BatchRule>>,
    loose: bool,
    park: bool,
}

impl SlotRunner {
    /// Take one delivery from the subscription: admit its headers, then
    /// capture it, queue it unordered, or queue it in its lane.
    pub(super) fn accept(&mut self, mut d: Delivery) {
        match &mut d.message {
            Ok(env) => self.admit_headers(env),
            Err((wire, _)) => {
                if self.p.seal.admit_raw(wire) > 0 {
                    self.p.stats.untrusted_headers.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let park;
        let key = match &d.message {
            Err(_) => {
                let (p, s) = (self.p.clone(), self.s.clone());
                self.job(Done::Capture, 1, async move {
                    capture_undecodable(&p.slot(&s), d).await;
                    Parks::new()
                });
                return;
            }
            Ok(env) if !self.skipped.is_empty() && self.skipped.remove(&env.id) => {
                let error = "an operator skipped this head of a parked group (weir groups skip)".to_owned();
                self.capture_now(d, Reason::Skipped, error);
                return;
            }
            Ok(env) => {
                let (batch, parks) = self.p.router.lane_rule(&self.s.topology, env);
                let batch = batch.cloned();
                park = parks && batch.is_none() && env.group().is_some() && !self.s.bypass_lanes;
                match (env.group().filter(|_| !self.s.bypass_lanes), batch) {
                    (Some(g), batch) => {
                        let salt = if batch.is_some() && self.s.bypass_batch_lanes {
                            BYPASS_SALT
                        } else {
                            0
                        };
                        Some((lane_key(env.tenant_id.as_deref(), g) ^ salt, batch, false))
                    }
                    (None, Some(rule)) => Some((loose_key(env.tenant_id.as_deref(), &rule.handler), Some(rule), true)),
                    (None, None) => None,
                }
            }
        };
        let Some((key, batch, loose)) = key else {
            self.unordered.push_back(d);
            return;
        };
        self.enqueue(
            d,
            Route {
                key,
                batch,
                loose,
                park,
            },
        );
    }

    /// Queue `d` in the lane `route` names, or dead-letter it when its
    /// parked group (or the slot's parked groups together) hold all they may.
    fn enqueue(&mut self, d: Delivery, route: Route) {
        let Route {
            key,
            batch,
            loose,
            park,
        } = route;
        let slot_full = self.slot_hold() >= self.s.park_hold_slot;
        let lane = self.lanes.entry(key).or_insert_with(|| Lane {
            loose,
            ..Lane::default()
        });
        // Keys of a group and of loose batches could collide: the lane then
        // keeps order (slower, never unsafe).
        lane.loose &= loose;
        let queued = Queued {
            d,
            at: Instant::now(),
            batch,
            park,
        };
        match lane.parked.as_mut() {
            // The parked head is back from the ladder: it runs first.
            // (Back before its job ended, on a ladder that retries at once:
            // it waits at the back for [`SlotRunner::park`] to bring it
            // forward. A head is never dead-lettered for the hold.)
            Some(p) if queued.env().is_some_and(|e| e.id == p.id) => {
                if p.head_back {
                    lane.queue.push_back(queued);
                } else {
                    p.head_back = true;
                    lane.queue.push_front(queued);
                }
                self.held += 1;
            }
            // A parked group holds what it may, and all the parked groups
            // of the slot together hold less than its window; the rest is
            // dead-lettered.
            Some(p) if lane.queue.len() >= self.s.park_hold => {
                let head = p.id.clone();
                self.overflow(queued.d, &head, Bound::Group);
                return;
            }
            Some(p) if slot_full => {
                let head = p.id.clone();
                self.overflow(queued.d, &head, Bound::Slot);
                return;
            }
            Some(_) => {
                lane.queue.push_back(queued);
                self.held += 1;
            }
            None => lane.queue.push_back(queued),
        }
        self.queued += 1;
        // A lingering batch may be complete now: look again.
        lane.lingering = None;
        if lane.can_start() && !lane.ready {
            lane.ready = true;
            self.ready.push_back(key);
        }
    }

    /// Weir's own headers are Weir's: before anything reads a `weir-*`
    /// header of this delivery, the ones without a valid seal (a
    /// publisher's, a guest's) are moved aside ([`crate::seal`]).
    fn admit_headers(&self, env: &mut crate::envelope::Envelope) {
        let host_attempts = self.p.transport.retry_owner() == crate::transport::RetryOwner::Host;
        if let crate::seal::Admission::Untrusted(moved) = self.p.seal.admit(env, host_attempts) {
            self.p.stats.untrusted_headers.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                topology = %self.s.topology,
                slot = self.s.slot,
                message_id = %crate::settle::capture::cut_text(&env.id, 128),
                moved,
                "weir-* headers without a valid seal moved under untrusted- names"
            );
        }
    }
}
