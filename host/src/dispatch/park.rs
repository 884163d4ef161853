//! Parking (`on_failure = "park"`), the slot runner's part of it: a group
//! whose head failed waits behind it on the ladder; the groups the slot's
//! previous owner parked are read at start; an operator's release or skip;
//! and the bounds on what parked groups hold in the slot's window.

use std::cmp::Reverse;
use std::time::Instant;

use anyhow::Context as _;

use crate::outcome::Reason;
use crate::transport::Delivery;

use super::job::Parks;
use super::lane::{Parked, lane_key};
use super::runner::{Bound, Done, SlotRunner};

/// A parked group as the admin API shows it.
fn shown(r: &crate::parked::Record, failures: u32) -> crate::observe::stats::ParkedGroup {
    crate::observe::stats::ParkedGroup {
        topology: r.topology.clone(),
        slot: r.slot,
        tenant: Some(r.tenant.clone()).filter(|t| !t.is_empty()),
        group: r.group.clone(),
        head: r.head.clone(),
        failures,
        since_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
    }
}

impl SlotRunner {
    /// After a job of lanes `keys`: park the groups whose head went to the
    /// ladder (`parks`), and release those whose head came back and ended
    /// any other way (handled, dead-lettered).
    pub(super) fn park(&mut self, keys: &[u64], parks: Parks) {
        let s = self.s.clone();
        let slot_key: crate::observe::stats::SlotKey = (s.topology.clone(), s.slot);
        for (key, record) in &parks {
            let id = &record.head;
            let Some(lane) = self.lanes.get_mut(key) else { continue };
            let failures = match lane.parked.as_mut() {
                Some(p) if p.id == *id => {
                    p.head_back = false;
                    p.deadline = None;
                    p.failures += 1;
                    p.failures
                }
                _ => {
                    if lane.parked.is_none() {
                        self.parked += 1;
                        self.held += lane.queue.len();
                    }
                    lane.parked = Some(Parked {
                        id: id.clone(),
                        since: Instant::now(),
                        failures: 1,
                        head_back: false,
                        deadline: None,
                    });
                    1
                }
            };
            // A ladder that retries at once may have brought it back already.
            if let Some(i) = lane.queue.iter().position(|q| q.env().is_some_and(|e| e.id == *id)) {
                if let Some(q) = lane.queue.remove(i) {
                    lane.queue.push_front(q);
                }
                if let Some(p) = lane.parked.as_mut() {
                    p.head_back = true;
                }
            }
            tracing::info!(
                topology = %s.topology, slot = s.slot, message_id = %id, failures, held = lane.queue.len(),
                "group parked behind a failed message (on_failure = \"park\"); its later messages wait"
            );
            self.p
                .stats
                .set_parked_group(&slot_key, *key, Some(shown(record, failures)));
        }
        for (key, _) in &parks {
            self.trim_hold(*key);
        }
        for key in keys {
            if parks.iter().any(|(k, _)| k == key) {
                continue;
            }
            let Some(lane) = self.lanes.get_mut(key) else { continue };
            if let Some(p) = lane.parked.take_if(|p| p.head_back) {
                self.parked -= 1;
                self.held -= lane.queue.len();
                self.p.stats.set_parked_group(&slot_key, *key, None);
                tracing::info!(
                    topology = %s.topology, slot = s.slot, message_id = %p.id, failures = p.failures,
                    parked_for = ?p.since.elapsed(), held = lane.queue.len(),
                    "parked group released: its head ended (handled or dead-lettered)"
                );
            }
        }
    }

