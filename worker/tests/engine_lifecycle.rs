//! Checkpoints, resume, non-finite gradients, init weights and bad input.

mod common;

use accrue_worker::engine::RunOptions;
use accrue_worker::{Engine, Error, SingleRank};
use common::*;
use std::path::Path;
use tch::{Kind, Tensor};
use tempfile::TempDir;

const ADAM_COSINE: &str = r#"
[schedule]
kind = "cosine"
warmup_steps = 2
[checkpoint]
every_steps = 3
keep = 2
"#;

fn adam_job(samples: u64) -> String {
    mlp_job(samples, 8, 2, "global_count", ADAM_COSINE)
        .replace("kind = \"sgd\"", "kind = \"adamw\"")
        .replace("momentum = 0.9\n", "")
        .replace("epochs = 2", "max_steps = 14")
}

/// 2N steps straight equals N steps, stop, resume, N more (AdamW state,
/// cosine schedule and the data cursor mid-epoch all carried over).
#[test]
fn resume_continues_exactly() {
    let (a, b) = (TempDir::new().unwrap(), TempDir::new().unwrap());
    let job = adam_job(80); // 10 micro-batches, 5 windows per epoch
    let straight = train(spec(&job), a.path());

    let opts = |resume, stop| RunOptions {
        checkpoint_dir: Some(b.path().to_path_buf()),
        resume,
        stop_after_steps: stop,
        ..Default::default()
    };
    let mut first = Engine::new(spec(&job), SingleRank, opts(false, Some(7))).unwrap();
    let s1 = first.run(|_| {}).unwrap();
    assert!(!s1.finished);
    assert_eq!(
        (s1.state.step, s1.state.epoch, s1.state.cursor),
        (7, 1, 4),
        "stopped mid-epoch"
    );
    drop(first);
    let mut second = Engine::new(spec(&job), SingleRank, opts(true, None)).unwrap();
    assert_eq!(second.state().step, 7);
    let s2 = second.run(|_| {}).unwrap();
    assert!(s2.finished);
    assert_eq!(s2.state.step, 14);
    assert_eq!(s2.state.samples_seen, 14 * 16);
    let resumed = snapshot(&second);
    let rel = max_rel_diff(&resumed, &straight);
    assert_eq!(
        rel, 0.0,
        "resumed run differs from the straight run by {rel:e}"
    );
}

/// Layout, keep and LATEST of a run that ends normally (atomicity under a
/// kill: `a_writer_killed_mid_checkpoint_leaves_latest_complete`).
#[test]
fn checkpoint_layout_keep_and_latest() {
    let dir = TempDir::new().unwrap();
    let mut e = engine(spec(&adam_job(80)), dir.path());
    let mut written = Vec::new();
    e.run(|ev| {
        if let accrue_worker::Event::Checkpoint(p) = ev {
            written.push(p.file_name().unwrap().to_string_lossy().to_string());
        }
    })
    .unwrap();
    // every 3 steps, and always the final step 14.
    assert_eq!(
        written,
        ["step-3", "step-6", "step-9", "step-12", "step-14"]
    );
    let mut entries: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    entries.sort();
    assert_eq!(
        entries,
        [
            ".accrue-writer.lock",
            "LATEST",
            "OWNER.json",
            "step-12",
            "step-14"
        ],
        "keep = 2, no temporary folders left (the writer lock's file stays)"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("LATEST"))
            .unwrap()
            .trim(),
        "step-14"
    );
    let last = dir.path().join("step-14");
    let model = Tensor::read_safetensors(last.join("model.safetensors")).unwrap();
    let names: Vec<&str> = model.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.len(), 4);
    for n in ["0.weight", "0.bias", "2.weight", "2.bias"] {
        assert!(names.contains(&n), "model.safetensors lacks {n}: {names:?}");
    }
    let opt = Tensor::read_safetensors(last.join("optimizer.safetensors")).unwrap();
    assert!(opt.iter().any(|(n, _)| n == "0.weight.exp_avg_sq"));
    let trainer: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(last.join("trainer.json")).unwrap()).unwrap();
    assert_eq!(trainer["step"], 14);
    assert_eq!(trainer["optimizer_steps"], 14);
    assert_eq!(trainer["samples_seen"], 14 * 16);
    // The saved weights are the engine's.
    let w = model
        .iter()
        .find(|(n, _)| n == "0.weight")
        .unwrap()
        .1
        .shallow_clone();
    assert_eq!(
        e.parameters()[0].0,
        "0.weight",
        "parameters in module order"
    );
    assert!(w.equal(&e.parameters()[0].1.detach()));
}

