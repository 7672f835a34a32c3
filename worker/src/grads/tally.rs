//! What each rank adds to the sync step's sum reduction besides its
//! gradients: the window's loss-term count, its non-empty micro-batches,
//! its loss sum, and the requests every rank must honour at the same step
//! (stop, checkpoint). They ride as f32 slots after the gradients
//! (the gradient buffer's `EXTRA`), so the reduction stays one collective.
//!
//! An f32 holds integers exactly only up to 2^24 (16.7 M: one language-model
//! window's tokens can pass it), so integers travel in pieces of
//! [`PIECE_BITS`] bits, one slot each: a piece is below 2^14 in magnitude on
//! every rank, the sum over at most [`MAX_WORKERS`] = 2^10 ranks below 2^24,
//! so every partial sum the ring forms, in any order, is an exact f32
//! integer.
//!
//! - The count takes [`COUNT_PIECES`] pieces: exact up to 2^56.
//! - The loss sum (f64 on each rank) crosses as a signed fixed-point
//!   integer with [`LOSS_FRAC_BITS`] fraction bits in [`LOSS_PIECES`]
//!   pieces (112 bits): each rank's f64 is rounded once to a multiple of
//!   2^-40, and those are summed exactly. The global sum is therefore the
//!   exact sum of the ranks' f64 values to within `world * 2^-41`, the same
//!   on every rank and independent of the ring's order (an f64 sum of
//!   values above 2^12 rounds more than that). A value that is not finite
//!   or not below 2^70 in magnitude rides in one more slot as an f32, so a
//!   NaN or an overflow still shows in the reported loss.

use accrue_common::spec::MAX_WORKERS;

/// Bits per integer piece.
pub const PIECE_BITS: u32 = 14;
/// Slots the count takes (56 bits in all).
pub const COUNT_PIECES: usize = 4;
/// Slots the loss sum's fixed-point integer takes (112 bits, signed).
pub const LOSS_PIECES: usize = 8;
/// Fraction bits of the loss sum's fixed point (resolution 2^-40).
pub const LOSS_FRAC_BITS: i32 = 40;
/// The largest loss sum magnitude carried as fixed point (2^70).
pub const LOSS_LIMIT: f64 = (1u128 << 70) as f64;
/// Every slot: the count's pieces, micro-batches, the loss sum's pieces,
/// its overflow slot, stop and checkpoint.
pub const SLOTS: usize = COUNT_PIECES + 1 + LOSS_PIECES + 1 + 2;
/// The largest count carried exactly.
pub const MAX_COUNT: u64 = (1 << (PIECE_BITS as u64 * COUNT_PIECES as u64)) - 1;

// Every partial sum of a piece over the ranks stays an exact f32 integer.
const _: () = assert!(((1u64 << PIECE_BITS) - 1) * MAX_WORKERS as u64 <= 1 << 24);
// The fixed point's integer (70 + 40 bits and a sign bit) fits its pieces.
const _: () = assert!(70 + (LOSS_FRAC_BITS as u32) < PIECE_BITS * LOSS_PIECES as u32);

