//! What a coordinator tells about the cluster (`weir status`,
//! `GET /v1/slots`): nodes with their leases, slots with their owners, what
//! the broker says of each slot (waiting messages, consumers) and the calls
//! running on it. The admin listener and the CLI read these types, never a
//! coordinator's internals. A slot that no node owns and no consumer reads
//! is *unowned*: its messages wait, and `weir status` shows it in red.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A node as `weir status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeStatus {
    /// Registration id (new on every start).
    pub id: Uuid,
    /// `[node] name`.
    pub name: String,
    /// Seconds since the last renewal (the coordinator's clock).
    pub lease_age_s: f64,
    /// Seconds until the lease expires (negative: expired).
    pub lease_left_s: f64,
    /// Holds the leader lease.
    pub leader: bool,
}

/// A slot as `weir status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SlotStatus {
    /// Topology name.
    pub topology: String,
    /// Slot number.
    pub slot: u32,
    /// Owner's name (`None`: free, or not this node's in a mode where a node
    /// knows only its own slots).
    pub owner: Option<String>,
    /// Fencing epoch (0 in modes without one).
    pub epoch: i64,
    /// `free`, `assigned` or `releasing` (coordinated modes); `consumed`
    /// (this node consumes it), `not here` (solo, static, rabbitmq-sac).
    pub state: String,
    /// Messages waiting on the broker for this slot (`None`: unknown).
    pub lag: Option<u64>,
    /// Consumers the broker counts on the slot (`None`: unknown).
    #[serde(default)]
    pub consumers: Option<u32>,
    /// Guest calls running on the slot now, when the answering node runs it.
    #[serde(default)]
    pub in_flight: Option<u64>,
    /// Groups parked in the slot now (`on_failure = "park"`), when the
    /// answering node runs it.
    #[serde(default)]
    pub parked: Option<u64>,
}

impl SlotStatus {
    /// A slot with nothing known from the broker or the calls yet.
    pub fn new(
        topology: impl Into<String>,
        slot: u32,
        owner: Option<String>,
        epoch: i64,
        state: impl Into<String>,
    ) -> Self {
        Self {
            topology: topology.into(),
            slot,
            owner,
            epoch,
            state: state.into(),
            lag: None,
            consumers: None,
            in_flight: None,
            parked: None,
        }
    }

    /// Nobody owns it and the broker counts no consumer (or cannot say):
    /// its messages wait.
    pub fn unowned(&self) -> bool {
        self.owner.is_none() && self.consumers.is_none_or(|c| c == 0)
    }
}

/// The cluster as `weir status` and `GET /v1/slots` show it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Status {
    /// `cluster.mode` of the node that answered.
    #[serde(default)]
    pub mode: String,
    /// Registered nodes (coordinated modes; else the answering node alone).
    pub nodes: Vec<NodeStatus>,
    /// Every slot.
    pub slots: Vec<SlotStatus>,
}

/// Two nodes' counts of one slot: their sum, or what the one that knows says.
fn add(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a + b),
        (a, b) => a.or(b),
    }
}

impl Status {
    /// Several nodes' views as one (`weir status --admin A --admin B`): a
    /// slot is owned when any node owns it; the nodes are listed once.
    pub fn merge(views: Vec<Status>) -> Status {
        let mut out = Status::default();
        for v in views {
            if out.mode.is_empty() {
                out.mode = v.mode.clone();
            }
            for n in v.nodes {
                if !out.nodes.iter().any(|m| m.id == n.id) {
                    out.nodes.push(n);
                }
            }
            for s in v.slots {
                match out
                    .slots
                    .iter_mut()
                    .find(|o| o.topology == s.topology && o.slot == s.slot)
                {
                    Some(o) => {
                        // Calls and parked groups are known only to the nodes running the
                        // slot (two during a handoff): added up, whichever view names the owner.
                        let lag = o.lag.or(s.lag);
                        let consumers = o.consumers.or(s.consumers);
                        let in_flight = add(o.in_flight, s.in_flight);
                        let parked = add(o.parked, s.parked);
                        if o.owner.is_none() && s.owner.is_some() {
                            *o = s;
                        }
                        (o.lag, o.consumers, o.in_flight, o.parked) = (lag, consumers, in_flight, parked);
                    }
                    None => out.slots.push(s),
                }
            }
        }
        out.slots
            .sort_by(|a, b| (&a.topology, a.slot).cmp(&(&b.topology, b.slot)));
        out
    }

    /// The slots nobody consumes.
    pub fn unowned(&self) -> Vec<&SlotStatus> {
        self.slots.iter().filter(|s| s.unowned()).collect()
    }

