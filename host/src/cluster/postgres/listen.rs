//! Change notifications: `NOTIFY weir_slots` at every commit that changes
//! slots, and the listener that wakes the loop at once.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::FutureExt as _;

use super::{Member, step};

/// Channel of the change notifications (`NOTIFY weir_slots`).
const CHANNEL: &str = "weir_slots";

/// Wake every node's loop: slots changed (sent at commit).
pub(super) async fn notify<'e>(db: impl sqlx::PgExecutor<'e>) -> anyhow::Result<()> {
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(CHANNEL)
        .execute(db)
        .await
        .context("notifying the cluster")?;
    Ok(())
}

/// `LISTEN weir_slots`, so a node acts on a change at once instead of at its
/// next tick (the handoff pause is two such waits). Best effort: without a
/// listener the loop still runs every tick, and it tries to listen again at
/// most once a second.
#[derive(Default)]
pub(super) struct Wakeups {
    listener: Option<sqlx::postgres::PgListener>,
    tried: Option<Instant>,
}

impl Wakeups {
    pub(super) async fn ensure(&mut self, c: &Member, fence_at: Option<Instant>) {
        if self.listener.is_some() || self.tried.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return;
        }
        self.tried = Some(Instant::now());
        let connect = async {
            let mut l = sqlx::postgres::PgListener::connect_with(&c.pool).await?;
            l.listen(CHANNEL).await?;
            anyhow::Ok(l)
        };
        match step(c, fence_at, connect).await {
            Ok(l) => self.listener = Some(l),
            Err(e) => tracing::debug!(error = %format!("{e:#}"), "cannot listen for cluster changes; ticking only"),
        }
    }

    /// The next notification (drains any that queued up behind it); never
    /// returns without a listener.
    pub(super) async fn next(&mut self) {
        let Some(l) = self.listener.as_mut() else {
            return std::future::pending().await;
        };
        match l.try_recv().await {
            Ok(Some(_)) => while let Some(Ok(Some(_))) = l.try_recv().now_or_never() {},
            // Ok(None): the connection was lost (it reconnects on the next
            // call); Err: drop it and listen again later.
            Ok(None) | Err(_) => self.listener = None,
        }
    }
}
