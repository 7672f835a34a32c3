//! A Llama's size as the memory estimate counts it: its parameters, its
//! largest pipeline unit and the activations a sample's step saves.

use super::LlamaConfig;
use crate::spec::family::ModelSize;

impl LlamaConfig {
    pub fn parameter_count(&self) -> u64 {
        let u = |x: i64| x.max(0) as u64;
        let (v, h, i) = (
            u(self.vocab_size),
            u(self.hidden_size),
            u(self.intermediate_size),
        );
        let kv = u(self.num_key_value_heads).saturating_mul(u(self.head_dim()));
        // q_proj's rows and o_proj's columns: heads x head_dim.
        let q = u(self.num_attention_heads).saturating_mul(u(self.head_dim()));
        let m = |a: u64, b: u64| a.saturating_mul(b);
        let attention = m(h, q)
            .saturating_add(m(h, kv))
            .saturating_add(m(h, kv))
            .saturating_add(m(q, h))
            .saturating_add(if self.attention_bias {
                q.saturating_add(kv).saturating_add(kv).saturating_add(h)
            } else if self.qkv_bias() {
                q.saturating_add(kv).saturating_add(kv)
            } else {
                0
            });
        let mlp = m(3, m(h, i)).saturating_add(if self.mlp_bias {
            m(2, i).saturating_add(h)
        } else {
            0
        });
        // Qwen3's per-head norms on q and k.
        let head_norms = if self.qk_norm() {
            m(2, u(self.head_dim()))
        } else {
            0
        };
        let layer = attention
            .saturating_add(mlp)
            .saturating_add(m(2, h))
            .saturating_add(head_norms);
        let head = if self.tie_word_embeddings { 0 } else { m(v, h) };
        m(v, h)
            .saturating_add(m(u(self.num_hidden_layers), layer))
            .saturating_add(h)
            .saturating_add(head)
    }

    /// The parameters of the largest pipeline unit: the embedding with the
    /// first layer, or the last layer with the final norm and the head (a
    /// tied head: the last stage's copy of the embedding).
    pub fn largest_unit(&self) -> u64 {
        let layers = (self.num_hidden_layers.max(1)) as u64;
        let v_h = (self.vocab_size.max(0) as u64).saturating_mul(self.hidden_size.max(0) as u64);
        let without = self
            .parameter_count()
            .saturating_sub(v_h)
            .saturating_sub(self.hidden_size.max(0) as u64)
            .saturating_sub(if self.tie_word_embeddings { 0 } else { v_h });
        let layer = without / layers;
        layer
            .saturating_add(v_h)
            .saturating_add(self.hidden_size.max(0) as u64)
    }

    /// The model's size at `t` tokens a sample.
    pub(in crate::spec::family) fn model_size(&self, t: u64) -> ModelSize {
        // Activations counted: the logits, T x vocab per sample (the
        // largest tensor of a language model's step), and each decoder
        // layer's saved tensors, T x (10 H + 4 I + heads x T) a sample
        // (the norms' inputs, q, k, v and their rotations, the attention
        // weights, the MLP's gate, up, their activation and product:
        // within 3% of what PyTorch saves for transformers' model with
        // eager attention, worker/benches/activation_bytes.py).
        let c = |v: i64| v.max(0) as u64;
        let (h, i) = (c(self.hidden_size), c(self.intermediate_size));
        let per_token = h
            .saturating_mul(10)
            .saturating_add(i.saturating_mul(4))
            .saturating_add(c(self.num_attention_heads).saturating_mul(t));
        ModelSize {
            parameters: self.parameter_count(),
            activations: t.saturating_mul(c(self.vocab_size)),
            largest_unit: self.largest_unit(),
            layers: c(self.num_hidden_layers),
            layer_activations: t.saturating_mul(per_token),
            layer_input: t.saturating_mul(h),
        }
    }
}
