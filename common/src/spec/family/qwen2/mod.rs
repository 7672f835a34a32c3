//! Qwen2 (transformers' `Qwen2ForCausalLM`, issue 39): the Llama layout
//! and names with biases on q_proj, k_proj and v_proj (none on o_proj or
//! the MLP). It reads Llama's `[model]` fields (the family it extends); a
//! config.json's `model_type` must be "qwen2". Its rules (the biases,
//! `use_sliding_window` refused) are `DecoderArch::Qwen2`'s in
//! spec/family/llama; the worker builds it in family/qwen2.

use super::llama::Extends;
use crate::spec::ModelKind;

pub(super) const QWEN2: Extends = Extends(&[ModelKind::Qwen2]);
