//! The sync step's decision on the window's gradients, once the norm is
//! known: skip the step (no loss terms, an fp16 overflow, non-finite
//! gradients) or fail (`clipping.on_nonfinite = "error"`), else what they
//! go through before the optimizer (1/divisor and the clip, as one
//! multiplier where possible) and the clip coefficient reported.

use crate::error::{Error, Result};
use crate::optim::GradPrep;
use crate::spec::{ClippingSpec, Normalize, OnNonfinite};

/// What `accumulation.normalize` divides the window's summed gradients
/// by: the loss terms over every rank (`global_count`), the non-empty
/// micro-batches over every rank (`mean`), or the data ranks (`sum`).
pub(super) fn divisor(normalize: Normalize, count: u64, batches: u64, world: f64) -> f64 {
    match normalize {
        Normalize::GlobalCount => count as f64,
        Normalize::Mean => batches as f64,
        Normalize::Sum => world,
    }
}

/// Why a sync step took no optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Skip {
    /// No loss term in the window on any rank (N = 0).
    NoTerms,
    /// Non-finite fp16 gradients: GradScaler's skip, the scale (this
    /// window's) backs off.
    Overflow { loss_scale: f32 },
    /// Non-finite gradients under `clipping.on_nonfinite = "skip"`.
    NonFinite,
}

impl Skip {
    /// The step report's skip reason.
    pub(super) fn reason(self) -> &'static str {
        match self {
            Skip::NoTerms => "no loss terms",
            Skip::Overflow { .. } => "fp16 overflow",
            Skip::NonFinite => "non-finite gradients",
        }
    }
}

/// What the sync step does with the window's gradients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Decision {
    /// What the gradients go through before the optimizer (None: the step
    /// is skipped).
    pub prep: Option<GradPrep>,
    /// clip_grad_norm_'s coefficient (1 without `max_norm` or when skipped).
    pub clip_coef: f64,
    pub skip: Option<Skip>,
}

/// Decides the step from the window's `divisor` (0: no loss terms), the
/// norm of the normalized gradients `grad_norm`, the clipping settings and
/// the fp16 loss scale (None: no scaler). A non-finite norm without a scaler
/// under `on_nonfinite = "error"` is [`Error::NonFinite`] naming `step + 1`
/// (the step being taken).
pub(super) fn decide(
    divisor: f64,
    grad_norm: f64,
    clipping: &ClippingSpec,
    loss_scale: Option<f32>,
    step: u64,
) -> Result<Decision> {
    let skip = |skip| Decision {
        prep: None,
        clip_coef: 1.0,
        skip: Some(skip),
    };
    let step_with = |prep, clip_coef| Decision {
        prep: Some(prep),
        clip_coef,
        skip: None,
    };
    if divisor == 0.0 {
        return Ok(skip(Skip::NoTerms));
    }
    if !grad_norm.is_finite() {
        if let Some(loss_scale) = loss_scale {
            return Ok(skip(Skip::Overflow { loss_scale }));
        }
        return match clipping.on_nonfinite {
            OnNonfinite::Skip => Ok(skip(Skip::NonFinite)),
            OnNonfinite::Error => Err(Error::NonFinite {
                step: step + 1,
                norm: grad_norm,
            }),
        };
    }
    Ok(if let Some(max_norm) = clipping.max_norm {
        // clip_grad_norm_: min(1, max_norm / (total_norm + 1e-6)).
        let clip_coef = (max_norm / (grad_norm + 1e-6)).min(1.0);
        step_with(GradPrep::Mul((clip_coef / divisor) as f32), clip_coef)
    } else if let Some(v) = clipping.clip_value {
        step_with(GradPrep::DivClamp(divisor as f32, v as f32), 1.0)
    } else {
        step_with(GradPrep::Div(divisor as f32), 1.0)
    })
}

