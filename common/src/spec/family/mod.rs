//! The spec side of the model-family registry: one folder or module per
//! family, one line in [`registry!`] each. A family owns its typed
//! `[model]` fields (a struct of [`FieldSet`], held in
//! [`FamilyFields`]: `model.fields.llama`), the checks of the model fields
//! whose rule depends on the kind (`model.hidden`, `model.path`, its own
//! fields) and its size for the memory estimate; the worker's `family`
//! modules own its builder, parameter names, blocks and parallel plan.
//! The kind enum (kinds.rs) and the proto enum keep the list of names.
//!
//! A new family: a folder here implementing [`ModelFamily`] (with its
//! field struct, declared with `spec_fields!`, when it has fields of its
//! own), its line in [`registry!`], its name in `ModelKind` and the proto
//! enum, its line in the proto conversion's registry when it has fields,
//! and its worker folder (docs/ARCHITECTURE.md, "Where a family goes").

mod fields;
mod lenet5;
mod llama;
mod mistral;
mod mlp;
mod qwen2;
mod qwen3;
mod resnet;
mod torchscript;

use super::{Checker, DataSpec, ModelKind, ModelSpec, SpecErrors};
pub use fields::FieldSet;
pub use llama::{Decoder, DecoderArch, LlamaConfig, LlamaSpec, RopeScaling, Window};
use serde::de::MapAccess;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// Declares the registry: [`FAMILIES`], and [`FamilyFields`] with a
/// field per family that has fields of its own (`family { set: Type }`).
macro_rules! registry {
    ($($family:path $({ $set:ident: $fields:ty })?),+ $(,)?) => {
        /// Every family.
        static FAMILIES: &[&dyn ModelFamily] = &[$(&$family),+];

        /// Every family's own `[model]` fields, one typed struct per family
        /// that has any (`model.fields.llama`). In TOML they stand flat in
        /// `[model]`, beside `kind`: the struct's field names are the keys.
        #[derive(Clone, Debug, Default, PartialEq, Serialize)]
        pub struct FamilyFields {
            $($(
                #[doc = concat!("The `", stringify!($set), "` field set.")]
                #[serde(flatten)]
                pub $set: $fields,
            )?)+
        }

        impl FamilyFields {
            /// Every family field's key, set by set in the registry's order.
            pub fn names() -> Vec<&'static str> {
                let mut names = Vec::new();
                $($(names.extend_from_slice(<$fields as FieldSet>::NAMES);)?)+
                names
            }

            /// Every field set: its name and the family that declares it.
            #[cfg(test)]
            fn sets() -> Vec<(&'static str, &'static dyn ModelFamily)> {
                vec![$($((stringify!($set), &$family as &'static dyn ModelFamily),)?)+]
            }

            /// The fields given: (their set's name, the key).
            fn given(&self) -> Vec<(&'static str, &'static str)> {
                let mut given = Vec::new();
                $($(given.extend(self.$set.given().into_iter().map(|k| (stringify!($set), k)));)?)+
                given
            }

            /// Every set's path fields (`model.<key>`, the value).
            pub fn paths(&self) -> Vec<(&'static str, Option<&Path>)> {
                let mut paths = Vec::new();
                $($(paths.extend(self.$set.paths());)?)+
                paths
            }

            /// [`FamilyFields::paths`], to replace them.
            pub fn paths_mut(&mut self) -> Vec<(&'static str, &mut Option<PathBuf>)> {
                let mut paths = Vec::new();
                $($(paths.extend(self.$set.paths_mut());)?)+
                paths
            }

            /// Reads `key`'s value from `map` into the set that has the
            /// key; whether one had it.
            pub(crate) fn take<'de, A: MapAccess<'de>>(
                &mut self,
                key: &str,
                map: &mut A,
            ) -> Result<bool, A::Error> {
                $($(
                    if self.$set.take(key, map)? {
                        return Ok(true);
                    }
                )?)+
                Ok(false)
            }
        }
    };
}

// Every family, one line each: the family, and its own field set (the
// field of `FamilyFields` and its struct) when it has one.
registry! {
    mlp::Mlp,
    lenet5::LeNet5,
    resnet::ResNet,
    torchscript::TorchScript,
    llama::Llama { llama: llama::LlamaSpec },
    qwen2::QWEN2,
    mistral::MISTRAL,
    qwen3::QWEN3,
}

/// A model's size as the memory estimate counts it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct ModelSize {
    /// Parameters (f32 each).
    pub parameters: u64,
    /// Activations per sample the estimate counts (an MLP's; the others'
    /// are not estimated).
    pub activations: u64,
    /// The parameters of the largest pipeline unit (issue 40: a Llama's
    /// embedding with its first layer, or its last layer with the final
    /// norm and head; an mlp's largest layer); 0 for a family without
    /// stages.
    pub largest_unit: u64,
    /// Blocks whose activations activation checkpointing recomputes (a
    /// Llama's decoder layers; 0: none counted).
    pub layers: u64,
    /// One such block's saved activations per sample, f32 elements (under
    /// bf16 or fp16 autocast about half as many bytes).
    pub layer_activations: u64,
    /// One block's input per sample, f32 elements (what checkpointing
    /// keeps of each recomputed segment).
    pub layer_input: u64,
}

/// One model family, as the spec sees it.
pub(super) trait ModelFamily: Sync {
    /// The spec kinds it builds.
    fn kinds(&self) -> &'static [ModelKind];

    /// A decoder-only language model on the Llama layout: its
    /// transformers names and rules (None: not one).
    fn decoder(&self) -> Option<&'static Decoder> {
        None
    }

    /// The field sets of [`FamilyFields`] it reads (its own, and those of
    /// a family it extends); a field of another set is refused.
    fn field_sets(&self) -> &'static [&'static str] {
        &[]
    }

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

    /// The family's own fields (of its [`ModelFamily::field_sets`]), with
    /// the data they depend on.
    fn check_fields(&self, _model: &ModelSpec, _data: &DataSpec, _c: &mut Checker) {}

    /// The outputs per sample its own fields give (a language model's
    /// vocabulary), which the memory estimate counts as the classes of
    /// token data; `None`: the data's.
    fn classes(&self, _model: &ModelSpec) -> Option<i64> {
        None
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

/// The family that builds `kind`.
pub(super) fn family(kind: ModelKind) -> &'static dyn ModelFamily {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.kinds().contains(&kind))
        .unwrap_or_else(|| unreachable!("model kind {kind} has no family in the registry"))
}

/// Every decoder family's [`Decoder`], in the registry's order.
pub(in crate::spec) fn decoders() -> impl Iterator<Item = &'static Decoder> {
    FAMILIES.iter().filter_map(|f| f.decoder())
}

