//! Data sharding with `torch.utils.data.DistributedSampler` semantics, and the
//! split of a rank's epoch into micro-batches and accumulation windows.
//!
//! Everything here is pure arithmetic: the engine asks for an epoch's plan and
//! walks it with a cursor (epoch, micro-batch index) that checkpoints record.

use crate::source::rng::randperm;

/// How one epoch is sharded over ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardSpec {
    /// Number of samples in the data set.
    pub len: usize,
    /// Number of ranks W (>= 1).
    pub world: usize,
    /// Base seed; the permutation of epoch e uses seed + e.
    pub seed: u64,
    pub shuffle: bool,
    /// Drop the tail so every rank gets the same count (instead of padding).
    pub drop_last: bool,
    /// Pad (repeat the start) so every rank gets the same count; with
    /// `pad = false` and no `drop_last` every sample is read exactly once and
    /// the first `len % W` ranks get one sample more.
    pub pad: bool,
    /// Samples at the start of the epoch's order already consumed before
    /// this sharding began (0 normally). When the world size changes in the
    /// middle of an epoch, the rest of the order, `order[offset..]`, is
    /// sharded over the new ranks exactly as `DistributedSampler` shards a
    /// list, so no sample is skipped or read twice.
    pub offset: usize,
}

impl ShardSpec {
    /// Samples this sharding covers: the epoch's order after `offset`.
    pub fn remaining(&self) -> usize {
        self.len.saturating_sub(self.offset)
    }

    /// Samples each rank sees per epoch (`DistributedSampler.num_samples`).
    pub fn per_rank(&self) -> usize {
        let len = self.remaining();
        if self.world == 0 {
            return 0;
        }
        if self.drop_last && !len.is_multiple_of(self.world) {
            // ceil((len - W) / W) as torch computes it; len < W gives 0.
            len.saturating_sub(self.world).div_ceil(self.world)
        } else {
            len.div_ceil(self.world)
        }
    }

    /// Whether ranks may hold different sample counts.
    pub fn uneven(&self) -> bool {
        !self.pad && !self.drop_last
    }

    /// Samples rank `rank` sees per epoch.
    pub fn rank_len(&self, rank: usize) -> usize {
        if self.uneven() && self.world > 0 {
            let len = self.remaining();
            len / self.world + usize::from(rank < len % self.world)
        } else {
            self.per_rank()
        }
    }

    /// The indices rank `rank` reads in `epoch`, in order.
    pub fn indices(&self, rank: usize, epoch: u64) -> Vec<usize> {
        if self.uneven() {
            let all = self.order(epoch);
            return all
                .into_iter()
                .skip(rank)
                .step_by(self.world.max(1))
                .collect();
        }
        let num_samples = self.per_rank();
        let total = num_samples * self.world;
        if self.remaining() == 0 || total == 0 {
            return Vec::new();
        }
        let mut all = self.order(epoch);
        if total > all.len() {
            // Pad by repeating the list from its start, as torch does.
            let base = all.clone();
            while all.len() < total {
                let need = total - all.len();
                all.extend_from_slice(&base[..need.min(base.len())]);
            }
        } else {
            all.truncate(total);
        }
        all.into_iter().skip(rank).step_by(self.world).collect()
    }
}

/// The micro-batch and window structure of one rank's epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowPlan {
    /// Samples of this rank in the epoch.
    pub samples: usize,
    /// Samples of the largest rank: the window structure every rank follows
    /// (ranks with fewer samples run empty micro-steps at the end, like
    /// DDP's Join).
    pub max_samples: usize,
    /// Micro-batch size b.
    pub batch: usize,
    /// Accumulation steps k.
    pub k: usize,
}

impl WindowPlan {
    /// Micro-steps per epoch, the same on every rank (the last micro-batch
    /// may be short, or empty on a rank with fewer samples).
    pub fn micro_batches(&self) -> usize {
        self.max_samples
            .max(self.samples)
            .div_ceil(self.batch.max(1))
    }

