//! Mixed precision (issue 18): autocast for the forward and the loss (a
//! C++ shim, `csrc/amp.cpp`: tch turns CUDA autocast on and off only), and
//! fp16's dynamic loss scaling as torch.amp.GradScaler does it, as a pure
//! state machine ([`LossScale`]) the engine advances once per step.
//!
//! Parameters, the accumulation buffer and the optimizer stay fp32 (master
//! weights); autocast casts inside the ops that run in the lower type.

use crate::error::{Error, Result};
use accrue_common::spec::{LossScalingSpec, Precision};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind};

extern "C" {
    fn accrue_autocast_enter(device: i32, dtype: i32, cache: i32) -> i32;
    fn accrue_autocast_exit(device: i32) -> i32;
    fn accrue_autocast_is_enabled(device: i32) -> i32;
    fn accrue_autocast_dtype(device: i32) -> i32;
}

/// c10::ScalarType's number of an autocast type (tch keeps its own
/// mapping private): bf16 15, fp16 5; None for any other kind. The shims'
/// tests check the ops then run in the type asked for.
pub fn scalar_type(kind: Kind) -> Option<i32> {
    match kind {
        Kind::BFloat16 => Some(15),
        Kind::Half => Some(5),
        _ => None,
    }
}

/// The autocast type of `precision` (None: fp32, no autocast).
pub fn autocast_kind(precision: Precision) -> Option<Kind> {
    match precision {
        Precision::Fp32 => None,
        Precision::Bf16 => Some(Kind::BFloat16),
        Precision::Fp16 => Some(Kind::Half),
    }
}

fn device_code(device: Device) -> Result<i32> {
    match device {
        Device::Cpu => Ok(0),
        Device::Cuda(_) => Ok(1),
        other => Err(Error::Precision(format!(
            "mixed precision runs on the CPU and CUDA, not on {other:?}"
        ))),
    }
}

/// Autocast on for this thread while the guard lives (torch.autocast's
/// `with` block): from [`Autocast::enter`] to drop.
#[must_use = "autocast ends when the guard is dropped"]
pub struct Autocast {
    device: i32,
}

impl Autocast {
    /// Turns autocast to `precision`'s type on for `device` (None for
    /// fp32: nothing to do).
    pub fn enter(device: Device, precision: Precision) -> Result<Option<Self>> {
        Self::enter_with(device, precision, true)
    }

    /// [`Autocast::enter`]; `cache = false` turns the cast cache off
    /// (`torch.autocast(cache_enabled=False)`), as a CUDA-graph capture
    /// needs: a cached cast would outlive the capture.
    pub fn enter_with(device: Device, precision: Precision, cache: bool) -> Result<Option<Self>> {
        let Some(kind) = autocast_kind(precision) else {
            return Ok(None);
        };
        let code = device_code(device)?;
        // autocast_kind gives bf16 or fp16 only, which scalar_type maps.
        let dtype = scalar_type(kind).unwrap_or(15);
        // SAFETY: a plain C function of the shim; it only sets libtorch's
        // thread-local autocast state and catches every C++ exception.
        if unsafe { accrue_autocast_enter(code, dtype, i32::from(cache)) } != 0 {
            return Err(Error::Precision(format!(
                "libtorch refused autocast to {kind:?} on {device:?}"
            )));
        }
        Ok(Some(Self { device: code }))
    }

    /// The type autocast casts to on `device` on this thread (None: off).
    pub fn kind(device: Device) -> Option<Kind> {
        let code = device_code(device).ok()?;
        // SAFETY: as in `enter`; reads thread-local state only.
        let dtype = unsafe { accrue_autocast_dtype(code) };
        [Kind::BFloat16, Kind::Half]
            .into_iter()
            .find(|&k| scalar_type(k) == Some(dtype))
    }

    /// Whether autocast is on for `device` on this thread.
    pub fn is_enabled(device: Device) -> bool {
        // SAFETY: as in `enter`; reads thread-local state only.
        device_code(device).is_ok_and(|d| unsafe { accrue_autocast_is_enabled(d) } == 1)
    }
}

impl Drop for Autocast {
    fn drop(&mut self) {
        // SAFETY: as in `enter`. It cannot fail for a device `enter`
        // accepted; were it to, autocast would stay on for this thread's
        // next forward, so say so.
        if unsafe { accrue_autocast_exit(self.device) } != 0 {
            tracing::error!("libtorch refused to leave autocast");
        }
    }
}

/// fp16's loss scale and its growth tracker (GradScaler's `_scale` and
/// `_growth_tracker`), kept in the trainer state: checkpointed, resumed
/// and broadcast at re-formation with the rest.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScale {
    pub scale: f32,
    /// Steps in a row without a non-finite gradient since the last change.
    pub growth_tracker: u64,
}

