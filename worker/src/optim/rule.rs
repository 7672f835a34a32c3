//! The optimizer rules (SGD, Adam, AdamW), each once: step numbers and order of operations.
//!
//! The hyper-parameters, the numbers of a step (and their neutral values
//! for a skipped one) and the order of operations every back-end follows.
//! A rule is PyTorch's single-tensor (for-loop) implementation. The
//! numbers a step's operations take are computed here, in f64, from the
//! hyper-parameters, the step number `t` (1 for the first step) and the
//! learning rate; a back-end rounds each once to its element type, as
//! ATen does with a Python scalar. The back-ends:
//!
//! - tensor.rs: the operations below as tensor ops, one parameter at a
//!   time, each number a host scalar ([`crate::optim::Optimizer::step_pairs`])
//!   or a 0-dim device tensor (masked.rs: the step of a CUDA graph, whose
//!   numbers become [`Coefs::skipped`] when the step is skipped);
//! - cpu_loop.rs: the same operations per element in one pass over memory
//!   (CPU, float32), the gradient's preparation in front and its zeroing
//!   behind ([`crate::optim::Optimizer::step_fused`]);
//! - aten_fused.rs: PyTorch's fused Adam/AdamW kernel (`fused = true`),
//!   which takes the hyper-parameters, the learning rate and the step and
//!   computes its numbers itself.
//!
//! # The order of operations
//!
//! SGD, per parameter `p` with gradient `g` (the buffer is made, a copy of
//! `d_p`, on the first step instead of updated):
//!
//! ```text
//! d_p = g + weight_decay * p                 (weight_decay != 0)
//! buf = momentum * buf + (1 - dampening) * d_p   (momentum != 0)
//! d_p = d_p + momentum * buf  if nesterov, else  d_p = buf
//! p   = p + (-lr) * d_p
//! ```
//!
//! Adam (L2 decay) and AdamW (decoupled decay), with moments `m`, `v`:
//!
//! ```text
//! p = p * (1 - lr * weight_decay)            (AdamW, weight_decay != 0)
//! g = g + p * weight_decay                   (Adam, weight_decay != 0)
//! m = lerp(m, g, 1 - beta1)
//! v = v * beta2 + (g * g) * (1 - beta2)
//! denom = sqrt(v) / sqrt(1 - beta2^t) + eps
//! p = p - (m / denom) * (lr / (1 - beta1^t))
//! ```
//!
//! Each line is one or more tensor ops, each rounding once; cpu_loop.rs
//! documents where its fused multiply-adds round SGD's `a + b * c` lines
//! once where the tensor ops round twice.

use crate::spec::{OptimizerKind, OptimizerSpec};

/// SGD's state: the momentum buffer.
pub const MOMENTUM_BUFFER: &str = "momentum_buffer";
/// Adam's state: the first moment.
pub const EXP_AVG: &str = "exp_avg";
/// Adam's state: the second moment.
pub const EXP_AVG_SQ: &str = "exp_avg_sq";
/// Every state tensor any rule keeps (what a checkpoint may name).
pub const ALL_STATE: [&str; 3] = [MOMENTUM_BUFFER, EXP_AVG, EXP_AVG_SQ];

/// An optimizer rule and its hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rule {
    Sgd(Sgd),
    /// Adam and AdamW (`decoupled`).
    Adam(Adam),
}

/// SGD with momentum, dampening, Nesterov momentum and weight decay
/// (`torch.optim.SGD`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
}

/// Adam (`torch.optim.Adam`, L2 weight decay) and AdamW
/// (`torch.optim.AdamW`, `decoupled` weight decay).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adam {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub decoupled: bool,
}

/// Which weight decay an Adam step applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decay {
    None,
    /// Adam's: `g += p * weight_decay`.
    L2,
    /// AdamW's: `p *= 1 - lr * weight_decay`.
    Decoupled,
}

impl Rule {
    /// The spec's rule, with PyTorch's defaults (betas 0.9 and 0.999, eps
    /// 1e-8, weight decay 0, or 0.01 for AdamW).
    pub fn from_spec(spec: &OptimizerSpec) -> Self {
        match spec.kind {
            OptimizerKind::Adam | OptimizerKind::Adamw => {
                let adamw = spec.kind == OptimizerKind::Adamw;
                let [beta1, beta2] = spec.betas.unwrap_or([0.9, 0.999]);
                Rule::Adam(Adam {
                    beta1,
                    beta2,
                    eps: spec.eps.unwrap_or(1e-8),
                    weight_decay: spec.weight_decay.unwrap_or(if adamw { 0.01 } else { 0.0 }),
                    decoupled: adamw,
                })
            }
            OptimizerKind::Sgd => Rule::Sgd(Sgd {
                momentum: spec.momentum,
                dampening: spec.dampening,
                nesterov: spec.nesterov,
                weight_decay: spec.weight_decay.unwrap_or(0.0),
            }),
        }
    }

