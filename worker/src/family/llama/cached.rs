//! Generation's forward (`accrue sample`): new tokens after those a
//! [`KvCache`] holds, attending to the cached keys and values.

use super::{window_mask, Net};
use crate::error::{Result, TorchContext};
use tch::{Kind, TchError, Tensor};

/// Keys and values of the positions a [`Net::forward_cached`] has seen,
/// per layer (`[N, kv_heads, S, head_dim]`, after RoPE), for generation.
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<(Tensor, Tensor)>,
    len: i64,
}

impl KvCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Positions cached (the next token's position).
    pub fn len(&self) -> i64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Net {
    /// Logits `[N, t, vocab]` of `t` new tokens `[N, t]` at positions
    /// `cache.len()..cache.len() + t`, attending to the cached positions
    /// and causally among themselves; their keys and values are appended
    /// to `cache`. The first call (empty cache) computes what
    /// [`Net::forward`] computes; later ones give the logits the full
    /// forward of the whole sequence gives at those positions.
    pub fn forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        self.try_forward_cached(ids, cache)
            .ctx("running the llama forward (KV cache)")
    }

    fn try_forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor, TchError> {
        if self.tp.is_some() {
            return Err(TchError::Torch(
                "generation runs on the whole model (a checkpoint is whole): not on a tensor shard"
                    .into(),
            ));
        }
        let (n, t) = ids.size2()?;
        let past = cache.len;
        let mut h = Tensor::f_embedding(&self.embed, ids, -1, false, false)?;
        let rope = self.rope(past, t, &h)?;
        // The prompt pass is the training forward's causal attention; one
        // new token attends to every cached position; several new tokens
        // after a cache need a mask (is_causal aligns top-left when the
        // query and key lengths differ): key j is seen by query i when
        // j <= past + i.
        let window = window_mask(past, t, self.sliding_window, ids.device())?;
        let causal = past == 0 && t > 1 && window.is_none();
        let mask = if window.is_some() {
            window
        } else if past > 0 && t > 1 {
            let device = ids.device();
            let keys = Tensor::f_arange(past + t, (Kind::Int64, device))?.f_unsqueeze(0)?;
            let queries = Tensor::f_arange(t, (Kind::Int64, device))?
                .f_add_scalar(past)?
                .f_unsqueeze(-1)?;
            Some(keys.f_le_tensor(&queries)?)
        } else {
            None
        };
        for (i, l) in self.layers.iter().enumerate() {
            let x = l.input_norm.forward(&h)?;
            let [q, k, v] = self.qkv(l, &x, &rope)?;
            let (k, v) = match cache.layers.get(i) {
                Some((pk, pv)) => (Tensor::f_cat(&[pk, &k], 2)?, Tensor::f_cat(&[pv, &v], 2)?),
                None => (k, v),
            };
            // Under Mistral's window, as the training forward (`attend`).
            let windowed = self.sliding_window.is_some() && mask.is_some();
            let (ke, ve) = if windowed {
                (self.repeat_kv(&k)?, self.repeat_kv(&v)?)
            } else {
                (k.shallow_clone(), v.shallow_clone())
            };
            let out = Tensor::f_scaled_dot_product_attention(
                &q,
                &ke,
                &ve,
                mask.as_ref(),
                0.0,
                causal,
                Some(self.scale),
                self.kv_heads < self.heads && !windowed,
            )?;
            match cache.layers.get_mut(i) {
                Some(slot) => *slot = (k, v),
                None => cache.layers.push((k, v)),
            }
            let out = out
                .f_transpose(1, 2)?
                .f_contiguous()?
                .f_reshape([n, t, -1])?;
            h = h.f_add(&l.o.forward(&out)?)?;
            h = self.mlp_block(l, &h)?;
        }
        cache.len = past + t;
        self.logits(&h)
    }
}
