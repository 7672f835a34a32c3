//! Mistral (transformers' `MistralForCausalLM`, issue 39): the Llama network
//! (family/llama) built from a config whose decoder is Mistral: no biases,
//! and attention within its `sliding_window` (the mask transformers builds,
//! also over the KV cache of `accrue sample`); names, blocks and plan Llama's.

use crate::error::Result;
use crate::family::llama::Llama;
use crate::family::{Block, BuildTo, Built, Family, ParallelPlan};
use crate::spec::{ModelKind, ModelSpec};
use std::collections::HashMap;
use tch::{Device, Tensor};

pub(in crate::family) struct Mistral;

impl Family for Mistral {
    fn kinds(&self) -> &'static [ModelKind] {
        &[ModelKind::Mistral]
    }

    fn build(&self, to: &BuildTo<'_>) -> Result<Built> {
        Llama.build(to)
    }

    fn probe_input(&self, shape: &[i64], device: Device) -> Result<Tensor> {
        Llama.probe_input(shape, device)
    }

    fn fit_init(
        &self,
        has: &dyn Fn(&str) -> bool,
        tensors: &mut HashMap<String, Tensor>,
    ) -> std::result::Result<(), String> {
        Llama.fit_init(has, tensors)
    }

    fn blocks(&self, spec: &ModelSpec, params: &[String]) -> Result<Vec<Block>> {
        Llama.blocks(spec, params)
    }

    fn parallel_plan(&self, spec: &ModelSpec) -> Result<ParallelPlan> {
        Llama.parallel_plan(spec)
    }

    fn check_output(
        &self,
        kind: ModelKind,
        shape: &[i64],
        got: &[i64],
        classes: i64,
    ) -> Result<()> {
        Llama.check_output(kind, shape, got, classes)
    }
}
