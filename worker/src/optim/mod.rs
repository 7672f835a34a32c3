//! The optimizer: a rule (rule.rs) stepped by a back-end, its state saved by parameter name.
//!
//! The rule (rule.rs) owns the hyper-parameters, the numbers of each step
//! and the order of operations; the back-ends take them: the tensor ops,
//! PyTorch's single-tensor (for-loop) implementations op for op, so the
//! numbers match (tensor.rs); the same with the numbers on the device, for
//! CUDA graphs (masked.rs); the CPU single-pass loop (cpu_loop.rs, driven
//! by cpu_step.rs); and PyTorch's fused Adam/AdamW kernel (aten_fused.rs).

mod aten_fused;
pub mod cpu_loop;
mod cpu_step;
mod masked;
pub mod rule;
pub mod schedule;
mod tensor;

pub use cpu_loop::GradPrep;
pub use masked::MaskedCoefs;
pub use rule::Rule;

use crate::error::{Error, Result, TorchContext};
use crate::spec::OptimizerSpec;
use std::collections::HashMap;
use tch::Tensor;

#[derive(Debug)]
pub struct Optimizer {
    pub rule: Rule,
    /// Optimizer steps taken (Adam's bias correction uses it).
    pub steps: u64,
    /// Per parameter: named state tensors (the rule's
    /// [`Rule::state_keys`]: momentum_buffer, exp_avg, exp_avg_sq).
    state: Vec<HashMap<&'static str, Tensor>>,
    /// Per parameter: scratch tensors of its shape (two for Adam), made on
    /// the first step and reused; not part of the state.
    scratch: Vec<Option<(Tensor, Option<Tensor>)>>,
    /// `[optimizer] fused = true` (Adam and AdamW: PyTorch's fused kernel,
    /// optim/aten_fused.rs).
    fused: bool,
    /// The fused kernel's float32 step count on the parameters' device,
    /// made by its first eager step.
    aten_step: Option<Tensor>,
}

impl Optimizer {
    pub fn new(spec: &OptimizerSpec, num_params: usize) -> Self {
        Self {
            rule: Rule::from_spec(spec),
            steps: 0,
            state: (0..num_params).map(|_| HashMap::new()).collect(),
            scratch: Vec::new(),
            fused: spec.fused,
            aten_step: None,
        }
    }

    /// One update of every parameter from its (normalized, clipped)
    /// gradient. The arithmetic is PyTorch's single-tensor SGD/Adam, op for
    /// op (tensor.rs); intermediate results go to per-parameter scratch
    /// tensors made on the first step (and into the gradient itself, which
    /// the engine zeroes right after), so a step allocates nothing.
    pub fn step(&mut self, params: &[(String, Tensor)], lr: f64) -> Result<()> {
        self.step_pairs(&with_grads(params), lr)
    }

    /// [`Optimizer::step`] of (parameter, gradient) pairs: the parameter
    /// tensors may be views (a ZeRO slice of the flat parameters), updated
    /// in place; state i belongs to pair i.
    pub fn step_pairs(&mut self, pairs: &[(Tensor, Tensor)], lr: f64) -> Result<()> {
        if self.is_aten_fused() {
            return self.step_aten(pairs, lr);
        }
        self.step_tensor_ops(pairs, lr)
    }

    /// The first parameter's state by kind, sorted (under ZeRO the one
    /// "parameter" is the rank's flat slice).
    pub fn first_state(&self) -> Vec<(&'static str, Tensor)> {
        self.state.first().map(sorted).unwrap_or_default()
    }

    /// Replaces the first parameter's state (see [`Optimizer::first_state`])
    /// and the step count.
    pub fn set_first_state(&mut self, state: Vec<(&'static str, Tensor)>, steps: u64) {
        if let Some(first) = self.state.first_mut() {
            *first = state.into_iter().collect();
        }
        // The slice may have another length now: fresh scratch tensors.
        self.scratch.clear();
        self.steps = steps;
    }

    /// State tensors named `<param>.<state>` (for optimizer.safetensors).
    pub fn named_state(&self, params: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for ((name, _), state) in params.iter().zip(&self.state) {
            for (k, t) in sorted(state) {
                out.push((format!("{name}.{k}"), t));
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
        let mut saved: HashMap<String, Tensor> = saved.into_iter().collect();
        for ((name, p), state) in params.iter().zip(self.state.iter_mut()) {
            state.clear();
            for k in rule::ALL_STATE {
                if let Some(t) = saved.remove(&format!("{name}.{k}")) {
                    if t.size() != p.size() {
                        return Err(Error::OptimizerStateShape {
                            name: format!("{name}.{k}"),
                            got: t.size(),
                            want: p.size(),
                        });
                    }
                    state.insert(k, t.f_to_device(p.device()).ctx("loading optimizer state")?);
                }
            }
        }
        if let Some(extra) = saved.keys().next() {
            return Err(Error::OptimizerStateUnknown {
                name: extra.clone(),
            });
        }
        self.steps = steps;
        Ok(())
    }
}

/// One parameter's state tensors (shallow), by name.
fn sorted(state: &HashMap<&'static str, Tensor>) -> Vec<(&'static str, Tensor)> {
    let mut out: Vec<_> = state.iter().map(|(k, t)| (*k, t.shallow_clone())).collect();
    out.sort_unstable_by_key(|(k, _)| *k);
    out
}

/// Each parameter with its gradient (shallow), as the steps take them.
pub fn with_grads(params: &[(String, Tensor)]) -> Vec<(Tensor, Tensor)> {
    params
        .iter()
        .map(|(_, p)| (p.shallow_clone(), p.grad()))
        .collect()
}

#[cfg(test)]
mod tests;
