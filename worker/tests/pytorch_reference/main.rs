//! The engine against PyTorch itself (the installed torch 2.11.0): the
//! engine's clipping at W = 1 and W = 2, DistributedSampler order, whole
//! training runs, and W = 2 against PyTorch DDP + no_sync under torchrun.

#[path = "../common/mod.rs"]
mod common;

use accrue_worker::engine::RunOptions;
use accrue_worker::source::rng::Mt19937;
use accrue_worker::source::sampler::ShardSpec;
use accrue_worker::{Engine, SingleRank};
use common::procs::{run_ranks, Torchrun};
use common::*;
use std::path::Path;
use std::time::Duration;
use tch::Tensor;
use tempfile::TempDir;

mod amp;
mod clipping;
mod ddp;
mod end_to_end;

/// Tensors by name (a model's parameters).
type Named = Vec<(String, Tensor)>;

/// `(max |a - b|, max over tensors of max|a - b| / max|b|)` over the
/// tensors of `want`, matched by name in `got`.
fn differences(got: &[(String, Tensor)], want: &[(String, Tensor)]) -> (f64, f64) {
    assert_eq!(got.len(), want.len(), "tensor counts differ");
    let mut worst = (0.0f64, 0.0f64);
    for (name, w) in want {
        let g = &got
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("{name} missing"))
            .1;
        let abs = (g - w).abs().max().double_value(&[]);
        let rel = abs / w.abs().max().double_value(&[]).max(1e-30);
        worst = (worst.0.max(abs), worst.1.max(rel));
    }
    worst
}

/// Writes `d/data.safetensors` (`x` [n, 6] normal, `y` in 0..4) and
/// `d/init.safetensors`: weights for torch_reference.py's MLP (6 -> 16 ->
/// 12 -> 4, named as its state_dict, uniform in +-1/sqrt(fan_in) as
/// torch.nn.Linear draws them), seeded. Written here rather than by
/// Python to save a Python start.
fn prepare(d: &Path, n: i64) {
    // A generator of its own: tests in other threads share libtorch's.
    let mut rng = Mt19937::new(3);
    let x: Vec<f32> = (0..n * 6).map(|_| rng.next_normal()).collect();
    let y: Vec<i64> = (0..n).map(|_| (rng.next_u32() % 4) as i64).collect();
    let x = Tensor::from_slice(&x).view([n, 6]);
    let y = Tensor::from_slice(&y);
    Tensor::write_safetensors(&[("x", &x), ("y", &y)], d.join("data.safetensors")).unwrap();
    let widths = [6i64, 16, 12, 4];
    let mut init = Vec::new();
    for (i, w) in widths.windows(2).enumerate() {
        let bound = 1.0 / (w[0] as f32).sqrt();
        for (name, shape) in [("weight", &[w[1], w[0]][..]), ("bias", &[w[1]][..])] {
            let v: Vec<f32> = (0..shape.iter().product::<i64>())
                .map(|_| (2.0 * rng.next_f32() - 1.0) * bound)
                .collect();
            init.push((
                format!("{}.{name}", 2 * i),
                Tensor::from_slice(&v).view(shape),
            ));
        }
    }
    Tensor::write_safetensors(&init, d.join("init.safetensors")).unwrap();
}

/// Largest `|a - b| / |b|` over two lists of per-step norms.
fn norm_differences(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "step counts differ");
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / w.abs().max(1e-30))
        .fold(0.0, f64::max)
}

/// Clipping as configured in a case.
#[derive(Clone, Copy, Debug)]
enum Clip {
    /// `max_norm` with `norm_type = inf` (clip_grad_norm_).
    NormInf(f64),
    /// `clip_value` (clip_grad_value_).
    Value(f64),
}
