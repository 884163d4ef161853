//! Canary by slot: a new version of a handler runs on some slots of its
//! topology only (`weir deploy --canary-slots 0,1` or `--canary-slots 10%`),
//! while every other slot keeps the stable version. Since a group's slot
//! never changes, a group sees either the canary or the stable version, never
//! both: groups on stable slots never run the canary.
//!
//! While it runs, each node counts what the canary's calls and the stable
//! version's calls did (outcomes, call durations; [`Tally`]); the admin API
//! and `weir status` show the two side by side. `weir promote` makes the
//! canary the current version everywhere, `weir rollback` ends it, and a
//! threshold ([`Thresholds`]) ends it by itself: the canary's dead-letter or
//! retry rate above the stable version's by more than the threshold, with at
//! least `min_messages` settled on each side and the difference at least
//! [`MIN_Z`] standard errors ([`ThresholdMode::Relative`]). Messages every
//! version fails (a publisher's poison) weigh on both sides alike, so they
//! cannot roll a canary back unless they are aimed at its slots alone. The
//! reason names the counts of both sides and the last canary messages that
//! failed, as the node that rolled it back saw them (ids are kept per node,
//! not in the cluster's store).
//!
//! Ending a canary is one write in the router, like a swap: calls already
//! running finish, the next call on the canary's slots runs the stable
//! version. Nothing is lost: a message the canary retried comes back on the
//! ladder and runs on the stable version; one it dead-lettered is in the
//! dead-letter store with its reason, for a redrive.
//!
//! Where it is kept: in a coordinated cluster the live canary is in the
//! store every node follows, as it follows deploys (`postgres`: a row of
//! `weir_handler_canaries`; `nats-kv`: the handler's record in the handlers
//! bucket), and each node writes its tally beside it, so the comparison and
//! the threshold see the whole cluster. In the data directory it is
//! `handlers/{name}.canary.json`; in memory it ends with the process.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;

use super::shared::Shared;
use super::store::{Store, write_canary, write_component};
use super::types::{Caller, DeployError, Grants, Upload, digest};
use super::{Priority, Registry, State, now_ms};
use crate::runtime::HandlerVersion;

pub use super::types::{
    Breach, Canary, CanaryStarted, CanaryView, Compare, DEFAULT_MIN_MESSAGES, Ended, MIN_Z, Rates, Side, Tally,
    ThresholdMode, Thresholds,
};

/// How often each node checks thresholds and writes its tally.
pub const GUARD_EVERY: Duration = Duration::from_millis(500);

/// A canary this node runs.
pub(super) struct Running {
    pub canary: Canary,
    pub version: Arc<HandlerVersion>,
    /// The stable version's tally when the canary began here (its id: a
    /// stable version swapped meanwhile counts from zero).
    pub baseline: (u64, Tally),
    /// The comparison summed over the cluster at the last look (coordinated modes).
    pub cluster: Option<(Tally, Tally)>,
}

/// `0,1`, `2-4`, `0,3-5` or `25%` (the lowest slots, at least one) of a
/// topology of `slots` slots; sorted, no repeats. A canary on every slot is
/// refused: that is a deploy.
pub fn parse_slots(spec: &str, slots: u32) -> Result<Vec<u32>, String> {
    let spec = spec.trim();
    let accepted = "accepted: slot numbers and ranges like 0,1 or 0-2, or a share like 10%";
    let mut out = Vec::new();
    if let Some(pct) = spec.strip_suffix('%') {
        let p: f64 = pct
            .trim()
            .parse()
            .map_err(|_| format!("canary slots {spec:?}: {accepted}"))?;
        if !(p > 0.0 && p < 100.0) {
            return Err(format!(
                "canary slots {spec:?}: a share must be above 0% and below 100%"
            ));
        }
        let n = ((f64::from(slots) * p / 100.0).ceil() as u32).clamp(1, slots);
        out.extend(0..n);
    } else {
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            let (a, b): (u32, u32) = match (a.trim().parse(), b.trim().parse()) {
                (Ok(a), Ok(b)) if a <= b => (a, b),
                _ => {
                    return Err(format!(
                        "canary slots {spec:?}: {part:?} is not a slot or range; {accepted}"
                    ));
                }
            };
            if b >= slots {
                return Err(format!(
                    "canary slots {spec:?}: slot {b} does not exist; the topology has slots 0 to {}",
                    slots - 1
                ));
            }
            out.extend(a..=b);
        }
    }
    out.sort_unstable();
    out.dedup();
    if out.is_empty() {
        return Err(format!("canary slots {spec:?}: no slot given; {accepted}"));
    }
    if out.len() as u32 >= slots {
        return Err(format!(
            "canary slots {spec:?}: that is every slot of the topology ({slots}); a canary leaves some slots on the \
             stable version (deploy without --canary-slots to replace it everywhere)"
        ));
    }
    Ok(out)
}

