//! SGD (momentum, dampening, nesterov, weight decay), Adam and AdamW, written
//! as PyTorch's single-tensor (for-loop) implementations so the numbers match,
//! with state that checkpoints can save by parameter name.

use crate::error::{Error, InPlace, Result, TorchContext};
use crate::spec::OptimizerSpec;
use std::collections::HashMap;
use tch::Tensor;

#[derive(Clone, Debug, PartialEq)]
pub enum Rule {
    Sgd {
        momentum: f64,
        dampening: f64,
        nesterov: bool,
        weight_decay: f64,
    },
    Adam {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        decoupled: bool,
    },
}

#[derive(Debug)]
pub struct Optimizer {
    pub rule: Rule,
    /// Optimizer steps taken (Adam's bias correction uses it).
    pub steps: u64,
    /// Per parameter: named state tensors (momentum_buffer, exp_avg, exp_avg_sq).
    state: Vec<HashMap<&'static str, Tensor>>,
    /// Per parameter: scratch tensors of its shape (two for Adam), made on
    /// the first step and reused; not part of the state.
    scratch: Vec<Option<(Tensor, Option<Tensor>)>>,
}

impl Optimizer {
    pub fn new(spec: &OptimizerSpec, num_params: usize) -> Self {
        let [beta1, beta2] = spec.betas.unwrap_or([0.9, 0.999]);
        let rule = match spec.kind.as_str() {
            "adam" | "adamw" => Rule::Adam {
                beta1,
                beta2,
                eps: spec.eps.unwrap_or(1e-8),
                decoupled: spec.kind == "adamw",
                weight_decay: spec.weight_decay.unwrap_or(if spec.kind == "adamw" {
                    0.01
                } else {
                    0.0
                }),
            },
            _ => Rule::Sgd {
                momentum: spec.momentum,
                dampening: spec.dampening,
                nesterov: spec.nesterov,
                weight_decay: spec.weight_decay.unwrap_or(0.0),
            },
        };
        Self {
            rule,
            steps: 0,
            state: (0..num_params).map(|_| HashMap::new()).collect(),
            scratch: Vec::new(),
        }
    }

