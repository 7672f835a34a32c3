//! Qwen2 (transformers' `Qwen2ForCausalLM`, issue 39): the Llama layout
//! and names with biases on q_proj, k_proj and v_proj (none on o_proj or
//! the MLP). It reads Llama's `[model]` fields (the family it extends); a
//! config.json's `model_type` must be "qwen2". Its rules (the biases,
//! `use_sliding_window` refused) are its [`Decoder`]'s, which
//! spec/family/llama reads; the worker builds it in family/qwen2.

use super::llama::Extends;
use super::{Decoder, Window};
use crate::spec::ModelKind;

pub(super) const QWEN2: Extends = Extends(&Decoder {
    kind: ModelKind::Qwen2,
    model_type: "qwen2",
    architecture: "Qwen2ForCausalLM",
    default_max_positions: 32768,
    // Qwen2Config's default, not the heads.
    file_kv_heads: Some(32),
    file_head_dim: None,
    attention_bias: false,
    mlp_bias: false,
    qkv_bias: true,
    window: Window::Switch,
    qk_norm: false,
});
