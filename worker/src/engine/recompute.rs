//! Activation checkpointing (issue 41, `[performance]
//! activation_checkpointing = "full"`): the micro-step runs the model's
//! blocks in segments of `checkpoint_every` (the family's `Staged`
//! forward, as pipeline stages do). The forward keeps only each
//! segment's input, without a graph; the last segment runs with its graph
//! into the head and the loss, and its backward; then, last to first, each
//! segment is run again from its saved input, under the same autocast,
//! and back-propagated with the gradient its output received (the
//! backward of `sum(output * grad)`, whose gradient at the output is
//! `grad` exactly). The same operations on the same values as the
//! whole forward, so the same numbers: bit for bit on the CPU.

use super::window::LossScaleBy;
use super::Engine;
use crate::comm::collective::Collective;
use crate::error::{Error, Result, TorchContext};
use crate::family::model::Model;
use crate::source::batch::Batch;
use crate::spec::{ActivationCheckpointing, JobSpec, Normalize};
use std::ops::Range;
use tch::{Kind, Tensor};

/// Blocks `0..blocks` in segments of `every` (the last one shorter).
pub(super) fn split(blocks: usize, every: usize) -> Vec<Range<usize>> {
    let every = every.max(1);
    (0..blocks)
        .step_by(every)
        .map(|a| a..(a + every).min(blocks))
        .collect()
}

/// `range` in segments of `every` (the last one shorter).
pub(super) fn split_range(range: Range<usize>, every: usize) -> Vec<Range<usize>> {
    split(range.len(), every)
        .into_iter()
        .map(|r| r.start + range.start..r.end + range.start)
        .collect()
}

/// What `activation_checkpointing = "full"` recomputes, or how ZeRO-3
/// runs the blocks one unit at a time.
#[derive(Clone, Debug)]
pub(super) struct Recompute {
    /// Blocks in segments of `checkpoint_every` (ZeRO-3 without
    /// checkpointing: one block each).
    pub segments: Vec<Range<usize>>,
    /// Parameters more than one block uses (a tied embedding: the lookup
    /// in the first block, the head after the last).
    pub shared: Vec<String>,
    /// ZeRO-3 without activation checkpointing: each segment's graph is
    /// kept from its forward to its backward (nothing recomputed; only
    /// the parameters are released in between).
    pub keep: bool,
}

/// The segments `activation_checkpointing = "full"` recomputes, or
/// ZeRO-3's one block a segment with their graphs kept; None for neither.
pub(super) fn plan(spec: &JobSpec, model: &Model, staged: bool) -> Result<Option<Recompute>> {
    // Pipeline stages segment their own blocks (Engine::stage_recompute).
    if staged {
        return Ok(None);
    }
    let (segments, keep) = match segments(spec, model)? {
        Some(s) => (s, false),
        None if spec.sharding.stage == 3 => (split(blocks(spec, model)?, 1), true),
        None => return Ok(None),
    };
    let tied = spec.model.kind.is_decoder()
        && crate::spec::LlamaConfig::resolve(&spec.model)?.tie_word_embeddings;
    let shared = model
        .params
        .iter()
        .map(|(n, _)| n)
        .filter(|n| tied && n.ends_with("embed_tokens.weight"))
        .cloned()
        .collect();
    Ok(Some(Recompute {
        segments,
        shared,
        keep,
    }))
}

/// How many blocks the model runs in (the family's).
pub(super) fn blocks(spec: &JobSpec, model: &Model) -> Result<usize> {
    if model.staged().is_none() {
        return Err(Error::Schedule(format!(
            "model.kind = {} does not run in blocks",
            spec.model.kind
        )));
    }
    let names: Vec<String> = model.params.iter().map(|(n, _)| n.clone()).collect();
    Ok(crate::family::family(spec.model.kind)
        .blocks(&spec.model, &names)?
        .len())
}

fn segments(spec: &JobSpec, model: &Model) -> Result<Option<Vec<Range<usize>>>> {
    if spec.performance.activation_checkpointing != Some(ActivationCheckpointing::Full) {
        return Ok(None);
    }
    if model.staged().is_none() {
        return Err(Error::Schedule(format!(
            "model.kind = {} has no blocks to recompute",
            spec.model.kind
        )));
    }
    let blocks = blocks(spec, model)?;
    let every = spec.performance.checkpoint_every.unwrap_or(1) as usize;
    Ok(Some(split(blocks, every)))
}

