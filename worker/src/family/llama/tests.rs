//! The fused projections and operations against the separate ones, on
//! the CPU.

use super::*;
use crate::cuda::amp::Autocast;
use crate::spec::Precision;

fn config(kv_heads: i64, bias: bool) -> LlamaConfig {
    LlamaConfig {
        vocab_size: 50,
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: kv_heads,
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        max_position_embeddings: 64,
        tie_word_embeddings: false,
        attention_bias: bias,
        mlp_bias: bias,
        initializer_range: 0.02,
        rope_scaling: Default::default(),
        arch: Default::default(),
        sliding_window: None,
        explicit_head_dim: None,
    }
}

/// Logits and every gradient of a summed loss, with the projections
/// fused or not (biases made non-zero so their concatenation counts).
fn run(c: &LlamaConfig, fused: bool, bf16: bool) -> (Tensor, Vec<Tensor>) {
    run_with(c, fused, false, bf16)
}

/// Seeded values of a shape from a generator of the test's own.
type Values = Box<dyn FnMut(&[i64], &mut dyn FnMut(&mut rand::rngs::StdRng) -> f32) -> Tensor>;

/// Box-Muller: normal(0, std).
fn normal(std: f64) -> impl FnMut(&mut rand::rngs::StdRng) -> f32 {
    use rand::Rng;
    move |r: &mut rand::rngs::StdRng| {
        let (u, v): (f64, f64) = (r.gen_range(f64::EPSILON..1.0), r.gen());
        (std * (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }
}

/// A net of `c` with seeded weights (biases non-zero), and the generator
/// for more values.
fn seeded(c: &LlamaConfig) -> (nn::VarStore, Net, Values) {
    // Every value from a generator of its own: libtorch's is global, and
    // tests on other threads draw from it at any time.
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let mut values: Values = Box::new(move |shape: &[i64], draw| {
        let n: i64 = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| draw(&mut rng)).collect();
        Tensor::from_slice(&v).view(shape)
    });
    let vs = nn::VarStore::new(Device::Cpu);
    let net = Net::new(&vs.root(), c).unwrap();
    tch::no_grad(|| {
        // In name order: the same values on every run.
        let mut vars: Vec<_> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, mut t) in vars {
            let shape = t.size();
            let fresh = if name.ends_with(".bias") {
                values(&shape, &mut |r| r.gen_range(-0.1f32..0.1))
            } else if name.ends_with("norm.weight") {
                continue;
            } else {
                values(&shape, &mut normal(c.initializer_range))
            };
            t.copy_(&fresh);
        }
    });
    (vs, net, values)
}

/// [`run`], with the fused operations (their reference implementation:
/// no CUDA here) when `ops`.
fn run_with(c: &LlamaConfig, fused: bool, ops: bool, bf16: bool) -> (Tensor, Vec<Tensor>) {
    let (vs, mut net, mut values) = seeded(c);
    net.set_fused_projections(fused);
    if ops {
        net.set_fused_ops(true, false);
    }
    use rand::Rng;
    let ids = values(&[3, 9], &mut |r| r.gen_range(0..c.vocab_size) as f32).to_kind(Kind::Int64);
    let logits = {
        let _amp = bf16.then(|| Autocast::enter(Device::Cpu, Precision::Bf16).unwrap());
        net.forward(&ids).unwrap()
    };
    let weights = values(&logits.size(), &mut normal(1.0));
    (&logits * &weights).sum(Kind::Float).backward();
    let mut vars: Vec<_> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let grads = vars.iter().map(|(_, t)| t.grad().copy()).collect();
    (logits.detach(), grads)
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let scale = b.abs().max().double_value(&[]).max(1e-30);
    (a - b).abs().max().double_value(&[]) / scale
}