/// A job whose checkpoints are large next to its steps (1.1 M parameters
/// with AdamW state, 13 MB per checkpoint; b = 2): the writer spends most
/// of its time in `checkpoint::write`, so a kill lands there.
const BIG_CHECKPOINTS: &str = r#"
name = "atomic"
seed = 1
max_steps = 1000000
device = "cpu"
threads = 1
[model]
kind = "mlp"
hidden = [1024, 1024]
[data]
kind = "synthetic"
samples = 4096
eval_samples = 16
shape = [64]
classes = 4
batch_size = 2
[accumulation]
steps = 1
[optimizer]
kind = "adamw"
lr = 0.001
[checkpoint]
every_steps = 1
keep = 2
"#;

/// The temporary folders of checkpoints being written in `dir`.
fn temporaries(dir: &Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    let n = p.file_name().unwrap().to_string_lossy();
                    n.starts_with(".step-") && n.contains(".tmp-")
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Atomicity under a real crash: an `accrue-worker train` process writing
/// a checkpoint every step is killed with SIGKILL while one is being
/// written (its temporary folder is there, and still is after the kill).
/// LATEST names a complete checkpoint that loads, every `step-N` folder is
/// complete, the half-written folder is not taken for a checkpoint, and a
/// resumed engine starts from LATEST's step.
#[test]
fn a_writer_killed_mid_checkpoint_leaves_latest_complete() {
    use accrue_worker::checkpoint;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    let d = TempDir::new().unwrap();
    let job = d.path().join("job.toml");
    std::fs::write(&job, BIG_CHECKPOINTS).unwrap();
    let ckpt = d.path().join("ckpt");
    let mut hit = None;
    for attempt in 0..5 {
        let log = std::fs::File::create(d.path().join(format!("writer{attempt}.log"))).unwrap();
        let mut writer = Command::new(env!("CARGO_BIN_EXE_accrue-worker"))
            .arg("train")
            .arg(&job)
            .arg("--checkpoint-dir")
            .arg(&ckpt)
            .args(if attempt > 0 { &["--resume"][..] } else { &[] })
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        // Some complete checkpoints first, then the next write in progress.
        let deadline = Instant::now() + Duration::from_secs(60);
        let written = |min: u64| {
            checkpoint::list_steps(&ckpt)
                .unwrap()
                .last()
                .is_some_and(|&s| s >= min)
        };
        let start = checkpoint::list_steps(&ckpt)
            .unwrap()
            .last()
            .copied()
            .unwrap_or(0);
        let writing = || written(start + 3) && !temporaries(&ckpt).is_empty();
        while !writing() {
            assert!(
                Instant::now() < deadline && writer.try_wait().unwrap().is_none(),
                "no checkpoint being written within 60 s; see {}",
                d.path().display()
            );
            std::thread::sleep(Duration::from_micros(200));
        }
        writer.kill().unwrap(); // SIGKILL
        writer.wait().unwrap();
        let tmp = temporaries(&ckpt);
        if !tmp.is_empty() {
            hit = Some(tmp);
            break;
        }
        eprintln!("attempt {attempt}: the write had ended before the kill; again");
    }
    let tmp = hit.expect("no kill landed while a checkpoint was written in 5 attempts");
    let partial: Vec<(String, u64)> = std::fs::read_dir(&tmp[0])
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                e.metadata().unwrap().len(),
            )
        })
        .collect();
    eprintln!("killed while writing {}: {partial:?}", tmp[0].display());
    // LATEST names a complete checkpoint, and it loads.
    let latest = std::fs::read_to_string(ckpt.join(checkpoint::LATEST)).unwrap();
    let loaded = checkpoint::read_latest(&ckpt)
        .unwrap_or_else(|e| panic!("LATEST ({}) does not load: {e}", latest.trim()))
        .expect("LATEST exists");
    assert_eq!(
        loaded.path.file_name().unwrap().to_string_lossy(),
        latest.trim()
    );
    assert_eq!(format!("step-{}", loaded.state.step), latest.trim());
    let shapes: Vec<(String, Vec<i64>)> = loaded
        .model
        .iter()
        .map(|(n, t)| (n.clone(), t.size()))
        .collect();
    for (name, shape) in [
        ("0.weight", vec![1024, 64]),
        ("2.weight", vec![1024, 1024]),
        ("4.weight", vec![4, 1024]),
        ("4.bias", vec![4]),
    ] {
        assert!(
            shapes.contains(&(name.to_string(), shape.clone())),
            "{name} {shape:?} missing from {shapes:?}"
        );
    }
    assert_eq!(loaded.model.len(), 6);
    assert_eq!(
        loaded.optimizer.len(),
        2 * 6,
        "AdamW keeps two tensors per parameter"
    );
    // Every checkpoint by name is complete; the half-written one has none.
    let steps = checkpoint::list_steps(&ckpt).unwrap();
    assert!(steps.contains(&loaded.state.step), "{steps:?}");
    for s in &steps {
        let c = checkpoint::read(&ckpt.join(format!("step-{s}"))).unwrap();
        assert_eq!(c.state.step, *s);
    }
    let tmp_name = tmp[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        !latest.contains(&tmp_name) && !latest.contains("tmp"),
        "LATEST names the temporary folder: {latest}"
    );
    // The real resume path takes LATEST's step.
    let resumed = Engine::new(
        spec(BIG_CHECKPOINTS),
        SingleRank,
        RunOptions {
            checkpoint_dir: Some(ckpt.clone()),
            resume: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(resumed.state().step, loaded.state.step);
}

#[test]
fn existing_checkpoints_are_not_overwritten_without_resume() {
    let dir = TempDir::new().unwrap();
    train(spec(&mlp_job(32, 8, 2, "global_count", "")), dir.path());
    let err = Engine::new(
        spec(&mlp_job(32, 8, 2, "global_count", "")),
        SingleRank,
        RunOptions {
            checkpoint_dir: Some(dir.path().to_path_buf()),
            ..Default::default()
        },
    )
    .err()
    .expect("must refuse");
    let msg = err.to_string();
    assert!(
        msg.contains("already holds checkpoints") && msg.contains("step-4"),
        "{msg}"
    );
}

/// A data set whose sample 5 holds a NaN: the window containing it has a
/// non-finite gradient norm.
fn nan_data(dir: &Path) -> String {
    let path = poisoned_data(dir, "nan.safetensors", 5, 0, f64::NAN);
    on_tensors(&mlp_job(64, 8, 2, "global_count", ""), &path, false)
}

/// Issue 37, item 6: a job that applies no optimizer step, or skips more
/// than `max_skipped_fraction` of its steps, fails with that reason (before:
/// it ended as "finished"). Sample 5 holds a NaN: one window in 4 of each
/// epoch is skipped (2 of 8 steps), every window when a window is the
/// whole epoch.
#[test]
fn too_many_skipped_steps_or_none_applied_fail_the_job() {
    let dir = TempDir::new().unwrap();
    let quarter = format!("max_skipped_fraction = 0.2\n{}", nan_data(dir.path()));
    let mut e = engine(spec(&quarter), &dir.path().join("a"));
    let msg = e.run(|_| {}).expect_err("must fail").to_string();
    assert!(
        msg.starts_with("2 of its 8 optimizer steps were skipped (the last for non-finite gradients), more than max_skipped_fraction = 0.2 allows (1)"),
        "{msg}"
    );
    // At the default (0.5) the same job finishes.
    let mut e = engine(spec(&nan_data(dir.path())), &dir.path().join("b"));
    assert_eq!(e.run(|_| {}).unwrap().state.skipped_steps, 2);
    let path = dir.path().join("nan.safetensors");
    let all = format!(
        "max_skipped_fraction = 1.0\n{}",
        on_tensors(&mlp_job(64, 64, 1, "global_count", ""), &path, false)
    );
    let mut e = engine(spec(&all), &dir.path().join("c"));
    let msg = e.run(|_| {}).expect_err("must fail").to_string();
    assert!(
        msg.starts_with("no optimizer step was applied: all 2 steps were skipped (the last for non-finite gradients)"),
        "{msg}"
    );
}

#[test]
fn nonfinite_gradient_step_is_skipped_and_counted() {
    let dir = TempDir::new().unwrap();
    let job = nan_data(dir.path());
    assert!(job.contains("tensors"));
    let mut e = engine(spec(&job), &dir.path().join("ckpt"));
    let before = snapshot(&e);
    let first = loop {
        if let Some(r) = e.micro_step().unwrap() {
            break r;
        }
    };
    assert!(first.skipped && !first.grad_norm.is_finite(), "{first:?}");
    assert_eq!(e.state().skipped_steps, 1);
    assert_eq!(
        max_rel_diff(&snapshot(&e), &before),
        0.0,
        "a skipped step must not change parameters"
    );
    let second = loop {
        if let Some(r) = e.micro_step().unwrap() {
            break r;
        }
    };
    assert!(!second.skipped && second.grad_norm.is_finite());
    assert!(max_rel_diff(&snapshot(&e), &before) > 0.0);
    let summary = e.run(|_| {}).unwrap();
    // Sample 5 is in the first window of each of the 2 epochs.
    assert_eq!(summary.state.skipped_steps, 2);
    assert!(e
        .parameters()
        .iter()
        .all(|(_, p)| p.isfinite().all().int64_value(&[]) == 1));
}

#[test]
fn nonfinite_gradient_with_error_fails_clearly() {
    let dir = TempDir::new().unwrap();
    let job = nan_data(dir.path()).replace(
        "[optimizer]",
        "[clipping]\non_nonfinite = \"error\"\n[optimizer]",
    );
    let mut e = engine(spec(&job), &dir.path().join("ckpt"));
    let err = e.run(|_| {}).expect_err("must fail");
    assert!(matches!(err, Error::NonFinite { step: 1, .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("non-finite gradient norm") && msg.contains("step 1"),
        "{msg}"
    );
    // The run's writer lock on the folder (made for it) goes with it.
    drop(e);
    assert!(
        !dir.path().join("ckpt").exists(),
        "a failed step must not write a checkpoint"
    );
}

#[test]
fn init_weights_are_loaded_strictly() {
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    let w0 = Tensor::ones([16, 6], (Kind::Float, tch::Device::Cpu));
    let b0 = Tensor::zeros([16], (Kind::Float, tch::Device::Cpu));
    let w2 = Tensor::full([4, 16], 0.5, (Kind::Float, tch::Device::Cpu));
    let b2 = Tensor::zeros([4], (Kind::Float, tch::Device::Cpu));
    let good = d.join("good.safetensors");
    Tensor::write_safetensors(
        &[
            ("0.weight", &w0),
            ("0.bias", &b0),
            ("2.weight", &w2),
            ("2.bias", &b2),
        ],
        &good,
    )
    .unwrap();
    let with_init = |file: &Path| {
        mlp_job(32, 8, 2, "global_count", "").replace(
            "hidden = [16]",
            &format!("hidden = [16]\ninit = \"{}\"", file.display()),
        )
    };
    let e = engine(spec(&with_init(&good)), &d.join("c1"));
    let names: Vec<&str> = e.parameters().iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["0.weight", "0.bias", "2.weight", "2.bias"]);
    assert!(
        e.parameters()[2].1.equal(&w2),
        "2.weight must come from the file"
    );

    let renamed = d.join("renamed.safetensors");
    Tensor::write_safetensors(
        &[
            ("0.weight", &w0),
            ("0.bias", &b0),
            ("fc.weight", &w2),
            ("2.bias", &b2),
        ],
        &renamed,
    )
    .unwrap();
    let err = Engine::new(
        spec(&with_init(&renamed)),
        SingleRank,
        RunOptions::default(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("renamed.safetensors")
            && err.contains("2.weight")
            && err.contains("fc.weight"),
        "{err}"
    );

    let reshaped = d.join("reshaped.safetensors");
    let w2bad = Tensor::zeros([4, 15], (Kind::Float, tch::Device::Cpu));
    Tensor::write_safetensors(
        &[
            ("0.weight", &w0),
            ("0.bias", &b0),
            ("2.weight", &w2bad),
            ("2.bias", &b2),
        ],
        &reshaped,
    )
    .unwrap();
    let err = Engine::new(
        spec(&with_init(&reshaped)),
        SingleRank,
        RunOptions::default(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("2.weight: file [4, 15], model [4, 16]"),
        "{err}"
    );
}

#[test]
fn model_that_cannot_take_the_data_is_refused() {
    let job = mlp_job(32, 8, 2, "global_count", "")
        .replace("kind = \"mlp\"\nhidden = [16]", "kind = \"lenet5\"");
    let err = Engine::new(spec(&job), SingleRank, RunOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("lenet5 needs image samples [C, H, W]") && err.contains("[6]"),
        "{err}"
    );
    let job = job.replace("shape = [6]", "shape = [1, 8, 8]");
    let err = Engine::new(spec(&job), SingleRank, RunOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("at least 12x12") && err.contains("8x8"),
        "{err}"
    );
}

/// A CUDA index past the visible devices (cuda:0 where there is no GPU) is
/// refused before anything runs, naming the device.
#[test]
fn unavailable_device_is_refused() {
    let device = format!("cuda:{}", tch::Cuda::device_count());
    let job = mlp_job(32, 8, 2, "global_count", "")
        .replace("device = \"cpu\"", &format!("device = \"{device}\""));
    assert!(job.contains(&device));
    let err = Engine::new(spec(&job), SingleRank, RunOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains(&device), "{err}");
    let why = if tch::Cuda::is_available() {
        "CUDA devices are visible"
    } else {
        "CUDA is not available"
    };
    assert!(err.contains(why), "{err}");
}

/// `[eval] every_steps` (issue 39): the held-out split is evaluated after
/// every N-th step, as well as every N-th epoch and at the end, once per
/// step, and each evaluation is the model of that step (the same numbers
/// as evaluating a model trained to that step and stopped).
#[test]
fn evaluation_every_n_steps() {
    let text = mlp_job(
        64,
        8,
        1,
        "global_count",
        "[eval]\nevery_steps = 3\nevery_epochs = 1\n",
    )
    .replace("eval_samples = 0", "eval_samples = 16");
    // 64 samples, batch 8, k = 1: 8 steps an epoch, 16 in all.
    let d = TempDir::new().unwrap();
    let mut e = engine(spec(&text), &d.path().join("a"));
    let mut evals = Vec::new();
    e.run(|ev| {
        if let accrue_worker::Event::Eval(r) = ev {
            evals.push((r.step, r.loss));
        }
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let steps: Vec<u64> = evals.iter().map(|(s, _)| *s).collect();
    // Step 16 is the last: its evaluation is the final one, made once.
    assert_eq!(steps, vec![3, 6, 8, 9, 12, 15, 16], "{evals:?}");
    // Step 6's evaluation is the model stopped at step 6 evaluated.
    let stopped = text.replace("epochs = 2", "max_steps = 6");
    let mut e6 = engine(spec(&stopped), &d.path().join("b"));
    let mut last = None;
    e6.run(|ev| {
        if let accrue_worker::Event::Eval(r) = ev {
            last = Some((r.step, r.loss));
        }
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(last.map(|(s, _)| s), Some(6));
    assert_eq!(last.unwrap().1, evals[1].1, "step 6's evaluation differs");
}
