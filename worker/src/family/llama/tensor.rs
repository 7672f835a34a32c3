//! Tensor parallelism for the Llama family (issue 42): Megatron-LM's
//! mapping. q, k, v, gate and up split by output rows, o and down by input
//! columns; `f` (the input's gradient summed over the group) before each
//! pair and `g` (the partial outputs summed) after it, so a decoder layer
//! costs one all-reduce of `[N, T, H]` after o_proj and one after
//! down_proj in the forward, and their mirrors in the backward. Attention
//! heads split T ways; with fewer key-value heads than T each serves
//! T / kv ranks. The embedding and the head split by vocabulary rows
//! (`shard::slice`: a vocabulary T does not divide gives the first ranks
//! one row more, no padding ever visible); the embedding's lookups outside
//! the rank's rows give zeros and the rows are summed (`g`).

use super::Net;
use crate::comm::tensor_ops::TensorGroupCell;
use crate::error::{Error, Result, TorchContext};
use crate::family::tensor::{TensorPlace, TpSlice};
use crate::family::Split;
use crate::spec::LlamaConfig;
use tch::{Kind, TchError, Tensor};

/// The vocabulary's rows of each rank (`shard::slice`).
pub(super) fn vocab_ranges(vocab: i64, t: i64) -> Vec<(i64, i64)> {
    (0..t)
        .map(|r| {
            let s = crate::comm::shard::slice(vocab as usize, t as usize, r as usize);
            (s.start as i64, s.end as i64)
        })
        .collect()
}

/// Whether `c` splits `t` ways, or an error naming the setting and T.
pub(super) fn check(c: &LlamaConfig, t: i64) -> std::result::Result<(), String> {
    let (heads, kv) = (c.num_attention_heads, c.num_key_value_heads);
    if heads % t != 0 {
        return Err(format!(
            "parallel.tensor = {t} must divide num_attention_heads = {heads} (each rank takes \
             num_attention_heads / tensor heads)"
        ));
    }
    if kv % t != 0 && t % kv != 0 {
        return Err(format!(
            "parallel.tensor = {t} and num_key_value_heads = {kv}: one must divide the other \
             (each rank takes kv / T heads, or each kv head serves T / kv ranks)"
        ));
    }
    if c.intermediate_size % t != 0 {
        return Err(format!(
            "parallel.tensor = {t} must divide intermediate_size = {} (gate, up and down split \
             by it)",
            c.intermediate_size
        ));
    }
    if c.vocab_size < t {
        return Err(format!(
            "parallel.tensor = {t} is above vocab_size = {} (each rank holds rows of the \
             vocabulary)",
            c.vocab_size
        ));
    }
    Ok(())
}

/// Every parameter's [`TpSlice`] at degree `t`, in the model's order.
pub(super) fn layout(
    c: &LlamaConfig,
    t: i64,
) -> std::result::Result<Vec<(String, TpSlice)>, String> {
    check(c, t)?;
    let d = c.head_dim();
    let plan = super::plan::parallel_plan(c);
    let q = TpSlice::even(0, c.num_attention_heads * d, t);
    let kv = if c.num_key_value_heads >= t {
        TpSlice::even(0, c.num_key_value_heads * d, t)
    } else {
        let share = t / c.num_key_value_heads;
        TpSlice::Sliced {
            dim: 0,
            ranges: (0..t)
                .map(|r| {
                    let head = r / share;
                    (head * d, (head + 1) * d)
                })
                .collect(),
        }
    };
    let inner = TpSlice::even(0, c.intermediate_size, t);
    let vocab = TpSlice::Sliced {
        dim: 0,
        ranges: vocab_ranges(c.vocab_size, t),
    };
    let by_rows = |s: &TpSlice| match s {
        TpSlice::Sliced { ranges, .. } => TpSlice::Sliced {
            dim: 1,
            ranges: ranges.clone(),
        },
        TpSlice::Replicated => TpSlice::Replicated,
    };
    let mut out = Vec::new();
    for name in super::plan::param_names(c) {
        let slice = match plan.split_of(&name) {
            Split::Replicated => TpSlice::Replicated,
            Split::Vocab => vocab.clone(),
            split => {
                let layer = if name.contains(".q_proj.") || name.contains(".o_proj.") {
                    &q
                } else if name.contains(".k_proj.") || name.contains(".v_proj.") {
                    &kv
                } else {
                    &inner
                };
                match split {
                    Split::Row => by_rows(layer),
                    _ => layer.clone(),
                }
            }
        };
        out.push((name, slice));
    }
    Ok(out)
}

/// Rows of a key-value projection several tensor ranks hold (fewer kv
/// heads than ranks): used through [`TensorGroup::shared_sum`], so each
/// holder's gradient is the sum over the holders.
///
/// [`TensorGroup::shared_sum`]: crate::comm::tensor_ops::TensorGroup::shared_sum
#[derive(Debug, Clone)]
pub(super) struct SharedRows {
    group: TensorGroupCell,
    start: i64,
    whole: i64,
}

