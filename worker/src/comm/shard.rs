//! Sharding arithmetic for ZeRO stages 1 and 2 (issue 17), pure: which
//! slice of the flat gradient buffer a rank owns, which parameters (and
//! which part of each) fall in it, the ring schedule that leaves rank r
//! with slice r reduced, and how the clipping norm is assembled from every
//! rank's partial (Colossal-AI's point: a norm over shards must combine the
//! shards, never clip each by its own norm).

use crate::comm::chunks::{self, chunk_range};
use std::ops::Range;

/// Slice `rank` of a flat buffer of `len` elements over `world` ranks:
/// contiguous, sizes differing by at most one element, tiling `0..len`
/// in rank order (a parameter may straddle a boundary).
pub fn slice(len: usize, world: usize, rank: usize) -> Range<usize> {
    chunk_range(len, world, rank)
}

/// The ring schedule relabelled so that rank r ends the reduce-scatter
/// owning chunk r (the plain schedule of [`chunks`] ends on chunk r + 1):
/// it is the plain schedule run as rank r - 1.
fn shifted(rank: usize, world: usize) -> usize {
    (rank + world - 1) % world.max(1)
}

/// Reduce-scatter step `s`: the chunk rank `r` sends to its next.
pub fn rs_send(rank: usize, world: usize, step: usize) -> usize {
    chunks::rs_send(shifted(rank, world), world, step)
}

/// Reduce-scatter step `s`: the chunk rank `r` receives and adds.
pub fn rs_recv(rank: usize, world: usize, step: usize) -> usize {
    chunks::rs_recv(shifted(rank, world), world, step)
}

/// All-gather step `s`, starting from every rank owning its own chunk:
/// the chunk rank `r` forwards.
pub fn ag_send(rank: usize, world: usize, step: usize) -> usize {
    chunks::ag_send(shifted(rank, world), world, step)
}

/// All-gather step `s`: the chunk rank `r` receives (and overwrites).
pub fn ag_recv(rank: usize, world: usize, step: usize) -> usize {
    chunks::ag_recv(shifted(rank, world), world, step)
}

/// One parameter's part in a slice: parameter `param`, its elements
/// `within` (offsets inside the parameter), at `at` inside the flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub param: usize,
    pub within: Range<usize>,
    pub at: Range<usize>,
}

/// The parameters (by element count, in flat-buffer order) that fall in
/// `slice`, each with the part of it that does: what a rank steps under
/// stage 1. Pieces tile the slice in order.
pub fn pieces(sizes: &[usize], slice: Range<usize>) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut start = 0;
    for (param, &n) in sizes.iter().enumerate() {
        let end = start + n;
        let (lo, hi) = (start.max(slice.start), end.min(slice.end));
        if lo < hi {
            out.push(Piece {
                param,
                within: lo - start..hi - start,
                at: lo..hi,
            });
        }
        start = end;
        if start >= slice.end {
            break;
        }
    }
    out
}

/// A rank's partial of the gradient norm over its slice: the sum of
/// squares (norm 2) or the largest magnitude (norm inf).
pub fn partial(slice: &[f32], norm_type: f64) -> f64 {
    if norm_type.is_infinite() {
        slice.iter().fold(0.0f64, |m, &g| {
            let a = (g as f64).abs();
            if a.is_nan() || m.is_nan() {
                f64::NAN
            } else {
                m.max(a)
            }
        })
    } else {
        slice.iter().map(|&g| (g as f64) * (g as f64)).sum()
    }
}

/// The global norm from every rank's [`partial`], in rank order (so every
/// rank computes the same bits): sqrt of the sum for norm 2, the max for
/// norm inf. A non-finite partial anywhere makes the norm non-finite, so
/// every rank takes the same skip.
pub fn combine(partials: &[f64], norm_type: f64) -> f64 {
    if partials.iter().any(|p| p.is_nan()) {
        return f64::NAN;
    }
    if norm_type.is_infinite() {
        partials.iter().copied().fold(0.0, f64::max)
    } else {
        partials.iter().sum::<f64>().sqrt()
    }
}

