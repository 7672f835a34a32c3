//! Placement strategies: who owns which parameters, gradients and optimizer state.
//!
//! [`Placed`] owns what a rank holds besides the parameters: the
//! gradient-accumulation buffer and the optimizer state, and the
//! [`Placement`] strategy that shapes them. One strategy per job decides,
//! for the sync step, how the gradients
//! are reduced (all-reduce or reduce-scatter over the data axis), which
//! elements this rank's optimizer steps, how the parameters come back
//! (all-gather), what this rank contributes to the clip norm, and the shape
//! of the optimizer state it holds (whole, or its flat slice, gathered to
//! PyTorch's per-parameter names for checkpoints). The window
//! (engine/window.rs) calls the strategy and never asks which one it is.
//!
//! - [`Replicated`] (ZeRO stage 0): everything whole on every rank.
//! - [`ShardedOptimizer`] (stage 1): optimizer state sharded over the data
//!   axis; gradients reduce-scattered, parameters all-gathered.
//! - [`ShardedGradients`] (stage 2): stage 1 with the gradient buffer
//!   released between uses (1/W of the gradients held between
//!   micro-steps under `sync = "every_step"`).
//!
//! - [`ShardedParameters`] (stage 3, issue 41): the parameters sharded
//!   too ([`ParamShards`]): each rank keeps its chunk of every unit (a
//!   block), steps them in place and gathers a unit around its forward
//!   and its backward (engine/recompute.rs runs the blocks).
//!
//! **The clip norm** is assembled in one place (engine/norm.rs) from what
//! each rank owns ([`Placement::norm_part`]), over exactly the axes on
//! which the owned elements are distinct ([`Placement::norm_axes`], then
//! the model splits'): a replicated tensor is counted once (no reduction
//! over an axis it is replicated on); sharded slices are combined over the
//! data axis (sum of squares, max for the inf norm; [`combine_norm`]).
//!
//! **The tally** (loss sum, count, stop and checkpoint votes) is reduced
//! over the group that owns the loss ([`LOSS_OWNER`]). With today's
//! unsplit models that group is the data group, so [`Replicated`] sends
//! it in the same all-reduce as the gradients (the ring's byte counts
//! depend on it); the sharded strategies all-reduce it on its own.

mod params;
mod replicated;
mod sharded;
mod stage3;

pub(super) use params::{ParamShards, ShardTaker};
pub(super) use replicated::Replicated;
pub(super) use sharded::{views_by_name, ShardedGradients, ShardedOptimizer};
pub(super) use stage3::ShardedParameters;

use crate::comm::collective::Collective;
use crate::comm::shard;
use crate::error::{Error, Result};
use crate::grads::FlatGrads;
use crate::optim::{GradPrep, Optimizer};
use std::time::Duration;
use tch::{Device, Tensor};

/// The mesh's axes (the spec's one enum): a placement shards or
/// replicates over the data axis; the tensor and pipeline axes are the
/// model splits'.
pub(super) use crate::spec::Axis;

/// A rank's share of the norm: a norm already, or the partial it comes
/// from (the sum of the `norm_type`-th powers; the max for the inf norm).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(in crate::engine) enum NormPart {
    Norm(f64),
    Partial(f64),
}

impl NormPart {
    /// The partial: a norm raised to `norm_type` (itself for inf).
    pub(in crate::engine) fn partial(self, norm_type: f64) -> f64 {
        match self {
            NormPart::Partial(x) => x,
            NormPart::Norm(n) if norm_type.is_infinite() => n,
            NormPart::Norm(n) => n.powf(norm_type),
        }
    }

    /// The norm: a partial's `norm_type`-th root (itself for inf).
    pub(in crate::engine) fn norm(self, norm_type: f64) -> f64 {
        match self {
            NormPart::Norm(n) => n,
            NormPart::Partial(x) if norm_type.is_infinite() => x,
            NormPart::Partial(x) => x.powf(1.0 / norm_type),
        }
    }
}

/// The group that owns the loss (every rank of it computes part of the
/// same loss): the tally is reduced over these axes, the mesh's (the loss
/// owner's data group; engine/mesh.rs).
pub(super) use super::mesh::LOSS_OWNER;

