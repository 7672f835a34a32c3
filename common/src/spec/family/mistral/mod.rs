//! Mistral (transformers' `MistralForCausalLM`, issue 39): the Llama layout
//! and names, no biases, and an optional sliding attention window
//! (`sliding_window` in its config.json: a query sees the last that many
//! positions). It reads Llama's `[model]` fields; a config.json's `model_type`
//! must be "mistral". Its rules are `DecoderArch::Mistral`'s in
//! spec/family/llama; the worker builds it in family/mistral.

use super::llama::Extends;
use crate::spec::ModelKind;

pub(super) const MISTRAL: Extends = Extends(&[ModelKind::Mistral]);
