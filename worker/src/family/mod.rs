//! The model-family registry: one module or folder per family, one line
//! in [`FAMILIES`] each. A family owns, for the worker, its builder from
//! an `nn::Path` (the parameter names are the paths it creates), its
//! checks of the data's sample shape, its output contract, and its blocks
//! with their parallel plan (plan.rs). The spec's kind enum, the family's
//! typed fields, their checks and the memory estimate (accrue-common,
//! which links no libtorch) and the proto conversion keep the list of
//! names.
//!
//! A new family: a module here implementing [`Family`], its line in
//! [`FAMILIES`], and its spec side (docs/ARCHITECTURE.md, "Where a family
//! goes").

mod lenet5;
pub mod llama;
mod load;
mod mistral;
mod mlp;
pub mod model;
mod plan;
mod qwen2;
mod qwen3;
mod resnet;
mod stage_build;
pub mod tensor;
mod torchscript;

pub use plan::{check_blocks, matches, stage_units, units, Block, ParallelPlan, PlanError, Split};

use crate::error::{Error, Result, TorchContext};
use crate::spec::{ModelKind, ModelSpec};
use std::collections::HashMap;
use tch::nn::{self, ModuleT};
use tch::{CModule, Device, Kind, Tensor};

/// Tensors by name (a family's parameters and buffers, a checkpoint's
/// contents).
pub type Named = Vec<(String, tch::Tensor)>;

/// What a family's builder gives: layers on the `nn::Path` (their
/// variables live in its VarStore), or a loaded TorchScript module with
/// its own parameters.
pub enum Built {
    Layers(Box<dyn ModuleT>),
    /// Layers whose output is a linear head over features ([`Headed`]).
    Headed(Box<dyn Headed>),
    /// Layers that also run in pipeline stages ([`Staged`]).
    Staged(Box<dyn StagedLayers>),
    Script(CModule, Named),
}

/// Layers whose output is a linear head without bias over features: a
/// language model's `lm_head`. The training step may then compute the
/// head together with its loss (the worker's head_loss module) instead of
/// materializing the output; `forward_t` still gives the output.
pub trait Headed: ModuleT + Staged {
    /// The forward pass up to the head: features `[.., H]`, with their
    /// graph.
    fn features(&self, xs: &Tensor) -> Result<Tensor>;

    /// The head's weight `[outputs, H]` (a parameter; tied weights are
    /// the shared one; under tensor parallelism this rank's vocabulary
    /// rows).
    fn head_weight(&self) -> &Tensor;

    /// The head's output over `features` (the model's output whole: under
    /// tensor parallelism every rank's vocabulary columns joined), fp32.
    fn logits(&self, features: &Tensor) -> Result<Tensor> {
        let l = features
            .f_linear(self.head_weight(), None::<&Tensor>)
            .ctx("running the head")?;
        if l.kind() == Kind::Float {
            Ok(l)
        } else {
            l.f_to_kind(Kind::Float).ctx("running the head")
        }
    }

    /// Tensor parallelism (issue 42): takes this rank's geometry once its
    /// parameters hold their slices (family/tensor.rs). Families without
    /// a tensor-parallel forward refuse.
    fn split_tensor(&mut self, _place: &tensor::TensorPlace) -> Result<()> {
        Err(Error::Schedule(
            "this model has no tensor-parallel forward".into(),
        ))
    }

    /// The head's vocabulary shard under tensor parallelism (None: whole).
    fn vocab_shard(&self) -> Option<VocabShard> {
        None
    }
}

/// A head split by vocabulary rows: this rank's first row and the group
/// its cross-entropy reduces over (objective/head_loss.rs).
#[derive(Clone, Debug)]
pub struct VocabShard {
    pub start: i64,
    pub group: crate::comm::tensor_ops::TensorGroupCell,
}

/// A model that runs a range of its blocks alone: a pipeline stage
/// (issue 40; block indices as [`Family::blocks`] lists them).
pub trait Staged {
    /// The forward of blocks `blocks`: `x` is the model's input when the
    /// range begins at block 0, else what the previous stage gave; the
    /// result is what the next stage takes, or, when the range ends at the
    /// last block, the model's output (a [`Headed`] model's: the features
    /// under the head, [`Headed::features`]'s).
    fn stage_forward(&self, x: &Tensor, blocks: std::ops::Range<usize>) -> Result<Tensor>;

    /// [`Staged::stage_forward`] given the micro-batch's own inputs too
    /// (`inputs`: what the first stage takes), for a stage past the first
    /// that needs more than the hidden states: a Llama's packed rows
    /// (their positions and block-diagonal attention, issue 40). The
    /// default ignores them.
    fn stage_forward_with(
        &self,
        x: &Tensor,
        blocks: std::ops::Range<usize>,
        inputs: Option<&Tensor>,
    ) -> Result<Tensor> {
        let _ = inputs;
        self.stage_forward(x, blocks)
    }
}

/// Layers that run in stages ([`Built::Staged`]).
pub trait StagedLayers: ModuleT + Staged {}
impl<T: ModuleT + Staged> StagedLayers for T {}

/// What a builder builds: the spec, where (names and device), for
/// samples of `shape` (without the batch dimension) and `classes` outputs.
pub struct BuildTo<'a> {
    pub spec: &'a ModelSpec,
    pub root: &'a nn::Path<'a>,
    pub shape: &'a [i64],
    pub classes: i64,
}

