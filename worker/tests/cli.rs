//! The real `accrue-worker` binary as a process: the demo job on the real
//! digits data set, and a refused spec.

use std::path::{Path, PathBuf};
use std::process::Command;
use tempfile::TempDir;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The demo job reaches at least 95% on the 360 held-out digits and prints a
/// progress line per optimizer step. Needs `make test` (it writes data/digits).
#[test]
fn demo_job_trains_digits_to_95_percent() {
    let repo = repo();
    assert!(
        repo.join("data/digits/train-images-idx3-ubyte").exists(),
        "data/digits is missing: run `make test` (it writes the digits as IDX files)"
    );
    let state = TempDir::new().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_accrue-worker"))
        .current_dir(&repo)
        .args(["train", "jobs/digits-mlp.toml", "--state-dir"])
        .arg(state.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 1,437 samples, b = 8, k = 4: 180 micro-batches -> 45 steps per epoch, 30 epochs.
    let steps = stdout.lines().filter(|l| l.starts_with("step ")).count();
    assert_eq!(steps, 1350);
    assert!(stdout.contains("step 1350/1350 epoch 30 loss"));
    let acc: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("final accuracy "))
        .and_then(|l| l.split('%').next())
        .and_then(|v| v.parse().ok())
        .expect("a final accuracy line");
    assert!(acc >= 95.0, "final accuracy {acc}% < 95%");
    assert!(state
        .path()
        .join("checkpoints/digits-mlp/step-1350/model.safetensors")
        .exists());
}

#[test]
fn refused_spec_names_fields_and_writes_nothing() {
    let dir = TempDir::new().unwrap();
    let job = dir.path().join("bad.toml");
    std::fs::write(
        &job,
        r#"
name = "bad"
[model]
kind = "transformer"
[data]
kind = "synthetic"
batch_size = 0
[accumulation]
steps = 0
[clipping]
max_norm = -1.0
norm_type = 1.0
[optimizer]
kind = "sgd"
lr = nan
"#,
    )
    .unwrap();
    let state = dir.path().join("state");
    let out = Command::new(env!("CARGO_BIN_EXE_accrue-worker"))
        .args(["train"])
        .arg(&job)
        .arg("--state-dir")
        .arg(&state)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "model.kind = \"transformer\": must be one of mlp, lenet5, resnet18, resnet34, torchscript",
        "data.batch_size = 0: must be an integer in 1..=1048576",
        "accumulation.steps = 0: must be an integer in 1..=65536",
        "clipping.max_norm = -1.0: must be a finite number > 0",
        "clipping.norm_type = 1.0: must be 2.0 or inf",
        "optimizer.lr = NaN: must be a finite number > 0",
    ] {
        assert!(err.contains(needle), "missing {needle:?} in:\n{err}");
    }
    assert!(!state.exists(), "a refused job must write nothing");
}

/// Issue 14, confined paths: `accrue-worker train` with roots refuses a
/// data path out of `--data-root` and a checkpoint folder out of
/// `--checkpoint-root` (the default one under `--state-dir` included),
/// naming the field and writing nothing; inside them it trains, relative
/// paths resolved under the roots.
#[test]
fn train_confines_paths_under_the_roots_given() {
    let dir = TempDir::new().unwrap();
    let base = std::fs::canonicalize(dir.path()).unwrap();
    let (data, ckpt, outside) = (base.join("data"), base.join("ckpt"), base.join("outside"));
    for d in [&data, &ckpt, &outside] {
        std::fs::create_dir_all(d).unwrap();
    }
    let synthetic = |extra: &str| {
        format!(
            "name = \"conf\"\nmax_steps = 2\ndevice = \"cpu\"\nthreads = 1\n[model]\nkind = \"mlp\"\nhidden = [4]\n[data]\nkind = \"synthetic\"\nsamples = 32\nshape = [4]\nclasses = 2\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n{extra}"
        )
    };
    let run = |name: &str, text: &str, state: &Path| {
        let job = base.join(name);
        std::fs::write(&job, text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_accrue-worker"))
            .arg("train")
            .arg(&job)
            .arg("--state-dir")
            .arg(state)
            .arg("--data-root")
            .arg(&data)
            .arg("--checkpoint-root")
            .arg(&ckpt)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.success(), err)
    };
    let tensors = "name = \"conf\"\n[model]\nkind = \"mlp\"\n[data]\nkind = \"tensors\"\npath = \"../outside/t.safetensors\"\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n";
    let (ok, err) = run("escape.toml", tensors, &ckpt);
    assert!(!ok);
    assert!(
        err.contains("data.path = \"../outside/t.safetensors\": must lie under the data root"),
        "{err}"
    );
    let (ok, err) = run(
        "ckpt.toml",
        &synthetic("[checkpoint]\ndir = \"../outside/c\""),
        &ckpt,
    );
    assert!(!ok);
    assert!(
        err.contains("checkpoint.dir = \"../outside/c\": must lie under"),
        "{err}"
    );
    // The default folder, <state-dir>/checkpoints/<name>, out of the root.
    let (ok, err) = run("default.toml", &synthetic(""), &outside);
    assert!(!ok);
    assert!(err.contains("--state-dir = "), "{err}");
    assert_eq!(
        std::fs::read_dir(&outside).unwrap().count(),
        0,
        "nothing written outside"
    );
    // Inside: trains, the relative checkpoint.dir under the root.
    let (ok, err) = run(
        "fine.toml",
        &synthetic("[checkpoint]\ndir = \"fine\""),
        &outside,
    );
    assert!(ok, "{err}");
    assert!(ckpt.join("fine/step-2/model.safetensors").exists());
    assert_eq!(
        std::fs::read_dir(&outside).unwrap().count(),
        0,
        "nothing written outside"
    );
}
