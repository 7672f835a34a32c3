//! ZeRO-3 in the engine (issue 41, `[sharding] stage = 3`): the units set
//! up from the family's blocks (build.rs, with the sharded build and the
//! chunks of `model.init` and of a resumed checkpoint), gathered and
//! released around each block's forward and backward (engine/recompute.rs
//! runs the blocks), the next one prefetched beside the current one, and
//! the checkpoints every rank writes (engine/commit/).

mod build;

use build::chunks_of;
pub(super) use build::{build, by_unit, check, shards};

use super::recompute::Recompute;
use super::Engine;
use crate::comm::collective::Collective;
use crate::error::{Error, Result, TorchContext};
use crate::family::model::{Model, WeightsFrom};
use crate::spec::Axis;
use std::ops::Range;
use tch::Tensor;

impl<C: Collective> Engine<C> {
    /// The units a range of blocks uses: its own, and the embedding's
    /// (block 0) for a tied head.
    /// (In a pipeline stage the units are the stage's blocks, from its
    /// first.)
    pub(super) fn units_of(&self, blocks: Range<usize>, tied_head: bool) -> Vec<usize> {
        let first = self.pipe.as_ref().map_or(0, |p| p.blocks().start);
        let mut u: Vec<usize> = blocks.map(|b| b.saturating_sub(first)).collect();
        if tied_head && !u.contains(&0) {
            u.push(0);
        }
        u
    }

    /// Gathers `units` under ZeRO-3 (nothing otherwise).
    pub(super) fn zero3_gather(&mut self, units: &[usize]) -> Result<()> {
        match self.placement.strategy.param_shards() {
            Some(s) => s.gather(units, &mut self.collective),
            None => Ok(()),
        }
    }

    /// After a segment's forward: releases `units` under ZeRO-3 unless
    /// `sharding.reshard_after_forward = false` keeps them gathered until
    /// its backward.
    pub(super) fn zero3_release_after_forward(&mut self, units: &[usize]) -> Result<()> {
        if self.spec.sharding.reshard_after_forward == Some(false) {
            return Ok(());
        }
        self.zero3_release(units)
    }

    /// Runs `f` on the model while `next`'s units are gathered on a thread
    /// beside it (ZeRO-3 with `sharding.prefetch`, the default: the next
    /// unit's all-gather overlaps this unit's compute); otherwise just
    /// `f`. Every rank gathers the same units in the same order either
    /// way; `f` must not communicate.
    pub(super) fn with_prefetch<T>(
        &mut self,
        next: &[usize],
        f: impl FnOnce(&Model) -> Result<T>,
    ) -> Result<T> {
        let on = !next.is_empty() && self.zero3_prefetches();
        let shards = match self.placement.strategy.param_shards() {
            Some(s) if on => s,
            _ => return f(&self.model),
        };
        let (collective, model) = (&mut self.collective, &self.model);
        std::thread::scope(|scope| {
            let gathering = std::thread::Builder::new()
                .name("accrue-prefetch".into())
                .spawn_scoped(scope, move || shards.gather(next, collective))
                .map_err(|e| Error::Sharding(format!("starting a unit's prefetch: {e}")))?;
            let out = f(model);
            let gathered = gathering
                .join()
                .map_err(|_| Error::Sharding("a unit's prefetch panicked".into()))?;
            // The compute's failure first; then the gather's.
            let out = out?;
            gathered?;
            Ok(out)
        })
    }

    /// Whether ZeRO-3 gathers the next unit beside the current one.
    pub(super) fn zero3_prefetches(&self) -> bool {
        self.spec.sharding.stage == 3 && self.spec.sharding.prefetch != Some(false)
    }

    /// Releases `units` under ZeRO-3 (nothing otherwise).
    pub(super) fn zero3_release(&mut self, units: &[usize]) -> Result<()> {
        match self.placement.strategy.param_shards() {
            Some(s) => s.release(units),
            None => Ok(()),
        }
    }

