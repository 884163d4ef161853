//! RabbitMQ helpers shared by the RabbitMQ test crates: the broker URL and a
//! topology whose broker objects are deleted on drop.

use std::time::Duration;

use lapin::options::QueueDeleteOptions;
use lapin::{Connection, ConnectionProperties};
use weir::config::QueueType;
use weir::transport::TopologySpec;
use weir::transport::rabbitmq::{self, names};

/// The broker the tests use (override with WEIR_TEST_AMQP_URL).
pub fn url() -> String {
    std::env::var("WEIR_TEST_AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// The queue type the RabbitMQ suites run with: `WEIR_TEST_QUEUE_TYPE=quorum`
/// runs them on quorum queues (`transport.queue_type`), classic otherwise.
pub fn queue_type() -> QueueType {
    match std::env::var("WEIR_TEST_QUEUE_TYPE").as_deref() {
        Ok("quorum") => QueueType::Quorum,
        Ok("classic") | Err(_) => QueueType::Classic,
        Ok(other) => panic!("WEIR_TEST_QUEUE_TYPE={other:?}: accepted classic or quorum"),
    }
}

/// A transport on the test broker with [`queue_type`], named `name`.
pub fn transport(name: impl Into<String>) -> rabbitmq::RabbitMq {
    rabbitmq::RabbitMq::with_settings(vec![url()], name, queue_type())
}

/// A topology of this test; its broker objects are deleted on drop.
pub struct Topo {
    pub name: String,
    pub slots: u32,
    pub rungs: Vec<Duration>,
}

impl Topo {
    pub fn new(slots: u32, ladder: &[Duration]) -> Self {
        let name = format!("t-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let mut spec = TopologySpec::new(&name, slots);
        spec.retry.ladder = ladder.to_vec();
        Self {
            rungs: rabbitmq::rungs(&spec),
            name,
            slots,
        }
    }
}

impl Drop for Topo {
    fn drop(&mut self) {
        let queues = names::queues(&self.name, self.slots, &self.rungs);
        let exchanges = names::exchanges(&self.name, &self.rungs);
        super::clean_up_on_a_thread(move || async move {
            let conn = Connection::connect(&url(), ConnectionProperties::default())
                .await
                .unwrap();
            let ch = conn.create_channel().await.unwrap();
            for q in queues {
                let _ = ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await;
            }
            for e in exchanges {
                let _ = ch.exchange_delete(e.as_str().into(), Default::default()).await;
            }
            let _ = conn.close(200, "cleanup".into()).await;
        });
    }
}