impl<C: Collective> Engine<C> {
    /// [`Engine::forward_backward`] with the blocks recomputed in the
    /// backward (see the module documentation); returns the batch's count
    /// of loss terms.
    pub(super) fn recompute_forward_backward(
        &mut self,
        batch: &Batch,
        scale: LossScaleBy<'_>,
        plan: &Recompute,
    ) -> Result<u64> {
        let input = batch.inputs.shallow_clone();
        self.recompute_last(batch, scale, plan, input)
    }

    /// The forward and backward of `segments` from `input` (the batch's
    /// inputs, or a pipeline's last stage's received activation, whose
    /// gradient it fills) into the head and the loss; returns the batch's
    /// count of loss terms.
    pub(super) fn recompute_last(
        &mut self,
        batch: &Batch,
        scale: LossScaleBy<'_>,
        plan: &Recompute,
        input: Tensor,
    ) -> Result<u64> {
        let shared = &plan.shared[..];
        let (last, before) = plan
            .segments
            .split_last()
            .ok_or_else(|| Error::Schedule("no blocks to recompute".into()))?;
        let packed = self.spec.data.pack.then_some(&batch.inputs);
        let (device, precision) = (self.device, self.spec.precision);
        let (x, saved) = self.forward_segments(plan.keep, before, input, packed)?;
        // ZeRO-3: the last segment's units (and a tied head's embedding)
        // stay gathered through the loss's backward.
        let last_units = self.units_of(last.clone(), !shared.is_empty());
        self.zero3_gather(&last_units)?;
        self.zero3_open_grads(&last_units)?;
        // The last segment with its graph, the head and the loss, and its
        // backward.
        let x_last = if before.is_empty() {
            x
        } else {
            x.f_detach()
                .ctx("keeping a segment's input")?
                .set_requires_grad(true)
        };
        let summed = self.spec.accumulation.normalize == Normalize::GlobalCount;
        let one_pass = summed && matches!(scale, LossScaleBy::One) && self.head_loss_applies();
        // A parameter two segments use gets its two gradients from two
        // backwards; the whole graph's one backward sums them before they
        // join the window's sum. So they are summed apart here, then added
        // (the one-pass head adds its part into the window's sum itself,
        // as it does without recomputing).
        // (ZeRO-3 with gradients by unit starts each micro-step's
        // gradients at zero: nothing to set apart.)
        let apart = if one_pass || self.zero3_by_unit {
            Vec::new()
        } else {
            self.set_apart(shared)?
        };
        let mut autocast = crate::cuda::amp::Autocast::enter_with(device, precision, true)?;
        let out = self
            .model
            .staged()
            .ok_or_else(|| Error::Schedule("this model does not run in blocks".into()))?
            .stage_forward_with(&x_last, last.clone(), packed)?;
        let loss_sum = if one_pass {
            drop(autocast.take());
            self.head_loss_of(&out, batch, false)?
        } else {
            let logits = self.stage_logits(out)?;
            self.loss_backward(&logits, batch, scale, autocast.take())?
        };
        self.graph.add_loss(&loss_sum)?;
        self.zero3_release(&last_units)?;
        // A tied embedding's gradient is complete after block 0's own
        // backward: reduced then.
        self.zero3_reduce_grads(&self.units_of(last.clone(), false))?;
        // Back through the kept segments, last to first, each run again
        // (or, keeping graphs, back-propagated).
        let grad = x_last.grad();
        drop(x_last);
        self.backward_segments(plan.keep, before, saved, grad, packed)?;
        for (mut g, window) in apart {
            let _ = g.f_add_(&window).ctx("adding a shared gradient")?;
        }
        Ok(batch.count)
    }

    /// A pipeline rank's model chunk (`blocks`) in segments: recomputed
    /// under activation checkpointing, or ZeRO-3's one block a segment
    /// with their graphs kept; None for neither.
    pub(super) fn stage_recompute(&self, blocks: Range<usize>) -> Option<Recompute> {
        let full =
            self.spec.performance.activation_checkpointing == Some(ActivationCheckpointing::Full);
        if !full && self.spec.sharding.stage != 3 {
            return None;
        }
        let every = match full {
            true => self.spec.performance.checkpoint_every.unwrap_or(1) as usize,
            false => 1,
        };
        Some(Recompute {
            segments: split_range(blocks, every),
            shared: Vec::new(),
            keep: !full,
        })
    }

