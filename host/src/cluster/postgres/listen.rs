//! Change notifications: `NOTIFY weir_slots` at every commit that changes
//! slots, and the listener that wakes the loop at once.

use anyhow::Context as _;
use futures::StreamExt as _;
use futures::stream::BoxStream;
use sqlx::postgres::PgPool;

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

/// `LISTEN weir_slots` on a connection of its own: an item per
/// notification; the stream ends when the connection is lost (the loop
/// listens again).
pub(super) async fn changes(pool: &PgPool) -> anyhow::Result<BoxStream<'static, ()>> {
    let mut l = sqlx::postgres::PgListener::connect_with(pool).await?;
    l.listen(CHANNEL).await?;
    // `into_stream` would reconnect behind the loop's back and hide the
    // notifications lost meanwhile; end instead, and the loop listens anew.
    Ok(futures::stream::unfold(l, |mut l| async move {
        match l.try_recv().await {
            Ok(Some(_)) => Some(((), l)),
            Ok(None) | Err(_) => None,
        }
    })
    .boxed())
}
