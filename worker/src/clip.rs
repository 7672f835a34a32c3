//! Gradient norm and clipping, written as torch.nn.utils.clip_grad_norm_ and
//! clip_grad_value_ compute them.

use crate::error::{InPlace, Result, TorchContext};
use tch::{Kind, Tensor};

/// Total norm of all gradients: the `norm_type` norm of the per-tensor norms
/// (2.0 or inf), as a 0-dim f32 tensor on the gradients' device.
pub fn total_norm(grads: &[Tensor], norm_type: f64) -> Result<Tensor> {
    let per: Vec<Tensor> = grads
        .iter()
        .map(|g| vector_norm(g, norm_type))
        .collect::<Result<_, _>>()
        .ctx("computing gradient norms")?;
    if per.is_empty() {
        return Tensor::f_zeros([], (Kind::Float, tch::Device::Cpu))
            .ctx("computing gradient norms");
    }
    Tensor::f_stack(&per, 0)
        .and_then(|s| vector_norm(&s, norm_type))
        .ctx("computing gradient norms")
}

/// `torch.linalg.vector_norm(t, ord)`: the norm of the flattened tensor
/// (linalg_norm on a 1-D input is the vector norm).
fn vector_norm(t: &Tensor, ord: f64) -> Result<Tensor, tch::TchError> {
    t.f_flatten(0, -1)?
        .f_linalg_norm(ord, None::<&[i64]>, false, None::<Kind>)
}

/// Scales every gradient by `min(1, max_norm / (total + 1e-6))` and returns
/// that coefficient.
pub fn clip_by_norm(grads: &[Tensor], total: &Tensor, max_norm: f64) -> Result<f64> {
    let coef = total
        .f_add_scalar(1e-6)
        .and_then(|d| d.f_reciprocal())
        .and_then(|r| r.f_mul_scalar(max_norm))
        .and_then(|c| c.f_clamp_max(1.0))
        .ctx("computing the clip coefficient")?;
    for g in grads {
        g.shallow_clone().f_mul_(&coef).ctx_("clipping gradients")?;
    }
    coef.f_double_value(&[]).ctx("reading the clip coefficient")
}

/// Clamps every gradient element to [-value, value].
pub fn clip_by_value(grads: &[Tensor], value: f64) -> Result<()> {
    for g in grads {
        g.shallow_clone()
            .f_clamp_(-value, value)
            .ctx_("clipping gradients by value")?;
    }
    Ok(())
}
