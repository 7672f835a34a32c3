//! A pipeline job's checkpoint (issue 40), written without gathering the
//! model on one rank: every stage's data rank 0 writes its own tensors
//! into the step's temporary folder as shards of one Hugging Face
//! checkpoint (`model-0000i-of-0000n.safetensors`, numbered in stage
//! order, a stage's tensors split further above `max_shard_size`) and its
//! optimizer state as `optimizer-0000s-of-0000P.safetensors`; the first
//! stage's (the writer, holding the folder's lock) claims the folder,
//! writes `model.safetensors.index.json`, the trainer state and the other
//! files, lists every stage's files in the manifest and publishes the
//! step under the usual rules (checkpoint/mod.rs: `begin_step`,
//! `write_part`, `finish_step`). Only names, sizes and checksums cross
//! between the stages.

use super::wire::{recv_bytes, send_bytes};
use crate::checkpoint::{self, manifest::Entry, shards};
use crate::comm::collective::Collective;
use crate::engine::Engine;
use crate::error::{Error, Result, TorchContext};
use crate::family::Named;
use std::path::{Path, PathBuf};

/// What a stage (or a ZeRO-3 rank, engine/zero3.rs) wrote, for the
/// writer's index and manifest.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub(in crate::engine) struct Part {
    entries: Vec<Entry>,
    /// Tensor name -> its shard file.
    weight_map: Vec<(String, String)>,
    /// The tensors' bytes (the index's `total_size`).
    bytes: u64,
}

/// A stage's outcome as it crosses to the writer: its part, or why not.
pub(in crate::engine) type Outcome = std::result::Result<Part, String>;

pub(in crate::engine) fn encode<T: serde::Serialize>(v: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| Error::Schedule(format!("encoding a stage's part: {e}")))
}

pub(in crate::engine) fn decode<T: serde::de::DeserializeOwned>(
    b: &[u8],
    from: usize,
) -> Result<T> {
    serde_json::from_slice(b)
        .map_err(|e| Error::Schedule(format!("stage {from}'s checkpoint report: {e}")))
}

/// The tensors' bytes, each.
pub(in crate::engine) fn sizes(tensors: &Named) -> Result<Vec<u64>> {
    tensors
        .iter()
        .map(|(_, t)| {
            let kind = t
                .f_kind()
                .ctx("reading a tensor's kind for the checkpoint")?;
            Ok((t.numel() * kind.elt_size_in_bytes()) as u64)
        })
        .collect()
}

/// Writes `model`'s shards (`plan`, numbered from `first` of `total`) and
/// the optimizer state `opt` (part `stage` of `stages`) into `tmp`.
#[allow(clippy::too_many_arguments)]
pub(in crate::engine) fn write_stage(
    tmp: &Path,
    model: &Named,
    plan: &[Vec<usize>],
    first: usize,
    total: usize,
    opt: &Named,
    stage: usize,
    stages: usize,
) -> Result<Part> {
    let sizes = sizes(model)?;
    let mut files: Vec<(String, Vec<u8>)> = Vec::with_capacity(plan.len() + 1);
    let mut weight_map = Vec::with_capacity(model.len());
    for (i, members) in plan.iter().enumerate() {
        // One file in all: `model.safetensors`, as a whole model's.
        let name = match total {
            1 => checkpoint::MODEL_FILE.to_string(),
            _ => shards::shard_name(first + i, total),
        };
        let part: Named = members
            .iter()
            .map(|&j| (model[j].0.clone(), model[j].1.shallow_clone()))
            .collect();
        weight_map.extend(part.iter().map(|(n, _)| (n.clone(), name.clone())));
        files.push((name, checkpoint::safetensors_bytes(&part)?));
    }
    files.push((
        checkpoint::optimizer_part_name(stage, stages),
        checkpoint::safetensors_bytes(opt)?,
    ));
    let refs: Vec<(&str, &[u8])> = files
        .iter()
        .map(|(n, b)| (n.as_str(), b.as_slice()))
        .collect();
    let entries =
        checkpoint::write_part(&mut checkpoint::disk::Local, tmp, &refs).map_err(|e| {
            Error::Checkpoint {
                path: tmp.to_path_buf(),
                reason: format!("stage {stage}'s part: {e}"),
            }
        })?;
    Ok(Part {
        entries,
        weight_map,
        bytes: sizes.iter().sum(),
    })
}

