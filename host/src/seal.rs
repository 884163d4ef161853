//! Weir's own headers are Weir's. A message Weir sends back to a slot with
//! headers that change how Weir treats it (a retry's `weir-attempt` where
//! the host counts attempts, a redrive's `weir-redrive-*` and
//! `weir-handler-pin`) carries `weir-seal`: an HMAC-SHA256, with a key only
//! the cluster holds, over the message's identity, those headers and its
//! payload. When a delivery arrives, [`Seal::admit`] checks it before
//! anything reads a `weir-*` header: a delivery whose `weir-*` headers carry
//! no valid seal came from a publisher or a guest, so each of them is moved
//! under an `untrusted-` name (kept for the operator, read by nothing) and
//! the attempt it claims counts as 1.
//!
//! The identity headers a publisher sets on purpose (`weir-message-id`,
//! `weir-message-type`, `weir-group-id`, `weir-tenant-id`) are the
//! envelope's fields, not sealed headers; `weir-binary-headers` is the
//! transport's own encoding note. Where the key comes from is [`key`]'s
//! business.

pub mod key;

use hmac::{Hmac, Mac as _};

use crate::envelope::{Envelope, Wire, header};

type HmacSha256 = Hmac<sha2::Sha256>;

/// The prefix an unsealed `weir-*` header is moved under.
pub const UNTRUSTED: &str = "untrusted-";

/// A sealed header: a `weir-*` name (in any case) that is not one of the
/// envelope's own fields, the transport's encoding note, or the seal.
pub fn is_sealed_name(name: &str) -> bool {
    name.len() > 5
        && name.as_bytes()[..5].eq_ignore_ascii_case(b"weir-")
        && !header::DERIVED.contains(&name)
        && name != header::BINARY_HEADERS
        && name != header::SEAL
}

/// What [`Seal::admit`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// No sealed header and no claimed attempt: nothing to check.
    Clean,
    /// Its `weir-*` headers carry a valid seal: they are Weir's.
    Sealed,
    /// They did not: this many headers were moved under `untrusted-` names
    /// (the attempt it claimed counts as one).
    Untrusted(usize),
}

/// The cluster's sealing key. Cheap to clone.
#[derive(Clone)]
pub struct Seal {
    mac: HmacSha256,
    /// Where the key came from, for logs and errors.
    origin: std::sync::Arc<str>,
    /// The negative control: every delivery is taken as sealed.
    trust_all: bool,
}

impl std::fmt::Debug for Seal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seal")
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

/// Append `part` with its length, so no two sequences of parts run together.
fn part(mac: &mut HmacSha256, bytes: &[u8]) {
    mac.update(&(bytes.len() as u64).to_le_bytes());
    mac.update(bytes);
}

fn opt(mac: &mut HmacSha256, value: Option<&str>) {
    match value {
        None => mac.update(&[0]),
        Some(v) => {
            mac.update(&[1]);
            part(mac, v.as_bytes());
        }
    }
}

impl Seal {
    /// A seal with `key` (at least 32 bytes); `origin` says where it came from.
    pub fn new(key: &[u8], origin: impl Into<String>) -> anyhow::Result<Self> {
        anyhow::ensure!(
            key.len() >= 32,
            "a sealing key must have at least 32 bytes, not {}",
            key.len()
        );
        let mac = HmacSha256::new_from_slice(key).map_err(|e| anyhow::anyhow!("sealing key: {e}"))?;
        Ok(Self {
            mac,
            origin: std::sync::Arc::from(origin.into()),
            trust_all: false,
        })
    }

    /// Negative control for the tests, never for production: this seal
    /// takes every delivery's `weir-*` headers as Weir's, as Weir did
    /// before it sealed them.
    #[doc(hidden)]
    #[must_use]
    pub fn negative_control_trusting_everything(mut self) -> Self {
        self.trust_all = true;
        self
    }

    /// A key of this process alone (nothing else can check what it seals).
    pub fn ephemeral() -> Self {
        let key: [u8; 32] = rand::random();
        Self::new(&key, "a key of this process only").unwrap_or_else(|_| unreachable!("32 bytes"))
    }

