//! `[optimizer] fused = true`: PyTorch's fused Adam/AdamW kernel as a back-end of the rule.
//!
//! PyTorch's fused Adam and AdamW (`torch.optim.AdamW(fused=True)`) are
//! libtorch's `_fused_adam_` and `_fused_adamw_`, called through the C++
//! shim (csrc/fused_ops.cpp). On CUDA that is
//! one multi-tensor kernel launch per step that reads each gradient,
//! parameter and moment once, instead of about ten tensor ops per
//! parameter; on the CPU it is ATen's vectorized loop. The numbers are
//! PyTorch's `fused=True` (tests compare with it), which round differently
//! from its single-tensor Adam (accrue's default, [`Optimizer::step_pairs`]).
//! The kernel takes the rule's hyper-parameters (rule.rs), the learning
//! rate and the step, and computes the bias corrections itself.
//!
//! The step count every parameter reads is one float32 tensor on the
//! parameters' device (PyTorch keeps one per parameter, all equal). In a
//! CUDA graph ([`Optimizer::step_masked`]) the learning rate, the step and
//! the skip flag (`found_inf`: 1 leaves parameters and moments as they
//! were) are device tensors the host fills before each replay.

use super::rule::{EXP_AVG, EXP_AVG_SQ};
use super::{MaskedCoefs, Optimizer, Rule};
use crate::error::{Error, InPlace, Result, TorchContext};
use crate::shim::handle;
use std::ffi::{c_char, c_void};
use tch::{Kind, Tensor};

extern "C" {
    fn accrue_fused_adam(
        params: *const *mut c_void,
        grads: *const *mut c_void,
        exp_avgs: *const *mut c_void,
        exp_avg_sqs: *const *mut c_void,
        n: i32,
        step: *mut c_void,
        lr_tensor: *mut c_void,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        decoupled: i32,
        found_inf: *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
}

/// A fused step's numbers, in their order in its coefficient vector
/// (float32 on the device): the learning rate, the step (1 for the first)
/// and `found_inf` (1: skip the step).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct AtenCoefs<N> {
    lr: N,
    step: N,
    found_inf: N,
}

impl<N> AtenCoefs<N> {
    pub(super) const LEN: usize = 3;

    fn into_array(self) -> [N; 3] {
        [self.lr, self.step, self.found_inf]
    }

    fn from_array([lr, step, found_inf]: [N; 3]) -> Self {
        AtenCoefs {
            lr,
            step,
            found_inf,
        }
    }
}

/// The learning rate of one fused call.
enum Lr<'a> {
    Host(f64),
    /// A float32 tensor on the parameters' device.
    Device(&'a Tensor),
}

impl Optimizer {
    /// Whether steps go through PyTorch's fused kernel.
    pub fn is_aten_fused(&self) -> bool {
        self.fused && matches!(self.rule, Rule::Adam(_))
    }

    /// The eager fused step of every pair with a gradient, counting it:
    /// Adam's state is made (zeros) on the first step, as PyTorch's.
    pub(super) fn step_aten(&mut self, pairs: &[(Tensor, Tensor)], lr: f64) -> Result<()> {
        let _guard = tch::no_grad_guard();
        for ((p, g), state) in pairs.iter().zip(self.state.iter_mut()) {
            if g.defined() && !state.contains_key(EXP_AVG) {
                state.insert(EXP_AVG, p.f_zeros_like().ctx("adam state")?);
                state.insert(EXP_AVG_SQ, p.f_zeros_like().ctx("adam state")?);
            }
        }
        self.steps += 1;
        let step = self.step_tensor(pairs)?;
        step.shallow_clone()
            .f_fill_(self.steps as f64)
            .ctx_("the fused step's count")?;
        self.call_aten(pairs, &step, Lr::Host(lr), None)
    }

