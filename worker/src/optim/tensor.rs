//! The tensor-op back-end: the rule's operations as ATen ops, numbers on the host or device.
//!
//! Op for op this is PyTorch's single-tensor (for-loop) SGD and Adam in
//! the order rule.rs gives. Each per-step number is a [`Num`]: an f64 host
//! scalar (the eager step, [`Optimizer::step_pairs`]) or a 0-dim float32
//! tensor on the parameters' device (the masked step of a CUDA graph,
//! masked.rs). ATen computes both the same way (a host scalar is rounded
//! to the tensor's type first), except one division: on CUDA a tensor
//! divided by a host scalar is multiplied by the scalar's float32
//! reciprocal, which the device number reproduces ([`Num::div_`]).
//! Intermediate results go to per-parameter scratch tensors made on the
//! first step (and into the gradient itself, which the engine zeroes right
//! after), so a step allocates nothing after the first.

use super::rule::{self, AdamCoefs, Coefs, Decay, SgdCoefs, EXP_AVG, EXP_AVG_SQ, MOMENTUM_BUFFER};
use super::{Optimizer, Rule};
use crate::error::{Error, InPlace, Result, TorchContext};
use std::collections::HashMap;
use tch::{TchError, Tensor};

/// One per-step number of the rule as its tensor ops take it.
pub(super) trait Num {
    /// As the 0-dim multiplier of an `addcmul_`: a host number becomes a
    /// tensor of `like`'s kind and device, a device number is itself.
    fn tensor(&self, like: &Tensor) -> Result<Tensor>;
    /// `t *= self`.
    fn mul_(&self, t: &mut Tensor) -> Result<Tensor, TchError>;
    /// `out = t * self`.
    fn mul_out(&self, out: &Tensor, t: &Tensor) -> Result<Tensor, TchError>;
    /// `t = lerp(t, end, self)`.
    fn lerp_(&self, t: &mut Tensor, end: &Tensor) -> Result<Tensor, TchError>;
    /// `t /= self`.
    fn div_(&self, t: &mut Tensor) -> Result<Tensor, TchError>;
}

impl Num for f64 {
    fn tensor(&self, like: &Tensor) -> Result<Tensor> {
        Tensor::f_scalar_tensor(*self, (like.kind(), like.device())).ctx("optimizer scalar")
    }

    fn mul_(&self, t: &mut Tensor) -> Result<Tensor, TchError> {
        t.f_mul_scalar_(*self)
    }

    fn mul_out(&self, out: &Tensor, t: &Tensor) -> Result<Tensor, TchError> {
        t.f_mul_scalar_out(out, *self)
    }

    fn lerp_(&self, t: &mut Tensor, end: &Tensor) -> Result<Tensor, TchError> {
        t.f_lerp_(end, *self)
    }

    fn div_(&self, t: &mut Tensor) -> Result<Tensor, TchError> {
        t.f_div_scalar_(*self)
    }
}

impl Optimizer {
    /// One update of every parameter from its (normalized, clipped)
    /// gradient: the rule's tensor ops with host numbers, counting the
    /// step.
    pub(super) fn step_tensor_ops(&mut self, pairs: &[(Tensor, Tensor)], lr: f64) -> Result<()> {
        let _guard = tch::no_grad_guard();
        self.steps += 1;
        let coefs = self.rule.coefs(self.steps, lr);
        self.tensor_ops(pairs, &coefs)
    }

    /// The rule's tensor ops over every pair with a gradient, with the
    /// numbers `coefs`: state is made where the rule's first step makes it
    /// (the masked step checks beforehand that none is missing).
    pub(super) fn tensor_ops<N: Num>(
        &mut self,
        pairs: &[(Tensor, Tensor)],
        coefs: &Coefs<N>,
    ) -> Result<()> {
        self.make_scratch(pairs)?;
        for (i, (((p, grad), state), scratch)) in pairs
            .iter()
            .zip(self.state.iter_mut())
            .zip(self.scratch.iter())
            .enumerate()
        {
            // No scratch: a pair without a gradient.
            let Some((tmp, tmp2)) = scratch else {
                continue;
            };
            let (mut p, mut grad) = (p.shallow_clone(), grad.shallow_clone());
            match coefs {
                Coefs::Sgd(rule, c) => sgd(rule, c, &mut p, &mut grad, state, tmp)?,
                Coefs::Adam(rule, c) => {
                    let (m, v) = adam_state(state, &p, i)?;
                    let denom = tmp2.as_ref().unwrap_or(tmp);
                    adam(rule, c, &mut p, &mut grad, (m, v), tmp, denom)?;
                }
            }
        }
        Ok(())
    }

    /// Makes the scratch tensors of every pair with a gradient (the first
    /// step; they are reused after): one of the parameter's shape, two
    /// for Adam.
    pub(super) fn make_scratch(&mut self, pairs: &[(Tensor, Tensor)]) -> Result<()> {
        if self.scratch.len() != pairs.len() {
            self.scratch = (0..pairs.len()).map(|_| None).collect();
        }
        let adam = matches!(self.rule, Rule::Adam(_));
        for ((p, grad), scratch) in pairs.iter().zip(self.scratch.iter_mut()) {
            if grad.defined() && scratch.is_none() {
                let one = p.f_empty_like().ctx("optimizer scratch")?;
                let two = if adam {
                    Some(p.f_empty_like().ctx("optimizer scratch")?)
                } else {
                    None
                };
                *scratch = Some((one, two));
            }
        }
        Ok(())
    }
}

