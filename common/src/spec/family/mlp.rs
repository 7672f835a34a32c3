//! `mlp`: fully connected layers of `model.hidden` widths (the one family
//! that takes `model.hidden`), ReLU between them.

use super::{layer, numel, ModelFamily, ModelSize};
use crate::spec::{Checker, ModelKind, ModelSpec};

pub(super) struct Mlp;

impl ModelFamily for Mlp {
    fn kinds(&self) -> &'static [ModelKind] {
        &[ModelKind::Mlp]
    }

    /// Any widths (checked for every kind), none included.
    fn check_hidden(&self, _hidden: &[i64], _c: &mut Checker) {}

    fn size(&self, model: &ModelSpec, shape: &[u64], classes: u64) -> ModelSize {
        let mut widths = vec![numel(shape)];
        widths.extend(model.hidden.iter().map(|&h| h.max(0) as u64));
        widths.push(classes);
        ModelSize {
            parameters: widths
                .windows(2)
                .fold(0u64, |a, w| a.saturating_add(layer(w[0], w[1]))),
            activations: widths[1..].iter().fold(0u64, |a, &w| a.saturating_add(w)),
            largest_unit: widths
                .windows(2)
                .map(|w| layer(w[0], w[1]))
                .max()
                .unwrap_or(0),
            ..ModelSize::default()
        }
    }
}
