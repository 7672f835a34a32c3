//! ZeRO stage 0: parameters, gradients and optimizer state whole on every rank.

use super::{Axis, NormPart, Parts, Placement};
use crate::comm::collective::Collective;
use crate::error::{InPlace, Result, TorchContext};
use crate::optim::{GradPrep, Optimizer};
use std::time::{Duration, Instant};
use tch::Tensor;

/// `sync = "every_step"` with a whole gradient buffer: the window's
/// all-reduced gradients so far, one tensor per parameter.
#[derive(Default)]
pub(super) struct WindowSums(Option<Vec<Tensor>>);

impl WindowSums {
    /// All-reduces this micro-step's gradients, adds them to the sums and
    /// zeroes the buffer.
    pub(super) fn add_micro_step<C: Collective>(&mut self, p: &mut Parts<'_, C>) -> Result<()> {
        let grads: Vec<Tensor> = p.params.iter().map(|(_, t)| t.grad()).collect();
        p.grads.all_reduce(p.collective, &mut [])?;
        let _guard = tch::no_grad_guard();
        match &mut self.0 {
            None => {
                self.0 = Some(
                    grads
                        .iter()
                        .map(|g| g.f_detach_copy())
                        .collect::<Result<_, _>>()
                        .ctx("accumulating")?,
                )
            }
            Some(acc) => {
                for (a, g) in acc.iter_mut().zip(&grads) {
                    a.f_add_(g).ctx_("accumulating")?;
                }
            }
        }
        p.grads.zero()
    }

    /// Puts the window's sums (if any) back into the gradients; whether
    /// there were any (then the gradients are reduced already).
    pub(super) fn restore<C: Collective>(&mut self, p: &Parts<'_, C>) -> Result<bool> {
        let Some(acc) = self.0.take() else {
            return Ok(false);
        };
        for ((_, t), a) in p.params.iter().zip(&acc) {
            t.grad().f_copy_(a).ctx("restoring accumulated gradients")?;
        }
        Ok(true)
    }

    pub(super) fn clear(&mut self) {
        self.0 = None;
    }

    pub(super) fn bytes(&self) -> usize {
        self.0.as_ref().map_or(0, |a| {
            a.iter()
                .map(|t| t.numel() * t.kind().elt_size_in_bytes())
                .sum()
        })
    }
}

/// Stage 0: the gradients are all-reduced (the tally riding in the same
/// buffer), every rank steps every parameter with whole optimizer state.
#[derive(Default)]
pub(in crate::engine) struct Replicated {
    sums: WindowSums,
}

impl<C: Collective> Placement<C> for Replicated {
    fn stage(&self) -> u32 {
        0
    }

    fn stepped_tensors(&self, params: usize) -> usize {
        params
    }

    fn reduce_micro_step(&mut self, p: &mut Parts<'_, C>) -> Result<()> {
        self.sums.add_micro_step(p)
    }

    fn reduce(&mut self, p: &mut Parts<'_, C>, tally: &mut Vec<f32>) -> Result<()> {
        if self.sums.restore(p)? {
            return super::reduce_tally(p.collective, tally);
        }
        // The loss owner's group is the data group: the tally rides in the
        // gradients' all-reduce (its EXTRA slots).
        p.grads.all_reduce(p.collective, tally)
    }

    fn norm_axes(&self) -> &'static [Axis] {
        // Replicated over the data axis: counted once.
        &[]
    }

    fn owned_grads(
        &mut self,
        p: &mut Parts<'_, C>,
    ) -> Result<(Tensor, Vec<std::ops::Range<usize>>)> {
        // One range: the whole buffer.
        let whole = 0..p.flat_len();
        Ok((p.grads.view()?, vec![whole]))
    }

    fn norm_part(&mut self, p: &mut Parts<'_, C>, norm_type: f64) -> Result<NormPart> {
        p.grads
            .norm(norm_type)?
            .f_double_value(&[])
            .map(NormPart::Norm)
            .ctx("reading the gradient norm")
    }

    fn step(&mut self, p: &mut Parts<'_, C>, prep: Option<GradPrep>, lr: f64) -> Result<Duration> {
        // On CPU (SGD, Adam, AdamW): one fused pass per parameter that also
        // applies `prep` and zeroes the gradient (crate::optim's CPU loop);
        // otherwise the same as tensor ops, pass by pass.
        let fused = match prep {
            Some(prep) => match p.grads.cpu_mut() {
                Some(g) if !p.unfused => p.optimizer.step_fused(p.params, g, lr, prep)?,
                _ => false,
            },
            None => false,
        };
        if fused {
            p.grads.zero_extra()?;
            return Ok(Duration::ZERO);
        }
        let mut prep_s = Duration::ZERO;
        if let Some(prep) = prep {
            let t = Instant::now();
            p.grads.prepare(prep)?;
            prep_s = t.elapsed();
            p.optimizer.step(p.params, lr)?;
        }
        <Self as Placement<C>>::clear_grads(self, p)?;
        Ok(prep_s)
    }

    fn clear_grads(&mut self, p: &mut Parts<'_, C>) -> Result<()> {
        self.sums.clear();
        p.grads.zero()
    }

    fn discard(&mut self) {
        self.sums.clear();
    }

    fn held_gradient_bytes(&self) -> usize {
        self.sums.bytes()
    }

    fn holds_whole_state(&self) -> bool {
        true
    }

    fn state_in_place(&self, _layout: (usize, usize)) -> bool {
        true
    }

    fn optimizer_state_bytes(&self, optimizer: &Optimizer, params: &[(String, Tensor)]) -> usize {
        optimizer
            .named_state(params)
            .iter()
            .map(|(_, t)| t.numel() * t.kind().elt_size_in_bytes())
            .sum()
    }

    fn optimizer_state(&mut self, p: &mut Parts<'_, C>) -> Result<Vec<(String, Tensor)>> {
        Ok(p.optimizer.named_state(p.params))
    }

    fn load_optimizer_state(
        &mut self,
        p: &mut Parts<'_, C>,
        saved: Vec<(String, Tensor)>,
        steps: u64,
    ) -> Result<()> {
        p.optimizer.load_state(p.params, saved, steps)
    }
}