    /// `blocks` of the model from `x` (a pipeline stage's evaluation):
    /// under ZeRO-3 one block at a time, each gathered and released.
    pub(super) fn blocks_forward(
        &mut self,
        x: &Tensor,
        blocks: Range<usize>,
        packed: Option<&Tensor>,
    ) -> Result<Tensor> {
        if self.placement.strategy.stage() != 3 {
            return self.staged()?.stage_forward_with(x, blocks, packed);
        }
        let mut x = x.shallow_clone();
        for b in blocks {
            let units = self.units_of(b..b + 1, false);
            self.zero3_gather(&units)?;
            x = self.staged()?.stage_forward_with(&x, b..b + 1, packed)?;
            self.zero3_release(&units)?;
        }
        Ok(x)
    }

    /// ZeRO-3's evaluation forward (no graph): the blocks one unit at a
    /// time, the last one gathered (with a tied head's embedding) through
    /// the head; the model's output, as [`Model::forward`] gives it.
    pub(super) fn zero3_eval_forward(&mut self, inputs: &Tensor) -> Result<Tensor> {
        let plan = self
            .recompute
            .clone()
            .ok_or_else(|| Error::Sharding("stage 3 runs its blocks in segments".into()))?;
        let blocks = plan.segments.last().map_or(0, |s| s.end);
        let last = blocks.saturating_sub(1);
        let packed = self.spec.data.pack.then_some(inputs);
        let x = self.blocks_forward(inputs, 0..last, packed)?;
        // The last block gathered (with a tied head's embedding) through
        // the head.
        let units = self.units_of(last..blocks, !plan.shared.is_empty());
        self.zero3_gather(&units)?;
        let x = self
            .staged()?
            .stage_forward_with(&x, last..blocks, packed)?;
        let x = self.stage_logits(x)?;
        self.zero3_release(&units)?;
        Ok(x)
    }

    /// Gradients by unit: zeroed buffers under `units` before their
    /// backward (nothing otherwise).
    pub(super) fn zero3_open_grads(&mut self, units: &[usize]) -> Result<()> {
        if !self.zero3_by_unit {
            return Ok(());
        }
        match self.placement.strategy.param_shards() {
            Some(s) => s.open_grads(units),
            None => Ok(()),
        }
    }

    /// Gradients by unit: `units`' backward is done; their gradients are
    /// reduce-scattered into this rank's chunks and released (nothing
    /// otherwise).
    ///
    /// A first pipeline stage's tied embedding (unit 0) waits for the
    /// last stage's head gradient ([`Engine::zero3_reduce_tied`]).
    pub(super) fn zero3_reduce_grads(&mut self, units: &[usize]) -> Result<()> {
        if !self.zero3_by_unit {
            return Ok(());
        }
        let tied_waits = self.mesh.has(Axis::Pipeline)
            && self.mesh.is_first_stage()
            && self.pipe.as_ref().is_some_and(|p| p.tied.is_some());
        let now: Vec<usize> = units
            .iter()
            .copied()
            .filter(|&u| !(tied_waits && u == 0))
            .collect();
        self.zero3_reduce_now(&now)
    }

