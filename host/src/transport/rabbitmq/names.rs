//! The broker names of a topology (DESIGN.md, "Broker names").

use std::time::Duration;

/// The topology's direct exchange.
pub fn exchange(topology: &str) -> String {
    format!("weir.{topology}")
}
/// The queue of slot `n`.
pub fn slot_queue(topology: &str, slot: u32) -> String {
    format!("weir.{topology}.{slot}")
}
/// The ingress queue.
pub fn ingress(topology: &str) -> String {
    format!("weir.{topology}.ingress")
}
/// The routing key that binds the ingress queue to the exchange.
pub const INGRESS_KEY: &str = "ingress";
/// The dead-letter queue.
pub fn dead_letter(topology: &str) -> String {
    format!("weir.{topology}.dead-letter")
}
/// The retry rung (exchange and queue share the name) for `delay`.
pub fn rung(topology: &str, delay: Duration) -> String {
    format!("weir.{topology}.retry.{}ms", delay.as_millis())
}
/// Every queue a topology of `slots` slots and these rungs has.
pub fn queues(topology: &str, slots: u32, rungs: &[Duration]) -> Vec<String> {
    let mut q: Vec<String> = (0..slots).map(|n| slot_queue(topology, n)).collect();
    q.push(ingress(topology));
    q.push(dead_letter(topology));
    q.extend(rungs.iter().map(|d| rung(topology, *d)));
    q
}
/// Every exchange of such a topology.
pub fn exchanges(topology: &str, rungs: &[Duration]) -> Vec<String> {
    let mut e = vec![exchange(topology)];
    e.extend(rungs.iter().map(|d| rung(topology, *d)));
    e
}
