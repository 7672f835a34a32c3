//! Rotary position embedding: the frequencies (transformers' default and
//! scaled forms), the two forms of the rotation, and the tables of a
//! forward's positions.

use super::Net;
use tch::{Device, Kind, TchError, Tensor};

impl Net {
    /// RoPE for positions `start..start + t` of hidden states `h` (the
    /// complex form in fp32 without autocast, Hugging Face's otherwise).
    pub(super) fn rope(&self, start: i64, t: i64, h: &Tensor) -> Result<Rope, TchError> {
        let device = self.inv_freq.device();
        let positions = Tensor::f_arange_start(start, start + t, (Kind::Int64, device))?;
        self.rope_at(&positions, h)
    }

    /// RoPE for `positions` (`[T]`, every row's, or `[N, T]`, each row's
    /// own: packed rows) of hidden states `h`.
    pub(super) fn rope_at(&self, positions: &Tensor, h: &Tensor) -> Result<Rope, TchError> {
        let device = self.inv_freq.device();
        let rows = positions.dim() == 2;
        let freqs = positions
            .f_to_kind(Kind::Float)?
            .f_unsqueeze(-1)?
            .f_mul(&self.inv_freq.f_unsqueeze(0)?)?;
        // Under autocast the real form keeps every rounding transformers'
        // (the complex form's fp32 products round differently in its
        // backward, and the bf16 casts of the gradients turn a last-bit
        // difference into a bf16 one). On CUDA the training forward under
        // autocast takes the fused operations instead (rope_qkv).
        // Qwen3's head norms read each head in transformers' order: the
        // real form, whose rows are not permuted.
        let complex = h.kind() == Kind::Float
            && self.head_dim % 2 == 0
            && !self.qk_norm
            && !crate::cuda::amp::Autocast::is_enabled(device);
        if complex {
            // [T, 1, d/2] (broadcast over rows before) or [N, T, 1, d/2],
            // broadcast over heads.
            let rotation = Tensor::f_complex(&freqs.f_cos()?, &freqs.f_sin()?)?.f_unsqueeze(-2)?;
            return Ok(Rope::Complex { rotation });
        }
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?;
        // [1, 1, T, D] (broadcast over rows) or [N, 1, T, D], broadcast
        // over heads.
        let kind = h.kind();
        let wide = |t: Tensor| -> Result<Tensor, TchError> {
            if rows {
                t.f_unsqueeze(1)
            } else {
                t.f_unsqueeze(0)?.f_unsqueeze(0)
            }
        };
        Ok(Rope::Real {
            cos: wide(emb.f_cos()?.f_to_kind(kind)?)?,
            sin: wide(emb.f_sin()?.f_to_kind(kind)?)?,
        })
    }
}

/// Rotary position embedding, in one of two forms that compute the same
/// function.
///
/// - `Real`: Hugging Face's, `q * cos + rotate_half(q) * sin` with
///   `rotate_half(x) = cat(-x[d/2:], x[:d/2])` and cos, sin `[1, 1, T, d]`
///   in the hidden states' type: used under autocast (bf16 and fp16 have
///   no complex type), where it keeps accrue's roundings those of
///   transformers.
/// - `Complex`: in fp32, each pair (x[i], x[i + d/2]) of a head is the
///   complex number x[i] + x[i + d/2]·j, and RoPE is its product with
///   cos θ + j sin θ: real part x[i] cos − x[i + d/2] sin, imaginary part
///   x[i] sin + x[i + d/2] cos, which are Hugging Face's two halves. q_proj's
///   and k_proj's rows are taken in pair order ([`paired_rows`]) so the
///   pairs are adjacent; queries and keys are then permuted alike within a
///   head, which leaves every attention score unchanged (a dot product over
///   the same pairs), and values are not permuted. One complex multiply
///   and no copies instead of five kernels forward and eight backward: a
///   quarter less time per micro-step for the rotation (Meta's Llama
///   reference and torchtitan compute RoPE this way).
pub(super) enum Rope {
    Real { cos: Tensor, sin: Tensor },
    Complex { rotation: Tensor },
}

/// For `heads` heads of `d` rows each, the rows in pair order: per head
/// 0, d/2, 1, d/2 + 1, ..., d/2 - 1, d - 1.
pub(super) fn paired_rows(heads: i64, d: i64, device: Device) -> Result<Tensor, TchError> {
    let half = d / 2;
    let rows: Vec<i64> = (0..heads)
        .flat_map(|h| (0..half).flat_map(move |i| [h * d + i, h * d + half + i]))
        .collect();
    Tensor::f_from_slice(&rows)?.f_to_device(device)
}

/// `q * cos + rotate_half(q) * sin`, rotate_half(x) = cat(-x[d/2:], x[:d/2]).
pub(super) fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor, TchError> {
    let d = x.size().last().copied().unwrap_or(0);
    let x1 = x.f_narrow(-1, 0, d / 2)?;
    let x2 = x.f_narrow(-1, d / 2, d - d / 2)?;
    let half = Tensor::f_cat(&[&x2.f_neg()?, &x1], -1)?;
    x.f_mul(cos)?.f_add(&half.f_mul(sin)?)
}

/// transformers' default RoPE: `1 / theta ** (arange(0, d, 2).float() / d)`,
/// fp32 on the CPU.
fn inv_freq(head_dim: i64, theta: f64) -> Result<Tensor, TchError> {
    let exponents = Tensor::f_arange_start_step(0, head_dim, 2, (Kind::Float, Device::Cpu))?
        .f_div_scalar(head_dim)?;
    Tensor::f_pow_scalar(theta, &exponents)?.f_reciprocal()
}

/// RoPE's frequencies under `scaling`, computed on the CPU in float32 op
/// for op as transformers' `ROPE_INIT_FUNCTIONS` computes them (its
/// `scalar / tensor` is `tensor.reciprocal() * scalar`), so the tables are
/// bitwise transformers'. `dynamic` equals the default within
/// `max_position_embeddings`, which no sequence passes (the spec and
/// sampling stop there).
pub(crate) fn scaled_inv_freq(
    head_dim: i64,
    theta: f64,
    scaling: &crate::spec::RopeScaling,
) -> Result<Tensor, TchError> {
    use crate::spec::RopeScaling;
    let inv = inv_freq(head_dim, theta)?;
    match *scaling {
        RopeScaling::Default | RopeScaling::Dynamic { .. } => Ok(inv),
        RopeScaling::Linear { factor } => inv.f_div_scalar(factor),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old = original_max_position_embeddings as f64;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            let wavelen = inv
                .f_reciprocal()?
                .f_mul_scalar(2.0 * std::f64::consts::PI)?;
            let llama = inv
                .f_div_scalar(factor)?
                .f_where_self(&wavelen.f_gt(low_wavelen)?, &inv)?;
            let smooth = wavelen
                .f_reciprocal()?
                .f_mul_scalar(old)?
                .f_sub_scalar(low_freq_factor)?
                .f_div_scalar(high_freq_factor - low_freq_factor)?;
            let smoothed = smooth
                .f_neg()?
                .f_add_scalar(1.0)?
                .f_mul(&llama)?
                .f_div_scalar(factor)?
                .f_add(&smooth.f_mul(&llama)?)?;
            let medium = wavelen
                .f_ge(high_wavelen)?
                .f_logical_and(&wavelen.f_le(low_wavelen)?)?;
            smoothed.f_where_self(&medium, &llama)
        }
    }
}
