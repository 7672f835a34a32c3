//! `resnet18`, `resnet34`: torchvision's ResNets.

use super::{layer, ModelFamily, ModelSize};
use crate::spec::{ModelKind, ModelSpec};

/// Parameters of ResNet-18/34 without the final fully connected layer
/// (torchvision's counts, 11,689,512 and 21,797,672, less 512 * 1000 + 1000).
const RESNET18_BODY: u64 = 11_176_512;
const RESNET34_BODY: u64 = 21_284_672;

pub(super) struct ResNet;

impl ModelFamily for ResNet {
    fn kinds(&self) -> &'static [ModelKind] {
        &[ModelKind::Resnet18, ModelKind::Resnet34]
    }

    fn size(&self, model: &ModelSpec, _shape: &[u64], classes: u64) -> ModelSize {
        let body = if model.kind == ModelKind::Resnet18 {
            RESNET18_BODY
        } else {
            RESNET34_BODY
        };
        ModelSize {
            parameters: body.saturating_add(layer(512, classes)),
            activations: 0,
            largest_unit: 0,
            ..ModelSize::default()
        }
    }
}
