//! The leader: one node at a time (by lease row) removes expired nodes,
//! assigns free slots ([`crate::cluster::assign`]) and asks owners to hand
//! slots over, each pass in one transaction that re-checks the lease first.

use std::collections::HashSet;

use anyhow::Context as _;
use sqlx::Row as _;
use uuid::Uuid;

use super::listen::notify;
use super::{REASSIGN_MARGIN, Tables, secs};
use crate::cluster::assign;

impl Tables {
    /// Take or keep the leader lease; true while this node leads.
    ///
    /// A follower that sees another node's live lease in its snapshot
    /// inserts nothing and so never waits for the leader row, which the
    /// leader's pass holds locked: with 100 nodes, followers queued behind
    /// it were most of the database's time (docs/SCALE.md). Only a lease
    /// that is this node's or has expired goes on to the locked upsert,
    /// which checks it again.
    pub(super) async fn try_lead(&self, id: Uuid) -> anyhow::Result<bool> {
        let row = sqlx::query(
            "INSERT INTO weir_leader (id, node_id, term, lease_until) \
             SELECT 1, $1, 1, now() + make_interval(secs => $2) \
             WHERE NOT EXISTS (SELECT 1 FROM weir_leader WHERE id = 1 AND node_id <> $1 AND lease_until >= now()) \
             ON CONFLICT (id) DO UPDATE SET node_id = EXCLUDED.node_id, lease_until = EXCLUDED.lease_until, \
                 term = weir_leader.term + CASE WHEN weir_leader.node_id = EXCLUDED.node_id THEN 0 ELSE 1 END \
             WHERE weir_leader.node_id = EXCLUDED.node_id OR weir_leader.lease_until < now() \
             RETURNING term",
        )
        .bind(id)
        .bind(secs(self.lease))
        .fetch_optional(&self.pool)
        .await
        .context("taking the leader lease")?;
        Ok(row.is_some())
    }

    /// One leader pass, in one transaction that re-checks leadership first.
    pub(super) async fn lead(&self, id: Uuid) -> anyhow::Result<()> {
        let mut tx = self.pool.begin().await.context("leader: begin")?;
        // The leader row locked, and the transaction bounded: a node that
        // stalls inside it (its network, its process) is cut off by the
        // server, which frees every row it locked for the others.
        let still = sqlx::query(
            "SELECT set_config('idle_in_transaction_session_timeout', $2, true) FROM weir_leader \
             WHERE id = 1 AND node_id = $1 AND lease_until > now() FOR UPDATE",
        )
        .bind(id)
        .bind(self.idle_in_transaction())
        .fetch_optional(&mut *tx)
        .await?;
        if still.is_none() {
            return Ok(());
        }
        self.ensure_slot_rows(&mut tx).await?;
        let expired = remove_expired(&mut tx).await?;
        let nodes = read_nodes(&mut tx).await?;
        let rows = read_slots(&mut tx).await?;
        let changed = reassign(&mut tx, &nodes, &rows).await?;
        if changed || !expired.is_empty() {
            notify(&mut *tx).await?;
        }
        tx.commit().await.context("leader: commit")?;
        Ok(())
    }

    /// Every slot of the config has its row: one statement for all of
    /// them (one per slot was two thirds of a 100-node cluster's
    /// statements, docs/SCALE.md).
    async fn ensure_slot_rows(&self, tx: &mut sqlx::PgConnection) -> anyhow::Result<()> {
        let (topologies, numbers): (Vec<&str>, Vec<i32>) = self
            .all_slots
            .iter()
            .map(|(t, s)| (t.as_str(), i32::try_from(*s).unwrap_or(i32::MAX)))
            .unzip();
        sqlx::query(
        "INSERT INTO weir_slots (topology, slot) SELECT * FROM UNNEST($1::text[], $2::int[]) ON CONFLICT DO NOTHING",
    )
    .bind(&topologies)
    .bind(&numbers)
    .execute(&mut *tx)
    .await?;
        Ok(())
    }
}

/// Remove the nodes whose lease expired by more than the margin, and free
/// their slots; the nodes removed.
async fn remove_expired(tx: &mut sqlx::PgConnection) -> anyhow::Result<Vec<Uuid>> {
    let expired: Vec<Uuid> =
        sqlx::query("DELETE FROM weir_nodes WHERE lease_until < now() - make_interval(secs => $1) RETURNING node_id")
            .bind(secs(REASSIGN_MARGIN))
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(|r| r.get::<Uuid, _>(0))
            .collect();
    if !expired.is_empty() {
        let freed = sqlx::query(
            "UPDATE weir_slots SET owner = NULL, state = 'free', target = NULL, changed_at = now() WHERE owner = ANY($1)",
        )
        .bind(&expired)
        .execute(&mut *tx)
        .await?;
        tracing::warn!(nodes = ?expired, slots = freed.rows_affected(), "leader: nodes whose lease expired were removed; their slots are free");
    }
    Ok(expired)
}

