//! The soak's own side of the broker, written against lapin and async-nats
//! directly (not Weir's transports): the steady publisher's confirmed
//! publishes to a slot, the observer that sees every message published to a
//! slot (RabbitMQ: a queue of the soak's own bound to `weir.T` with every
//! slot's key; NATS: a core subscription on `weir.T.slot.*`), the
//! dead-letter reader, and the deletion of the topology's broker objects.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt as _;
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};
use parking_lot::Mutex;
use weir::transport::TopologySpec;
use weir::transport::{nats::names as nats_names, rabbitmq};

use crate::ledger::{Ledger, WireMessage};

/// Most dead letters read at the end (a bound, far above any soak's count).
const MAX_DEAD_LETTERS: usize = 1_000_000;
/// Most stream messages re-read for the NATS backfill.
const MAX_BACKFILL: u64 = 5_000_000;

/// A connection of the soak's own to the real broker (never through a proxy).
pub enum Broker {
    /// RabbitMQ: a confirming publisher channel and a channel for reads.
    Rabbit {
        /// The connection.
        conn: Connection,
        /// Publisher confirms on.
        publisher: lapin::Channel,
        /// Consumes the observer queue, reads the dead-letter queue.
        reader: lapin::Channel,
    },
    /// NATS.
    Nats {
        /// Core client.
        client: async_nats::Client,
        /// JetStream context on it.
        js: async_nats::jetstream::Context,
    },
}

impl Broker {
    /// Connect to RabbitMQ at `url`.
    pub async fn rabbit(url: &str) -> anyhow::Result<Self> {
        let conn = Connection::connect(
            url,
            ConnectionProperties::default().with_connection_name("weir-soak".into()),
        )
        .await
        .with_context(|| {
            format!(
                "weir-soak: connecting to RabbitMQ at {}",
                weir::cluster::postgres::redact(url)
            )
        })?;
        let publisher = conn.create_channel().await.context("opening the publisher channel")?;
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .context("enabling publisher confirms")?;
        let reader = conn.create_channel().await.context("opening the reader channel")?;
        Ok(Self::Rabbit {
            conn,
            publisher,
            reader,
        })
    }

    /// Connect to NATS at `url`.
    pub async fn nats(url: &str) -> anyhow::Result<Self> {
        let client = async_nats::ConnectOptions::new()
            .name("weir-soak")
            .subscription_capacity(1 << 18)
            .connection_timeout(Duration::from_secs(5))
            .connect(url)
            .await
            .with_context(|| format!("weir-soak: connecting to NATS at {url}"))?;
        let js = async_nats::jetstream::new(client.clone());
        Ok(Self::Nats { client, js })
    }

