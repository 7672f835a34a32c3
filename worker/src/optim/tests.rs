//! The optimizer's back-ends against each other: the CPU loop against the tensor ops.

use super::cpu_step::PARALLEL_MIN;
use super::*;
use crate::grads::FlatGrads;
use crate::spec::OptimizerSpec;
use tch::{Device, Kind, Tensor};

fn sgd_spec(nesterov: bool, dampening: f64) -> OptimizerSpec {
    toml::from_str(&format!(
        "kind = \"sgd\"\nlr = 0.1\nmomentum = 0.9\nweight_decay = 0.001\n\
         nesterov = {nesterov}\ndampening = {dampening}"
    ))
    .unwrap()
}

/// Parameters of the given sizes with gradients set to `seed`-derived values.
fn params(sizes: &[i64], seed: i64) -> Vec<(String, Tensor)> {
    tch::manual_seed(seed);
    sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let p = Tensor::randn([n], (Kind::Float, Device::Cpu)).set_requires_grad(true);
            (&p * 1.0).sum(Kind::Float).backward();
            let _g = tch::no_grad_guard();
            p.grad()
                .copy_(&Tensor::randn([n], (Kind::Float, Device::Cpu)));
            (format!("p{i}"), p)
        })
        .collect()
}

fn copy(ps: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    ps.iter()
        .map(|(n, p)| {
            let q = p.detach().copy().set_requires_grad(true);
            (q.shallow_clone() * 1.0).sum(Kind::Float).backward();
            let _g = tch::no_grad_guard();
            q.grad().copy_(&p.grad());
            (n.clone(), q)
        })
        .collect()
}

/// The same `seed`-derived gradients into both parameter sets: drawn
/// once and copied, since tests running alongside share libtorch's
/// global generator and may draw from it in between.
fn set_grads(a: &[(String, Tensor)], b: &[(String, Tensor)], seed: i64) {
    tch::manual_seed(seed);
    let _g = tch::no_grad_guard();
    for ((_, p), (_, q)) in a.iter().zip(b) {
        let g = Tensor::randn(p.size(), (Kind::Float, Device::Cpu));
        p.grad().copy_(&g);
        q.grad().copy_(&g);
    }
}

/// Three steps of the fused step against the tensor-op step (clip scale
/// applied to the gradients first): the same parameters and momentum
/// buffers up to float rounding, gradients zeroed by the fused step.
#[test]
fn fused_step_equals_the_tensor_op_step() {
    for (nesterov, dampening) in [(false, 0.0), (true, 0.0), (false, 0.25)] {
        let fused_p = params(&[7, 300, 33], 3);
        let plain_p = copy(&fused_p);
        let mut flat = FlatGrads::attach(&fused_p, 1 << 20).unwrap();
        let mut fused = Optimizer::new(&sgd_spec(nesterov, dampening), 3);
        let mut plain = Optimizer::new(&sgd_spec(nesterov, dampening), 3);
        for step in 0..3 {
            set_grads(&fused_p, &plain_p, 10 + step);
            assert!(fused
                .step_fused(&fused_p, flat.cpu_mut().unwrap(), 0.1, GradPrep::Mul(0.3))
                .unwrap());
            {
                let _g = tch::no_grad_guard();
                for (_, p) in &plain_p {
                    let _ = p.grad().f_mul_scalar_(0.3f32 as f64).unwrap();
                }
            }
            plain.step(&plain_p, 0.1).unwrap();
        }
        for ((n, a), (_, b)) in fused_p.iter().zip(&plain_p) {
            assert!(
                a.allclose(b, 1e-6, 1e-7, false),
                "{n} (nesterov {nesterov}, dampening {dampening}): {a:?} vs {b:?}"
            );
            assert_eq!(a.grad().abs().sum(Kind::Float).double_value(&[]), 0.0);
        }
        for ((n, a), (_, b)) in fused
            .named_state(&fused_p)
            .iter()
            .zip(&plain.named_state(&plain_p))
        {
            assert!(a.allclose(b, 1e-6, 1e-7, false), "state {n}");
        }
        assert_eq!(fused.steps, 3);
    }
}

/// Split over several threads the result is bit for bit the one-thread
/// result (the update is elementwise): SGD, AdamW and Adam, parameters
/// and state.
#[test]
fn fused_step_on_threads_is_bitwise_the_one_thread_step() {
    let sizes = [PARALLEL_MIN as i64, 1000, PARALLEL_MIN as i64 / 3 + 7];
    for spec in [
        sgd_spec(true, 0.0),
        adam_spec("adamw", 0.01, 0.9),
        adam_spec("adam", 0.01, 0.3),
    ] {
        let a = params(&sizes, 5);
        let b = copy(&a);
        let (mut fa, mut fb) = (
            FlatGrads::attach(&a, 1 << 20).unwrap(),
            FlatGrads::attach(&b, 1 << 20).unwrap(),
        );
        let mut oa = Optimizer::new(&spec, 3);
        let mut ob = Optimizer::new(&spec, 3);
        let before = tch::get_num_threads();
        for step in 0..2 {
            set_grads(&a, &b, 20 + step);
            tch::set_num_threads(1);
            assert!(oa
                .step_fused(&a, fa.cpu_mut().unwrap(), 0.05, GradPrep::Div(4.0))
                .unwrap());
            tch::set_num_threads(3);
            assert!(ob
                .step_fused(&b, fb.cpu_mut().unwrap(), 0.05, GradPrep::Div(4.0))
                .unwrap());
        }
        tch::set_num_threads(before);
        for ((n, x), (_, y)) in a.iter().zip(&b) {
            assert!(x.equal(y), "{n} differs between 1 and 3 threads ({spec:?})");
        }
        for ((n, x), (_, y)) in oa.named_state(&a).iter().zip(&ob.named_state(&b)) {
            assert!(x.equal(y), "{n} differs between 1 and 3 threads ({spec:?})");
        }
    }
}

