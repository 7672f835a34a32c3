//! The sync step's elementwise tail in one pass over memory (CPU, float32).
//!
//! After the all-reduce and the norm, PyTorch's pipeline walks the gradients
//! five times: scale by the clip coefficient (clip_grad_norm_), add weight
//! decay, update the momentum buffer, update the parameter, zero the
//! gradient. Each pass is a read and a write of an array as large as the
//! model, and on CPU they are bound by memory bandwidth, not arithmetic.
//! [`sgd`] does all five per element while the element is in a register:
//! it reads gradient, parameter and momentum buffer once and writes the
//! three once (24 bytes per element instead of about 48).
//!
//! The arithmetic per element is PyTorch's single-tensor SGD, op for op, in
//! float32, with `x.add(y, alpha=a)` as one fused multiply-add (what ATen's
//! vectorized `add` does on CPUs with FMA); on x86_64 the loop is compiled
//! for AVX2+FMA and chosen at run time, so it vectorizes. Differences from
//! the unfused tensor ops are float rounding only (test: `matches_tensor_ops`).

/// What happens to the (all-reduced) gradient before the optimizer sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GradPrep {
    /// `g * s` (normalization and clip coefficient together).
    Mul(f32),
    /// `g / d` (normalization only).
    Div(f32),
    /// `clamp(g / d, -v, v)` (normalization, then clip_grad_value_).
    DivClamp(f32, f32),
}

impl GradPrep {
    #[inline(always)]
    fn apply(self, g: f32) -> f32 {
        match self {
            GradPrep::Mul(s) => g * s,
            GradPrep::Div(d) => g / d,
            // f32::clamp would panic on NaN bounds; PyTorch's clamp keeps NaN.
            GradPrep::DivClamp(d, v) => {
                let x = g / d;
                if x > v {
                    v
                } else if x < -v {
                    -v
                } else {
                    x
                }
            }
        }
    }
}

/// SGD hyper-parameters for one step, in the element type.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    pub lr: f32,
    pub momentum: f32,
    /// `1 - dampening`, computed in f64 and rounded once (PyTorch passes it
    /// as the `alpha` of one op).
    pub one_minus_dampening: f32,
    pub nesterov: bool,
    pub weight_decay: f32,
    /// The momentum buffer is created by this step (`buf = d_p`, PyTorch's
    /// `torch.clone(d_p)`); its old contents are ignored.
    pub first: bool,
}

/// One parameter's SGD step, with the gradient prepared on the way in and
/// zeroed on the way out. `buf` is ignored (and may be empty) when
/// momentum is 0. All three slices have the same length otherwise.
pub fn sgd(p: &mut [f32], g: &mut [f32], buf: &mut [f32], prep: GradPrep, h: Sgd) {
    assert_eq!(p.len(), g.len(), "parameter and gradient lengths differ");
    assert!(
        h.momentum == 0.0 || buf.len() == p.len(),
        "momentum buffer length differs from the parameter's"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            unsafe { sgd_avx2_fma(p, g, buf, prep, h) };
            return;
        }
    }
    sgd_generic(p, g, buf, prep, h);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sgd_avx2_fma(p: &mut [f32], g: &mut [f32], buf: &mut [f32], prep: GradPrep, h: Sgd) {
    sgd_generic(p, g, buf, prep, h)
}

/// The loop, specialised per case so each inner loop is branch-free and
/// vectorizes (inlined into the target-feature function above).
#[inline(always)]
fn sgd_generic(p: &mut [f32], g: &mut [f32], buf: &mut [f32], prep: GradPrep, h: Sgd) {
    match prep {
        GradPrep::Mul(s) => sgd_with(p, g, buf, h, |x| x * s),
        GradPrep::Div(d) => sgd_with(p, g, buf, h, |x| x / d),
        GradPrep::DivClamp(..) => sgd_with(p, g, buf, h, |x| prep.apply(x)),
    }
}