    /// The tables `weir status` prints; `colour` paints unowned slots red.
    pub fn render(&self, colour: bool) -> String {
        use std::fmt::Write as _;
        let (red, bold, reset) = if colour {
            ("\x1b[31m", "\x1b[1m", "\x1b[0m")
        } else {
            ("", "", "")
        };
        let mut f = String::new();
        let mode = if self.mode.is_empty() { "?" } else { &self.mode };
        let _ = writeln!(f, "{bold}cluster mode {mode}{reset}");
        let _ = writeln!(f, "nodes ({}):", self.nodes.len());
        let _ = writeln!(f, "  {:<24} {:>12} {:>12}  role", "name", "lease age", "lease left");
        for n in &self.nodes {
            let _ = writeln!(
                f,
                "  {:<24} {:>11.1}s {:>11.1}s  {}",
                n.name,
                n.lease_age_s,
                n.lease_left_s,
                if n.leader { "leader" } else { "" }
            );
        }
        let _ = writeln!(f, "slots ({}):", self.slots.len());
        let _ = writeln!(
            f,
            "  {:<20} {:>5}  {:<24} {:>6}  {:<9} {:>8} {:>9} {:>9} {:>6}",
            "topology", "slot", "owner", "epoch", "state", "lag", "consumers", "in flight", "parked"
        );
        let unknown = |v: Option<String>| v.unwrap_or_else(|| "?".to_owned());
        for s in &self.slots {
            let unowned = s.unowned();
            let owner = match (&s.owner, unowned) {
                (Some(o), _) => o.clone(),
                (None, true) => "UNOWNED".to_owned(),
                (None, false) => "(another node)".to_owned(),
            };
            let (start, end) = if unowned { (red, reset) } else { ("", "") };
            let _ = writeln!(
                f,
                "{start}  {:<20} {:>5}  {:<24} {:>6}  {:<9} {:>8} {:>9} {:>9} {:>6}{end}",
                s.topology,
                s.slot,
                owner,
                s.epoch,
                s.state,
                unknown(s.lag.map(|l| l.to_string())),
                unknown(s.consumers.map(|c| c.to_string())),
                s.in_flight.map_or_else(|| "-".to_owned(), |n| n.to_string()),
                s.parked.map_or_else(|| "-".to_owned(), |n| n.to_string()),
            );
        }
        let unowned = self.unowned();
        if !unowned.is_empty() {
            let list: Vec<String> = unowned.iter().map(|s| format!("{}/{}", s.topology, s.slot)).collect();
            let _ = writeln!(
                f,
                "{red}{} unowned slot(s): {} — no node consumes them; their messages wait{reset}",
                unowned.len(),
                list.join(", ")
            );
        }
        f
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.render(false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(t: &str, n: u32, owner: Option<&str>, consumers: Option<u32>) -> SlotStatus {
        let mut s = SlotStatus::new(t, n, owner.map(str::to_owned), 0, "consumed");
        s.consumers = consumers;
        s
    }

    #[test]
    fn a_slot_without_owner_and_consumer_is_unowned_and_shown_red() {
        let st = Status {
            mode: "static".into(),
            nodes: Vec::new(),
            slots: vec![
                slot("orders", 0, Some("a"), Some(1)),
                slot("orders", 1, None, Some(1)),
                slot("orders", 2, None, Some(0)),
                slot("orders", 3, None, None),
            ],
        };
        let unowned: Vec<u32> = st.unowned().iter().map(|s| s.slot).collect();
        assert_eq!(unowned, [2, 3]);
        let plain = st.render(false);
        assert!(plain.contains("(another node)"), "{plain}");
        assert!(plain.contains("2 unowned slot(s): orders/2, orders/3"), "{plain}");
        assert!(!plain.contains('\x1b'), "{plain}");
        let red = st.render(true);
        assert!(red.contains("\x1b[31m  orders"), "{red}");
    }

    #[test]
    fn merged_views_take_each_slots_owner_from_whoever_has_it() {
        let a = Status {
            mode: "static".into(),
            nodes: Vec::new(),
            slots: vec![slot("t", 0, Some("a"), Some(1)), slot("t", 1, None, Some(1))],
        };
        let b = Status {
            mode: "static".into(),
            nodes: Vec::new(),
            slots: vec![slot("t", 0, None, Some(1)), slot("t", 1, Some("b"), Some(1))],
        };
        let m = Status::merge(vec![a, b]);
        let owners: Vec<Option<&str>> = m.slots.iter().map(|s| s.owner.as_deref()).collect();
        assert_eq!(owners, [Some("a"), Some("b")]);
        assert!(m.unowned().is_empty());
    }

    /// In the coordinated modes every node names every slot's owner, but only the owner
    /// counts its calls and parked groups: the merge keeps them whichever view came first.
    #[test]
    fn merged_views_keep_the_calls_and_parked_groups_of_whoever_runs_the_slot() {
        let counted = |in_flight: Option<u64>, parked: Option<u64>| {
            let mut s = slot("t", 0, Some("a"), Some(1));
            (s.in_flight, s.parked) = (in_flight, parked);
            s
        };
        let view = |s: SlotStatus| Status {
            mode: "postgres".into(),
            nodes: Vec::new(),
            slots: vec![s],
        };
        // Node b's view first: it knows a owns the slot, not what runs there.
        let m = Status::merge(vec![view(counted(None, None)), view(counted(Some(3), Some(2)))]);
        assert_eq!((m.slots[0].in_flight, m.slots[0].parked), (Some(3), Some(2)));
        let m = Status::merge(vec![view(counted(Some(3), Some(2))), view(counted(None, None))]);
        assert_eq!((m.slots[0].in_flight, m.slots[0].parked), (Some(3), Some(2)));
        // A handoff: the old owner still finishing a call, the new one running two.
        let mut old = counted(Some(1), Some(0));
        old.owner = None;
        let m = Status::merge(vec![view(old), view(counted(Some(2), Some(1)))]);
        assert_eq!(m.slots[0].owner.as_deref(), Some("a"));
        assert_eq!((m.slots[0].in_flight, m.slots[0].parked), (Some(3), Some(1)));
    }
}
