//! ZeRO stage 3 (issue 41): parameters, gradients and optimizer state all
//! sharded over the data axis, unit by unit ([`ParamShards`]: each rank
//! owns chunk r of every unit).
//!
//! - `sync = "boundary"`: the gradients accumulate whole over the window
//!   (the flat buffer, as stage 2 between its sync steps: FSDP2 with
//!   `set_requires_gradient_sync(False)`); the sync step reduce-scatters
//!   each unit's range, so every rank holds its chunks summed.
//! - `sync = "every_step"`: each unit's gradients are reduce-scattered as
//!   its backward ends and added to this rank's chunks of the window's sum
//!   ([`Placement::reduce_units`]); the unit's buffer is released, so only
//!   the units in flight hold gradients (DeepSpeed's and Gemini's way).
//!
//! The clip norm comes from the chunks (sum of squares over the data
//! axis, max for inf); the optimizer steps `owned` in place with state in
//! the same layout; nothing is gathered after the step: the next forward
//! gathers each unit. Checkpoints gather the optimizer state unit by unit
//! into PyTorch's per-parameter names, so they load under any stage and
//! world size.

use super::sharded::{slice_partial, step_slice, views_by_name, Shard, KEYS};
use super::{Axis, NormPart, ParamShards, Parts, Placement, ShardTaker};
use crate::comm::collective::Collective;
use crate::error::{Error, Result, TorchContext};
use crate::optim::{GradPrep, Optimizer};
use std::time::Duration;
use tch::{Device, Kind, Tensor};

pub(in crate::engine) struct ShardedParameters {
    shard: Shard,
    params: ParamShards,
    /// This rank's chunks of the window's reduced gradients (`owned`'s
    /// layout): accumulated unit by unit under `sync = "every_step"`, or
    /// taken at the sync step's reduce-scatter.
    sum: Option<Tensor>,
}

impl ShardedParameters {
    pub fn new(params: ParamShards) -> Self {
        Self {
            shard: Shard::default(),
            params,
            sum: None,
        }
    }

    /// This rank's chunks of the window's sum, zeroed if none yet.
    fn sum_at<C: Collective>(&mut self, p: &Parts<'_, C>) -> Result<Tensor> {
        if self.sum.is_none() {
            let n = self.params.owned_len(p.layout()) as i64;
            self.sum =
                Some(Tensor::f_zeros([n], (Kind::Float, Device::Cpu)).ctx("the gradient chunks")?);
        }
        self.sum
            .as_ref()
            .map(Tensor::shallow_clone)
            .ok_or_else(|| Error::Sharding("no gradient chunks".into()))
    }

    fn clear<C: Collective>(&mut self, p: &mut Parts<'_, C>) -> Result<()> {
        self.sum = None;
        if self.params.by_unit() {
            return Ok(());
        }
        p.grads.release(p.params)
    }
}

impl<C: Collective> Placement<C> for ShardedParameters {
    fn stage(&self) -> u32 {
        3
    }

    /// This rank's chunk of every unit, in unit order (`sum_at`'s layout).
    fn owned_grads(
        &mut self,
        p: &mut Parts<'_, C>,
    ) -> Result<(Tensor, Vec<std::ops::Range<usize>>)> {
        let (w, r) = p.layout();
        let chunks = self
            .params
            .layout_of_units()
            .into_iter()
            .map(|(flat, _)| {
                let c = crate::comm::shard::slice(flat.len(), w, r);
                flat.start + c.start..flat.start + c.end
            })
            .collect();
        Ok((self.sum_at(p)?, chunks))
    }

    fn stepped_tensors(&self, _params: usize) -> usize {
        1
    }

    /// Every unit's gradients were reduced as its backward ended
    /// ([`Placement::reduce_units`]).
    fn reduce_micro_step(&mut self, _p: &mut Parts<'_, C>) -> Result<()> {
        Ok(())
    }

    fn reduce(&mut self, p: &mut Parts<'_, C>, tally: &mut Vec<f32>) -> Result<()> {
        super::reduce_tally(p.collective, tally)?;
        if self.params.by_unit() {
            // (Zeros if no micro-step reduced anything.)
            let _ = self.sum_at(p)?;
            return Ok(());
        }
        let units = self.params.layout_of_units();
        let g = p
            .grads
            .cpu_mut()
            .ok_or_else(|| Error::Sharding("gradients are not on the CPU".into()))?;
        for (flat, _) in units {
            p.collective.reduce_scatter_sum(&mut g[flat])?;
        }
        let chunks = self.params.chunks_of_tensor(&p.grads.view()?, p.layout())?;
        self.sum = Some(chunks);
        Ok(())
    }

