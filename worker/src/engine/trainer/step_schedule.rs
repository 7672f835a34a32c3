//! The step schedule: the sequence of micro-steps and sync steps one window runs.
//!
//! A [`StepSchedule`] says, for the window that starts at a micro-batch of
//! the epoch, which operations the engine runs in which order. Without
//! stages it is [`AccumulateThenSync`]: the one-stage pipeline schedule's
//! op list (engine/trainer/pipeline.rs, P = V = 1) as k micro-steps
//! (forward, loss, backward into the accumulation buffers), then the sync
//! step (the last window of an epoch may be shorter); the engine runs them
//! one by one ([`crate::engine::Engine::micro_step`]). Pipeline stages run
//! the same generator's lists for P ranks (engine/pipe/window.rs).

use crate::source::sampler::WindowPlan;
use std::collections::VecDeque;

/// One operation of a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Forward, loss and backward of micro-batch `index` of the epoch (its
    /// gradients add into the accumulation buffers).
    Micro { index: usize },
    /// The sync step: reduce, normalize, clip, step, commit.
    Sync,
}

/// The operations of the windows of an epoch.
pub trait StepSchedule: Send {
    /// The operations of the window whose first micro-batch is `first`
    /// (the committed cursor), in the order they run; it ends with
    /// [`Op::Sync`].
    fn window(&self, plan: &WindowPlan, first: usize) -> VecDeque<Op>;
}

/// k micro-steps, then the sync step: the window ends after micro-batch m
/// when m + 1 is a multiple of k or the epoch's last
/// ([`WindowPlan::is_sync`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct AccumulateThenSync;

impl StepSchedule for AccumulateThenSync {
    /// The one-stage pipeline schedule's op list (P = V = 1: no transfers;
    /// the only chunk is the last, so each forward runs the loss and its
    /// backward, and the backward op only marks the micro-batch done) as
    /// micro-steps, then the sync step: data parallelism is the schedule
    /// with one stage.
    fn window(&self, plan: &WindowPlan, first: usize) -> VecDeque<Op> {
        let mut k = 1;
        while !plan.is_sync(first + k - 1) {
            k += 1;
        }
        let one = super::pipeline::Layout::new(1, 1);
        super::pipeline::rank_ops(super::pipeline::PipeSchedule::OneFOneB, &one, 0, k)
            .into_iter()
            .filter_map(|op| match op {
                super::pipeline::PipeOp::Forward { micro, .. } => Some(Op::Micro {
                    index: first + micro,
                }),
                _ => None,
            })
            .chain(std::iter::once(Op::Sync))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(samples: usize, batch: usize, k: usize) -> WindowPlan {
        WindowPlan {
            samples,
            max_samples: samples,
            batch,
            k,
        }
    }

    fn micro(ops: &VecDeque<Op>) -> Vec<usize> {
        ops.iter()
            .filter_map(|o| match o {
                Op::Micro { index } => Some(*index),
                Op::Sync => None,
            })
            .collect()
    }

    /// The one-stage schedule's list: forward then backward of each
    /// micro-batch in order, no transfers.
    #[test]
    fn one_stage_is_forward_backward_without_transfers() {
        use crate::engine::trainer::pipeline::{rank_ops, Layout, PipeOp, PipeSchedule};
        let ops = rank_ops(PipeSchedule::OneFOneB, &Layout::new(1, 1), 0, 3);
        let want: Vec<PipeOp> = (0..3)
            .flat_map(|micro| {
                [
                    PipeOp::Forward { chunk: 0, micro },
                    PipeOp::Backward { chunk: 0, micro },
                ]
            })
            .collect();
        assert_eq!(ops, want);
    }

    #[test]
    fn k_micro_steps_then_the_sync_step() {
        let p = plan(40, 4, 3); // 10 micro-batches, windows of 3, 3, 3, 1
        let w = AccumulateThenSync.window(&p, 0);
        assert_eq!(micro(&w), vec![0, 1, 2]);
        assert_eq!(w.back(), Some(&Op::Sync));
        assert_eq!(micro(&AccumulateThenSync.window(&p, 3)), vec![3, 4, 5]);
        // The epoch's last window is short.
        assert_eq!(micro(&AccumulateThenSync.window(&p, 9)), vec![9]);
    }

    #[test]
    fn every_window_has_one_sync_step_at_its_end() {
        for k in 1..5 {
            let p = plan(30, 4, k);
            let mut m = 0;
            let mut windows = 0;
            while m < p.micro_batches() {
                let w = AccumulateThenSync.window(&p, m);
                assert_eq!(w.iter().filter(|o| **o == Op::Sync).count(), 1);
                assert_eq!(w.back(), Some(&Op::Sync));
                m += w.len() - 1;
                windows += 1;
            }
            assert_eq!(windows, p.windows());
        }
    }
}
