//! `lenet5`: LeNet-5 (conv1 padded by 2, so 28x28 inputs work like the
//! original 32x32).

use super::{layer, ModelFamily, ModelSize};
use crate::spec::{ModelKind, ModelSpec};

pub(super) struct LeNet5;

impl ModelFamily for LeNet5 {
    fn kinds(&self) -> &'static [ModelKind] {
        &[ModelKind::Lenet5]
    }

    fn size(&self, _model: &ModelSpec, shape: &[u64], classes: u64) -> ModelSize {
        let (c, h, w) = match shape {
            [c, h, w] => (*c, *h, *w),
            _ => (1, 28, 28),
        };
        let side = |s: u64| ((s / 2).saturating_sub(4)) / 2;
        let feat = 16u64.saturating_mul(side(h)).saturating_mul(side(w));
        ModelSize {
            parameters: layer(c.saturating_mul(25), 6)
                .saturating_add(layer(150, 16))
                .saturating_add(layer(feat, 120))
                .saturating_add(layer(120, 84))
                .saturating_add(layer(84, classes)),
            activations: 0,
            largest_unit: 0,
            ..ModelSize::default()
        }
    }
}
