//! The shared side of the tests against transformers' Llama under
//! torchrun + DDP + no_sync (tests/reference/lm_ddp_reference.py): its
//! settings, accrue's job for the same model and data, and comparisons.

use super::procs::Torchrun;
use super::python;
use std::path::{Path, PathBuf};
use tch::Tensor;

pub type Named = Vec<(String, Tensor)>;

/// The tests that start torchrun take turns (two Python ranks each, plus
/// accrue's two, on a 2-core machine).
pub static TORCHRUN: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn torchrun_turn() -> std::sync::MutexGuard<'static, ()> {
    TORCHRUN.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/lm_ddp_reference.py")
}

/// The shared settings (the python side reads the same JSON).
pub fn config() -> serde_json::Value {
    serde_json::json!({
        "seed": 5, "batch": 2, "k": 4, "epochs": 2, "seq_len": 12, "rows": 32,
        "max_norm": 1.0, "lr": 0.001, "weight_decay": 0.1, "pad_id": 0,
        "model": {
            "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        },
        "modes": ["global_count", "mean"],
    })
}

/// accrue's job for the same model, data and optimizer.
pub fn job(d: &Path, normalize: &str, k: u64, batch: u64) -> String {
    format!(
        r#"
name = "lm"
seed = 5
epochs = 2
device = "cpu"
threads = 1
[model]
kind = "llama"
vocab_size = 97
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = 64
rms_norm_eps = 1e-6
init = "{d}/init.safetensors"
[data]
kind = "sequences"
path = "{d}/data.safetensors"
seq_len = 12
batch_size = {batch}
shuffle = false
[accumulation]
steps = {k}
normalize = "{normalize}"
[clipping]
max_norm = 1.0
[optimizer]
kind = "adamw"
lr = 0.001
weight_decay = 0.1
[comm]
timeout_s = 20
connect_timeout_s = 30
"#,
        d = d.display()
    )
}

/// Largest per-tensor max|a - b| / max|b| over `want`'s names.
pub fn rel_diff(got: &Named, want: &Named) -> (f64, String) {
    let mut worst = (0.0, String::new());
    assert_eq!(got.len(), want.len(), "tensor counts differ");
    for (name, w) in want {
        let g = &got
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("{name} missing"))
            .1;
        let d = (g - w).abs().max().double_value(&[]) / w.abs().max().double_value(&[]).max(1e-12);
        if d > worst.0 {
            worst = (d, name.clone());
        }
    }
    worst
}

