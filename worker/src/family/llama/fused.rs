//! The Llama's faster CUDA path (docs/SEMANTICS.md, "On CUDA"): one
//! product for q/k/v and one for gate/up, and under autocast the fused
//! operations of crate::fused_ops (their CUDA kernels, or their ATen
//! reference); the training forward through them.

use super::{Layer, Linear, Net};
use tch::{Device, Kind, TchError, Tensor};

impl Net {
    /// Turns the fused operations under autocast on or off, and their CUDA
    /// kernels (tests compare them with transformers' op chains).
    pub fn set_fused_ops(&mut self, on: bool, kernels: bool) {
        self.fused_ops = on && self.head_dim % 2 == 0;
        self.kernels = on && kernels;
        if on {
            self.fuse_projections = true;
        }
    }

    /// The autocast type when this forward takes the fused operations.
    pub(super) fn fused_kind(&self, device: Device) -> Option<Kind> {
        if self.fused_ops {
            crate::amp::Autocast::kind(device)
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
        let cat_weights = |ls: &[&Linear]| -> Result<(Tensor, Option<Tensor>), TchError> {
            let cast = |t: &Tensor| t.f_to_kind(kind);
            let w = ls
                .iter()
                .map(|l| cast(&l.weight))
                .collect::<Result<Vec<_>, _>>()?;
            let b = match ls
                .iter()
                .map(|l| l.bias.as_ref())
                .collect::<Option<Vec<_>>>()
            {
                Some(bs) => {
                    let bs = bs.into_iter().map(cast).collect::<Result<Vec<_>, _>>()?;
                    Some(Tensor::f_cat(&bs, 0)?)
                }
                None => None,
            };
            Ok((Tensor::f_cat(&w, 0)?, b))
        };
        // Each residual add goes with the norm after it (the next
        // layer's input norm, or the final norm after the last layer).
        let norm_after = |i: usize| {
            self.layers
                .get(i)
                .map(|l| &l.input_norm)
                .unwrap_or(&self.norm)
        };
        let first = norm_after(0);
        let mut x = crate::fused_ops::rms_norm_cast(&h, &first.weight, first.eps, kind, k)?;
        for (i, l) in self.layers.iter().enumerate() {
            let (w, b) = cat_weights(&[&l.q, &l.k, &l.v])?;
            let y = x.f_linear(&w, b.as_ref())?;
            let qkv = crate::fused_ops::rope_qkv(&y, &cos, &sin, self.heads, self.kv_heads, k)?;
            let a = self.attend(l, &qkv, n, t)?;
            let post = &l.post_norm;
            (h, x) = crate::fused_ops::add_rms_norm_cast(&h, &a, &post.weight, post.eps, k)?;
            let (w, b) = cat_weights(&[&l.gate, &l.up])?;
            let m = crate::fused_ops::swiglu(&x.f_linear(&w, b.as_ref())?, k)?;
            let next = norm_after(i + 1);
            (h, x) = crate::fused_ops::add_rms_norm_cast(
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
        let pick =
            |lin: &Linear, r: Option<&Tensor>| -> Result<(Tensor, Option<Tensor>), TchError> {
                Ok(match r {
                    Some(r) => (
                        lin.weight.f_index_select(0, r)?,
                        lin.bias
                            .as_ref()
                            .map(|b| b.f_index_select(0, r))
                            .transpose()?,
                    ),
                    None => (
                        lin.weight.shallow_clone(),
                        lin.bias.as_ref().map(Tensor::shallow_clone),
                    ),
                })
            };
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
        let (wq, bq) = pick(&l.q, qr)?;
        let (wk, bk) = pick(&l.k, kr)?;
        let (wv, bv) = pick(&l.v, None)?;
        let w = Tensor::f_cat(&[&wq, &wk, &wv], 0)?;
        let b = match (bq, bk, bv) {
            (Some(a), Some(b), Some(c)) => Some(Tensor::f_cat(&[&a, &b, &c], 0)?),
            _ => None,
        };
        let y = x.f_linear(&w, b.as_ref())?;
        // A split, whose backward is one concatenation (narrow's would be
        // a zeroed full-width gradient per part, then their sum).
        let sizes = [wq.size()[0], wk.size()[0], wv.size()[0]];
        let mut parts = y.f_split_with_sizes(sizes, -1)?.into_iter();
        match (parts.next(), parts.next(), parts.next()) {
            (Some(q), Some(k), Some(v)) => Ok([q, k, v]),
            _ => Err(TchError::Shape("splitting the q/k/v product".into())),
        }
    }

    /// silu(gate(x)) * up(x), from one product when fused.
    pub(super) fn swiglu(&self, l: &Layer, x: &Tensor) -> Result<Tensor, TchError> {
        if !self.fuse_projections {
            return l.gate.forward(x)?.f_silu()?.f_mul(&l.up.forward(x)?);
        }
        let w = Tensor::f_cat(&[&l.gate.weight, &l.up.weight], 0)?;
        let b = match (&l.gate.bias, &l.up.bias) {
            (Some(a), Some(b)) => Some(Tensor::f_cat(&[a, b], 0)?),
            _ => None,
        };
        let y = x.f_linear(&w, b.as_ref())?;
        let i = l.gate.weight.size()[0];
        match y.f_split_with_sizes([i, i], -1)?.as_slice() {
            [g, u] => g.f_silu()?.f_mul(u),
            _ => Err(TchError::Shape("splitting the gate/up product".into())),
        }
    }
}
