//! Mixed precision (issue 18) on one rank: a run stopped mid-way and
//! resumed from its checkpoint continues fp16's loss scale (and its growth
//! tracker) exactly where the uninterrupted run has it, and ends at the
//! same parameters. (Against PyTorch: worker/tests/pytorch_reference/.)

mod common;

use accrue_worker::comm::collective::SingleRank;
use accrue_worker::engine::{Engine, Event, RunOptions};
use common::*;
use std::path::Path;
use tch::Tensor;
use tempfile::TempDir;

/// (step, loss scale, skipped) of every step `e` runs, and its parameters.
type Trace = (Vec<(u64, f64, bool)>, Vec<(String, Tensor)>);

fn trace(mut e: Engine<SingleRank>) -> Trace {
    let mut steps = Vec::new();
    e.run(|ev| {
        if let Event::Step(r) = ev {
            steps.push((r.step, r.loss_scale, r.skipped));
        }
    })
    .unwrap();
    (steps, snapshot(&e))
}

fn fp16_job(data: &Path) -> String {
    let text = "precision = \"fp16\"\n".to_string()
        + &mlp_job(
            64,
            4,
            2,
            "mean",
            "[loss_scaling]\ninit_scale = 1024.0\ngrowth_interval = 3\n",
        );
    on_tensors(&text, data, true)
}

#[test]
fn a_resumed_fp16_run_continues_the_loss_scale_exactly() {
    let d = TempDir::new().unwrap();
    let data = poisoned_data(d.path(), "big.safetensors", 9, 2, -1e6);
    let text = fp16_job(&data);
    assert!(text.contains("big.safetensors"));
    let opts = |dir: &Path, stop: Option<u64>, resume: bool| RunOptions {
        checkpoint_dir: Some(dir.to_path_buf()),
        stop_after_steps: stop,
        resume,
        ..Default::default()
    };
    let whole = trace(
        Engine::new(
            spec(&text),
            SingleRank,
            opts(&d.path().join("a"), None, false),
        )
        .unwrap(),
    );
    let b = d.path().join("b");
    let first = trace(Engine::new(spec(&text), SingleRank, opts(&b, Some(7), false)).unwrap());
    let rest = trace(Engine::new(spec(&text), SingleRank, opts(&b, None, true)).unwrap());
    let joined: Vec<_> = first.0.iter().chain(&rest.0).copied().collect();
    assert_eq!(first.0.len(), 7);
    assert_eq!(joined, whole.0, "the resumed run's scales and skips");
    let scales: Vec<f64> = whole.0.iter().map(|s| s.1).collect();
    assert!(
        whole.0.iter().any(|s| s.2),
        "the overflow must skip: {scales:?}"
    );
    assert!(
        scales.windows(2).any(|p| p[1] > p[0]),
        "the scale must grow: {scales:?}"
    );
    assert_eq!(
        max_rel_diff(&rest.1, &whole.1),
        0.0,
        "the same parameters, bit for bit"
    );
}
