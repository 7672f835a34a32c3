//! Ring arithmetic, pure: how a flat buffer is split into W chunks, which
//! chunk a rank sends and receives at every step of reduce-scatter and
//! all-gather, how gradients are grouped into buckets, and how many bytes a
//! rank puts on the wire. Proptested for every (length, world) pair.

use std::ops::Range;

/// Chunk `i` of `len` elements split into `parts` nearly equal chunks: the
/// first `len % parts` chunks hold one element more. Chunks may be empty
/// (len < parts) and always tile `0..len`.
pub fn chunk_range(len: usize, parts: usize, i: usize) -> Range<usize> {
    let parts = parts.max(1);
    let base = len / parts;
    let extra = len % parts;
    let start = i * base + i.min(extra);
    let size = base + usize::from(i < extra);
    start..start + size
}

fn wrap(x: isize, world: usize) -> usize {
    x.rem_euclid(world as isize) as usize
}

/// Reduce-scatter step `s` (0..W-1): the chunk rank `r` sends to its next.
pub fn rs_send(rank: usize, world: usize, step: usize) -> usize {
    wrap(rank as isize - step as isize, world)
}

/// Reduce-scatter step `s`: the chunk rank `r` receives from its previous
/// rank and adds into its own.
pub fn rs_recv(rank: usize, world: usize, step: usize) -> usize {
    wrap(rank as isize - step as isize - 1, world)
}

/// The chunk rank `r` holds fully reduced after reduce-scatter.
pub fn owned_chunk(rank: usize, world: usize) -> usize {
    wrap(rank as isize + 1, world)
}

/// All-gather step `s` (0..W-1): the chunk rank `r` forwards.
pub fn ag_send(rank: usize, world: usize, step: usize) -> usize {
    wrap(rank as isize + 1 - step as isize, world)
}

/// All-gather step `s`: the chunk rank `r` receives (and overwrites).
pub fn ag_recv(rank: usize, world: usize, step: usize) -> usize {
    wrap(rank as isize - step as isize, world)
}

/// Elements rank `r` sends in one ring all-reduce of `len` elements:
/// 2(W-1) chunk transfers, about 2(W-1)/W * len.
pub fn ring_send_elems(len: usize, world: usize, rank: usize) -> usize {
    if world <= 1 {
        return 0;
    }
    (0..world - 1)
        .map(|s| chunk_range(len, world, rs_send(rank, world, s)).len())
        .chain((0..world - 1).map(|s| chunk_range(len, world, ag_send(rank, world, s)).len()))
        .sum()
}

/// Elements rank `r` receives in one ring all-reduce.
pub fn ring_recv_elems(len: usize, world: usize, rank: usize) -> usize {
    if world <= 1 {
        return 0;
    }
    (0..world - 1)
        .map(|s| chunk_range(len, world, rs_recv(rank, world, s)).len())
        .chain((0..world - 1).map(|s| chunk_range(len, world, ag_recv(rank, world, s)).len()))
        .sum()
}

/// Groups consecutive tensors (given by element counts) into buckets of at
/// most `cap` elements; a tensor larger than `cap` gets a bucket of its own.
/// Returns ranges of tensor indices; they tile `0..sizes.len()`.
pub fn buckets(sizes: &[usize], cap: usize) -> Vec<Range<usize>> {
    let cap = cap.max(1);
    let mut out = Vec::new();
    let mut start = 0;
    let mut elems = 0;
    for (i, &n) in sizes.iter().enumerate() {
        if i > start && elems + n > cap {
            out.push(start..i);
            start = i;
            elems = 0;
        }
        elems += n;
    }
    if sizes.len() > start {
        out.push(start..sizes.len());
    }
    out
}