    /// Where the key came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The MAC of `env` (its attempt when `attempt` is set), over every
    /// sealed header in a fixed order (brokers reorder headers).
    fn mac(&self, env: &Envelope, attempt: Option<u32>) -> [u8; 32] {
        let mut mac = self.mac.clone();
        part(&mut mac, b"weir-seal/1");
        part(&mut mac, env.id.as_bytes());
        part(&mut mac, env.message_type.as_bytes());
        opt(&mut mac, env.group_id.as_deref());
        opt(&mut mac, env.tenant_id.as_deref());
        match attempt {
            None => mac.update(&[0]),
            Some(a) => {
                mac.update(&[1]);
                mac.update(&a.to_le_bytes());
            }
        }
        let mut sealed: Vec<(&str, &str)> = env
            .headers
            .iter()
            .filter(|(k, _)| is_sealed_name(k))
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        sealed.sort_unstable();
        mac.update(&(sealed.len() as u64).to_le_bytes());
        for (k, v) in sealed {
            part(&mut mac, k.as_bytes());
            part(&mut mac, v.as_bytes());
        }
        part(&mut mac, &env.payload);
        mac.finalize().into_bytes().into()
    }

    /// Seal `env` as Weir sends it back to a slot: `host_attempts` when the
    /// host counts attempts (memory, RabbitMQ), so its attempt is sealed
    /// too. A message with nothing to seal gets no seal (and costs nothing).
    pub fn sign(&self, env: &mut Envelope, host_attempts: bool) {
        env.headers.retain(|(k, _)| k != header::SEAL);
        let attempt = host_attempts.then_some(env.attempt);
        let nothing = attempt.is_none_or(|a| a == 1) && !env.headers.iter().any(|(k, _)| is_sealed_name(k));
        if nothing {
            return;
        }
        let mac = hex::encode(self.mac(env, attempt));
        env.headers.push((header::SEAL.to_owned(), mac));
    }

    /// [`Seal::sign`] for a message in its broker form (a redrive): `wire`
    /// gets its `weir-seal`. A wire that does not decode is left unsealed
    /// (the node captures it as undecodable anyway).
    pub fn sign_wire(&self, wire: &mut Wire, host_attempts: bool) {
        wire.headers.retain(|(k, _)| k != header::SEAL);
        let Some(id) = wire.header(header::MESSAGE_ID).map(str::to_owned) else {
            return;
        };
        let Ok(mut env) = crate::envelope::decode(wire.clone(), move || id, None) else {
            return;
        };
        self.sign(&mut env, host_attempts);
        if let Some((k, v)) = env.headers.into_iter().find(|(k, _)| k == header::SEAL) {
            wire.headers.push((k, v));
        }
    }

    /// A delivery that did not decode keeps its headers as received in its
    /// dead letter, but none of its `weir-*` ones as Weir's: no seal is
    /// checked (an undecodable message is never one Weir sealed), every
    /// sealed name is moved under `untrusted-`, and the seal is dropped.
    /// How many were moved.
    pub fn admit_raw(&self, wire: &mut Wire) -> usize {
        if self.trust_all {
            return 0;
        }
        wire.headers.retain(|(k, _)| k != header::SEAL);
        let mut moved = 0;
        for (k, _) in &mut wire.headers {
            if is_sealed_name(k) {
                k.insert_str(0, UNTRUSTED);
                moved += 1;
            }
        }
        moved
    }