/// What a strategy works on: the engine's pieces it borrows for one call.
pub(super) struct Parts<'a, C: Collective> {
    pub collective: &'a mut C,
    pub grads: &'a mut FlatGrads,
    pub params: &'a [(String, Tensor)],
    pub optimizer: &'a mut Optimizer,
    pub device: Device,
    /// `RunOptions::unfused_step`: the tensor-op step even on the CPU.
    pub unfused: bool,
}

impl<C: Collective> Parts<'_, C> {
    /// Elements of all parameters together (the flat buffer's length).
    pub fn flat_len(&self) -> usize {
        self.params.iter().map(|(_, p)| p.numel()).sum()
    }

    /// (world size, rank) on the data axis: which slice is this rank's.
    pub fn layout(&self) -> (usize, usize) {
        (self.collective.world_size(), self.collective.rank())
    }
}

/// One way of placing parameters, gradients and optimizer state over the
/// ranks. The sync step calls, in order: [`Placement::reduce`],
/// [`Placement::norm_part`] (engine/norm.rs), [`Placement::step`].
pub(super) trait Placement<C: Collective>: Send {
    /// The ZeRO stage this strategy is (0 to 3), for logs and the CUDA
    /// graph decisions.
    fn stage(&self) -> u32;

    /// How many tensors the optimizer steps (its state's shape): one per
    /// parameter, or one flat slice.
    fn stepped_tensors(&self, params: usize) -> usize;