    /// The masked fused step (a CUDA graph's): `coefs` in the layout of
    /// [`AtenCoefs`], already neutral when the step is skipped. Counts
    /// nothing.
    pub(super) fn step_aten_masked(
        &mut self,
        pairs: &[(Tensor, Tensor)],
        coefs: &Tensor,
    ) -> Result<()> {
        let _guard = tch::no_grad_guard();
        let c = |i: i64| coefs.f_select(0, i).ctx("an optimizer coefficient");
        let c = AtenCoefs::from_array([c(0)?, c(1)?, c(2)?]);
        self.call_aten(pairs, &c.step, Lr::Device(&c.lr), Some(&c.found_inf))
    }

    /// The fused step's numbers of step `self.steps + 1` at `lr` in the
    /// layout of [`AtenCoefs`], and their neutral values.
    pub(super) fn aten_coefs(&self, lr: f64) -> MaskedCoefs {
        let step = (self.steps + 1) as f64;
        let values = AtenCoefs {
            lr,
            step,
            found_inf: 0.0,
        };
        let neutral = AtenCoefs {
            lr: 0.0,
            found_inf: 1.0,
            ..values
        };
        MaskedCoefs {
            values: values.into_array().to_vec(),
            neutral: neutral.into_array().to_vec(),
        }
    }

    /// The float32 step count on the parameters' device, made once.
    fn step_tensor(&mut self, pairs: &[(Tensor, Tensor)]) -> Result<Tensor> {
        if let Some(t) = &self.aten_step {
            return Ok(t.shallow_clone());
        }
        let device = pairs
            .first()
            .map(|(p, _)| p.device())
            .unwrap_or(tch::Device::Cpu);
        let t = Tensor::f_zeros([], (Kind::Float, device)).ctx("the fused step's count")?;
        self.aten_step = Some(t.shallow_clone());
        Ok(t)
    }

    fn call_aten(
        &self,
        pairs: &[(Tensor, Tensor)],
        step: &Tensor,
        lr: Lr<'_>,
        found_inf: Option<&Tensor>,
    ) -> Result<()> {
        let Rule::Adam(rule) = self.rule else {
            return Err(Error::Torch {
                context: "the fused optimizer step",
                message: "fused = true applies to adam and adamw only".into(),
            });
        };
        // The pairs with a gradient, and their moments (made by the first
        // step, or loaded from a checkpoint).
        let mut lists: [Vec<*mut c_void>; 4] = Default::default();
        for (i, ((p, g), state)) in pairs.iter().zip(&self.state).enumerate() {
            if !g.defined() {
                continue;
            }
            let (Some(m), Some(v)) = (state.get(EXP_AVG), state.get(EXP_AVG_SQ)) else {
                return Err(Error::Torch {
                    context: "the fused optimizer step",
                    message: format!("parameter {i} has no exp_avg and exp_avg_sq (Adam's state)"),
                });
            };
            for (list, t) in lists.iter_mut().zip([p, g, m, v]) {
                list.push(handle(t));
            }
        }
        if lists[0].is_empty() {
            return Ok(());
        }
        let (lr_tensor, lr) = match lr {
            Lr::Host(v) => (std::ptr::null_mut(), v),
            Lr::Device(t) => (handle(t), 0.0),
        };
        let found_inf = found_inf.map_or(std::ptr::null_mut(), handle);
        // SAFETY: every pointer is a live tch tensor handle (`at::Tensor*`)
        // borrowed from `pairs`, `self.state`, `step`, `lr` or `found_inf`
        // for the length of the call; the four lists have the same length
        // n; the shim catches every C++ exception and writes at most `len`
        // bytes, NUL-terminated, into `err`.
        crate::shim::call(|err, len| unsafe {
            accrue_fused_adam(
                lists[0].as_ptr(),
                lists[1].as_ptr(),
                lists[2].as_ptr(),
                lists[3].as_ptr(),
                lists[0].len() as i32,
                handle(step),
                lr_tensor,
                lr,
                rule.beta1,
                rule.beta2,
                rule.weight_decay,
                rule.eps,
                i32::from(rule.decoupled),
                found_inf,
                err,
                len,
            )
        })
        .map_err(|e| Error::Torch {
            context: "the fused optimizer step",
            message: e.to_string(),
        })
    }
}
