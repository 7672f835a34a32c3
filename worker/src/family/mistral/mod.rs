//! Mistral (transformers' `MistralForCausalLM`, issue 39): the Llama network
//! (family/llama) built from a config whose decoder is Mistral: no biases,
//! and attention within its `sliding_window` (the mask transformers builds,
//! also over the KV cache of `accrue sample`); names, blocks and plan Llama's.

use crate::family::llama::Extends;
use crate::spec::ModelKind;

pub(in crate::family) const MISTRAL: Extends = Extends(&[ModelKind::Mistral]);
