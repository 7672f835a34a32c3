//! ZeRO stages 1 and 2 (issue 17): optimizer state, then gradients too, sharded over the data axis.
//!
//! The sync step reduce-scatters the flat gradients so rank r holds slice r
//! ([`crate::comm::shard::slice`]) reduced, assembles the clipping norm from
//! every rank's partial, prepares and steps only its slice with optimizer
//! state for that slice only (one flat state tensor per kind: 1/W of
//! stage 0's), then all-gathers the parameters. Checkpoints gather the
//! state back into PyTorch's per-parameter names, so they load under any
//! stage and world size.
//!
//! Stage 2 also frees the gradient buffer: after each sync step (sync =
//! "boundary": the buffer lives from a window's first backward to its sync
//! step), or after each micro-step's reduce-scatter into a 1/W slice
//! accumulator (sync = "every_step": 1/W of the gradients between
//! micro-steps).
//!
//! On CUDA the gradients, the optimizer step and the state stay on the
//! device; the ring works in the pinned host mirror (the whole buffer
//! down for the reduce-scatter, this rank's slice back; the stepped slice
//! down for the all-gather, the whole buffer back). The CPU tests run that
//! staging path too (`RunOptions::copy_through_host`); it has not run on
//! a GPU yet.
//!
//! SGD, Adam and AdamW take the fused CPU pass (as stage 0), CUDA tensor
//! ops. A lost rank's shard is recovered by rolling every rank back to the
//! last checkpoint (engine/state_sync.rs); shard replicas on a ring
//! neighbour are not built.

use super::replicated::WindowSums;
use super::{host_f32, host_f32_mut, Axis, NormPart, Parts, Placement};
use crate::comm::collective::Collective;
use crate::comm::shard;
use crate::engine::flat::flatten;
use crate::error::{Error, InPlace, Result, TorchContext};
use crate::optim::{GradPrep, Optimizer};
use std::ops::Range;
use std::time::Duration;
use tch::{Device, Tensor};

/// The optimizer state kinds, as PyTorch names them.
pub(super) const KEYS: [&str; 3] = ["exp_avg", "exp_avg_sq", "momentum_buffer"];

/// What the sharded stages keep: where this rank's optimizer slice is.
#[derive(Default)]
pub(super) struct Shard {
    /// The (world size, rank) whose slice the optimizer state holds (None:
    /// no state yet).
    pub layout: Option<(usize, usize)>,
    /// The slice was stepped but the step not finished (its parameters
    /// not all-gathered): its state is ahead of the committed step.
    pub dirty: bool,
}

/// This rank's slice of the flat buffer.
fn my_slice<C: Collective>(p: &Parts<'_, C>) -> Range<usize> {
    let (w, r) = p.layout();
    shard::slice(p.flat_len(), w, r)
}

/// Reduce-scatter of the gradients: slice r summed over all ranks. On
/// CUDA (staged) the gradients go to the pinned host mirror, the ring
/// works there, and this rank's slice comes back to the device.
fn reduce_scatter<C: Collective>(p: &mut Parts<'_, C>) -> Result<()> {
    if p.grads.via_host() {
        let (len, s) = (p.flat_len(), my_slice(p));
        p.grads.to_host(0..len)?;
        let h = p
            .grads
            .host_mut()
            .ok_or_else(|| Error::Sharding("the host mirror is gone".into()))?;
        p.collective.reduce_scatter_sum(h)?;
        return p.grads.from_host(s);
    }
    let g = p
        .grads
        .cpu_mut()
        .ok_or_else(|| Error::Sharding("gradients are not on the CPU".into()))?;
    Ok(p.collective.reduce_scatter_sum(g)?)
}

/// This rank's slice of the gradient buffer (a view).
fn buffer_slice<C: Collective>(p: &Parts<'_, C>) -> Result<Tensor> {
    let s = my_slice(p);
    p.grads
        .view()?
        .f_narrow(0, s.start as i64, s.len() as i64)
        .ctx("the gradient slice")
}

/// The `norm_type` partial of this rank's slice `g` ([`shard::partial`]),
/// which engine/norm.rs combines over the data axis.
pub(super) fn slice_partial(g: Tensor, norm_type: f64) -> Result<NormPart> {
    let g = if g.device() == Device::Cpu {
        g
    } else {
        g.f_to_device(Device::Cpu).ctx("the gradient slice")?
    };
    Ok(NormPart::Partial(shard::partial(host_f32(&g)?, norm_type)))
}