/// SGD on one parameter `p` with gradient `grad` (which becomes `d_p`);
/// `tmp` is scratch of `p`'s shape.
fn sgd<N: Num>(
    rule: &rule::Sgd,
    c: &SgdCoefs<N>,
    p: &mut Tensor,
    grad: &mut Tensor,
    state: &mut HashMap<&'static str, Tensor>,
    tmp: &Tensor,
) -> Result<()> {
    // d_p = grad + weight_decay * p, in the gradient, in one pass (torch:
    // grad.add(p, alpha=weight_decay)).
    if rule.weight_decay != 0.0 {
        grad.f_addcmul_(p, &c.weight_decay.tensor(p)?)
            .ctx_("sgd weight decay")?;
    }
    let mut d_p = grad.shallow_clone();
    if rule.momentum != 0.0 {
        let buf = match state.get_mut(MOMENTUM_BUFFER) {
            // The first step: buf = clone(d_p).
            None => {
                let b = d_p.f_detach_copy().ctx("sgd momentum")?;
                state.insert(MOMENTUM_BUFFER, b.shallow_clone());
                b
            }
            Some(buf) => {
                c.momentum.mul_(buf).ctx_("sgd momentum")?;
                if rule.dampening != 0.0 {
                    d_p.f_mul_scalar_out(tmp, rule.one_minus_dampening())
                        .ctx_("sgd momentum")?;
                    buf.f_add_(tmp).ctx_("sgd momentum")?;
                } else {
                    buf.f_add_(&d_p).ctx_("sgd momentum")?;
                }
                buf.shallow_clone()
            }
        };
        d_p = if rule.nesterov {
            buf.f_mul_scalar_out(tmp, rule.momentum)
                .ctx_("sgd nesterov")?;
            grad.f_add_(tmp).ctx_("sgd nesterov")?;
            grad.shallow_clone()
        } else {
            buf
        };
    }
    // p += (-lr) * d_p in one pass (torch: p.add_(d_p, alpha=-lr)).
    p.f_addcmul_(&d_p, &c.neg_lr.tensor(p)?).ctx_("sgd update")
}

/// Parameter `i`'s Adam moments, made (zeros, as PyTorch's) by its first
/// step.
fn adam_state(
    state: &mut HashMap<&'static str, Tensor>,
    p: &Tensor,
    i: usize,
) -> Result<(Tensor, Tensor)> {
    if !state.contains_key(EXP_AVG) {
        state.insert(EXP_AVG, p.f_zeros_like().ctx("adam state")?);
        state.insert(EXP_AVG_SQ, p.f_zeros_like().ctx("adam state")?);
    }
    match (state.get(EXP_AVG), state.get(EXP_AVG_SQ)) {
        (Some(m), Some(v)) => Ok((m.shallow_clone(), v.shallow_clone())),
        // A checkpoint that had one moment of the two.
        _ => Err(Error::OptimizerStateMissing {
            key: EXP_AVG_SQ.into(),
            param: format!("parameter {i}, which has {EXP_AVG}"),
        }),
    }
}

/// Adam or AdamW on one parameter `p` with gradient `grad` and moments
/// `(m, v)`; `tmp` and `denom` are scratch of `p`'s shape (they may be the
/// same tensor).
fn adam<N: Num>(
    rule: &rule::Adam,
    c: &AdamCoefs<N>,
    p: &mut Tensor,
    grad: &mut Tensor,
    (mut m, mut v): (Tensor, Tensor),
    tmp: &Tensor,
    denom: &Tensor,
) -> Result<()> {
    match rule.decay() {
        Decay::Decoupled => c.decay.mul_(p).ctx_("adamw decay")?,
        Decay::L2 => {
            c.decay.mul_out(tmp, p).ctx_("adam decay")?;
            grad.f_add_(tmp).ctx_("adam decay")?;
        }
        Decay::None => {}
    }
    c.one_minus_beta1.lerp_(&mut m, grad).ctx_("adam moments")?;
    c.beta2.mul_(&mut v).ctx_("adam moments")?;
    // v += (grad * grad) * (1 - beta2)
    grad.f_mul_out(tmp, grad).ctx_("adam moments")?;
    c.one_minus_beta2
        .mul_(&mut tmp.shallow_clone())
        .ctx_("adam moments")?;
    v.f_add_(tmp).ctx_("adam moments")?;
    // denom = sqrt(v) / bc2_sqrt + eps
    v.f_sqrt_out(denom).ctx_("adam update")?;
    let mut d = denom.shallow_clone();
    c.bc2_sqrt.div_(&mut d).ctx_("adam update")?;
    d.f_add_scalar_(rule.eps).ctx_("adam update")?;
    // p -= (m / denom) * (lr / bc1)
    m.f_div_out(tmp, denom).ctx_("adam update")?;
    c.step_size
        .mul_(&mut tmp.shallow_clone())
        .ctx_("adam update")?;
    p.f_sub_(tmp).ctx_("adam update")
}
