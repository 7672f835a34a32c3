//! The sync step's elementwise tail in one pass over memory (CPU, float32).
//!
//! After the all-reduce and the norm, PyTorch's pipeline walks the gradients
//! several times: scale by the clip coefficient (clip_grad_norm_), add weight
//! decay, update the optimizer state, update the parameter, zero the
//! gradient. Each pass is a read and a write of an array as large as the
//! model, and on CPU they are bound by memory bandwidth, not arithmetic.
//! [`sgd`] and [`adam`] do all of it per element while the element is in a
//! register: they read gradient, parameter and state once and write them
//! once (SGD with momentum: 24 bytes per element instead of about 48; Adam:
//! 32 instead of about 120).
//!
//! The arithmetic per element is what accrue's tensor-op step
//! (crate::optim) computes, op for op, in float32: for SGD that is
//! PyTorch's single-tensor SGD with `x.add(y, alpha=a)` as one fused
//! multiply-add (what ATen's vectorized `add` does on CPUs with FMA); for
//! Adam/AdamW it is PyTorch's single-tensor Adam as optim.rs writes it
//! (one rounding per tensor op, `lerp` as ATen's vectorized kernel: one
//! fused multiply-add). Every scalar an op takes is computed in f64 and
//! rounded to f32 once, as ATen does with a Python scalar. On x86_64 the
//! loops are compiled for AVX2+FMA and chosen at run time, so they
//! vectorize. Differences from the unfused tensor ops are float rounding
//! only (tests: `matches_tensor_ops`, `adam_matches_tensor_ops`, and
//! crate::optim's `fused_*` tests). Adam's square root is the caller's
//! ([`adam`]'s `sqrt`, over blocks of [`SQRT_BLOCK`] second moments while
//! they are in cache): ATen's float sqrt (MKL VML on x86) is an ulp off
//! the correctly rounded root for some inputs, so the engine passes ATen's
//! own kernel, and the step is then bit for bit the tensor ops'. A
//! correctly rounded sqrt here once left a denominator an ulp apart, which
//! bf16 autocast amplified to 8e-5 after four AdamW steps against
//! PyTorch's AdamW.

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

/// Adam/AdamW hyper-parameters for one step, in the element type. Each is
/// the scalar one tensor op of accrue's tensor-op Adam (crate::optim)
/// takes, computed in f64 from the f64 hyper-parameters and rounded once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adam {
    /// `1 - beta1`: the weight of `exp_avg.lerp_(grad, 1 - beta1)`.
    pub lerp_weight: f32,
    /// `exp_avg_sq.mul_(beta2)`.
    pub beta2: f32,
    /// `1 - beta2`: `(grad * grad) * (1 - beta2)`.
    pub one_minus_beta2: f32,
    /// `sqrt(1 - beta2^step)`: `sqrt(exp_avg_sq) / bias_correction2_sqrt`.
    pub bias_correction2_sqrt: f32,
    /// `+ eps`, after the division.
    pub eps: f32,
    /// `lr / (1 - beta1^step)`: `p -= (exp_avg / denom) * step_size`.
    pub step_size: f32,
    /// Adam's L2 weight decay, `grad += p * weight_decay` (0: none).
    pub weight_decay: f32,
    /// AdamW's decoupled decay, `p *= 1 - lr * weight_decay` (None: none).
    pub decay: Option<f32>,
}

/// Second moments per call of [`adam`]'s `sqrt` (128 KB: they are still
/// in cache when the second half of the step reads the roots).
pub const SQRT_BLOCK: usize = 32768;

/// The square root of every element of `src` into `dst` (same length, at
/// most [`SQRT_BLOCK`]).
pub type Sqrt<'a> = &'a (dyn Fn(&[f32], &mut [f32]) + Sync);

/// `f32::sqrt` (correctly rounded) as a [`Sqrt`]: tests, and the fallback
/// when ATen's kernel fails.
pub fn exact_sqrt(src: &[f32], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.sqrt();
    }
}

