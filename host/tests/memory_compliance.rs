//! The compliance harness (`common/compliance.rs`) on the in-memory broker:
//! the same assertions the real brokers must pass, in a fraction of the time.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::compliance::{self, Harness, Subject};
use weir::config::TransportKind;
use weir::transport::memory::MemoryBroker;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_of_groups_keeps_lanes_slots_and_parallelism() {
    let subject = Subject {
        transport: Arc::new(MemoryBroker::new()),
        kind: TransportKind::Memory,
        url: None,
    };
    let mut h = Harness::start(subject, "mem", 4, &[Duration::from_millis(200)], 3, ()).await;
    compliance::burst_of_groups(&mut h, |slot| format!("weir.mem.{slot}")).await;
}
