//! What a coordinator tells about the cluster (`weir status`,
//! `GET /v1/slots`): nodes with their leases, slots with their owners. The
//! admin listener and the CLI read these types, never a coordinator's
//! internals.

use uuid::Uuid;

/// A node as `weir status` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NodeStatus {
    /// Registration id (new on every start).
    pub id: Uuid,
    /// `[node] name`.
    pub name: String,
    /// Seconds since the last renewal (database clock).
    pub lease_age_s: f64,
    /// Seconds until the lease expires (negative: expired).
    pub lease_left_s: f64,
    /// Holds the leader lease.
    pub leader: bool,
}

/// A slot as `weir status` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SlotStatus {
    /// Topology name.
    pub topology: String,
    /// Slot number.
    pub slot: u32,
    /// Owner's name (`None`: free).
    pub owner: Option<String>,
    /// Fencing epoch.
    pub epoch: i64,
    /// `free`, `assigned` or `releasing`.
    pub state: String,
    /// Messages waiting on the broker for this slot (`None`: unknown).
    pub lag: Option<u64>,
}

/// The registry as `weir status` and `GET /v1/slots` show it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Status {
    /// Registered nodes.
    pub nodes: Vec<NodeStatus>,
    /// Every slot.
    pub slots: Vec<SlotStatus>,
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "nodes ({}):", self.nodes.len())?;
        writeln!(f, "  {:<24} {:>12} {:>12}  role", "name", "lease age", "lease left")?;
        for n in &self.nodes {
            writeln!(
                f,
                "  {:<24} {:>11.1}s {:>11.1}s  {}",
                n.name,
                n.lease_age_s,
                n.lease_left_s,
                if n.leader { "leader" } else { "" }
            )?;
        }
        writeln!(f, "slots ({}):", self.slots.len())?;
        writeln!(
            f,
            "  {:<20} {:>5}  {:<24} {:>6}  {:<9} {:>8}",
            "topology", "slot", "owner", "epoch", "state", "lag"
        )?;
        for s in &self.slots {
            writeln!(
                f,
                "  {:<20} {:>5}  {:<24} {:>6}  {:<9} {:>8}",
                s.topology,
                s.slot,
                s.owner.as_deref().unwrap_or("-"),
                s.epoch,
                s.state,
                s.lag.map_or_else(|| "?".to_owned(), |l| l.to_string())
            )?;
        }
        Ok(())
    }
}