/// One model family.
pub trait Family: Sync {
    /// The spec kinds it builds.
    fn kinds(&self) -> &'static [ModelKind];

    /// Builds the model `to` asks for (parameter names are the paths
    /// created under `to.root`), after checking that the family can take
    /// its samples.
    fn build(&self, to: &BuildTo<'_>) -> Result<Built>;

    /// Whether the builder draws initial weights (then it runs seeded
    /// under the initialisation lock); a loaded module does not.
    fn draws_weights(&self) -> bool {
        true
    }

    /// Whether the builder reports each parameter it makes
    /// ([`model::made`]), so a pipeline stage can be built without the
    /// others' storage ([`model::Model::build_stage`], issue 40).
    fn builds_by_stage(&self) -> bool {
        false
    }

    /// The probe batch: 2 samples of `shape` in the model's input type
    /// (zeros; float for the image and tensor families, token ids for a
    /// language model).
    fn probe_input(&self, shape: &[i64], device: Device) -> Result<Tensor> {
        let mut dims = vec![2];
        dims.extend_from_slice(shape);
        Tensor::f_zeros(dims.as_slice(), (Kind::Float, device)).ctx("probing the model")
    }

    /// Fits the tensors of a `model.init` file (one transformers saved) to
    /// the model's names before the strict load (`has`: whether the model
    /// has a name), as transformers' loading would; `Err` is why the file
    /// is refused. Unchanged by default.
    fn fit_init(
        &self,
        _has: &dyn Fn(&str) -> bool,
        _tensors: &mut HashMap<String, Tensor>,
    ) -> std::result::Result<(), String> {
        Ok(())
    }

    /// The model's blocks in forward order, every parameter of `params`
    /// (the built model's names) in exactly one. By default one block,
    /// `model`, holding them all; a family that knows its structure names
    /// its blocks from the spec and checks them against `params`.
    fn blocks(&self, _spec: &ModelSpec, params: &[String]) -> Result<Vec<Block>> {
        Ok(vec![Block {
            name: "model".into(),
            params: params.to_vec(),
        }])
    }

    /// Where pipeline stages may begin among [`Family::blocks`] and how
    /// each parameter splits under tensor parallelism. By default the
    /// model is one stage and nothing is split.
    /// Each parameter's slice at tensor degree `t` (issue 42), in the
    /// model's order, or an error naming what does not split. Families
    /// without a tensor-parallel forward refuse (the spec's check names
    /// those that have one).
    fn tensor_layout(&self, spec: &ModelSpec, t: usize) -> Result<Vec<(String, tensor::TpSlice)>> {
        let have: Vec<&str> = crate::spec::decoder_kinds()
            .into_iter()
            .map(ModelKind::as_str)
            .collect();
        Err(Error::ModelInput {
            model: spec.kind.to_string(),
            reason: format!(
                "has no tensor-parallel forward (parallel.tensor = {t}); the decoders have one: {}",
                have.join(", ")
            ),
        })
    }

    fn parallel_plan(&self, _spec: &ModelSpec) -> Result<ParallelPlan> {
        Ok(ParallelPlan::default())
    }

    /// The output contract, checked on the probe batch of 2 samples of
    /// `shape`: per-class logits `[2, classes]` (what the classification
    /// objective reads).
    fn check_output(
        &self,
        kind: ModelKind,
        _shape: &[i64],
        got: &[i64],
        classes: i64,
    ) -> Result<()> {
        if got.len() != 2 || got[1] != classes {
            return Err(Error::ModelOutput {
                model: kind,
                got: got.to_vec(),
                classes,
            });
        }
        Ok(())
    }
}

/// Every family, one line each.
static FAMILIES: &[&dyn Family] = &[
    &mlp::Mlp,
    &lenet5::LeNet5,
    &resnet::ResNet,
    &torchscript::TorchScript,
    &llama::Llama,
    &qwen2::QWEN2,
    &mistral::MISTRAL,
    &qwen3::QWEN3,
];

/// The family that builds `kind`.
pub fn family(kind: ModelKind) -> &'static dyn Family {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.kinds().contains(&kind))
        .unwrap_or_else(|| unreachable!("model kind {kind} has no family in the registry"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_exactly_one_family() {
        for &kind in ModelKind::ALL {
            let n = FAMILIES
                .iter()
                .filter(|f| f.kinds().contains(&kind))
                .count();
            assert_eq!(n, 1, "{kind}");
        }
    }

    /// The families without a plan of their own: one block of every
    /// parameter, one stage, nothing split (the mlp's plan: its own test).
    #[test]
    fn other_families_are_one_block_without_splits() {
        let params: Vec<String> = ["0.weight", "0.bias", "2.weight", "2.bias"]
            .map(String::from)
            .to_vec();
        for kind in [
            ModelKind::Lenet5,
            ModelKind::Resnet18,
            ModelKind::Resnet34,
            ModelKind::Torchscript,
        ] {
            let spec = ModelSpec {
                kind,
                hidden: Vec::new(),
                num_classes: None,
                path: None,
                init: None,
                fields: Default::default(),
            };
            let f = family(kind);
            let blocks = f.blocks(&spec, &params).unwrap();
            assert_eq!(
                blocks,
                [Block {
                    name: "model".into(),
                    params: params.clone()
                }]
            );
            check_blocks(&blocks, &params).unwrap();
            assert_eq!(f.parallel_plan(&spec).unwrap(), ParallelPlan::default());
        }
    }
}