/// The kinds of the decoder families, in the registry's order, for
/// messages ("the families that do: llama, qwen2, ...").
pub fn decoder_kinds() -> Vec<ModelKind> {
    decoders().map(|d| d.kind).collect()
}

impl ModelKind {
    /// Whether it is a decoder-only language model (the Llama layout and
    /// the families that extend it): trained on token data, its classes
    /// the vocabulary. The family registry says.
    pub fn is_decoder(self) -> bool {
        family(self).decoder().is_some()
    }
}

/// The decoder kinds and `more`, for messages: "llama, qwen2, mistral, mlp".
pub(in crate::spec) fn decoders_and(more: &[ModelKind]) -> String {
    let names: Vec<&str> = decoder_kinds()
        .into_iter()
        .chain(more.iter().copied())
        .map(ModelKind::as_str)
        .collect();
    names.join(", ")
}

/// The decoder kinds as alternatives, for messages: "llama, qwen2 or mistral".
pub(in crate::spec) fn any_decoder() -> String {
    let names: Vec<&str> = decoder_kinds().into_iter().map(ModelKind::as_str).collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => names.join(""),
    }
}

/// Refuses the fields of a set that the family of `model.kind` does not
/// read (`model.vocab_size` with an mlp), as `model.hidden`'s rule does:
/// each one names the kinds that take it.
pub(super) fn refuse_foreign_fields(model: &ModelSpec, c: &mut Checker) {
    let reads = family(model.kind).field_sets();
    for (set, key) in model.fields.given() {
        if reads.contains(&set) {
            continue;
        }
        let kinds: Vec<&str> = FAMILIES
            .iter()
            .filter(|f| f.field_sets().contains(&set))
            .flat_map(|f| f.kinds().iter().map(|k| k.as_str()))
            .collect();
        c.fail(
            &format!("model.{key}"),
            "(set)",
            format!("only allowed with model.kind = {}", kinds.join(" or ")),
        );
    }
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
    use crate::spec::model::GENERIC_FIELDS;

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

    #[test]
    fn every_field_set_is_read_by_the_family_declaring_it() {
        for (set, owner) in FamilyFields::sets() {
            assert!(owner.field_sets().contains(&set), "{set}");
        }
        let declared: Vec<&str> = FamilyFields::sets().iter().map(|(s, _)| *s).collect();
        for f in FAMILIES {
            for set in f.field_sets() {
                assert!(declared.contains(set), "{set} of {:?}", f.kinds());
            }
        }
    }

    #[test]
    fn no_two_fields_share_a_key() {
        let mut keys: Vec<&str> = GENERIC_FIELDS.to_vec();
        keys.extend(FamilyFields::names());
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), keys.len(), "{keys:?}");
    }
}
