//! Mistral (transformers' `MistralForCausalLM`, issue 39): the Llama layout
//! and names, no biases, and an optional sliding attention window
//! (`sliding_window` in its config.json: a query sees the last that many
//! positions). It reads Llama's `[model]` fields; a config.json's `model_type`
//! must be "mistral". Its rules are its [`Decoder`]'s, which
//! spec/family/llama reads; the worker builds it in family/mistral.

use super::llama::Extends;
use super::{Decoder, Window};
use crate::spec::ModelKind;

pub(super) const MISTRAL: Extends = Extends(&Decoder {
    kind: ModelKind::Mistral,
    model_type: "mistral",
    architecture: "MistralForCausalLM",
    default_max_positions: 131072,
    // MistralConfig's defaults where a config.json leaves them out.
    file_kv_heads: Some(8),
    file_head_dim: None,
    attention_bias: false,
    mlp_bias: false,
    qkv_bias: false,
    window: Window::Sliding { default: 4096 },
    qk_norm: false,
});
