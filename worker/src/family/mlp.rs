//! `mlp`: torch.nn.Sequential(Linear, ReLU, ..., Linear) over the
//! flattened sample; parameter names as that Sequential's state_dict
//! (`0.weight`, `0.bias`, `2.weight`, ...).

use super::{BuildTo, Built, Family};
use crate::error::Result;
use crate::spec::ModelKind;
use tch::nn::{self, Module};
use tch::Tensor;

pub(super) struct Mlp;

impl Family for Mlp {
    fn kinds(&self) -> &'static [ModelKind] {
        &[ModelKind::Mlp]
    }

    fn build(&self, to: &BuildTo<'_>) -> Result<Built> {
        let root = to.root;
        let mut widths = vec![to.shape.iter().product::<i64>()];
        widths.extend_from_slice(&to.spec.hidden);
        widths.push(to.classes);
        let layers = widths
            .windows(2)
            .enumerate()
            .map(|(i, w)| nn::linear(root / (2 * i).to_string(), w[0], w[1], Default::default()))
            .collect();
        Ok(Built::Layers(Box::new(Net { layers })))
    }
}

#[derive(Debug)]
struct Net {
    layers: Vec<nn::Linear>,
}

impl Module for Net {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let mut h = xs.flatten(1, -1);
        let last = self.layers.len().saturating_sub(1);
        for (i, l) in self.layers.iter().enumerate() {
            h = h.apply(l);
            if i < last {
                h = h.relu();
            }
        }
        h
    }
}