    /// The state tensors the rule keeps per parameter, made by its first
    /// step (none: SGD without momentum).
    pub fn state_keys(&self) -> &'static [&'static str] {
        match self {
            Rule::Sgd(s) if s.momentum == 0.0 => &[],
            Rule::Sgd(_) => &[MOMENTUM_BUFFER],
            Rule::Adam(_) => &[EXP_AVG, EXP_AVG_SQ],
        }
    }

    /// The numbers of step `t` (1 for the first) at learning rate `lr`.
    pub fn coefs(&self, t: u64, lr: f64) -> Coefs<f64> {
        match self {
            Rule::Sgd(s) => Coefs::Sgd(*s, s.coefs(lr)),
            Rule::Adam(a) => Coefs::Adam(*a, a.coefs(t, lr)),
        }
    }

    /// How many numbers a step takes ([`Coefs::to_vec`]'s length).
    pub fn coef_count(&self) -> usize {
        match self {
            Rule::Sgd(_) => SgdCoefs::<f64>::LEN,
            Rule::Adam(_) => AdamCoefs::<f64>::LEN,
        }
    }
}

impl Sgd {
    /// The numbers of a step at `lr` (SGD's do not depend on the step).
    pub fn coefs(&self, lr: f64) -> SgdCoefs<f64> {
        SgdCoefs {
            weight_decay: self.weight_decay,
            momentum: self.momentum,
            neg_lr: -lr,
        }
    }

    /// `1 - dampening`: the weight of `d_p` in the momentum update.
    pub fn one_minus_dampening(&self) -> f64 {
        1.0 - self.dampening
    }
}

impl Adam {
    /// The numbers of step `t` at `lr`: the bias corrections
    /// `1 - beta^t` of PyTorch's Adam (`t` past `i32::MAX` counts as
    /// `i32::MAX`, where both are 1 in f64).
    pub fn coefs(&self, t: u64, lr: f64) -> AdamCoefs<f64> {
        let t = i32::try_from(t).unwrap_or(i32::MAX);
        let bias_correction1 = 1.0 - self.beta1.powi(t);
        AdamCoefs {
            decay: if self.decoupled {
                1.0 - lr * self.weight_decay
            } else {
                self.weight_decay
            },
            one_minus_beta1: 1.0 - self.beta1,
            beta2: self.beta2,
            one_minus_beta2: 1.0 - self.beta2,
            bc2_sqrt: (1.0 - self.beta2.powi(t)).sqrt(),
            step_size: lr / bias_correction1,
        }
    }

    /// Which weight decay the step applies.
    pub fn decay(&self) -> Decay {
        match (self.weight_decay != 0.0, self.decoupled) {
            (false, _) => Decay::None,
            (true, false) => Decay::L2,
            (true, true) => Decay::Decoupled,
        }
    }
}

/// SGD's numbers of one step, in the order of the masked step's
/// coefficient vector ([`SgdCoefs::into_array`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdCoefs<N> {
    /// `d_p = g + weight_decay * p`. Skipped: 0.
    pub weight_decay: N,
    /// `buf = momentum * buf + ...`. Skipped: 1.
    pub momentum: N,
    /// `p = p + (-lr) * d_p`. Skipped: 0.
    pub neg_lr: N,
}

impl<N> SgdCoefs<N> {
    pub const LEN: usize = 3;

    /// The numbers in their order in a coefficient vector.
    pub fn into_array(self) -> [N; 3] {
        [self.weight_decay, self.momentum, self.neg_lr]
    }

    /// The inverse of [`SgdCoefs::into_array`].
    pub fn from_array([weight_decay, momentum, neg_lr]: [N; 3]) -> Self {
        SgdCoefs {
            weight_decay,
            momentum,
            neg_lr,
        }
    }
}