/// One product for q, k, v and one for gate, up computes the separate
/// products' function: in fp32 (complex RoPE) within float rounding,
/// with GQA and biases too; under bf16 autocast (the real RoPE on the
/// CPU) within bf16's rounding, since the input's gradient is then
/// summed inside one product instead of over three bf16 ones.
#[test]
fn fused_projections_compute_the_separate_ones() {
    for (kv, bias) in [(4, false), (2, true)] {
        let c = config(kv, bias);
        for (bf16, tol) in [(false, 1e-5), (true, 2e-2)] {
            let (la, ga) = run(&c, false, bf16);
            let (lb, gb) = run(&c, true, bf16);
            let d = rel(&lb, &la);
            assert!(d <= tol, "kv {kv} bias {bias} bf16 {bf16}: logits {d:e}");
            assert_eq!(ga.len(), gb.len());
            let mut worst = 0f64;
            for (i, (a, b)) in ga.iter().zip(&gb).enumerate() {
                let d = rel(b, a);
                assert!(
                    d <= tol,
                    "kv {kv} bias {bias} bf16 {bf16}: gradient {i}: {d:e}"
                );
                worst = worst.max(d);
            }
            eprintln!("kv {kv} bias {bias} bf16 {bf16}: logits {d:e}, gradients {worst:e}");
        }
    }
}

/// Under bf16 autocast the fused operations (norm cast for the
/// projection, RoPE with the split into heads, SwiGLU; their ATen
/// reference here) compute the model the fused projections compute
/// without them: the logits to the bit (the operations equal
/// transformers' chains: tests/fused_ops.rs), the gradients within
/// float rounding (the norm's hand-written backward). Without autocast
/// they are not taken: the fp32 run is the same to the bit.
#[test]
fn fused_ops_compute_the_model() {
    for (kv, bias) in [(4, false), (2, true)] {
        let c = config(kv, bias);
        let (la, ga) = run_with(&c, true, false, true);
        let (lb, gb) = run_with(&c, true, true, true);
        let d = rel(&lb, &la);
        let worst = ga
            .iter()
            .zip(&gb)
            .map(|(a, b)| rel(b, a))
            .fold(0f64, f64::max);
        eprintln!("kv {kv} bias {bias}: fused ops under bf16: logits {d:e}, gradients {worst:e}");
        assert!(
            d == 0.0 && worst <= 1e-5,
            "logits {d:e}, gradients {worst:e}"
        );
        let (la, ga) = run_with(&c, true, false, false);
        let (lb, gb) = run_with(&c, true, true, false);
        assert_eq!(rel(&lb, &la), 0.0);
        for (a, b) in ga.iter().zip(&gb) {
            assert_eq!(rel(b, a), 0.0);
        }
    }
}

/// RoPE scaling (issue 39) against the formulas in f64: linear divides
/// every frequency; llama3 divides the long wavelengths, keeps the short
/// ones and interpolates the band between.
#[test]
fn scaled_frequencies_follow_the_formulas() {
    use crate::spec::RopeScaling;
    let (d, theta): (i64, f64) = (8, 10000.0);
    let plain: Vec<f64> = (0..d / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f64 / d as f64))
        .collect();
    let got = |s: RopeScaling| -> Vec<f64> {
        Vec::<f32>::try_from(&super::scaled_inv_freq(d, theta, &s).unwrap())
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect()
    };
    let close = |a: &[f64], b: &[f64]| {
        a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-6 * y.abs())
    };
    assert!(close(&got(RopeScaling::Default), &plain));
    assert!(close(&got(RopeScaling::Dynamic { factor: 4.0 }), &plain));
    let linear: Vec<f64> = plain.iter().map(|f| f / 2.0).collect();
    assert!(close(&got(RopeScaling::Linear { factor: 2.0 }), &linear));
    let (factor, low, high, old) = (8.0, 1.0, 4.0, 16.0);
    let want: Vec<f64> = plain
        .iter()
        .map(|&f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < old / high {
                f
            } else if wavelen > old / low {
                f / factor
            } else {
                let s = (old / wavelen - low) / (high - low);
                (1.0 - s) * f / factor + s * f
            }
        })
        .collect();
    let llama3 = got(RopeScaling::Llama3 {
        factor,
        low_freq_factor: low,
        high_freq_factor: high,
        original_max_position_embeddings: 16,
    });
    assert!(close(&llama3, &want), "{llama3:?} vs {want:?}");
    // Each branch is taken: kept (wavelength 6.28 is in the band here, so
    // the first is smoothed), divided.
    assert!(llama3[0] < plain[0] && llama3[0] > plain[0] / factor);
    assert!((llama3[3] - plain[3] / factor).abs() <= 1e-9);
}

