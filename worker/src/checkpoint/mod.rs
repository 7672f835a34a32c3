//! Checkpoints: `<dir>/OWNER.json` (the one job the folder belongs to),
//! `<dir>/step-<N>/{model.safetensors, optimizer.safetensors, trainer.json,
//! MANIFEST.json}` and `<dir>/LATEST` naming the newest complete step.
//!
//! A write is durable and atomic: every file is written into a temporary
//! folder and fsynced, the manifest (sizes and CRC-32s) last, then the
//! folder is fsynced, renamed into place and its parent fsynced; LATEST is
//! replaced the same way. Any error removes the temporary folder, so a full
//! disk leaves LATEST on the last complete step and nothing half-written.
//!
//! Reading verifies the manifest. Recovery ([`load_newest`]) takes the step
//! LATEST names, or, when LATEST is missing or names a step that does not
//! verify, the newest step that does, saying what it skipped; weights and
//! counters always come from one folder.

pub mod disk;
mod format;
pub mod hub;
pub mod lock;
pub mod manifest;
pub mod mapped;
pub mod owner;
pub mod shards;
mod write;

use format::tensors_from;
pub use format::{safetensors_bytes, shard_files, tensor_bytes};
pub use write::{
    abandon_step, begin_step, claim, finish_step, latest_says, write, write_on, write_part,
};

use crate::error::{Error, Result, TorchContext};
use disk::Disk;
use owner::Owner;
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
    /// The id of the job that wrote it (the coordinator's; `accrue-worker
    /// train`: the job's name), the SHA-256 of its spec, and the model and
    /// optimizer kinds: a resume of another job, or with another model or
    /// optimizer kind, is refused naming what differs.
    #[serde(default)]
    pub job_id: String,
    #[serde(default)]
    pub spec_hash: String,
    #[serde(default)]
    pub model_kind: String,
    #[serde(default)]
    pub optimizer_kind: String,
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
    pub loss_scale: Option<crate::cuda::amp::LossScale>,
}

pub(super) fn ckpt_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The folder name of step `n`.
pub fn step_name(n: u64) -> String {
    format!("step-{n}")
}

/// What a write puts into a step folder, serialised.
pub struct Payload {
    /// The model's files: `model.safetensors`, or shards and their index
    /// ([`format::model_files`]).
    pub model: Vec<(String, Vec<u8>)>,
    pub optimizer: Vec<u8>,
    pub trainer: Vec<u8>,
    /// Files for other tools, by name (a language model's `config.json`
    /// and `tokenizer.json`, so transformers' `from_pretrained` loads the
    /// folder): written, and listed in the manifest, like the others.
    pub extra: Vec<(String, Vec<u8>)>,
}

impl Payload {
    pub fn new(
        state: &TrainerState,
        model: &[(String, Tensor)],
        optimizer: &[(String, Tensor)],
        max_shard: u64,
    ) -> Result<Self> {
        Ok(Self {
            model: format::model_files(model, max_shard)?,
            optimizer: safetensors_bytes(optimizer)?,
            trainer: serde_json::to_vec_pretty(state).map_err(|e| Error::Encode {
                what: "the trainer state".into(),
                reason: e.to_string(),
            })?,
            extra: Vec::new(),
        })
    }
}

/// How a write treats the folder.
#[derive(Clone, Debug)]
pub struct WriteOptions {
    /// Keep the newest `keep` steps (at least 1).
    pub keep: usize,
    /// The folder's owner: claimed when the folder has none, refused when
    /// it names another job.
    pub owner: Owner,
    /// Never prune this step or an older one (recovery fell back past an
    /// unreadable checkpoint: keep what is left of the history).
    pub protect_upto: Option<u64>,
    /// The largest model file in bytes: above it the model is written as
    /// shards and their index (`checkpoint.max_shard_size`).
    pub max_shard: u64,
}

/// The step numbers of the step folders in `dir`, ascending (complete or
/// not: [`read`] tells).
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
        let entry = entry.map_err(crate::error::io_err(dir))?;
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