impl Registry {
    /// Validate `upload` and run it as a canary of `name` on the slots
    /// `slots` names ([`parse_slots`]); the other slots keep the stable version.
    pub async fn start_canary(
        &self,
        caller: &Caller,
        name: &str,
        upload: Upload,
        grants: Option<Grants>,
        slots: &str,
        thresholds: Thresholds,
    ) -> Result<CanaryStarted, DeployError> {
        let r = self
            .start_canary_inner(caller, name, upload, grants, slots, thresholds)
            .await;
        if r.is_err() {
            self.refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        r
    }

    async fn start_canary_inner(
        &self,
        caller: &Caller,
        name: &str,
        upload: Upload,
        grants: Option<Grants>,
        slots: &str,
        thresholds: Thresholds,
    ) -> Result<CanaryStarted, DeployError> {
        let started = std::time::Instant::now();
        let spec = self.authorize(caller, name)?;
        let topology_slots = spec.slots;
        let slots = parse_slots(slots, topology_slots).map_err(DeployError::Invalid)?;
        thresholds.check().map_err(DeployError::Invalid)?;
        let grants = grants.unwrap_or_else(|| spec.config_grants.clone());
        self.check_grants(spec, &grants)?;
        self.check_size(&upload)?;
        let _queue = self.queue(caller).lock_owned().await;
        let _changing = self.changing(name).await;
        let bytes = self.read_upload(upload).await?;
        if let Store::Shared(shared) = &self.store {
            self.sync_one(shared.as_ref(), name).await.map_err(DeployError::Store)?;
        }
        let bytes: Arc<[u8]> = Arc::from(bytes);
        let new_digest = digest(&bytes);
        let stable = self
            .router
            .version(name)
            .ok_or_else(|| DeployError::UnknownHandler(name.to_owned()))?;
        if let Some(c) = self.canaries.lock().get(name) {
            return Err(DeployError::Conflict(format!(
                "a canary of `{name}` runs already (version {}, slots {:?}): promote it or roll it back first",
                c.canary.digest, c.canary.slots
            )));
        }
        if stable.digest == new_digest {
            return Err(DeployError::Conflict(format!(
                "version {new_digest} is `{name}`'s stable version already; a canary must differ"
            )));
        }
        let origin = format!("canary upload for handler `{name}` ({} bytes)", bytes.len());
        let version = self
            .compile(name, &bytes, &grants, &origin, Priority::Background)
            .await?;
        let compiled_ms = version
            .compiled_in
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let mut canary = Canary {
            id: 0, // given by the store below
            digest: new_digest.clone(),
            slots: slots.clone(),
            grants,
            thresholds: thresholds.clone(),
            started_ms: now_ms(),
            node: self.node.clone(),
        };
        match &self.store {
            Store::Memory => canary.id = self.next_canary_id(),
            Store::Dir(dir) => {
                canary.id = self.next_canary_id();
                write_component(dir, &new_digest, &bytes).map_err(DeployError::Store)?;
                write_canary(dir, name, Some(&canary)).map_err(DeployError::Store)?;
            }
            Store::Shared(shared) => {
                canary = shared
                    .start_canary(name, &bytes, canary)
                    .await
                    .map_err(DeployError::Store)?;
            }
        }
        tracing::info!(handler = name, digest = %new_digest, slots = ?slots, stable = %stable.digest, "canary started");
        self.run_canary(name, stable.clone(), Some((canary, version)));
        Ok(CanaryStarted {
            handler: name.to_owned(),
            digest: new_digest,
            stable: stable.digest.clone(),
            slots,
            topology_slots,
            thresholds,
            kept_in: self.store.label(),
            took_ms: super::deploy::elapsed_ms(started),
            compiled_ms,
        })
    }

    fn next_canary_id(&self) -> i64 {
        self.canary_ids.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
    }

    /// Install `stable` and `canary` in the router in one write, and
    /// remember the canary (or forget the one that ran).
    pub(super) fn run_canary(
        &self,
        name: &str,
        stable: Arc<HandlerVersion>,
        canary: Option<(Canary, Arc<HandlerVersion>)>,
    ) {
        // Count both sides while a canary runs; stop counting when it ends.
        let on = canary.is_some();
        stable.tallying.store(on, Ordering::Relaxed);
        if let Some((_, v)) = &canary {
            v.tallying.store(true, Ordering::Relaxed);
        }
        let baseline = (stable.id, Tally::of(&stable.tally));
        let (old_stable, old_canary) = self.router.install_with_canary(
            stable.clone(),
            canary.as_ref().map(|(c, v)| (v.clone(), c.slots.as_slice())),
        );
        let mut canaries = self.canaries.lock();
        match canary {
            Some((canary, version)) => {
                let keep = canaries
                    .get(name)
                    .filter(|r| r.canary.id == canary.id && r.version.id == version.id)
                    .map(|r| (r.baseline, r.cluster));
                let (baseline, cluster) = keep.unwrap_or((baseline, None));
                canaries.insert(
                    name.to_owned(),
                    Running {
                        canary,
                        version,
                        baseline,
                        cluster,
                    },
                );
            }
            None => {
                canaries.remove(name);
            }
        }
        drop(canaries);
        if old_stable.as_ref().is_some_and(|o| o.id != stable.id) {
            self.swaps.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(old) = old_canary.filter(|o| o.id != stable.id) {
            old.tallying.store(false, Ordering::Relaxed);
        }
    }

    /// This node's comparison of `name`'s canary with its stable version, or
    /// the cluster's when the last look at the database found it.
    fn compare(&self, name: &str, r: &Running) -> Compare {
        let stable = self.router.version(name);
        let (canary_t, stable_t) = self.local_tallies(r, stable.as_deref());
        let (canary_t, stable_t, scope) = match r.cluster {
            Some((c, s)) => (c, s, "cluster"),
            None => (canary_t, stable_t, "node"),
        };
        Compare {
            canary: Side::new(&r.canary.digest, canary_t),
            stable: Side::new(stable.as_ref().map_or("", |s| s.digest.as_str()), stable_t),
            scope,
        }
    }

    /// (canary, stable) as this node counted them since the canary began here.
    fn local_tallies(&self, r: &Running, stable: Option<&HandlerVersion>) -> (Tally, Tally) {
        let canary = Tally::of(&r.version.tally);
        let stable = stable.map_or_else(Tally::default, |s| {
            let now = Tally::of(&s.tally);
            if s.id == r.baseline.0 {
                now.since(r.baseline.1)
            } else {
                now
            }
        });
        (canary, stable)
    }

    /// The running canary of `name`, with its live comparison.
    pub fn canary(&self, name: &str) -> Option<CanaryView> {
        let canaries = self.canaries.lock();
        let r = canaries.get(name)?;
        Some(CanaryView {
            canary: r.canary.clone(),
            topology_slots: self.specs.get(name).map_or(0, |s| s.slots),
            compare: self.compare(name, r),
        })
    }

    /// How the last canary of `name` ended, on this node's watch.
    pub fn last_canary(&self, name: &str) -> Option<Ended> {
        self.ended.lock().get(name).cloned()
    }

    /// Make the running canary of `name` its current version everywhere.
    pub async fn promote(&self, caller: &Caller, name: &str) -> Result<super::Deployed, DeployError> {
        let started = std::time::Instant::now();
        self.authorize(caller, name)?;
        let _queue = self.queue(caller).lock_owned().await;
        let _changing = self.changing(name).await;
        if let Store::Shared(shared) = &self.store {
            self.sync_one(shared.as_ref(), name).await.map_err(DeployError::Store)?;
        }
        let (canary, version, compare) = {
            let canaries = self.canaries.lock();
            let Some(r) = canaries.get(name) else {
                return Err(DeployError::NoPrevious(format!(
                    "handler `{name}` runs no canary to promote (deploy one with --canary-slots)"
                )));
            };
            (r.canary.clone(), r.version.clone(), self.compare(name, r))
        };
        let previous = self.router.version(name).map(|v| v.digest.clone());
        let current_seq = self.snapshot(name).current().map(|c| c.seq);
        let mut activation = super::Activation {
            seq: current_seq.map_or(1, |s| s + 1),
            digest: canary.digest.clone(),
            size: version.size as u64,
            at_ms: now_ms(),
            source: "promote".into(),
            node: self.node.clone(),
            previous: current_seq,
            grants: canary.grants.clone(),
        };
        match &self.store {
            Store::Memory => {}
            Store::Dir(dir) => write_canary(dir, name, None).map_err(DeployError::Store)?,
            Store::Shared(shared) => {
                activation = shared
                    .promote(name, canary.id, activation)
                    .await
                    .map_err(DeployError::Store)?;
            }
        }
        // The canary's compiled code becomes the stable version: the lanes
        // on its slots keep their instances.
        self.activate(name, version.clone(), activation)
            .map_err(DeployError::Store)?;
        self.run_canary(name, version, None);
        self.ended(name, &canary, "promoted", "operator".into(), Some(compare));
        Ok(super::Deployed {
            handler: name.to_owned(),
            digest: canary.digest,
            previous,
            swapped: true,
            kept_in: self.store.label(),
            took_ms: super::deploy::elapsed_ms(started),
            compiled_ms: None,
        })
    }

    /// End the running canary of `name` (its change lock held): every slot
    /// runs the stable version again. `reason`: `operator`, or the threshold
    /// crossed. `None` when no canary runs.
    pub(super) async fn end_canary_locked(&self, name: &str, reason: String) -> Result<Option<Ended>, DeployError> {
        let (canary, compare) = {
            let canaries = self.canaries.lock();
            let Some(r) = canaries.get(name) else {
                return Ok(None);
            };
            (r.canary.clone(), self.compare(name, r))
        };
        match &self.store {
            Store::Memory => {}
            Store::Dir(dir) => write_canary(dir, name, None).map_err(DeployError::Store)?,
            Store::Shared(shared) => shared
                .end_canary(name, canary.id, &reason)
                .await
                .map_err(DeployError::Store)?,
        }
        let stable = self
            .router
            .version(name)
            .ok_or_else(|| DeployError::UnknownHandler(name.to_owned()))?;
        self.run_canary(name, stable, None);
        tracing::warn!(handler = name, digest = %canary.digest, slots = ?canary.slots, %reason, "canary rolled back; every slot runs the stable version");
        Ok(Some(self.ended(name, &canary, "rolled-back", reason, Some(compare))))
    }

    fn ended(&self, name: &str, c: &Canary, outcome: &'static str, reason: String, compare: Option<Compare>) -> Ended {
        let e = Ended {
            digest: c.digest.clone(),
            slots: c.slots.clone(),
            outcome,
            reason,
            at_ms: now_ms(),
            compare,
        };
        self.ended.lock().insert(name.to_owned(), e.clone());
        e
    }

    /// Watch the thresholds of running canaries, and (in a coordinated
    /// cluster) write this node's tallies and read the cluster's, until `stop`.
    pub fn guard(self: &Arc<Self>, mut stop: watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = tokio::time::sleep(GUARD_EVERY) => {}
                    _ = stop.changed() => return,
                }
                if *stop.borrow() {
                    return;
                }
                me.guard_once().await;
            }
        })
    }

    /// One look: see [`Registry::guard`].
    pub async fn guard_once(&self) {
        let running: Vec<(String, Canary, Arc<HandlerVersion>, Tally, Tally)> = {
            let canaries = self.canaries.lock();
            canaries
                .iter()
                .map(|(name, r)| {
                    let stable = self.router.version(name);
                    let (c, s) = self.local_tallies(r, stable.as_deref());
                    (name.clone(), r.canary.clone(), r.version.clone(), c, s)
                })
                .collect()
        };
        for (name, canary, version, mut c, mut s) in running {
            if let Store::Shared(shared) = &self.store {
                match shared.tally_canary(canary.id, &self.node, &c, &s).await {
                    Ok((cluster_c, cluster_s)) => {
                        (c, s) = (cluster_c, cluster_s);
                        if let Some(r) = self.canaries.lock().get_mut(&name).filter(|r| r.canary.id == canary.id) {
                            r.cluster = Some((c, s));
                        }
                    }
                    Err(e) => {
                        tracing::warn!(handler = %name, error = %format!("{e:#}"), "cannot share the canary's tally; judging this node's alone")
                    }
                }
            }
            let Some(breach) = canary.thresholds.breached(&c, &s) else {
                continue;
            };
            let why = breach.reason(&self.node, &version.failed.last(breach.retried));
            let _changing = self.changing(&name).await;
            // Still the same canary (an operator may have ended it meanwhile).
            if self.canaries.lock().get(&name).is_none_or(|r| r.canary.id != canary.id) {
                continue;
            }
            if let Err(e) = self.end_canary_locked(&name, why).await {
                // Another node may have ended it first: take the cluster's state.
                let synced = match &self.store {
                    Store::Shared(shared) => self.sync_one(shared.as_ref(), &name).await.is_ok(),
                    _ => false,
                };
                if !synced
                    || self
                        .canaries
                        .lock()
                        .get(&name)
                        .is_some_and(|r| r.canary.id == canary.id)
                {
                    tracing::error!(handler = %name, error = %e, "the canary crossed its threshold but could not be rolled back; trying again");
                }
            }
        }
    }

    /// At start or on a sync: make this node run `canary` (or none) of
    /// `name` beside `stable`, compiling it when it is not kept.
    pub(super) async fn follow_canary(
        &self,
        name: &str,
        stable: Arc<HandlerVersion>,
        canary: Option<Canary>,
    ) -> anyhow::Result<()> {
        let ours = self.canaries.lock().get(name).map(|r| (r.canary.id, r.version.clone()));
        let Some(canary) = canary else {
            if ours.is_some() {
                self.run_canary(name, stable, None);
            }
            return Ok(());
        };
        let version = match ours {
            Some((id, v)) if id == canary.id => {
                if self.router.version(name).is_some_and(|s| s.id == stable.id) {
                    return Ok(()); // as it runs already
                }
                v
            }
            _ => self.canary_version(name, &canary).await?,
        };
        tracing::info!(handler = name, digest = %canary.digest, slots = ?canary.slots, "running the cluster's canary");
        self.run_canary(name, stable, Some((canary, version)));
        Ok(())
    }

    /// The compiled version of `c`, from what is kept or its stored bytes.
    async fn canary_version(&self, name: &str, c: &Canary) -> anyhow::Result<Arc<HandlerVersion>> {
        let kept = self
            .states
            .lock()
            .get(name)
            .and_then(|s: &State| s.compiled(&c.digest, &c.grants).cloned());
        if let Some(v) = kept {
            return Ok(v.reissue());
        }
        let bytes = self.bytes_of(name, &c.digest).await?;
        Ok(self
            .compile(
                name,
                &bytes,
                &c.grants,
                &format!("canary {} of `{name}`", c.digest),
                Priority::Background,
            )
            .await?)
    }

    /// Every handler's running canary, for metrics: (handler, canary).
    pub fn canaries(&self) -> HashMap<String, CanaryView> {
        let names: Vec<String> = self.canaries.lock().keys().cloned().collect();
        names
            .into_iter()
            .filter_map(|n| Some((n.clone(), self.canary(&n)?)))
            .collect()
    }
}

