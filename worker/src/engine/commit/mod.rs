//! The one checkpoint protocol, for any set of writers (docs/SEMANTICS.md):
//! every rank hands its [`Share`] (share.rs: the tensors it owns and
//! writes, or nothing), and one exchange writes the step folder without
//! gathering the model on one rank:
//!
//! 1. **begin**: the finisher (the first stage's data rank 0, tensor rank
//!    0, holding the folder's lock) claims the folder and makes the step's
//!    temporary folder; every rank learns its path;
//! 2. **write**: each writer writes its files there: its model tensors as
//!    shards of one Hugging Face checkpoint (numbered over every writer in
//!    place order, stage by stage, data rank by data rank; one file in
//!    all is `model.safetensors`), and its optimizer state as part
//!    `optimizer-0000i-of-0000N` (one writer: `optimizer.safetensors`);
//! 3. **finish**: the finisher takes every writer's outcome, and only when
//!    all succeeded ([`plan::complete`]) writes the index, the trainer
//!    state and the other files, lists every file in the manifest and
//!    publishes the step (checkpoint/write.rs: `begin_step`, `write_part`,
//!    `finish_step`); a failure removes the temporary folder;
//! 4. **done**: every rank learns the outcome and returns the step
//!    folder's path, or the same failure.
//!
//! The whole model is the one-writer case; pipeline stages, ZeRO 1 to 3
//! and tensor ranks differ only in what their shares hold. Only names,
//! sizes, checksums and outcomes cross the world.

pub(in crate::engine) mod plan;
mod share;

use crate::checkpoint::{self, shards};
use crate::comm::collective::Collective;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::family::Named;
use plan::{Numbering, Outcome, Part, NO_PLACE};
pub(in crate::engine) use share::Share;
use std::path::{Path, PathBuf};

fn encode<T: serde::Serialize>(v: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| Error::Encode {
        what: "a rank's checkpoint report".into(),
        reason: e.to_string(),
    })
}

fn decode<T: serde::de::DeserializeOwned>(b: &[u8], from: usize, dir: &Path) -> Result<T> {
    serde_json::from_slice(b).map_err(|e| Error::Checkpoint {
        path: dir.to_path_buf(),
        reason: format!("rank {from}'s checkpoint report: {e}"),
    })
}

/// Writes a writer's files into `tmp`: `model` in the shards `plan`
/// groups (numbered from `n.first` of `n.total`) and the optimizer state
/// `opt` as part `n.part` of `n.parts`.
fn write_share(
    tmp: &Path,
    model: &Named,
    opt: &Named,
    plan: &[Vec<usize>],
    n: &Numbering,
) -> Result<Part> {
    let sizes = checkpoint::tensor_bytes(model)?;
    let (mut files, weight_map) =
        checkpoint::shard_files(model, plan, |i| plan::model_file(n.first + i, n.total))?;
    files.push((
        plan::optimizer_file(n.part, n.parts),
        checkpoint::safetensors_bytes(opt)?,
    ));
    let refs: Vec<(&str, &[u8])> = files
        .iter()
        .map(|(f, b)| (f.as_str(), b.as_slice()))
        .collect();
    let entries =
        checkpoint::write_part(&mut checkpoint::disk::Local, tmp, &refs).map_err(|e| {
            Error::Checkpoint {
                path: tmp.to_path_buf(),
                reason: e,
            }
        })?;
    Ok(Part {
        entries,
        weight_map,
        bytes: sizes.iter().sum(),
    })
}

