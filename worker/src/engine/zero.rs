//! ZeRO stage 1 in the engine (issue 17; `[sharding] stage = 1`): the
//! sync step reduce-scatters the flat gradients so rank r holds slice r
//! ([`crate::shard::slice`]) reduced, assembles the clipping norm from
//! every rank's partial, prepares and steps only its slice with optimizer
//! state for that slice only (one flat state tensor per kind: 1/W of
//! stage 0's), then all-gathers the parameters. Checkpoints gather the
//! state back into PyTorch's per-parameter names, so they load under any
//! stage and world size.
//!
//! Stage 2 (`stage = 2`) also frees the gradient buffer: after each sync
//! step (sync = "boundary": the buffer lives from a window's first
//! backward to its sync step), or after each micro-step's reduce-scatter
//! into a 1/W slice accumulator (sync = "every_step": 1/W of the gradients
//! between micro-steps).
//!
//! On CUDA the gradients, the optimizer step and the state stay on the
//! device; the ring works in the pinned host mirror (the whole buffer
//! down for the reduce-scatter, this rank's slice back; the stepped slice
//! down for the all-gather, the whole buffer back). The CPU tests run that
//! staging path too (`RunOptions::copy_through_host`); it has not run on
//! a GPU yet.
//!
//! SGD, Adam and AdamW take the fused CPU pass (as stage 0), CUDA tensor
//! ops. A lost rank's shard is recovered by rolling every rank
//! back to the last checkpoint (engine/state_sync.rs); shard replicas on a
//! ring neighbour are not built.

use super::flat::flatten;
use super::Engine;
use crate::collective::Collective;
use crate::error::{Error, InPlace, Result, TorchContext};
use crate::optim::GradPrep;
use crate::shard;
use std::ops::Range;
use tch::{Device, Tensor};

/// The optimizer state kinds, as PyTorch names them.
const KEYS: [&str; 3] = ["exp_avg", "exp_avg_sq", "momentum_buffer"];

impl<C: Collective> Engine<C> {
    /// Whether the optimizer state is sharded.
    pub(super) fn sharded(&self) -> bool {
        self.spec.sharding.stage >= 1
    }

    /// Refuses a device sharding does not run on (checked at start).
    pub(super) fn check_sharding(&self) -> Result<()> {
        if self.sharded() && !matches!(self.device, Device::Cpu | Device::Cuda(_)) {
            return Err(Error::Sharding(format!(
                "sharding.stage = {} runs on the CPU and CUDA; device {:?} needs stage 0",
                self.spec.sharding.stage, self.device
            )));
        }
        Ok(())
    }

    /// Bytes of optimizer state this rank holds (under stage 1 its slice's
    /// only).
    pub fn optimizer_state_bytes(&self) -> usize {
        let state = if self.sharded() {
            self.optimizer
                .first_state()
                .into_iter()
                .map(|(_, t)| t)
                .collect::<Vec<_>>()
        } else {
            self.optimizer
                .named_state(&self.model.params)
                .into_iter()
                .map(|(_, t)| t)
                .collect()
        };
        state
            .iter()
            .map(|t| t.numel() * t.kind().elt_size_in_bytes())
            .sum()
    }

    /// Elements of all parameters together (the flat buffer's length).
    fn flat_len(&self) -> usize {
        self.model.params.iter().map(|(_, p)| p.numel()).sum()
    }

    /// (world size, rank): which slice is this rank's.
    fn layout(&self) -> (usize, usize) {
        (self.collective.world_size(), self.collective.rank())
    }

    /// Whether the optimizer state this rank holds (if any) is its slice
    /// in the current ring.
    pub(super) fn shard_in_place(&self) -> bool {
        !self.zero_dirty && self.zero_layout.is_none_or(|l| l == self.layout())
    }

    /// This rank's slice of the flat buffer.
    fn my_slice(&self) -> Range<usize> {
        shard::slice(
            self.flat_len(),
            self.collective.world_size(),
            self.collective.rank(),
        )
    }

    /// Reduce-scatter of the gradients: slice r summed over all ranks. On
    /// CUDA (staged) the gradients go to the pinned host mirror, the ring
    /// works there, and this rank's slice comes back to the device.
    pub(super) fn zero_reduce(&mut self) -> Result<()> {
        if self.grads.via_host() {
            let (len, s) = (self.flat_len(), self.my_slice());
            self.grads.to_host(0..len)?;
            let h = self
                .grads
                .host_mut()
                .ok_or_else(|| Error::Sharding("the host mirror is gone".into()))?;
            self.collective.reduce_scatter_sum(h)?;
            return self.grads.from_host(s);
        }
        let g = self
            .grads
            .cpu_mut()
            .ok_or_else(|| Error::Sharding("gradients are not on the CPU".into()))?;
        Ok(self.collective.reduce_scatter_sum(g)?)
    }