impl LossScale {
    pub fn new(spec: &LossScalingSpec) -> Self {
        Self {
            scale: spec.init_scale as f32,
            growth_tracker: 0,
        }
    }

    /// 1/scale as GradScaler computes it (in f64, then to f32).
    pub fn inv_scale(self) -> f32 {
        (1.0 / f64::from(self.scale)) as f32
    }

    /// The scale after a step, as `torch._amp_update_scale_` does it: a
    /// non-finite gradient (the step was skipped) multiplies the scale by
    /// `backoff_factor` and resets the tracker; otherwise the tracker
    /// counts, and at `growth_interval` the scale is multiplied by
    /// `growth_factor` (kept only when finite) and the tracker resets.
    pub fn update(self, spec: &LossScalingSpec, found_inf: bool) -> Self {
        if found_inf {
            return Self {
                scale: (f64::from(self.scale) * spec.backoff_factor) as f32,
                growth_tracker: 0,
            };
        }
        let successful = self.growth_tracker + 1;
        if successful == spec.growth_interval {
            let grown = (f64::from(self.scale) * spec.growth_factor) as f32;
            Self {
                scale: if grown.is_finite() { grown } else { self.scale },
                growth_tracker: 0,
            }
        } else {
            Self {
                scale: self.scale,
                growth_tracker: successful,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(interval: u64) -> LossScalingSpec {
        LossScalingSpec {
            growth_interval: interval,
            ..Default::default()
        }
    }

    #[test]
    fn grad_scalers_defaults_back_off_and_grow() {
        let s = spec(2000);
        let mut ls = LossScale::new(&s);
        assert_eq!(ls.scale, 65536.0);
        ls = ls.update(&s, true);
        assert_eq!((ls.scale, ls.growth_tracker), (32768.0, 0));
        for _ in 0..1999 {
            ls = ls.update(&s, false);
        }
        assert_eq!((ls.scale, ls.growth_tracker), (32768.0, 1999));
        ls = ls.update(&s, false);
        assert_eq!((ls.scale, ls.growth_tracker), (65536.0, 0));
        assert_eq!(ls.inv_scale(), 1.0 / 65536.0);
    }

    #[test]
    fn a_scale_that_would_overflow_stays() {
        let s = spec(1);
        let ls = LossScale {
            scale: f32::MAX,
            growth_tracker: 0,
        };
        assert_eq!(ls.update(&s, false).scale, f32::MAX);
    }

    #[test]
    fn autocast_is_on_inside_the_guard_only() {
        assert!(!Autocast::is_enabled(Device::Cpu));
        {
            let _g = Autocast::enter(Device::Cpu, Precision::Bf16)
                .unwrap()
                .unwrap();
            assert!(Autocast::is_enabled(Device::Cpu));
            let a = tch::Tensor::ones([2, 3], (Kind::Float, Device::Cpu));
            let b = tch::Tensor::ones([3, 2], (Kind::Float, Device::Cpu));
            assert_eq!(a.matmul(&b).kind(), Kind::BFloat16, "matmul runs in bf16");
        }
        assert!(!Autocast::is_enabled(Device::Cpu));
        {
            let _g = Autocast::enter(Device::Cpu, Precision::Fp16)
                .unwrap()
                .unwrap();
            let a = tch::Tensor::ones([2, 3], (Kind::Float, Device::Cpu));
            assert_eq!(a.matmul(&a.tr()).kind(), Kind::Half, "matmul runs in fp16");
        }
        assert!(Autocast::enter(Device::Cpu, Precision::Fp32)
            .unwrap()
            .is_none());
        let a = tch::Tensor::ones([2, 3], (Kind::Float, Device::Cpu));
        assert_eq!(a.matmul(&a.tr()).kind(), Kind::Float);
    }

    proptest! {
        /// Any sequence of steps: the scale only moves by the two factors,
        /// the tracker never reaches the interval, and it is the number
        /// of clean steps since the last change.
        #[test]
        fn the_scale_moves_only_by_the_factors(
            steps in proptest::collection::vec(any::<bool>(), 0..100),
            interval in 1u64..10,
        ) {
            let s = spec(interval);
            let mut ls = LossScale::new(&s);
            let mut clean = 0u64;
            for inf in steps {
                let next = ls.update(&s, inf);
                let ratio = f64::from(next.scale) / f64::from(ls.scale);
                if inf {
                    prop_assert_eq!(ratio, 0.5);
                    clean = 0;
                } else {
                    clean += 1;
                    if clean == interval {
                        prop_assert!(ratio == 2.0 || next.scale == ls.scale);
                        clean = 0;
                    } else {
                        prop_assert_eq!(ratio, 1.0);
                    }
                }
                prop_assert_eq!(next.growth_tracker, clean);
                prop_assert!(next.growth_tracker < interval);
                ls = next;
            }
        }
    }
}
