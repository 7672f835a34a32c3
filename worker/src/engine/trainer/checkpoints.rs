//! The trainer's checkpoints: every rank hands what it writes of the
//! committed state, and one exchange writes the step folder
//! (engine/commit/).

use crate::comm::collective::Collective;
use crate::engine::Engine;
use crate::error::Result;
use std::path::PathBuf;

impl<C: Collective> Engine<C> {
    /// Writes a checkpoint of the committed state (every rank calls it:
    /// each hands its share, the parameters and optimizer state it owns,
    /// or nothing; the whole model is the one-writer case) and returns the
    /// step folder's path, the same on every rank, or the same failure.
    pub fn checkpoint(&mut self) -> Result<PathBuf> {
        if let Some((step, path)) = &self.last_checkpoint {
            if *step == self.state.step {
                return Ok(path.clone());
            }
        }
        let share = self.checkpoint_share()?;
        let path = self.commit_step(share)?;
        self.last_checkpoint = Some((self.state.step, path.clone()));
        Ok(path)
    }
}
