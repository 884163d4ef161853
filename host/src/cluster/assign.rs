//! The pure assignment: from (live nodes, slots, current owners) to a
//! balanced assignment that moves as few slots as possible.
//!
//! With `n` live nodes and `s` slots every node gets `s / n` slots, and
//! `s % n` of them one more. The nodes that get one more are those that
//! already hold the most (ties: the smaller node id), so that no slot moves
//! only to even out the remainder. A slot moves only when its owner is gone
//! or holds more than its quota (it gives up its highest slots); free slots
//! go, lowest first, to the node with the largest deficit (ties: the
//! smaller node id). The result depends only on the inputs, not on the
//! order the nodes are listed in.

use std::collections::BTreeMap;

/// Balanced owners for `current.len()` slots. `current[i]` is the owner of
/// slot `i` now (`None`: free, or its owner is not in `nodes`). Returns the
/// owner each slot should have; all `None` when there is no node.
pub fn assign<N: Ord + Clone>(nodes: &[N], current: &[Option<N>]) -> Vec<Option<N>> {
    let mut live: Vec<&N> = nodes.iter().collect();
    live.sort();
    live.dedup();
    if live.is_empty() {
        return vec![None; current.len()];
    }
    // Slots each live node holds now, ascending.
    let mut held: BTreeMap<&N, Vec<usize>> = live.iter().map(|n| (*n, Vec::new())).collect();
    for (slot, owner) in current.iter().enumerate() {
        if let Some(o) = owner
            && let Some(v) = held.get_mut(o)
        {
            v.push(slot);
        }
    }
    let base = current.len() / live.len();
    let extra = current.len() % live.len();
    // Who gets base + 1: the largest holders first, then the smaller id.
    let mut by_holding: Vec<&N> = live.clone();
    by_holding.sort_by(|a, b| held[b].len().cmp(&held[a].len()).then_with(|| a.cmp(b)));
    let quota: BTreeMap<&N, usize> = by_holding
        .iter()
        .enumerate()
        .map(|(i, n)| (*n, base + usize::from(i < extra)))
        .collect();

    let mut out: Vec<Option<N>> = vec![None; current.len()];
    for (node, slots) in &held {
        for &slot in slots.iter().take(quota[node]) {
            out[slot] = Some((*node).clone());
        }
    }
    let mut deficit: BTreeMap<&N, usize> = held
        .iter()
        .map(|(n, slots)| (*n, quota[n].saturating_sub(slots.len())))
        .collect();
    for free in out.iter_mut().filter(|o| o.is_none()) {
        // Largest deficit; the BTreeMap's order breaks ties by node id.
        let Some((node, _)) = deficit
            .iter()
            .filter(|(_, d)| **d > 0)
            .max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))
        else {
            break;
        };
        let node: &N = node;
        *free = Some(node.clone());
        if let Some(d) = deficit.get_mut(node) {
            *d -= 1;
        }
    }
    out
}

/// Slots whose owner differs between `a` and `b`.
pub fn moves<N: PartialEq>(a: &[Option<N>], b: &[Option<N>]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x != y).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn counts(out: &[Option<u8>], nodes: &[u8]) -> Vec<usize> {
        nodes
            .iter()
            .map(|n| out.iter().filter(|o| o.as_ref() == Some(n)).count())
            .collect()
    }

    #[test]
    fn three_nodes_six_slots_two_each() {
        let out = assign(&[1u8, 2, 3], &[None; 6]);
        assert_eq!(counts(&out, &[1, 2, 3]), vec![2, 2, 2]);
        assert_eq!(out, vec![Some(1), Some(2), Some(3), Some(1), Some(2), Some(3)]);
    }

    #[test]
    fn a_joining_node_takes_one_slot_from_each_large_holder() {
        let now = assign(&[1u8, 2], &[None; 6]);
        let next = assign(&[1u8, 2, 3], &now);
        assert_eq!(counts(&next, &[1, 2, 3]), vec![2, 2, 2]);
        assert_eq!(moves(&now, &next), 2);
    }

    #[test]
    fn a_dead_node_s_slots_go_to_the_survivors_and_nothing_else_moves() {
        let now = assign(&[1u8, 2, 3], &[None; 6]);
        let next = assign(&[1u8, 3], &now);
        assert_eq!(counts(&next, &[1, 3]), vec![3, 3]);
        assert_eq!(moves(&now, &next), 2, "only node 2's two slots move");
    }

    #[test]
    fn no_nodes_means_no_owners() {
        assert_eq!(assign::<u8>(&[], &[Some(1), None]), vec![None, None]);
    }

    fn arb_case() -> impl Strategy<Value = (Vec<u8>, Vec<Option<u8>>)> {
        (prop::collection::vec(0u8..8, 0..6), 0usize..40).prop_flat_map(|(nodes, slots)| {
            let owners = prop::collection::vec(prop::option::of(0u8..10), slots);
            (Just(nodes), owners)
        })
    }

    proptest! {
        #[test]
        fn balanced_within_one_and_every_slot_owned((nodes, current) in arb_case()) {
            let out = assign(&nodes, &current);
            let mut live = nodes.clone();
            live.sort();
            live.dedup();
            if live.is_empty() {
                prop_assert!(out.iter().all(Option::is_none));
            } else {
                prop_assert!(out.iter().all(|o| o.as_ref().is_some_and(|n| live.contains(n))));
                let c = counts(&out, &live);
                prop_assert!(c.iter().max().unwrap() - c.iter().min().unwrap() <= 1, "{c:?}");
            }
        }

        #[test]
        fn moves_are_minimal((nodes, current) in arb_case()) {
            let out = assign(&nodes, &current);
            let mut live = nodes.clone();
            live.sort();
            live.dedup();
            if !live.is_empty() {
                // A lower bound any balanced assignment must pay: slots
                // without a live owner, plus each node's excess over the
                // largest quota it could be given.
                let s = current.len();
                let (base, extra) = (s / live.len(), s % live.len());
                let mut held: Vec<usize> = counts(&current, &live);
                held.sort_unstable_by(|a, b| b.cmp(a));
                let orphans = current.iter().filter(|o| !o.as_ref().is_some_and(|n| live.contains(n))).count();
                let excess: usize = held
                    .iter()
                    .enumerate()
                    .map(|(i, h)| h.saturating_sub(base + usize::from(i < extra)))
                    .sum();
                prop_assert_eq!(moves(&current, &out), orphans + excess);
            }
        }

        #[test]
        fn deterministic_whatever_the_node_order((nodes, current) in arb_case()) {
            let mut reversed = nodes.clone();
            reversed.reverse();
            prop_assert_eq!(assign(&nodes, &current), assign(&reversed, &current));
        }

        #[test]
        fn stable_when_nothing_changed((nodes, current) in arb_case()) {
            let once = assign(&nodes, &current);
            prop_assert_eq!(assign(&nodes, &once), once);
        }
    }
}
