//! Tensor parallelism in the engine (issue 42). The model is built whole
//! from the job's seed and cut to this rank's slices
//! (family/tensor.rs), so the result does not depend on T; each data
//! group is the ranks of one tensor rank, so the data axis's reduction,
//! ZeRO-free optimizer step and tally are as before. What the tensor axis
//! adds at the sync step:
//! - (the gradients of a slice several ranks share, a key-value head
//!   serving T / kv ranks, are summed over them in the backward:
//!   family/llama/tensor.rs);
//! - the clip norm counts each element once: this rank's slices, a
//!   replicated tensor on tensor rank 0 only, a shared slice on its first
//!   holder ([`Engine::tensor_partial`]), summed over the tensor group
//!   (engine/norm.rs, with the data axis's and the stages');
//! - checkpoints are whole: every tensor rank's slices gathered, tensor
//!   rank 0 writes ([`Engine::tensor_whole`]); weights and optimizer state
//!   load whole and are cut ([`Engine::tensor_slice_state`]).

use super::{Engine, Mesh};
use crate::comm::collective::Collective;
use crate::comm::tensor_ops::TensorGroupCell;
use crate::error::{Result, TorchContext};
use crate::family::model::Model;
use crate::family::tensor::{counts, join, take, TensorPlace, TpSlice};
use crate::spec::JobSpec;
use std::collections::HashMap;
use tch::{Kind, Tensor};

/// What this rank holds on the tensor axis (its rank and the degree are
/// the mesh's: `Engine::mesh`).
pub(super) struct TensorAxis {
    /// The current generation's group, which the model's operations use.
    pub cell: TensorGroupCell,
    /// Every parameter's slice.
    pub layout: HashMap<String, TpSlice>,
}

/// Cuts `model` (built whole from the seed) to this rank's slices; None
/// without tensor parallelism.
pub(super) fn split<C: Collective>(
    spec: &JobSpec,
    model: &mut Model,
    collective: &mut C,
) -> Result<Option<TensorAxis>> {
    let mesh = Mesh::of(collective);
    let Some((rank, size)) = mesh.tensor() else {
        return Ok(None);
    };
    let layout = crate::family::family(spec.model.kind).tensor_layout(&spec.model, size)?;
    let cell = TensorGroupCell::default();
    cell.set(mesh.tensor_group(collective)?);
    let place = TensorPlace {
        rank,
        size,
        group: cell.clone(),
    };
    model.split_tensor(&layout, &place)?;
    let elements: i64 = model.params.iter().map(|(_, t)| t.numel() as i64).sum();
    tracing::info!(rank, size, elements, "tensor-parallel shard");
    Ok(Some(TensorAxis {
        cell,
        layout: layout.into_iter().collect(),
    }))
}

impl<C: Collective> Engine<C> {
    /// A new generation's tensor group for the model's operations (a rank
    /// keeps its tensor place across generations: `Engine::reconfigure`
    /// checks it).
    pub(super) fn renew_tensor_group(&mut self) -> Result<()> {
        if let Some(t) = &self.tensor {
            t.cell.set(self.mesh.tensor_group(&mut self.collective)?);
        }
        Ok(())
    }

    /// This rank's partial of the clip norm with tensor parallelism, each
    /// element counted once over the tensor ranks (None without tensor
    /// parallelism): the p-th powers of the norms of this rank's counted
    /// parameters' elements (max for inf) within what it owns of the
    /// gradients (all of them at stage 0, its slice under ZeRO 1 and 2,
    /// its chunk of each unit under ZeRO-3). engine/norm.rs combines it
    /// over the data axis (when sharded), the tensor group and the stages.
    pub(super) fn tensor_partial(&mut self, norm_type: f64) -> Result<Option<f64>> {
        if self.tensor.is_none() {
            return Ok(None);
        }
        let inf = norm_type.is_infinite();
        let (flat, segments) = {
            let (placement, mut parts) = self.placed();
            placement.owned_grads(&mut parts)?
        };
        let Some(axis) = &self.tensor else {
            return Ok(None);
        };
        let rank = self.mesh.tensor_rank();
        let mut mine = 0f64;
        let mut at = 0usize;
        for (name, p) in &self.model.params {
            let (start, end) = (at, at + p.numel());
            at = end;
            if !axis.layout.get(name).is_some_and(|s| counts(s, rank)) {
                continue;
            }
            // This parameter's elements among the owned segments (laid
            // one after another in `flat`).
            let mut offset = 0usize;
            for seg in &segments {
                let (a, b) = (start.max(seg.start), end.min(seg.end));
                if a < b {
                    let n = flat
                        .f_narrow(0, (offset + a - seg.start) as i64, (b - a) as i64)
                        .and_then(|g| {
                            g.f_linalg_norm(norm_type, None::<&[i64]>, false, None::<Kind>)
                        })
                        .and_then(|n| n.f_double_value(&[]))
                        .ctx("computing the gradient norm")?;
                    mine = if inf {
                        mine.max(n)
                    } else {
                        mine + n.powf(norm_type)
                    };
                }
                offset += seg.len();
            }
        }
        Ok(Some(mine))
    }

    /// `named` (this rank's parameters or optimizer state, the same names
    /// in the same order on every tensor rank) whole: each slice gathered
    /// over the tensor group and joined (every rank takes part).
    pub(super) fn tensor_whole(
        &mut self,
        named: Vec<(String, Tensor)>,
    ) -> Result<Vec<(String, Tensor)>> {
        let (Some(split), Some(axis)) = (self.model.tensor_split.as_ref(), self.tensor.as_ref())
        else {
            return Ok(named);
        };
        let group = axis.cell.get().ctx("gathering the tensor shards")?;
        let local: HashMap<&str, Vec<i64>> = self
            .model
            .params
            .iter()
            .map(|(n, t)| (n.as_str(), t.size()))
            .collect();
        let _guard = tch::no_grad_guard();
        let mut out = Vec::with_capacity(named.len());
        for (name, t) in named {
            let Some(slice @ TpSlice::Sliced { dim, ranges }) =
                split.slice_of(&name, &t.size(), &local)
            else {
                out.push((name, t));
                continue;
            };
            let widths: Vec<i64> = ranges.iter().map(|(a, b)| b - a).collect();
            let whole = || -> std::result::Result<Tensor, tch::TchError> {
                let last = t.dim() as i64 - 1;
                let moved = t.f_transpose(*dim, last)?.f_contiguous()?;
                let all = group.gather_last(&moved, &widths)?;
                let parts = all
                    .f_split_with_sizes(widths.as_slice(), last)?
                    .into_iter()
                    .map(|p| p.f_transpose(*dim, last))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                join(&parts, slice)?.f_contiguous()
            };
            out.push((name, whole().ctx("gathering the tensor shards")?));
        }
        Ok(out)
    }

    /// This rank's slices of whole optimizer state (`<param>.<state>` of
    /// the whole parameter's shape), as a checkpoint holds it.
    pub(super) fn tensor_slice_state(
        &self,
        saved: Vec<(String, Tensor)>,
    ) -> Result<Vec<(String, Tensor)>> {
        let Some(split) = self.model.tensor_split.as_ref() else {
            return Ok(saved);
        };
        let none = HashMap::new();
        saved
            .into_iter()
            .map(|(name, t)| match split.slice_of(&name, &t.size(), &none) {
                Some(slice) => {
                    let part = take(&t, slice, split.rank)
                        .ctx("cutting the optimizer state for tensor parallelism")?;
                    Ok((name, part))
                }
                None => Ok((name, t)),
            })
            .collect()
    }
}