/// Prepares the gradient slice `grad` and steps the flat parameter
/// slice `mine` with the optimizer's state for it (one tensor's worth):
/// on the CPU PyTorch's fused pass as stage 0 takes it, elsewhere tensor
/// ops. ZeRO-3 steps its shard with it too.
pub(super) fn step_slice(
    optimizer: &mut Optimizer,
    mine: &Tensor,
    grad: &mut Tensor,
    prep: GradPrep,
    lr: f64,
) -> Result<()> {
    let slot = [(String::new(), mine.shallow_clone())];
    let fused = grad.device() == Device::Cpu
        && optimizer.step_fused(&slot, host_f32_mut(grad)?, lr, prep)?;
    if !fused {
        match prep {
            GradPrep::Mul(f) => grad.f_mul_scalar_(f as f64).map(|_| ()),
            GradPrep::Div(d) => grad.f_div_scalar_(d as f64).map(|_| ()),
            GradPrep::DivClamp(d, v) => grad
                .f_div_scalar_(d as f64)
                .and_then(|mut g| g.f_clamp_(-(v as f64), v as f64))
                .map(|_| ()),
        }
        .ctx("preparing the gradient slice")?;
        optimizer.step_pairs(&[(mine.shallow_clone(), grad.shallow_clone())], lr)?;
    }
    Ok(())
}

/// Views of the flat tensor `whole` (the parameters' elements in order)
/// shaped as `params`, named `<param>.<key>` (or the parameter's own name
/// with an empty key): a state kind by PyTorch's names.
pub(in crate::engine) fn views_by_name(
    params: &[(String, Tensor)],
    whole: &Tensor,
    key: &str,
) -> Result<Vec<(String, Tensor)>> {
    let mut off = 0;
    params
        .iter()
        .map(|(name, t)| {
            let n = t.numel() as i64;
            let view = whole
                .f_narrow(0, off, n)
                .and_then(|v| v.f_view(t.size().as_slice()))
                .ctx("a view by name")?;
            off += n;
            let name = if key.is_empty() {
                name.clone()
            } else {
                format!("{name}.{key}")
            };
            Ok((name, view))
        })
        .collect()
}

/// A whole saved optimizer state by PyTorch's per-parameter names, kind
/// by kind, as one flat vector in the parameters' order, of which `keep`
/// makes this rank's tensor; refuses a missing, misshapen or unknown
/// tensor. Stages 1 to 3 resume with it (each keeps its own part).
pub(super) fn keep_of_saved<C: Collective>(
    p: &Parts<'_, C>,
    saved: Vec<(String, Tensor)>,
    mut keep: impl FnMut(&[f32]) -> Result<Tensor>,
) -> Result<Vec<(&'static str, Tensor)>> {
    let mut saved: std::collections::HashMap<String, Tensor> = saved.into_iter().collect();
    let mut state = Vec::new();
    for key in KEYS {
        let parts: Vec<Option<Tensor>> = p
            .params
            .iter()
            .map(|(name, _)| saved.remove(&format!("{name}.{key}")))
            .collect();
        if parts.iter().all(Option::is_none) {
            continue;
        }
        let mut flat = Vec::with_capacity(p.flat_len());
        for ((name, t), part) in p.params.iter().zip(parts) {
            let part = part.ok_or_else(|| Error::OptimizerStateMissing {
                key: key.to_string(),
                param: name.clone(),
            })?;
            if part.size() != t.size() {
                return Err(Error::OptimizerStateShape {
                    name: format!("{name}.{key}"),
                    got: part.size(),
                    want: t.size(),
                });
            }
            flat.extend(flatten(&[part])?);
        }
        state.push((key, keep(&flat)?));
    }
    if let Some(extra) = saved.keys().next() {
        return Err(Error::OptimizerStateUnknown {
            name: extra.clone(),
        });
    }
    Ok(state)
}