    /// This rank's slice of the reduced gradients: stage 2 with
    /// `sync = "every_step"` keeps it apart (the window's sum so far, the
    /// whole buffer released between micro-steps); otherwise it is the
    /// slice of the buffer the reduce-scatter left it in.
    fn grad_slice(&self) -> Result<Tensor> {
        match &self.zero_acc {
            Some(acc) => Ok(acc.shallow_clone()),
            None => {
                let s = self.my_slice();
                self.grads
                    .view()?
                    .f_narrow(0, s.start as i64, s.len() as i64)
                    .ctx("the gradient slice")
            }
        }
    }

    /// Stage 2 with `sync = "every_step"`, after a micro-step's backward:
    /// reduce-scatters its gradients, adds this rank's slice to the
    /// window's slice accumulator and frees the whole buffer, so only 1/W
    /// of the gradients is held between micro-steps.
    pub(super) fn zero_reduce_micro_step(&mut self) -> Result<()> {
        self.zero_reduce()?;
        let slice = {
            let s = self.my_slice();
            self.grads
                .view()?
                .f_narrow(0, s.start as i64, s.len() as i64)
                .ctx("the gradient slice")?
        };
        match &mut self.zero_acc {
            None => self.zero_acc = Some(slice.f_detach_copy().ctx("accumulating")?),
            Some(acc) => {
                acc.f_add_(&slice).ctx_("accumulating")?;
            }
        }
        self.grads.release(&self.model.params)
    }

    /// After a sync step (or a skipped one): stage 2 frees the gradient
    /// buffer until the next backward, stage 0 and 1 zero it in place.
    pub(super) fn clear_grads(&mut self) -> Result<()> {
        self.zero_acc = None;
        if self.spec.sharding.stage >= 2 {
            self.grads.release(&self.model.params)
        } else {
            self.grads.zero()
        }
    }

    /// Bytes of gradients this rank holds now: the accumulation buffer
    /// (while not released), stage 2's slice accumulator and sync =
    /// every_step's window sums.
    pub fn gradient_bytes(&self) -> usize {
        let t = |t: &Tensor| t.numel() * t.kind().elt_size_in_bytes();
        self.grads.bytes()
            + self.zero_acc.as_ref().map_or(0, t)
            + self.acc.as_ref().map_or(0, |a| a.iter().map(t).sum())
    }

    /// The global `norm_type` norm of the (summed) gradients from every
    /// rank's slice: each rank's partial is all-gathered (as f64 bits) and
    /// combined in rank order, so every rank gets the same value.
    pub(super) fn zero_norm(&mut self, norm_type: f64) -> Result<f64> {
        let (w, r) = (self.collective.world_size(), self.collective.rank());
        let g = self.grad_slice()?;
        let g = if g.device() == Device::Cpu {
            g
        } else {
            g.f_to_device(Device::Cpu).ctx("the gradient slice")?
        };
        let mine = shard::partial(host_f32(&g)?, norm_type);
        let mut words = vec![0f32; 2 * w];
        words[2 * r..2 * r + 2].copy_from_slice(&shard::to_words(mine));
        self.collective.all_gather(&mut words)?;
        let partials: Vec<f64> = words
            .chunks(2)
            .map(|c| shard::from_words([c[0], c[1]]))
            .collect();
        Ok(shard::combine(&partials, norm_type))
    }

