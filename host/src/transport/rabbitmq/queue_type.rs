//! `transport.queue_type`: the queue arguments of each kind of queue Weir
//! declares (classic or quorum), the server version read at connect, and the
//! check that refuses a combination the server cannot honour.
//!
//! Quorum queues (RabbitMQ 3.8+) are replicated over the cluster's nodes.
//! What Weir needs of them, and since when RabbitMQ has it:
//! - single active consumer on slot and ingress queues: 3.8;
//! - per-queue message TTL (`x-message-ttl`), which the retry rungs are made
//!   of: 3.10 (per-message TTL, `expiration`, is not used by Weir);
//! - at-least-once dead-lettering (`x-dead-letter-strategy = at-least-once`
//!   with `x-overflow = reject-publish`), so a rung that expires a message
//!   into its slot queue keeps it until the slot queue has confirmed it:
//!   3.10 (at-most-once before, which can lose the message).
//!
//! `x-delivery-limit`: Weir's retry ladder never returns a failed message to
//! its queue; it publishes a new copy to a rung with `weir-attempt` + 1 and
//! acks the old one, so the broker's delivery count of a copy counts only
//! returns (a drain's release, a deferred dead-letter capture, a lost
//! connection), never handler failures. `max_deliver` is counted by the host
//! on `weir-attempt`. A limit taken from `max_deliver` would therefore let the
//! broker dead-letter or drop a message after a few drains, behind the
//! host's back. So the limit is set explicitly (RabbitMQ 4 defaults it to
//! 20) to [`DELIVERY_LIMIT`], and slot and ingress queues dead-letter (at
//! least once) into the topology's dead-letter queue: should it ever be
//! reached, the message is kept there, never dropped.

use std::fmt;

use lapin::types::{AMQPValue, FieldTable};

use crate::transport::{ErrorKind, TransportError};

pub use crate::config::QueueType;

/// The `x-delivery-limit` of every quorum queue Weir declares (module docs):
/// the largest AMQP signed 32-bit integer, so that only returns that never
/// end could reach it (about 68 years of one return a second).
pub const DELIVERY_LIMIT: i32 = i32::MAX;

/// A server version as `major.minor.patch` (what RabbitMQ's `version` server
/// property holds; a suffix such as `-rc.1` or `+…` is ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub u32, pub u32, pub u32);

impl Version {
    /// Parse `3.10.7`, `3.12.0-rc.1`, `4.0.5+2.gabc`; `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        let core = s.trim().split(['-', '+', ' ']).next()?;
        let mut it = core.split('.').map(str::parse::<u32>);
        let major = it.next()?.ok()?;
        let minor = it.next().unwrap_or(Ok(0)).ok()?;
        let patch = it.next().unwrap_or(Ok(0)).ok()?;
        Some(Self(major, minor, patch))
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// First version with quorum queues.
pub const QUORUM_SINCE: Version = Version(3, 8, 0);
/// First version whose quorum queues have message TTL and at-least-once
/// dead-lettering (the retry rungs need both).
pub const QUORUM_TTL_SINCE: Version = Version(3, 10, 0);

/// Refuse `queue_type` on a server of `version` (`None`: unknown, e.g. TLS,
/// where the version is not read: then the declarations themselves decide)
/// for a topology with `rungs` retry rungs. The error names the key.
pub fn check(
    queue_type: QueueType,
    version: Option<Version>,
    topology: &str,
    rungs: usize,
) -> Result<(), TransportError> {
    let (QueueType::Quorum, Some(v)) = (queue_type, version) else {
        return Ok(());
    };
    let refuse = |why: String| {
        Err(TransportError::new(
            ErrorKind::Invalid,
            format!("transport.queue_type = \"quorum\" cannot be honoured by RabbitMQ {v}: {why}"),
        ))
    };
    if v < QUORUM_SINCE {
        return refuse(format!(
            "quorum queues need RabbitMQ {QUORUM_SINCE} or later; accepted on this server: queue_type = \"classic\""
        ));
    }
    if rungs > 0 && v < QUORUM_TTL_SINCE {
        return refuse(format!(
            "topology `{topology}` has a retry ladder, whose rung queues need message TTL and at-least-once \
             dead-lettering on quorum queues (RabbitMQ {QUORUM_TTL_SINCE} or later); accepted on this server: \
             queue_type = \"classic\", or a topology without a ladder"
        ));
    }
    Ok(())
}

/// What a queue is for: each kind gets its own arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A slot queue (single active consumer unless a test's negative control).
    Slot {
        /// Single active consumer.
        sac: bool,
    },
    /// The ingress queue (single active consumer).
    Ingress,
    /// The dead-letter queue.
    DeadLetter,
    /// A retry rung: messages expire after `ttl_ms` into the topology's
    /// exchange.
    Rung {
        /// Per-queue message TTL.
        ttl_ms: i64,
    },
}

