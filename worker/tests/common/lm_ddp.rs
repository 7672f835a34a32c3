//! The shared side of the tests against transformers' Llama under
//! torchrun + DDP + no_sync (tests/reference/lm_ddp_reference.py): its
//! settings, accrue's job for the same model and data, and comparisons.

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
