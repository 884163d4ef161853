//! Group id → slot: the one hash every sender, batcher and consumer uses (DESIGN.md, "Slot of a
//! group"). Pure functions only; which node owns a slot is the cluster module's business.
//!
//! `slot = jump_consistent_hash(fnv1a_64(utf8(group_id)), slot_count)`. A message without a group
//! id (or with an empty one, which is the same) is spread by its message id with the same
//! function and runs unordered; it never gets a random slot.

/// FNV-1a 64 offset basis.
const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a 64 prime.
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
/// The linear congruential multiplier of Lamping and Veach's jump consistent hash.
const JUMP_MULTIPLIER: u64 = 2_862_933_555_777_941_757;

/// FNV-1a, 64-bit, over `bytes`.
pub fn fnv1a_64(bytes: &[u8]) -> u64 {
    fnv1a_64_continue(FNV_OFFSET_BASIS, bytes)
}

/// FNV-1a, 64-bit, continued from `hash` over `bytes`: the hash of a
/// concatenation without building it (`fnv1a_64(a ++ b) ==
/// fnv1a_64_continue(fnv1a_64(a), b)`).
pub fn fnv1a_64_continue(hash: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(hash, |hash, &byte| (hash ^ u64::from(byte)).wrapping_mul(FNV_PRIME))
}

/// Lamping–Veach jump consistent hash ("A Fast, Minimal Memory, Consistent Hash Algorithm",
/// 2014): maps `key` to a bucket in `0..buckets`, moving only about `1/(n+1)` of the keys when
/// the bucket count grows from `n` to `n + 1`.
///
/// `buckets` must be at least 1 (config validation guarantees `slots >= 1`); 0 is treated as 1,
/// so the answer is always a valid index for a non-empty range and the function never panics.
pub fn jump_consistent_hash(key: u64, buckets: u32) -> u32 {
    let buckets = i64::from(buckets.max(1));
    let mut key = key;
    let mut b: i64 = -1;
    let mut j: i64 = 0;
    while j < buckets {
        b = j;
        key = key.wrapping_mul(JUMP_MULTIPLIER).wrapping_add(1);
        // As in the paper: (b + 1) * (2^31 / ((key >> 33) + 1)), in f64.
        j = ((b + 1) as f64 * ((1u64 << 31) as f64 / ((key >> 33) + 1) as f64)) as i64;
    }
    // b is in 0..buckets, and buckets <= u32::MAX.
    u32::try_from(b).unwrap_or(0)
}

/// The slot of `key` among `slot_count` slots: `jump_consistent_hash(fnv1a_64(utf8(key)))`.
pub fn slot_of(key: &str, slot_count: u32) -> u32 {
    jump_consistent_hash(fnv1a_64(key.as_bytes()), slot_count)
}

/// The group id that orders a message: an empty group id is the same as none.
pub fn group_key(group_id: Option<&str>) -> Option<&str> {
    group_id.filter(|g| !g.is_empty())
}

/// The slot a message goes to: by its group id when it has one (ordered), otherwise by its
/// message id (unordered, spread with the same function, never random).
pub fn slot_for(group_id: Option<&str>, message_id: &str, slot_count: u32) -> u32 {
    slot_of(group_key(group_id).unwrap_or(message_id), slot_count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The shared vectors: `shared/` sits beside the repository clone (locally and in CI).
    const VECTORS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/slot-hash-vectors.json");

    fn vectors() -> serde_json::Value {
        let text = std::fs::read_to_string(VECTORS)
            .unwrap_or_else(|e| panic!("reading the slot hash vectors at {VECTORS}: {e}"));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {VECTORS}: {e}"))
    }

    #[test]
    fn shared_vectors_match_fnv_and_every_slot() {
        let doc = vectors();
        let list = doc["vectors"].as_array().expect("vectors is an array");
        assert!(!list.is_empty(), "no vectors in {VECTORS}");
        let mut checked = 0;
        for v in list {
            let group = v["group_id"].as_str().expect("group_id is a string");
            let fnv = u64::from_str_radix(v["fnv1a64"].as_str().expect("fnv1a64 string"), 16).expect("fnv1a64 is hex");
            assert_eq!(fnv1a_64(group.as_bytes()), fnv, "fnv1a_64({group:?})");
            let slots = v["slot"].as_object().expect("slot is an object");
            assert!(!slots.is_empty(), "no slots for {group:?}");
            for (count, want) in slots {
                let count: u32 = count.parse().expect("slot count is a number");
                let want = u32::try_from(want.as_u64().expect("slot is a number")).expect("u32");
                assert_eq!(slot_of(group, count), want, "slot_of({group:?}, {count})");
                assert_eq!(jump_consistent_hash(fnv, count), want);
                assert_eq!(slot_for(Some(group), "ignored", count), want);
                checked += 1;
            }
        }
        assert!(checked >= list.len());
    }

    #[test]
    fn fnv_of_empty_input_is_the_offset_basis() {
        assert_eq!(fnv1a_64(b""), FNV_OFFSET_BASIS);
        assert_eq!(fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn one_bucket_is_always_zero_and_zero_buckets_does_not_panic() {
        for key in [0, 1, u64::MAX, 0xdead_beef] {
            assert_eq!(jump_consistent_hash(key, 1), 0);
            assert_eq!(jump_consistent_hash(key, 0), 0);
        }
        assert!(jump_consistent_hash(u64::MAX, u32::MAX) < u32::MAX);
    }

    #[test]
    fn missing_or_empty_group_spreads_by_message_id() {
        for n in [1, 2, 6, 64, 1024] {
            assert_eq!(slot_for(None, "msg-17", n), slot_of("msg-17", n));
            assert_eq!(slot_for(Some(""), "msg-17", n), slot_of("msg-17", n));
            assert_eq!(slot_for(Some("order-1"), "msg-17", n), slot_of("order-1", n));
        }
        assert_eq!(group_key(Some("")), None);
        assert_eq!(group_key(None), None);
        assert_eq!(group_key(Some("g")), Some("g"));
    }

    #[test]
    fn message_ids_spread_over_every_slot() {
        let n = 8;
        let mut seen = [false; 8];
        for i in 0..1000 {
            seen[slot_for(None, &format!("m{i}"), n) as usize] = true;
        }
        assert!(seen.iter().all(|s| *s), "{seen:?}");
    }

    proptest! {
        #[test]
        fn growing_slot_count_moves_keys_only_to_the_new_slot(key in any::<u64>(), n in 1u32..2048) {
            let before = jump_consistent_hash(key, n);
            let after = jump_consistent_hash(key, n + 1);
            prop_assert!(before < n);
            prop_assert!(after == before || after == n, "n={} before={} after={}", n, before, after);
        }

        #[test]
        fn string_keys_stay_or_move_to_the_new_slot(key in ".{0,40}", n in 1u32..300) {
            let before = slot_of(&key, n);
            let after = slot_of(&key, n + 1);
            prop_assert!(after == before || after == n);
        }
    }
}
