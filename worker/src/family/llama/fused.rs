//! The Llama's faster CUDA path (docs/SEMANTICS.md, "On CUDA"): one
//! product for q/k/v and one for gate/up, and under autocast the fused
//! operations of crate::cuda::fused_ops (their CUDA kernels, or their ATen
//! reference); the training forward through them.

use super::{Layer, Linear, Net};
use tch::{Device, Kind, TchError, Tensor};

impl Net {
    /// Turns the fused operations under autocast on or off, and their CUDA
    /// kernels (tests compare them with transformers' op chains).
    pub fn set_fused_ops(&mut self, on: bool, kernels: bool) {
        self.fused_ops = on && self.head_dim % 2 == 0 && !self.qk_norm;
        self.kernels = on && kernels;
        if on {
            self.fuse_projections = true;
        }
    }

    /// The autocast type when this forward takes the fused operations.
    pub(super) fn fused_kind(&self, device: Device) -> Option<Kind> {
        if self.fused_ops {
            crate::cuda::amp::Autocast::kind(device)
        } else {
            None
        }
    }

    /// cos and sin `[T, D/2]` (fp32) of positions 0..T: transformers'
    /// tables (whose two halves are equal) without the repeat.
    pub(super) fn rope_table(&self, t: i64) -> Result<(Tensor, Tensor), TchError> {
        let device = self.inv_freq.device();
        let freqs = Tensor::f_arange(t, (Kind::Int64, device))?
            .f_to_kind(Kind::Float)?
            .f_unsqueeze(-1)?
            .f_mul(&self.inv_freq.f_unsqueeze(0)?)?;
        Ok((freqs.f_cos()?, freqs.f_sin()?))
    }

    /// The training forward under autocast through the fused operations
    /// (`kind` the autocast type): per layer, one q/k/v product of the
    /// normed input, RoPE and the split into heads, attention and the
    /// output projection; its residual add with the post-attention norm;
    /// one gate/up product, SwiGLU and the down projection; its residual
    /// add with the next norm (the next layer's input norm, or the final
    /// norm), cast for the next product or the head.
    pub(super) fn try_features_fused(&self, ids: &Tensor, kind: Kind) -> Result<Tensor, TchError> {
        let (n, t) = ids.size2()?;
        let k = self.kernels;
        let mut h = Tensor::f_embedding(&self.embed, ids, -1, false, false)?;
        let (cos, sin) = self.rope_table(t)?;
        // Each weight cast to the autocast type as autocast would cast it
        // for its own product, then concatenated: the same values, and
        // half the bytes a concatenation in fp32 would move.
        let cast = Some(kind);
        // Each residual add goes with the norm after it (the next
        // layer's input norm, or the final norm after the last layer).
        let norm_after = |i: usize| {
            self.layers
                .get(i)
                .map(|l| &l.input_norm)
                .unwrap_or(&self.norm)
        };
        let first = norm_after(0);
        let mut x = crate::cuda::fused_ops::rms_norm_cast(&h, &first.weight, first.eps, kind, k)?;
        for (i, l) in self.layers.iter().enumerate() {
            let (w, b) = concat(&[(&l.q, None), (&l.k, None), (&l.v, None)], cast)?;
            let y = x.f_linear(&w, b.as_ref())?;
            let qkv =
                crate::cuda::fused_ops::rope_qkv(&y, &cos, &sin, self.heads, self.kv_heads, k)?;
            let a = self.attend(l, &qkv, n, t, None)?;
            let post = &l.post_norm;
            (h, x) = crate::cuda::fused_ops::add_rms_norm_cast(&h, &a, &post.weight, post.eps, k)?;
            let (w, b) = concat(&[(&l.gate, None), (&l.up, None)], cast)?;
            let m = crate::cuda::fused_ops::swiglu(&x.f_linear(&w, b.as_ref())?, k)?;
            let next = norm_after(i + 1);
            (h, x) = crate::cuda::fused_ops::add_rms_norm_cast(
                &h,
                &l.down.forward(&m)?,
                &next.weight,
                next.eps,
                k,
            )?;
        }
        Ok(x)
    }