    /// One update of every parameter from its (normalized, clipped)
    /// gradient. The arithmetic is PyTorch's single-tensor SGD/Adam, op for
    /// op; intermediate results go to per-parameter scratch tensors made on
    /// the first step (and into the gradient itself, which the engine zeroes
    /// right after), so a step allocates nothing.
    pub fn step(&mut self, params: &[(String, Tensor)], lr: f64) -> Result<()> {
        let _guard = tch::no_grad_guard();
        self.steps += 1;
        let step = self.steps as i32;
        if self.scratch.len() != params.len() {
            self.scratch = (0..params.len()).map(|_| None).collect();
        }
        let adam = matches!(self.rule, Rule::Adam { .. });
        for (((_, p), state), scratch) in params
            .iter()
            .zip(self.state.iter_mut())
            .zip(self.scratch.iter_mut())
        {
            let mut grad = p.grad();
            if !grad.defined() {
                continue;
            }
            if scratch.is_none() {
                let one = p.f_empty_like().ctx("optimizer scratch")?;
                let two = if adam {
                    Some(p.f_empty_like().ctx("optimizer scratch")?)
                } else {
                    None
                };
                *scratch = Some((one, two));
            }
            let Some((tmp, tmp2)) = scratch.as_ref() else {
                continue; // unreachable: filled just above
            };
            let mut p = p.shallow_clone();
            match self.rule {
                Rule::Sgd {
                    momentum,
                    dampening,
                    nesterov,
                    weight_decay,
                } => {
                    // d_p = grad + weight_decay * p, in the gradient, in one
                    // pass (torch: grad.add(p, alpha=weight_decay)).
                    if weight_decay != 0.0 {
                        let wd = scalar(weight_decay, &p)?;
                        grad.f_addcmul_(&p, &wd).ctx_("sgd weight decay")?;
                    }
                    let mut d_p = grad.shallow_clone();
                    if momentum != 0.0 {
                        let buf = match state.get_mut("momentum_buffer") {
                            None => {
                                let b = d_p.f_detach_copy().ctx("sgd momentum")?;
                                state.insert("momentum_buffer", b.shallow_clone());
                                b
                            }
                            Some(buf) => {
                                buf.f_mul_scalar_(momentum).ctx_("sgd momentum")?;
                                if dampening != 0.0 {
                                    d_p.f_mul_scalar_out(tmp, 1.0 - dampening)
                                        .ctx_("sgd momentum")?;
                                    buf.f_add_(tmp).ctx_("sgd momentum")?;
                                } else {
                                    buf.f_add_(&d_p).ctx_("sgd momentum")?;
                                }
                                buf.shallow_clone()
                            }
                        };
                        d_p = if nesterov {
                            buf.f_mul_scalar_out(tmp, momentum).ctx_("sgd nesterov")?;
                            grad.f_add_(tmp).ctx_("sgd nesterov")?;
                            grad.shallow_clone()
                        } else {
                            buf
                        };
                    }
                    // p += (-lr) * d_p in one pass (torch: p.add_(d_p, alpha=-lr)).
                    let neg_lr = scalar(-lr, &p)?;
                    p.f_addcmul_(&d_p, &neg_lr).ctx_("sgd update")?;
                }
                Rule::Adam {
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                    decoupled,
                } => {
                    if decoupled {
                        if weight_decay != 0.0 {
                            p.f_mul_scalar_(1.0 - lr * weight_decay)
                                .ctx_("adamw decay")?;
                        }
                    } else if weight_decay != 0.0 {
                        p.f_mul_scalar_out(tmp, weight_decay).ctx_("adam decay")?;
                        grad.f_add_(tmp).ctx_("adam decay")?;
                    }
                    if !state.contains_key("exp_avg") {
                        state.insert("exp_avg", p.f_zeros_like().ctx("adam state")?);
                        state.insert("exp_avg_sq", p.f_zeros_like().ctx("adam state")?);
                    }
                    let mut m = state["exp_avg"].shallow_clone();
                    let mut v = state["exp_avg_sq"].shallow_clone();
                    m.f_lerp_(&grad, 1.0 - beta1).ctx_("adam moments")?;
                    v.f_mul_scalar_(beta2).ctx_("adam moments")?;
                    // v += (grad * grad) * (1 - beta2)
                    grad.f_mul_out(tmp, &grad).ctx_("adam moments")?;
                    tmp.shallow_clone()
                        .f_mul_scalar_(1.0 - beta2)
                        .ctx_("adam moments")?;
                    v.f_add_(tmp).ctx_("adam moments")?;
                    let bc1 = 1.0 - beta1.powi(step);
                    let bc2_sqrt = (1.0 - beta2.powi(step)).sqrt();
                    // denom = sqrt(v) / bc2_sqrt + eps
                    let denom = tmp2.as_ref().unwrap_or(tmp);
                    v.f_sqrt_out(denom).ctx_("adam update")?;
                    let mut d = denom.shallow_clone();
                    d.f_div_scalar_(bc2_sqrt).ctx_("adam update")?;
                    d.f_add_scalar_(eps).ctx_("adam update")?;
                    // p -= (m / denom) * (lr / bc1)
                    m.f_div_out(tmp, denom).ctx_("adam update")?;
                    tmp.shallow_clone()
                        .f_mul_scalar_(lr / bc1)
                        .ctx_("adam update")?;
                    p.f_sub_(tmp).ctx_("adam update")?;
                }
            }
        }
        Ok(())
    }

    /// State tensors named `<param>.<state>` (for optimizer.safetensors).
    pub fn named_state(&self, params: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for ((name, _), state) in params.iter().zip(&self.state) {
            let mut keys: Vec<_> = state.keys().copied().collect();
            keys.sort_unstable();
            for k in keys {
                out.push((format!("{name}.{k}"), state[k].shallow_clone()));
            }
        }
        out
    }

    /// Restores state saved by [`Optimizer::named_state`].
    pub fn load_state(
        &mut self,
        params: &[(String, Tensor)],
        saved: Vec<(String, Tensor)>,
        steps: u64,
    ) -> Result<()> {
        const KEYS: [&str; 3] = ["momentum_buffer", "exp_avg", "exp_avg_sq"];
        let mut saved: HashMap<String, Tensor> = saved.into_iter().collect();
        for ((name, p), state) in params.iter().zip(self.state.iter_mut()) {
            state.clear();
            for k in KEYS {
                if let Some(t) = saved.remove(&format!("{name}.{k}")) {
                    if t.size() != p.size() {
                        return Err(Error::Model(format!(
                            "optimizer state {name}.{k} has shape {:?}, parameter has {:?}",
                            t.size(),
                            p.size()
                        )));
                    }
                    state.insert(k, t.f_to_device(p.device()).ctx("loading optimizer state")?);
                }
            }
        }
        if let Some(extra) = saved.keys().next() {
            return Err(Error::Model(format!(
                "optimizer state names unknown tensor {extra}"
            )));
        }
        self.steps = steps;
        Ok(())
    }
}

/// A 0-dim tensor holding `v` with `like`'s kind and device (the multiplier
/// of a one-pass addcmul_).
fn scalar(v: f64, like: &Tensor) -> Result<Tensor> {
    Tensor::f_scalar_tensor(v, (like.kind(), like.device())).ctx("optimizer scalar")
}
