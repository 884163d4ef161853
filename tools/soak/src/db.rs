//! The soak's database in `postgres` mode: a fresh one per run on the
//! shared server (dropped at the end), and the slot watcher, which reads
//! `weir_slots`/`weir_nodes` directly (not through any node's proxy).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::slots::{POLL, Row, Slots};

use anyhow::Context as _;
use parking_lot::Mutex;
use sqlx::Connection as _;
use sqlx::Row as _;

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
                    let map: HashMap<u32, Row> = rows
                        .iter()
                        .filter_map(|r| {
                            let slot: i32 = r.try_get(0).ok()?;
                            let row = Row {
                                owned: r.try_get(1).ok()?,
                                releasing: r.try_get(2).ok()?,
                                owner: r.try_get::<Option<String>, _>(3).ok().flatten(),
                            };
                            Some((u32::try_from(slot).ok()?, row))
                        })
                        .collect();
                    out.lock().observe(Instant::now(), slots, &map, threshold);
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
