//! The registry as `weir status` and `GET /v1/slots` show it, read from the
//! database.

use anyhow::Context as _;
use sqlx::Row as _;
use sqlx::postgres::PgPool;

use crate::cluster::status::{NodeStatus, SlotStatus, Status};

/// Read the registry.
pub async fn status(pool: &PgPool) -> anyhow::Result<Status> {
    let nodes = sqlx::query(
        "SELECT n.node_id, n.name, extract(epoch FROM now() - n.renewed_at)::float8, \
                extract(epoch FROM n.lease_until - now())::float8, \
                coalesce(l.node_id = n.node_id AND l.lease_until > now(), false) \
         FROM weir_nodes n LEFT JOIN weir_leader l ON l.id = 1 ORDER BY n.name, n.started_at",
    )
    .fetch_all(pool)
    .await
    .context("reading weir_nodes")?
    .iter()
    .map(|r| NodeStatus {
        id: r.get(0),
        name: r.get(1),
        lease_age_s: r.get(2),
        lease_left_s: r.get(3),
        leader: r.get(4),
    })
    .collect();
    let slots = sqlx::query(
        "SELECT s.topology, s.slot, n.name, s.epoch, s.state FROM weir_slots s \
         LEFT JOIN weir_nodes n ON n.node_id = s.owner ORDER BY s.topology, s.slot",
    )
    .fetch_all(pool)
    .await
    .context("reading weir_slots")?
    .iter()
    .map(|r| {
        SlotStatus::new(
            r.get::<String, _>(0),
            u32::try_from(r.get::<i32, _>(1)).unwrap_or(0),
            r.get(2),
            r.get(3),
            r.get::<String, _>(4),
        )
    })
    .collect();
    Ok(Status {
        mode: "postgres".into(),
        nodes,
        slots,
    })
}
