//! CUDA graphs for the micro-step (issue 19).
//!
//! On the CPU: the graph body (the micro-batch's indices copied into a
//! static buffer, fp16's loss scale read from a tensor, the loss summed in
//! place, autocast without its cast cache), run eagerly with
//! `RunOptions::graph_body_only`, ends at exactly the parameters and
//! buffers of the ordinary eager micro-step: the MLP, LeNet-5 and ResNet-18
//! (BatchNorm's running statistics), W = 1 and 2 over the TCP ring, k = 1
//! and 4, fp32, bf16 and fp16 with an overflow that skips a step; a short
//! last micro-batch falls back to the eager micro-step with the reason in
//! the step report.
//!
//! On CUDA (skipped without it): graphed and eager runs of the same jobs
//! end at the same parameters, and the graph did replay.

mod common;

use accrue_worker::engine::{Engine, Event, RunOptions};
use common::*;
use tch::{Device, Kind, Tensor};
use tempfile::TempDir;

/// One rank's end: model state (parameters and buffers), and per step
/// (graph replays, eager reason, loss scale, skipped, loss, grad norm).
type End = (
    Vec<(String, Tensor)>,
    Vec<(u64, String, f64, bool, f64, f64)>,
);

/// Runs `text` on `world` ranks (threads over a loopback ring).
fn run(text: &str, world: usize, body_only: bool) -> Vec<End> {
    let text = text.to_string();
    on_ring(world, move |rank, ring| {
        let dir = TempDir::new().unwrap();
        let opts = RunOptions {
            checkpoint_dir: Some(dir.path().to_path_buf()),
            graph_body_only: body_only,
            ..Default::default()
        };
        let mut e = Engine::new(spec(&text), ring, opts).unwrap_or_else(|e| panic!("{e}"));
        let mut steps = Vec::new();
        e.run(|ev| {
            if let Event::Step(r) = ev {
                steps.push((
                    r.graph_replays,
                    r.eager_reason.clone(),
                    r.loss_scale,
                    r.skipped,
                    r.loss,
                    r.grad_norm,
                ));
            }
        })
        .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        let state = e
            .model()
            .state()
            .map(|(n, t)| (n.clone(), t.detach().to_device(Device::Cpu).copy()))
            .collect();
        (state, steps)
    })
}

/// Asserts every tensor of `a` equals `b`'s exactly.
fn assert_same(a: &[(String, Tensor)], b: &[(String, Tensor)], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: tensor count");
    for ((na, ta), (nb, tb)) in a.iter().zip(b) {
        assert_eq!(na, nb, "{what}");
        let diff = (ta.to_kind(Kind::Double) - tb.to_kind(Kind::Double))
            .abs()
            .max()
            .double_value(&[]);
        assert_eq!(diff, 0.0, "{what}: {na} differs by up to {diff}");
    }
}

/// A job on synthetic data: `samples` of `shape`, batch 4, `k`.
fn job(model: &str, shape: &str, samples: u64, k: u64, precision: &str, extra: &str) -> String {
    let hidden = if model == "mlp" {
        "hidden = [16]\n"
    } else {
        ""
    };
    format!(
        r#"precision = "{precision}"
name = "graphs"
seed = 3
epochs = 2
device = "cpu"
threads = 1
[model]
kind = "{model}"
{hidden}num_classes = 4
[data]
kind = "synthetic"
samples = {samples}
eval_samples = 0
shape = {shape}
classes = 4
batch_size = 4
drop_last = false
[accumulation]
steps = {k}
normalize = "mean"
[clipping]
max_norm = 0.5
[optimizer]
kind = "sgd"
lr = 0.05
momentum = 0.9
{extra}"#
    )
}

/// The body equals the eager micro-step; reasons say which ran eagerly.
fn body_equals_eager(text: &str, world: usize, short: Option<usize>) {
    let eager = run(text, world, false);
    let body = run(text, world, true);
    for (rank, ((es, esteps), (bs, bsteps))) in eager.iter().zip(&body).enumerate() {
        assert_same(bs, es, &format!("rank {rank}"));
        assert_eq!(esteps.len(), bsteps.len());
        for (e, b) in esteps.iter().zip(bsteps) {
            assert_eq!((e.0, b.0), (0, 0), "nothing replays without a capture");
            assert_eq!(e.1, "the device is the CPU");
            assert_eq!((e.2, e.3), (b.2, b.3), "loss scale and skips");
            // The loss and the norm are NaN on a skipped fp16 step.
            if !e.3 {
                assert_eq!((e.4, e.5), (b.4, b.5), "loss and grad norm");
            }
            let breason = &b.1;
            if !breason.is_empty() {
                let got = short.expect("only a short micro-batch runs eagerly");
                assert_eq!(
                    breason,
                    &format!("a micro-batch of {got} samples (the graph holds 4)")
                );
            }
        }
        if short.is_some() {
            assert!(
                bsteps.iter().any(|s| !s.1.is_empty()),
                "rank {rank}: the short micro-batch must fall back: {bsteps:?}"
            );
        }
    }
}

