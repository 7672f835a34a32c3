//! Qwen2 (transformers' `Qwen2ForCausalLM`, issue 39): the Llama network
//! (family/llama) built from a config whose decoder is Qwen2, which gives
//! q_proj, k_proj and v_proj their biases and o_proj none; the names,
//! blocks and parallel plan are Llama's with those biases.

use crate::error::Result;
use crate::family::llama::Llama;
use crate::family::{Block, BuildTo, Built, Family, ParallelPlan};
use crate::spec::{ModelKind, ModelSpec};
use std::collections::HashMap;
use tch::{Device, Tensor};

pub(in crate::family) struct Qwen2;

impl Family for Qwen2 {
    fn kinds(&self) -> &'static [ModelKind] {
        &[ModelKind::Qwen2]
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