/// The live canaries of `handlers` (name, slots of its topology) as the
/// cluster's store holds them, each with the cluster's comparison: what
/// `weir status --config` shows without asking a node.
pub async fn in_store(shared: &dyn Shared, handlers: &[(String, u32)]) -> anyhow::Result<Vec<(String, CanaryView)>> {
    let mut out = Vec::new();
    for (name, topology_slots) in handlers {
        let Some(canary) = shared.live_canary(name).await? else {
            continue;
        };
        let stable = shared
            .activations(name)
            .await?
            .last()
            .map(|a| a.digest.clone())
            .unwrap_or_default();
        let (c, s) = shared.canary_tallies(canary.id).await?;
        let compare = Compare {
            canary: Side::new(&canary.digest, c),
            stable: Side::new(&stable, s),
            scope: "cluster",
        };
        out.push((
            name.clone(),
            CanaryView {
                canary,
                topology_slots: *topology_slots,
                compare,
            },
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_by_number_range_and_share() {
        assert_eq!(parse_slots("0,1", 6), Ok(vec![0, 1]));
        assert_eq!(parse_slots(" 3-4, 0 ,4", 6), Ok(vec![0, 3, 4]));
        assert_eq!(parse_slots("10%", 6), Ok(vec![0]), "at least one slot");
        assert_eq!(parse_slots("50%", 6), Ok(vec![0, 1, 2]));
        for bad in ["", "6", "1-0", "x", "0%", "100%", "0-5", "abc%"] {
            let e = parse_slots(bad, 6).expect_err(bad);
            assert!(e.contains("canary slots"), "{bad}: {e}");
        }
        assert!(parse_slots("0-5", 6).unwrap_err().contains("every slot"));
        assert!(parse_slots("7", 6).unwrap_err().contains("slot 7 does not exist"));
    }
}
