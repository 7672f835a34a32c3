//! The Llama family's fused operations (worker/src/cuda/fused_ops.rs) against
//! the chains of ops transformers runs under autocast, through autograd:
//! on the CPU their reference implementation (ATen's ops, with a
//! hand-written backward), on CUDA accrue's kernels against that
//! reference (ignored without CUDA: scripts/gpu-checks.sh runs them).

mod common;

use accrue_worker::cuda::fused_ops::{
    add_rms_norm_cast, cross_entropy_sum, kernels_built, rms_norm_cast, rope_qkv, swiglu,
};
use common::cuda_or_skip;
use tch::{Device, Kind, Tensor};

const EPS: f64 = 1e-6;

/// Largest |a - b| / max|b|.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
    let scale = b.abs().max().double_value(&[]).max(1e-30);
    (&a - &b).abs().max().double_value(&[]) / scale
}

/// How many elements differ at all.
fn differing(a: &Tensor, b: &Tensor) -> i64 {
    a.to_kind(Kind::Double)
        .ne_tensor(&b.to_kind(Kind::Double))
        .sum(Kind::Int64)
        .int64_value(&[])
}

fn leaf(t: Tensor) -> Tensor {
    t.detach().set_requires_grad(true)
}

/// transformers' LlamaRMSNorm and autocast's cast of its output.
fn norm_chain(x: &Tensor, w: &Tensor, kind: Kind) -> Tensor {
    let variance = x
        .pow_tensor_scalar(2)
        .mean_dim(Some([-1i64].as_slice()), true, None::<Kind>);
    (w * (x * (variance + EPS).rsqrt())).to_kind(kind)
}

/// transformers' q/k/v from a fused projection's output: split into
/// heads, `x * cos + rotate_half(x) * sin` with fp32 cos and sin (the
/// T-typed x widened by the product), then autocast's cast for attention.
fn rope_chain(y: &Tensor, cos: &Tensor, sin: &Tensor, hq: i64, hkv: i64) -> [Tensor; 3] {
    let (n, t, f) = y.size3().unwrap();
    let d = f / (hq + 2 * hkv);
    let kind = y.kind();
    let heads = |from: i64, count: i64| {
        y.narrow(-1, from * d, count * d)
            .view([n, t, count, d])
            .transpose(1, 2)
    };
    let emb = |c: &Tensor| Tensor::cat(&[c, c], -1).view([1, 1, t, d]);
    let (c, s) = (emb(cos), emb(sin));
    let turn = |x: Tensor| {
        let x1 = x.narrow(-1, 0, d / 2);
        let x2 = x.narrow(-1, d / 2, d / 2);
        let half = Tensor::cat(&[&x2.neg(), &x1], -1);
        (&x * &c + &half * &s).to_kind(kind).contiguous()
    };
    [
        turn(heads(0, hq)),
        turn(heads(hq, hkv)),
        heads(hq + hkv, hkv).contiguous(),
    ]
}

/// transformers' loss on the head's logits: `logits.float()`, then
/// cross_entropy with reduction sum (-100 ignored).
fn cross_entropy_chain(logits: &Tensor, targets: &Tensor) -> Tensor {
    let v = logits.size().last().copied().unwrap();
    logits
        .to_kind(Kind::Float)
        .view([-1, v])
        .cross_entropy_loss::<Tensor>(&targets.view([-1]), None, tch::Reduction::Sum, -100, 0.0)
}

fn swiglu_chain(y: &Tensor) -> Tensor {
    let i = y.size().last().copied().unwrap() / 2;
    y.narrow(-1, 0, i).silu() * y.narrow(-1, i, i)
}

/// The gradients of `sum(out * probe)` over `inputs`, `probe` fixed per
/// output.
fn grads(outs: &[Tensor], probes: &[Tensor], inputs: &[&Tensor]) -> Vec<Tensor> {
    let loss = outs
        .iter()
        .zip(probes)
        .map(|(o, p)| (o.to_kind(Kind::Float) * p).sum(Kind::Float))
        .reduce(|a, b| a + b)
        .unwrap();
    Tensor::run_backward(&[loss], inputs, false, false)
}

