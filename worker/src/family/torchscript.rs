//! `torchscript`: a user's module saved with torch.jit.save, loaded from
//! `model.path` on the job's device and trained through libtorch; its
//! names are its own `named_parameters()`.

use super::{BuildTo, Built, Family};
use crate::error::{torch_text, Error, Result, TorchContext};
use crate::spec::ModelKind;
use tch::CModule;

pub(super) struct TorchScript;

impl Family for TorchScript {
    fn kinds(&self) -> &'static [ModelKind] {
        &[ModelKind::Torchscript]
    }

    fn draws_weights(&self) -> bool {
        false
    }

    fn build(&self, to: &BuildTo<'_>) -> Result<Built> {
        let path = to.spec.path.clone().unwrap_or_default();
        let field = |reason: String| Error::Field {
            field: "model.path",
            value: format!("\"{}\"", path.display()),
            reason,
        };
        let module = CModule::load_on_device(&path, to.root.device()).map_err(|e| {
            field(format!(
                "not a TorchScript module libtorch can load (save one with torch.jit.save): {}",
                torch_text("loading the TorchScript module", &e)
            ))
        })?;
        let params = module
            .named_parameters()
            .ctx("listing TorchScript parameters")?;
        if params.is_empty() {
            return Err(field(
                "the TorchScript module has no parameters to train (named_parameters() is empty)"
                    .into(),
            ));
        }
        let params = params
            .into_iter()
            .map(|(n, t)| {
                Ok((
                    n,
                    if t.requires_grad() {
                        t
                    } else {
                        t.f_set_requires_grad(true).ctx("enabling gradients")?
                    },
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Built::Script(module, params))
    }
}