const LOSS_AT: usize = COUNT_PIECES + 1;
const OVERFLOW_AT: usize = LOSS_AT + LOSS_PIECES;
const STOP_AT: usize = OVERFLOW_AT + 1;
const CHECKPOINT_AT: usize = STOP_AT + 1;

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
        s[COUNT_PIECES] = self.batches as f32;
        if self.loss_sum.is_finite() && self.loss_sum.abs() < LOSS_LIMIT {
            // |loss_sum| < 2^70, so the scaled value is below 2^110: the
            // cast neither saturates nor loses the sign.
            let fixed = (self.loss_sum * 2f64.powi(LOSS_FRAC_BITS)).round() as i128;
            let pieces = &mut s[LOSS_AT..OVERFLOW_AT];
            // Low pieces in 0..2^14 (arithmetic shift keeps the sign for
            // the top piece, which lies in -2^13..2^13).
            let imask = (1i128 << PIECE_BITS) - 1;
            for (i, slot) in pieces.iter_mut().enumerate() {
                let shifted = fixed >> (PIECE_BITS * i as u32);
                *slot = if i + 1 == LOSS_PIECES {
                    shifted as f32
                } else {
                    (shifted & imask) as f32
                };
            }
        } else {
            s[OVERFLOW_AT] = self.loss_sum as f32;
        }
        s[STOP_AT] = f32::from(u8::from(self.stop));
        s[CHECKPOINT_AT] = f32::from(u8::from(self.checkpoint));
        s
    }

    /// The global sums from the reduced slots (requests: any rank's).
    pub fn decode(s: &[f32]) -> Self {
        let count = s[..COUNT_PIECES]
            .iter()
            .enumerate()
            .map(|(i, p)| (p.round() as u64) << (PIECE_BITS * i as u32))
            .sum();
        // Each reduced piece is an exact integer below 2^24 in magnitude.
        let fixed: i128 = s[LOSS_AT..OVERFLOW_AT]
            .iter()
            .enumerate()
            .map(|(i, p)| (p.round() as i128) << (PIECE_BITS * i as u32))
            .sum();
        let loss_sum = fixed as f64 / 2f64.powi(LOSS_FRAC_BITS) + f64::from(s[OVERFLOW_AT]);
        Self {
            count,
            batches: s[COUNT_PIECES].round() as u64,
            loss_sum,
            stop: s[STOP_AT] > 0.5,
            checkpoint: s[CHECKPOINT_AT] > 0.5,
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
        assert!((back.loss_sum - t.loss_sum).abs() <= 2f64.powi(-41));
        assert!(back.stop && !back.checkpoint);
    }
    /// The bound the module promises: the exact sum of the ranks' f64
    /// values to within world * 2^-41.
    fn assert_loss_exact(sums: &[f64]) {
        let ranks: Vec<WindowTally> = sums
            .iter()
            .map(|&loss_sum| WindowTally {
                loss_sum,
                ..Default::default()
            })
            .collect();
        let got = reduce(&ranks).loss_sum;
        // The reference: Neumaier's compensated f64 sum (within an ulp or
        // two of the exact sum).
        let (mut exact, mut carry) = (0f64, 0f64);
        for &v in sums {
            let t = exact + v;
            carry += if exact.abs() >= v.abs() {
                (exact - t) + v
            } else {
                (v - t) + exact
            };
            exact = t;
        }
        let exact = exact + carry;
        let bound = sums.len() as f64 * 2f64.powi(-41) + exact.abs() * 2.0 * f64::EPSILON;
        assert!(
            (got - exact).abs() <= bound,
            "{sums:?}: got {got}, exact {exact}, off by {} > {bound}",
            (got - exact).abs()
        );
    }

    #[test]
    fn a_loss_sum_an_f32_would_round_is_f64_exact() {
        // Two ranks with language-model-sized loss sums: an f32 (or an f32
        // high part summed in f32) is off by whole units here.
        let sums = [123_456_789.123_456_7, 98_765_432.987_654_3];
        let f32_sum = f64::from(sums[0] as f32 + sums[1] as f32);
        assert!((f32_sum - (sums[0] + sums[1])).abs() > 1.0);
        assert_loss_exact(&sums);
        // Signs, tiny values and the largest carried magnitude.
        assert_loss_exact(&[-3.25, 1e-9, 7.0]);
        assert_loss_exact(&[LOSS_LIMIT * 0.999, -LOSS_LIMIT * 0.5]);
    }

    #[test]
    fn a_non_finite_or_huge_loss_still_shows() {
        let nan = reduce(&[
            WindowTally {
                loss_sum: f64::NAN,
                ..Default::default()
            },
            WindowTally {
                loss_sum: 2.0,
                ..Default::default()
            },
        ]);
        assert!(nan.loss_sum.is_nan());
        let inf = WindowTally {
            loss_sum: f64::INFINITY,
            ..Default::default()
        };
        assert_eq!(reduce(&[inf]).loss_sum, f64::INFINITY);
        // Beyond the fixed point: an f32's worth of precision, not a wrap.
        let huge = 3.0 * LOSS_LIMIT;
        let got = reduce(&[
            WindowTally {
                loss_sum: huge,
                ..Default::default()
            },
            WindowTally {
                loss_sum: 1.5,
                ..Default::default()
            },
        ])
        .loss_sum;
        assert!(((got - huge) / huge).abs() < 1e-6, "{got} vs {huge}");
    }

    proptest::proptest! {
        #[test]
        fn any_ranks_sum_exactly(
            ranks in proptest::collection::vec(
                (0u64..=MAX_COUNT / MAX_WORKERS as u64, 0u64..1000, -1e12f64..1e12),
                1..64,
            )
        ) {
            let tallies: Vec<WindowTally> = ranks
                .iter()
                .map(|&(count, batches, loss_sum)| WindowTally {
                    count,
                    batches,
                    loss_sum,
                    ..Default::default()
                })
                .collect();
            let got = reduce(&tallies);
            proptest::prop_assert_eq!(got.count, ranks.iter().map(|r| r.0).sum::<u64>());
            proptest::prop_assert_eq!(got.batches, ranks.iter().map(|r| r.1).sum::<u64>());
            assert_loss_exact(&ranks.iter().map(|r| r.2).collect::<Vec<_>>());
        }
    }
}