/// The log line of a skipped step (`step`: the last committed).
pub(super) fn log_skip(skip: Skip, step: u64, grad_norm: f64) {
    match skip {
        Skip::NoTerms => tracing::info!(
            step = step + 1,
            "no loss term in the window on any rank (N = 0): step skipped"
        ),
        Skip::Overflow { loss_scale } => tracing::info!(
            step = step + 1,
            loss_scale,
            "non-finite fp16 gradients: step skipped, loss scale backs off"
        ),
        Skip::NonFinite => tracing::warn!(
            step = step + 1,
            grad_norm,
            "non-finite gradient norm, step skipped"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clipping(max_norm: Option<f64>, clip_value: Option<f64>, error: bool) -> ClippingSpec {
        ClippingSpec {
            max_norm,
            clip_value,
            on_nonfinite: if error {
                OnNonfinite::Error
            } else {
                OnNonfinite::Skip
            },
            ..Default::default()
        }
    }

    #[test]
    fn the_divisor_is_the_terms_the_batches_or_the_ranks() {
        assert_eq!(divisor(Normalize::GlobalCount, 37, 5, 2.0), 37.0);
        assert_eq!(divisor(Normalize::Mean, 37, 5, 2.0), 5.0);
        assert_eq!(divisor(Normalize::Sum, 37, 5, 2.0), 2.0);
        // No terms anywhere: 0, the step skips (decide).
        assert_eq!(divisor(Normalize::GlobalCount, 0, 0, 2.0), 0.0);
    }

    #[test]
    fn a_finite_norm_divides_then_clips_as_clip_grad_norm_or_clip_grad_value() {
        let none = clipping(None, None, false);
        let d = decide(4.0, 2.0, &none, None, 0).unwrap();
        assert_eq!(d.prep, Some(GradPrep::Div(4.0)));
        assert_eq!((d.clip_coef, d.skip), (1.0, None));
        // Above max_norm: min(1, 1 / (2 + 1e-6)), folded with 1/4.
        let d = decide(4.0, 2.0, &clipping(Some(1.0), None, false), None, 0).unwrap();
        let coef = 1.0 / (2.0 + 1e-6);
        assert_eq!(d.clip_coef, coef);
        assert_eq!(d.prep, Some(GradPrep::Mul((coef / 4.0) as f32)));
        // Below it: the coefficient is 1, the multiplier 1/divisor.
        let d = decide(4.0, 2.0, &clipping(Some(10.0), None, false), None, 0).unwrap();
        assert_eq!((d.clip_coef, d.prep), (1.0, Some(GradPrep::Mul(0.25))));
        let d = decide(4.0, 2.0, &clipping(None, Some(0.5), false), Some(8.0), 0).unwrap();
        assert_eq!(d.prep, Some(GradPrep::DivClamp(4.0, 0.5)));
        // max_norm is applied before clip_value is looked at.
        let d = decide(4.0, 2.0, &clipping(Some(1.0), Some(0.5), false), None, 0).unwrap();
        assert!(matches!(d.prep, Some(GradPrep::Mul(_))), "{d:?}");
    }

    #[test]
    fn no_terms_skip_before_the_norm_is_looked_at() {
        for norm in [0.0, f64::NAN, f64::INFINITY] {
            for scale in [None, Some(65536.0)] {
                let d = decide(0.0, norm, &clipping(Some(1.0), None, true), scale, 3).unwrap();
                assert_eq!(d.skip, Some(Skip::NoTerms));
                assert_eq!((d.prep, d.clip_coef), (None, 1.0));
            }
        }
        assert_eq!(Skip::NoTerms.reason(), "no loss terms");
    }

    #[test]
    fn a_non_finite_norm_is_an_overflow_under_fp16_else_the_settings_skip_or_error() {
        for norm in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            // GradScaler's skip whatever on_nonfinite says.
            let d = decide(2.0, norm, &clipping(Some(1.0), None, true), Some(4.0), 0).unwrap();
            let overflow = Skip::Overflow { loss_scale: 4.0 };
            assert_eq!((d.skip, d.prep, d.clip_coef), (Some(overflow), None, 1.0));
            let d = decide(2.0, norm, &clipping(Some(1.0), None, false), None, 0).unwrap();
            assert_eq!((d.skip, d.prep), (Some(Skip::NonFinite), None));
        }
        let err = decide(2.0, f64::INFINITY, &clipping(None, None, true), None, 6).unwrap_err();
        assert!(
            matches!(err, Error::NonFinite { step: 7, norm } if norm == f64::INFINITY),
            "{err:?}"
        );
        assert_eq!(Skip::Overflow { loss_scale: 1.0 }.reason(), "fp16 overflow");
        assert_eq!(Skip::NonFinite.reason(), "non-finite gradients");
    }
}