impl Shard {
    /// Prepares this rank's gradient slice `grad`, steps its parameters
    /// with the slice's optimizer state (on the CPU the fused pass, as
    /// stage 0; on CUDA tensor ops), and all-gathers the parameters. The
    /// gradient buffer (zeroed or released right after) is the gather's
    /// buffer, so no whole-model copy is allocated: only the slice's
    /// parameters.
    fn step<C: Collective>(
        &mut self,
        p: &mut Parts<'_, C>,
        mut grad: Tensor,
        prep: GradPrep,
        lr: f64,
    ) -> Result<()> {
        let s = my_slice(p);
        let (at, n) = (s.start as i64, s.len() as i64);
        // This rank's parameters, as one flat slice (the pieces of the
        // parameters that fall in it).
        let sizes: Vec<usize> = p.params.iter().map(|(_, t)| t.numel()).collect();
        let pieces = shard::pieces(&sizes, s.clone());
        let part = |q: &shard::Piece| -> Result<Tensor> {
            p.params[q.param]
                .1
                .f_view([-1])
                .and_then(|v| v.f_narrow(0, q.within.start as i64, q.within.len() as i64))
                .ctx("a parameter piece")
        };
        let parts: Vec<Tensor> = pieces.iter().map(part).collect::<Result<_>>()?;
        let mine = if parts.is_empty() {
            Tensor::f_zeros([0], (tch::Kind::Float, p.device))
        } else {
            Tensor::f_cat(&parts, 0)
        }
        .ctx("this rank's parameter slice")?;
        // Until the gather below is through, the slice's state is a step
        // ahead of the committed one: a ring re-formed meanwhile rolls back.
        self.dirty = true;
        step_slice(p.optimizer, &mine, &mut grad, prep, lr)?;
        self.layout = Some(p.layout());
        // The stepped slice goes to its place in the gradient buffer
        // (restored first under stage 2 with sync = "every_step"); the
        // gather fills in every other rank's.
        p.grads.restore(p.params)?;
        let flat = p.grads.view()?;
        if p.grads.via_host() {
            // CUDA: the gather runs in the pinned host mirror, and the
            // whole buffer goes back to the device once.
            p.grads
                .host_view(s.clone())?
                .f_copy_(&mine)
                .ctx("staging the stepped slice")?;
            let h = p
                .grads
                .host_mut()
                .ok_or_else(|| Error::Sharding("the host mirror is gone".into()))?;
            p.collective.all_gather(h)?;
            let len = p.flat_len();
            p.grads.from_host(0..len)?;
        } else {
            flat.f_narrow(0, at, n)
                .and_then(|mut g| g.f_copy_(&mine))
                .ctx("staging the stepped slice")?;
            let g = p
                .grads
                .cpu_mut()
                .ok_or_else(|| Error::Sharding("gradients are not on the CPU".into()))?;
            p.collective.all_gather(g)?;
        }
        for ((_, t), (_, src)) in p.params.iter().zip(views_by_name(p.params, &flat, "")?) {
            t.shallow_clone()
                .f_copy_(&src)
                .ctx("the gathered parameters")?;
        }
        self.dirty = false;
        Ok(())
    }

    pub fn in_place(&self, layout: (usize, usize)) -> bool {
        !self.dirty && self.layout.is_none_or(|l| l == layout)
    }

    pub fn state_bytes(optimizer: &Optimizer) -> usize {
        optimizer
            .first_state()
            .iter()
            .map(|(_, t)| t.numel() * t.kind().elt_size_in_bytes())
            .sum()
    }

    /// The whole state of parameters `run` by PyTorch's names: each rank's
    /// part of their flat range summed into zeros (one all-reduce a kind;
    /// every rank holds the run's state until it drops it).
    fn gather_state_of<C: Collective>(
        p: &mut Parts<'_, C>,
        run: Range<usize>,
    ) -> Result<Vec<(String, Tensor)>> {
        let at: usize = p.params[..run.start].iter().map(|(_, t)| t.numel()).sum();
        let len: usize = p.params[run.clone()].iter().map(|(_, t)| t.numel()).sum();
        let s = my_slice(p);
        // This rank's part of the run, within the run and within its slice.
        let (a, b) = (s.start.max(at), s.end.min(at + len));
        let mut out = Vec::new();
        for (key, t) in p.optimizer.first_state() {
            let mut buf = vec![0f32; len];
            if a < b {
                let mine = t
                    .f_narrow(0, (a - s.start) as i64, (b - a) as i64)
                    .and_then(|v| v.f_to_device(Device::Cpu))
                    .and_then(|v| v.f_contiguous())
                    .ctx("optimizer state")?;
                buf[a - at..b - at].copy_from_slice(host_f32(&mine)?);
            }
            p.collective.all_reduce_sum(&mut buf)?;
            let whole = Tensor::f_from_slice(&buf).ctx("optimizer state")?;
            out.extend(views_by_name(&p.params[run.clone()], &whole, key)?);
        }
        Ok(out)
    }