/// The registered nodes, as one leader pass reads them.
struct Nodes {
    /// Nodes that may be given slots: live and not leaving.
    live: Vec<Uuid>,
    registered: HashSet<Uuid>,
    /// Registered, lease expired (not yet by the margin): may be fencing.
    expiring: HashSet<Uuid>,
}

/// Every registered node, whether its lease is live and whether it is
/// leaving, in one read. `FOR SHARE`: a node marking itself leaving
/// waits for this pass to commit, so it sees (and releases) whatever
/// this pass gives it.
async fn read_nodes(tx: &mut sqlx::PgConnection) -> anyhow::Result<Nodes> {
    let nodes: Vec<(Uuid, bool, bool)> =
        sqlx::query("SELECT node_id, lease_until > now(), leaving FROM weir_nodes ORDER BY node_id FOR SHARE")
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(|r| (r.get::<Uuid, _>(0), r.get::<bool, _>(1), r.get::<bool, _>(2)))
            .collect();
    // Nodes that may be given slots: live and not leaving.
    let live: Vec<Uuid> = nodes
        .iter()
        .filter(|(_, l, leaving)| *l && !*leaving)
        .map(|(n, ..)| *n)
        .collect();
    let registered: HashSet<Uuid> = nodes.iter().map(|(n, ..)| *n).collect();
    // Registered, lease expired (not yet by the margin): may be fencing.
    let expiring: HashSet<Uuid> = nodes.iter().filter(|(_, l, _)| !*l).map(|(n, ..)| *n).collect();
    Ok(Nodes {
        live,
        registered,
        expiring,
    })
}

/// A slot's row, as the leader reads it.
struct SlotRow {
    topology: String,
    slot: i32,
    owner: Option<Uuid>,
    state: String,
    target: Option<Uuid>,
}

/// Every slot's row, locked for this pass.
async fn read_slots(tx: &mut sqlx::PgConnection) -> anyhow::Result<Vec<SlotRow>> {
    let rows = sqlx::query(
        "SELECT topology, slot, owner, epoch, state, target FROM weir_slots ORDER BY topology, slot FOR UPDATE",
    )
    .fetch_all(&mut *tx)
    .await?;
    Ok(rows
        .iter()
        .map(|r| SlotRow {
            topology: r.get(0),
            slot: r.get(1),
            owner: r.get(2),
            state: r.get(4),
            target: r.get(5),
        })
        .collect())
}

/// Give each slot the owner [`assign::assign`] wants, or ask its owner to
/// hand it over; whether any row changed.
async fn reassign(tx: &mut sqlx::PgConnection, nodes: &Nodes, rows: &[SlotRow]) -> anyhow::Result<bool> {
    let Nodes {
        live,
        registered,
        expiring,
    } = nodes;
    let live_set: HashSet<Uuid> = live.iter().copied().collect();
    // A slot whose owner's lease expired, but not yet by the margin, is
    // left alone: that owner may still be fencing itself. A leaving
    // owner keeps its slots until it releases them, to the target set
    // here when there is one.
    let current: Vec<Option<Uuid>> = rows.iter().map(|r| r.owner.filter(|o| live_set.contains(o))).collect();
    let desired = assign::assign(live, &current);
    let mut changed = false;
    for (row, want) in rows.iter().zip(desired) {
        let pinned = row.owner.is_some_and(|o| expiring.contains(&o));
        if pinned || row.owner == want {
            continue;
        }
        changed |= reassign_slot(tx, row, want, registered).await?;
    }
    Ok(changed)
}