/// An f64 carried through an f32 all-gather (which only copies): its bits
/// as two f32 words.
pub fn to_words(x: f64) -> [f32; 2] {
    let b = x.to_bits();
    [f32::from_bits(b as u32), f32::from_bits((b >> 32) as u32)]
}

/// The f64 of [`to_words`].
pub fn from_words(w: [f32; 2]) -> f64 {
    f64::from_bits(u64::from(w[0].to_bits()) | (u64::from(w[1].to_bits()) << 32))
}

/// Elements rank `r` sends for one reduce-scatter plus one all-gather of
/// `len` elements: the same as one ring all-reduce, 2(W-1)/W * len.
pub fn shard_send_elems(len: usize, world: usize, rank: usize) -> usize {
    // The relabelled schedule is the plain one run as rank r - 1.
    chunks::ring_send_elems(len, world, shifted(rank, world))
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)] // rank-indexed simulation reads clearer with indices
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Runs the relabelled reduce-scatter on in-memory buffers.
    fn reduce_scatter(bufs: &mut [Vec<f64>]) {
        let world = bufs.len();
        let len = bufs[0].len();
        for s in 0..world - 1 {
            let sent: Vec<(usize, Vec<f64>)> = (0..world)
                .map(|r| {
                    let c = rs_send(r, world, s);
                    (c, bufs[r][chunk_range(len, world, c)].to_vec())
                })
                .collect();
            for r in 0..world {
                let (c, data) = &sent[(r + world - 1) % world];
                assert_eq!(*c, rs_recv(r, world, s), "rank {r} step {s}");
                for (d, v) in bufs[r][chunk_range(len, world, *c)].iter_mut().zip(data) {
                    *d += v;
                }
            }
        }
    }

    fn all_gather(bufs: &mut [Vec<f64>]) {
        let world = bufs.len();
        let len = bufs[0].len();
        for s in 0..world - 1 {
            let sent: Vec<(usize, Vec<f64>)> = (0..world)
                .map(|r| {
                    let c = ag_send(r, world, s);
                    (c, bufs[r][chunk_range(len, world, c)].to_vec())
                })
                .collect();
            for r in 0..world {
                let (c, data) = &sent[(r + world - 1) % world];
                assert_eq!(*c, ag_recv(r, world, s), "rank {r} step {s}");
                bufs[r][chunk_range(len, world, *c)].copy_from_slice(data);
            }
        }
    }

    #[test]
    fn a_parameter_may_straddle_a_slice_boundary() {
        // Parameters of 3, 4 and 2 elements over 2 ranks: slices 0..5, 5..9.
        assert_eq!(slice(9, 2, 0), 0..5);
        assert_eq!(
            pieces(&[3, 4, 2], slice(9, 2, 0)),
            [
                Piece {
                    param: 0,
                    within: 0..3,
                    at: 0..3
                },
                Piece {
                    param: 1,
                    within: 0..2,
                    at: 3..5
                },
            ]
        );
        assert_eq!(
            pieces(&[3, 4, 2], slice(9, 2, 1)),
            [
                Piece {
                    param: 1,
                    within: 2..4,
                    at: 5..7
                },
                Piece {
                    param: 2,
                    within: 0..2,
                    at: 7..9
                },
            ]
        );
        assert!(
            pieces(&[3], slice(3, 4, 3)).is_empty(),
            "fewer elements than ranks"
        );
    }

    #[test]
    fn the_norm_is_assembled_from_every_shard() {
        let g: Vec<f32> = vec![3.0, -4.0, 12.0, 0.5, -0.25];
        for norm_type in [2.0, f64::INFINITY] {
            let whole = combine(&[partial(&g, norm_type)], norm_type);
            for world in 1..=5 {
                let parts: Vec<f64> = (0..world)
                    .map(|r| partial(&g[slice(g.len(), world, r)], norm_type))
                    .collect();
                assert_eq!(combine(&parts, norm_type), whole, "W = {world}");
            }
        }
        assert_eq!(combine(&[9.0, 16.0], 2.0), 5.0);
        assert_eq!(combine(&[3.0, 12.0], f64::INFINITY), 12.0);
        // Non-finite on one shard: the global norm is non-finite.
        let bad = [1.0, f32::NAN, 2.0];
        for norm_type in [2.0, f64::INFINITY] {
            let parts = [partial(&bad[..1], norm_type), partial(&bad[1..], norm_type)];
            assert!(!combine(&parts, norm_type).is_finite(), "{norm_type}");
        }
        let inf = [f32::INFINITY, 1.0];
        assert_eq!(combine(&[partial(&inf, 2.0)], 2.0), f64::INFINITY);
    }

    #[test]
    fn an_f64_survives_an_f32_copy() {
        for x in [0.0, 1.5e-300, 123.456, f64::INFINITY, f64::MAX, -7.0] {
            assert_eq!(from_words(to_words(x)).to_bits(), x.to_bits());
        }
        assert!(from_words(to_words(f64::NAN)).is_nan());
    }

    proptest! {
        #[test]
        fn rank_r_owns_slice_r_then_everyone_has_everything(
            len in 0usize..80, world in 2usize..9, seed in 0u64..1000,
        ) {
            let inputs: Vec<Vec<f64>> = (0..world)
                .map(|r| (0..len).map(|i| ((seed as usize + r * 31 + i * 7) % 97) as f64).collect())
                .collect();
            let want: Vec<f64> = (0..len).map(|i| inputs.iter().map(|b| b[i]).sum()).collect();
            let mut bufs = inputs.clone();
            reduce_scatter(&mut bufs);
            for r in 0..world {
                let s = slice(len, world, r);
                prop_assert_eq!(&bufs[r][s.clone()], &want[s], "rank {}", r);
                prop_assert_eq!(rs_recv(r, world, world - 2), r);
            }
            // Each rank steps its slice (here: doubles it), then gathers.
            for r in 0..world {
                for v in &mut bufs[r][slice(len, world, r)] {
                    *v *= 2.0;
                }
            }
            all_gather(&mut bufs);
            let twice: Vec<f64> = want.iter().map(|v| 2.0 * v).collect();
            for r in 0..world {
                prop_assert_eq!(&bufs[r], &twice, "rank {}", r);
            }
        }

        #[test]
        fn pieces_tile_each_slice(
            sizes in proptest::collection::vec(0usize..20, 1..12), world in 1usize..6,
        ) {
            let len: usize = sizes.iter().sum();
            for r in 0..world {
                let s = slice(len, world, r);
                let ps = pieces(&sizes, s.clone());
                let mut at = s.start;
                for p in &ps {
                    prop_assert_eq!(p.at.start, at);
                    prop_assert_eq!(p.at.len(), p.within.len());
                    prop_assert!(p.within.end <= sizes[p.param]);
                    at = p.at.end;
                }
                prop_assert_eq!(at, s.end);
            }
        }

        #[test]
        fn sharded_traffic_equals_the_all_reduce(len in 0usize..100_000, world in 1usize..17, rank in 0usize..16) {
            let rank = rank % world;
            let by_schedule: usize = if world == 1 { 0 } else {
                (0..world - 1)
                    .map(|s| chunk_range(len, world, rs_send(rank, world, s)).len()
                        + chunk_range(len, world, ag_send(rank, world, s)).len())
                    .sum()
            };
            prop_assert_eq!(shard_send_elems(len, world, rank), by_schedule);
            let ideal = 2.0 * (world as f64 - 1.0) / world as f64 * len as f64;
            prop_assert!((by_schedule as f64 - ideal).abs() <= 2.0 * world as f64);
        }
    }
}