impl<C: Collective> Engine<C> {
    /// Writes the committed step from every rank's `share` (see the module
    /// documentation); every rank returns the step folder's path, or the
    /// same failure.
    pub(in crate::engine) fn commit_step(&mut self, share: Share) -> Result<PathBuf> {
        let step = self.state.step;
        let dir = self.checkpoint_dir.clone();
        // Validated with the spec: never None here.
        let max_shard = accrue_common::spec::shard_size_bytes(&self.spec.checkpoint.max_shard_size)
            .unwrap_or(u64::MAX);
        // (A writer without model tensors writes no shard.)
        let groups = match share.model.is_empty() {
            true => Vec::new(),
            false => shards::plan(&checkpoint::tensor_bytes(&share.model)?, max_shard),
        };
        let places = self.collective.world_gather_u64(share.place)?;
        let counts = self.collective.world_gather_u64(groups.len() as u64)?;
        let numbers = plan::numbering(&places, &counts);
        let root = plan::finisher(&places).ok_or_else(|| Error::Checkpoint {
            path: dir.clone(),
            reason: format!("no rank holds the first stage's data rank 0: places {places:?}"),
        })?;
        let finisher = share.place == 0;
        // begin: the finisher makes the temporary folder; every rank
        // learns it (empty: it could not begin, and says why at the end).
        let began = match finisher {
            true => self.begin_commit().map(Some),
            false => Ok(None),
        };
        let mut name = match &began {
            Ok(Some(tmp)) => tmp.to_string_lossy().into_owned().into_bytes(),
            _ => Vec::new(),
        };
        self.collective.world_broadcast_bytes(&mut name, root)?;
        let tmp =
            (!name.is_empty()).then(|| PathBuf::from(String::from_utf8_lossy(&name).into_owned()));
        // write: each writer its files.
        let mine = places.iter().position(|&p| p == share.place);
        let outcome: Outcome = match (&tmp, mine.and_then(|i| numbers[i].as_ref())) {
            (_, None) => Ok(Part::default()),
            (Some(tmp), Some(n)) => {
                write_share(tmp, &share.model, &share.opt, &groups, n).map_err(|e| e.to_string())
            }
            (None, Some(_)) => Err("the finisher could not begin the step".into()),
        };
        drop(share);
        // Every writer's outcome to the finisher, in world rank order.
        let mut parts = Vec::new();
        for (from, &at) in places.iter().enumerate().filter(|(_, &p)| p != NO_PLACE) {
            let mut b = match Some(from) == mine {
                true => encode(&outcome)?,
                false => Vec::new(),
            };
            self.collective.world_broadcast_bytes(&mut b, from)?;
            if finisher {
                parts.push((at, decode::<Outcome>(&b, from, &dir)?));
            }
        }
        // finish: only a complete step is published.
        let result = match (finisher, began, tmp) {
            (false, _, _) => Ok(dir.join(checkpoint::step_name(step))),
            (true, Err(e), _) => Err(e),
            (true, Ok(Some(_)), Some(tmp)) => {
                let writers = places.iter().filter(|&&p| p != NO_PLACE).count();
                self.finish_commit(&tmp, plan::complete(parts, writers))
            }
            (true, Ok(_), _) => Err(Error::Checkpoint {
                path: dir.clone(),
                reason: "the finisher began no step".into(),
            }),
        };
        // done: every rank the finisher's outcome.
        let mut done = encode(&match &result {
            Ok(_) => Ok(()),
            Err(e) => Err(format!("the finisher's write failed: {e}")),
        })?;
        self.collective.world_broadcast_bytes(&mut done, root)?;
        match decode::<std::result::Result<(), String>>(&done, root, &dir)? {
            Err(reason) if !finisher => Err(Error::Checkpoint { path: dir, reason }),
            _ => result,
        }
    }

    /// The finisher's begin: the folder's lock (once), the folder claimed
    /// and the step's temporary folder made.
    fn begin_commit(&mut self) -> Result<PathBuf> {
        if self.folder_lock.is_none() {
            self.take_folder_lock()?;
        }
        checkpoint::begin_step(
            &mut checkpoint::disk::Local,
            &self.checkpoint_dir,
            self.state.step,
            &self.owner,
        )
    }

    /// The finisher's end of a step: the writers' parts joined (`parts`:
    /// or why the step is incomplete), the index, the trainer state and
    /// the other files written, the manifest listing them all, the folder
    /// published; an incomplete step or a failed write removes the
    /// temporary folder.
    fn finish_commit(
        &mut self,
        tmp: &Path,
        parts: std::result::Result<Part, String>,
    ) -> Result<PathBuf> {
        let dir = self.checkpoint_dir.clone();
        let mut disk = checkpoint::disk::Local;
        let fail = |disk: &mut checkpoint::disk::Local, reason: String| {
            checkpoint::abandon_step(disk, tmp);
            Error::Checkpoint {
                path: dir.clone(),
                reason: format!(
                    "writing {} failed: {reason}; {} (the temporary folder was removed)",
                    checkpoint::step_name(self.state.step),
                    checkpoint::latest_says(&dir)
                ),
            }
        };
        let all = match parts {
            Ok(p) => p,
            Err(e) => return Err(fail(&mut disk, e)),
        };
        let mut entries = all.entries;
        let trainer = match serde_json::to_vec_pretty(&self.state) {
            Ok(t) => t,
            Err(e) => return Err(fail(&mut disk, format!("the trainer state: {e}"))),
        };
        let mut files: Vec<(&str, Vec<u8>)> = vec![(checkpoint::TRAINER_FILE, trainer)];
        // A single `model.safetensors` needs no index.
        if all
            .weight_map
            .iter()
            .any(|(_, f)| f != checkpoint::MODEL_FILE)
        {
            files.push((
                shards::INDEX_FILE,
                shards::index_json(all.bytes, &all.weight_map),
            ));
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

#[cfg(test)]
mod tests;