/// Adam's and AdamW's numbers of one step, in the order of the masked
/// step's coefficient vector ([`AdamCoefs::into_array`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamCoefs<N> {
    /// AdamW: `1 - lr * weight_decay`, the factor of `p`; Adam:
    /// `weight_decay`, of `p` added to `g`. Skipped: 1 (AdamW) or 0 (Adam).
    pub decay: N,
    /// `1 - beta1`: the weight of `lerp(m, g, .)`. Skipped: 0.
    pub one_minus_beta1: N,
    /// `v * beta2`. Skipped: 1.
    pub beta2: N,
    /// `(g * g) * (1 - beta2)`. Skipped: 0.
    pub one_minus_beta2: N,
    /// `sqrt(1 - beta2^t)`: `sqrt(v)` is divided by it. Skipped: itself
    /// (it divides the unchanged `v`'s root, which changes nothing).
    pub bc2_sqrt: N,
    /// `lr / (1 - beta1^t)`: `(m / denom)` is multiplied by it. Skipped: 0.
    pub step_size: N,
}

impl<N> AdamCoefs<N> {
    pub const LEN: usize = 6;

    /// The numbers in their order in a coefficient vector.
    pub fn into_array(self) -> [N; 6] {
        [
            self.decay,
            self.one_minus_beta1,
            self.beta2,
            self.one_minus_beta2,
            self.bc2_sqrt,
            self.step_size,
        ]
    }

    /// The inverse of [`AdamCoefs::into_array`].
    pub fn from_array(
        [decay, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, step_size]: [N; 6],
    ) -> Self {
        AdamCoefs {
            decay,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            bc2_sqrt,
            step_size,
        }
    }
}

/// A rule with the numbers of one step, each an `N`: an f64 (host), a
/// device tensor (masked.rs), ...
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Coefs<N> {
    Sgd(Sgd, SgdCoefs<N>),
    Adam(Adam, AdamCoefs<N>),
}

impl Coefs<f64> {
    /// The numbers of a skipped step: each operation then leaves the
    /// parameters and the state as they were (with zeroed gradients):
    /// a factor 1, an addend 0.
    pub fn skipped(&self) -> Self {
        match *self {
            Coefs::Sgd(rule, _) => Coefs::Sgd(
                rule,
                SgdCoefs {
                    weight_decay: 0.0,
                    momentum: 1.0,
                    neg_lr: 0.0,
                },
            ),
            Coefs::Adam(rule, c) => Coefs::Adam(
                rule,
                AdamCoefs {
                    decay: if rule.decoupled { 1.0 } else { 0.0 },
                    one_minus_beta1: 0.0,
                    beta2: 1.0,
                    one_minus_beta2: 0.0,
                    bc2_sqrt: c.bc2_sqrt,
                    step_size: 0.0,
                },
            ),
        }
    }

    /// The numbers in their order in a coefficient vector.
    pub fn to_vec(&self) -> Vec<f64> {
        match *self {
            Coefs::Sgd(_, c) => c.into_array().to_vec(),
            Coefs::Adam(_, c) => c.into_array().to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adamw() -> Adam {
        Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            decoupled: true,
        }
    }

    /// A coefficient vector's order round-trips through the struct.
    #[test]
    fn the_layout_round_trips() {
        let a = adamw().coefs(3, 0.01);
        assert_eq!(AdamCoefs::from_array(a.into_array()), a);
        let s = Sgd {
            momentum: 0.9,
            dampening: 0.1,
            nesterov: true,
            weight_decay: 0.01,
        }
        .coefs(0.5);
        assert_eq!(SgdCoefs::from_array(s.into_array()), s);
    }

    /// The bias corrections are PyTorch's, of the step taken.
    #[test]
    fn adam_numbers_are_pytorchs() {
        let c = adamw().coefs(3, 0.01);
        let (b1, b2) = (0.9f64, 0.999f64);
        assert_eq!(c.decay, 1.0 - 0.01 * 0.1);
        assert_eq!(c.bc2_sqrt, (1.0 - b2.powi(3)).sqrt());
        assert_eq!(c.step_size, 0.01 / (1.0 - b1.powi(3)));
        let big = adamw().coefs(u64::MAX, 0.01);
        assert_eq!((big.bc2_sqrt, big.step_size), (1.0, 0.01));
    }

    #[test]
    fn decay_kinds() {
        let mut a = adamw();
        assert_eq!(a.decay(), Decay::Decoupled);
        a.decoupled = false;
        assert_eq!(a.decay(), Decay::L2);
        a.weight_decay = 0.0;
        assert_eq!(a.decay(), Decay::None);
        assert_eq!(a.coefs(1, 0.1).decay, 0.0);
        a.decoupled = true;
        assert_eq!(a.coefs(1, 0.1).decay, 1.0);
    }
}
