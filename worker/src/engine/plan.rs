//! Sharding and the window plan for the current world size and k: what
//! this rank reads for the rest of the epoch, and how many steps are left.

use super::Engine;
use crate::comm::collective::Collective;
use crate::optim::schedule::Schedule;
use crate::source::sampler::{ShardSpec, WindowPlan};

impl<C: Collective> Engine<C> {
    /// Points the sharding and the window plan at the current world size
    /// and k; when they differ from the ones the cursor counts in, the rest
    /// of the epoch is re-sharded from the committed cursor.
    pub(super) fn reshard(&mut self) {
        let world = self.collective.world_size();
        let rank = self.collective.rank();
        let k = self.plan.k;
        let b = self.spec.data.batch_size as usize;
        let s = &mut self.state;
        if s.world_size != world as u64 || s.accumulation_steps != k as u64 {
            if s.cursor > 0 {
                let old = ShardSpec {
                    world: s.world_size.max(1) as usize,
                    offset: s.epoch_offset as usize,
                    ..self.shard
                };
                s.epoch_offset = old.offset_after(s.cursor as usize * b) as u64;
                s.cursor = 0;
            }
            tracing::info!(
                from_world = s.world_size,
                from_k = s.accumulation_steps,
                world,
                k,
                epoch_offset = s.epoch_offset,
                "re-sharding the rest of the epoch"
            );
            s.world_size = world as u64;
            s.accumulation_steps = k as u64;
        }
        let offset = s.epoch_offset as usize;
        self.set_plan(world, rank, offset);
        if self.plan.micro_batches() == 0 && self.state.epoch_offset > 0 {
            // Nothing of this epoch is left for the new world (drop_last).
            self.state.epoch += 1;
            self.state.epoch_offset = 0;
            self.set_plan(world, rank, 0);
        }
        self.total_steps = self.compute_total_steps();
        self.schedule = Schedule::from_spec(&self.spec, self.total_steps);
    }

    pub(super) fn set_plan(&mut self, world: usize, rank: usize, offset: usize) {
        self.shard = ShardSpec {
            world,
            offset,
            ..self.shard
        };
        self.plan = WindowPlan {
            samples: self.shard.rank_len(rank),
            max_samples: self.shard.rank_len(0),
            ..self.plan
        };
        self.epoch_indices = None;
    }

    /// `max_steps`, or the committed steps plus the windows left in this
    /// epoch and in the remaining full epochs under the current plan.
    fn compute_total_steps(&self) -> u64 {
        if let Some(m) = self.spec.max_steps {
            return m;
        }
        let epochs = self.spec.epochs.unwrap_or(1);
        let s = &self.state;
        if s.epoch >= epochs {
            return s.step;
        }
        let full = ShardSpec {
            offset: 0,
            ..self.shard
        };
        let full_windows = WindowPlan {
            samples: full.rank_len(self.collective.rank()),
            max_samples: full.rank_len(0),
            ..self.plan
        }
        .windows() as u64;
        let here =
            (self.plan.windows() as u64).saturating_sub(s.cursor / self.plan.k.max(1) as u64);
        s.step + here + (epochs - s.epoch - 1) * full_windows
    }
}