    /// Publish `body` with `headers` to `slot` of `topology` and wait for the confirm.
    pub async fn publish(
        &self,
        topology: &str,
        slot: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> anyhow::Result<()> {
        match self {
            Self::Rabbit { publisher, .. } => {
                let mut table = FieldTable::default();
                for (k, v) in headers {
                    table.insert(ShortString::from(*k), AMQPValue::LongString((*v).into()));
                }
                let mut props = BasicProperties::default().with_delivery_mode(2).with_headers(table);
                if let Some((_, id)) = headers.iter().find(|(k, _)| *k == "weir-message-id") {
                    props = props.with_message_id(ShortString::from(*id));
                }
                let exchange = rabbitmq::names::exchange(topology);
                let confirm = publisher
                    .basic_publish(
                        exchange.as_str().into(),
                        slot.to_string().as_str().into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        body,
                        props,
                    )
                    .await
                    .with_context(|| format!("publishing to {exchange} key {slot}"))?
                    .await
                    .with_context(|| format!("the confirm of a publish to {exchange} key {slot}"))?;
                match confirm {
                    Confirmation::Ack(None) => Ok(()),
                    Confirmation::Ack(Some(r)) => {
                        anyhow::bail!("{exchange} key {slot} is unroutable: {} {}", r.reply_code, r.reply_text)
                    }
                    Confirmation::Nack(_) => anyhow::bail!("the broker nacked a publish to {exchange} key {slot}"),
                    Confirmation::NotRequested => anyhow::bail!("publish to {exchange} was not confirmed"),
                }
            }
            Self::Nats { js, .. } => {
                let mut h = async_nats::HeaderMap::new();
                for (k, v) in headers {
                    h.append(*k, *v);
                }
                let subject = format!("weir.{topology}.slot.{slot}");
                let ack = js
                    .publish_with_headers(subject.clone(), h, bytes::Bytes::copy_from_slice(body))
                    .await
                    .with_context(|| format!("publishing to {subject}"))?;
                tokio::time::timeout(Duration::from_secs(10), ack)
                    .await
                    .with_context(|| format!("no PubAck for {subject} within 10s"))?
                    .with_context(|| format!("the PubAck of a publish to {subject}"))?;
                Ok(())
            }
        }
    }

    /// Publish `body` with `headers` to the ingress of `topology` (RabbitMQ:
    /// the default exchange with the ingress queue's name; NATS: the ingress
    /// subject) and wait for the confirm. A node forwards it to its slot.
    pub async fn publish_ingress(&self, topology: &str, headers: &[(&str, &str)], body: &[u8]) -> anyhow::Result<()> {
        match self {
            Self::Rabbit { publisher, .. } => {
                let mut table = FieldTable::default();
                for (k, v) in headers {
                    table.insert(ShortString::from(*k), AMQPValue::LongString((*v).into()));
                }
                let props = BasicProperties::default().with_delivery_mode(2).with_headers(table);
                let queue = rabbitmq::names::ingress(topology);
                let confirm = publisher
                    .basic_publish(
                        "".into(),
                        queue.as_str().into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        body,
                        props,
                    )
                    .await
                    .with_context(|| format!("publishing to {queue}"))?
                    .await
                    .with_context(|| format!("the confirm of a publish to {queue}"))?;
                match confirm {
                    Confirmation::Ack(None) => Ok(()),
                    Confirmation::Ack(Some(r)) => {
                        anyhow::bail!("{queue} is unroutable: {} {}", r.reply_code, r.reply_text)
                    }
                    Confirmation::Nack(_) => anyhow::bail!("the broker nacked a publish to {queue}"),
                    Confirmation::NotRequested => anyhow::bail!("publish to {queue} was not confirmed"),
                }
            }
            Self::Nats { js, .. } => {
                let mut h = async_nats::HeaderMap::new();
                for (k, v) in headers {
                    h.append(*k, *v);
                }
                let subject = nats_names::ingress(topology);
                let ack = js
                    .publish_with_headers(subject.clone(), h, bytes::Bytes::copy_from_slice(body))
                    .await
                    .with_context(|| format!("publishing to {subject}"))?;
                tokio::time::timeout(Duration::from_secs(10), ack)
                    .await
                    .with_context(|| format!("no PubAck for {subject} within 10s"))?
                    .with_context(|| format!("the PubAck of a publish to {subject}"))?;
                Ok(())
            }
        }
    }

    /// Start seeing every message published to a slot of `topology`;
    /// records them in `ledger`. The task ends when the connection does.
    pub async fn observe(
        &self,
        topology: &str,
        slots: u32,
        ledger: Arc<Mutex<Ledger>>,
    ) -> anyhow::Result<tokio::task::JoinHandle<()>> {
        match self {
            Self::Rabbit { reader, .. } => {
                let queue = format!("weir-soak.{topology}.observer");
                reader
                    .queue_declare(
                        queue.as_str().into(),
                        QueueDeclareOptions {
                            exclusive: true,
                            auto_delete: true,
                            ..QueueDeclareOptions::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .with_context(|| format!("declaring the observer queue {queue}"))?;
                let exchange = rabbitmq::names::exchange(topology);
                for slot in 0..slots {
                    reader
                        .queue_bind(
                            queue.as_str().into(),
                            exchange.as_str().into(),
                            slot.to_string().as_str().into(),
                            QueueBindOptions::default(),
                            FieldTable::default(),
                        )
                        .await
                        .with_context(|| format!("binding {queue} to {exchange} with key {slot}"))?;
                }
                let mut consumer = reader
                    .basic_consume(
                        queue.as_str().into(),
                        "weir-soak-observer".into(),
                        BasicConsumeOptions {
                            no_ack: true,
                            ..BasicConsumeOptions::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .with_context(|| format!("consuming {queue}"))?;
                Ok(tokio::spawn(async move {
                    while let Some(Ok(d)) = consumer.next().await {
                        let m = rabbit_message(&d.properties, &d.data);
                        ledger.lock().saw(m);
                    }
                    ledger.lock().observer_ended = true;
                }))
            }
            Self::Nats { client, .. } => {
                let subject = format!("weir.{topology}.slot.*");
                let mut sub = client
                    .subscribe(subject.clone())
                    .await
                    .with_context(|| format!("subscribing to {subject}"))?;
                // The subscription is registered once the server answered a flush.
                client.flush().await.context("flushing the observer subscription")?;
                Ok(tokio::spawn(async move {
                    while let Some(m) = sub.next().await {
                        let w = nats_message(m.headers.as_ref(), &m.payload);
                        ledger.lock().saw(w);
                    }
                    ledger.lock().observer_ended = true;
                }))
            }
        }
    }

    /// NATS only: re-read the work stream and record what the core
    /// subscription missed (core delivery is at-most-once). Returns how many
    /// interval reports only the stream had.
    pub async fn backfill(&self, topology: &str, ledger: &Mutex<Ledger>) -> anyhow::Result<usize> {
        let Self::Nats { js, .. } = self else {
            return Ok(0);
        };
        let name = nats_names::stream(topology);
        let mut stream = js
            .get_stream(&name)
            .await
            .with_context(|| format!("reading stream {name}"))?;
        let state = stream
            .info()
            .await
            .with_context(|| format!("stream info of {name}"))?
            .state
            .clone();
        let before = ledger.lock().interval_count();
        let last = state
            .last_sequence
            .min(state.first_sequence.saturating_add(MAX_BACKFILL));
        for seq in state.first_sequence.max(1)..=last {
            match stream.get_raw_message(seq).await {
                Ok(m) => {
                    let w = nats_message(Some(&m.headers), &m.payload);
                    ledger.lock().saw_backfill(w);
                }
                Err(_) => continue, // deleted or a gap: nothing to see
            }
        }
        Ok(ledger.lock().interval_count() - before)
    }

    /// Messages waiting in the dead-letter destination, when the broker can say cheaply.
    pub async fn dead_letter_depth(&self, topology: &str) -> Option<u64> {
        match self {
            Self::Rabbit { reader, .. } => {
                let q = rabbitmq::names::dead_letter(topology);
                reader
                    .queue_declare(
                        q.as_str().into(),
                        QueueDeclareOptions {
                            passive: true,
                            ..QueueDeclareOptions::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .ok()
                    .map(|q| u64::from(q.message_count()))
            }
            Self::Nats { js, .. } => {
                let mut s = js.get_stream(nats_names::dead_letter_stream(topology)).await.ok()?;
                s.info().await.ok().map(|i| i.state.messages)
            }
        }
    }

    /// Every dead letter of `topology`, read (and on RabbitMQ taken) at the end.
    pub async fn dead_letters(&self, topology: &str) -> anyhow::Result<Vec<WireMessage>> {
        let mut out = Vec::new();
        match self {
            Self::Rabbit { reader, .. } => {
                let q = rabbitmq::names::dead_letter(topology);
                while out.len() < MAX_DEAD_LETTERS {
                    let got = reader
                        .basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
                        .await
                        .with_context(|| format!("reading the dead-letter queue {q}"))?;
                    let Some(m) = got else { break };
                    out.push(rabbit_message(&m.delivery.properties, &m.delivery.data));
                }
            }
            Self::Nats { js, .. } => {
                let name = nats_names::dead_letter_stream(topology);
                let Ok(mut stream) = js.get_stream(&name).await else {
                    return Ok(out); // never created: no dead letters
                };
                let state = stream
                    .info()
                    .await
                    .with_context(|| format!("stream info of {name}"))?
                    .state
                    .clone();
                if state.messages > 0 {
                    for seq in state.first_sequence.max(1)..=state.last_sequence {
                        if out.len() >= MAX_DEAD_LETTERS {
                            break;
                        }
                        if let Ok(m) = stream.get_raw_message(seq).await {
                            out.push(nats_message(Some(&m.headers), &m.payload));
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// Delete the topology's broker objects (best effort; errors are returned for the log).
    pub async fn delete_topology(&self, spec: &TopologySpec) -> Vec<String> {
        let mut errors = Vec::new();
        match self {
            Self::Rabbit { conn, .. } => {
                let Ok(ch) = conn.create_channel().await else {
                    return vec!["no channel for the cleanup".into()];
                };
                let rungs = rabbitmq::rungs(spec);
                for q in rabbitmq::names::queues(&spec.name, spec.slots, &rungs) {
                    if let Err(e) = ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await {
                        errors.push(format!("deleting queue {q}: {e}"));
                    }
                }
                for e in rabbitmq::names::exchanges(&spec.name, &rungs) {
                    if let Err(err) = ch.exchange_delete(e.as_str().into(), Default::default()).await {
                        errors.push(format!("deleting exchange {e}: {err}"));
                    }
                }
            }
            Self::Nats { js, .. } => {
                for s in [
                    nats_names::stream(&spec.name),
                    nats_names::dead_letter_stream(&spec.name),
                ] {
                    if let Err(e) = js.delete_stream(&s).await {
                        errors.push(format!("deleting stream {s}: {e}"));
                    }
                }
            }
        }
        errors
    }

    /// Close the connection.
    pub async fn close(self) {
        match self {
            Self::Rabbit { conn, .. } => {
                let _ = conn.close(200, "weir-soak done".into()).await;
            }
            Self::Nats { client, .. } => {
                let _ = client.drain().await;
            }
        }
    }
}

fn amqp_text(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::ByteArray(b) => Some(String::from_utf8_lossy(b.as_slice()).into_owned()),
        AMQPValue::LongLongInt(n) => Some(n.to_string()),
        AMQPValue::LongInt(n) => Some(n.to_string()),
        AMQPValue::LongUInt(n) => Some(n.to_string()),
        _ => None,
    }
}

fn rabbit_message(props: &BasicProperties, body: &[u8]) -> WireMessage {
    let mut headers = Vec::new();
    if let Some(t) = props.headers().as_ref() {
        for (k, v) in t.inner() {
            if let Some(v) = amqp_text(v) {
                headers.push((k.as_str().to_owned(), v));
            }
        }
    }
    WireMessage {
        headers,
        body: body.to_vec(),
    }
}

fn nats_message(h: Option<&async_nats::HeaderMap>, body: &[u8]) -> WireMessage {
    let mut headers = Vec::new();
    if let Some(h) = h {
        for (name, values) in h.iter() {
            for v in values {
                headers.push((AsRef::<str>::as_ref(name).to_owned(), v.as_str().to_owned()));
            }
        }
    }
    WireMessage {
        headers,
        body: body.to_vec(),
    }
}