    /// The whole state by PyTorch's names: every rank's slice all-gathered.
    fn gather_state<C: Collective>(p: &mut Parts<'_, C>) -> Result<Vec<(String, Tensor)>> {
        let total = p.flat_len();
        let s = my_slice(p);
        let mut out = Vec::new();
        for (key, t) in p.optimizer.first_state() {
            // One whole-state tensor per kind, gathered in place; the
            // per-parameter tensors are views of it (no second copy).
            let whole = Tensor::f_zeros([total as i64], (tch::Kind::Float, Device::Cpu))
                .ctx("optimizer state")?;
            whole
                .f_narrow(0, s.start as i64, s.len() as i64)
                .and_then(|mut w| w.f_copy_(&t))
                .ctx("optimizer state")?;
            // SAFETY: `whole` is a contiguous float32 CPU tensor of `total`
            // elements that outlives this borrow; nothing else uses it.
            let buf =
                unsafe { std::slice::from_raw_parts_mut(whole.data_ptr() as *mut f32, total) };
            p.collective.all_gather(buf)?;
            out.extend(views_by_name(p.params, &whole, key)?);
        }
        Ok(out)
    }

    /// Keeps this rank's slice of a whole saved state.
    fn load_state<C: Collective>(
        &mut self,
        p: &mut Parts<'_, C>,
        saved: Vec<(String, Tensor)>,
        steps: u64,
    ) -> Result<()> {
        let s = my_slice(p);
        let device = p.device;
        let state = keep_of_saved(p, saved, |flat| {
            Tensor::from_slice(&flat[s.clone()])
                .f_to_device(device)
                .ctx("optimizer state")
        })?;
        p.optimizer.set_first_state(state, steps);
        self.layout = Some(p.layout());
        self.dirty = false;
        Ok(())
    }
}

/// What the two sharded stages share, written once: the trait items that
/// do not depend on where the gradients live.
macro_rules! sharded_common {
    () => {
        fn stepped_tensors(&self, _params: usize) -> usize {
            // One flat slice: one parameter's worth of state.
            1
        }

        fn norm_axes(&self) -> &'static [Axis] {
            // The slices are distinct over the data axis.
            &[Axis::Data]
        }

        fn holds_whole_state(&self) -> bool {
            false
        }

        fn state_in_place(&self, layout: (usize, usize)) -> bool {
            self.shard.in_place(layout)
        }

        fn optimizer_state_of(
            &mut self,
            p: &mut Parts<'_, C>,
            run: Range<usize>,
        ) -> Result<Vec<(String, Tensor)>> {
            Shard::gather_state_of(p, run)
        }

        fn optimizer_state_bytes(
            &self,
            optimizer: &Optimizer,
            _params: &[(String, Tensor)],
        ) -> usize {
            Shard::state_bytes(optimizer)
        }

        fn optimizer_state(&mut self, p: &mut Parts<'_, C>) -> Result<Vec<(String, Tensor)>> {
            Shard::gather_state(p)
        }

        fn load_optimizer_state(
            &mut self,
            p: &mut Parts<'_, C>,
            saved: Vec<(String, Tensor)>,
            steps: u64,
        ) -> Result<()> {
            self.shard.load_state(p, saved, steps)
        }

        fn step(
            &mut self,
            p: &mut Parts<'_, C>,
            prep: Option<GradPrep>,
            lr: f64,
        ) -> Result<Duration> {
            // This rank's slice only; the fused CPU pass prepares it.
            if let Some(prep) = prep {
                let grad = self.grad_slice(p)?;
                self.shard.step(p, grad, prep, lr)?;
                self.clear(p)?;
                p.grads.zero_extra()?;
            } else {
                self.clear(p)?;
            }
            Ok(Duration::ZERO)
        }

        fn owned_grads(&mut self, p: &mut Parts<'_, C>) -> Result<(Tensor, Vec<Range<usize>>)> {
            Ok((self.grad_slice(p)?, vec![my_slice(p)]))
        }

        fn norm_part(&mut self, p: &mut Parts<'_, C>, norm_type: f64) -> Result<NormPart> {
            slice_partial(self.grad_slice(p)?, norm_type)
        }
    };
}