pub fn read(path: &Path) -> Named {
    Tensor::read_safetensors(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs the reference script's `mode` (prepare, hf) on `d`.
pub fn run_script(mode: &str, d: &Path, cfg: &serde_json::Value) {
    let out = std::process::Command::new(python())
        .arg(script())
        .args([mode, d.to_str().unwrap(), &cfg.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{mode}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// accrue's step reports against the reference's `report` (its
/// `ddp-*.json`): the same count, each step's loss and grad norm within
/// 1e-5 (relative, printed), and the same target count.
pub fn steps_match(steps: &[serde_json::Value], report: &Path, what: &str) {
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(report).unwrap()).unwrap();
    let want_steps = report["steps"].as_array().unwrap();
    assert_eq!(steps.len(), want_steps.len(), "{what}: step count");
    for (i, (g, w)) in steps.iter().zip(want_steps).enumerate() {
        for key in ["loss", "grad_norm"] {
            let (g, w) = (g[key].as_f64().unwrap(), w[key].as_f64().unwrap());
            eprintln!("{what}, step {}: {key} {g} vs PyTorch {w}", i + 1);
            assert!(
                (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                "{what}, step {}: {key} {g} vs PyTorch's {w}",
                i + 1
            );
        }
        assert_eq!(
            g["samples"].as_f64(),
            w["tokens"].as_f64(),
            "{what}, step {}: tokens counted",
            i + 1
        );
    }
}

/// Starts PyTorch's own floor run in `d/one`: `cfg`'s job alone on one
/// process, k = 8 (the same 16-row windows as W = 2, k = 4), with
/// transformers' eager attention instead of SDPA (another valid order of
/// the same sums); `modes` overrides cfg's when given.
pub fn start_floor(
    d: &Path,
    cfg: &serde_json::Value,
    modes: Option<&[&str]>,
) -> (PathBuf, Torchrun) {
    let one = d.join("one");
    std::fs::create_dir_all(&one).unwrap();
    for f in ["init.safetensors", "data.safetensors"] {
        std::fs::copy(d.join(f), one.join(f)).unwrap();
    }
    let mut cfg1 = cfg.clone();
    cfg1["k"] = 8.into();
    cfg1["attn"] = "eager".into();
    if let Some(m) = modes {
        cfg1["modes"] = serde_json::json!(m);
    }
    let run = Torchrun::start(
        &python(),
        &script(),
        1,
        &one,
        &["train", one.to_str().unwrap(), &cfg1.to_string()],
    );
    (one, run)
}

/// Waits for `run` (at most 300 s) and requires it to have succeeded,
/// with its logs in the message (`what` names it).
pub fn finish(run: &mut Torchrun, what: &str) {
    let status = run
        .wait(std::time::Duration::from_secs(300))
        .unwrap_or_else(|| panic!("{what}torchrun did not finish:\n{}", run.logs()));
    assert!(status.success(), "{what}torchrun failed:\n{}", run.logs());
}

/// One accrue run against PyTorch's: its label, the name of PyTorch's
/// `ddp-*` outputs it is held to (in `d`), its final parameters and its
/// step reports.
pub type Run = (String, String, Named, Vec<serde_json::Value>);

/// Every run's parameters within 1e-5 or 4x PyTorch's own floor (its
/// W = 1, k = 8 eager run in `one` against its W = 2, k = 4 SDPA run in
/// `d`), and every step within 1e-5 ([`steps_match`]); `label` prefixes
/// the messages. Returns the floor.
pub fn runs_match_pytorch(d: &Path, one: &Path, runs: &[Run], label: &str) -> f64 {
    runs_match_pytorch_or(d, one, runs, label, None)
}

/// [`runs_match_pytorch`] with a second sample of the floor: `other`, the
/// same loop run another valid way (accrue without the feature under test,
/// e.g. T = 1 on the same data ranks, with its own attention and norm
/// assembly), against PyTorch's W = 2 run; the floor is the larger of the
/// two. Under AdamW one pair of orders is one draw of a noisy distance:
/// on the tied model PyTorch's pair measured 6.4e-5 on one machine and
/// 1.6e-5 on another, where accrue's runs sat 4.3e-5 to 6.2e-5 away.
pub fn runs_match_pytorch_or(
    d: &Path,
    one: &Path,
    runs: &[Run],
    label: &str,
    other: Option<&Named>,
) -> f64 {
    let want = read(&d.join("ddp-global_count-rank0.safetensors"));
    let (mut floor, mut floor_name) = rel_diff(
        &read(&one.join("ddp-global_count-rank0.safetensors")),
        &want,
    );
    if let Some(other) = other {
        let (f, name) = rel_diff(other, &want);
        eprintln!("{label}the other valid run against PyTorch's W = 2: {f:.3e} ({name})");
        if f > floor {
            (floor, floor_name) = (f, name);
        }
    }
    for (what, reference, model, steps) in runs {
        let what = format!("{label}{what}");
        let want = read(&d.join(format!("{reference}.safetensors")));
        let (diff, name) = rel_diff(model, &want);
        eprintln!(
            "{what}: parameters vs PyTorch {diff:.3e} ({name}); the floor \
             (W=1,k=8 eager vs W=2,k=4 SDPA, or the other valid run) {floor:.3e} ({floor_name})"
        );
        steps_match(steps, &d.join(format!("{reference}.json")), &what);
        assert!(
            diff <= 1e-5_f64.max(4.0 * floor),
            "{what}: {name} differs from PyTorch by {diff:.3e}, PyTorch's floor {floor:.3e}"
        );
    }
    floor
}