    fn reduce_units(&mut self, p: &mut Parts<'_, C>, units: &[usize]) -> Result<()> {
        let sum = self.sum_at(p)?;
        for &u in units {
            self.params.reduce_grads(u, p.collective, &sum)?;
        }
        Ok(())
    }

    fn norm_axes(&self) -> &'static [Axis] {
        &[Axis::Data]
    }

    fn norm_part(&mut self, p: &mut Parts<'_, C>, norm_type: f64) -> Result<NormPart> {
        slice_partial(self.sum_at(p)?, norm_type)
    }

    fn step(&mut self, p: &mut Parts<'_, C>, prep: Option<GradPrep>, lr: f64) -> Result<Duration> {
        if let Some(prep) = prep {
            let mut grad = self.sum_at(p)?;
            let owned = self.params.owned()?;
            self.shard.dirty = true;
            step_slice(p.optimizer, &owned, &mut grad, prep, lr)?;
            self.shard.layout = Some(p.layout());
            self.shard.dirty = false;
        }
        self.clear(p)?;
        p.grads.zero_extra()?;
        Ok(Duration::ZERO)
    }

    fn clear_grads(&mut self, p: &mut Parts<'_, C>) -> Result<()> {
        self.clear(p)
    }

    fn discard(&mut self) {
        self.sum = None;
    }

    fn held_gradient_bytes(&self) -> usize {
        self.sum.as_ref().map_or(0, |t| t.numel() * 4)
    }

    fn holds_whole_state(&self) -> bool {
        false
    }

    fn state_in_place(&self, layout: (usize, usize)) -> bool {
        self.shard.in_place(layout)
    }

    fn optimizer_state_bytes(&self, optimizer: &Optimizer, _params: &[(String, Tensor)]) -> usize {
        Shard::state_bytes(optimizer)
    }

    /// The whole state by PyTorch's names: every rank's chunks gathered
    /// unit by unit.
    fn optimizer_state(&mut self, p: &mut Parts<'_, C>) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (key, t) in p.optimizer.first_state() {
            let whole = self.params.gather_flat(&t, p.collective)?;
            out.extend(views_by_name(p.params, &whole, key)?);
        }
        Ok(out)
    }

    /// Keeps this rank's chunks of a whole saved state, taking from each
    /// saved tensor only the part in them (it may be a view of a mapped
    /// file: only those pages are read).
    fn load_optimizer_state(
        &mut self,
        p: &mut Parts<'_, C>,
        saved: Vec<(String, Tensor)>,
        steps: u64,
    ) -> Result<()> {
        self.load_optimizer_state_mapped(p, saved, steps, &|| {})
    }

    fn load_optimizer_state_mapped(
        &mut self,
        p: &mut Parts<'_, C>,
        saved: Vec<(String, Tensor)>,
        steps: u64,
        forget: &dyn Fn(),
    ) -> Result<()> {
        let layout = p.layout();
        let names: Vec<String> = p.params.iter().map(|(n, _)| n.clone()).collect();
        let numels: Vec<usize> = p.params.iter().map(|(_, t)| t.numel()).collect();
        let units: Vec<_> = self
            .params
            .layout_of_units()
            .into_iter()
            .map(|(_, params)| params)
            .collect();
        let mut saved: std::collections::HashMap<String, Tensor> = saved.into_iter().collect();
        let mut state = Vec::new();
        for key in KEYS {
            let named = |n: &str| format!("{n}.{key}");
            if !names.iter().any(|n| saved.contains_key(&named(n))) {
                continue;
            }
            let mut taker = ShardTaker::new(&names, &numels, &units, layout);
            for (name, t) in p.params.iter() {
                let part =
                    saved
                        .remove(&named(name))
                        .ok_or_else(|| Error::OptimizerStateMissing {
                            key: key.to_string(),
                            param: name.clone(),
                        })?;
                if part.size() != t.size() {
                    return Err(Error::OptimizerStateShape {
                        name: named(name),
                        got: part.size(),
                        want: t.size(),
                    });
                }
                taker.take(name, &part)?;
                forget();
            }
            state.push((key, taker.finish()?));
        }
        if let Some(extra) = saved.keys().next() {
            return Err(Error::OptimizerStateUnknown {
                name: extra.clone(),
            });
        }
        p.optimizer.set_first_state(state, steps);
        self.shard.layout = Some(p.layout());
        self.shard.dirty = false;
        Ok(())
    }

    fn param_shards(&mut self) -> Option<&mut ParamShards> {
        Some(&mut self.params)
    }
}
