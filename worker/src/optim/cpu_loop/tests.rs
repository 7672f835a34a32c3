//! The CPU loops against op-by-op references and libtorch's own tensor ops.

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
        let rule = rule::Sgd {
            momentum: m,
            dampening: damp,
            nesterov,
            weight_decay: wd,
        };
        let h = Sgd::from_rule(&rule, &rule.coefs(lr), false);
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

/// Accrue's tensor-op Adam (tensor.rs) written the slow way, one
/// rounding per op, `lerp` as ATen's (one fused multiply-add).
fn adam_reference(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], prep: GradPrep, h: Adam) {
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
        .prop_map(|(beta1, beta2, eps, step, lr, weight_decay, decoupled)| {
            let rule = rule::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
                decoupled,
            };
            Adam::from_rule(&rule, &rule.coefs(u64::from(step), lr))
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
        let rule = rule::Adam {
            beta1,
            beta2,
            eps,
            weight_decay: wd,
            decoupled,
        };
        let h = Adam::from_rule(&rule, &rule.coefs(step as u64, lr));
        adam(
            &mut fp,
            &mut fg,
            &mut fm,
            &mut fv,
            GradPrep::Mul(s as f32),
            h,
            &exact_sqrt,
        );
        let close =
            |got: &[f32], want: &Tensor| Tensor::from_slice(got).allclose(want, 1e-6, 1e-7, false);
        assert!(close(&fp, &p), "parameters (decoupled {decoupled})");
        assert!(close(&fm, &m), "exp_avg (decoupled {decoupled})");
        assert!(close(&fv, &v), "exp_avg_sq (decoupled {decoupled})");
        assert!(fg.iter().all(|&x| x == 0.0));
    }
}