/// Mistral's window (issue 39): query i (at position past + i) sees key j
/// when j <= past + i and past + i - j < window; no mask where the window
/// reaches every earlier key.
#[test]
fn the_sliding_window_mask_sees_the_last_window_positions() {
    let mask = |past, t, w| {
        super::window_mask(past, t, w, Device::Cpu)
            .unwrap()
            .map(|m| Vec::<Vec<bool>>::try_from(&m.to_kind(tch::Kind::Bool)).unwrap())
    };
    assert_eq!(mask(0, 4, None), None);
    assert_eq!(
        mask(0, 4, Some(4)),
        None,
        "a window of the whole row is causal"
    );
    assert_eq!(
        mask(0, 4, Some(2)).unwrap(),
        vec![
            vec![true, false, false, false],
            vec![true, true, false, false],
            vec![false, true, true, false],
            vec![false, false, true, true],
        ]
    );
    // Two new tokens after three cached: positions 3 and 4.
    assert_eq!(
        mask(3, 2, Some(3)).unwrap(),
        vec![
            vec![false, true, true, true, false],
            vec![false, false, true, true, true],
        ]
    );
}

/// Issue 39, packed rows: rows packed into samples (each with its own
/// positions and a block-diagonal causal mask) give every row the logits
/// and the gradients it gives alone, with GQA and biases, with Mistral's
/// window shorter than a row, in fp32 (complex RoPE) and under bf16
/// autocast (the real RoPE; bf16's rounding of different product shapes).
#[test]
fn packed_rows_compute_each_row_alone() {
    use rand::Rng;
    let mut windowed = config(2, true);
    windowed.sliding_window = Some(3);
    for (name, c, bf16, tol) in [
        ("gqa+bias", config(2, true), false, 1e-5),
        ("window 3", windowed, false, 1e-5),
        ("bf16", config(4, false), true, 2e-2),
    ] {
        // Two samples of T = 16: rows of 5, 3, 7 (and one pad), 9, 4
        // (and three pads).
        let t = 16i64;
        let packs: [&[i64]; 2] = [&[5, 3, 7], &[9, 4]];
        let grads_of = |packed: bool| -> (Vec<Tensor>, Vec<Tensor>) {
            let (vs, net, mut values) = seeded(&c);
            let rows: Vec<Vec<Tensor>> = packs
                .iter()
                .map(|lens| {
                    lens.iter()
                        .map(|&l| {
                            values(&[l], &mut |r| r.gen_range(0..c.vocab_size) as f32)
                                .to_kind(Kind::Int64)
                        })
                        .collect()
                })
                .collect();
            let weights: Vec<Vec<Tensor>> = packs
                .iter()
                .map(|lens| {
                    lens.iter()
                        .map(|&l| values(&[l, c.vocab_size], &mut normal(1.0)))
                        .collect()
                })
                .collect();
            let _amp = bf16.then(|| Autocast::enter(Device::Cpu, Precision::Bf16).unwrap());
            let mut logits = Vec::new();
            let loss = if packed {
                let (mut ids, mut pos, mut w) = (Vec::new(), Vec::new(), Vec::new());
                for (r, lens) in packs.iter().enumerate() {
                    let used: i64 = lens.iter().sum();
                    let pad = t - used;
                    let mut row_ids: Vec<&Tensor> = rows[r].iter().collect();
                    let zeros = Tensor::zeros([pad], (Kind::Int64, Device::Cpu));
                    row_ids.push(&zeros);
                    ids.push(Tensor::cat(&row_ids, 0));
                    let mut p: Vec<Tensor> = lens
                        .iter()
                        .map(|&l| Tensor::arange(l, (Kind::Int64, Device::Cpu)))
                        .collect();
                    p.push(Tensor::arange(pad, (Kind::Int64, Device::Cpu)));
                    pos.push(Tensor::cat(&p, 0));
                    let mut ws: Vec<&Tensor> = weights[r].iter().collect();
                    let wz = Tensor::zeros([pad, c.vocab_size], (Kind::Float, Device::Cpu));
                    ws.push(&wz);
                    w.push(Tensor::cat(&ws, 0));
                }
                let inputs =
                    packed::inputs(&Tensor::stack(&ids, 0), &Tensor::stack(&pos, 0)).unwrap();
                let out = net.forward(&inputs).unwrap();
                for (r, lens) in packs.iter().enumerate() {
                    let mut at = 0;
                    for &l in lens.iter() {
                        logits.push(out.get(r as i64).narrow(0, at, l).detach());
                        at += l;
                    }
                }
                (&out * Tensor::stack(&w, 0)).sum(Kind::Float)
            } else {
                let mut total = Tensor::zeros([], (Kind::Float, Device::Cpu));
                for (r, lens) in packs.iter().enumerate() {
                    for i in 0..lens.len() {
                        let out = net.forward(&rows[r][i].view([1, -1])).unwrap().get(0);
                        logits.push(out.detach());
                        total += (&out * &weights[r][i]).sum(Kind::Float);
                    }
                }
                total
            };
            loss.backward();
            let mut vars: Vec<_> = vs.variables().into_iter().collect();
            vars.sort_by(|a, b| a.0.cmp(&b.0));
            (logits, vars.iter().map(|(_, v)| v.grad().copy()).collect())
        };
        let (alone_logits, alone_grads) = grads_of(false);
        let (packed_logits, packed_grads) = grads_of(true);
        for (i, (p, a)) in packed_logits.iter().zip(&alone_logits).enumerate() {
            let d = rel(p, a);
            assert!(d <= tol, "{name}: row {i}'s logits differ by {d}");
        }
        for (i, (p, a)) in packed_grads.iter().zip(&alone_grads).enumerate() {
            let d = rel(p, a);
            assert!(d <= tol, "{name}: gradient {i} differs by {d}");
        }
    }
}