/// The steps to delete so that at most `keep` steps up to `newest` remain
/// besides the protected ones: the oldest first, never `newest`, never one
/// newer (not this run's to judge), never one at or below `protect_upto`
/// (they do not count against `keep`).
pub fn to_prune(steps: &[u64], keep: usize, newest: u64, protect_upto: Option<u64>) -> Vec<u64> {
    let open: Vec<u64> = steps
        .iter()
        .copied()
        .filter(|&s| s <= newest && protect_upto.is_none_or(|p| s > p))
        .collect();
    let excess = open.len().saturating_sub(keep.max(1));
    open.into_iter()
        .filter(|&s| s != newest)
        .take(excess)
        .collect()
}

pub(super) fn prune(
    disk: &mut dyn Disk,
    dir: &Path,
    keep: usize,
    newest: u64,
    protect_upto: Option<u64>,
) -> Result<()> {
    for step in to_prune(&list_steps(dir)?, keep, newest, protect_upto) {
        let p = dir.join(step_name(step));
        disk.remove_dir_all(&p)
            .map_err(|e| ckpt_err(&p, format!("pruning: {e}")))?;
    }
    Ok(())
}

/// Removes the temporary files and folders accrue's writers leave when
/// they die mid-write (`.step-<N>.tmp-<pid>`, `.LATEST.tmp-<pid>`,
/// `.OWNER.json.tmp-<pid>`; [`lock::is_our_temporary`]), and nothing else.
/// Only the holder of the folder's writer lock may sweep (`held` is the
/// proof): while it holds the lock no other writer of the folder lives, on
/// any host, so every such entry is a dead writer's. The caller checked
/// that the folder is its job's (or has no owner) before taking the lock.
/// Returns what it removed.
pub fn sweep(held: &lock::FolderLock) -> Result<Vec<PathBuf>> {
    let dir = held.dir();
    let mut removed = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(crate::error::io_err(dir)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(crate::error::io_err(dir))?;
        if !entry
            .file_name()
            .to_str()
            .is_some_and(lock::is_our_temporary)
        {
            continue;
        }
        let path = entry.path();
        // Not followed: a symlink named like ours is removed as a link.
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        let r = if is_dir {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        r.map_err(crate::error::io_err(&path))?;
        removed.push(path);
    }
    removed.sort();
    Ok(removed)
}

/// A loaded checkpoint.
pub struct Loaded {
    pub path: PathBuf,
    pub state: TrainerState,
    pub model: Vec<(String, Tensor)>,
    pub optimizer: Vec<(String, Tensor)>,
}

/// Reads step folder `path` (named `step-<N>`), verifying its manifest and
/// that trainer.json is step N's. The error is one line.
fn read_step(path: &Path) -> std::result::Result<Loaded, String> {
    let step = step_of(path)?;
    let mut files = manifest::read_verified(path, step)?;
    let mut take = |name: &str| {
        files
            .remove(name)
            .ok_or_else(|| format!("{} lists no {name}", manifest::MANIFEST_FILE))
    };
    let trainer = take(TRAINER_FILE)?;
    let optimizer = take_optimizer(&mut files, path)?;
    let model = shards::take_model_files(&mut files)?
        .into_iter()
        .map(|(name, expected, bytes)| {
            let file = path.join(name);
            let tensors = tensors_from(&bytes, &file)?;
            Ok((file, expected, tensors))
        })
        .collect::<std::result::Result<Vec<_>, String>>()?;
    let state = trainer_state(&trainer, step)?;
    Ok(Loaded {
        path: path.to_path_buf(),
        state,
        model: shards::join(model)?,
        optimizer,
    })
}

/// Stage `i` (from 0) of `n`'s optimizer state file in a pipeline job's
/// step folder: `optimizer-00001-of-00002.safetensors`.
pub fn optimizer_part_name(i: usize, n: usize) -> String {
    format!("optimizer-{:05}-of-{n:05}.safetensors", i + 1)
}

fn is_optimizer_part(name: &str) -> bool {
    name.strip_prefix("optimizer-")
        .and_then(|r| r.strip_suffix(".safetensors"))
        .and_then(|r| r.split_once("-of-"))
        .is_some_and(|(a, b)| {
            !a.is_empty()
                && !b.is_empty()
                && (a.chars().chain(b.chars())).all(|c| c.is_ascii_digit())
        })
}

/// A step folder's optimizer state out of its verified files:
/// `optimizer.safetensors`, or each pipeline stage's part, in order (a
/// tensor named in two parts is refused).
fn take_optimizer(
    files: &mut std::collections::BTreeMap<String, Vec<u8>>,
    path: &Path,
) -> std::result::Result<Vec<(String, Tensor)>, String> {
    if let Some(bytes) = files.remove(OPTIMIZER_FILE) {
        return tensors_from(&bytes, &path.join(OPTIMIZER_FILE));
    }
    let parts: Vec<String> = files
        .keys()
        .filter(|n| is_optimizer_part(n))
        .cloned()
        .collect();
    if parts.is_empty() {
        return Err(format!(
            "{} lists no {OPTIMIZER_FILE} (nor a pipeline stage's optimizer-*-of-*.safetensors)",
            manifest::MANIFEST_FILE
        ));
    }
    let mut out: Vec<(String, Tensor)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for name in parts {
        let bytes = files.remove(&name).unwrap_or_default();
        for (t, v) in tensors_from(&bytes, &path.join(&name))? {
            if !seen.insert(t.clone()) {
                return Err(format!(
                    "{name} holds {t}, which another optimizer part holds too"
                ));
            }
            out.push((t, v));
        }
    }
    Ok(out)
}

/// Tensors from safetensors `bytes` (`path` names them in errors; the
/// pipeline's gather, engine/pipe/, reads other stages' parts so).
pub fn tensors_of(bytes: &[u8], path: &Path) -> std::result::Result<Vec<(String, Tensor)>, String> {
    tensors_from(bytes, path)
}

/// Reads and verifies the step folder `path`.
pub fn read(path: &Path) -> Result<Loaded> {
    read_step(path).map_err(|e| ckpt_err(path, e))
}

/// Reads the checkpoint LATEST names (verified), or None without LATEST.
pub fn read_latest(dir: &Path) -> Result<Option<Loaded>> {
    match latest_name(dir).map_err(|e| ckpt_err(&dir.join(LATEST), e))? {
        None => Ok(None),
        Some(n) => read(&dir.join(step_name(n))).map(Some),
    }
}

/// The step LATEST names; None when there is no LATEST.
pub fn latest_name(dir: &Path) -> std::result::Result<Option<u64>, String> {
    let text = match std::fs::read_to_string(dir.join(LATEST)) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let name = text.trim();
    name.strip_prefix("step-")
        .and_then(|n| n.parse().ok())
        .map(Some)
        .ok_or_else(|| format!("names {name:?}, expected step-<N>"))
}

/// The checkpoint a recovery continues from, and why that one.
pub struct Found {
    pub loaded: Loaded,
    /// "step-32 (named by LATEST)" or "step-32 (LATEST missing; skipped
    /// step-48: model.safetensors: ...)".
    pub why: String,
    /// LATEST was missing or unreadable: an older step was taken.
    pub fell_back: bool,
}

/// What [`choose`] decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Load this step; (the steps skipped, why) on the way.
    Take {
        step: u64,
        skipped: Vec<(u64, String)>,
        fell_back: bool,
    },
    /// No step folder and no LATEST: a fresh start.
    Nothing,
    /// Step folders (or a LATEST) exist but none verifies.
    NoneReadable {
        latest: String,
        skipped: Vec<(u64, String)>,
    },
}

