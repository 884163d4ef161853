//! `cluster.mode = "rabbitmq-sac"`: the broker decides. Every node
//! subscribes to every slot; each slot queue has a single active consumer,
//! so the broker picks one node per slot and activates another when that one
//! goes away.

use super::coordinator::Coordinator;

/// Every slot, from the start; the broker activates one consumer per slot.
pub struct SingleActiveConsumer;

impl Coordinator for SingleActiveConsumer {
    fn initial_slots(&self, slots: u32) -> Vec<u32> {
        (0..slots).collect()
    }
}
