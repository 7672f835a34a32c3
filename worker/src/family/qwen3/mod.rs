//! Qwen3 (transformers' `Qwen3ForCausalLM`): the Llama network
//! (family/llama) built from a config whose decoder is Qwen3, which gives
//! each layer its per-head RMSNorms on q and k (replicated across tensor
//! ranks, their gradients summed over the group); the names, blocks and
//! parallel plan are Llama's with those norms.

use crate::family::llama::Extends;
use crate::spec::ModelKind;

pub(in crate::family) const QWEN3: Extends = Extends(&[ModelKind::Qwen3]);