/// The decision of [`load_newest`], pure: `latest` is what LATEST names
/// (Ok(None): no LATEST; Err: unreadable), `steps` the step folders found
/// and `verify` whether one reads. LATEST's step when it verifies, else the
/// newest step that does.
pub fn choose(
    latest: &std::result::Result<Option<u64>, String>,
    steps: &[u64],
    mut verify: impl FnMut(u64) -> std::result::Result<(), String>,
) -> Choice {
    let mut skipped = Vec::new();
    let mut tried = None;
    let latest_text = match latest {
        Ok(Some(n)) => {
            tried = Some(*n);
            match verify(*n) {
                Ok(()) => {
                    return Choice::Take {
                        step: *n,
                        skipped,
                        fell_back: false,
                    }
                }
                Err(e) => {
                    skipped.push((*n, e));
                    format!("LATEST names step-{n}, which does not verify")
                }
            }
        }
        Ok(None) => "LATEST missing".to_string(),
        Err(e) => format!("LATEST unreadable ({e})"),
    };
    for &s in steps.iter().rev().filter(|&&s| Some(s) != tried) {
        match verify(s) {
            Ok(()) => {
                return Choice::Take {
                    step: s,
                    skipped,
                    fell_back: true,
                }
            }
            Err(e) => skipped.push((s, e)),
        }
    }
    if steps.is_empty() && matches!(latest, Ok(None)) {
        Choice::Nothing
    } else {
        Choice::NoneReadable {
            latest: latest_text,
            skipped,
        }
    }
}

