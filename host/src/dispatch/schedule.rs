//! The slot runner's scheduler: hands the ready lanes' next messages (or
//! their head batches) and the unordered messages to the worker pool, in
//! jobs sized by the backlog and holding one tenant each.

use std::cmp::Reverse;
use std::time::Instant;

use crate::observe::stats::FlushReason;
use crate::transport::Delivery;

use super::batch::{Take, take_batch};
use super::job::{Parks, run_batches, run_lane};
use super::lane::Queued;
use super::runner::{Done, SlotRunner};

/// What one round of the lane scheduler gathers for one job: single
/// messages of some lanes and head batches of others.
struct Round {
    /// Single messages, each lane's in order, one lane after another.
    run: Vec<Delivery>,
    /// The lanes `run` was taken from.
    keys: Vec<u64>,
    batches: Vec<(Vec<Delivery>, FlushReason)>,
    /// The lanes `batches` were taken from (a loose lane may repeat).
    batch_keys: Vec<u64>,
    /// Messages in `batches`.
    members: usize,
    /// One tenant per job: a job runs on one worker, one message after
    /// another, so a tenant waiting on its concurrency limit or running
    /// away must not hold another tenant's messages.
    job_tenant: Option<Option<String>>,
    /// Parked heads back from the ladder in this job.
    returning: Vec<String>,
}

impl SlotRunner {
    /// Hand ready work to the pool. A job may carry the next messages of
    /// several lanes (each lane's in order, one lane after another, on one
    /// worker); its size is the backlog shared out over the workers, capped
    /// at `max_run`, so a backlog amortises the hand-off and a trickle still
    /// goes out one message at a time. A lane whose head is a batched
    /// message gives a batch instead (or lingers); the batches taken in one
    /// round share one job the same way, their members counting towards its
    /// size.
    pub(super) fn schedule(&mut self) {
        let workers = self.p.pool.size().max(1);
        let max_run = self.s.max_run.max(1);
        self.schedule_lanes(workers, max_run);
        self.schedule_unordered(workers, max_run);
    }

    /// Jobs from the ready lanes, while lanes may start.
    fn schedule_lanes(&mut self, workers: usize, max_run: usize) {
        let now = Instant::now();
        let window_full = self.window_full();
        while self.running_groups < self.s.max_concurrent_groups && !self.ready.is_empty() {
            let target = (self.queued / workers).clamp(1, max_run);
            let mut round = Round {
                run: Vec::with_capacity(target),
                keys: Vec::new(),
                batches: Vec::new(),
                batch_keys: Vec::new(),
                members: 0,
                job_tenant: None,
                returning: Vec::new(),
            };
            while round.run.len() + round.members < target && self.running_groups < self.s.max_concurrent_groups {
                let Some(key) = self.ready.pop_front() else { break };
                if !self.take_from_lane(&mut round, key, target, now, window_full) {
                    break;
                }
            }
            self.start_round(round);
        }
    }

    /// Take lane `key`'s next work into `round`: its head batch (or set it
    /// lingering), or its next single messages up to `target`. `false` when
    /// the lane's tenant is not the round's: the lane goes back to the front
    /// of the ready queue and the round is complete.
    fn take_from_lane(&mut self, round: &mut Round, key: u64, target: usize, now: Instant, window_full: bool) -> bool {
        let Some(lane) = self.lanes.get_mut(&key) else {
            return true;
        };
        let tenant = lane
            .queue
            .front()
            .and_then(Queued::env)
            .and_then(|e| e.tenant_id.as_deref());
        match &round.job_tenant {
            None => round.job_tenant = Some(tenant.map(str::to_owned)),
            Some(t) if t.as_deref() == tenant => {}
            Some(_) => {
                self.ready.push_front(key);
                return false;
            }
        }
        lane.ready = false;
        if let Some(rule) = lane.queue.front().and_then(|q| q.batch.clone()) {
            match take_batch(lane, &rule, now, window_full) {
                Take::Wait(until) => {
                    lane.lingering = Some(until);
                    self.lingering.push(Reverse((until, key)));
                }
                Take::Batch(batch, reason) => {
                    self.queued -= batch.len();
                    if lane.parked.is_some() {
                        self.held -= batch.len();
                    }
                    round.members += batch.len();
                    lane.running += 1;
                    self.running_groups += 1;
                    if lane.can_start() {
                        lane.ready = true;
                        self.ready.push_back(key);
                    }
                    round.batches.push((batch, reason));
                    round.batch_keys.push(key);
                }
            }
            return true;
        }
        // Single messages up to the next batched one; a message
        // that parks its group on failure runs alone.
        let n = if lane.queue.front().is_some_and(|q| q.park) {
            if let Some(p) = lane.parked.as_ref().filter(|p| p.head_back) {
                round.returning.push(p.id.clone());
            }
            1
        } else {
            lane.queue
                .iter()
                .take(target - round.run.len() - round.members)
                .take_while(|q| q.batch.is_none() && !q.park)
                .count()
        };
        round.run.extend(lane.queue.drain(..n).map(|q| q.d));
        self.queued -= n;
        if lane.parked.is_some() {
            self.held -= n;
        }
        lane.running += 1;
        self.running_groups += 1;
        round.keys.push(key);
        true
    }

    /// Put what `round` gathered in flight: its batches as one job, its
    /// single messages as another.
    fn start_round(&mut self, round: Round) {
        let Round {
            run,
            keys,
            batches,
            batch_keys,
            members,
            returning,
            ..
        } = round;
        if !batches.is_empty() {
            let (p, s, c) = (self.p.clone(), self.s.clone(), self.cancel.clone());
            self.job(Done::Batches(batch_keys), members, async move {
                run_batches(p, s, c, batches).await;
                Parks::new()
            });
        }
        if !keys.is_empty() {
            let (p, s, c) = (self.p.clone(), self.s.clone(), self.cancel.clone());
            let held = run.len();
            self.job(Done::Groups(keys), held, run_lane(p, s, c, run, returning));
        }
    }

    /// Jobs from the unordered queue, while unordered jobs may start.
    fn schedule_unordered(&mut self, workers: usize, max_run: usize) {
        let unordered_run = if self.s.bypass_lanes { 1 } else { max_run };
        while self.running_unordered < self.s.max_unordered.max(1) && !self.unordered.is_empty() {
            let n = (self.unordered.len() / workers)
                .clamp(1, unordered_run)
                .min(self.unordered.len());
            // One tenant per job, as for lanes.
            fn tenant_of(d: &Delivery) -> Option<&str> {
                d.message.as_ref().ok().and_then(|e| e.tenant_id.as_deref())
            }
            let first = self.unordered.front().and_then(tenant_of);
            let n = self
                .unordered
                .iter()
                .take(n)
                .take_while(|d| tenant_of(d) == first)
                .count()
                .max(1);
            let run: Vec<Delivery> = self.unordered.drain(..n).collect();
            self.running_unordered += 1;
            let (p, s, c) = (self.p.clone(), self.s.clone(), self.cancel.clone());
            self.job(Done::Unordered, n, run_lane(p, s, c, run, Vec::new()));
        }
    }
}