/// The arguments of a queue of `role` for `queue_type`, and the shape shown
/// in a mismatch error. `dead_letter_queue`: the topology's dead-letter
/// queue (the safety net of quorum slot and ingress queues); `exchange`: the
/// topology's exchange (where rungs expire to).
pub fn arguments(queue_type: QueueType, role: Role, exchange: &str, dead_letter_queue: &str) -> (FieldTable, String) {
    let mut args = FieldTable::default();
    let mut shape: Vec<String> = vec![format!("durable {queue_type} queue")];
    let mut put = |k: &str, v: AMQPValue, shown: String| {
        args.insert(k.into(), v);
        shape.push(shown);
    };
    let quorum = queue_type == QueueType::Quorum;
    if quorum {
        put(
            "x-queue-type",
            AMQPValue::LongString("quorum".into()),
            "x-queue-type = quorum".into(),
        );
        put(
            "x-delivery-limit",
            AMQPValue::LongInt(DELIVERY_LIMIT),
            format!("x-delivery-limit = {DELIVERY_LIMIT}"),
        );
    }
    let at_least_once = |put: &mut dyn FnMut(&str, AMQPValue, String)| {
        put(
            "x-dead-letter-strategy",
            AMQPValue::LongString("at-least-once".into()),
            "x-dead-letter-strategy = at-least-once".into(),
        );
        put(
            "x-overflow",
            AMQPValue::LongString("reject-publish".into()),
            "x-overflow = reject-publish".into(),
        );
    };
    let sac = match role {
        Role::Slot { sac } => sac,
        Role::Ingress => true,
        Role::DeadLetter | Role::Rung { .. } => false,
    };
    if sac {
        put(
            "x-single-active-consumer",
            AMQPValue::Boolean(true),
            "x-single-active-consumer = true".into(),
        );
    }
    if quorum && matches!(role, Role::Slot { .. } | Role::Ingress) {
        put(
            "x-dead-letter-exchange",
            AMQPValue::LongString("".into()),
            "x-dead-letter-exchange = \"\"".into(),
        );
        put(
            "x-dead-letter-routing-key",
            AMQPValue::LongString(dead_letter_queue.into()),
            format!("x-dead-letter-routing-key = {dead_letter_queue}"),
        );
        at_least_once(&mut put);
    }
    if let Role::Rung { ttl_ms, .. } = role {
        put(
            "x-message-ttl",
            AMQPValue::LongLongInt(ttl_ms),
            format!("x-message-ttl = {ttl_ms}"),
        );
        put(
            "x-dead-letter-exchange",
            AMQPValue::LongString(exchange.into()),
            format!("x-dead-letter-exchange = {exchange}"),
        );
        if quorum {
            at_least_once(&mut put);
        }
    }
    (args, shape.join(", "))
}

/// Read the `version` server property of the AMQP server at `url` (plain
/// `amqp://` only: `None` for `amqps://` or when it cannot be read) from the
/// `connection.start` it sends after the protocol header; the connection is
/// dropped right after, before any login.
pub async fn server_version(url: &str) -> Option<Version> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let rest = url.strip_prefix("amqp://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let hostport = authority.rsplit('@').next()?;
    let addr = if hostport.starts_with('[') {
        if hostport.contains("]:") {
            hostport.to_owned()
        } else {
            format!("{hostport}:5672")
        }
    } else if hostport.contains(':') {
        hostport.to_owned()
    } else {
        format!("{hostport}:5672")
    };
    let read = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(b"AMQP\x00\x00\x09\x01").await.ok()?;
        let mut head = [0u8; 7];
        s.read_exact(&mut head).await.ok()?;
        let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
        if head[0] != 1 || size > 1 << 20 {
            return None;
        }
        let mut payload = vec![0u8; size];
        s.read_exact(&mut payload).await.ok()?;
        version_of_start(&payload)
    };
    tokio::time::timeout(std::time::Duration::from_secs(5), read)
        .await
        .ok()
        .flatten()
}

