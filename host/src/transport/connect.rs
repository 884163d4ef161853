//! The transport a config asks for, and what a broker that cannot be
//! reached at start is called in the error (`weir run`, `weir publish`,
//! `weir dead-letters`).

use std::sync::Arc;

use crate::config::{Config, TransportKind};
use crate::transport::memory::MemoryBroker;
use crate::transport::nats::{Nats, NatsOptions};
use crate::transport::rabbitmq::RabbitMq;
use crate::transport::{ErrorKind, Transport, TransportError};

/// Build the transport a config asks for.
pub fn for_config(config: &Config) -> anyhow::Result<Arc<dyn Transport>> {
    match config.transport.kind {
        TransportKind::Memory => Ok(Arc::new(MemoryBroker::new())),
        TransportKind::Rabbitmq => {
            let urls = config.transport.urls();
            if urls.is_empty() {
                anyhow::bail!(
                    "{}: transport.url is required for transport.kind = \"rabbitmq\", e.g. \"amqp://guest:guest@127.0.0.1:5672/%2f\"",
                    config.origin
                );
            }
            Ok(Arc::new(RabbitMq::with_settings(
                urls,
                format!("weir {}", config.node.name),
                config.transport.queue_type(),
            )))
        }
        TransportKind::Nats => {
            let urls = config.transport.urls();
            if urls.is_empty() {
                anyhow::bail!(
                    "{}: transport.url is required for transport.kind = \"nats\", e.g. \"nats://127.0.0.1:4222\"",
                    config.origin
                );
            }
            let options = NatsOptions {
                replicas: config.transport.replicas(),
                ..Default::default()
            };
            Ok(Arc::new(Nats::with_urls(
                urls,
                format!("weir {}", config.node.name),
                options,
            )))
        }
    }
}

/// A broker that cannot be reached at start: the error says which key of
/// which file to check, before what the client saw (`weir run`, `weir
/// publish`, `weir dead-letters`).
pub fn unreachable(config: &Config, system: &str, e: anyhow::Error) -> anyhow::Error {
    let down = e.chain().any(|c| {
        c.downcast_ref::<TransportError>()
            .is_some_and(|t| matches!(t.kind, ErrorKind::Connection))
    });
    if down {
        e.context(format!(
            "{}: transport.url: cannot reach {system} (is the broker running, and is the URL right?)",
            config.origin
        ))
    } else {
        e
    }
}
