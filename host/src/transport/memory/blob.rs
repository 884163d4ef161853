//! The memory broker's copy of a message: one flat, shared buffer that a
//! queue keeps and a delivery decodes straight from.

use std::sync::Arc;

use crate::envelope::{self, Wire};

/// A [`Wire`] as one flat, shared buffer: the body first, then the headers.
/// Storing one costs one allocation, not one per header, and holding it
/// for a requeue costs a reference count. Only [`Blob::of`] makes one, so
/// every string in it is a `&str` it wrote, at the lengths it wrote.
#[derive(Debug, Clone)]
pub(super) struct Blob(Arc<[u8]>);

impl Blob {
    pub(super) fn of(w: &Wire) -> Self {
        let len = 8 + w.body.len() + w.headers.iter().map(|(k, v)| 8 + k.len() + v.len()).sum::<usize>();
        let mut b = Vec::with_capacity(len);
        b.extend_from_slice(&(w.body.len() as u32).to_le_bytes());
        b.extend_from_slice(&w.body);
        b.extend_from_slice(&(w.headers.len() as u32).to_le_bytes());
        for (k, v) in &w.headers {
            b.extend_from_slice(&(k.len() as u32).to_le_bytes());
            b.extend_from_slice(k.as_bytes());
            b.extend_from_slice(&(v.len() as u32).to_le_bytes());
            b.extend_from_slice(v.as_bytes());
        }
        Self(b.into())
    }

    /// The body, and the headers as borrowed pairs.
    fn parts(&self) -> (&[u8], impl Iterator<Item = (&str, &str)>) {
        let mut r = Reader(&self.0);
        let body_len = r.len();
        let body = r.bytes(body_len);
        let n = r.len();
        (body, (0..n).map(move |_| (r.str(), r.str())))
    }
}

/// Reads a [`Blob`] back, in the order [`Blob::of`] wrote it.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        head
    }
    fn len(&mut self) -> usize {
        u32::from_le_bytes(self.bytes(4).try_into().unwrap_or_default()) as usize
    }
    fn str(&mut self) -> &'a str {
        let n = self.len();
        let bytes = self.bytes(n);
        // SAFETY: a `Reader` reads only a `Blob`, and reads it in the order
        // and at the lengths `Blob::of` wrote it: these bytes are exactly
        // one `&str` it copied in, so UTF-8. (Validating them again was
        // 1 400 instructions a message, more than the rest of the decode.)
        unsafe { std::str::from_utf8_unchecked(bytes) }
    }
}

fn from_blob(b: &Blob) -> Wire {
    let (body, headers) = b.parts();
    Wire {
        headers: headers.map(|(k, v)| (k.to_owned(), v.to_owned())).collect(),
        body: body.to_vec(),
    }
}

/// Decode a delivery straight from the broker's blob: only what the
/// envelope keeps is copied ([`envelope::decode_pairs`]); one that does not
/// decode is rebuilt whole for [`envelope::decode`], which names why.
pub(super) fn decode_blob(b: &Blob, seq: u64) -> Result<envelope::Envelope, (Wire, envelope::DecodeError)> {
    let fallback = || format!("memory-{seq}");
    let (body, headers) = b.parts();
    let pairs = headers.map(|(k, v)| (k, std::borrow::Cow::Borrowed(v)));
    match envelope::decode_pairs(pairs, fallback, None) {
        Some(mut env) => {
            env.payload = body.to_vec();
            Ok(env)
        }
        None => envelope::decode(from_blob(b), fallback, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_copy_round_trips_headers_and_body() {
        let w = Wire {
            headers: vec![
                ("weir-message-id".into(), "m-1".into()),
                ("x".into(), String::new()),
                ("ü".into(), "v".into()),
            ],
            body: vec![0, 1, 2, 255],
        };
        assert_eq!(from_blob(&Blob::of(&w)), w);
        assert_eq!(from_blob(&Blob::of(&Wire::default())), Wire::default());
    }

    #[test]
    fn a_delivery_decoded_from_the_blob_is_what_decode_makes() {
        let wire = |headers: &[(&str, &str)]| Wire {
            headers: headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            body: b"payload".to_vec(),
        };
        for w in [
            wire(&[
                ("weir-message-id", "m-1"),
                ("weir-message-type", "t"),
                ("weir-group-id", "g"),
                ("weir-attempt", "3"),
                ("x-trace", "ü"),
            ]),
            wire(&[("weir-message-type", "t")]),
            // Neither decodes: the error names why and keeps the wire whole.
            wire(&[("weir-message-id", "m-2")]),
            wire(&[("weir-message-type", "t"), ("weir-attempt", "zero")]),
        ] {
            // (The WIT record has no `PartialEq`; its `Debug` shows every field.)
            assert_eq!(
                format!("{:?}", decode_blob(&Blob::of(&w), 7)),
                format!("{:?}", envelope::decode(w.clone(), || "memory-7".to_owned(), None))
            );
        }
    }
}