fn adam_spec(kind: &str, weight_decay: f64, beta1: f64) -> OptimizerSpec {
    toml::from_str(&format!(
        "kind = \"{kind}\"\nlr = 0.01\nweight_decay = {weight_decay}\n\
         betas = [{beta1}, 0.999]\neps = 1e-6"
    ))
    .unwrap()
}

/// The tensor-op pipeline's preparation of the gradients (as the engine's
/// FlatGrads::prepare and zero.rs do it: one op each).
fn prepare_plain(ps: &[(String, Tensor)], prep: GradPrep) {
    let _g = tch::no_grad_guard();
    for (_, p) in ps {
        let mut g = p.grad();
        match prep {
            GradPrep::Mul(s) => drop(g.f_mul_scalar_(s as f64).unwrap()),
            GradPrep::Div(d) => drop(g.f_div_scalar_(d as f64).unwrap()),
            GradPrep::DivClamp(d, v) => {
                let _ = g.f_div_scalar_(d as f64).unwrap();
                let _ = g.f_clamp_(-(v as f64), v as f64).unwrap();
            }
        }
    }
}

/// The largest distance in units in the last place between two float32
/// tensors of the same shape (0: bitwise equal).
fn ulps(a: &Tensor, b: &Tensor) -> u32 {
    let a = Vec::<f32>::try_from(&a.flatten(0, -1)).unwrap();
    let b = Vec::<f32>::try_from(&b.flatten(0, -1)).unwrap();
    assert_eq!(a.len(), b.len());
    // Signed magnitudes as a monotone integer line.
    let key = |x: f32| {
        let i = x.to_bits() as i32;
        if i < 0 {
            i64::from(i32::MIN) - i64::from(i)
        } else {
            i64::from(i)
        }
    };
    a.iter()
        .zip(&b)
        .map(|(&x, &y)| (key(x) - key(y)).unsigned_abs() as u32)
        .max()
        .unwrap_or(0)
}

/// Three steps of the fused Adam and AdamW step against the tensor-op
/// step (gradients prepared first, by each GradPrep), with and without
/// weight decay, for `exp_avg.lerp_` weights under and over 0.5 (ATen's
/// two lerp formulas): the same state keys and step count, gradients
/// zeroed by the fused step, and the same numbers bit for bit: the
/// fused loop does the tensor ops' arithmetic, one rounding per op, and
/// takes its square roots from ATen's kernel (cpu_step.rs's `aten_sqrt`; with a
/// correctly rounded sqrt instead, parameters were an ulp apart where
/// ATen's vectorized float sqrt, MKL VML, is not correctly rounded).
#[test]
fn fused_adam_step_equals_the_tensor_op_step() {
    let preps = [
        GradPrep::Mul(0.3),
        GradPrep::Div(4.0),
        GradPrep::DivClamp(4.0, 0.1),
    ];
    let (mut worst, mut worst_state) = (0.0f64, 0);
    for kind in ["adam", "adamw"] {
        for weight_decay in [0.0, 0.05] {
            for beta1 in [0.9, 0.3] {
                for prep in preps {
                    let case = format!("{kind} wd {weight_decay} beta1 {beta1} {prep:?}");
                    let spec = adam_spec(kind, weight_decay, beta1);
                    let fused_p = params(&[7, 300, 33, 1029], 3);
                    let plain_p = copy(&fused_p);
                    let mut flat = FlatGrads::attach(&fused_p, 1 << 20).unwrap();
                    let mut fused = Optimizer::new(&spec, 4);
                    let mut plain = Optimizer::new(&spec, 4);
                    for step in 0..3 {
                        set_grads(&fused_p, &plain_p, 10 + step);
                        assert!(fused
                            .step_fused(&fused_p, flat.cpu_mut().unwrap(), 0.02, prep)
                            .unwrap());
                        prepare_plain(&plain_p, prep);
                        plain.step(&plain_p, 0.02).unwrap();
                    }
                    for ((n, a), (_, b)) in fused_p.iter().zip(&plain_p) {
                        let d = ulps(a, b);
                        worst = worst.max((a - b).abs().max().double_value(&[]));
                        assert_eq!(d, 0, "{n} ({case}): {d} ulps apart");
                        assert_eq!(a.grad().abs().sum(Kind::Float).double_value(&[]), 0.0);
                    }
                    let (sa, sb) = (fused.named_state(&fused_p), plain.named_state(&plain_p));
                    assert_eq!(sa.len(), 2 * fused_p.len(), "{case}");
                    for ((n, a), (m, b)) in sa.iter().zip(&sb) {
                        assert_eq!(n, m, "{case}");
                        let d = ulps(a, b);
                        worst_state = worst_state.max(d);
                        assert_eq!(d, 0, "state {n} ({case}): {d} ulps apart");
                    }
                    assert_eq!((fused.steps, plain.steps), (3, 3), "{case}");
                }
            }
        }
    }
    eprintln!(
        "fused vs tensor-op Adam: parameters within {worst:e}, state within {worst_state} ulps"
    );
}