    /// Optimizer steps (windows) per epoch; the last window may be short.
    pub fn windows(&self) -> usize {
        self.micro_batches().div_ceil(self.k.max(1))
    }

    /// Sample range `[start, end)` of this rank's micro-batch `m` within the
    /// epoch (empty past the rank's last sample).
    pub fn micro_batch_range(&self, m: usize) -> (usize, usize) {
        let start = (m * self.batch).min(self.samples);
        let end = (start + self.batch).min(self.samples);
        (start, end)
    }

    /// Number of micro-batches in the window that starts at micro-batch `m`.
    pub fn window_len_from(&self, m: usize) -> usize {
        let window_start = m - m % self.k.max(1);
        (self.micro_batches() - window_start).min(self.k)
    }

    /// Whether micro-batch `m` closes its window (the k-th, or the epoch's last).
    pub fn is_sync(&self, m: usize) -> bool {
        (m + 1).is_multiple_of(self.k.max(1)) || m + 1 == self.micro_batches()
    }
}

impl ShardSpec {
    /// The epoch's order of the samples this sharding covers (after
    /// `offset`, before padding and striding).
    fn order(&self, epoch: u64) -> Vec<usize> {
        let mut all = if self.shuffle {
            randperm(self.len, self.seed.wrapping_add(epoch))
        } else {
            (0..self.len).collect()
        };
        all.drain(..self.offset.min(self.len));
        all
    }

