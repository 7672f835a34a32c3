//! `resnet18`, `resnet34`: tch's torchvision ResNets, with torchvision's
//! parameter names (`conv1.weight`, `layer1.0.bn1.running_mean`, `fc.bias`).

use super::{BuildTo, Built, Family};
use crate::error::{Error, Result};
use crate::spec::ModelKind;

pub(super) struct ResNet;

impl Family for ResNet {
    fn kinds(&self) -> &'static [ModelKind] {
        &[ModelKind::Resnet18, ModelKind::Resnet34]
    }

    fn build(&self, to: &BuildTo<'_>) -> Result<Built> {
        let (kind, shape, classes) = (to.spec.kind, to.shape, to.classes);
        if shape.len() != 3 || shape[0] != 3 {
            return Err(Error::ModelInput {
                model: kind.to_string(),
                reason: format!("needs 3-channel images [3, H, W], the data has shape {shape:?}"),
            });
        }
        Ok(Built::Layers(if kind == ModelKind::Resnet18 {
            Box::new(tch::vision::resnet::resnet18(to.root, classes))
        } else {
            Box::new(tch::vision::resnet::resnet34(to.root, classes))
        }))
    }
}