    /// `segments`' forward from `input`: with their graphs kept
    /// ([`Engine::forward_graphs`]) or without ([`Engine::forward_kept`]).
    pub(super) fn forward_segments(
        &mut self,
        keep: bool,
        segments: &[Range<usize>],
        input: Tensor,
        packed: Option<&Tensor>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        if keep {
            self.forward_graphs(segments, input, packed)
        } else {
            self.forward_kept(segments, input, packed)
        }
    }

    /// The backward of what [`Engine::forward_segments`] kept, from the
    /// gradient `grad` of the last segment's output.
    pub(super) fn backward_segments(
        &mut self,
        keep: bool,
        segments: &[Range<usize>],
        saved: Vec<Tensor>,
        grad: Tensor,
        packed: Option<&Tensor>,
    ) -> Result<()> {
        if keep {
            self.backward_graphs(segments, saved, grad)
        } else {
            self.backward_kept(segments, saved, grad, packed)
        }
    }

    /// fp16's loss scale over k for a micro-batch's backward (1 without).
    pub(super) fn micro_scale(&self) -> LossScaleBy<'static> {
        match self.loss_scale() {
            Some(ls) => LossScaleBy::Scalar(f64::from(ls.scale) / self.plan.k as f64),
            None => LossScaleBy::One,
        }
    }

    /// `segments` from `input` without a graph: the last one's output and
    /// each segment's input (the first is `input` itself).
    pub(super) fn forward_kept(
        &mut self,
        segments: &[Range<usize>],
        input: Tensor,
        packed: Option<&Tensor>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let _guard = tch::no_grad_guard();
        let _autocast =
            crate::cuda::amp::Autocast::enter_with(self.device, self.spec.precision, true)?;
        let mut saved = Vec::with_capacity(segments.len());
        let mut x = input;
        for seg in segments {
            let units = self.units_of(seg.clone(), false);
            self.zero3_gather(&units)?;
            let next = self.staged()?.stage_forward_with(&x, seg.clone(), packed)?;
            self.zero3_release_after_forward(&units)?;
            saved.push(std::mem::replace(&mut x, next));
        }
        Ok((x, saved))
    }

    /// ZeRO-3 without activation checkpointing: `segments` from `input`
    /// with their graphs, each segment's parameters gathered for its
    /// forward and released after it (its graph's saved views of them
    /// hold no memory until the backward gathers them again). Returns the
    /// last output and, per segment, its input (a fresh leaf past the
    /// first) and output.
    fn forward_graphs(
        &mut self,
        segments: &[Range<usize>],
        input: Tensor,
        packed: Option<&Tensor>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let mut kept = Vec::with_capacity(2 * segments.len());
        let mut x = input;
        for (i, seg) in segments.iter().enumerate() {
            let x_in = if i == 0 {
                x
            } else {
                x.f_detach()
                    .ctx("keeping a segment's input")?
                    .set_requires_grad(true)
            };
            let units = self.units_of(seg.clone(), false);
            self.zero3_gather(&units)?;
            let next = self.next_units(segments.get(i + 1));
            let (device, precision) = (self.device, self.spec.precision);
            let out = self.with_prefetch(&next, |model| {
                let _autocast = crate::cuda::amp::Autocast::enter_with(device, precision, true)?;
                staged_of(model)?.stage_forward_with(&x_in, seg.clone(), packed)
            })?;
            self.zero3_release_after_forward(&units)?;
            x = out.shallow_clone();
            kept.push(x_in);
            kept.push(out);
        }
        Ok((x, kept))
    }

    /// Back through what [`Engine::forward_graphs`] kept, last to first:
    /// each segment's parameters gathered, its output back-propagated
    /// with the gradient it received, its parameters released.
    fn backward_graphs(
        &mut self,
        segments: &[Range<usize>],
        kept: Vec<Tensor>,
        mut grad: Tensor,
    ) -> Result<()> {
        let mut kept = kept.into_iter().rev();
        for (i, seg) in segments.iter().enumerate().rev() {
            let (out, x_in) = match (kept.next(), kept.next()) {
                (Some(o), Some(x)) => (o, x),
                _ => return Err(Error::Schedule("a kept segment is missing".into())),
            };
            let units = self.units_of(seg.clone(), false);
            self.zero3_gather(&units)?;
            self.zero3_open_grads(&units)?;
            let next = self.next_units(i.checked_sub(1).and_then(|j| segments.get(j)));
            self.segment_backward(out, &grad, &units, &next)?;
            if i > 0 {
                grad = x_in.grad();
            }
        }
        Ok(())
    }

    /// A segment's backward: its output back-propagated with the gradient
    /// it received (the backward of `sum(out * grad)`; under ZeRO-3 the
    /// `next` segment's units gathered beside it), then its `units`
    /// released and their gradients reduced.
    fn segment_backward(
        &mut self,
        out: Tensor,
        grad: &Tensor,
        units: &[usize],
        next: &[usize],
    ) -> Result<()> {
        self.with_prefetch(next, |_| {
            out.f_mul(grad)
                .and_then(|y| y.f_sum(Kind::Float))
                .and_then(|y| y.f_backward())
                .ctx("running backward")
        })?;
        drop(out);
        self.zero3_release(units)?;
        self.zero3_reduce_grads(units)
    }

    /// The units of segment `seg` (none without one).
    fn next_units(&self, seg: Option<&Range<usize>>) -> Vec<usize> {
        seg.map(|s| self.units_of(s.clone(), false))
            .unwrap_or_default()
    }

    /// The model's blocks, run one range at a time.
    pub(super) fn staged(&self) -> Result<&dyn crate::family::Staged> {
        staged_of(&self.model)
    }

    /// Runs `segments` again from their kept inputs, last to first, each
    /// back-propagating the gradient its output received; the first
    /// segment's input is the one [`Engine::forward_kept`] was given (its
    /// gradient filled where it takes one), the others fresh leaves.
    pub(super) fn backward_kept(
        &mut self,
        segments: &[Range<usize>],
        saved: Vec<Tensor>,
        mut grad: Tensor,
        packed: Option<&Tensor>,
    ) -> Result<()> {
        for (i, (seg, input)) in segments.iter().zip(saved).enumerate().rev() {
            let units = self.units_of(seg.clone(), false);
            self.zero3_gather(&units)?;
            self.zero3_open_grads(&units)?;
            let x_in = if i == 0 {
                input
            } else {
                input
                    .f_detach()
                    .ctx("recomputing a segment")?
                    .set_requires_grad(true)
            };
            let out = {
                let _autocast =
                    crate::cuda::amp::Autocast::enter_with(self.device, self.spec.precision, true)?;
                self.staged()?
                    .stage_forward_with(&x_in, seg.clone(), packed)?
            };
            let next = self.next_units(i.checked_sub(1).and_then(|j| segments.get(j)));
            self.segment_backward(out, &grad, &units, &next)?;
            if i > 0 {
                grad = x_in.grad();
            }
        }
        Ok(())
    }

    /// The gradients of `names` set apart: each one's window sum so far
    /// (returned with the gradient) and the gradient zeroed.
    fn set_apart(&self, names: &[String]) -> Result<Vec<(Tensor, Tensor)>> {
        let _guard = tch::no_grad_guard();
        names
            .iter()
            .filter_map(|n| self.model.params.iter().find(|(m, _)| m == n))
            .filter(|(_, p)| p.grad().defined())
            .map(|(_, p)| {
                let mut g = p.grad();
                let window = g.f_detach_copy().ctx("setting a shared gradient apart")?;
                let _ = g.f_zero_().ctx("setting a shared gradient apart")?;
                Ok((g, window))
            })
            .collect()
    }
}

/// `model`'s blocks, run one range at a time.
fn staged_of(model: &Model) -> Result<&dyn crate::family::Staged> {
    model
        .staged()
        .ok_or_else(|| Error::Schedule("this model does not run in blocks".into()))
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn segments_cover_the_blocks_in_order() {
        assert_eq!(super::split_range(3..8, 2), vec![3..5, 5..7, 7..8]);
        assert_eq!(split(6, 1), vec![0..1, 1..2, 2..3, 3..4, 4..5, 5..6]);
        assert_eq!(split(6, 4), vec![0..4, 4..6]);
        assert_eq!(split(3, 5), vec![0..3]);
        assert_eq!(split(4, 0), vec![0..1, 1..2, 2..3, 3..4]);
    }
}