    /// Park the groups the slot's previous owner left parked (read from the
    /// store before anything is consumed). An error stops the runner (its
    /// supervisor starts it again): consuming without them could run a
    /// parked group's messages before its head.
    pub(super) async fn load_parked(&mut self) -> anyhow::Result<()> {
        let Some(store) = self.p.parked.clone() else {
            return Ok(());
        };
        if std::env::var(crate::parked::NEGATIVE_CONTROL_NOT_CARRIED).is_ok_and(|v| v == "1") {
            tracing::error!(
                "{}=1: parked groups are NOT read at a slot's start (a test's negative control; never in production)",
                crate::parked::NEGATIVE_CONTROL_NOT_CARRIED
            );
            return Ok(());
        }
        let s = self.s.clone();
        let records = crate::parked::bounded("reading the parked groups", store.parked(&s.topology, s.slot))
            .await
            .with_context(|| {
                format!(
                    "slot {} of topology `{}`: reading its parked groups",
                    s.slot, s.topology
                )
            })?;
        let longest = s.schedule.policy().ladder.iter().max().copied().unwrap_or_default();
        let deadline =
            Instant::now() + longest.max(crate::retry::schedule::NATS_DEFAULT_ACK_WAIT) + crate::parked::GRACE;
        for r in records {
            let tenant = Some(r.tenant.as_str()).filter(|t| !t.is_empty());
            let key = lane_key(tenant, &r.group);
            let lane = self.lanes.entry(key).or_default();
            if lane.parked.is_none() {
                self.parked += 1;
            }
            tracing::info!(
                topology = %s.topology, slot = s.slot, group = %r.group, message_id = %r.head,
                "group parked by the slot's previous owner: it waits for its head here too"
            );
            self.p
                .stats
                .set_parked_group(&(s.topology.clone(), s.slot), key, Some(shown(&r, 0)));
            lane.parked = Some(Parked {
                id: r.head,
                since: Instant::now(),
                failures: 0,
                head_back: false,
                deadline: Some(deadline),
            });
            self.park_deadlines.push(Reverse((deadline, key)));
        }
        Ok(())
    }

    /// Parked groups read at start whose head is not back by their deadline:
    /// their record is stale (the head ended on a node that died before it
    /// could delete it), and they are released.
    pub(super) fn drop_overdue_parks(&mut self) {
        let now = Instant::now();
        while let Some(Reverse((at, key))) = self.park_deadlines.peek().copied() {
            if at > now {
                break;
            }
            self.park_deadlines.pop();
            let Some(lane) = self.lanes.get_mut(&key) else { continue };
            let Some(p) = lane.parked.take_if(|p| !p.head_back && p.deadline == Some(at)) else {
                continue;
            };
            self.parked -= 1;
            self.held -= lane.queue.len();
            self.p
                .stats
                .set_parked_group(&(self.s.topology.clone(), self.s.slot), key, None);
            tracing::warn!(
                topology = %self.s.topology, slot = self.s.slot, message_id = %p.id, held = lane.queue.len(),
                "a group parked by the slot's previous owner: its head did not come back in time, so the record \
                 was stale; the group runs on"
            );
            if lane.queue.is_empty() && lane.running == 0 {
                self.lanes.remove(&key);
            } else if lane.can_start() && !lane.ready {
                lane.ready = true;
                self.ready.push_back(key);
            }
        }
    }

