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
        }
    }

    /// One update of every parameter from its (normalized, clipped) gradient.
    pub fn step(&mut self, params: &[(String, Tensor)], lr: f64) -> Result<()> {
        let _guard = tch::no_grad_guard();
        self.steps += 1;
        let step = self.steps as i32;
        for ((_, p), state) in params.iter().zip(self.state.iter_mut()) {
            let grad = p.grad();
            if !grad.defined() {
                continue;
            }
            let mut p = p.shallow_clone();
            match self.rule {
                Rule::Sgd {
                    momentum,
                    dampening,
                    nesterov,
                    weight_decay,
                } => {
                    let mut d_p = if weight_decay != 0.0 {
                        grad.f_add(&p.f_mul_scalar(weight_decay).ctx("sgd weight decay")?)
                            .ctx("sgd weight decay")?
                    } else {
                        grad.shallow_clone()
                    };
                    if momentum != 0.0 {
                        let buf = match state.get_mut("momentum_buffer") {
                            None => {
                                let b = d_p.f_detach_copy().ctx("sgd momentum")?;
                                state.insert("momentum_buffer", b.shallow_clone());
                                b
                            }
                            Some(buf) => {
                                buf.f_mul_scalar_(momentum).ctx_("sgd momentum")?;
                                let scaled = if dampening != 0.0 {
                                    d_p.f_mul_scalar(1.0 - dampening).ctx("sgd momentum")?
                                } else {
                                    d_p.shallow_clone()
                                };
                                buf.f_add_(&scaled).ctx_("sgd momentum")?;
                                buf.shallow_clone()
                            }
                        };
                        d_p = if nesterov {
                            d_p.f_add(&buf.f_mul_scalar(momentum).ctx("sgd nesterov")?)
                                .ctx("sgd nesterov")?
                        } else {
                            buf
                        };
                    }
                    p.f_sub_(&d_p.f_mul_scalar(lr).ctx("sgd update")?)
                        .ctx_("sgd update")?;
                }
                Rule::Adam {
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                    decoupled,
                } => {
                    let grad = if decoupled {
                        if weight_decay != 0.0 {
                            p.f_mul_scalar_(1.0 - lr * weight_decay)
                                .ctx_("adamw decay")?;
                        }
                        grad
                    } else if weight_decay != 0.0 {
                        grad.f_add(&p.f_mul_scalar(weight_decay).ctx("adam decay")?)
                            .ctx("adam decay")?
                    } else {
                        grad
                    };
                    if !state.contains_key("exp_avg") {
                        state.insert("exp_avg", p.f_zeros_like().ctx("adam state")?);
                        state.insert("exp_avg_sq", p.f_zeros_like().ctx("adam state")?);
                    }
                    let mut m = state["exp_avg"].shallow_clone();
                    let mut v = state["exp_avg_sq"].shallow_clone();
                    m.f_lerp_(&grad, 1.0 - beta1).ctx_("adam moments")?;
                    v.f_mul_scalar_(beta2).ctx_("adam moments")?;
                    let g2 = grad
                        .f_mul(&grad)
                        .and_then(|g2| g2.f_mul_scalar(1.0 - beta2))
                        .ctx("adam moments")?;
                    v.f_add_(&g2).ctx_("adam moments")?;
                    let bc1 = 1.0 - beta1.powi(step);
                    let bc2_sqrt = (1.0 - beta2.powi(step)).sqrt();
                    let denom = v
                        .f_sqrt()
                        .and_then(|s| s.f_div_scalar(bc2_sqrt))
                        .and_then(|s| s.f_add_scalar(eps))
                        .ctx("adam update")?;
                    let upd = m
                        .f_div(&denom)
                        .and_then(|u| u.f_mul_scalar(lr / bc1))
                        .ctx("adam update")?;
                    p.f_sub_(&upd).ctx_("adam update")?;
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