/// One parameter's Adam/AdamW step, with the gradient prepared on the way in
/// and zeroed on the way out. All four slices have the same length; the
/// state (`exp_avg`, `exp_avg_sq`) is updated in place (zeros before the
/// first step, as PyTorch and the tensor-op step create it). `sqrt` takes
/// the roots of the new second moments, a block at a time.
pub fn adam(
    p: &mut [f32],
    g: &mut [f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    prep: GradPrep,
    h: Adam,
    sqrt: Sqrt<'_>,
) {
    assert!(
        g.len() == p.len() && exp_avg.len() == p.len() && exp_avg_sq.len() == p.len(),
        "parameter, gradient and Adam state lengths differ"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            unsafe { adam_avx2_fma(p, g, exp_avg, exp_avg_sq, prep, h, sqrt) };
            return;
        }
    }
    adam_generic(p, g, exp_avg, exp_avg_sq, prep, h, sqrt);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn adam_avx2_fma(
    p: &mut [f32],
    g: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    prep: GradPrep,
    h: Adam,
    sqrt: Sqrt<'_>,
) {
    adam_generic(p, g, m, v, prep, h, sqrt)
}

/// Which weight decay an Adam loop applies (a const parameter, so each
/// inner loop is branch-free).
const NO_DECAY: u8 = 0;
const L2_DECAY: u8 = 1;
const DECOUPLED_DECAY: u8 = 2;

/// Picks the loop for the case (inlined into the target-feature function
/// above, so every specialisation is compiled for AVX2+FMA there).
#[inline(always)]
fn adam_generic(
    p: &mut [f32],
    g: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    prep: GradPrep,
    h: Adam,
    sqrt: Sqrt<'_>,
) {
    // ATen's lerp: `self + w * (end - self)` for |w| < 0.5, else
    // `end - (end - self) * (1 - w)`, each one fused multiply-add.
    let small = h.lerp_weight.abs() < 0.5;
    let decay = match h.decay {
        Some(_) => DECOUPLED_DECAY,
        None if h.weight_decay != 0.0 => L2_DECAY,
        None => NO_DECAY,
    };
    macro_rules! with_prep {
        ($decay:expr, $small:expr) => {
            match prep {
                GradPrep::Mul(s) => {
                    adam_with::<{ $decay }, { $small }>(p, g, m, v, h, sqrt, |x| x * s)
                }
                GradPrep::Div(d) => {
                    adam_with::<{ $decay }, { $small }>(p, g, m, v, h, sqrt, |x| x / d)
                }
                GradPrep::DivClamp(..) => {
                    adam_with::<{ $decay }, { $small }>(p, g, m, v, h, sqrt, |x| prep.apply(x))
                }
            }
        };
    }
    match (decay, small) {
        (NO_DECAY, true) => with_prep!(NO_DECAY, true),
        (NO_DECAY, false) => with_prep!(NO_DECAY, false),
        (L2_DECAY, true) => with_prep!(L2_DECAY, true),
        (L2_DECAY, false) => with_prep!(L2_DECAY, false),
        (_, true) => with_prep!(DECOUPLED_DECAY, true),
        (_, false) => with_prep!(DECOUPLED_DECAY, false),
    }
}

#[inline(always)]
fn adam_with<const DECAY: u8, const SMALL: bool>(
    p: &mut [f32],
    g: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    h: Adam,
    sqrt: Sqrt<'_>,
    prep: impl Fn(f32) -> f32,
) {
    let n = p.len();
    let (g, m, v) = (&mut g[..n], &mut m[..n], &mut v[..n]);
    let wd = h.weight_decay;
    let decay = h.decay.unwrap_or(1.0);
    let w = h.lerp_weight;
    // Exact for the weights that take this branch (0.5 <= w <= 1: Sterbenz).
    let w_minus_1 = w - 1.0;
    let (beta2, omb2) = (h.beta2, h.one_minus_beta2);
    let (bc2_sqrt, eps, step_size) = (h.bias_correction2_sqrt, h.eps, h.step_size);
    let mut roots = vec![0.0f32; n.min(SQRT_BLOCK)];
    let mut start = 0;
    while start < n {
        let end = (start + SQRT_BLOCK).min(n);
        let (p, g, m, v) = (
            &mut p[start..end],
            &mut g[start..end],
            &mut m[start..end],
            &mut v[start..end],
        );
        for (((p, g), m), v) in p
            .iter_mut()
            .zip(g.iter_mut())
            .zip(m.iter_mut())
            .zip(v.iter_mut())
        {
            let mut x = *p;
            let mut d = prep(*g);
            if DECAY == DECOUPLED_DECAY {
                // p.mul_(1 - lr * weight_decay)
                x *= decay;
            } else if DECAY == L2_DECAY {
                // grad.add_(p * weight_decay): two roundings, as two ops
                d += x * wd;
            }
            *p = x;
            // exp_avg.lerp_(grad, 1 - beta1)
            let diff = d - *m;
            *m = if SMALL {
                w.mul_add(diff, *m)
            } else {
                w_minus_1.mul_add(diff, d)
            };
            // exp_avg_sq.mul_(beta2).add_((grad * grad) * (1 - beta2))
            *v = *v * beta2 + (d * d) * omb2;
            *g = 0.0;
        }
        // sqrt(exp_avg_sq), by the caller's kernel
        let roots = &mut roots[..end - start];
        sqrt(v, roots);
        for ((p, m), r) in p.iter_mut().zip(m.iter()).zip(roots.iter()) {
            // denom = sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
            let denom = r / bc2_sqrt + eps;
            // p.sub_((exp_avg / denom) * step_size)
            *p -= (m / denom) * step_size;
        }
        start = end;
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

    /// Accrue's tensor-op Adam (crate::optim) written the slow way, one
    /// rounding per op, `lerp` as ATen's (one fused multiply-add).
    fn adam_reference(
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        prep: GradPrep,
        h: Adam,
    ) {
        for i in 0..p.len() {
            let mut d = prep.apply(g[i]);
            if let Some(c) = h.decay {
                p[i] *= c;
            } else if h.weight_decay != 0.0 {
                let t = p[i] * h.weight_decay;
                d += t;
            }
            let w = h.lerp_weight;
            m[i] = if w.abs() < 0.5 {
                w.mul_add(d - m[i], m[i])
            } else {
                (w - 1.0).mul_add(d - m[i], d)
            };
            let sq = d * d;
            let sq = sq * h.one_minus_beta2;
            v[i] *= h.beta2;
            v[i] += sq;
            let mut denom = v[i].sqrt();
            denom /= h.bias_correction2_sqrt;
            denom += h.eps;
            let t = m[i] / denom;
            let t = t * h.step_size;
            p[i] -= t;
        }
    }

    fn adam_hyper() -> impl Strategy<Value = Adam> {
        (
            prop_oneof![0.0f64..0.45, 0.5f64..0.99],
            0.9f64..0.9999,
            1e-10f64..1e-3,
            1u32..50,
            1e-4f64..0.1,
            prop_oneof![Just(0.0f64), 1e-4f64..0.1],
            any::<bool>(),
        )
            .prop_map(|(beta1, beta2, eps, step, lr, wd, decoupled)| {
                let step = step as i32;
                Adam {
                    lerp_weight: (1.0 - beta1) as f32,
                    beta2: beta2 as f32,
                    one_minus_beta2: (1.0 - beta2) as f32,
                    bias_correction2_sqrt: (1.0 - beta2.powi(step)).sqrt() as f32,
                    eps: eps as f32,
                    step_size: (lr / (1.0 - beta1.powi(step))) as f32,
                    weight_decay: if decoupled { 0.0 } else { wd as f32 },
                    decay: (decoupled && wd != 0.0).then_some((1.0 - lr * wd) as f32),
                }
            })
    }

    proptest! {
        /// Adam: the vectorized loop gives bit for bit what the op-by-op
        /// reference gives, for every length and case; gradient zeroed.
        #[test]
        fn adam_equals_the_op_by_op_reference(
            data in prop::collection::vec(
                (-4.0f32..4.0, -4.0f32..4.0, -1.0f32..1.0, 0.0f32..2.0), 0..300),
            prep in prep(),
            h in adam_hyper(),
        ) {
            let mut p: Vec<f32> = data.iter().map(|x| x.0).collect();
            let mut g: Vec<f32> = data.iter().map(|x| x.1).collect();
            let mut m: Vec<f32> = data.iter().map(|x| x.2).collect();
            let mut v: Vec<f32> = data.iter().map(|x| x.3).collect();
            let (mut p2, g2, mut m2, mut v2) = (p.clone(), g.clone(), m.clone(), v.clone());
            adam(&mut p, &mut g, &mut m, &mut v, prep, h, &exact_sqrt);
            adam_reference(&mut p2, &g2, &mut m2, &mut v2, prep, h);
            let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&p), bits(&p2));
            prop_assert_eq!(bits(&m), bits(&m2));
            prop_assert_eq!(bits(&v), bits(&v2));
            prop_assert!(g.iter().all(|&x| x == 0.0));
        }
    }

    /// Across blocks of SQRT_BLOCK (two whole ones and a part): the same
    /// bits as the op-by-op reference, and `sqrt` is asked for each block
    /// once, in order.
    #[test]
    fn adam_in_blocks_equals_the_op_by_op_reference() {
        let n = 2 * SQRT_BLOCK + 1234;
        let f = |i: usize, a: f32| ((i as f32) * a).sin();
        let mut p: Vec<f32> = (0..n).map(|i| f(i, 0.37)).collect();
        let mut g: Vec<f32> = (0..n).map(|i| f(i, 1.3)).collect();
        let mut m: Vec<f32> = (0..n).map(|i| f(i, 0.11) * 0.1).collect();
        let mut v: Vec<f32> = (0..n).map(|i| f(i, 0.07).abs() * 0.01).collect();
        let (mut p2, g2, mut m2, mut v2) = (p.clone(), g.clone(), m.clone(), v.clone());
        let h = Adam {
            lerp_weight: 0.1,
            beta2: 0.999,
            one_minus_beta2: 0.001,
            bias_correction2_sqrt: 0.05,
            eps: 1e-8,
            step_size: 0.02,
            weight_decay: 0.0,
            decay: Some(0.999),
        };
        let calls = std::sync::Mutex::new(Vec::new());
        let counting = |src: &[f32], dst: &mut [f32]| {
            calls.lock().unwrap().push(src.len());
            exact_sqrt(src, dst)
        };
        adam(
            &mut p,
            &mut g,
            &mut m,
            &mut v,
            GradPrep::Div(3.0),
            h,
            &counting,
        );
        adam_reference(&mut p2, &g2, &mut m2, &mut v2, GradPrep::Div(3.0), h);
        let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&p), bits(&p2));
        assert_eq!(bits(&m), bits(&m2));
        assert_eq!(bits(&v), bits(&v2));
        assert!(g.iter().all(|&x| x == 0.0));
        assert_eq!(*calls.lock().unwrap(), vec![SQRT_BLOCK, SQRT_BLOCK, 1234]);
    }

    /// Adam and AdamW against libtorch's own tensor ops in the shape of
    /// PyTorch's single-tensor Adam (`lerp_`, `mul_`, `addcmul_`, `sqrt`,
    /// `div`, `add`, `addcdiv_`; tch's addcmul/addcdiv take no `value`, so
    /// it is folded into an operand): the same values up to float rounding
    /// (within 1e-6 relative).
    #[test]
    fn adam_matches_tensor_ops() {
        use tch::{Device, Kind, Tensor};
        tch::manual_seed(8);
        let n = 10_007;
        let opts = (Kind::Float, Device::Cpu);
        let p0 = Tensor::randn([n], opts);
        let g0 = Tensor::randn([n], opts);
        let m0 = Tensor::randn([n], opts) * 0.1;
        let v0 = Tensor::rand([n], opts) * 0.01;
        let (lr, beta1, beta2, eps, wd, s) = (0.01f64, 0.9f64, 0.999f64, 1e-8, 0.05f64, 0.37f64);
        let step = 5;
        for decoupled in [false, true] {
            let mut p = p0.copy();
            let mut g = &g0 * s;
            let mut m = m0.copy();
            let mut v = v0.copy();
            if decoupled {
                let _ = p.f_mul_scalar_(1.0 - lr * wd).unwrap();
            } else {
                g = g.f_add(&(&p * wd)).unwrap();
            }
            let _ = m.f_lerp_(&g, 1.0 - beta1).unwrap();
            let _ = v.f_mul_scalar_(beta2).unwrap();
            // addcmul_(g, g, value=1-beta2), value folded into one factor
            let _ = v.f_addcmul_(&g, &(&g * (1.0 - beta2))).unwrap();
            let bc1 = 1.0 - beta1.powi(step);
            let bc2_sqrt = (1.0 - beta2.powi(step)).sqrt();
            let denom = (v.sqrt() / bc2_sqrt) + eps;
            // addcdiv_(m, denom, value=-step_size), value folded into the divisor
            let _ = p.f_addcdiv_(&m, &(denom / (-lr / bc1))).unwrap();
            let mut fp = Vec::<f32>::try_from(&p0).unwrap();
            let mut fg = Vec::<f32>::try_from(&g0).unwrap();
            let mut fm = Vec::<f32>::try_from(&m0).unwrap();
            let mut fv = Vec::<f32>::try_from(&v0).unwrap();
            let h = Adam {
                lerp_weight: (1.0 - beta1) as f32,
                beta2: beta2 as f32,
                one_minus_beta2: (1.0 - beta2) as f32,
                bias_correction2_sqrt: bc2_sqrt as f32,
                eps: eps as f32,
                step_size: (lr / bc1) as f32,
                weight_decay: if decoupled { 0.0 } else { wd as f32 },
                decay: decoupled.then_some((1.0 - lr * wd) as f32),
            };
            adam(
                &mut fp,
                &mut fg,
                &mut fm,
                &mut fv,
                GradPrep::Mul(s as f32),
                h,
                &exact_sqrt,
            );
            let close = |got: &[f32], want: &Tensor| {
                Tensor::from_slice(got).allclose(want, 1e-6, 1e-7, false)
            };
            assert!(close(&fp, &p), "parameters (decoupled {decoupled})");
            assert!(close(&fm, &m), "exp_avg (decoupled {decoupled})");
            assert!(close(&fv, &v), "exp_avg_sq (decoupled {decoupled})");
            assert!(fg.iter().all(|&x| x == 0.0));
        }
    }
}