    /// An operator's order for a parked group: release it now (its head
    /// runs late when it comes back), or also skip its head (dead-lettered
    /// `skipped` when it comes back). Refused while the head is back and
    /// about to run, or running.
    pub(super) fn order(&mut self, o: crate::dispatch::GroupOrder) {
        let key = lane_key(o.tenant.as_deref(), &o.group);
        let s = self.s.clone();
        let Some(lane) = self.lanes.get_mut(&key) else {
            let _ = o.reply.send(Err(format!("group `{}` is not parked here", o.group)));
            return;
        };
        match lane.parked.as_ref() {
            None => {
                let _ = o.reply.send(Err(format!("group `{}` is not parked here", o.group)));
                return;
            }
            Some(p) if p.head_back => {
                let _ = o.reply.send(Err(format!(
                    "group `{}`: its head {} is back from the ladder and runs now; look again in a moment",
                    o.group, p.id
                )));
                return;
            }
            Some(_) => {}
        }
        let Some(p) = lane.parked.take() else { return };
        self.parked -= 1;
        self.held -= lane.queue.len();
        self.p.stats.set_parked_group(&(s.topology.clone(), s.slot), key, None);
        tracing::warn!(
            topology = %s.topology, slot = s.slot, group = %o.group, message_id = %p.id, held = lane.queue.len(),
            skip = o.skip,
            "parked group released by an operator: its held messages run now{}",
            if o.skip { ", and its head is dead-lettered `skipped` when it comes back" } else { ", its head when it comes back" }
        );
        if lane.queue.is_empty() && lane.running == 0 {
            self.lanes.remove(&key);
        } else if lane.can_start() && !lane.ready {
            lane.ready = true;
            self.ready.push_back(key);
        }
        if o.skip {
            self.skipped.insert(p.id.clone());
        }
        if let Some(store) = self.p.parked.clone() {
            let record = crate::parked::Record {
                topology: s.topology.to_string(),
                slot: s.slot,
                tenant: o.tenant.clone().unwrap_or_default(),
                group: o.group.clone(),
                head: p.id.clone(),
            };
            self.job(Done::Capture, 0, async move {
                if let Err(e) = crate::parked::bounded("forgetting a parked group", store.release(&record)).await {
                    tracing::warn!(group = %record.group, error = %format!("{e:#}"), "the parked-groups store did not take the release");
                }
                Parks::new()
            });
        }
        let _ = o.reply.send(Ok(p.id));
    }

    /// What the parked groups of the slot hold in its window: the messages
    /// in their lanes and, where the broker keeps a failed head
    /// unacknowledged while it waits on the ladder (JetStream), one head per
    /// group. Kept at most `park_hold_slot`, below the window, so held
    /// messages never stop the deliveries that release them: the heads
    /// coming back (RabbitMQ brings them through the slot's queue, behind
    /// the window) and the slot's other groups.
    pub(super) fn slot_hold(&self) -> usize {
        self.held + if self.heads_pending { self.parked } else { 0 }
    }

    /// Keep a group that just parked within its hold and the slot's: the
    /// newest of the messages that arrived while its head ran, beyond
    /// either bound, are dead-lettered `park-overflow`. A head already back
    /// from the ladder (at the front) stays.
    pub(super) fn trim_hold(&mut self, key: u64) {
        let others = self.slot_hold();
        let Some(lane) = self.lanes.get_mut(&key) else { return };
        let Some(p) = lane.parked.as_ref() else { return };
        let room = self
            .s
            .park_hold_slot
            .saturating_sub(others.saturating_sub(lane.queue.len()));
        let (keep, bound) = if self.s.park_hold <= room {
            (self.s.park_hold, Bound::Group)
        } else {
            (room, Bound::Slot)
        };
        let keep = keep.max(usize::from(p.head_back));
        if lane.queue.len() <= keep {
            return;
        }
        let head = p.id.clone();
        let excess: Vec<Delivery> = lane.queue.drain(keep..).map(|q| q.d).collect();
        self.queued -= excess.len();
        self.held -= excess.len();
        for d in excess {
            self.overflow(d, &head, bound);
        }
    }

    /// A message of a parked group beyond `bound`: captured as
    /// `park-overflow` (the window must keep room for the head and the
    /// other groups), the reason naming the bound.
    pub(super) fn overflow(&mut self, d: Delivery, head: &str, bound: Bound) {
        let error = match bound {
            Bound::Group => format!(
                "its group is parked behind message {head}, which waits on the retry ladder, and already holds \
                 {} messages (topology.park_hold)",
                self.s.park_hold
            ),
            Bound::Slot => format!(
                "its group is parked behind message {head}, which waits on the retry ladder, and the parked \
                 groups of slot {} already hold {} messages together (topology.park_hold_slot, kept below \
                 transport.prefetch = {} so that failed heads and the slot's other groups keep room in its window)",
                self.s.slot, self.s.park_hold_slot, self.s.prefetch
            ),
        };
        self.capture_now(d, Reason::ParkOverflow, error);
    }
}
