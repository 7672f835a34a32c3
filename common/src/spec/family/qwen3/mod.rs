//! Qwen3 (transformers' `Qwen3ForCausalLM`): the Llama layout and names
//! with an RMSNorm over each head's width on q and k
//! (`self_attn.q_norm.weight`, `self_attn.k_norm.weight`, after the
//! projection and before RoPE), biases on q, k, v and o with
//! `attention_bias` (none on the MLP), and its own head width (`head_dim`
//! in a config.json, 128 where it is left out). It reads Llama's `[model]`
//! fields; a config.json's `model_type` must be "qwen3", and
//! `use_sliding_window` must be false (as Qwen2's). Its rules are its
//! [`Decoder`]'s, which spec/family/llama reads; the worker builds it in
//! family/qwen3.

use super::llama::Extends;
use super::{Decoder, Window};
use crate::spec::ModelKind;

pub(super) const QWEN3: Extends = Extends(&Decoder {
    kind: ModelKind::Qwen3,
    model_type: "qwen3",
    architecture: "Qwen3ForCausalLM",
    default_max_positions: 32768,
    // Qwen3Config's defaults where a config.json leaves the keys out.
    file_kv_heads: Some(32),
    file_head_dim: Some(128),
    attention_bias: true,
    mlp_bias: false,
    qkv_bias: false,
    window: Window::Switch,
    qk_norm: true,
});

#[cfg(test)]
mod tests {
    use crate::spec::{LlamaConfig, ModelKind};
    use serde_json::json;

    fn config(extra: serde_json::Value) -> serde_json::Value {
        let mut c = json!({"model_type": "qwen3", "vocab_size": 97, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2});
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    /// Qwen3Config's defaults where the file leaves keys out, its head
    /// norms counted in the size: transformers'
    /// `Qwen3ForCausalLM(config).num_parameters()` for head_dim 16 with
    /// attention biases is 31,328.
    #[test]
    fn qwen3_resolves_with_its_class_defaults_and_head_norms() {
        let c = LlamaConfig::from_hf_json(&config(json!({}))).unwrap();
        assert_eq!(c.arch.kind(), ModelKind::Qwen3);
        assert_eq!((c.head_dim(), c.max_position_embeddings), (128, 32768));
        assert!(c.qk_norm() && !c.qkv_bias());
        let c = LlamaConfig::from_hf_json(&config(json!({"head_dim": 16, "attention_bias": true})))
            .unwrap();
        assert_eq!(c.parameter_count(), 31_328);
        let back = c.to_hf_json();
        assert_eq!(back["architectures"][0], "Qwen3ForCausalLM");
        assert_eq!(
            (&back["head_dim"], &back["attention_bias"]),
            (&json!(16), &json!(true))
        );
        assert!(back.get("mlp_bias").is_none(), "{back}");
        assert_eq!(back["use_sliding_window"], false);
    }

    /// What Qwen3 does not have is refused naming it.
    #[test]
    fn qwen3_refuses_mlp_biases_and_the_layer_window() {
        let e = LlamaConfig::from_hf_json(&config(json!({"mlp_bias": true})))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.mlp_bias = true: qwen3 has no mlp_bias"),
            "{e}"
        );
        let e = LlamaConfig::from_hf_json(&config(json!({"use_sliding_window": true})))
            .unwrap_err()
            .to_string();
        assert!(e.contains("accrue's qwen3 has no sliding window"), "{e}");
    }
}
