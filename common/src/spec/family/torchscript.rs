//! `torchscript`: a user's module saved with torch.jit.save, loaded from
//! `model.path` (the one family that takes it, and requires it). Its size
//! is in the file, which its loader checks: the estimate counts none.

use super::{ModelFamily, ModelSize};
use crate::spec::{Checker, ModelKind, ModelSpec};
use std::path::Path;

pub(super) struct TorchScript;

impl ModelFamily for TorchScript {
    fn kinds(&self) -> &'static [ModelKind] {
        &[ModelKind::Torchscript]
    }

    fn check_path(&self, path: Option<&Path>, c: &mut Checker) {
        match path {
            None => c.fail(
                "model.path",
                "(missing)",
                "required for model.kind = torchscript",
            ),
            Some(p) => c.file_exists("model.path", p),
        }
    }

    fn size(&self, _model: &ModelSpec, _shape: &[u64], _classes: u64) -> ModelSize {
        ModelSize::default()
    }
}
