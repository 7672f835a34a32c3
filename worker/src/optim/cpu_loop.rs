//! The CPU loop back-end: the rule's step with the gradient's preparation, one pass (f32).
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
//! The operations per element are the rule's (rule.rs), in its order, in
//! float32, and their numbers are the rule's ([`Sgd::from_rule`],
//! [`Adam::from_rule`]: each computed in f64 by the rule and rounded to
//! f32 once, as ATen does with a Python scalar). For SGD each
//! `x + y * a` line is one fused multiply-add (PyTorch's `x.add(y,
//! alpha=a)`: what ATen's vectorized `add` does on CPUs with FMA); the
//! tensor-op back-end (tensor.rs) rounds some of them twice. For
//! Adam/AdamW it is the tensor-op back-end's arithmetic exactly (one
//! rounding per tensor op, `lerp` as ATen's vectorized kernel: one fused
//! multiply-add). On x86_64 the loops are compiled for AVX2+FMA and chosen
//! at run time, so they vectorize. Differences from the tensor ops are
//! float rounding only (tests: `matches_tensor_ops`,
//! `adam_matches_tensor_ops`, and crate::optim's `fused_*` tests). Adam's
//! square root is the caller's ([`adam`]'s `sqrt`, over blocks of
//! [`SQRT_BLOCK`] second moments while they are in cache): ATen's float
//! sqrt (MKL VML on x86) is an ulp off the correctly rounded root for some
//! inputs, so the engine passes ATen's own kernel, and the step is then
//! bit for bit the tensor ops'. A correctly rounded sqrt here once left a
//! denominator an ulp apart, which bf16 autocast amplified to 8e-5 after
//! four AdamW steps against PyTorch's AdamW.

use super::rule::{self, AdamCoefs, Decay, SgdCoefs};

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

/// SGD hyper-parameters for one step, in the element type
/// ([`Sgd::from_rule`]).
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

impl Sgd {
    /// The loop's numbers of a step of `rule` with the rule's numbers `c`;
    /// `first`: the optimizer's first step (the momentum buffer is made).
    pub fn from_rule(rule: &rule::Sgd, c: &SgdCoefs<f64>, first: bool) -> Self {
        Sgd {
            lr: (-c.neg_lr) as f32,
            momentum: c.momentum as f32,
            one_minus_dampening: rule.one_minus_dampening() as f32,
            nesterov: rule.nesterov,
            weight_decay: c.weight_decay as f32,
            first: rule.momentum != 0.0 && first,
        }
    }
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
/// the scalar one tensor op of the rule takes ([`Adam::from_rule`]),
/// computed in f64 by the rule and rounded once.
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

impl Adam {
    /// The loop's numbers of a step of `rule` with the rule's numbers `c`.
    pub fn from_rule(rule: &rule::Adam, c: &AdamCoefs<f64>) -> Self {
        let decay = rule.decay();
        Adam {
            lerp_weight: c.one_minus_beta1 as f32,
            beta2: c.beta2 as f32,
            one_minus_beta2: c.one_minus_beta2 as f32,
            bias_correction2_sqrt: c.bc2_sqrt as f32,
            eps: rule.eps as f32,
            step_size: c.step_size as f32,
            weight_decay: if decay == Decay::L2 {
                c.decay as f32
            } else {
                0.0
            },
            decay: (decay == Decay::Decoupled).then_some(c.decay as f32),
        }
    }
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
    ROOTS.with_borrow_mut(|roots| {
        if roots.len() < n.min(SQRT_BLOCK) {
            roots.resize(n.min(SQRT_BLOCK), 0.0);
        }
        adam_blocks(
            p,
            g,
            m,
            v,
            roots,
            sqrt,
            |p, g, m, v| {
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
            },
            |p, m, r| {
                // denom = sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
                let denom = r / bc2_sqrt + eps;
                // p.sub_((exp_avg / denom) * step_size)
                *p -= (m / denom) * step_size;
            },
        )
    });
}

thread_local! {
    /// [`adam`]'s block of square roots, kept between calls (a step makes
    /// one call per parameter): no allocation or zeroing per call.
    static ROOTS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `first` over every element of a block of [`SQRT_BLOCK`], takes the
/// block's square roots of `v` by `sqrt` into `roots`, then runs `second`
/// with each root; block after block.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn adam_blocks(
    p: &mut [f32],
    g: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    roots: &mut [f32],
    sqrt: Sqrt<'_>,
    first: impl Fn(&mut f32, &mut f32, &mut f32, &mut f32),
    second: impl Fn(&mut f32, f32, f32),
) {
    let n = p.len();
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
            first(p, g, m, v);
        }
        // sqrt(exp_avg_sq), by the caller's kernel
        let roots = &mut roots[..end - start];
        sqrt(v, roots);
        for ((p, m), r) in p.iter_mut().zip(m.iter()).zip(roots.iter()) {
            second(p, *m, *r);
        }
        start = end;
    }
}

#[cfg(test)]
mod tests;
