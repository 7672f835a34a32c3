//! The step schedule: the sequence of micro-steps and sync steps one window runs.
//!
//! A [`StepSchedule`] says, for the window that starts at a micro-batch of
//! the epoch, which operations the engine runs in which order. Today's one
//! schedule is [`AccumulateThenSync`]: k micro-steps (forward, loss,
//! backward into the accumulation buffers), then the sync step (the last
//! window of an epoch may be shorter). A pipeline schedule (1F1B: forwards
//! and backwards of different micro-batches interleaved across stages, with
//! sends and receives between them) is a second implementation, yielding
//! its own [`Op`]s; the engine runs them one by one
//! ([`crate::engine::Engine::micro_step`]).

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
    fn window(&self, plan: &WindowPlan, first: usize) -> VecDeque<Op> {
        let mut ops = VecDeque::new();
        let mut m = first;
        loop {
            ops.push_back(Op::Micro { index: m });
            if plan.is_sync(m) {
                break;
            }
            m += 1;
        }
        ops.push_back(Op::Sync);
        ops
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