    /// Gradients by unit, a first pipeline stage's tied embedding: the
    /// last stage's head gradient `add` (added into the embedding's
    /// gradient, opened first if its backward had none), then unit 0
    /// reduced (nothing without gradients by unit).
    pub(super) fn zero3_reduce_tied(
        &mut self,
        add: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<()> {
        if !self.zero3_by_unit {
            return add(self);
        }
        self.zero3_open_grads(&[0])?;
        add(self)?;
        self.zero3_reduce_now(&[0])
    }

    fn zero3_reduce_now(&mut self, units: &[usize]) -> Result<()> {
        self.window.units_reduced = true;
        let (placement, mut parts) = self.placed();
        placement.reduce_units(&mut parts, units)
    }

    /// A micro-step without a batch (an empty micro-batch: a rank with
    /// fewer samples) under ZeRO-3: the other ranks gather and reduce
    /// unit by unit, so this one takes part in the same collectives in
    /// the same order as [`Engine::recompute_last`] runs them, without
    /// computing (its gradients are zeros).
    pub(super) fn zero3_empty_micro_step(&mut self, plan: &Recompute) -> Result<()> {
        let (last, before) = plan
            .segments
            .split_last()
            .ok_or_else(|| Error::Sharding("no blocks".into()))?;
        self.zero3_empty_forward(before)?;
        // The last segment with the head (and a tied embedding) and the
        // loss; its gradients reduced, a tied embedding's after block 0.
        let last_units = self.units_of(last.clone(), !plan.shared.is_empty());
        self.zero3_gather(&last_units)?;
        self.zero3_release(&last_units)?;
        self.zero3_reduce_grads(&self.units_of(last.clone(), false))?;
        self.zero3_empty_backward(before)
    }

    /// An empty micro-batch's forward over `segments`: each gathered and
    /// released (or kept), as [`Engine::forward_segments`] does.
    pub(super) fn zero3_empty_forward(&mut self, segments: &[Range<usize>]) -> Result<()> {
        for seg in segments {
            let units = self.units_of(seg.clone(), false);
            self.zero3_gather(&units)?;
            self.zero3_release_after_forward(&units)?;
        }
        Ok(())
    }

    /// An empty micro-batch's backward over `segments`, last to first:
    /// each gathered, released and its (zero) gradients reduced, as
    /// [`Engine::backward_segments`] does.
    pub(super) fn zero3_empty_backward(&mut self, segments: &[Range<usize>]) -> Result<()> {
        for (i, seg) in segments.iter().enumerate().rev() {
            let units = self.units_of(seg.clone(), false);
            self.zero3_gather(&units)?;
            // The prefetch of the segment before, where the others run it.
            if let Some(prev) = i.checked_sub(1).filter(|_| self.zero3_prefetches()) {
                let before = self.units_of(segments[prev].clone(), false);
                self.zero3_gather(&before)?;
            }
            self.zero3_release(&units)?;
            self.zero3_reduce_grads(&units)?;
        }
        Ok(())
    }

    /// Every unit gathered, so the parameters can be read and written as
    /// tensors; returns whether they were sharded (then
    /// [`Engine::reshard_params`] afterwards).
    pub(super) fn unshard(&mut self) -> Result<bool> {
        match self.placement.strategy.param_shards() {
            Some(s) => s.unshard(&mut self.collective),
            None => Ok(false),
        }
    }

    /// This rank's shard taken from the whole parameters at the current
    /// layout, every unit released (nothing below stage 3).
    pub(super) fn reshard_params(&mut self) -> Result<()> {
        let layout = (self.collective.world_size(), self.collective.rank());
        match self.placement.strategy.param_shards() {
            Some(s) => s.reshard(layout),
            None => Ok(()),
        }
    }

    /// ZeRO-3: shards parameters that are whole (nothing otherwise).
    pub(super) fn shard_params(&mut self) -> Result<()> {
        if self
            .placement
            .strategy
            .param_shards()
            .is_some_and(|s| s.is_whole())
        {
            self.reshard_params()?;
        }
        Ok(())
    }

    /// Runs `f` with the parameters whole (gathered under ZeRO-3, then
    /// sharded again from what `f` left in them).
    pub(super) fn with_whole<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let sharded = self.unshard()?;
        let out = f(self);
        if sharded {
            self.reshard_params()?;
        }
        out
    }