/// The packed mask: same row (a row begins at position 0), causal, within
/// the window.
#[test]
fn the_packed_mask_is_block_diagonal_and_causal() {
    let positions = Tensor::from_slice(&[0i64, 1, 2, 0, 1, 0]).view([1, 6]);
    let p = packed::Packed {
        ids: positions.zeros_like(),
        positions,
    };
    let rows = |m: Tensor| Vec::<Vec<bool>>::try_from(&m.get(0).get(0)).unwrap();
    let (t, f) = (true, false);
    assert_eq!(
        rows(p.mask(None).unwrap()),
        vec![
            vec![t, f, f, f, f, f],
            vec![t, t, f, f, f, f],
            vec![t, t, t, f, f, f],
            vec![f, f, f, t, f, f],
            vec![f, f, f, t, t, f],
            vec![f, f, f, f, f, t],
        ]
    );
    assert_eq!(rows(p.mask(Some(2)).unwrap())[2], vec![f, t, t, f, f, f]);
}

/// Issue 40: the model cut into pipeline stages (the embedding with
/// layer 0; layers 1 and 2; layer 3 with the final norm), each stage's
/// output the next one's input, computes the whole forward's features and
/// gradients bit for bit (the same operations in the same order).
#[test]
fn stages_chained_compute_the_whole_model() {
    use rand::Rng;
    let mut c = config(2, true);
    c.num_hidden_layers = 4;
    let run = |stages: &[std::ops::Range<usize>]| -> (Tensor, Vec<Tensor>) {
        let (vs, net, mut values) = seeded(&c);
        let ids =
            values(&[2, 7], &mut |r| r.gen_range(0..c.vocab_size) as f32).to_kind(Kind::Int64);
        let features = if stages.is_empty() {
            Headed::features(&net, &ids).unwrap()
        } else {
            let mut x = ids;
            for s in stages {
                x = super::super::Staged::stage_forward(&net, &x, s.clone()).unwrap();
            }
            x
        };
        let weights = values(&features.size(), &mut normal(1.0));
        (&features * &weights).sum(Kind::Float).backward();
        let mut vars: Vec<_> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let grad = |t: &Tensor| {
            let g = t.grad();
            if g.defined() {
                g.copy()
            } else {
                t.zeros_like()
            }
        };
        (
            features.detach(),
            vars.iter().map(|(_, t)| grad(t)).collect(),
        )
    };
    let (whole, whole_grads) = run(&[]);
    // Blocks: 0 embed, 1-4 layers, 5 head.
    let (staged, staged_grads) = run(&[0..2, 2..4, 4..6]);
    assert!(
        staged.equal(&whole),
        "features differ by {}",
        rel(&staged, &whole)
    );
    for (i, (a, b)) in staged_grads.iter().zip(&whole_grads).enumerate() {
        assert!(a.equal(b), "gradient {i} differs by {}", rel(a, b));
    }
    // One stage of everything is the whole model too; a wrong cut is not.
    let all_blocks: std::ops::Range<usize> = 0..6;
    let (one, _) = run(std::slice::from_ref(&all_blocks));
    assert!(one.equal(&whole));
    let (skipped, _) = run(&[0..2, 3..6]);
    assert!(!skipped.equal(&whole));
}
