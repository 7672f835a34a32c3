//! The clip norm, assembled in one place: what this rank owns of the
//! reduced gradients (its placement's share, each element counted once
//! on the tensor axis), combined over the mesh axes over which that is
//! distinct, in the mesh's order (data, tensor, pipeline). Every rank
//! gets the same value: `clip_grad_norm_`'s total norm of the whole
//! model's summed gradients (divided by the window's divisor by the
//! caller).
//!
//! - data: a placement that shards the gradients (ZeRO 1 to 3) owns a
//!   slice; replicated ones are counted once (no reduction);
//! - tensor: a rank's slices, a replicated tensor on tensor rank 0 only,
//!   a shared slice on its first holder (engine/tensor.rs);
//! - pipeline: each stage's parameters, a tied embedding on the first
//!   stage only (engine/pipe/).

use super::placement::{combine_norm, Axis, NormPart};
use super::Engine;
use crate::comm::collective::Collective;
use crate::comm::tensor_ops::Reduce;
use crate::error::{Result, TorchContext};
use tch::Tensor;

/// The axes a norm is combined over, in order: the placement's (the data
/// axis when it shards), then the model splits' the mesh has.
pub(super) fn norm_axes(placement: &[Axis], tensor: bool, pipeline: bool) -> Vec<Axis> {
    let mut axes = placement.to_vec();
    for (axis, on) in [(Axis::Tensor, tensor), (Axis::Pipeline, pipeline)] {
        if on && !axes.contains(&axis) {
            axes.push(axis);
        }
    }
    axes
}

impl<C: Collective> Engine<C> {
    /// The `norm_type` norm of the whole model's reduced (summed)
    /// gradients, the same on every rank.
    pub(super) fn clip_norm(&mut self, norm_type: f64) -> Result<f64> {
        let mut part = match self.tensor_partial(norm_type)? {
            Some(mine) => NormPart::Partial(mine),
            None => {
                let (placement, mut parts) = self.placed();
                placement.norm_part(&mut parts, norm_type)?
            }
        };
        let axes = norm_axes(
            self.placement.strategy.norm_axes(),
            self.mesh.has(Axis::Tensor),
            self.mesh.has(Axis::Pipeline),
        );
        for axis in axes {
            part = NormPart::Norm(self.combine_over(axis, part, norm_type)?);
        }
        Ok(part.norm(norm_type))
    }

    /// `part` combined over `axis`'s group: the norm of every rank's.
    fn combine_over(&mut self, axis: Axis, part: NormPart, norm_type: f64) -> Result<f64> {
        let inf = norm_type.is_infinite();
        match axis {
            // Exact and in rank order: every rank the same bits.
            Axis::Data => combine_norm(
                &mut self.collective,
                part.partial(norm_type),
                &[Axis::Data],
                norm_type,
            ),
            Axis::Tensor => {
                let Some(tensor) = &self.tensor else {
                    return Ok(part.norm(norm_type));
                };
                let group = tensor.cell.get().ctx("computing the gradient norm")?;
                let t = Tensor::f_from_slice(&[part.partial(norm_type)])
                    .and_then(|t| t.f_to_device(group.device))
                    .ctx("computing the gradient norm")?;
                let op = if inf { Reduce::Max } else { Reduce::Sum };
                group
                    .all_reduce_(&t, op)
                    .ctx("summing the gradient norm over the tensor group")?;
                let total = t.f_double_value(&[0]).ctx("computing the gradient norm")?;
                Ok(NormPart::Partial(total).norm(norm_type))
            }
            Axis::Pipeline => self.pipeline_norm(part.norm(norm_type), norm_type),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_axes_are_the_placements_then_the_model_splits() {
        assert!(norm_axes(&[], false, false).is_empty());
        assert_eq!(norm_axes(&[Axis::Data], false, false), vec![Axis::Data]);
        assert_eq!(
            norm_axes(&[Axis::Data], true, true),
            vec![Axis::Data, Axis::Tensor, Axis::Pipeline]
        );
        assert_eq!(
            norm_axes(&[], false, true),
            vec![Axis::Pipeline],
            "a replicated stage is counted once over the data axis"
        );
    }

    #[test]
    fn a_part_converts_between_norm_and_partial() {
        assert_eq!(NormPart::Norm(5.0).partial(2.0), 25.0);
        assert_eq!(NormPart::Partial(25.0).norm(2.0), 5.0);
        assert_eq!(NormPart::Norm(3.0).partial(f64::INFINITY), 3.0);
        assert_eq!(NormPart::Partial(3.0).norm(f64::INFINITY), 3.0);
        assert_eq!(NormPart::Partial(8.0).norm(3.0), 2.0);
    }
}