    /// Runs `f`, which writes every parameter, with their storage whole
    /// (allocated without a gather, so without any peer), then shards
    /// them again.
    pub(super) fn with_local_whole<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T>,
    ) -> Result<T> {
        let sharded = match self.placement.strategy.param_shards() {
            Some(s) => s.unshard_local()?,
            None => false,
        };
        let out = f(self);
        if sharded {
            self.reshard_params()?;
        }
        out
    }

    /// The initial weights again, as the engine built them (the job's
    /// seed, then `model.init`): this rank's chunks by the sharded build
    /// (never the whole model); a pipeline stage's own parameters built
    /// again (1/P of the model) and written by name.
    pub(super) fn initial_params_again(&mut self) -> Result<()> {
        let (shape, classes) = self.build_shape.clone();
        let (device, seed) = (self.device, self.spec.seed);
        // Tensor parallelism builds the whole model and cuts it (below).
        if !self.mesh.is_split() {
            let layout = (self.collective.world_size(), self.collective.rank());
            let (_, owned) = build(&self.spec, &shape, classes, device, layout)?;
            return match self.placement.strategy.param_shards() {
                Some(s) => s.set_owned(owned, layout),
                None => Ok(()),
            };
        }
        let names: std::collections::HashSet<String> =
            self.model.params.iter().map(|(n, _)| n.clone()).collect();
        let keep = names.clone();
        let mut fresh = Model::build_stage(
            &self.spec.model,
            &shape,
            classes,
            device,
            seed,
            Box::new(move |n| keep.contains(n)),
        )?;
        fresh.restrict(&names, None)?;
        if let Some(given) = &self.spec.model.init {
            let tensors = super::setup::read_init(given)?;
            fresh.load_named(WeightsFrom::Init(given), tensors)?;
        }
        // Tensor parallelism: this rank's slices of the whole values.
        if let Some(t) = &self.tensor {
            let _guard = tch::no_grad_guard();
            let rank = self.mesh.tensor_rank();
            for (name, p) in &mut fresh.params {
                if let Some(slice) = t.layout.get(name) {
                    *p = crate::family::tensor::take(p, slice, rank)
                        .ctx("cutting the initial weights for tensor parallelism")?;
                }
            }
        }
        let theirs: std::collections::HashMap<&str, &Tensor> =
            fresh.params.iter().map(|(n, t)| (n.as_str(), t)).collect();
        self.with_local_whole(|e| {
            let _guard = tch::no_grad_guard();
            for (name, mine) in &e.model.params {
                let src = theirs.get(name.as_str()).ok_or_else(|| {
                    Error::Sharding(format!("the stage built again lacks {name}"))
                })?;
                mine.shallow_clone()
                    .f_copy_(src)
                    .map_err(|err| Error::Sharding(format!("initialising {name}: {err}")))?;
            }
            Ok(())
        })
    }

    /// ZeRO-3's resume: this rank's chunks of the parameters in step
    /// folder `path` at the current layout, every unit released.
    pub(super) fn zero3_load_chunks(&mut self, path: &std::path::Path) -> Result<()> {
        let layout = (self.collective.world_size(), self.collective.rank());
        let units: Vec<Range<usize>> = match self.placement.strategy.param_shards() {
            Some(s) => s.layout_of_units().into_iter().map(|(_, p)| p).collect(),
            None => return Err(Error::Sharding("a ZeRO-3 resume below stage 3".into())),
        };
        let owned = chunks_of(
            &mut self.model,
            WeightsFrom::Checkpoint(path),
            &units,
            layout,
        )?;
        match self.placement.strategy.param_shards() {
            Some(s) => s.set_owned(owned, layout),
            None => Ok(()),
        }
    }

    /// Copies of every parameter by name, whole under any sharding stage
    /// (a collective under stage 3: every rank must call it).
    pub fn whole_parameters(&mut self) -> Result<Vec<(String, Tensor)>> {
        self.with_whole(|e| {
            e.model
                .params
                .iter()
                .map(|(n, t)| Ok((n.clone(), t.f_detach_copy().ctx("copying a parameter")?)))
                .collect()
        })
    }
}
