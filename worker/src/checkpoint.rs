//! Checkpoints: `<dir>/step-<N>/{model.safetensors, optimizer.safetensors,
//! trainer.json}` and `<dir>/LATEST` naming the newest complete one. A
//! checkpoint is written into a temporary folder and renamed into place, and
//! LATEST is replaced by rename too, so a crash never leaves a half-written
//! checkpoint behind a name.

use crate::error::{io_err, Error, Result, TorchContext};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use tch::{Device, Tensor};

pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const TRAINER_FILE: &str = "trainer.json";
pub const LATEST: &str = "LATEST";

/// Counters and the data cursor: everything besides tensors a resume needs.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct TrainerState {
    pub job: String,
    /// Optimizer steps committed (skipped ones included).
    pub step: u64,
    /// Micro-steps this rank has run.
    pub micro_step: u64,
    /// Epoch of the data cursor.
    pub epoch: u64,
    /// Next micro-batch of `epoch` (always a window boundary).
    pub cursor: u64,
    /// Samples consumed by committed steps over all ranks.
    pub samples_seen: u64,
    pub skipped_steps: u64,
    /// Updates the optimizer applied (Adam's bias correction counts these).
    pub optimizer_steps: u64,
    pub seed: u64,
    /// The learning rate of the last committed step.
    pub lr: f64,
    /// The world size and k the cursor counts in.
    pub world_size: u64,
    pub accumulation_steps: u64,
    /// Samples of the epoch's order consumed before the current sharding
    /// began (non-zero after the world size changed mid-epoch).
    #[serde(default)]
    pub epoch_offset: u64,
    /// fp16's loss scale and growth tracker (issue 18; None otherwise).
    #[serde(default)]
    pub loss_scale: Option<crate::amp::LossScale>,
}

fn ckpt_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn to_cpu(tensors: &[(String, Tensor)]) -> Result<Vec<(String, Tensor)>> {
    tensors
        .iter()
        .map(|(n, t)| {
            let t = t
                .f_detach()
                .and_then(|t| t.f_to_device(Device::Cpu))
                .and_then(|t| t.f_contiguous());
            Ok((n.clone(), t.ctx("copying a tensor for the checkpoint")?))
        })
        .collect()
}

/// Writes step-N atomically, points LATEST at it and keeps the newest `keep`.
pub fn write(
    dir: &Path,
    state: &TrainerState,
    model: &[(String, Tensor)],
    optimizer: &[(String, Tensor)],
    keep: usize,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let name = format!("step-{}", state.step);
    let final_dir = dir.join(&name);
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    std::fs::create_dir(&tmp).map_err(io_err(&tmp))?;
    let model_path = tmp.join(MODEL_FILE);
    Tensor::write_safetensors(&to_cpu(model)?, &model_path)
        .map_err(|e| ckpt_err(&model_path, e.to_string()))?;
    let opt_path = tmp.join(OPTIMIZER_FILE);
    Tensor::write_safetensors(&to_cpu(optimizer)?, &opt_path)
        .map_err(|e| ckpt_err(&opt_path, e.to_string()))?;
    let json = serde_json::to_vec_pretty(state).map_err(|e| ckpt_err(&tmp, e.to_string()))?;
    let trainer_path = tmp.join(TRAINER_FILE);
    std::fs::write(&trainer_path, json).map_err(io_err(&trainer_path))?;
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(io_err(&final_dir))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(io_err(&final_dir))?;
    let latest_tmp = dir.join(format!(".{LATEST}.tmp-{}", std::process::id()));
    std::fs::write(&latest_tmp, format!("{name}\n")).map_err(io_err(&latest_tmp))?;
    std::fs::rename(&latest_tmp, dir.join(LATEST)).map_err(io_err(dir.join(LATEST)))?;
    prune(dir, keep, state.step)?;
    Ok(final_dir)
}

/// The step numbers of the complete checkpoints in `dir`, ascending.
pub fn list_steps(dir: &Path) -> Result<Vec<u64>> {
    let mut steps = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(steps),
        Err(e) => {
            return Err(Error::Io {
                path: dir.to_path_buf(),
                source: e,
            })
        }
    };
    for entry in entries {
        let entry = entry.map_err(io_err(dir))?;
        if let Some(n) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.strip_prefix("step-"))
            .and_then(|s| s.parse().ok())
        {
            steps.push(n);
        }
    }
    steps.sort_unstable();
    Ok(steps)
}

fn prune(dir: &Path, keep: usize, newest: u64) -> Result<()> {
    let steps = list_steps(dir)?;
    let excess = steps.len().saturating_sub(keep.max(1));
    for step in steps.into_iter().filter(|&s| s != newest).take(excess) {
        let p = dir.join(format!("step-{step}"));
        std::fs::remove_dir_all(&p).map_err(io_err(&p))?;
    }
    Ok(())
}

/// A loaded checkpoint.
pub struct Loaded {
    pub path: PathBuf,
    pub state: TrainerState,
    pub model: Vec<(String, Tensor)>,
    pub optimizer: Vec<(String, Tensor)>,
}

/// Reads the checkpoint LATEST names, or None when `dir` has none.
pub fn read_latest(dir: &Path) -> Result<Option<Loaded>> {
    let latest = dir.join(LATEST);
    let name = match std::fs::read_to_string(&latest) {
        Ok(s) => s.trim().to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(Error::Io {
                path: latest,
                source: e,
            })
        }
    };
    if !name.starts_with("step-") || name.contains('/') {
        return Err(ckpt_err(
            &latest,
            format!("names {name:?}, expected step-<N>"),
        ));
    }
    read(&dir.join(name)).map(Some)
}

pub fn read(path: &Path) -> Result<Loaded> {
    let trainer_path = path.join(TRAINER_FILE);
    let text = std::fs::read_to_string(&trainer_path).map_err(io_err(&trainer_path))?;
    let state: TrainerState =
        serde_json::from_str(&text).map_err(|e| ckpt_err(&trainer_path, e.to_string()))?;
    let read_st = |file: &str| {
        let p = path.join(file);
        Tensor::read_safetensors(&p).map_err(|e| ckpt_err(&p, e.to_string()))
    };
    Ok(Loaded {
        path: path.to_path_buf(),
        state,
        model: read_st(MODEL_FILE)?,
        optimizer: read_st(OPTIMIZER_FILE)?,
    })
}

/// Moves loaded tensors to `device`.
pub fn to_device(tensors: Vec<(String, Tensor)>, device: Device) -> Result<Vec<(String, Tensor)>> {
    tensors
        .into_iter()
        .map(|(n, t)| Ok((n, t.f_to_device(device).ctx("moving checkpoint tensors")?)))
        .collect()
}
