//! Qwen2 (transformers' `Qwen2ForCausalLM`, issue 39): the Llama layout
//! and names with biases on q_proj, k_proj and v_proj (none on o_proj or
//! the MLP). It reads Llama's `[model]` fields (the family it extends); a
//! config.json's `model_type` must be "qwen2". Its rules (the biases,
//! `use_sliding_window` refused) are `DecoderArch::Qwen2`'s in
//! spec/family/llama; the worker builds it in family/qwen2.

use super::llama::Llama;
use super::{DataSpec, ModelFamily, ModelSize};
use crate::spec::{Checker, ModelKind, ModelSpec, SpecErrors};

pub(super) struct Qwen2;

impl ModelFamily for Qwen2 {
    fn kinds(&self) -> &'static [ModelKind] {
        &[ModelKind::Qwen2]
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
