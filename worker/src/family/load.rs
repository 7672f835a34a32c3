//! Loading weights into a [`Model`] by PyTorch name, strictly (from a
//! `model.init` file or a checkpoint's step folder): fitted by the
//! family, checked (names, shapes), then copied; ZeRO-3 takes its chunks
//! of the parameters itself (engine/zero3/).

use super::model::Model;
use crate::error::{Error, Result, TorchContext};
use std::collections::{HashMap, HashSet};
use std::path::Path;
use tch::Tensor;

/// Where weights loaded by name come from: errors name the file
/// (`model.init`) or the checkpoint folder.
#[derive(Clone, Copy, Debug)]
pub enum WeightsFrom<'a> {
    /// `model.init`: a safetensors file.
    Init(&'a Path),
    /// A checkpoint's `step-<N>` folder.
    Checkpoint(&'a Path),
}

impl WeightsFrom<'_> {
    /// An error naming this source.
    pub fn error(&self, reason: String) -> Error {
        match *self {
            WeightsFrom::Init(path) => Error::Init {
                path: path.to_path_buf(),
                reason,
            },
            WeightsFrom::Checkpoint(path) => Error::Checkpoint {
                path: path.to_path_buf(),
                reason,
            },
        }
    }

    /// How reasons call the source ("file", "checkpoint").
    fn noun(&self) -> &'static str {
        match self {
            WeightsFrom::Init(_) => "file",
            WeightsFrom::Checkpoint(_) => "checkpoint",
        }
    }
}

/// At most this many names are listed in a message.
const NAMES_SHOWN: usize = 3;

/// `names` as `["a", "b", "c"] and 4 more`.
fn some_names(names: &[&str]) -> String {
    let shown: Vec<&str> = names.iter().take(NAMES_SHOWN).copied().collect();
    match names.len().saturating_sub(NAMES_SHOWN) {
        0 => format!("{shown:?}"),
        more => format!("{shown:?} and {more} more"),
    }
}

impl Model {
    /// Loads weights by name, strictly: every parameter and buffer must be
    /// there with the same shape, and nothing else (BatchNorm's
    /// `num_batches_tracked` aside; a `model.init` file first fitted by its
    /// family, [`crate::family::Family::fit_init`]). Weights of another
    /// architecture are refused naming their source (the `model.init` file
    /// or the checkpoint folder) and the first difference in the model's
    /// order, with shapes.
    pub fn load_named(
        &mut self,
        from: WeightsFrom<'_>,
        tensors: Vec<(String, Tensor)>,
    ) -> Result<()> {
        let mut by_name = self.fit_named(from, tensors)?;
        self.copy_named(from, &mut by_name, true)
    }

    /// [`Model::load_named`]'s checks: `tensors` fitted (a `model.init`
    /// file by its family) and refused unless they are exactly this
    /// model's; returns them by name, another stage's parameters left out.
    pub fn fit_named(
        &self,
        from: WeightsFrom<'_>,
        tensors: Vec<(String, Tensor)>,
    ) -> Result<HashMap<String, Tensor>> {
        let mut by_name: HashMap<String, Tensor> = tensors.into_iter().collect();
        if let WeightsFrom::Init(_) = from {
            // The whole model's names (a pipeline stage's frozen and
            // shared ones too): what the file fits is the model's.
            let ours: HashSet<&str> = self.shapes().into_iter().map(|(n, _)| n).collect();
            crate::family::family(self.kind)
                .fit_init(&|n| ours.contains(n), &mut by_name)
                .map_err(|reason| from.error(reason))?;
        }
        if let Some(reason) = self.mismatch(from.noun(), &by_name) {
            return Err(from.error(reason));
        }
        // Another stage's parameters are that stage's to load.
        for (name, _) in &self.frozen {
            by_name.remove(name);
        }
        // Tensor parallelism: this rank's slices of the whole tensors.
        if let Some(split) = &self.tensor_split {
            for (name, t) in by_name.iter_mut() {
                if let Some(slice) = split.slices.get(name) {
                    *t = crate::family::tensor::take(t, slice, split.rank)
                        .ctx("cutting the weights for tensor parallelism")?;
                }
            }
        }
        Ok(by_name)
    }

    /// Copies what [`Model::fit_named`] gave into the shared parameters
    /// and buffers, and with `params` into the parameters (ZeRO-3 takes
    /// its chunks of them itself).
    pub fn copy_named(
        &mut self,
        from: WeightsFrom<'_>,
        by_name: &mut HashMap<String, Tensor>,
        params: bool,
    ) -> Result<()> {
        let err = |reason: String| from.error(reason);
        let _guard = tch::no_grad_guard();
        let params = if params {
            &mut self.params[..]
        } else {
            &mut []
        };
        for (name, t) in params
            .iter_mut()
            .chain(self.shared.iter_mut())
            .chain(self.buffers.iter_mut())
        {
            let src = by_name
                .remove(name)
                .ok_or_else(|| err(format!("{name} vanished")))?;
            let src = src
                .f_to_kind(t.kind())
                .and_then(|s| s.f_to_device(t.device()))
                .ctx("loading weights")?;
            t.f_copy_(&src).ctx("loading weights")?;
        }
        Ok(())
    }

    /// Why `by_name` does not fit this model (None: it does): the first
    /// difference in the model's order ("2.weight: file [4, 15], model
    /// [4, 16]"), then the names missing and unexpected, or how many
    /// shapes differ. `noun` names the source ("file", "checkpoint").
    fn mismatch(&self, noun: &str, by_name: &HashMap<String, Tensor>) -> Option<String> {
        let shapes = self.shapes();
        let ours: HashSet<&str> = shapes.iter().map(|(n, _)| *n).collect();
        let mut unexpected: Vec<&str> = by_name
            .keys()
            .map(String::as_str)
            .filter(|k| !ours.contains(k) && !k.ends_with("num_batches_tracked"))
            .collect();
        unexpected.sort_unstable();
        let missing: Vec<&str> = shapes
            .iter()
            .map(|(n, _)| *n)
            .filter(|n| !by_name.contains_key(*n))
            .collect();
        let reshaped = shapes
            .iter()
            .filter(|(n, s)| by_name.get(*n).is_some_and(|src| src.size() != *s))
            .count();
        let first = shapes
            .iter()
            .find_map(|(n, s)| match by_name.get(*n) {
                None => Some(format!("{n}: {noun} has none, model {s:?}")),
                Some(src) if src.size() != *s => {
                    Some(format!("{n}: {noun} {:?}, model {s:?}", src.size()))
                }
                Some(_) => None,
            })
            .or_else(|| {
                let n = unexpected.first()?;
                let size = by_name.get(*n).map(Tensor::size).unwrap_or_default();
                Some(format!("{n}: {noun} {size:?}, model has none"))
            })?;
        let detail = if !missing.is_empty() || !unexpected.is_empty() {
            format!(
                " (missing {}, unexpected {})",
                some_names(&missing),
                some_names(&unexpected)
            )
        } else if reshaped > 1 {
            format!(" ({reshaped} of {} tensors differ in shape)", ours.len())
        } else {
            String::new()
        };
        Some(format!(
            "another architecture than the {} model: first difference {first}{detail}",
            self.kind
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_name_lists_are_cut() {
        assert_eq!(some_names(&["a", "b"]), r#"["a", "b"]"#);
        assert_eq!(
            some_names(&["a", "b", "c", "d", "e"]),
            r#"["a", "b", "c"] and 2 more"#
        );
    }
}