    /// The offset at which a new sharding continues after each rank of
    /// this one consumed its first `per_rank_consumed` samples (a committed
    /// window boundary before the epoch's end): ranks read interleaved
    /// positions, so together they consumed a prefix of the order.
    pub fn offset_after(&self, per_rank_consumed: usize) -> usize {
        (self.offset + per_rank_consumed * self.world).min(self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn torch_examples() {
        // DistributedSampler(range(10), num_replicas=3, shuffle=False):
        // padded to 12, rank 0 -> [0, 3, 6, 9], rank 2 -> [2, 5, 8, 1].
        let s = ShardSpec {
            len: 10,
            world: 3,
            seed: 0,
            shuffle: false,
            drop_last: false,
            pad: true,
            offset: 0,
        };
        assert_eq!(s.indices(0, 0), vec![0, 3, 6, 9]);
        assert_eq!(s.indices(2, 0), vec![2, 5, 8, 1]);
        let d = ShardSpec {
            drop_last: true,
            ..s
        };
        assert_eq!(d.per_rank(), 3);
        assert_eq!(d.indices(1, 0), vec![1, 4, 7]);
    }

    #[test]
    fn uneven_ranks_share_the_window_structure() {
        // 101 samples over 2 ranks: 51 and 50; b = 8 gives 7 micro-batches each.
        let s = ShardSpec {
            len: 101,
            world: 2,
            seed: 0,
            shuffle: false,
            drop_last: false,
            pad: false,
            offset: 0,
        };
        assert_eq!((s.rank_len(0), s.rank_len(1)), (51, 50));
        // 17 samples over 2 ranks with b = 8: rank 0 has 9 (2 micro-batches), rank 1 has 8 (1).
        let p1 = WindowPlan {
            samples: 8,
            max_samples: 9,
            batch: 8,
            k: 4,
        };
        assert_eq!(p1.micro_batches(), 2);
        assert_eq!(
            p1.micro_batch_range(1),
            (8, 8),
            "an empty micro-step on the smaller rank"
        );
        assert!(p1.is_sync(1));
    }

    #[test]
    fn windows_of_an_uneven_epoch() {
        let p = WindowPlan {
            samples: 108,
            max_samples: 108,
            batch: 8,
            k: 4,
        };
        assert_eq!(p.micro_batches(), 14);
        assert_eq!(p.windows(), 4);
        assert_eq!(p.micro_batch_range(13), (104, 108));
        assert_eq!(p.window_len_from(12), 2);
        assert_eq!(p.window_len_from(13), 2);
        assert!(p.is_sync(3) && !p.is_sync(12) && p.is_sync(13));
    }

    proptest! {
        #[test]
        fn every_index_exactly_once_across_ranks(
            len in 0usize..300, world in 1usize..9, seed in 0u64..1000,
            epoch in 0u64..5, shuffle: bool, drop_last: bool, pad: bool,
        ) {
            let s = ShardSpec { len, world, seed, shuffle, drop_last, pad, offset: 0 };
            let mut count = vec![0usize; len];
            for r in 0..world {
                let idx = s.indices(r, epoch);
                prop_assert_eq!(idx.len(), s.rank_len(r));
                prop_assert!(s.rank_len(r) <= s.rank_len(0));
                for i in idx { count[i] += 1; }
            }
            let total = s.per_rank() * world;
            if s.uneven() {
                // Every index exactly once; counts differ by at most one.
                prop_assert!(count.iter().all(|&c| c == 1));
                prop_assert!(s.rank_len(0) - s.rank_len(world - 1) <= 1);
            } else if drop_last {
                // Dropped tail: no index twice, exactly `total` distinct ones.
                prop_assert!(count.iter().all(|&c| c <= 1));
                prop_assert_eq!(count.iter().filter(|&&c| c == 1).count(), total);
                prop_assert!(len - total < world);
            } else {
                // Padding: every index at least once; the extra ones are the padding.
                prop_assert!(count.iter().all(|&c| c >= 1));
                prop_assert_eq!(count.iter().sum::<usize>(), total);
                prop_assert!(total - len < world);
                if len >= world { prop_assert!(count.iter().all(|&c| c <= 2)); }
            }
        }

        #[test]
        fn resharding_mid_epoch_reads_every_sample_once(
            len in 1usize..300, w1 in 1usize..6, w2 in 1usize..6, seed in 0u64..1000,
            shuffle: bool, windows in 0usize..10, batch in 1usize..9,
        ) {
            // W1 ranks consume `windows` micro-batches each, then W2 ranks
            // take over the rest of the epoch (pad = false: exactly once).
            let first = ShardSpec { len, world: w1, seed, shuffle, drop_last: false, pad: false, offset: 0 };
            let c = (windows * batch).min(first.rank_len(w1 - 1));
            let mut count = vec![0usize; len];
            for r in 0..w1 {
                for &i in &first.indices(r, 3)[..c] { count[i] += 1; }
            }
            let second = ShardSpec { world: w2, offset: first.offset_after(c), ..first };
            for r in 0..w2 {
                for i in second.indices(r, 3) { count[i] += 1; }
            }
            prop_assert!(count.iter().all(|&n| n == 1), "{:?}", count);
            // The same order as one uninterrupted sharding would read.
            let mut order = Vec::new();
            let whole = ShardSpec { world: 1, ..first };
            for i in whole.indices(0, 3) { order.push(i); }
            let mut prefix: Vec<usize> = (0..c).flat_map(|j| (0..w1).map(move |r| (r, j))).map(|(r, j)| first.indices(r, 3)[j]).collect();
            prefix.sort_unstable();
            let mut expect = order[..c * w1].to_vec();
            expect.sort_unstable();
            prop_assert_eq!(prefix, expect);
        }

        #[test]
        fn micro_batches_tile_the_epoch(samples in 0usize..500, batch in 1usize..40, k in 1usize..10) {
            let p = WindowPlan { samples, max_samples: samples, batch, k };
            let mut next = 0;
            let mut syncs = 0;
            for m in 0..p.micro_batches() {
                let (a, b) = p.micro_batch_range(m);
                prop_assert_eq!(a, next);
                prop_assert!(b > a && b - a <= batch);
                next = b;
                if p.is_sync(m) { syncs += 1; }
                prop_assert!(p.window_len_from(m) >= 1 && p.window_len_from(m) <= k);
            }
            prop_assert_eq!(next, samples);
            prop_assert_eq!(syncs, p.windows());
        }
    }
}