    /// Prepares this rank's gradient slice, steps its parameters with the
    /// slice's optimizer state (on the CPU the fused pass, as stage 0; on
    /// CUDA tensor ops), and all-gathers the parameters. The
    /// gradient buffer (zeroed or released right after) is the gather's
    /// buffer, so no whole-model copy is allocated: only the slice's
    /// parameters.
    pub(super) fn zero_step(&mut self, prep: GradPrep, lr: f64) -> Result<()> {
        let s = self.my_slice();
        let (at, n) = (s.start as i64, s.len() as i64);
        let mut grad = self.grad_slice()?;
        // This rank's parameters, as one flat slice (the pieces of the
        // parameters that fall in it).
        let sizes: Vec<usize> = self.model.params.iter().map(|(_, p)| p.numel()).collect();
        let pieces = shard::pieces(&sizes, s.clone());
        let part = |p: &shard::Piece| -> Result<Tensor> {
            self.model.params[p.param]
                .1
                .f_view([-1])
                .and_then(|v| v.f_narrow(0, p.within.start as i64, p.within.len() as i64))
                .ctx("a parameter piece")
        };
        let parts: Vec<Tensor> = pieces.iter().map(part).collect::<Result<_>>()?;
        let mine = if parts.is_empty() {
            Tensor::f_zeros([0], (tch::Kind::Float, self.device))
        } else {
            Tensor::f_cat(&parts, 0)
        }
        .ctx("this rank's parameter slice")?;
        // Until the gather below is through, the slice's state is a step
        // ahead of the committed one: a ring re-formed meanwhile rolls back.
        self.zero_dirty = true;
        let slot = [(String::new(), mine.shallow_clone())];
        let fused = grad.device() == Device::Cpu
            && self
                .optimizer
                .step_fused(&slot, host_f32_mut(&grad)?, lr, prep)?;
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
            self.optimizer
                .step_pairs(&[(mine.shallow_clone(), grad.shallow_clone())], lr)?;
        }
        self.zero_layout = Some(self.layout());
        // The stepped slice goes to its place in the gradient buffer
        // (restored first under stage 2 with sync = "every_step"); the
        // gather fills in every other rank's.
        self.grads.restore(&self.model.params)?;
        let flat = self.grads.view()?;
        if self.grads.via_host() {
            // CUDA: the gather runs in the pinned host mirror, and the
            // whole buffer goes back to the device once.
            self.grads
                .host_view(s.clone())?
                .f_copy_(&mine)
                .ctx("staging the stepped slice")?;
            let h = self
                .grads
                .host_mut()
                .ok_or_else(|| Error::Sharding("the host mirror is gone".into()))?;
            self.collective.all_gather(h)?;
            self.grads.from_host(0..self.flat_len())?;
        } else {
            flat.f_narrow(0, at, n)
                .and_then(|mut g| g.f_copy_(&mine))
                .ctx("staging the stepped slice")?;
            let g = self
                .grads
                .cpu_mut()
                .ok_or_else(|| Error::Sharding("gradients are not on the CPU".into()))?;
            self.collective.all_gather(g)?;
        }
        let params: Vec<Tensor> = self
            .model
            .params
            .iter()
            .map(|(_, p)| p.shallow_clone())
            .collect();
        let mut off = 0;
        for p in &params {
            let n = p.numel() as i64;
            let src = flat
                .f_narrow(0, off, n)
                .and_then(|t| t.f_view(p.size().as_slice()))
                .ctx("the gathered parameters")?;
            p.shallow_clone()
                .f_copy_(&src)
                .ctx("the gathered parameters")?;
            off += n;
        }
        self.zero_dirty = false;
        Ok(())
    }

    /// The optimizer state by PyTorch's names, whole: under sharding every
    /// rank's slice is all-gathered first (every rank must call this).
    pub(super) fn optimizer_state(&mut self) -> Result<Vec<(String, Tensor)>> {
        if !self.sharded() {
            return Ok(self.optimizer.named_state(&self.model.params));
        }
        let total = self.flat_len();
        let s = self.my_slice();
        let mut out = Vec::new();
        for (key, t) in self.optimizer.first_state() {
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
            self.collective.all_gather(buf)?;
            let mut off = 0;
            for (name, p) in &self.model.params {
                let n = p.numel() as i64;
                let part = whole
                    .f_narrow(0, off, n)
                    .and_then(|v| v.f_view(p.size().as_slice()))
                    .ctx("optimizer state")?;
                out.push((format!("{name}.{key}"), part));
                off += n;
            }
        }
        Ok(out)
    }

    /// Restores state saved by [`Engine::optimizer_state`] (under any stage
    /// and world size): under sharding each rank keeps its slice.
    pub(super) fn load_optimizer_state(
        &mut self,
        saved: Vec<(String, Tensor)>,
        steps: u64,
    ) -> Result<()> {
        if !self.sharded() {
            return self.optimizer.load_state(&self.model.params, saved, steps);
        }
        let mut saved: std::collections::HashMap<String, Tensor> = saved.into_iter().collect();
        let s = self.my_slice();
        let mut state = Vec::new();
        for key in KEYS {
            let parts: Vec<Option<Tensor>> = self
                .model
                .params
                .iter()
                .map(|(name, _)| saved.remove(&format!("{name}.{key}")))
                .collect();
            if parts.iter().all(Option::is_none) {
                continue;
            }
            let mut flat = Vec::with_capacity(self.flat_len());
            for ((name, p), t) in self.model.params.iter().zip(parts) {
                let t = t.ok_or_else(|| Error::OptimizerStateMissing {
                    key: key.to_string(),
                    param: name.clone(),
                })?;
                if t.size() != p.size() {
                    return Err(Error::OptimizerStateShape {
                        name: format!("{name}.{key}"),
                        got: t.size(),
                        want: p.size(),
                    });
                }
                flat.extend(flatten(&[t])?);
            }
            let slice = Tensor::from_slice(&flat[s.clone()])
                .f_to_device(self.device)
                .ctx("optimizer state")?;
            state.push((key, slice));
        }
        if let Some(extra) = saved.keys().next() {
            return Err(Error::OptimizerStateUnknown {
                name: extra.clone(),
            });
        }
        self.optimizer.set_first_state(state, steps);
        self.zero_layout = Some(self.layout());
        self.zero_dirty = false;
        Ok(())
    }
}

/// The elements of a contiguous float32 CPU tensor, read-only.
fn host_f32(t: &Tensor) -> Result<&[f32]> {
    host_f32_mut(t).map(|s| &*s)
}

/// The elements of a contiguous float32 CPU tensor (a gradient slice the
/// engine thread alone uses; the tensor handle outlives the slice).
#[allow(clippy::mut_from_ref)]
fn host_f32_mut(t: &Tensor) -> Result<&mut [f32]> {
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
