//! Declaring a topology's broker objects: the exchange, the slot, ingress
//! and dead-letter queues, and one rung (exchange and queue) per delay.

use std::collections::BTreeSet;
use std::time::Duration;

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ExchangeKind};

use super::names;
use super::queue_type::{self, QueueType, Role};
use super::wire::{SYSTEM, is_precondition_failed, lapin_err};
use crate::transport::{ErrorKind, TopologySpec, TransportError};

/// The distinct non-zero delays of a ladder, in order: one rung each.
pub fn rungs(spec: &TopologySpec) -> Vec<Duration> {
    let set: BTreeSet<Duration> = spec.retry.ladder.iter().copied().filter(|d| !d.is_zero()).collect();
    set.into_iter().collect()
}

pub(super) fn declare_options() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

/// Negative control for the multi-process cluster tests, never for
/// production: when this environment variable is `1`, slot queues are
/// declared without single active consumer, so nodes that claim the same
/// slot really consume it at the same time. A broker that already has the
/// queues with the argument refuses the declaration.
pub const NEGATIVE_CONTROL_NO_SAC: &str = "WEIR_NEGATIVE_CONTROL_NO_SINGLE_ACTIVE_CONSUMER";

/// Whether slot queues get single active consumer: always, except under
/// the negative control [`NEGATIVE_CONTROL_NO_SAC`].
pub(super) fn slot_queue_sac(topology: &str) -> bool {
    if std::env::var(NEGATIVE_CONTROL_NO_SAC).is_ok_and(|v| v == "1") {
        tracing::error!(
            messaging.system = SYSTEM,
            topology,
            "{NEGATIVE_CONTROL_NO_SAC}=1: slot queues WITHOUT single active consumer (a test's negative control; never in production)"
        );
        return false;
    }
    true
}

/// Declare every broker object of `spec` on a channel of its own (a refused
/// declaration closes the channel it was made on), every queue of
/// `queue_type` ([`queue_type::arguments`]).
pub(super) async fn declare_on(
    connection: &Connection,
    spec: &TopologySpec,
    queue_type: QueueType,
) -> Result<(), TransportError> {
    let t = spec.name.as_str();
    let ch = connection
        .create_channel()
        .await
        .map_err(|e| lapin_err(format!("opening a channel to declare topology `{t}`"), &e))?;
    let durable_exchange = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    let exchange = names::exchange(t);
    ch.exchange_declare(
        exchange.as_str().into(),
        ExchangeKind::Direct,
        durable_exchange,
        FieldTable::default(),
    )
    .await
    .map_err(|e| declare_err("exchange", &exchange, "a durable direct exchange", &e))?;

    let dead_letter = names::dead_letter(t);
    let queue = |name: String, role: Role| {
        let ch = ch.clone();
        let (args, shape) = queue_type::arguments(queue_type, role, &exchange, &dead_letter);
        async move {
            ch.queue_declare(name.as_str().into(), declare_options(), args)
                .await
                .map(|_| ())
                .map_err(|e| queue_declare_err(&name, queue_type, &shape, &e))
        }
    };
    let bind = |name: String, source: String, key: String| {
        let ch = ch.clone();
        async move {
            ch.queue_bind(
                name.as_str().into(),
                source.as_str().into(),
                key.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| lapin_err(format!("binding queue {name} to {source} with key {key:?}"), &e))
        }
    };
    // The dead-letter queue first: quorum slot and ingress queues
    // dead-letter into it (module docs of [`queue_type`]).
    queue(dead_letter.clone(), Role::DeadLetter).await?;
    let sac = slot_queue_sac(t);
    for n in 0..spec.slots {
        let q = names::slot_queue(t, n);
        queue(q.clone(), Role::Slot { sac }).await?;
        bind(q, exchange.clone(), n.to_string()).await?;
    }
    let ingress = names::ingress(t);
    queue(ingress.clone(), Role::Ingress).await?;
    bind(ingress, exchange.clone(), names::INGRESS_KEY.to_owned()).await?;
    for delay in rungs(spec) {
        let rung = names::rung(t, delay);
        ch.exchange_declare(
            rung.as_str().into(),
            ExchangeKind::Fanout,
            durable_exchange,
            FieldTable::default(),
        )
        .await
        .map_err(|e| declare_err("exchange", &rung, "a durable fanout exchange", &e))?;
        let ttl_ms = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
        queue(rung.clone(), Role::Rung { ttl_ms }).await?;
        bind(rung.clone(), rung, String::new()).await?;
    }
    let _ = ch.close(200, "declared".into()).await;
    tracing::debug!(
        messaging.system = SYSTEM,
        topology = t,
        slots = spec.slots,
        "topology declared"
    );
    Ok(())
}

/// A refused queue declaration. A queue that exists with other settings
/// (PRECONDITION_FAILED) most often has the other queue type: the error names
/// `transport.queue_type` and what this node asked for.
pub(super) fn queue_declare_err(name: &str, queue_type: QueueType, shape: &str, e: &lapin::Error) -> TransportError {
    if is_precondition_failed(e) {
        return TransportError::new(
            ErrorKind::Invalid,
            format!(
                "transport.queue_type = \"{queue_type}\": queue {name} already exists with different settings ({e}), \
                 most likely as a queue of the other type; Weir declares it as: {shape}. \
                 Either set transport.queue_type to the type the existing queues have, or migrate them: \
                 stop the nodes, move or drain their messages, delete the queues \
                 (`rabbitmqctl delete_queue {name}`), then start Weir, which declares them again \
                 (README, \"Migrating queues\")"
            ),
        );
    }
    lapin_err(format!("declaring queue {name}"), e)
}

pub(super) fn declare_err(what: &str, name: &str, shape: &str, e: &lapin::Error) -> TransportError {
    if is_precondition_failed(e) {
        return TransportError::new(
            ErrorKind::Invalid,
            format!(
                "{what} {name} already exists with different settings ({e}); Weir declares it as {shape}. \
                 Migrate it: stop the nodes, move or drain its messages, delete it \
                 (`rabbitmqctl delete_queue {name}` / delete the exchange), then start Weir, which declares it again \
                 (README, \"Migrating queues\")"
            ),
        );
    }
    lapin_err(format!("declaring {what} {name}"), e)
}
