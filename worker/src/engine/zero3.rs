//! ZeRO-3 in the engine (issue 41, `[sharding] stage = 3`): the units set
//! up from the family's blocks, gathered and released around each block's
//! forward and backward (engine/recompute.rs runs the blocks), and whole
//! for every path that reads or writes the parameters as tensors (state
//! broadcast, resume, evaluation, checkpoints).

use super::placement::{ParamShards, ShardTaker};
use super::recompute::Recompute;
use super::Engine;
use crate::collective::Collective;
use crate::error::{Error, Result, TorchContext};
use crate::family::model::{Model, WeightsFrom};
use crate::spec::JobSpec;
use std::cell::RefCell;
use std::ops::Range;
use std::rc::Rc;
use tch::{Device, Tensor};

/// Refuses what stage 3 does not run yet, naming it (nothing below
/// stage 3).
pub(super) fn check(spec: &JobSpec, device: Device) -> Result<()> {
    if spec.sharding.stage != 3 {
        return Ok(());
    }
    let refuse = |what: String| Err(Error::Sharding(format!("sharding.stage = 3 {what}")));
    if device != Device::Cpu {
        return refuse(format!(
            "runs on the CPU so far; device {device:?} takes stages 0 to 2"
        ));
    }
    let family = crate::family::family(spec.model.kind);
    if !family.builds_by_stage() {
        return refuse(format!(
            "shards a model by its blocks: model.kind = {} has none (the mlp and the Llama family have)",
            spec.model.kind
        ));
    }
    Ok(())
}

/// Whether stage 3 gradients are kept by unit (`sync = "every_step"`).
pub(super) fn by_unit(spec: &JobSpec) -> bool {
    spec.sharding.stage == 3 && spec.accumulation.sync == crate::spec::SyncMode::EveryStep
}

/// Stage 3's units over parameters `names` (the model's order): the
/// family's blocks, as ranges of parameter indices.
pub(super) fn units(spec: &JobSpec, names: &[String]) -> Result<Vec<Range<usize>>> {
    let blocks = crate::family::family(spec.model.kind).blocks(&spec.model, names)?;
    units_over(&blocks, names)
}

/// A pipeline stage's units: the family's blocks `stage` (of the whole
/// model's parameters `all`) over the stage's parameters `here`.
pub(super) fn stage_units(
    spec: &JobSpec,
    all: &[String],
    stage: Range<usize>,
    here: &[String],
) -> Result<Vec<Range<usize>>> {
    let blocks = crate::family::family(spec.model.kind).blocks(&spec.model, all)?;
    let mine = blocks.get(stage.clone()).ok_or_else(|| {
        Error::Sharding(format!(
            "the stage's blocks {stage:?} are beyond the model's {}",
            blocks.len()
        ))
    })?;
    units_over(mine, here)
}

/// `blocks` as ranges of indices into `names`, which they must cover in
/// order.
fn units_over(blocks: &[crate::family::Block], names: &[String]) -> Result<Vec<Range<usize>>> {
    let mut units = Vec::with_capacity(blocks.len());
    let mut at = 0;
    for b in blocks {
        let start = at;
        for name in &b.params {
            if names.get(at) != Some(name) {
                return Err(Error::Sharding(format!(
                    "sharding.stage = 3 needs each block's parameters in the model's order; block {} holds {name}, the model has {:?} at {at}",
                    b.name,
                    names.get(at)
                )));
            }
            at += 1;
        }
        units.push(start..at);
    }
    if at != names.len() {
        return Err(Error::Sharding(format!(
            "sharding.stage = 3: the blocks cover {at} of the {} parameters ({:?} left)",
            names.len(),
            &names[at..]
        )));
    }
    Ok(units)
}

