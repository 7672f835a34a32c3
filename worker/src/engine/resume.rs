//! The checkpoint folder at job start: its owner checked, rank 0's writer
//! lock taken and dead writers' leftovers swept, the newest verified
//! checkpoint loaded on a resume.

use super::*;

impl<C: Collective> Engine<C> {
    /// Rank 0's claim on the checkpoint folder, in this order: the
    /// folder's owner record must name this job (or be absent), then the
    /// writer lock (refused naming the holder when another run keeps it),
    /// then the temporary files of dead writers are swept. A folder
    /// another job owns is never touched.
    pub(super) fn take_folder_lock(&mut self) -> Result<()> {
        self.check_owner()?;
        let held = checkpoint::lock::FolderLock::acquire(
            &self.checkpoint_dir,
            &self.owner,
            self.opts.lock_wait,
        )?;
        for p in checkpoint::sweep(&held)? {
            tracing::warn!(path = %p.display(), "removed a temporary checkpoint file of a writer that died");
        }
        self.folder_lock = Some(held);
        Ok(())
    }

    /// Refuses a checkpoint folder another job owns.
    pub(super) fn check_owner(&self) -> Result<()> {
        let dir = &self.checkpoint_dir;
        let found = checkpoint::owner::read(dir).map_err(|reason| Error::Checkpoint {
            path: dir.clone(),
            reason,
        })?;
        match found.and_then(|o| checkpoint::owner::refusal(dir, &o, &self.owner)) {
            Some(reason) => Err(Error::Checkpoint {
                path: dir.clone(),
                reason,
            }),
            None => Ok(()),
        }
    }

    /// Loads the newest verified checkpoint (LATEST's step, else the
    /// newest step whose manifest verifies); false when the folder holds
    /// none. Weights, optimizer state and counters come from one folder.
    pub(super) fn resume(&mut self) -> Result<bool> {
        if self.placement.strategy.param_shards().is_some() {
            // ZeRO-3: each rank takes its chunks of the checkpoint.
            return self.zero3_resume();
        }
        self.resume_whole()
    }

    fn resume_whole(&mut self) -> Result<bool> {
        let Some(found) = checkpoint::load_newest(&self.checkpoint_dir, &self.owner)? else {
            return Ok(false);
        };
        let loaded = found.loaded;
        self.check_resumable(&loaded.path, &loaded.state)?;
        self.model.load_named(
            WeightsFrom::Checkpoint(&loaded.path),
            checkpoint::to_device(loaded.model, self.device)?,
        )?;
        let optimizer = self.stage_optimizer_state(loaded.optimizer);
        let optimizer = self.tensor_slice_state(optimizer)?;
        self.load_optimizer_state(optimizer, loaded.state.optimizer_steps)?;
        self.resumed_with(loaded.state, &loaded.path, &found.why, found.fell_back);
        Ok(true)
    }

    /// A resume under ZeRO-3: the newest verified step (its files read in
    /// pieces, never held), then this rank's chunks of its parameters and
    /// optimizer state taken through memory maps, so no rank holds the
    /// whole model (engine/zero3.rs).
    fn zero3_resume(&mut self) -> Result<bool> {
        let Some(found) = checkpoint::newest_verified(&self.checkpoint_dir, &self.owner)? else {
            return Ok(false);
        };
        let path = found.path.clone();
        self.check_resumable(&path, &found.state)?;
        self.zero3_load_chunks(&path)?;
        let files = checkpoint::optimizer_files(&path)
            .map_err(|reason| Error::Checkpoint {
                path: path.clone(),
                reason,
            })?
            .into_iter()
            .map(|f| (f, None))
            .collect();
        let steps = found.state.optimizer_steps;
        checkpoint::mapped::with_mapped_files(files, |tensors, forget| {
            let optimizer = self.stage_optimizer_state(tensors);
            // Tensor parallelism: this rank's slices of the whole state.
            let optimizer = self.tensor_slice_state(optimizer)?;
            self.load_optimizer_state_mapped(optimizer, steps, forget)
        })
        .map_err(|reason| Error::Checkpoint {
            path: path.clone(),
            reason,
        })??;
        self.resumed_with(found.state, &path, &found.why, found.fell_back);
        Ok(true)
    }

    /// After a resume from step folder `path` (`why`: how it was chosen):
    /// its counters, under this run's identity.
    fn resumed_with(&mut self, state: TrainerState, path: &Path, why: &str, fell_back: bool) {
        if fell_back {
            self.protect_upto = Some(state.step);
        }
        self.resumed_from = Some(format!("checkpoint {why}"));
        self.last_checkpoint = Some((state.step, path.to_path_buf()));
        // The counters come from the folder the weights came from; this
        // run's identity (job id, spec hash, kinds) is what it writes next.
        let mut state = state;
        if state.spec_hash != self.owner.spec_hash && !state.spec_hash.is_empty() {
            tracing::info!(was = %state.spec_hash, now = %self.owner.spec_hash, "resuming with a changed spec");
        }
        state.job_id = self.owner.job_id.clone();
        state.spec_hash = self.owner.spec_hash.clone();
        state.model_kind = self.spec.model.kind.as_str().to_string();
        state.optimizer_kind = self.spec.optimizer.kind.as_str().to_string();
        self.state = state;
        self.holds_committed = true;
        tracing::info!(step = self.state.step, path = %path.display(), why = %why, "resumed");
    }

    /// A checkpoint of another model or optimizer kind is refused naming
    /// the field (shapes and names: [`Model::load_named`] names them).
    pub(super) fn check_resumable(&self, path: &Path, state: &TrainerState) -> Result<()> {
        let ours = [
            (
                "model.kind",
                self.spec.model.kind.as_str(),
                &state.model_kind,
            ),
            (
                "optimizer.kind",
                self.spec.optimizer.kind.as_str(),
                &state.optimizer_kind,
            ),
        ];
        for (field, now, then) in ours {
            if !then.is_empty() && then != now {
                return Err(Error::Checkpoint {
                    path: path.to_path_buf(),
                    reason: format!(
                        "was written with {field} = \"{then}\", the spec says \"{now}\": a resume keeps the {field} (its state would not carry over)"
                    ),
                });
            }
        }
        Ok(())
    }
}
