//! Tensor parallelism's layout (issue 42): how each parameter of a model is
//! cut across the tensor ranks ([`TpSlice`], from the family's
//! [`super::ParallelPlan`] and its own arithmetic: heads, key-value heads,
//! the vocabulary), and what every part of the worker does with it:
//! - the build draws the whole model from the seed and keeps this rank's
//!   slices ([`take`]), so a job's result does not depend on T
//!   (Megatron's `_initialize_affine_weight_cpu`);
//! - `init` files and checkpoints (always whole) are sliced on load;
//! - checkpoints gather the slices whole ([`join`]);
//! - the clip norm counts each element once ([`counts`]): a sliced
//!   parameter on every rank, a replicated one on rank 0 only, a key-value
//!   head that serves several ranks on the first of them, whose partial
//!   gradients are summed over those ranks first ([`TpSlice::partial`]).

use crate::comm::tensor_ops::TensorGroupCell;
use tch::{TchError, Tensor};

/// This rank's place on the tensor axis and the group its operations use.
#[derive(Clone, Debug)]
pub struct TensorPlace {
    pub rank: usize,
    pub size: usize,
    pub group: TensorGroupCell,
}

/// How one parameter is cut across the tensor ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TpSlice {
    /// Whole on every rank, with the same gradient on each (norms, the
    /// biases of row-split layers).
    Replicated,
    /// Rank r holds `ranges[r]` (half-open) of dimension `dim`. Ranges
    /// may repeat: a key-value head that serves several ranks (fewer kv
    /// heads than ranks), whose gradients are partial there (each rank's
    /// query heads gave part) and summed over the ranks that share it.
    Sliced { dim: i64, ranges: Vec<(i64, i64)> },
}

impl TpSlice {
    /// Even ranges of `len` over `t` ranks (the caller checked that `t`
    /// divides it) in units of `unit` elements.
    pub fn even(dim: i64, len: i64, t: i64) -> Self {
        let each = len / t.max(1);
        TpSlice::Sliced {
            dim,
            ranges: (0..t).map(|r| (r * each, (r + 1) * each)).collect(),
        }
    }

    /// The ranks that hold the same range as `rank` (itself included), in
    /// rank order; just `rank` for a replicated tensor.
    pub fn sharers(&self, rank: usize) -> Vec<usize> {
        match self {
            TpSlice::Replicated => vec![rank],
            TpSlice::Sliced { ranges, .. } => {
                let mine = ranges.get(rank);
                (0..ranges.len())
                    .filter(|&r| ranges.get(r) == mine)
                    .collect()
            }
        }
    }

    /// Whether `rank`'s gradient of it is partial: its range is shared
    /// with other ranks, whose gradients add to it.
    pub fn partial(&self, rank: usize) -> bool {
        self.sharers(rank).len() > 1
    }
}

/// Whether `rank` counts the parameter in the clip norm (and in any other
/// sum over the model's elements): sliced ranges by their first holder,
/// replicated tensors by rank 0.
pub fn counts(slice: &TpSlice, rank: usize) -> bool {
    match slice {
        TpSlice::Replicated => rank == 0,
        TpSlice::Sliced { .. } => slice.sharers(rank).first() == Some(&rank),
    }
}

/// Rank `rank`'s part of a whole tensor, contiguous.
pub fn take(whole: &Tensor, slice: &TpSlice, rank: usize) -> Result<Tensor, TchError> {
    match slice {
        TpSlice::Replicated => Ok(whole.shallow_clone()),
        TpSlice::Sliced { dim, ranges } => {
            let (a, b) = ranges.get(rank).copied().ok_or_else(|| {
                TchError::Shape(format!("no tensor rank {rank} of {}", ranges.len()))
            })?;
            let len = whole.size().get(*dim as usize).copied().unwrap_or(0);
            let end = ranges.iter().map(|r| r.1).max().unwrap_or(0);
            if len != end {
                return Err(TchError::Shape(format!(
                    "a tensor of {len} along dimension {dim} where the split covers {end}"
                )));
            }
            whole.f_narrow(*dim, a, b - a)?.f_contiguous()
        }
    }
}

/// The whole tensor from every rank's part (`parts[r]` rank r's, in rank
/// order): a replicated tensor is rank 0's; a shared range is its first
/// holder's.
pub fn join(parts: &[Tensor], slice: &TpSlice) -> Result<Tensor, TchError> {
    match slice {
        TpSlice::Replicated => parts
            .first()
            .map(|t| t.shallow_clone())
            .ok_or_else(|| TchError::Shape("no part to join".into())),
        TpSlice::Sliced { dim, ranges } => {
            let mut seen = Vec::new();
            let mut pieces = Vec::new();
            for (r, range) in ranges.iter().enumerate() {
                if seen.contains(range) {
                    continue;
                }
                seen.push(*range);
                pieces.push(
                    parts
                        .get(r)
                        .ok_or_else(|| TchError::Shape(format!("rank {r}'s part is missing")))?,
                );
            }
            Tensor::f_cat(&pieces, *dim)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn kv() -> TpSlice {
        // One key-value head of 2 rows serving 4 ranks in pairs: 2 heads.
        TpSlice::Sliced {
            dim: 0,
            ranges: vec![(0, 2), (0, 2), (2, 4), (2, 4)],
        }
    }

    #[test]
    fn each_element_is_counted_once() {
        let even = TpSlice::even(0, 8, 4);
        for r in 0..4 {
            assert!(counts(&even, r));
            assert!(!even.partial(r));
        }
        let rep = TpSlice::Replicated;
        assert_eq!((0..4).filter(|&r| counts(&rep, r)).count(), 1);
        let kv = kv();
        let counted: Vec<usize> = (0..4).filter(|&r| counts(&kv, r)).collect();
        assert_eq!(counted, vec![0, 2]);
        assert_eq!(kv.sharers(3), vec![2, 3]);
        assert!(kv.partial(1));
    }

    #[test]
    fn take_then_join_is_the_whole() {
        let whole = Tensor::arange(24, (Kind::Float, Device::Cpu)).view([4, 6]);
        for slice in [
            TpSlice::even(1, 6, 2),
            TpSlice::even(0, 4, 4),
            kv(),
            TpSlice::Replicated,
        ] {
            let n = match &slice {
                TpSlice::Sliced { ranges, .. } => ranges.len(),
                TpSlice::Replicated => 3,
            };
            let parts: Vec<Tensor> = (0..n).map(|r| take(&whole, &slice, r).unwrap()).collect();
            assert_eq!(join(&parts, &slice).unwrap(), whole, "{slice:?}");
        }
        // A split that does not cover the tensor is refused.
        assert!(take(&whole, &TpSlice::even(0, 6, 2), 0).is_err());
    }
}