fn probes_like(outs: &[Tensor]) -> Vec<Tensor> {
    outs.iter()
        .map(|o| Tensor::randn(o.size(), (Kind::Float, o.device())))
        .collect()
}

/// One unit in the last place of `kind` at 1 (relative tolerance).
fn ulp(kind: Kind) -> f64 {
    if kind == Kind::BFloat16 {
        1.0 / 128.0
    } else {
        1.0 / 1024.0
    }
}

/// Inputs of the operations on `device`, `kind` activations.
struct Case {
    x: Tensor,
    /// A residual branch in the activation type, x's shape.
    a: Tensor,
    w: Tensor,
    y_qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    y_mlp: Tensor,
    logits: Tensor,
    targets: Tensor,
    hq: i64,
    hkv: i64,
}

fn case(device: Device, kind: Kind) -> Case {
    tch::manual_seed(5);
    let (n, t, h, hq, hkv, d, inner) = (2, 24, 96, 4, 2, 16, 80);
    let f = (Kind::Float, device);
    let positions = Tensor::arange(t, f).unsqueeze(-1);
    let inv = (Tensor::arange_start_step(0, d, 2, f) / d as f64 * -(10000f64.ln())).exp();
    let freqs = positions * inv.unsqueeze(0);
    Case {
        x: leaf(Tensor::randn([n, t, h], f) * 3.0),
        a: leaf(Tensor::randn([n, t, h], f).to_kind(kind)),
        w: leaf(Tensor::randn([h], f) * 0.1 + 1.0),
        y_qkv: leaf(Tensor::randn([n, t, (hq + 2 * hkv) * d], f).to_kind(kind)),
        cos: freqs.cos(),
        sin: freqs.sin(),
        y_mlp: leaf(Tensor::randn([n, t, 2 * inner], f).to_kind(kind)),
        // A vocabulary wider than a block's threads, some targets ignored.
        logits: leaf((Tensor::randn([n, t, 1000], f) * 4.0).to_kind(kind)),
        targets: Tensor::randint(1000, [n, t], (Kind::Int64, device))
            .where_scalarother(&Tensor::rand([n, t], f).ge(0.2), -100),
        hq,
        hkv,
    }
}

/// Each operation's output and gradients (`fused`: through fused_ops
/// with or without `kernels`; else the chains above).
fn outputs(c: &Case, kind: Kind, fused: bool, kernels: bool) -> Vec<(String, Tensor)> {
    let mut got = Vec::new();
    let mut record = |name: &str, outs: Vec<Tensor>, inputs: &[&Tensor]| {
        tch::manual_seed(9);
        let probes = probes_like(&outs);
        let gs = grads(&outs, &probes, inputs);
        for (i, o) in outs.iter().enumerate() {
            got.push((format!("{name}.out{i}"), o.detach()));
        }
        for (i, g) in gs.into_iter().enumerate() {
            got.push((format!("{name}.grad{i}"), g));
        }
    };
    let norm = if fused {
        rms_norm_cast(&c.x, &c.w, EPS, kind, kernels).unwrap()
    } else {
        norm_chain(&c.x, &c.w, kind)
    };
    record("rms_norm_cast", vec![norm], &[&c.x, &c.w]);
    let (sum, norm) = if fused {
        add_rms_norm_cast(&c.x, &c.a, &c.w, EPS, kernels).unwrap()
    } else {
        // transformers: residual + hidden_states (fp32 + T), then the norm.
        let sum = &c.x + &c.a;
        let norm = norm_chain(&sum, &c.w, kind);
        (sum, norm)
    };
    record("add_rms_norm_cast", vec![sum, norm], &[&c.x, &c.a, &c.w]);
    let qkv = if fused {
        rope_qkv(&c.y_qkv, &c.cos, &c.sin, c.hq, c.hkv, kernels).unwrap()
    } else {
        rope_chain(&c.y_qkv, &c.cos, &c.sin, c.hq, c.hkv)
    };
    record("rope_qkv", Vec::from(qkv), &[&c.y_qkv]);
    let mlp = if fused {
        swiglu(&c.y_mlp, kernels).unwrap()
    } else {
        swiglu_chain(&c.y_mlp)
    };
    record("swiglu", vec![mlp], &[&c.y_mlp]);
    let loss = if fused {
        cross_entropy_sum(&c.logits, &c.targets, kernels).unwrap()
    } else {
        cross_entropy_chain(&c.logits, &c.targets)
    };
    record("cross_entropy_sum", vec![loss], &[&c.logits]);
    got
}