/// Stage 3's build: a first build that keeps nothing gives every
/// parameter's name and shape, then the real one hands each parameter's
/// values to a [`ShardTaker`] as it is made and releases them (the same
/// draws from the seed: the values are one process's). With `model.init`
/// the chunks are taken from the file instead, through a memory map, so
/// only this rank's parts of each tensor are read
/// ([`crate::checkpoint::mapped`]). Returns the model and this rank's
/// chunks at `layout`.
pub(super) fn build(
    spec: &JobSpec,
    shape: &[i64],
    classes: i64,
    device: Device,
    layout: (usize, usize),
) -> Result<(Model, Tensor)> {
    let all = Model::build_stage(
        &spec.model,
        shape,
        classes,
        device,
        spec.seed,
        Box::new(|_| false),
    )?
    .frozen;
    let names: Vec<String> = all.iter().map(|(n, _)| n.clone()).collect();
    let numels: Vec<usize> = all
        .iter()
        .map(|(_, s)| s.iter().product::<i64>().max(0) as usize)
        .collect();
    let units = units(spec, &names)?;
    let taker = Rc::new(RefCell::new(ShardTaker::new(
        &names, &numels, &units, layout,
    )));
    let took = taker.clone();
    let model = Model::build_sharded(
        &spec.model,
        shape,
        classes,
        device,
        spec.seed,
        Box::new(move |n, t| took.borrow_mut().take(n, t)),
    )?;
    let built: Vec<&String> = model.params.iter().map(|(n, _)| n).collect();
    if built != names.iter().collect::<Vec<_>>() {
        return Err(Error::Sharding(format!(
            "the sharded build made the parameters {built:?}, its first build {names:?}"
        )));
    }
    let taker = Rc::try_unwrap(taker)
        .map_err(|_| Error::Sharding("the build kept its parameter taker".into()))?
        .into_inner();
    let Some(given) = &spec.model.init else {
        return Ok((model, taker.finish()?));
    };
    drop(taker);
    let mut model = model;
    let owned = chunks_of(&mut model, WeightsFrom::Init(given), &units, layout)?;
    Ok((model, owned))
}

/// This rank's chunks at `layout` (over `units`) of the weights `from`
/// names (`model.init`, or a checkpoint's step folder), checked as
/// [`Model::load_named`] checks them and read through a memory map, only
/// this rank's parts of each tensor; the buffers and a tied head's copy
/// are loaded whole.
fn chunks_of(
    model: &mut Model,
    from: WeightsFrom<'_>,
    units: &[Range<usize>],
    layout: (usize, usize),
) -> Result<Tensor> {
    let names: Vec<String> = model.params.iter().map(|(n, _)| n.clone()).collect();
    let numels: Vec<usize> = model.params.iter().map(|(_, t)| t.numel()).collect();
    let given = match from {
        WeightsFrom::Init(p) | WeightsFrom::Checkpoint(p) => p,
    };
    crate::checkpoint::mapped::with_mapped(given, |tensors, forget| {
        let mut by_name = model.fit_named(from, tensors)?;
        let mut taker = ShardTaker::new(&names, &numels, units, layout);
        for name in &names {
            let t = by_name
                .get(name)
                .ok_or_else(|| Error::Sharding(format!("model.init lost {name}")))?;
            taker.take(name, t)?;
            // Only this rank's chunks stay: the file's pages go.
            forget();
        }
        model.copy_named(from, &mut by_name, false)?;
        taker.finish()
    })
    .map_err(|reason| match from {
        WeightsFrom::Init(_) => Error::Init {
            path: given.to_path_buf(),
            reason,
        },
        WeightsFrom::Checkpoint(_) => Error::Checkpoint {
            path: given.to_path_buf(),
            reason,
        },
    })?
}

/// Stage 3's parameters over `model` (None below stage 3): from the
/// sharded build's chunks (`built`), or, the model built whole (with
/// `model.init`), copied into the units.
/// A pipeline stage's parameters are its blocks' (`stage`: the whole
/// model's parameter names and the stage's blocks).
pub(super) fn shards(
    spec: &JobSpec,
    model: &Model,
    built: Option<(Tensor, (usize, usize))>,
    stage: Option<(&[String], Range<usize>)>,
) -> Result<Option<ParamShards>> {
    if spec.sharding.stage != 3 {
        return Ok(None);
    }
    let names: Vec<String> = model.params.iter().map(|(n, _)| n.clone()).collect();
    let units = match stage {
        Some((all, blocks)) => stage_units(spec, all, blocks, &names)?,
        None => units(spec, &names)?,
    };
    match built {
        Some((owned, layout)) => {
            ParamShards::from_built(&model.params, &units, by_unit(spec), owned, layout).map(Some)
        }
        None => ParamShards::new(&model.params, &units, by_unit(spec)).map(Some),
    }
}