#[test]
fn mlp_body_equals_eager_k1_and_k4_with_a_short_last_batch() {
    // 30 samples, batch 4: the epoch's last micro-batch holds 2.
    body_equals_eager(&job("mlp", "[6]", 30, 1, "fp32", ""), 1, Some(2));
    body_equals_eager(&job("mlp", "[6]", 30, 4, "fp32", ""), 1, Some(2));
}

#[test]
fn lenet5_body_equals_eager_on_two_ranks_in_bf16() {
    // 2 x 16 samples: every micro-batch is full on both ranks.
    body_equals_eager(&job("lenet5", "[1, 28, 28]", 32, 2, "bf16", ""), 2, None);
}

#[test]
fn resnet18_body_equals_eager_with_batchnorm_buffers() {
    body_equals_eager(&job("resnet18", "[3, 32, 32]", 16, 2, "fp32", ""), 1, None);
}

/// fp16 on `d`/big.safetensors (written here): 64 samples, one of them
/// huge enough to overflow the fp16 backward, so a step is skipped.
fn fp16_overflow_job(d: &std::path::Path) -> String {
    let data = poisoned_data(d, "big.safetensors", 9, 2, -1e6);
    let text = job(
        "mlp",
        "[6]",
        64,
        2,
        "fp16",
        "[loss_scaling]\ninit_scale = 1024.0\ngrowth_interval = 3\n",
    );
    on_tensors(&text, &data, true)
}

#[test]
fn fp16_body_equals_eager_through_an_overflow() {
    let d = TempDir::new().unwrap();
    let text = fp16_overflow_job(d.path());
    let eager = run(&text, 2, false);
    assert!(
        eager[0].1.iter().any(|s| s.3),
        "the overflow must skip a step: {:?}",
        eager[0].1
    );
    body_equals_eager(&text, 2, None);
}

/// On the GPU: the graphed job and the same job with `cuda_graphs =
/// false` end at the same parameters, and the graph replayed.
fn graphed_equals_eager_on_cuda(text: &str, world: usize, tol: f64) {
    let text = text.replace("device = \"cpu\"", "device = \"cuda\"");
    let graphed = run(&text, world, false);
    let eager = run(
        &(text + "\n[performance]\ncuda_graphs = false\n"),
        world,
        false,
    );
    for (rank, ((gs, gsteps), (es, _))) in graphed.iter().zip(&eager).enumerate() {
        let d = max_rel_diff(gs, es);
        eprintln!("rank {rank}: graphed vs eager max relative difference {d:e}");
        assert!(d <= tol, "rank {rank}: {d:e} > {tol:e}");
        assert!(
            gsteps.iter().any(|s| s.0 > 0),
            "rank {rank}: no micro-step replayed a graph (a build without ACCRUE_CUDA=1?): {gsteps:?}"
        );
    }
}

#[test]
fn cuda_graphed_runs_equal_eager_runs() {
    if !cuda_or_skip("cuda_graphed_runs_equal_eager_runs") {
        return;
    }
    // cuDNN and cuBLAS may choose other kernels for a capture than for an
    // eager call (and some backward kernels add with atomics): 1e-6
    // relative, not bitwise.
    for (model, shape, samples) in [
        ("mlp", "[6]", 30),
        ("lenet5", "[1, 28, 28]", 30),
        ("resnet18", "[3, 32, 32]", 30),
    ] {
        for k in [1, 4] {
            for world in [1, 2] {
                let text = job(model, shape, samples, k, "fp32", "");
                graphed_equals_eager_on_cuda(&text, world, 1e-6);
            }
        }
    }
    // A non-finite step under replay: skipped by both, the same scales.
    let d = TempDir::new().unwrap();
    graphed_equals_eager_on_cuda(&fp16_overflow_job(d.path()), 2, 1e-6);
}
