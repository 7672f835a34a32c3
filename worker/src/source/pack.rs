//! Packing rows into samples (`data.pack`): which rows share a sample.
//!
//! Best-fit decreasing, as TRL's default `packing_strategy = "bfd"`: rows
//! from the longest down (ties in file order), each into the pack with
//! the least room left that still fits it, a new pack when none does.
//! Rows are never split: a row longer than the sample was already cut to
//! it, as unpacked. Rows that feed no position (0 pairs) are left out.
//! Within a pack rows keep file order; packs are ordered by their first
//! row. A pure function of the row lengths: every rank computes the same
//! packs.

use std::collections::BTreeSet;

/// Packs of `lens` (each row's positions, at most `capacity`): each pack a
/// list of row indices whose lengths sum to at most `capacity`.
pub fn best_fit_decreasing(lens: &[usize], capacity: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lens.len()).filter(|&i| lens[i] > 0).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
    let mut packs: Vec<Vec<usize>> = Vec::new();
    // (room left, pack index): the smallest room that fits comes first.
    let mut room: BTreeSet<(usize, usize)> = BTreeSet::new();
    for i in order {
        let len = lens[i].min(capacity);
        match room.range((len, 0)..).next().copied() {
            Some((left, p)) => {
                room.remove(&(left, p));
                packs[p].push(i);
                room.insert((left - len, p));
            }
            None => {
                packs.push(vec![i]);
                room.insert((capacity - len, packs.len() - 1));
            }
        }
    }
    for p in &mut packs {
        p.sort_unstable();
    }
    packs.sort_unstable_by_key(|p| p[0]);
    packs
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rows_fill_the_fullest_pack_that_fits() {
        // 5 first, then 4 (no room beside 5 in 8), then 3 beside 5, 2
        // and 1 beside 4.
        assert_eq!(
            best_fit_decreasing(&[3, 5, 4, 2, 1], 8),
            vec![vec![0, 1], vec![2, 3, 4]]
        );
        // Empty rows are left out; full rows stand alone.
        assert_eq!(
            best_fit_decreasing(&[0, 8, 0, 8], 8),
            vec![vec![1], vec![3]]
        );
        assert!(best_fit_decreasing(&[], 8).is_empty());
    }

    proptest! {
        #[test]
        fn every_row_with_positions_is_in_one_pack_within_capacity(
            lens in proptest::collection::vec(0usize..20, 0..60), capacity in 1usize..24,
        ) {
            let lens: Vec<usize> = lens.into_iter().map(|l| l.min(capacity)).collect();
            let packs = best_fit_decreasing(&lens, capacity);
            let mut seen: Vec<usize> = packs.iter().flatten().copied().collect();
            seen.sort_unstable();
            let want: Vec<usize> = (0..lens.len()).filter(|&i| lens[i] > 0).collect();
            prop_assert_eq!(seen, want);
            for p in &packs {
                prop_assert!(p.iter().map(|&i| lens[i]).sum::<usize>() <= capacity);
                prop_assert!(p.windows(2).all(|w| w[0] < w[1]));
            }
            prop_assert!(packs.windows(2).all(|w| w[0][0] < w[1][0]));
            // Any fit needs this many; and a new pack opens only when no
            // pack has room, so at most one pack is at most half full.
            let total: usize = lens.iter().sum();
            prop_assert!(packs.len() >= total.div_ceil(capacity));
            let sums: Vec<usize> =
                packs.iter().map(|p| p.iter().map(|&i| lens[i]).sum()).collect();
            prop_assert!(sums.iter().filter(|&&s| 2 * s <= capacity).count() <= 1, "{sums:?}");
        }
    }
}
