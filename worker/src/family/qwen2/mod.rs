//! Qwen2 (transformers' `Qwen2ForCausalLM`, issue 39): the Llama network
//! (family/llama) built from a config whose decoder is Qwen2, which gives
//! q_proj, k_proj and v_proj their biases and o_proj none; the names,
//! blocks and parallel plan are Llama's with those biases.

use crate::family::llama::Extends;
use crate::spec::ModelKind;

pub(in crate::family) const QWEN2: Extends = Extends(&[ModelKind::Qwen2]);
