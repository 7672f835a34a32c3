//! What each rank adds to the sync step's sum reduction besides its
//! gradients: the window's loss-term count, its non-empty micro-batches,
//! its loss sum, and the requests every rank must honour at the same step
//! (stop, checkpoint). They ride as f32 slots after the gradients
//! (the gradient buffer's `EXTRA`), so the reduction stays one collective.
//!
//! An f32 holds integers exactly only up to 2^24 (16.7 M: one language-model
//! window's tokens can pass it), so the count travels in [`COUNT_PIECES`]
//! slots of [`PIECE_BITS`] bits each: a piece is below 2^14 on every rank,
//! the sum over at most [`MAX_WORKERS`] = 2^10 ranks below 2^24, so every
//! partial sum the ring forms is an exact f32 integer, and the count is
//! exact up to 2^56. The loss sum (f64 on each rank) travels as an f32 pair
//! (high part, rounding remainder): exact on one rank; across ranks each
//! part is summed in f32 (the loss is reported, never divided into the
//! gradients).

use accrue_common::spec::MAX_WORKERS;

/// Bits of the count per slot.
pub const PIECE_BITS: u32 = 14;
/// Slots the count takes (56 bits in all).
pub const COUNT_PIECES: usize = 4;
/// Every slot: the count's pieces, micro-batches, the loss sum's two parts,
/// stop and checkpoint.
pub const SLOTS: usize = COUNT_PIECES + 1 + 2 + 2;
/// The largest count carried exactly.
pub const MAX_COUNT: u64 = (1 << (PIECE_BITS as u64 * COUNT_PIECES as u64)) - 1;

// Every partial sum of a piece over the ranks stays an exact f32 integer.
const _: () = assert!(((1u64 << PIECE_BITS) - 1) * MAX_WORKERS as u64 <= 1 << 24);

/// One rank's contribution before the reduction, the global sums after it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WindowTally {
    /// Loss terms (samples, target tokens): `Batch::count`
    /// summed over the window.
    pub count: u64,
    /// Non-empty micro-batches (`normalize = "mean"` divides by their sum).
    pub batches: u64,
    /// The loss summed over the window's terms.
    pub loss_sum: f64,
    /// Ranks asking to stop after this step.
    pub stop: bool,
    /// Ranks asking for a checkpoint after this step.
    pub checkpoint: bool,
}

impl WindowTally {
    /// The slots this rank adds to the reduction.
    pub fn encode(&self) -> [f32; SLOTS] {
        debug_assert!(self.count <= MAX_COUNT, "count {} above 2^56", self.count);
        let mut s = [0f32; SLOTS];
        let mask = (1u64 << PIECE_BITS) - 1;
        for (i, slot) in s.iter_mut().take(COUNT_PIECES).enumerate() {
            *slot = ((self.count >> (PIECE_BITS * i as u32)) & mask) as f32;
        }
        let hi = self.loss_sum as f32;
        s[COUNT_PIECES] = self.batches as f32;
        s[COUNT_PIECES + 1] = hi;
        s[COUNT_PIECES + 2] = (self.loss_sum - f64::from(hi)) as f32;
        s[COUNT_PIECES + 3] = f32::from(u8::from(self.stop));
        s[COUNT_PIECES + 4] = f32::from(u8::from(self.checkpoint));
        s
    }

    /// The global sums from the reduced slots (requests: any rank's).
    pub fn decode(s: &[f32]) -> Self {
        let count = s[..COUNT_PIECES]
            .iter()
            .enumerate()
            .map(|(i, p)| (p.round() as u64) << (PIECE_BITS * i as u32))
            .sum();
        Self {
            count,
            batches: s[COUNT_PIECES].round() as u64,
            loss_sum: f64::from(s[COUNT_PIECES + 1]) + f64::from(s[COUNT_PIECES + 2]),
            stop: s[COUNT_PIECES + 3] > 0.5,
            checkpoint: s[COUNT_PIECES + 4] > 0.5,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sums slot vectors in f32, as the ring does.
    fn reduce(ranks: &[WindowTally]) -> WindowTally {
        let mut sum = [0f32; SLOTS];
        for r in ranks {
            for (s, v) in sum.iter_mut().zip(r.encode()) {
                *s += v;
            }
        }
        WindowTally::decode(&sum)
    }

    #[test]
    fn a_count_an_f32_would_round_is_exact() {
        // 2^24 + 1 is the first integer an f32 cannot hold.
        let count = (1u64 << 24) + 1;
        assert_ne!(count as f32 as u64, count);
        let one = WindowTally {
            count,
            ..Default::default()
        };
        assert_eq!(reduce(&[one]).count, count);
        // Two ranks whose sum an f32 would round too.
        let two = [
            WindowTally {
                count: (1 << 25) + 3,
                ..Default::default()
            },
            WindowTally {
                count: (1 << 24) + 7,
                ..Default::default()
            },
        ];
        assert_eq!(reduce(&two).count, (1 << 25) + (1 << 24) + 10);
    }

    #[test]
    fn the_worst_case_sum_over_every_rank_is_exact() {
        let r = WindowTally {
            count: MAX_COUNT / MAX_WORKERS as u64,
            ..Default::default()
        };
        let ranks = vec![r; MAX_WORKERS as usize];
        assert_eq!(reduce(&ranks).count, r.count * MAX_WORKERS as u64);
    }

    #[test]
    fn the_rest_round_trips() {
        let t = WindowTally {
            count: 12_345_678_901,
            batches: 8,
            loss_sum: 1_234.567_890_123_456_7,
            stop: true,
            checkpoint: false,
        };
        let back = WindowTally::decode(&t.encode());
        assert_eq!(back.count, t.count);
        assert_eq!(back.batches, 8);
        assert!((back.loss_sum - t.loss_sum).abs() < 1e-9);
        assert!(back.stop && !back.checkpoint);
    }
}
