//! The server names of a topology (DESIGN.md, "Broker names").

/// The topology's work stream.
pub fn stream(topology: &str) -> String {
    format!("WEIR_{topology}")
}
/// The subjects of the work stream: slots and ingress (module docs,
/// "Subjects").
pub fn stream_subjects(topology: &str) -> Vec<String> {
    vec![format!("weir.{topology}.slot.*"), ingress(topology)]
}
/// The subject of slot `n`.
pub fn slot_subject(topology: &str, slot: u32) -> String {
    format!("weir.{topology}.slot.{slot}")
}
/// The durable pull consumer of slot `n`.
pub fn slot_consumer(topology: &str, slot: u32) -> String {
    format!("weir-{topology}-{slot}")
}
/// The ingress subject.
pub fn ingress(topology: &str) -> String {
    format!("weir.{topology}.ingress")
}
/// The durable pull consumer of the ingress.
pub fn ingress_consumer(topology: &str) -> String {
    format!("weir-{topology}-ingress")
}
/// The dead-letter subject.
pub fn dead_letter(topology: &str) -> String {
    format!("weir.{topology}.dead-letter")
}
/// The dead-letter stream.
pub fn dead_letter_stream(topology: &str) -> String {
    format!("WEIR_{topology}_DLQ")
}
/// The key-value bucket of failure counts (module docs, "Attempts").
pub fn attempts_bucket(topology: &str) -> String {
    format!("WEIR_{topology}_ATTEMPTS")
}
/// The stream behind [`attempts_bucket`] (the server's `KV_` prefix).
pub fn attempts_stream(topology: &str) -> String {
    format!("KV_WEIR_{topology}_ATTEMPTS")
}
/// The key of a message's failure count: its slot and stream sequence.
pub fn attempts_key(slot: u32, sequence: u64) -> String {
    format!("{slot}.{sequence}")
}