    /// `sync = "every_step"`, after a micro-step's backward: reduces its
    /// gradients over the data axis and adds them to the window's sums.
    fn reduce_micro_step(&mut self, p: &mut Parts<'_, C>) -> Result<()>;

    /// The sync step's reduction: the window's gradients over the data
    /// axis (into the shape [`Placement::step`] reads), and `tally`
    /// summed over the loss owner's group ([`LOSS_OWNER`]).
    fn reduce(&mut self, p: &mut Parts<'_, C>, tally: &mut Vec<f32>) -> Result<()>;

    /// The axes over which the elements this rank owns are distinct: the
    /// clip norm's partials are combined over these (none: replicated,
    /// counted once).
    fn norm_axes(&self) -> &'static [Axis];

    /// This rank's share of the clip norm of the reduced (summed)
    /// gradients: the norm or the partial of the elements it owns, which
    /// engine/norm.rs combines over [`Placement::norm_axes`] and the
    /// mesh's other axes.
    fn norm_part(&mut self, p: &mut Parts<'_, C>, norm_type: f64) -> Result<NormPart>;

    /// The reduced gradients this rank owns, flat, and the ranges of the
    /// model's flat parameter order they are, in the tensor's order (the
    /// whole buffer at stage 0, the rank's slice at stages 1 and 2, its
    /// chunk of each unit at stage 3): what a norm that counts elements
    /// by parameter reads (tensor parallelism, engine/tensor.rs).
    fn owned_grads(
        &mut self,
        p: &mut Parts<'_, C>,
    ) -> Result<(Tensor, Vec<std::ops::Range<usize>>)>;

    /// Steps the elements this rank owns with `prep` applied to their
    /// gradients (None: a skipped step, nothing stepped), brings the
    /// parameters back to every rank, and clears the gradients for the
    /// next window. Returns the time spent preparing the gradients apart
    /// from the step (zero where one fused pass did both).
    fn step(&mut self, p: &mut Parts<'_, C>, prep: Option<GradPrep>, lr: f64) -> Result<Duration>;

    /// Clears the gradients after a step the device took (the sync graph)
    /// or a skipped one: zeroed in place, or released.
    fn clear_grads(&mut self, p: &mut Parts<'_, C>) -> Result<()>;

    /// Forgets the window's reduced sums (a discarded window).
    fn discard(&mut self);

    /// Bytes of gradients held apart from the buffer (the window's sums).
    fn held_gradient_bytes(&self) -> usize;

    /// Whether this rank holds the whole optimizer state (it can be
    /// broadcast to a rank that lost it).
    fn holds_whole_state(&self) -> bool;

    /// Whether the optimizer state this rank holds (if any) is the part
    /// its place in the current group owns and is not ahead of the
    /// committed step.
    fn state_in_place(&self, layout: (usize, usize)) -> bool;

    /// Bytes of optimizer state this rank holds.
    fn optimizer_state_bytes(&self, optimizer: &Optimizer, params: &[(String, Tensor)]) -> usize;

    /// The optimizer state by PyTorch's per-parameter names, whole (a
    /// collective under sharding: every rank must call it).
    fn optimizer_state(&mut self, p: &mut Parts<'_, C>) -> Result<Vec<(String, Tensor)>>;

    /// The whole optimizer state of parameters `run` (indices, contiguous
    /// in the flat order) by PyTorch's names: a collective under sharding
    /// (every rank calls it for the same run; a checkpoint's writer of the
    /// run keeps it), so that no rank holds more than a run at a time.
    fn optimizer_state_of(
        &mut self,
        p: &mut Parts<'_, C>,
        run: std::ops::Range<usize>,
    ) -> Result<Vec<(String, Tensor)>> {
        let names: std::collections::HashSet<&str> =
            p.params[run].iter().map(|(n, _)| n.as_str()).collect();
        Ok(p.optimizer
            .named_state(p.params)
            .into_iter()
            .filter(|(n, _)| n.rsplit_once('.').is_some_and(|(q, _)| names.contains(q)))
            .collect())
    }

    /// Restores state saved by [`Placement::optimizer_state`] under any
    /// placement and world size: this rank keeps the part it owns.
    fn load_optimizer_state(
        &mut self,
        p: &mut Parts<'_, C>,
        saved: Vec<(String, Tensor)>,
        steps: u64,
    ) -> Result<()>;

    /// [`Placement::load_optimizer_state`] from tensors that may view a
    /// mapped file ([`crate::checkpoint::mapped`]): a placement that reads
    /// only its part of each calls `forget` after each, dropping the
    /// pages read so far.
    fn load_optimizer_state_mapped(
        &mut self,
        p: &mut Parts<'_, C>,
        saved: Vec<(String, Tensor)>,
        steps: u64,
        forget: &dyn Fn(),
    ) -> Result<()> {
        let _ = forget;
        self.load_optimizer_state(p, saved, steps)
    }

    /// ZeRO-3's sharded parameters (None: every rank holds them whole).
    fn param_shards(&mut self) -> Option<&mut ParamShards> {
        None
    }

    /// ZeRO-3 with gradients by unit (`sync = "every_step"`): reduces
    /// `units`' gradients now, their backward done, into this rank's
    /// chunks of the window's sum.
    fn reduce_units(&mut self, _p: &mut Parts<'_, C>, units: &[usize]) -> Result<()> {
        Err(Error::Sharding(format!(
            "units {units:?} reduced by a placement of stage {} (stage 3 reduces by unit)",
            self.stage()
        )))
    }
}

/// What a rank holds besides the parameters, owned by placement: the
/// strategy, the gradient-accumulation buffer it reduces and releases,
/// and the optimizer state in the shape it decides (one tensor per
/// parameter, or this rank's flat slice). The engine reaches them only
/// through here; the parameters stay with the model (ZeRO-3 will hand
/// them to its strategy too).
pub(super) struct Placed<C: Collective> {
    pub strategy: Box<dyn Placement<C>>,
    /// Every parameter's `.grad` is a view of it.
    pub grads: FlatGrads,
    pub optimizer: Optimizer,
}

impl<C: Collective> Placed<C> {
    /// The strategy of `[sharding] stage`, the optimizer state in its
    /// shape for `params` parameters, and the buffer `grads`.
    /// Stage 3 takes the parameters' units (`shards`).
    pub fn new(
        stage: u32,
        optimizer: &crate::spec::OptimizerSpec,
        params: usize,
        grads: FlatGrads,
        shards: Option<ParamShards>,
    ) -> Self {
        let strategy = match shards {
            Some(s) => Box::new(ShardedParameters::new(s)),
            None => for_stage::<C>(stage),
        };
        let optimizer = Optimizer::new(optimizer, strategy.stepped_tensors(params));
        Self {
            strategy,
            grads,
            optimizer,
        }
    }
}

/// The strategy for `[sharding] stage`.
pub(super) fn for_stage<C: Collective>(stage: u32) -> Box<dyn Placement<C>> {
    match stage {
        0 => Box::new(Replicated::default()),
        1 => Box::new(ShardedOptimizer::default()),
        _ => Box::new(ShardedGradients::default()),
    }
}

/// Combines this rank's norm partial ([`shard::partial`]) over `axes`:
/// all-gathered (as f64 bits) and combined in rank order, so every rank
/// gets the same value; over no axis it is this rank's alone.
pub(super) fn combine_norm<C: Collective>(
    collective: &mut C,
    mine: f64,
    axes: &[Axis],
    norm_type: f64,
) -> Result<f64> {
    if !axes.contains(&Axis::Data) {
        return Ok(shard::combine(&[mine], norm_type));
    }
    let (w, r) = (collective.world_size(), collective.rank());
    let mut words = vec![0f32; 2 * w];
    words[2 * r..2 * r + 2].copy_from_slice(&shard::to_words(mine));
    collective.all_gather(&mut words)?;
    let partials: Vec<f64> = words
        .chunks(2)
        .map(|c| shard::from_words([c[0], c[1]]))
        .collect();
    Ok(shard::combine(&partials, norm_type))
}

/// Sums the tally over the loss owner's group ([`LOSS_OWNER`]) on its own
/// (the strategies whose gradients do not ride an all-reduce with it).
pub(super) fn reduce_tally<C: Collective>(collective: &mut C, tally: &mut Vec<f32>) -> Result<()> {
    debug_assert_eq!(LOSS_OWNER, &[Axis::Data]);
    Ok(collective.all_reduce_sum(tally)?)
}

/// The elements of a contiguous float32 CPU tensor, read-only.
pub(super) fn host_f32(t: &Tensor) -> Result<&[f32]> {
    host_f32_mut(t).map(|s| &*s)
}

/// The elements of a contiguous float32 CPU tensor (a gradient slice the
/// engine thread alone uses; the tensor handle outlives the slice).
#[allow(clippy::mut_from_ref)]
pub(super) fn host_f32_mut(t: &Tensor) -> Result<&mut [f32]> {
    if t.device() != Device::Cpu || t.kind() != tch::Kind::Float || !t.is_contiguous() {
        return Err(Error::Sharding(format!(
            "a gradient slice is {:?} on {:?}; sharding steps contiguous float32 on the CPU",
            t.kind(),
            t.device()
        )));
    }
    // SAFETY: checked above to be a contiguous float32 CPU tensor of
    // numel elements; the storage lives as long as the borrowed handle and
    // the engine thread is the only one touching it while the slice lives.
    Ok(unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, t.numel()) })
}

impl<C: Collective> super::Engine<C> {
    /// The placement and the engine pieces it works on, borrowed apart.
    pub(super) fn placed(&mut self) -> (&mut dyn Placement<C>, Parts<'_, C>) {
        let Placed {
            strategy,
            grads,
            optimizer,
        } = &mut self.placement;
        (
            strategy.as_mut(),
            Parts {
                collective: &mut self.collective,
                grads,
                params: &self.model.params,
                optimizer,
                device: self.device,
                unfused: self.opts.unfused_step,
            },
        )
    }

    /// Refuses a device sharding does not run on (checked at start).
    pub(super) fn check_sharding(&self) -> Result<()> {
        let stage = self.placement.strategy.stage();
        if stage >= 1 && !matches!(self.device, Device::Cpu | Device::Cuda(_)) {
            return Err(Error::Sharding(format!(
                "sharding.stage = {stage} runs on the CPU and CUDA; device {:?} needs stage 0",
                self.device
            )));
        }
        Ok(())
    }

    /// Whether the optimizer state this rank holds (if any) is the part
    /// its place in the current group owns.
    pub(super) fn shard_in_place(&self) -> bool {
        self.placement
            .strategy
            .state_in_place((self.collective.world_size(), self.collective.rank()))
    }

    /// Bytes of optimizer state this rank holds (under sharding its
    /// slice's only).
    pub fn optimizer_state_bytes(&self) -> usize {
        self.placement
            .strategy
            .optimizer_state_bytes(&self.placement.optimizer, &self.model.params)
    }

    /// Bytes of gradients this rank holds now: the accumulation buffer
    /// (while not released) and the window's sums the placement keeps.
    pub fn gradient_bytes(&self) -> usize {
        self.placement.grads.bytes() + self.placement.strategy.held_gradient_bytes()
    }

    /// [`Placement::optimizer_state_of`] (every rank calls it).
    pub(super) fn optimizer_state_of(
        &mut self,
        run: std::ops::Range<usize>,
    ) -> Result<Vec<(String, Tensor)>> {
        let (placement, mut parts) = self.placed();
        placement.optimizer_state_of(&mut parts, run)
    }

    /// The optimizer state by PyTorch's names, whole (every rank must
    /// call this: under sharding the slices are all-gathered).
    pub(super) fn optimizer_state(&mut self) -> Result<Vec<(String, Tensor)>> {
        let (placement, mut parts) = self.placed();
        placement.optimizer_state(&mut parts)
    }

    /// Restores state saved by [`super::Engine::optimizer_state`] under any
    /// stage and world size.
    pub(super) fn load_optimizer_state(
        &mut self,
        saved: Vec<(String, Tensor)>,
        steps: u64,
    ) -> Result<()> {
        let (placement, mut parts) = self.placed();
        placement.load_optimizer_state(&mut parts, saved, steps)
    }

    /// [`Placement::load_optimizer_state_mapped`].
    pub(super) fn load_optimizer_state_mapped(
        &mut self,
        saved: Vec<(String, Tensor)>,
        steps: u64,
        forget: &dyn Fn(),
    ) -> Result<()> {
        let (placement, mut parts) = self.placed();
        placement.load_optimizer_state_mapped(&mut parts, saved, steps, forget)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::collective::SingleRank;

    #[test]
    fn each_stage_has_its_strategy_and_state_shape() {
        for stage in 0..3 {
            let p = for_stage::<SingleRank>(stage);
            assert_eq!(p.stage(), stage);
            // Stage 0 steps every parameter; sharded stages one flat slice.
            let want = if stage == 0 { 7 } else { 1 };
            assert_eq!(p.stepped_tensors(7), want);
            assert_eq!(p.holds_whole_state(), stage == 0);
            // A fresh strategy holds no state that could be out of place.
            assert!(p.state_in_place((4, 2)));
        }
    }

    #[test]
    fn the_norm_is_combined_over_exactly_the_distinct_axes() {
        // Replicated: no axis holds distinct elements (counted once).
        let replicated = for_stage::<SingleRank>(0);
        assert!(replicated.norm_axes().is_empty());
        for stage in 1..3 {
            assert_eq!(for_stage::<SingleRank>(stage).norm_axes(), &[Axis::Data]);
        }
        let mut c = SingleRank;
        // Over no axis: this rank's partial alone (sum of squares -> sqrt).
        assert_eq!(combine_norm(&mut c, 25.0, &[], 2.0).unwrap(), 5.0);
        // Over the data axis of one rank: the same; inf takes the max.
        assert_eq!(combine_norm(&mut c, 25.0, &[Axis::Data], 2.0).unwrap(), 5.0);
        assert_eq!(
            combine_norm(&mut c, 3.0, &[Axis::Data], f64::INFINITY).unwrap(),
            3.0
        );
    }

    #[test]
    fn the_tally_is_reduced_over_the_loss_owner() {
        assert_eq!(LOSS_OWNER, &[Axis::Data]);
        let mut c = SingleRank;
        let mut tally = vec![1.0, 2.0];
        reduce_tally(&mut c, &mut tally).unwrap();
        assert_eq!(tally, vec![1.0, 2.0]);
    }
}