/// Move one slot towards `want`; whether its row changed.
async fn reassign_slot(
    tx: &mut sqlx::PgConnection,
    row: &SlotRow,
    want: Option<Uuid>,
    registered: &HashSet<Uuid>,
) -> anyhow::Result<bool> {
    let mut changed = false;
    // An owner that is no longer registered left (after draining) or
    // was removed (after fencing): nothing of it runs. Its slot
    // would otherwise wait for a release that never comes.
    if let Some(gone) = row.owner.filter(|o| !registered.contains(o)) {
        sqlx::query(
            "UPDATE weir_slots SET owner = $4, epoch = epoch + CASE WHEN $4::uuid IS NULL THEN 0 ELSE 1 END, \
                 state = CASE WHEN $4::uuid IS NULL THEN 'free' ELSE 'assigned' END, target = NULL, changed_at = now() \
             WHERE topology = $1 AND slot = $2 AND owner = $3",
        )
        .bind(&row.topology)
        .bind(row.slot)
        .bind(gone)
        .bind(want)
        .execute(&mut *tx)
        .await?;
        changed = true;
        tracing::warn!(topology = %row.topology, slot = row.slot, gone = %gone, owner = %want.map_or_else(|| "none".to_owned(), |u| u.to_string()), "leader: the slot's owner is no longer registered; slot reassigned");
        return Ok(changed);
    }
    match (row.owner, want) {
        (None, Some(node)) => {
            sqlx::query(
                "UPDATE weir_slots SET owner = $3, epoch = epoch + 1, state = 'assigned', target = NULL, changed_at = now() \
                 WHERE topology = $1 AND slot = $2 AND owner IS NULL",
            )
            .bind(&row.topology)
            .bind(row.slot)
            .bind(node)
            .execute(&mut *tx)
            .await?;
            changed = true;
            tracing::info!(topology = %row.topology, slot = row.slot, owner = %node, "leader: slot assigned");
        }
        (Some(_), Some(node)) if row.state == "assigned" || row.target != Some(node) => {
            sqlx::query(
                "UPDATE weir_slots SET state = 'releasing', target = $3, changed_at = now() WHERE topology = $1 AND slot = $2",
            )
            .bind(&row.topology)
            .bind(row.slot)
            .bind(node)
            .execute(&mut *tx)
            .await?;
            changed = true;
            tracing::info!(topology = %row.topology, slot = row.slot, from = %row.owner.map_or_else(|| "none".to_owned(), |u| u.to_string()), to = %node, "leader: asked the owner to release the slot");
        }
        _ => {}
    }
    Ok(changed)
}

/// Against the real PostgreSQL (`WEIR_TEST_PG_URL`, as the cluster tests):
/// a follower's lease try while the leader's pass holds the leader row.
#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sqlx::Connection as _;
    use uuid::Uuid;

    use super::super::{MIGRATOR, Tables};

    fn server() -> String {
        std::env::var("WEIR_TEST_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into())
    }

    /// A database of its own, migrated; dropped by [`drop_database`].
    async fn database() -> (String, sqlx::PgPool) {
        let name = format!("weir_u_{}", &Uuid::new_v4().simple().to_string()[..8]);
        let mut admin = sqlx::PgConnection::connect(&format!("{}/postgres", server()))
            .await
            .unwrap();
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .await
            .unwrap();
        let pool = sqlx::PgPool::connect(&format!("{}/{name}", server())).await.unwrap();
        MIGRATOR.run(&pool).await.unwrap();
        (name, pool)
    }

    async fn drop_database(name: &str, pool: sqlx::PgPool) {
        pool.close().await;
        let mut admin = sqlx::PgConnection::connect(&format!("{}/postgres", server()))
            .await
            .unwrap();
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .execute(&mut admin)
            .await;
    }

    fn follower(pool: sqlx::PgPool) -> Tables {
        Tables::new(
            pool,
            "follower",
            Duration::from_secs(5),
            vec![("t".to_owned(), 0), ("t".to_owned(), 1)],
        )
    }

    /// Another node's leader lease, live or expired, and the leader row
    /// held `FOR UPDATE` as the leader's pass holds it. Returns what a
    /// follower's lease try gave within 2 s (`None`: it was still waiting).
    async fn try_while_the_pass_holds_the_row(lease_live: bool) -> Option<bool> {
        let (name, pool) = database().await;
        let until = if lease_live {
            "now() + interval '1 hour'"
        } else {
            "now() - interval '1 hour'"
        };
        sqlx::query(&format!(
            "INSERT INTO weir_leader (id, node_id, term, lease_until) VALUES (1, $1, 1, {until})"
        ))
        .bind(Uuid::now_v7())
        .execute(&pool)
        .await
        .unwrap();
        let mut pass = pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM weir_leader WHERE id = 1 FOR UPDATE")
            .execute(&mut *pass)
            .await
            .unwrap();
        let follower = follower(pool.clone());
        let tried = tokio::time::timeout(Duration::from_secs(2), follower.try_lead(Uuid::now_v7())).await;
        pass.rollback().await.unwrap();
        drop(follower);
        drop_database(&name, pool).await;
        tried.ok().map(Result::unwrap)
    }

    /// A follower that sees a live lease of another node answers at once,
    /// without waiting for the pass's lock.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_follower_does_not_wait_on_the_leaders_pass() {
        assert_eq!(try_while_the_pass_holds_the_row(true).await, Some(false));
    }

    /// The negative control: with the lease expired the try must take the
    /// row, so it waits for the pass; this shows the lock is really held,
    /// and that the test above would see a follower that waits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_try_for_an_expired_lease_waits_for_the_pass() {
        assert_eq!(try_while_the_pass_holds_the_row(false).await, None);
    }
}