#[inline(always)]
fn sgd_with(p: &mut [f32], g: &mut [f32], buf: &mut [f32], h: Sgd, prep: impl Fn(f32) -> f32) {
    let neg_lr = -h.lr;
    let wd = h.weight_decay;
    if h.momentum == 0.0 {
        for (p, g) in p.iter_mut().zip(g.iter_mut()) {
            let mut d = prep(*g);
            if wd != 0.0 {
                d = p.mul_add(wd, d);
            }
            *p = d.mul_add(neg_lr, *p);
            *g = 0.0;
        }
        return;
    }
    let m = h.momentum;
    let one_minus_damp = h.one_minus_dampening;
    let g = &mut g[..p.len()];
    let buf = &mut buf[..p.len()];
    macro_rules! body {
        ($first:expr, $nesterov:expr) => {
            for ((p, g), b) in p.iter_mut().zip(g.iter_mut()).zip(buf.iter_mut()) {
                let mut d = prep(*g);
                if wd != 0.0 {
                    // d_p = grad.add(param, alpha=weight_decay)
                    d = p.mul_add(wd, d);
                }
                // buf = clone(d_p), or buf.mul_(m).add_(d_p, alpha=1-dampening)
                let nb = if $first {
                    d
                } else {
                    d.mul_add(one_minus_damp, *b * m)
                };
                *b = nb;
                // nesterov: d_p = d_p.add(buf, alpha=momentum); else d_p = buf
                let step = if $nesterov { nb.mul_add(m, d) } else { nb };
                // param.add_(d_p, alpha=-lr)
                *p = step.mul_add(neg_lr, *p);
                *g = 0.0;
            }
        };
    }
    match (h.first, h.nesterov) {
        (false, false) => body!(false, false),
        (false, true) => body!(false, true),
        (true, false) => body!(true, false),
        (true, true) => body!(true, true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// PyTorch's single-tensor SGD written the slow way, one rounding per
    /// op (`add` with alpha as a fused multiply-add, as ATen's vector code).
    fn reference(p: &mut [f32], g: &[f32], buf: &mut [f32], prep: GradPrep, h: Sgd) {
        for i in 0..p.len() {
            let mut d = prep.apply(g[i]);
            if h.weight_decay != 0.0 {
                d = p[i].mul_add(h.weight_decay, d);
            }
            if h.momentum != 0.0 {
                if h.first {
                    buf[i] = d;
                } else {
                    let t = buf[i] * h.momentum;
                    buf[i] = d.mul_add(h.one_minus_dampening, t);
                }
                d = if h.nesterov {
                    buf[i].mul_add(h.momentum, d)
                } else {
                    buf[i]
                };
            }
            p[i] = d.mul_add(-h.lr, p[i]);
        }
    }

    fn hyper() -> impl Strategy<Value = Sgd> {
        (
            prop_oneof![Just(0.0f32), 0.01f32..1.0],
            prop_oneof![Just(0.0f32), 0.1f32..0.99],
            prop_oneof![Just(0.0f32), 0.0f32..0.5],
            any::<bool>(),
            prop_oneof![Just(0.0f32), 1e-5f32..1e-2],
            any::<bool>(),
        )
            .prop_map(
                |(lr, momentum, dampening, nesterov, weight_decay, first)| Sgd {
                    lr,
                    momentum,
                    one_minus_dampening: 1.0 - dampening,
                    nesterov,
                    weight_decay,
                    first,
                },
            )
    }

    fn prep() -> impl Strategy<Value = GradPrep> {
        prop_oneof![
            (1e-4f32..2.0).prop_map(GradPrep::Mul),
            (1.0f32..512.0).prop_map(GradPrep::Div),
            ((1.0f32..512.0), (1e-3f32..1.0)).prop_map(|(d, v)| GradPrep::DivClamp(d, v)),
        ]
    }

    proptest! {
        /// The vectorized loop gives bit for bit what the op-by-op reference
        /// gives, for every length (vector body and tail) and every case;
        /// the gradient is zero afterwards.
        #[test]
        fn equals_the_op_by_op_reference(
            data in prop::collection::vec((-4.0f32..4.0, -4.0f32..4.0, -1.0f32..1.0), 0..300),
            prep in prep(),
            h in hyper(),
        ) {
            let mut p: Vec<f32> = data.iter().map(|x| x.0).collect();
            let mut g: Vec<f32> = data.iter().map(|x| x.1).collect();
            let mut buf: Vec<f32> = data.iter().map(|x| x.2).collect();
            let (mut p2, g2, mut buf2) = (p.clone(), g.clone(), buf.clone());
            sgd(&mut p, &mut g, &mut buf, prep, h);
            reference(&mut p2, &g2, &mut buf2, prep, h);
            prop_assert_eq!(p.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                            p2.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            if h.momentum != 0.0 {
                prop_assert_eq!(buf.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                                buf2.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            }
            prop_assert!(g.iter().all(|&x| x == 0.0));
        }
    }

    /// Against libtorch's own tensor ops (the unfused pipeline PyTorch
    /// runs): the same values up to float rounding.
    #[test]
    fn matches_tensor_ops() {
        use tch::{Device, Kind, Tensor};
        tch::manual_seed(7);
        let n = 10_007;
        let opts = (Kind::Float, Device::Cpu);
        let p0 = Tensor::randn([n], opts);
        let g0 = Tensor::randn([n], opts);
        let b0 = Tensor::randn([n], opts);
        let (lr, m, wd, damp, s) = (0.05f64, 0.9f64, 1e-4f64, 0.1f64, 0.37f64);
        for nesterov in [false, true] {
            // libtorch: clip scale, then torch.optim.SGD's single-tensor ops.
            let g = g0.shallow_clone() * s;
            let d = &g + &p0 * wd;
            let buf = &b0 * m + &d * (1.0 - damp);
            let step = if nesterov {
                &d + &buf * m
            } else {
                buf.shallow_clone()
            };
            let want_p = &p0 - step * lr;
            let mut p = Vec::<f32>::try_from(&p0).unwrap();
            let mut g = Vec::<f32>::try_from(&g0).unwrap();
            let mut b = Vec::<f32>::try_from(&b0).unwrap();
            let h = Sgd {
                lr: lr as f32,
                momentum: m as f32,
                one_minus_dampening: (1.0 - damp) as f32,
                nesterov,
                weight_decay: wd as f32,
                first: false,
            };
            sgd(&mut p, &mut g, &mut b, GradPrep::Mul(s as f32), h);
            let got_p = Tensor::from_slice(&p);
            let got_b = Tensor::from_slice(&b);
            assert!(
                got_p.allclose(&want_p, 1e-6, 1e-6, false),
                "nesterov={nesterov}"
            );
            assert!(
                got_b.allclose(&buf, 1e-6, 1e-6, false),
                "nesterov={nesterov}"
            );
            assert!(g.iter().all(|&x| x == 0.0));
        }
    }
}