impl<C: Collective> Engine<C> {
    /// Writes the committed step of a pipeline job (see the module
    /// documentation); every rank returns the step folder's path, or the
    /// same failure.
    pub(in crate::engine) fn pipeline_checkpoint(&mut self, opt: Named) -> Result<PathBuf> {
        let pipe = self
            .pipe
            .clone()
            .ok_or_else(|| Error::Schedule("a pipeline checkpoint without stages".into()))?;
        let step = self.state.step;
        let dir = self.checkpoint_dir.clone();
        let final_dir = dir.join(checkpoint::step_name(step));
        // Replica 0 writes; the other replicas hold the same state.
        if self.collective.rank() != 0 {
            return Ok(final_dir);
        }
        // This stage's tensors: its parameters (the first stage's buffers
        // too, and the tied embedding there only).
        let model: Named = if pipe.is_first() {
            self.model_state()
        } else {
            self.model
                .params
                .iter()
                .map(|(n, t)| (n.clone(), t.shallow_clone()))
                .collect()
        };
        // Tensor parallelism: the stage's tensors whole (every tensor rank
        // takes part), written by tensor rank 0 (engine/tensor.rs).
        let model = self.tensor_whole(model)?;
        if self.tensor_rank() != 0 {
            return Ok(final_dir);
        }
        // Validated with the spec: never None here.
        let max_shard = accrue_common::spec::shard_size_bytes(&self.spec.checkpoint.max_shard_size)
            .unwrap_or(u64::MAX);
        let plan = shards::plan(&sizes(&model)?, max_shard);
        let counts: Vec<usize> = self
            .pipeline_each(&[plan.len() as f64])?
            .iter()
            .map(|c| c.first().copied().unwrap_or(0.0) as usize)
            .collect();
        let total: usize = counts.iter().sum();
        let first: usize = counts[..pipe.stage].iter().sum();
        // The writer begins; every stage learns the temporary folder
        // (nothing: the writer could not begin, and says why at the end).
        let began = if pipe.is_first() {
            if self.folder_lock.is_none() {
                self.take_folder_lock()?;
            }
            let began =
                checkpoint::begin_step(&mut checkpoint::disk::Local, &dir, step, &self.owner);
            let name = match &began {
                Ok(tmp) => tmp.to_string_lossy().into_owned(),
                Err(_) => String::new(),
            };
            for s in 1..pipe.stages {
                send_bytes(self.collective.pipeline_group()?, name.as_bytes(), s)?;
            }
            began.map(Some)
        } else {
            let b = recv_bytes(self.collective.pipeline_group()?, 0)?;
            Ok((!b.is_empty()).then(|| PathBuf::from(String::from_utf8_lossy(&b).into_owned())))
        };
        let outcome: Outcome = match &began {
            Ok(Some(tmp)) => write_stage(
                tmp,
                &model,
                &plan,
                first,
                total,
                &opt,
                pipe.stage,
                pipe.stages,
            )
            .map_err(|e| e.to_string()),
            Ok(None) => Err("the first stage could not begin the step".into()),
            Err(e) => Err(e.to_string()),
        };
        if !pipe.is_first() {
            send_bytes(self.collective.pipeline_group()?, &encode(&outcome)?, 0)?;
            let done: std::result::Result<(), String> =
                decode(&recv_bytes(self.collective.pipeline_group()?, 0)?, 0)?;
            return match done {
                Ok(()) => Ok(final_dir),
                Err(reason) => Err(Error::Checkpoint { path: dir, reason }),
            };
        }
        let mut parts = vec![outcome];
        for s in 1..pipe.stages {
            let b = recv_bytes(self.collective.pipeline_group()?, s)?;
            parts.push(decode(&b, s)?);
        }
        let result = match began {
            Ok(Some(tmp)) => self.finish_parts(&tmp, parts),
            Ok(None) => Err(Error::Schedule("the writer began no step".into())),
            Err(e) => Err(e),
        };
        let done: std::result::Result<(), String> = match &result {
            Ok(_) => Ok(()),
            Err(e) => Err(format!("the first stage's write failed: {e}")),
        };
        let bytes = encode(&done)?;
        for s in 1..pipe.stages {
            send_bytes(self.collective.pipeline_group()?, &bytes, s)?;
        }
        result
    }

    /// The writer's end of a step: every stage's part in, the index, the
    /// trainer state and the other files written, the manifest listing
    /// them all, the folder published; a failed part removes the
    /// temporary folder.
    pub(in crate::engine) fn finish_parts(
        &mut self,
        tmp: &Path,
        parts: Vec<Outcome>,
    ) -> Result<PathBuf> {
        let dir = self.checkpoint_dir.clone();
        let mut disk = checkpoint::disk::Local;
        let fail = |disk: &mut checkpoint::disk::Local, reason: String| {
            checkpoint::abandon_step(disk, tmp);
            Error::Checkpoint {
                path: dir.clone(),
                reason: format!(
                    "writing {} failed: {reason} (the temporary folder was removed)",
                    checkpoint::step_name(self.state.step)
                ),
            }
        };
        let mut entries = Vec::new();
        let mut weight_map = Vec::new();
        let mut bytes = 0u64;
        for (s, p) in parts.into_iter().enumerate() {
            match p {
                Ok(p) => {
                    entries.extend(p.entries);
                    weight_map.extend(p.weight_map);
                    bytes += p.bytes;
                }
                Err(e) => return Err(fail(&mut disk, format!("stage {s}: {e}"))),
            }
        }
        let trainer = serde_json::to_vec_pretty(&self.state).map_err(|e| Error::Encode {
            what: "the trainer state".into(),
            reason: e.to_string(),
        })?;
        let mut files: Vec<(&str, Vec<u8>)> = vec![(checkpoint::TRAINER_FILE, trainer)];
        // A single `model.safetensors` needs no index.
        if weight_map.iter().any(|(_, f)| f != checkpoint::MODEL_FILE) {
            files.push((shards::INDEX_FILE, shards::index_json(bytes, &weight_map)));
        }
        files.extend(
            self.extra_files
                .iter()
                .map(|(n, b)| (n.as_str(), b.clone())),
        );
        let refs: Vec<(&str, &[u8])> = files.iter().map(|(n, b)| (*n, b.as_slice())).collect();
        match checkpoint::write_part(&mut disk, tmp, &refs) {
            Ok(e) => entries.extend(e),
            Err(e) => return Err(fail(&mut disk, e)),
        }
        checkpoint::finish_step(
            &mut disk,
            &dir,
            self.state.step,
            tmp,
            entries,
            &checkpoint::WriteOptions {
                keep: self.spec.checkpoint.keep as usize,
                owner: self.owner.clone(),
                protect_upto: self.protect_upto,
                max_shard: u64::MAX,
            },
        )
    }
}