/// Stage 1: the gradient buffer whole on every rank (reduce-scattered at
/// the sync step, each rank reading its slice), the optimizer state 1/W.
#[derive(Default)]
pub(in crate::engine) struct ShardedOptimizer {
    shard: Shard,
    /// `sync = "every_step"`: the window's all-reduced gradients.
    sums: WindowSums,
}

impl ShardedOptimizer {
    fn grad_slice<C: Collective>(&self, p: &Parts<'_, C>) -> Result<Tensor> {
        buffer_slice(p)
    }

    fn clear<C: Collective>(&mut self, p: &mut Parts<'_, C>) -> Result<()> {
        self.sums.clear();
        p.grads.zero()
    }
}

impl<C: Collective> Placement<C> for ShardedOptimizer {
    sharded_common!();

    fn stage(&self) -> u32 {
        1
    }

    fn reduce_micro_step(&mut self, p: &mut Parts<'_, C>) -> Result<()> {
        self.sums.add_micro_step(p)
    }

    fn reduce(&mut self, p: &mut Parts<'_, C>, tally: &mut Vec<f32>) -> Result<()> {
        if self.sums.restore(p)? {
            // Every step's gradients were all-reduced: the slice is there.
            return super::reduce_tally(p.collective, tally);
        }
        super::reduce_tally(p.collective, tally)?;
        reduce_scatter(p)
    }

    fn clear_grads(&mut self, p: &mut Parts<'_, C>) -> Result<()> {
        self.clear(p)
    }

    fn discard(&mut self) {
        self.sums.clear();
    }

    fn held_gradient_bytes(&self) -> usize {
        self.sums.bytes()
    }
}

/// Stage 2: stage 1 with the gradient buffer released after each sync
/// step, and under `sync = "every_step"` after each micro-step's
/// reduce-scatter (this rank's slice kept apart).
#[derive(Default)]
pub(in crate::engine) struct ShardedGradients {
    shard: Shard,
    /// `sync = "every_step"`: this rank's slice of the window's reduced
    /// gradients so far (the buffer is released).
    slice_sum: Option<Tensor>,
}

impl ShardedGradients {
    /// This rank's slice of the reduced gradients: the window's slice sum
    /// under `sync = "every_step"`, otherwise the slice of the buffer the
    /// reduce-scatter left it in.
    fn grad_slice<C: Collective>(&self, p: &Parts<'_, C>) -> Result<Tensor> {
        match &self.slice_sum {
            Some(acc) => Ok(acc.shallow_clone()),
            None => buffer_slice(p),
        }
    }

    /// Frees the gradient buffer until the next backward.
    fn clear<C: Collective>(&mut self, p: &mut Parts<'_, C>) -> Result<()> {
        self.slice_sum = None;
        p.grads.release(p.params)
    }
}

impl<C: Collective> Placement<C> for ShardedGradients {
    sharded_common!();

    fn stage(&self) -> u32 {
        2
    }

    /// Reduce-scatters the micro-step's gradients, adds this rank's slice
    /// to the window's slice sum and frees the whole buffer, so only 1/W
    /// of the gradients is held between micro-steps.
    fn reduce_micro_step(&mut self, p: &mut Parts<'_, C>) -> Result<()> {
        reduce_scatter(p)?;
        let slice = buffer_slice(p)?;
        match &mut self.slice_sum {
            None => self.slice_sum = Some(slice.f_detach_copy().ctx("accumulating")?),
            Some(acc) => {
                acc.f_add_(&slice).ctx_("accumulating")?;
            }
        }
        p.grads.release(p.params)
    }

    fn reduce(&mut self, p: &mut Parts<'_, C>, tally: &mut Vec<f32>) -> Result<()> {
        super::reduce_tally(p.collective, tally)?;
        if self.slice_sum.is_none() {
            reduce_scatter(p)?;
        }
        Ok(())
    }

    fn clear_grads(&mut self, p: &mut Parts<'_, C>) -> Result<()> {
        self.clear(p)
    }

    fn discard(&mut self) {
        self.slice_sum = None;
    }

    fn held_gradient_bytes(&self) -> usize {
        self.slice_sum
            .as_ref()
            .map_or(0, |t| t.numel() * t.kind().elt_size_in_bytes())
    }
}
