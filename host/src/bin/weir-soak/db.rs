//! The soak's database: a fresh one per run on the shared server (dropped at
//! the end), and the slot watcher, which reads `weir_slots`/`weir_nodes`
//! directly (not through any node's proxy) and times how long each slot is
//! without a live owner. Windows in which no owner *can* exist (every
//! node's database cut on purpose) are paused: the clock of a slot that is
//! ownerless then restarts when the window ends.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use parking_lot::Mutex;
use sqlx::Connection as _;
use sqlx::Row as _;

/// How often the watcher reads the tables.
pub const POLL: Duration = Duration::from_millis(200);

/// Create database `name` on `server` (`postgres://user@host:port`, no database).
pub async fn create(server: &str, name: &str) -> anyhow::Result<()> {
    let mut c = sqlx::PgConnection::connect(&format!("{server}/postgres"))
        .await
        .with_context(|| format!("connecting to {server}/postgres to create the soak's database"))?;
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut c)
        .await
        .with_context(|| format!("CREATE DATABASE {name}"))?;
    Ok(())
}

/// Drop database `name` (forcing its connections closed).
pub async fn drop(server: &str, name: &str) -> anyhow::Result<()> {
    let mut c = sqlx::PgConnection::connect(&format!("{server}/postgres"))
        .await
        .with_context(|| format!("connecting to {server}/postgres to drop {name}"))?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(&mut c)
        .await
        .with_context(|| format!("DROP DATABASE {name}"))?;
    Ok(())
}

/// What the watcher found.
#[derive(Debug, Default)]
pub struct Slots {
    /// Per slot, since when it has been without a live owner (counted time only).
    since: HashMap<u32, Instant>,
    /// Longest completed or running ownerless stretch.
    pub longest: Duration,
    /// Its slot.
    pub longest_slot: Option<u32>,
    /// Ownerless stretches longer than the threshold (a slot counted once per stretch).
    pub stuck: Vec<(u32, Duration)>,
    /// Slots currently in a stuck stretch (to count each stretch once).
    stuck_now: HashMap<u32, bool>,
    /// Slots with a live owner at the last read.
    pub owned: usize,
    /// Each live owner's node name at the last read (slot → name), so faults can aim at it.
    pub owners: HashMap<u32, String>,
    /// Slots in `releasing` at the last read, and the longest such stretch.
    releasing_since: HashMap<u32, Instant>,
    /// Longest `releasing` stretch.
    pub longest_releasing: Duration,
    /// While true nothing is timed (every node's database is cut).
    pub paused: bool,
    /// Reads that failed.
    pub read_errors: u64,
}

impl Slots {
    /// Stop timing (a window in which no owner can exist).
    pub fn pause(&mut self) {
        self.paused = true;
        self.since.clear();
        self.stuck_now.clear();
    }

    /// Time again, from now.
    pub fn resume(&mut self) {
        self.paused = false;
    }

    fn observe(&mut self, now: Instant, slots: u32, rows: &HashMap<u32, (bool, bool)>, threshold: Duration) {
        self.owned = rows.values().filter(|(owned, _)| *owned).count();
        self.owners
            .retain(|slot, _| rows.get(slot).is_some_and(|(owned, _)| *owned));
        for slot in 0..slots {
            let (owned, releasing) = rows.get(&slot).copied().unwrap_or((false, false));
            if releasing {
                let since = *self.releasing_since.entry(slot).or_insert(now);
                self.longest_releasing = self.longest_releasing.max(now - since);
            } else {
                self.releasing_since.remove(&slot);
            }
            if self.paused {
                continue;
            }
            if owned {
                self.since.remove(&slot);
                self.stuck_now.remove(&slot);
                continue;
            }
            let since = *self.since.entry(slot).or_insert(now);
            let d = now - since;
            if d > self.longest {
                self.longest = d;
                self.longest_slot = Some(slot);
            }
            if d > threshold && !self.stuck_now.get(&slot).copied().unwrap_or(false) {
                self.stuck_now.insert(slot, true);
                self.stuck.push((slot, d));
            }
        }
    }
}

/// Read the slots of `topology` every [`POLL`] into `out` until `stop`;
/// a slot without a live owner longer than `threshold` is stuck.
pub async fn watch(
    url: String,
    topology: String,
    slots: u32,
    threshold: Duration,
    out: Arc<Mutex<Slots>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut conn: Option<sqlx::PgConnection> = None;
    loop {
        if *stop.borrow() {
            return;
        }
        if conn.is_none() {
            conn = sqlx::PgConnection::connect(&url).await.ok();
        }
        if let Some(c) = conn.as_mut() {
            // Live owner: a slot held (assigned or releasing) by a node whose lease has not expired.
            let read = sqlx::query(
                "SELECT s.slot, (s.owner IS NOT NULL AND s.state <> 'free' AND n.node_id IS NOT NULL), s.state = 'releasing', n.name \
                 FROM weir_slots s LEFT JOIN weir_nodes n ON n.node_id = s.owner AND n.lease_until > now() \
                 WHERE s.topology = $1",
            )
            .bind(&topology)
            .fetch_all(&mut *c);
            match tokio::time::timeout(Duration::from_secs(2), read).await {
                Ok(Ok(rows)) => {
                    let mut names = HashMap::new();
                    let map: HashMap<u32, (bool, bool)> = rows
                        .iter()
                        .filter_map(|r| {
                            let slot: i32 = r.try_get(0).ok()?;
                            let slot = u32::try_from(slot).ok()?;
                            let owned: bool = r.try_get(1).ok()?;
                            let releasing: bool = r.try_get(2).ok()?;
                            if let Ok(Some(name)) = r.try_get::<Option<String>, _>(3) {
                                names.insert(slot, name);
                            }
                            Some((slot, (owned, releasing)))
                        })
                        .collect();
                    let mut o = out.lock();
                    o.observe(Instant::now(), slots, &map, threshold);
                    for (slot, name) in names {
                        if map.get(&slot).is_some_and(|(owned, _)| *owned) {
                            o.owners.insert(slot, name);
                        }
                    }
                }
                Ok(Err(_)) | Err(_) => {
                    out.lock().read_errors += 1;
                    conn = None;
                }
            }
        }
        tokio::select! {
            () = tokio::time::sleep(POLL) => {}
            _ = stop.changed() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ownerless_longer_than_the_threshold_is_stuck_once_and_pauses_restart_the_clock() {
        let mut s = Slots::default();
        let t0 = Instant::now();
        let threshold = Duration::from_secs(3);
        let none = HashMap::new();
        let owned: HashMap<u32, (bool, bool)> = [(0, (true, false))].into();
        s.observe(t0, 1, &owned, threshold);
        s.observe(t0 + Duration::from_secs(1), 1, &none, threshold);
        s.observe(t0 + Duration::from_secs(5), 1, &none, threshold);
        s.observe(t0 + Duration::from_secs(6), 1, &none, threshold);
        assert_eq!(s.stuck.len(), 1);
        assert_eq!(s.longest, Duration::from_secs(5));
        s.observe(t0 + Duration::from_secs(7), 1, &owned, threshold);
        s.pause();
        s.observe(t0 + Duration::from_secs(8), 1, &none, threshold);
        s.observe(t0 + Duration::from_secs(20), 1, &none, threshold);
        s.resume();
        s.observe(t0 + Duration::from_secs(21), 1, &none, threshold);
        s.observe(t0 + Duration::from_secs(22), 1, &none, threshold);
        assert_eq!(s.stuck.len(), 1, "paused time is not counted");
    }
}
