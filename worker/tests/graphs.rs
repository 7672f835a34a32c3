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
/// (graph replays, eager reason, loss scale, skipped, loss, grad norm),
/// (sync graph replayed, sync eager reason).
type End = (
    Vec<(String, Tensor)>,
    Vec<(u64, String, f64, bool, f64, f64)>,
    Vec<(bool, String)>,
);

/// Runs `text` on `world` ranks (threads over a loopback ring).
fn run(text: &str, world: usize, body_only: bool) -> Vec<End> {
    let text = text.to_string();
    on_ring(world, move |rank, ring| {
        let dir = TempDir::new().unwrap();
        let opts = RunOptions {
            checkpoint_dir: Some(dir.path().to_path_buf()),
            graph_body_only: body_only,
            // CUDA's eager step (tensor ops), not the fused CPU pass.
            unfused_step: true,
            ..Default::default()
        };
        let mut e = Engine::new(spec(&text), ring, opts).unwrap_or_else(|e| panic!("{e}"));
        let mut steps = Vec::new();
        let mut syncs = Vec::new();
        e.run(|ev| {
            if let Event::Step(r) = ev {
                syncs.push((r.sync_graph_replayed, r.sync_eager_reason.clone()));
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
        (state, steps, syncs)
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

/// The bodies (micro-step and sync step) equal the eager steps; reasons
/// say which ran eagerly.
fn body_equals_eager(text: &str, world: usize, short: Option<usize>) {
    let eager = run(text, world, false);
    let body = run(text, world, true);
    for (rank, ((es, esteps, esyncs), (bs, bsteps, bsyncs))) in eager.iter().zip(&body).enumerate()
    {
        // The eager run's sync steps all eager; the body run's from its
        // first step that made the optimizer's state on.
        assert!(esyncs
            .iter()
            .all(|s| *s == (false, "the device is the CPU".to_string())));
        let made = bsteps
            .iter()
            .position(|s| !s.3)
            .expect("a step that was not skipped");
        for (i, s) in bsyncs.iter().enumerate() {
            let want = if i <= made {
                "the optimizer makes its state in its first step"
            } else {
                ""
            };
            assert_eq!(
                s,
                &(false, want.to_string()),
                "rank {rank} step {i}: {bsyncs:?}"
            );
        }
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

/// `text`'s eager run skips a step at or after step `from` (0-based), and
/// its bodies equal its eager steps.
fn skips_and_body_equals_eager(text: &str, world: usize, from: usize) {
    let eager = run(text, world, false);
    assert!(
        eager[0].1.iter().skip(from).any(|s| s.3),
        "a step from {from} on must be skipped: {:?}",
        eager[0].1
    );
    body_equals_eager(text, world, None);
}

#[test]
fn fp16_body_equals_eager_through_an_overflow() {
    let d = TempDir::new().unwrap();
    skips_and_body_equals_eager(&fp16_overflow_job(d.path()), 2, 0);
}

/// `job`'s text with another clipping table, optimizer table and
/// normalization.
fn variant(text: &str, clipping: &str, optimizer: &str, normalize: &str) -> String {
    let swap = |t: String, from: &str, to: &str| {
        assert!(t.contains(from), "{from} not in {t}");
        t.replace(from, to)
    };
    let t = swap(text.to_string(), "max_norm = 0.5\n", clipping);
    let t = swap(t, "kind = \"sgd\"\nlr = 0.05\nmomentum = 0.9\n", optimizer);
    swap(
        t,
        "normalize = \"mean\"",
        &format!("normalize = \"{normalize}\""),
    )
}

/// The sync body's numbers for every optimizer and clip: Adam (L2 decay)
/// and AdamW, whose bias corrections change every step; SGD with
/// dampening and decay under clip_value; nesterov without a clip and
/// global_count normalization.
fn sync_variants() -> Vec<String> {
    let base = job("mlp", "[6]", 64, 2, "fp32", "");
    vec![
        variant(
            &base,
            "max_norm = 0.3\nnorm_type = inf\n",
            "kind = \"adam\"\nlr = 0.01\nweight_decay = 0.05\n",
            "mean",
        ),
        variant(
            &base,
            "max_norm = 0.5\n",
            "kind = \"adamw\"\nlr = 0.01\nweight_decay = 0.1\n",
            "global_count",
        ),
        variant(
            &base,
            "clip_value = 0.01\n",
            "kind = \"sgd\"\nlr = 0.05\nmomentum = 0.8\ndampening = 0.25\nweight_decay = 0.01\n",
            "sum",
        ),
        variant(
            &base,
            "",
            "kind = \"sgd\"\nlr = 0.05\nmomentum = 0.9\nnesterov = true\n",
            "global_count",
        ),
    ]
}

#[test]
fn sync_body_equals_eager_for_adam_adamw_sgd_and_every_clip() {
    for text in sync_variants() {
        body_equals_eager(&text, 2, None);
    }
}

/// fp32 Adam on `d`/nan.safetensors (written here), whose sample 40 is
/// NaN, with on_nonfinite = "skip".
fn nan_adam_job(d: &std::path::Path) -> String {
    let data = poisoned_data(d, "nan.safetensors", 40, 1, f64::NAN);
    let text = variant(
        &job("mlp", "[6]", 64, 2, "fp32", ""),
        "max_norm = 0.5\non_nonfinite = \"skip\"\n",
        "kind = \"adam\"\nlr = 0.01\n",
        "mean",
    );
    on_tensors(&text, &data, false)
}

#[test]
fn a_nonfinite_step_in_the_sync_body_skips_as_eager_does() {
    // Adam's state and the parameters must come through the skipped step
    // untouched.
    let d = TempDir::new().unwrap();
    skips_and_body_equals_eager(&nan_adam_job(d.path()), 1, 1);
}

/// On the GPU: the graphed job and the same job with `cuda_graphs =
/// false` end at the same parameters, and the graph replayed.
fn graphed_equals_eager_on_cuda(text: &str, world: usize, tol: f64) {
    // Eight epochs: at W = 2, k = 4 that is 8 steps, so the sync graph (its
    // first step eager, three warm-ups, then the capture) replays too.
    assert!(text.contains("epochs = 2\n"));
    let text = text
        .replace("device = \"cpu\"", "device = \"cuda\"")
        .replace("epochs = 2\n", "epochs = 8\n");
    let graphed = run(&text, world, false);
    let eager = run(
        &(text + "\n[performance]\ncuda_graphs = false\n"),
        world,
        false,
    );
    for (rank, ((gs, gsteps, gsyncs), (es, _, _))) in graphed.iter().zip(&eager).enumerate() {
        let d = max_rel_diff(gs, es);
        eprintln!("rank {rank}: graphed vs eager max relative difference {d:e}");
        assert!(d <= tol, "rank {rank}: {d:e} > {tol:e}");
        assert!(
            gsteps.iter().any(|s| s.0 > 0),
            "rank {rank}: no micro-step replayed a graph (a build without ACCRUE_CUDA=1?): {gsteps:?}"
        );
        assert!(
            gsyncs.iter().any(|s| s.0),
            "rank {rank}: no sync step replayed its graph: {gsyncs:?}"
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
    // Non-finite steps under replay: skipped by both (fp16: the same
    // scales; fp32 Adam: its state untouched), and the sync variants.
    let d = TempDir::new().unwrap();
    graphed_equals_eager_on_cuda(&fp16_overflow_job(d.path()), 2, 1e-6);
    graphed_equals_eager_on_cuda(&nan_adam_job(d.path()), 1, 1e-6);
    for text in sync_variants() {
        graphed_equals_eager_on_cuda(&text, 2, 1e-6);
    }
}
