//! `cluster.mode = "static"`: the config names the slots each node owns
//! (`cluster.owned_slots`).

use super::coordinator::Coordinator;

/// The configured slots, from the start.
pub struct Static {
    /// `cluster.owned_slots`, flattened.
    pub owned: Vec<u32>,
}

impl Coordinator for Static {
    fn initial_slots(&self, slots: u32) -> Vec<u32> {
        self.owned.iter().copied().filter(|s| *s < slots).collect()
    }
}
