//! Mistral (transformers' `MistralForCausalLM`, issue 39): the Llama layout
//! and names, no biases, and an optional sliding attention window
//! (`sliding_window` in its config.json: a query sees the last that many
//! positions). It reads Llama's `[model]` fields; a config.json's `model_type`
//! must be "mistral". Its rules are `DecoderArch::Mistral`'s in
//! spec/family/llama; the worker builds it in family/mistral.

use super::llama::Llama;
use super::{DataSpec, ModelFamily, ModelSize};
use crate::spec::{Checker, ModelKind, ModelSpec, SpecErrors};

pub(super) struct Mistral;

impl ModelFamily for Mistral {
    fn kinds(&self) -> &'static [ModelKind] {
        &[ModelKind::Mistral]
    }

    fn field_sets(&self) -> &'static [&'static str] {
        &["llama"]
    }

    fn classes(&self, model: &ModelSpec) -> Option<i64> {
        Llama.classes(model)
    }

    fn check_fields(&self, model: &ModelSpec, data: &DataSpec, c: &mut Checker) {
        Llama.check_fields(model, data, c)
    }

    fn check_sizable(&self, model: &ModelSpec) -> Result<(), SpecErrors> {
        Llama.check_sizable(model)
    }

    fn size(&self, model: &ModelSpec, shape: &[u64], classes: u64) -> ModelSize {
        Llama.size(model, shape, classes)
    }
}