    /// Check a delivery's `weir-*` headers before anything reads them (see
    /// the module docs). The seal itself is removed either way: a handler
    /// never sees it.
    pub fn admit(&self, env: &mut Envelope, host_attempts: bool) -> Admission {
        let claimed = host_attempts && env.attempt != 1;
        let mut seal = None;
        let mut sealed = false;
        env.headers.retain_mut(|(k, v)| {
            if k == header::SEAL {
                seal.get_or_insert_with(|| std::mem::take(v));
                return false;
            }
            sealed |= is_sealed_name(k);
            true
        });
        if !sealed && !claimed && seal.is_none() {
            return Admission::Clean;
        }
        if self.trust_all {
            return Admission::Sealed;
        }
        let valid = seal.as_deref().and_then(|s| hex::decode(s).ok()).is_some_and(|given| {
            let want = self.mac(env, host_attempts.then_some(env.attempt));
            // Constant time: the comparison does not tell how much matched.
            given.len() == want.len() && given.iter().zip(want).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
        });
        if valid {
            return Admission::Sealed;
        }
        let mut moved = 0;
        for (k, _) in &mut env.headers {
            if is_sealed_name(k) {
                k.insert_str(0, UNTRUSTED);
                moved += 1;
            }
        }
        if claimed {
            env.headers
                .push((format!("{UNTRUSTED}{}", header::ATTEMPT), env.attempt.to_string()));
            env.attempt = 1;
            moved += 1;
        }
        if moved == 0 {
            // Only a seal that seals nothing: dropped, nothing else to do.
            return Admission::Clean;
        }
        Admission::Untrusted(moved)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::envelope::new_message;

    fn seal() -> Seal {
        Seal::new(&[7; 32], "test").unwrap()
    }

    fn redriven() -> Envelope {
        let mut env = new_message(
            "m-1".into(),
            "order.placed",
            Some("g".into()),
            Some("acme".into()),
            vec![
                ("x-user".into(), "kept".into()),
                (header::REDRIVE_COUNT.into(), "2".into()),
                (header::HANDLER_PIN.into(), "ab".repeat(32)),
            ],
            b"{}".to_vec(),
        );
        env.attempt = 3;
        env
    }

    #[test]
    fn a_sealed_message_is_admitted_as_it_is_even_with_its_headers_reordered() {
        let s = seal();
        let mut env = redriven();
        s.sign(&mut env, true);
        env.headers.reverse();
        let before: Vec<_> = env.headers.iter().filter(|(k, _)| k != header::SEAL).cloned().collect();
        assert_eq!(s.admit(&mut env, true), Admission::Sealed);
        assert_eq!(env.attempt, 3);
        assert_eq!(env.headers, before, "the seal is removed, nothing else changes");
    }

    #[test]
    fn forged_headers_and_attempts_are_moved_aside() {
        let s = seal();
        let mut env = redriven();
        assert_eq!(s.admit(&mut env, true), Admission::Untrusted(3));
        assert_eq!(env.attempt, 1);
        assert_eq!(env.header(header::HANDLER_PIN), None);
        assert_eq!(env.header(header::REDRIVE_COUNT), None);
        assert_eq!(env.header("untrusted-weir-redrive-count"), Some("2"));
        assert_eq!(env.header("untrusted-weir-attempt"), Some("3"));
        assert_eq!(env.header("x-user"), Some("kept"));
        // Admitting again changes nothing: untrusted names are not Weir's.
        assert_eq!(s.admit(&mut env, true), Admission::Clean);
    }

    #[test]
    fn a_seal_does_not_cover_another_payload_pin_key_or_attempt() {
        let s = seal();
        let mut signed = redriven();
        s.sign(&mut signed, true);
        let tamper: [fn(&mut Envelope); 5] = [
            |e| e.payload = b"{\"x\":1}".to_vec(),
            |e| e.attempt = 4,
            |e| e.group_id = Some("other".into()),
            |e| {
                for (k, v) in &mut e.headers {
                    if k == header::HANDLER_PIN {
                        *v = "cd".repeat(32);
                    }
                }
            },
            |e| e.headers.push(("weir-error".into(), "forged".into())),
        ];
        for (i, t) in tamper.iter().enumerate() {
            let mut env = signed.clone();
            t(&mut env);
            assert!(
                matches!(s.admit(&mut env, true), Admission::Untrusted(_)),
                "tamper {i} passed"
            );
        }
        let mut other_key = signed.clone();
        let other = Seal::new(&[8; 32], "other").unwrap();
        assert!(matches!(other.admit(&mut other_key, true), Admission::Untrusted(_)));
    }

    #[test]
    fn where_the_broker_counts_attempts_they_are_neither_sealed_nor_reset() {
        let s = seal();
        let mut env = redriven();
        s.sign(&mut env, false);
        env.attempt = 5; // the server's delivery count
        assert_eq!(s.admit(&mut env, false), Admission::Sealed);
        assert_eq!(env.attempt, 5);
        let mut plain = new_message("m".into(), "t", None, None, vec![], vec![]);
        plain.attempt = 4;
        assert_eq!(s.admit(&mut plain, false), Admission::Clean);
        assert_eq!(plain.attempt, 4);
    }

    #[test]
    fn a_plain_message_gets_no_seal_and_names_in_any_case_are_weirs() {
        let s = seal();
        let mut plain = new_message("m".into(), "t", None, None, vec![("x".into(), "y".into())], vec![]);
        s.sign(&mut plain, true);
        assert!(plain.header(header::SEAL).is_none());
        let mut shouty = new_message(
            "m".into(),
            "t",
            None,
            None,
            vec![("Weir-Handler-Pin".into(), "z".into())],
            vec![],
        );
        assert_eq!(s.admit(&mut shouty, true), Admission::Untrusted(1));
        assert_eq!(shouty.header("untrusted-Weir-Handler-Pin"), Some("z"));
    }

    #[test]
    fn a_sealed_wire_decodes_to_a_sealed_envelope() {
        let s = seal();
        let mut wire = crate::envelope::encode(&redriven());
        s.sign_wire(&mut wire, true);
        let mut env = crate::envelope::decode(wire, || "fallback".into(), None).unwrap();
        assert_eq!(s.admit(&mut env, true), Admission::Sealed);
    }
}