/// The fused Adam step and the tensor-op step take turns (a checkpoint
/// written by one, resumed by the other): same result as the tensor-op
/// step throughout.
#[test]
fn fused_and_tensor_op_adam_steps_interleave() {
    let spec = adam_spec("adamw", 0.1, 0.9);
    let a = params(&[300, 33], 4);
    let b = copy(&a);
    let mut flat = FlatGrads::attach(&a, 1 << 20).unwrap();
    let (mut oa, mut ob) = (Optimizer::new(&spec, 2), Optimizer::new(&spec, 2));
    for step in 0..4 {
        set_grads(&a, &b, 30 + step);
        if step % 2 == 1 {
            assert!(oa
                .step_fused(&a, flat.cpu_mut().unwrap(), 0.01, GradPrep::Mul(0.5))
                .unwrap());
        } else {
            prepare_plain(&a, GradPrep::Mul(0.5));
            oa.step(&a, 0.01).unwrap();
            let _g = tch::no_grad_guard();
            for (_, p) in &a {
                let _ = p.grad().zero_();
            }
        }
        prepare_plain(&b, GradPrep::Mul(0.5));
        ob.step(&b, 0.01).unwrap();
    }
    for ((n, x), (_, y)) in a.iter().zip(&b) {
        assert!(x.equal(y), "{n}");
    }
    assert_eq!(oa.steps, 4);
}

/// Adam state missing after the first step (a checkpoint without it)
/// is left to the tensor-op path: nothing is touched and the caller is
/// told.
#[test]
fn fused_adam_declines_missing_state() {
    let p = params(&[5], 1);
    let before = p[0].1.copy();
    let g = p[0].1.grad().copy();
    let mut flat = FlatGrads::attach(&p, 1 << 20).unwrap();
    let mut o = Optimizer::new(&adam_spec("adam", 0.0, 0.9), 1);
    o.load_state(&p, Vec::new(), 7).unwrap();
    assert!(!o
        .step_fused(&p, flat.cpu_mut().unwrap(), 0.1, GradPrep::Mul(1.0))
        .unwrap());
    assert!(p[0].1.equal(&before) && p[0].1.grad().equal(&g));
    assert_eq!(o.steps, 7);
    assert!(o.named_state(&p).is_empty());
}

/// Fused Adam against the engine's tensor-op pipeline (prepare, step,
/// zero the gradients) on 4M elements in four parameters: prints the
/// time per step of each, on one thread and on libtorch's threads.
/// `cargo test -p accrue-worker --release --lib adam_speed -- --ignored --nocapture`
#[test]
#[ignore = "a timing, not a check"]
fn adam_speed() {
    let sizes = [1 << 20; 4];
    let spec = adam_spec("adamw", 0.01, 0.9);
    let a = params(&sizes, 6);
    let b = copy(&a);
    let mut flat = FlatGrads::attach(&a, 1 << 23).unwrap();
    let (mut oa, mut ob) = (Optimizer::new(&spec, 4), Optimizer::new(&spec, 4));
    let before = tch::get_num_threads();
    for threads in [1, before] {
        tch::set_num_threads(threads);
        let reps = 20;
        let mut fused_s = 0.0;
        let mut plain_s = 0.0;
        for i in 0..reps + 2 {
            let t = std::time::Instant::now();
            assert!(oa
                .step_fused(&a, flat.cpu_mut().unwrap(), 0.01, GradPrep::Mul(0.5))
                .unwrap());
            let f = t.elapsed().as_secs_f64();
            let t = std::time::Instant::now();
            prepare_plain(&b, GradPrep::Mul(0.5));
            ob.step(&b, 0.01).unwrap();
            {
                let _g = tch::no_grad_guard();
                for (_, p) in &b {
                    let _ = p.grad().zero_();
                }
            }
            let p = t.elapsed().as_secs_f64();
            if i >= 2 {
                fused_s += f;
                plain_s += p;
            }
        }
        let (f, p) = (fused_s / reps as f64, plain_s / reps as f64);
        eprintln!(
            "adamw, 4M f32 elements, {threads} thread(s): fused {:.2} ms, tensor ops {:.2} ms ({:.2}x)",
            f * 1e3,
            p * 1e3,
            p / f
        );
    }
    tch::set_num_threads(before);
}
