//! `lenet5`: LeNet-5 with ReLU and max-pooling; conv1 pads by 2 so 28x28
//! inputs work like the original 32x32. Names `conv1`, `conv2`, `fc1`..`fc3`
//! (`.weight`, `.bias`). The PyTorch twin is in docs/SEMANTICS.md.

use super::{BuildTo, Built, Family};
use crate::error::{Error, Result};
use crate::spec::ModelKind;
use tch::nn::{self, Module};
use tch::Tensor;

pub(super) struct LeNet5;

impl Family for LeNet5 {
    fn kinds(&self) -> &'static [ModelKind] {
        &[ModelKind::Lenet5]
    }

    fn build(&self, to: &BuildTo<'_>) -> Result<Built> {
        let (root, shape, classes) = (to.root, to.shape, to.classes);
        let (c, h, w) = match shape {
            [c, h, w] => (*c, *h, *w),
            _ => {
                return Err(Error::ModelInput {
                    model: "lenet5".into(),
                    reason: format!("needs image samples [C, H, W], the data has shape {shape:?}"),
                })
            }
        };
        let feat = features(h, w);
        if feat == 0 {
            return Err(Error::ModelInput {
                model: "lenet5".into(),
                reason: format!(
                    "needs images of at least 12x12, the data has {h}x{w} \
                     (use model.kind = \"mlp\" for small inputs)"
                ),
            });
        }
        let conv = |p, i, o, pad| {
            nn::conv2d(
                p,
                i,
                o,
                5,
                nn::ConvConfig {
                    padding: pad,
                    ..Default::default()
                },
            )
        };
        Ok(Built::Layers(Box::new(Net {
            conv1: conv(root / "conv1", c, 6, 2),
            conv2: conv(root / "conv2", 6, 16, 0),
            fc1: nn::linear(root / "fc1", feat, 120, Default::default()),
            fc2: nn::linear(root / "fc2", 120, 84, Default::default()),
            fc3: nn::linear(root / "fc3", 84, classes, Default::default()),
        })))
    }
}

#[derive(Debug)]
struct Net {
    conv1: nn::Conv2D,
    conv2: nn::Conv2D,
    fc1: nn::Linear,
    fc2: nn::Linear,
    fc3: nn::Linear,
}

impl Module for Net {
    fn forward(&self, xs: &Tensor) -> Tensor {
        xs.apply(&self.conv1)
            .relu()
            .max_pool2d_default(2)
            .apply(&self.conv2)
            .relu()
            .max_pool2d_default(2)
            .flatten(1, -1)
            .apply(&self.fc1)
            .relu()
            .apply(&self.fc2)
            .relu()
            .apply(&self.fc3)
    }
}

/// fc1's input width for h x w images (0: too small).
fn features(h: i64, w: i64) -> i64 {
    let side = |s: i64| ((s / 2) - 4) / 2;
    16 * side(h).max(0) * side(w).max(0)
}
