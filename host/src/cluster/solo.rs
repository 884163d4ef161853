//! `cluster.mode = "solo"`: one node consumes every slot.

use super::coordinator::Coordinator;

/// Every slot, from the start.
pub struct Solo;

impl Coordinator for Solo {
    fn initial_slots(&self, slots: u32) -> Vec<u32> {
        (0..slots).collect()
    }
}