/// Splits `range` into consecutive pieces of at most `piece` elements.
pub fn pieces(range: Range<usize>, piece: usize) -> impl Iterator<Item = Range<usize>> {
    let piece = piece.max(1);
    let end = range.end;
    range.step_by(piece).map(move |s| s..(s + piece).min(end))
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)] // rank-indexed simulation reads clearer with indices
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Runs the ring schedule on in-memory buffers.
    fn simulate(inputs: &[Vec<f64>]) -> Vec<Vec<f64>> {
        let world = inputs.len();
        let len = inputs[0].len();
        let mut bufs = inputs.to_vec();
        for s in 0..world - 1 {
            let sent: Vec<(usize, Vec<f64>)> = (0..world)
                .map(|r| {
                    let c = chunk_range(len, world, rs_send(r, world, s));
                    (rs_send(r, world, s), bufs[r][c].to_vec())
                })
                .collect();
            for r in 0..world {
                let prev = (r + world - 1) % world;
                let (chunk, data) = &sent[prev];
                assert_eq!(
                    *chunk,
                    rs_recv(r, world, s),
                    "rank {r} step {s}: chunk mismatch"
                );
                let c = chunk_range(len, world, *chunk);
                for (dst, v) in bufs[r][c].iter_mut().zip(data) {
                    *dst += v;
                }
            }
        }
        for s in 0..world - 1 {
            let sent: Vec<(usize, Vec<f64>)> = (0..world)
                .map(|r| {
                    let c = chunk_range(len, world, ag_send(r, world, s));
                    (ag_send(r, world, s), bufs[r][c].to_vec())
                })
                .collect();
            for r in 0..world {
                let prev = (r + world - 1) % world;
                let (chunk, data) = &sent[prev];
                assert_eq!(*chunk, ag_recv(r, world, s));
                let c = chunk_range(len, world, *chunk);
                bufs[r][c].copy_from_slice(data);
            }
        }
        bufs
    }

    #[test]
    fn five_elements_over_four_peers() {
        // burn's ring slicing got this case wrong.
        let ranges: Vec<_> = (0..4).map(|i| chunk_range(5, 4, i)).collect();
        assert_eq!(ranges, [0..2, 2..3, 3..4, 4..5]);
        assert_eq!(chunk_range(0, 3, 2), 0..0);
        assert_eq!(buckets(&[3, 3, 10, 1, 1], 6), [0..2, 2..3, 3..5]);
        assert!(buckets(&[], 6).is_empty());
    }

    proptest! {
        #[test]
        fn chunks_tile_the_buffer(len in 0usize..2000, world in 1usize..17) {
            let mut next = 0;
            for i in 0..world {
                let r = chunk_range(len, world, i);
                prop_assert_eq!(r.start, next);
                prop_assert!(r.len() == len / world || r.len() == len / world + 1);
                next = r.end;
            }
            prop_assert_eq!(next, len);
        }

        #[test]
        fn ring_schedule_sums_everything(len in 0usize..64, world in 2usize..9, seed in 0u64..1000) {
            let inputs: Vec<Vec<f64>> = (0..world)
                .map(|r| (0..len).map(|i| ((seed as usize + r * 31 + i * 7) % 97) as f64).collect())
                .collect();
            let want: Vec<f64> = (0..len).map(|i| inputs.iter().map(|b| b[i]).sum()).collect();
            for (r, out) in simulate(&inputs).iter().enumerate() {
                prop_assert_eq!(out, &want, "rank {}", r);
            }
            // Each rank owns the chunk the reduce-scatter finished on.
            for r in 0..world {
                prop_assert_eq!(owned_chunk(r, world), rs_recv(r, world, world - 2));
                prop_assert_eq!(owned_chunk(r, world), ag_send(r, world, 0));
            }
        }

        #[test]
        fn traffic_is_two_w_minus_one_over_w(len in 0usize..100_000, world in 1usize..17, rank in 0usize..16) {
            let rank = rank % world;
            let sent = ring_send_elems(len, world, rank);
            let recv = ring_recv_elems(len, world, rank);
            let ideal = 2.0 * (world as f64 - 1.0) / world as f64 * len as f64;
            // Chunks differ by at most one element: at most 2(W-1) off the ideal.
            prop_assert!((sent as f64 - ideal).abs() <= 2.0 * world as f64);
            prop_assert!((recv as f64 - ideal).abs() <= 2.0 * world as f64);
            if len % world.max(1) == 0 { prop_assert_eq!(sent as f64, ideal); }
        }

        #[test]
        fn buckets_tile_and_respect_the_cap(sizes in proptest::collection::vec(0usize..50, 0..40), cap in 1usize..120) {
            let b = buckets(&sizes, cap);
            let mut next = 0;
            for r in &b {
                prop_assert_eq!(r.start, next);
                prop_assert!(!r.is_empty());
                next = r.end;
                let elems: usize = sizes[r.clone()].iter().sum();
                // Over the cap only as a single tensor.
                prop_assert!(elems <= cap || r.len() == 1, "bucket {:?} holds {} > {}", r, elems, cap);
            }
            prop_assert_eq!(next, sizes.len());
            // Greedy: a bucket could not have taken the next tensor.
            for w in b.windows(2) {
                let elems: usize = sizes[w[0].clone()].iter().sum();
                prop_assert!(elems + sizes[w[1].start] > cap);
            }
        }

        #[test]
        fn pieces_tile(start in 0usize..1000, len in 0usize..1000, piece in 1usize..300) {
            let p: Vec<_> = pieces(start..start + len, piece).collect();
            let mut next = start;
            for r in &p { prop_assert_eq!(r.start, next); prop_assert!(r.len() <= piece && !r.is_empty()); next = r.end; }
            prop_assert_eq!(next, start + len);
        }
    }
}