    /// Turns the fused projections ([`Net`]'s `fuse_projections`) on or
    /// off (tests compare both on the CPU).
    pub fn set_fused_projections(&mut self, on: bool) {
        self.fuse_projections = on;
    }

    /// q, k and v (k and q with their rows in `rows` order when given, for
    /// the complex RoPE) of `x`, from one product when fused.
    pub(super) fn project_qkv(
        &self,
        l: &Layer,
        x: &Tensor,
        rows: Option<(&Tensor, &Tensor)>,
    ) -> Result<[Tensor; 3], TchError> {
        let (qr, kr) = (rows.map(|r| r.0), rows.map(|r| r.1));
        if !self.fuse_projections {
            let one = |lin: &Linear, r: Option<&Tensor>| -> Result<Tensor, TchError> {
                match r {
                    Some(r) => lin.forward_rows(x, r),
                    None => lin.forward(x),
                }
            };
            return Ok([one(&l.q, qr)?, one(&l.k, kr)?, one(&l.v, None)?]);
        }
        let (w, b) = concat(&[(&l.q, qr), (&l.k, kr), (&l.v, None)], None)?;
        let rows = |lin: &Linear| lin.weight.size()[0];
        let parts = split(
            &x.f_linear(&w, b.as_ref())?,
            &[rows(&l.q), rows(&l.k), rows(&l.v)],
        )?;
        <[Tensor; 3]>::try_from(parts)
            .map_err(|_| TchError::Shape("splitting the q/k/v product".into()))
    }

    /// silu(gate(x)) * up(x), from one product when fused.
    pub(super) fn swiglu(&self, l: &Layer, x: &Tensor) -> Result<Tensor, TchError> {
        if !self.fuse_projections {
            return l.gate.forward(x)?.f_silu()?.f_mul(&l.up.forward(x)?);
        }
        let (w, b) = concat(&[(&l.gate, None), (&l.up, None)], None)?;
        let i = l.gate.weight.size()[0];
        match split(&x.f_linear(&w, b.as_ref())?, &[i, i])?.as_slice() {
            [g, u] => g.f_silu()?.f_mul(u),
            _ => Err(TchError::Shape("splitting the gate/up product".into())),
        }
    }
}

/// The weights (and the biases, when every part has one) of `parts`
/// concatenated for one product: each part a layer and, optionally, the
/// rows to take from it (q and k in pair order for the complex RoPE);
/// each cast to `cast` first when given.
fn concat(
    parts: &[(&Linear, Option<&Tensor>)],
    cast: Option<Kind>,
) -> Result<(Tensor, Option<Tensor>), TchError> {
    let prepare = |t: &Tensor, rows: Option<&Tensor>| -> Result<Tensor, TchError> {
        let t = match rows {
            Some(r) => t.f_index_select(0, r)?,
            None => t.shallow_clone(),
        };
        match cast {
            Some(kind) => t.f_to_kind(kind),
            None => Ok(t),
        }
    };
    let weights = parts
        .iter()
        .map(|(l, r)| prepare(&l.weight, *r))
        .collect::<Result<Vec<_>, _>>()?;
    let biases = parts
        .iter()
        .map(|(l, r)| l.bias.as_ref().map(|b| prepare(b, *r)))
        .collect::<Option<Result<Vec<_>, _>>>()
        .transpose()?;
    Ok((
        Tensor::f_cat(&weights, 0)?,
        biases.map(|b| Tensor::f_cat(&b, 0)).transpose()?,
    ))
}

/// A product's output split along its features into parts of `sizes`: a
/// split, whose backward is one concatenation (narrow's would be a zeroed
/// full-width gradient per part, then their sum).
fn split(y: &Tensor, sizes: &[i64]) -> Result<Vec<Tensor>, TchError> {
    y.f_split_with_sizes(sizes, -1)
}