impl SharedRows {
    pub(super) fn of(&self, t: &Tensor) -> Result<Tensor, TchError> {
        self.group.get()?.shared_sum(t, 0, self.start, self.whole)
    }
}

/// Whether `w` is another pipeline stage's parameter, released to an
/// empty tensor (family/model.rs).
fn released(w: &Tensor) -> bool {
    w.dim() == 1 && w.numel() == 0
}

/// A split model's tensor-parallel state.
#[derive(Debug)]
pub(super) struct Tp {
    group: TensorGroupCell,
    /// This rank's first vocabulary row and every rank's row count.
    vocab_start: i64,
    vocab_widths: Vec<i64>,
}

impl Net {
    /// Takes this rank's geometry after its parameters were cut to its
    /// slices (family/tensor.rs): its heads, key-value heads and
    /// vocabulary rows, and the group its operations run on. The fused
    /// CUDA paths stay off (they take whole q/k/v).
    pub(super) fn split_tensor(&mut self, place: &TensorPlace) -> Result<()> {
        let t = place.size as i64;
        let d = self.head_dim;
        let ranges = vocab_ranges(self.vocab, t);
        let (start, end) = ranges[place.rank];
        // Each vocabulary matrix this stage holds (a pipeline stage holds
        // the embedding, the head, both or neither: another stage's are
        // released to empty tensors) takes this rank's rows.
        let held = [
            ("embedding", Some(&self.embed)),
            ("head", self.head.as_ref()),
        ];
        for (what, w) in held {
            let Some(w) = w.filter(|w| !released(w)) else {
                continue;
            };
            let rows = w.size().first().copied().unwrap_or(0);
            if rows != end - start {
                return Err(Error::Sharding(format!(
                    "the {what} holds {rows} rows, rank {} of {t} takes {}",
                    place.rank,
                    end - start
                )));
            }
        }
        if self.kv_heads < t {
            // Each kv head serves t / kv ranks: its gradients summed over them.
            let head = place.rank as i64 / (t / self.kv_heads);
            let shared = SharedRows {
                group: place.group.clone(),
                start: head * d,
                whole: self.kv_heads * d,
            };
            for l in &mut self.layers {
                l.k.shared = Some(shared.clone());
                l.v.shared = Some(shared.clone());
            }
        }
        // Qwen3's head norms: replicated, each rank's gradient from its
        // own heads only, so summed over the group (transformers'
        // "replicated_with_grad_allreduce").
        for l in &mut self.layers {
            for norm in [&mut l.q_norm, &mut l.k_norm].into_iter().flatten() {
                norm.partial = Some(place.group.clone());
            }
        }
        self.heads /= t;
        self.kv_heads = (self.kv_heads / t).max(1);
        let device = self.embed.device();
        self.q_rows =
            super::rope::paired_rows(self.heads, d, device).ctx("computing RoPE's row order")?;
        self.k_rows =
            super::rope::paired_rows(self.kv_heads, d, device).ctx("computing RoPE's row order")?;
        self.fuse_projections = false;
        self.fused_ops = false;
        self.tp = Some(Tp {
            group: place.group.clone(),
            vocab_start: start,
            vocab_widths: ranges.iter().map(|(a, b)| b - a).collect(),
        });
        Ok(())
    }

    /// `f` before column-split layers (the identity at T = 1).
    pub(super) fn to_region(&self, x: &Tensor) -> Result<Tensor, TchError> {
        match &self.tp {
            Some(tp) => tp.group.get()?.copy(x),
            None => Ok(x.shallow_clone()),
        }
    }

    /// A row-split layer: the partial products summed over the group
    /// (`g`), then the bias (replicated) once.
    pub(super) fn row_out(&self, lin: &super::Linear, x: &Tensor) -> Result<Tensor, TchError> {
        let Some(tp) = &self.tp else {
            return lin.forward(x);
        };
        let y = tp
            .group
            .get()?
            .reduce(&x.f_linear(&lin.weight, None::<&Tensor>)?)?;
        match &lin.bias {
            Some(b) => y.f_add(b),
            None => Ok(y),
        }
    }

    /// The token embeddings of `ids`: each rank looks up its rows (zeros
    /// for ids outside them), summed over the group.
    pub(super) fn embed_ids(&self, ids: &Tensor) -> Result<Tensor, TchError> {
        let Some(tp) = &self.tp else {
            return Tensor::f_embedding(&self.embed, ids, -1, false, false);
        };
        let rows = self.embed.size().first().copied().unwrap_or(0);
        let local = ids.f_sub_scalar(tp.vocab_start)?;
        let outside = local.f_lt(0)?.f_logical_or(&local.f_ge(rows)?)?;
        let local = local.f_masked_fill(&outside, 0)?;
        let e = Tensor::f_embedding(&self.embed, &local, -1, false, false)?
            .f_masked_fill(&outside.f_unsqueeze(-1)?, 0.0)?;
        tp.group.get()?.reduce(&e)
    }