/// On the CPU, the reference implementation is transformers' chain: RoPE,
/// SwiGLU and the loss forward and backward bit for bit (autograd's
/// roundings to the activation type reproduced), the norm's output bit
/// for bit and its hand-written backward within float rounding of
/// autograd's; bf16 and fp16.
#[test]
fn reference_ops_are_transformers_chains_on_the_cpu() {
    for kind in [Kind::BFloat16, Kind::Half] {
        let c = case(Device::Cpu, kind);
        let fused = outputs(&c, kind, true, false);
        let chain = outputs(&c, kind, false, false);
        for ((name, a), (_, b)) in fused.iter().zip(&chain) {
            assert_eq!(a.size(), b.size(), "{kind:?} {name}");
            assert_eq!(a.kind(), b.kind(), "{kind:?} {name}");
            let r = rel(a, b);
            eprintln!("{kind:?} {name}: {} differ, {r:e}", differing(a, b));
            if name.ends_with("rms_norm_cast.grad0")
                || name == "rms_norm_cast.grad1"
                || name == "add_rms_norm_cast.grad2"
            {
                // The norm's hand-written backward (input and weight).
                assert!(r <= 1e-5, "{kind:?} {name}: {r:e}");
            } else if name == "add_rms_norm_cast.grad1" {
                // The residual's gradient: the fp32 sum of the two paths
                // (rounded in another order) cast to the type.
                assert!(r <= ulp(kind), "{kind:?} {name}: {r:e}");
            } else {
                assert_eq!(differing(a, b), 0, "{kind:?} {name}: {r:e}");
            }
        }
    }
}

/// Bad input is an error naming what is wrong, not a crash.
#[test]
fn bad_input_is_a_clear_error() {
    let c = case(Device::Cpu, Kind::BFloat16);
    let e = rms_norm_cast(&c.x, &c.w, EPS, Kind::Float, false).unwrap_err();
    assert!(e.to_string().contains("bf16 or fp16"), "{e}");
    let e = rms_norm_cast(&c.x, &c.w.narrow(0, 0, 5), EPS, Kind::BFloat16, false).unwrap_err();
    assert!(e.to_string().contains("weight of [5]"), "{e}");
    let e = rope_qkv(&c.y_qkv, &c.cos, &c.sin, 3, 2, false).unwrap_err();
    assert!(e.to_string().contains("for 7 heads"), "{e}");
    let e = rope_qkv(&c.y_qkv, &c.cos.narrow(0, 0, 3), &c.sin, c.hq, c.hkv, false).unwrap_err();
    assert!(e.to_string().contains("cos and sin"), "{e}");
    let odd = Tensor::zeros([2, 3, 5], (Kind::BFloat16, Device::Cpu));
    let e = swiglu(&odd, false).unwrap_err();
    assert!(e.to_string().contains("gate | up"), "{e}");
}