impl<C: Collective> Engine<C> {
    /// The units a range of blocks uses: its own, and the embedding's
    /// (block 0) for a tied head.
    /// (In a pipeline stage the units are the stage's blocks, from its
    /// first.)
    pub(super) fn units_of(&self, blocks: Range<usize>, tied_head: bool) -> Vec<usize> {
        let first = self.pipe.as_ref().map_or(0, |p| p.blocks.start);
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
        let packed = self.spec.data.pack.then_some(inputs);
        let mut x = inputs.shallow_clone();
        for b in 0..blocks {
            let last = b + 1 == blocks;
            let units = self.units_of(b..b + 1, last && !plan.shared.is_empty());
            self.zero3_gather(&units)?;
            let staged = self
                .model
                .staged()
                .ok_or_else(|| Error::Sharding("this model does not run in blocks".into()))?;
            x = staged.stage_forward_with(&x, b..b + 1, packed)?;
            if last {
                x = self.stage_logits(x)?;
            }
            self.zero3_release(&units)?;
        }
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
        let tied_waits = self
            .pipe
            .as_ref()
            .is_some_and(|p| p.is_first() && p.stages > 1 && p.tied.is_some());
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
    /// seed, then `model.init`), written into every parameter.
    pub(super) fn initial_params_again(&mut self) -> Result<()> {
        let (shape, classes) = &self.build_shape;
        let mut fresh = Model::build(
            &self.spec.model,
            shape,
            *classes,
            self.device,
            self.spec.seed,
        )?;
        if let Some(given) = &self.spec.model.init {
            let tensors = super::setup::read_init(given)?;
            fresh.load_named(crate::family::model::WeightsFrom::Init(given), tensors)?;
        }
        self.with_local_whole(|e| {
            let _guard = tch::no_grad_guard();
            for ((name, mine), (_, theirs)) in e.model.params.iter().zip(&fresh.params) {
                mine.shallow_clone()
                    .f_copy_(theirs)
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

/// Which rank writes unit `u` of `units` at world size `w`: contiguous
/// runs of units, so the shard files number in the model's order.
pub(super) fn writer_of(u: usize, units: usize, w: usize) -> usize {
    u * w / units.max(1)
}

impl<C: Collective> Engine<C> {
    /// A ZeRO-3 checkpoint written by every rank, never whole on one
    /// (docs/SEMANTICS.md): rank r of a data group writes the whole
    /// tensors of its run of the units ([`writer_of`]) as shards of one
    /// Hugging Face checkpoint, and their optimizer state as an
    /// `optimizer-0000i-of-0000N` part; each unit is gathered once (every
    /// rank of the group takes part) and kept only by its writer. In
    /// pipeline stages each stage's data group writes its stage's units,
    /// the files numbered stage by stage. The first stage's data rank 0
    /// (holding the folder's lock) begins the step, writes the index, the
    /// trainer state and the other files, and publishes it under the
    /// usual rules (engine/pipe/checkpoint.rs); only names, sizes,
    /// checksums and outcomes cross the world.
    pub(super) fn zero3_checkpoint(&mut self) -> Result<std::path::PathBuf> {
        use super::pipe::checkpoint::{decode, encode, sizes, write_stage, Outcome};
        use crate::checkpoint::{self, shards as files};
        let (w, r) = (self.collective.world_size(), self.collective.rank());
        let stage = self.pipe.as_ref().map_or(0, |p| p.stage);
        let step = self.state.step;
        let dir = self.checkpoint_dir.clone();
        let units = match self.placement.strategy.param_shards() {
            Some(s) => s.layout_of_units(),
            None => return Err(Error::Sharding("a ZeRO-3 checkpoint below stage 3".into())),
        };
        let n = units.len();
        let state = self.placement.optimizer.first_state();
        let mut model: Vec<(String, Tensor)> = Vec::new();
        let mut opt: Vec<(String, Tensor)> = Vec::new();
        for (u, (_, params)) in units.iter().enumerate() {
            let mine = writer_of(u, n, w) == r;
            self.zero3_gather(&[u])?;
            if mine {
                for (name, t) in &self.model.params[params.clone()] {
                    model.push((name.clone(), t.f_detach_copy().ctx("copying a parameter")?));
                }
            }
            self.zero3_release(&[u])?;
            for (key, t) in &state {
                let whole = match self.placement.strategy.param_shards() {
                    Some(s) => s.gather_unit_of(t, u, &mut self.collective)?,
                    None => continue,
                };
                if !mine {
                    continue;
                }
                opt.extend(super::placement::views_by_name(
                    &self.model.params[params.clone()],
                    &whole,
                    key,
                )?);
            }
        }
        let writer = r == 0 && stage == 0;
        if writer {
            model.extend(
                self.model
                    .buffers
                    .iter()
                    .map(|(n, t)| (n.clone(), t.shallow_clone())),
            );
        }
        let max_shard = accrue_common::spec::shard_size_bytes(&self.spec.checkpoint.max_shard_size)
            .unwrap_or(u64::MAX);
        let plan = files::plan(&sizes(&model)?, max_shard);
        // Every rank's place (stage, data rank) and shard count, in world
        // rank order: the files number in the model's order (stage by
        // stage, data rank by data rank), the optimizer parts too.
        let place = (stage as u64) << 32 | r as u64;
        let places = self.collective.world_gather_u64(place)?;
        let counts = self.collective.world_gather_u64(plan.len() as u64)?;
        let before = |p: u64| places.iter().zip(&counts).filter(move |(q, _)| **q < p);
        let first = before(place).map(|(_, c)| c).sum::<u64>() as usize;
        let total = counts.iter().sum::<u64>() as usize;
        let part = before(place).count();
        let root = places.iter().position(|&p| p == 0).ok_or_else(|| {
            Error::Sharding(format!("no rank holds stage 0's data rank 0: {places:?}"))
        })?;
        // The writer begins; every rank learns the temporary folder
        // (empty: the writer could not begin, and says why at the end).
        let began = if writer {
            if self.folder_lock.is_none() {
                self.take_folder_lock()?;
            }
            checkpoint::begin_step(&mut checkpoint::disk::Local, &dir, step, &self.owner).map(Some)
        } else {
            Ok(None)
        };
        let mut name = match &began {
            Ok(Some(tmp)) => tmp.to_string_lossy().into_owned().into_bytes(),
            _ => Vec::new(),
        };
        self.collective.world_broadcast_bytes(&mut name, root)?;
        let tmp = (!name.is_empty())
            .then(|| std::path::PathBuf::from(String::from_utf8_lossy(&name).into_owned()));
        let outcome: Outcome = match &tmp {
            Some(tmp) => write_stage(tmp, &model, &plan, first, total, &opt, part, places.len())
                .map_err(|e| e.to_string()),
            None => Err("the writer could not begin the step".into()),
        };
        drop((model, opt));
        // Every outcome to the writer, in the files' order.
        let mut parts = Vec::with_capacity(places.len());
        for (from, &at) in places.iter().enumerate() {
            let mut b = if at == place {
                encode(&outcome)?
            } else {
                Vec::new()
            };
            self.collective.world_broadcast_bytes(&mut b, from)?;
            if writer {
                parts.push((at, decode::<Outcome>(&b, from)?));
            }
        }
        parts.sort_by_key(|(p, _)| *p);
        let parts = parts.into_iter().map(|(_, o)| o).collect();
        let result = if writer {
            match (began, tmp) {
                (Ok(Some(_)), Some(tmp)) => self.finish_parts(&tmp, parts),
                (Err(e), _) => Err(e),
                _ => Err(Error::Sharding("the writer began no step".into())),
            }
        } else {
            Ok(dir.join(checkpoint::step_name(step)))
        };
        let mut done = encode(&match &result {
            Ok(_) => Ok(()),
            Err(e) => Err(format!("the writer's write failed: {e}")),
        })?;
        self.collective.world_broadcast_bytes(&mut done, root)?;
        let done: std::result::Result<(), String> = decode(&done, root)?;
        match done {
            Ok(()) => result,
            Err(reason) => Err(Error::Checkpoint { path: dir, reason }),
        }
    }
}
