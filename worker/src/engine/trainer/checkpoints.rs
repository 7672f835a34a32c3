//! The trainer's checkpoints: the committed state written by rank 0 (every rank gathers what it owns; pipeline stages write their own parts).

use crate::checkpoint;
use crate::comm::collective::Collective;
use crate::engine::Engine;
use crate::error::Result;
use std::path::PathBuf;

impl<C: Collective> Engine<C> {
    /// Writes a checkpoint of the committed state (rank 0 writes; the
    /// others hold identical parameters). Under ZeRO-3 every rank writes
    /// its share (engine/zero3.rs).
    pub fn checkpoint(&mut self) -> Result<PathBuf> {
        if let Some((step, path)) = &self.last_checkpoint {
            if *step == self.state.step {
                return Ok(path.clone());
            }
        }
        if self.placement.strategy.param_shards().is_some() {
            // ZeRO-3: every rank writes its share, never whole on one.
            let path = self.zero3_checkpoint()?;
            self.last_checkpoint = Some((self.state.step, path.clone()));
            return Ok(path);
        }
        if self.pipe.is_none()
            && matches!(self.placement.strategy.stage(), 1 | 2)
            && self.collective.world_size() > 1
        {
            // ZeRO 1 and 2: every rank writes its run's optimizer state,
            // never gathered whole.
            let path = self.sharded_checkpoint()?;
            self.last_checkpoint = Some((self.state.step, path.clone()));
            return Ok(path);
        }
        self.checkpoint_whole()
    }

    fn checkpoint_whole(&mut self) -> Result<PathBuf> {
        // Under sharding every rank takes part in gathering the state;
        // pipeline stages write their own parts (engine/pipe/checkpoint.rs).
        let opt = self.optimizer_state()?;
        // Tensor parallelism: whole, gathered over the tensor ranks
        // (engine/tensor.rs); tensor rank 0 writes.
        let opt = self.tensor_whole(opt)?;
        // The model whole on the writer's tensor group (every tensor rank
        // of data rank 0 takes part).
        let model = if self.pipe.is_none() && self.collective.rank() == 0 {
            let state = self.model_state();
            Some(self.tensor_whole(state)?)
        } else {
            None
        };
        let path = if self.pipe.is_some() {
            self.pipeline_checkpoint(opt)?
        } else if self.writes_checkpoints() {
            if self.folder_lock.is_none() {
                self.take_folder_lock()?;
            }
            let model = match model {
                Some(m) => m,
                None => self.model_state(),
            };
            checkpoint::write(
                &self.checkpoint_dir,
                &self.state,
                &model,
                &opt,
                &self.extra_files,
                &checkpoint::WriteOptions {
                    keep: self.spec.checkpoint.keep as usize,
                    owner: self.owner.clone(),
                    protect_upto: self.protect_upto,
                    // Validated with the spec: never None here.
                    max_shard: accrue_common::spec::shard_size_bytes(
                        &self.spec.checkpoint.max_shard_size,
                    )
                    .unwrap_or(u64::MAX),
                },
            )?
        } else {
            self.checkpoint_dir
                .join(format!("step-{}", self.state.step))
        };
        self.last_checkpoint = Some((self.state.step, path.clone()));
        Ok(path)
    }
}