/// On CUDA, accrue's kernels against the reference run on the same GPU:
/// RoPE forward and backward bit for bit (the same fp32 products and sums
/// without contraction, the same casts), SwiGLU and the norm's output
/// within one unit of the last place of the activation type (a different
/// exp contraction or reduction order can move a rounding), the norm's
/// gradients within float rounding (summed in another order); the loss
/// within float rounding (its rows summed in another order) and its
/// gradient within one unit of the type's last place.
#[test]
#[ignore = "needs CUDA"]
fn cuda_kernels_equal_the_reference() {
    if !cuda_or_skip("cuda_kernels_equal_the_reference") {
        return;
    }
    assert!(
        kernels_built(),
        "this test binary was built without ACCRUE_CUDA=1"
    );
    for kind in [Kind::BFloat16, Kind::Half] {
        let c = case(Device::Cuda(0), kind);
        let fast = outputs(&c, kind, true, true);
        let reference = outputs(&c, kind, true, false);
        for ((name, a), (_, b)) in fast.iter().zip(&reference) {
            assert_eq!(a.size(), b.size(), "{kind:?} {name}");
            let (n, r) = (differing(a, b), rel(a, b));
            eprintln!("cuda {kind:?} {name}: {n} of {} differ, {r:e}", a.numel());
            if name.starts_with("rope_qkv") {
                assert_eq!(n, 0, "{kind:?} {name}: {r:e}");
            } else if name.ends_with("rms_norm_cast.grad0")
                || name == "rms_norm_cast.grad1"
                || name == "add_rms_norm_cast.grad2"
                || name == "add_rms_norm_cast.out0"
                || name == "cross_entropy_sum.out0"
            {
                assert!(r <= 1e-5, "{kind:?} {name}: {r:e}");
            } else {
                assert!(r <= ulp(kind), "{kind:?} {name}: {r:e}");
            }
        }
    }
}

/// A small Llama on CUDA under bf16 autocast, its training forward, loss
/// and backward through accrue's kernels against the same through the
/// reference: the loss within 1e-3 (relative), logits and every gradient
/// within a few units of bf16's last place of the largest element (the
/// norm's reduction order moves a rounding, which later layers carry);
/// a kernel that indexed or rounded wrongly would be off by far more.
#[test]
#[ignore = "needs CUDA"]
fn cuda_llama_with_kernels_equals_the_reference() {
    use accrue_worker::cuda::amp::Autocast;
    use accrue_worker::family::llama::Net;
    use accrue_worker::spec::{LlamaConfig, Precision};
    if !cuda_or_skip("cuda_llama_with_kernels_equals_the_reference") {
        return;
    }
    let c = LlamaConfig {
        vocab_size: 256,
        hidden_size: 128,
        intermediate_size: 352,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        max_position_embeddings: 128,
        tie_word_embeddings: true,
        attention_bias: false,
        mlp_bias: false,
        initializer_range: 0.02,
        rope_scaling: Default::default(),
        arch: Default::default(),
        sliding_window: None,
        explicit_head_dim: None,
    };
    let device = Device::Cuda(0);
    let run = |kernels: bool| {
        tch::manual_seed(21);
        let vs = tch::nn::VarStore::new(device);
        let mut net = Net::new(&vs.root(), &c).unwrap();
        net.set_fused_ops(true, kernels);
        let ids = Tensor::randint(c.vocab_size, [2, 64], (Kind::Int64, device));
        let logits = {
            let _amp = Autocast::enter(device, Precision::Bf16).unwrap();
            net.forward(&ids).unwrap()
        };
        // The loss as the LM objective takes it: summed over the targets,
        // through the fused loss (kernel or reference alike).
        let targets = ids.roll([-1], [1]);
        let loss = cross_entropy_sum(&logits, &targets, kernels).unwrap() / targets.numel() as f64;
        loss.backward();
        let mut vars: Vec<_> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let grads: Vec<(String, Tensor)> = vars
            .iter()
            .map(|(n, t)| (n.clone(), t.grad().copy()))
            .collect();
        (loss.double_value(&[]), logits.detach(), grads)
    };
    let (loss_k, logits_k, grads_k) = run(true);
    let (loss_r, logits_r, grads_r) = run(false);
    let dl = (loss_k - loss_r).abs() / loss_r.abs();
    let d = rel(&logits_k, &logits_r);
    eprintln!("cuda llama: loss {loss_k} against {loss_r} ({dl:e}), logits {d:e}");
    assert!(dl <= 1e-3, "loss {loss_k} against {loss_r}");
    assert!(d <= 5e-2, "logits {d:e}");
    for ((n, a), (_, b)) in grads_k.iter().zip(&grads_r) {
        let r = rel(a, b);
        eprintln!("  {n}: {r:e}");
        assert!(r <= 5e-2, "gradient of {n}: {r:e}");
    }
}
