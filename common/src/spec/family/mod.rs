//! The spec side of the model-family registry: one module per family, one
//! line in [`FAMILIES`] each. A family owns the checks of the model fields
//! whose rule depends on the kind (`model.hidden`, `model.path`, the llama
//! fields) and its parameter count for the memory estimate; the worker's
//! `family` modules own its builder, output contract and parameter names.
//! The kind enum (kinds.rs) and the proto conversion keep the list of
//! names.
//!
//! A new family: a module here implementing [`ModelFamily`], its line in
//! [`FAMILIES`], its name in `ModelKind` and the proto enum, and its
//! worker module.

mod lenet5;
mod llama;
mod mlp;
mod resnet;
mod torchscript;

use super::{Checker, DataSpec, ModelKind, ModelSpec, SpecErrors};
pub use llama::LlamaConfig;
use std::path::Path;

/// A model's size as the memory estimate counts it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct ModelSize {
    /// Parameters (f32 each).
    pub parameters: u64,
    /// Activations per sample the estimate counts (an MLP's; the others'
    /// are not estimated).
    pub activations: u64,
}

/// One model family, as the spec sees it.
pub(super) trait ModelFamily: Sync {
    /// The spec kinds it builds.
    fn kinds(&self) -> &'static [ModelKind];

    /// `model.hidden` (its widths and count are checked for every kind
    /// before): refused unless the family takes it.
    fn check_hidden(&self, hidden: &[i64], c: &mut Checker) {
        if !hidden.is_empty() {
            c.fail("model.hidden", hidden, "only allowed with model.kind = mlp");
        }
    }

    /// `model.path`: refused unless the family loads its module from a file.
    fn check_path(&self, path: Option<&Path>, c: &mut Checker) {
        if let Some(p) = path {
            c.fail(
                "model.path",
                p.display().to_string(),
                "only allowed with model.kind = torchscript",
            );
        }
    }

    /// The family's own model fields (the llama ones), with the data they
    /// depend on: refused unless the family takes them.
    fn check_fields(&self, model: &ModelSpec, _data: &DataSpec, c: &mut Checker) {
        llama::refuse_llama_fields(model, c);
    }

    /// The size of `model` for samples of `shape` (without the batch
    /// dimension) and `classes` outputs; zero where the spec does not say.
    fn size(&self, model: &ModelSpec, shape: &[u64], classes: u64) -> ModelSize;

    /// Refuses a model whose size cannot be known from the files this
    /// host sees (a `config.json` that exists here but cannot be read or
    /// resolved): checked before [`ModelFamily::size`], which counts such
    /// a model as zero.
    fn check_sizable(&self, _model: &ModelSpec) -> Result<(), SpecErrors> {
        Ok(())
    }
}

/// Every family, one line each.
static FAMILIES: &[&dyn ModelFamily] = &[
    &mlp::Mlp,
    &lenet5::LeNet5,
    &resnet::ResNet,
    &torchscript::TorchScript,
    &llama::Llama,
];

/// The family that builds `kind`.
pub(super) fn family(kind: ModelKind) -> &'static dyn ModelFamily {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.kinds().contains(&kind))
        .unwrap_or_else(|| unreachable!("model kind {kind} has no family in the registry"))
}

/// Values in a sample of `shape` (saturating).
pub(super) fn numel(shape: &[u64]) -> u64 {
    shape.iter().fold(1u64, |a, &x| a.saturating_mul(x))
}

/// Parameters of a fully connected layer from `i` to `o` (weight and bias).
fn layer(i: u64, o: u64) -> u64 {
    i.saturating_mul(o).saturating_add(o)
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
            assert!(family(kind).kinds().contains(&kind), "{kind}");
        }
    }
}
