//! The trainer's accounting: a sync step's outcome committed to the trainer state and reported.

use crate::comm::collective::Collective;
use crate::engine::{Engine, StepReport, Timing};
use std::time::Duration;

/// What a sync step decided and measured, for the commit.
pub(in crate::engine) struct SyncOutcome {
    /// Loss terms of the window over the loss owner's group.
    pub global_count: u64,
    /// The window's loss, summed over its terms and the group.
    pub loss_sum: f64,
    pub grad_norm: f64,
    pub clip_coef: f64,
    pub skipped: bool,
    pub skip_reason: Option<&'static str>,
    /// fp16: the step overflowed (the loss scale backs off).
    pub overflow: bool,
    pub scaler: Option<crate::cuda::amp::LossScale>,
    pub lr: f64,
    pub comm: Duration,
    pub clip: Duration,
    pub optimizer: Duration,
}

impl<C: Collective> Engine<C> {
    /// Commits the window as one step: counters, the loss scale, the
    /// cursor (the next epoch re-sharded whole), and the step's report.
    pub(in crate::engine) fn commit(&mut self, o: SyncOutcome) -> StepReport {
        self.holds_committed = true;
        let s = &mut self.state;
        s.step += 1;
        s.samples_seen += o.global_count;
        s.skipped_steps += o.skipped as u64;
        s.optimizer_steps = self.placement.optimizer.steps;
        s.loss_scale = o
            .scaler
            .map(|ls| ls.update(&self.spec.loss_scaling, o.overflow));
        s.lr = o.lr;
        s.cursor += self.window.micro as u64;
        if s.cursor as usize >= self.plan.micro_batches() {
            s.epoch += 1;
            s.cursor = 0;
            if s.epoch_offset > 0 {
                // The next epoch is sharded whole again.
                s.epoch_offset = 0;
                let (world, rank) = (self.collective.world_size(), self.collective.rank());
                self.set_plan(world, rank, 0);
            }
        }
        let s = &mut self.state;
        let wall = self.window.started.map(|t| t.elapsed()).unwrap_or_default();
        let window = std::mem::take(&mut self.window);
        let (sent, received) = self.collective.bytes();
        StepReport {
            step: s.step,
            total_steps: self.total_steps,
            epoch: s.epoch,
            micro_step: s.micro_step,
            loss: loss_sum_global(o.loss_sum, o.global_count),
            grad_norm: o.grad_norm,
            clip_coef: o.clip_coef,
            skipped: o.skipped,
            skip_reason: o.skip_reason,
            samples: o.global_count,
            samples_seen: s.samples_seen,
            lr: o.lr,
            samples_per_sec: o.global_count as f64 / wall.as_secs_f64().max(1e-9),
            timing: Timing {
                compute_s: window.compute.as_secs_f64(),
                comm_s: o.comm.as_secs_f64(),
                clip_s: o.clip.as_secs_f64(),
                optimizer_s: o.optimizer.as_secs_f64(),
                bubble_s: window.bubble.as_secs_f64(),
                transfer_s: window.transfer.as_secs_f64(),
            },
            bytes_sent: sent - window.bytes_at_start.0,
            bytes_received: received - window.bytes_at_start.1,
            job_bytes_sent: sent,
            job_bytes_received: received,
            loss_scale: o.scaler.map_or(0.0, |ls| f64::from(ls.scale)),
            graph_replays: window.graph_replays,
            eager_reason: window.eager_reason,
            sync_graph_replayed: window.sync_replayed,
            sync_eager_reason: window.sync_eager_reason,
            resumed_from: self.resumed_from.take().unwrap_or_default(),
            peak_rss_bytes: crate::engine::report::peak_rss_bytes().unwrap_or(0),
        }
    }
}

/// The window's mean loss per term.
fn loss_sum_global(sum: f64, count: u64) -> f64 {
    sum / count.max(1) as f64
}