/// Skipped steps and why, in one line (`step-N: why; ...`).
pub fn list_skipped(skipped: &[(u64, String)]) -> String {
    skipped
        .iter()
        .map(|(s, e)| format!("step-{s}: {e}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The checkpoint to continue `me`'s job from: LATEST's step when it
/// verifies, else the newest step that does (a warning names what was
/// skipped). None for a folder with no checkpoint at all; an error listing
/// what was found when steps exist and none reads, or when the folder or a
/// checkpoint belongs to another job.
pub fn load_newest(dir: &Path, me: &Owner) -> Result<Option<Found>> {
    let found = find_newest(dir, me, read_step, |l: &Loaded| (&l.path, &l.state))?;
    Ok(found.map(|(loaded, why, fell_back)| Found {
        loaded,
        why,
        fell_back,
    }))
}

/// A step folder [`newest_verified`] chose: verified, its trainer state
/// read, its tensors not (ZeRO-3 maps them: [`mapped`]).
pub struct FoundStep {
    pub path: PathBuf,
    pub state: TrainerState,
    pub why: String,
    pub fell_back: bool,
}

/// [`load_newest`]'s choice, every file of the step verified (read in
/// pieces, never held) and only its trainer state kept. The files are
/// immutable once published, so what a reader maps next is what was
/// verified.
pub fn newest_verified(dir: &Path, me: &Owner) -> Result<Option<FoundStep>> {
    let found = find_newest(dir, me, verify_step, |f: &FoundStep| (&f.path, &f.state))?;
    Ok(found.map(|(mut f, why, fell_back)| {
        f.why = why;
        f.fell_back = fell_back;
        f
    }))
}

/// The trainer state of step folder `step` from its `trainer.json`, which
/// must be that step's.
fn trainer_state(bytes: &[u8], step: u64) -> std::result::Result<TrainerState, String> {
    let state: TrainerState =
        serde_json::from_slice(bytes).map_err(|e| format!("{TRAINER_FILE}: {e}"))?;
    if state.step != step {
        return Err(format!(
            "{TRAINER_FILE} holds step {}, the folder is step {step}",
            state.step
        ));
    }
    Ok(state)
}

/// Step folder `path`'s number (named `step-<N>`).
fn step_of(path: &Path) -> std::result::Result<u64, String> {
    path.file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("step-"))
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("{} is not a step-<N> folder", path.display()))
}

/// Verifies step folder `path` as [`read_step`] does, keeping only the
/// trainer state; its model and optimizer files must be listed.
fn verify_step(path: &Path) -> std::result::Result<FoundStep, String> {
    let step = step_of(path)?;
    let mut files = manifest::verify_keeping(path, step, |n| n == TRAINER_FILE)?;
    let trainer = files
        .remove(TRAINER_FILE)
        .flatten()
        .ok_or_else(|| format!("{} lists no {TRAINER_FILE}", manifest::MANIFEST_FILE))?;
    let listed: Vec<&String> = files.keys().collect();
    if !listed
        .iter()
        .any(|n| *n == MODEL_FILE || *n == shards::INDEX_FILE)
    {
        return Err(format!(
            "{} lists no {MODEL_FILE} (nor {})",
            manifest::MANIFEST_FILE,
            shards::INDEX_FILE
        ));
    }
    if !listed
        .iter()
        .any(|n| *n == OPTIMIZER_FILE || is_optimizer_part(n))
    {
        return Err(format!(
            "{} lists no {OPTIMIZER_FILE} (nor a part optimizer-*-of-*.safetensors)",
            manifest::MANIFEST_FILE
        ));
    }
    let state = trainer_state(&trainer, step)?;
    Ok(FoundStep {
        path: path.to_path_buf(),
        state,
        why: String::new(),
        fell_back: false,
    })
}

/// The optimizer state files of verified step folder `path`:
/// `optimizer.safetensors`, or every part in order.
pub fn optimizer_files(path: &Path) -> std::result::Result<Vec<PathBuf>, String> {
    if path.join(OPTIMIZER_FILE).is_file() {
        return Ok(vec![path.join(OPTIMIZER_FILE)]);
    }
    let mut parts: Vec<String> = std::fs::read_dir(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| is_optimizer_part(n))
        .collect();
    parts.sort();
    Ok(parts.into_iter().map(|n| path.join(n)).collect())
}

/// The choice of [`load_newest`] and [`newest_verified`], with `read`
/// reading (or verifying) a step folder and `parts` its path and state.
fn find_newest<L>(
    dir: &Path,
    me: &Owner,
    read: impl Fn(&Path) -> std::result::Result<L, String>,
    parts: impl Fn(&L) -> (&PathBuf, &TrainerState),
) -> Result<Option<(L, String, bool)>> {
    if let Some(o) = owner::read(dir).map_err(|e| ckpt_err(dir, e))? {
        if let Some(r) = owner::refusal(dir, &o, me) {
            return Err(ckpt_err(dir, r));
        }
    }
    let latest = latest_name(dir);
    let steps = list_steps(dir)?;
    let mut cache: Option<(u64, L)> = None;
    let choice = choose(&latest, &steps, |s| {
        let l = read(&dir.join(step_name(s)))?;
        cache = Some((s, l));
        Ok(())
    });
    let latest_text = match &latest {
        Ok(Some(n)) => format!("LATEST names step-{n}, which does not verify"),
        Ok(None) => "LATEST missing".to_string(),
        Err(e) => format!("LATEST unreadable ({e})"),
    };
    match choice {
        Choice::Nothing => Ok(None),
        Choice::NoneReadable { latest, skipped } => Err(ckpt_err(
            dir,
            format!(
                "no readable checkpoint to continue from: {latest}; {}; the job does not start again from step 0 while step folders exist (move them away to start afresh)",
                if skipped.is_empty() {
                    "no step folders".to_string()
                } else {
                    list_skipped(&skipped)
                }
            ),
        )),
        Choice::Take {
            step,
            skipped,
            fell_back,
        } => {
            let loaded = match cache {
                Some((s, l)) if s == step => l,
                // choose() stops at the first step that verifies, which is
                // the last one read; read again only if that ever changes.
                _ => {
                    let path = dir.join(step_name(step));
                    read(&path).map_err(|e| ckpt_err(&path, e))?
                }
            };
            let (path, state) = parts(&loaded);
            check_job(path, state, me)?;
            let why = if fell_back {
                format!(
                    "step-{step} ({latest_text}{})",
                    if skipped.is_empty() {
                        String::new()
                    } else {
                        format!("; skipped {}", list_skipped(&skipped))
                    }
                )
            } else {
                format!("step-{step} (named by LATEST)")
            };
            if fell_back {
                tracing::warn!(dir = %dir.display(), step, "recovery without a readable LATEST: {why}");
            }
            Ok(Some((loaded, why, fell_back)))
        }
    }
}

/// A checkpoint of another job is refused, naming both.
fn check_job(path: &Path, state: &TrainerState, me: &Owner) -> Result<()> {
    let theirs = if state.job_id.is_empty() {
        &state.job
    } else {
        &state.job_id
    };
    if *theirs != me.job_id {
        return Err(ckpt_err(
            path,
            format!(
                "was written by job {theirs}; this is job {}: a job resumes only from its own checkpoints",
                me.job_id
            ),
        ));
    }
    Ok(())
}

/// Moves loaded tensors to `device`.
pub fn to_device(tensors: Vec<(String, Tensor)>, device: Device) -> Result<Vec<(String, Tensor)>> {
    tensors
        .into_iter()
        .map(|(n, t)| Ok((n, t.f_to_device(device).ctx("moving checkpoint tensors")?)))
        .collect()
}

#[cfg(test)]
mod tests;