/// The `version` server property of a `connection.start` method payload.
fn version_of_start(p: &[u8]) -> Option<Version> {
    // class 10, method 10, version-major, version-minor, then the table.
    if p.get(0..4)? != [0, 10, 0, 10] {
        return None;
    }
    let len = u32::from_be_bytes(p.get(6..10)?.try_into().ok()?) as usize;
    let table = p.get(10..10 + len)?;
    let mut i = 0;
    while i < table.len() {
        let name_len = usize::from(*table.get(i)?);
        let name = table.get(i + 1..i + 1 + name_len)?;
        i += 1 + name_len;
        let kind = *table.get(i)?;
        i += 1;
        let skip = match kind {
            b'S' | b'F' | b'A' | b'x' => {
                let n = u32::from_be_bytes(table.get(i..i + 4)?.try_into().ok()?) as usize;
                if kind == b'S' && name == b"version" {
                    return Version::parse(std::str::from_utf8(table.get(i + 4..i + 4 + n)?).ok()?);
                }
                4 + n
            }
            b's' => 1 + usize::from(*table.get(i)?),
            b't' | b'b' | b'B' => 1,
            b'U' | b'u' => 2,
            b'I' | b'i' | b'f' => 4,
            b'L' | b'l' | b'd' | b'T' => 8,
            b'D' => 5,
            b'V' => 0,
            _ => return None,
        };
        i += skip;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_order() {
        assert_eq!(Version::parse("3.10.7"), Some(Version(3, 10, 7)));
        assert_eq!(Version::parse("3.12.0-rc.1"), Some(Version(3, 12, 0)));
        assert_eq!(Version::parse("4.0"), Some(Version(4, 0, 0)));
        assert_eq!(Version::parse("x"), None);
        assert!(Version(3, 9, 29) < QUORUM_TTL_SINCE);
        assert!(Version(3, 10, 0) >= QUORUM_TTL_SINCE);
    }

    #[test]
    fn quorum_with_a_ladder_needs_3_10_and_the_error_names_the_key() {
        let e = check(QueueType::Quorum, Some(Version(3, 9, 13)), "orders", 2).unwrap_err();
        assert!(e.to_string().contains("transport.queue_type"), "{e}");
        assert!(e.to_string().contains("3.10.0"), "{e}");
        assert!(check(QueueType::Quorum, Some(Version(3, 9, 13)), "orders", 0).is_ok());
        assert!(check(QueueType::Quorum, Some(Version(3, 7, 0)), "orders", 0).is_err());
        assert!(check(QueueType::Quorum, Some(Version(3, 10, 7)), "orders", 2).is_ok());
        assert!(check(QueueType::Classic, Some(Version(3, 7, 0)), "orders", 2).is_ok());
        assert!(check(QueueType::Quorum, None, "orders", 2).is_ok());
    }

    #[test]
    fn quorum_queues_get_an_explicit_delivery_limit_and_at_least_once_dead_lettering() {
        let (args, shape) = arguments(
            QueueType::Quorum,
            Role::Rung { ttl_ms: 1000 },
            "weir.t",
            "weir.t.dead-letter",
        );
        let a = args.inner();
        assert!(a.contains_key("x-delivery-limit"), "{shape}");
        assert_eq!(
            a.get("x-dead-letter-strategy"),
            Some(&AMQPValue::LongString("at-least-once".into()))
        );
        assert_eq!(
            a.get("x-overflow"),
            Some(&AMQPValue::LongString("reject-publish".into()))
        );
        let (slot, _) = arguments(
            QueueType::Quorum,
            Role::Slot { sac: true },
            "weir.t",
            "weir.t.dead-letter",
        );
        assert_eq!(
            slot.inner().get("x-single-active-consumer"),
            Some(&AMQPValue::Boolean(true))
        );
        assert_eq!(
            slot.inner().get("x-dead-letter-routing-key"),
            Some(&AMQPValue::LongString("weir.t.dead-letter".into()))
        );
        let (classic, _) = arguments(QueueType::Classic, Role::DeadLetter, "weir.t", "weir.t.dead-letter");
        assert!(classic.inner().is_empty());
    }

    #[test]
    fn the_version_is_read_from_a_connection_start() {
        let mut table = Vec::new();
        table.push(4u8);
        table.extend_from_slice(b"caps");
        table.push(b'F');
        table.extend_from_slice(&2u32.to_be_bytes());
        table.extend_from_slice(&[0, 0]);
        table.push(7u8);
        table.extend_from_slice(b"version");
        table.push(b'S');
        table.extend_from_slice(&6u32.to_be_bytes());
        table.extend_from_slice(b"3.10.7");
        let mut p = vec![0, 10, 0, 10, 0, 9];
        p.extend_from_slice(&u32::try_from(table.len()).unwrap().to_be_bytes());
        p.extend_from_slice(&table);
        assert_eq!(version_of_start(&p), Some(Version(3, 10, 7)));
    }
}