    /// The head's logits over `h`: this rank's vocabulary columns, joined
    /// over the group (each rank's columns of the gradient backward).
    pub(super) fn head_logits(&self, h: &Tensor) -> Result<Tensor, TchError> {
        let Some(tp) = &self.tp else {
            return h.f_linear(self.head_weight(), None::<&Tensor>);
        };
        let g = tp.group.get()?;
        let local = g.copy(h)?.f_linear(self.head_weight(), None::<&Tensor>)?;
        let local = if local.kind() == Kind::Float {
            local
        } else {
            local.f_to_kind(Kind::Float)?
        };
        g.gather_last(&local, &tp.vocab_widths)
    }

    /// The head's vocabulary shard, when split.
    pub(super) fn vocab_shard(&self) -> Option<crate::family::VocabShard> {
        self.tp.as_ref().map(|tp| crate::family::VocabShard {
            start: tp.vocab_start,
            group: tp.group.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(heads: i64, kv: i64, vocab: i64) -> LlamaConfig {
        LlamaConfig {
            vocab_size: vocab,
            hidden_size: 8 * heads,
            intermediate_size: 48,
            num_hidden_layers: 1,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            max_position_embeddings: 16,
            tie_word_embeddings: false,
            attention_bias: true,
            mlp_bias: false,
            initializer_range: 0.02,
            rope_scaling: Default::default(),
            arch: Default::default(),
            sliding_window: None,
            explicit_head_dim: None,
        }
    }

    fn slice<'a>(l: &'a [(String, TpSlice)], name: &str) -> &'a TpSlice {
        &l.iter().find(|(n, _)| n == name).unwrap().1
    }

    /// Megatron's mapping with the heads' arithmetic: q by heads, k and v
    /// by kv heads (shared by T / kv ranks when fewer), o by q's columns,
    /// the vocabulary by rows with the remainder on the first ranks.
    #[test]
    fn the_layout_follows_the_heads() {
        let l = layout(&config(4, 2, 97), 4).unwrap();
        let at = |name: &str| slice(&l, &format!("model.layers.0.{name}")).clone();
        let rows = |dim: i64, r: &[(i64, i64)]| TpSlice::Sliced {
            dim,
            ranges: r.to_vec(),
        };
        // head_dim 8: each rank one q head, the two kv heads two ranks each.
        assert_eq!(
            at("self_attn.q_proj.weight"),
            rows(0, &[(0, 8), (8, 16), (16, 24), (24, 32)])
        );
        assert_eq!(at("self_attn.q_proj.bias"), at("self_attn.q_proj.weight"));
        let kv = rows(0, &[(0, 8), (0, 8), (8, 16), (8, 16)]);
        assert_eq!(at("self_attn.k_proj.weight"), kv);
        assert_eq!(at("self_attn.v_proj.bias"), kv);
        assert_eq!(
            at("self_attn.o_proj.weight"),
            rows(1, &[(0, 8), (8, 16), (16, 24), (24, 32)])
        );
        assert_eq!(at("self_attn.o_proj.bias"), TpSlice::Replicated);
        assert_eq!(
            at("mlp.down_proj.weight"),
            rows(1, &[(0, 12), (12, 24), (24, 36), (36, 48)])
        );
        assert_eq!(at("input_layernorm.weight"), TpSlice::Replicated);
        assert_eq!(
            slice(&l, "model.embed_tokens.weight"),
            &rows(0, &[(0, 25), (25, 49), (49, 73), (73, 97)])
        );
        // Counted once: rank 0 and 2 count the kv heads, rank 0 the norms.
        let counted: Vec<usize> = (0..4)
            .filter(|&r| crate::family::tensor::counts(&kv, r))
            .collect();
        assert_eq!(counted, vec![0, 2]);
    }

    /// What does not split is refused naming the setting and T.
    #[test]
    fn settings_that_do_not_divide_are_named() {
        let e = layout(&config(6, 2, 97), 4).unwrap_err();
        assert!(e.contains("num_attention_heads = 6"), "{e}");
        let e = layout(&config(8, 3, 97), 2).unwrap_err();
        assert!(e.contains("num_key_value_heads = 3"), "{e}");
        let mut c = config(4, 2, 97);
        c.intermediate_size = 50;
        assert!(layout(&c, 4)
            .unwrap_err()
            .contains("intermediate_size = 50"));
        assert!(layout(&config(4, 4, 3), 4)
            .unwrap_err()
            .contains("vocab_size = 3"));
        assert!(layout(&config(4, 1, 97), 4).is_ok());
    }
}
