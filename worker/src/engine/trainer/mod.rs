//! The trainer: drives the step schedule and owns the run's accounting, events, evaluation and checkpoints.
//!
//! The engine runs operations (a micro-step, the sync step: engine/window.rs)
//! with the placement's reductions (engine/placement/); the trainer decides
//! what runs when and what it means for the run:
//! - [`step_schedule`]: which micro-steps and sync steps a window runs
//!   ([`AccumulateThenSync`] today; a pipeline's 1F1B beside it);
//! - [`accounting`]: a sync step committed to the trainer state and its
//!   [`StepReport`];
//! - [`checkpoints`] and [`eval`]: when the spec or an agreed request
//!   says, between windows;
//! - the run loop ([`Engine::run`]): events, the skip verdicts, control
//!   requests (stop, checkpoint, leave, reform) and the profiler.

mod accounting;
mod checkpoints;
mod eval;
pub mod pipeline;
mod step_schedule;

pub(super) use accounting::SyncOutcome;
pub use step_schedule::{AccumulateThenSync, Op, StepSchedule};

use super::verdict;
use super::{Engine, Event, StepReport, Summary};
use crate::comm::collective::Collective;
use crate::error::{Error, Result};

impl<C: Collective> Engine<C> {
    /// Trains to the end (or `stop_after_steps`), checkpointing and
    /// evaluating as the spec says; always leaves a checkpoint of the last step.
    pub fn run(&mut self, on_event: impl FnMut(Event<'_>)) -> Result<Summary> {
        Trainer::new(self).run(on_event)
    }
}

/// The run loop over one engine.
struct Trainer<'e, C: Collective> {
    engine: &'e mut Engine<C>,
    profiling: Profiling,
    /// Why the last skipped step was skipped (for the verdicts).
    last_skip: Option<&'static str>,
}

/// What the run loop does after a step.
enum Next {
    Continue,
    /// A stop agreed by every rank (or `stop_after_steps`): end here.
    Stop,
}

impl<'e, C: Collective> Trainer<'e, C> {
    fn new(engine: &'e mut Engine<C>) -> Self {
        let profiling = Profiling {
            from: engine.state.step,
            ..Profiling::default()
        };
        Self {
            engine,
            profiling,
            last_skip: None,
        }
    }

    fn run(mut self, mut on_event: impl FnMut(Event<'_>)) -> Result<Summary> {
        self.engine.model.set_train(true)?;
        let mut stopped = false;
        while !self.engine.is_done() {
            self.engine.profile_tick(&mut self.profiling, false)?;
            let Some(report) = self.engine.micro_step()? else {
                continue;
            };
            on_event(Event::Step(&report));
            self.account(&report)?;
            if let Next::Stop = self.after_step(&mut on_event)? {
                stopped = true;
                break;
            }
        }
        self.finish(stopped, on_event)
    }

    /// The skip verdict: every rank agreed on the skip, so all stop at
    /// this step when too many were skipped.
    fn account(&mut self, report: &StepReport) -> Result<()> {
        if !report.skipped {
            return Ok(());
        }
        let e = &self.engine;
        self.last_skip = report.skip_reason.or(self.last_skip);
        if let Some(why) = verdict::too_many_skipped(
            e.state.skipped_steps,
            e.total_steps,
            e.spec.max_skipped_fraction(),
            self.last_skip,
        ) {
            return Err(Error::Skipped(why));
        }
        Ok(())
    }

    /// Between windows: evaluation (every n epochs or steps), checkpoints (every
    /// n steps, or agreed), and the control requests.
    fn after_step(&mut self, on_event: &mut impl FnMut(Event<'_>)) -> Result<Next> {
        let e = &mut *self.engine;
        let every = e.spec.checkpoint.every_steps;
        if eval_due(
            &e.spec.eval,
            e.state.step,
            e.state.epoch,
            e.state.cursor == 0,
        ) && !e.is_done()
        {
            if let Some(r) = e.evaluate()? {
                on_event(Event::Eval(&r));
            }
        }
        if every > 0 && e.state.step.is_multiple_of(every) && !e.is_done() {
            let p = e.checkpoint()?;
            on_event(Event::Checkpoint(&p));
        }
        let requested = e.opts.control.clone();
        if std::mem::take(&mut e.agreed.checkpoint) && !e.is_done() {
            let p = e.checkpoint()?;
            on_event(Event::Checkpoint(&p));
        }
        if requested
            .as_ref()
            .is_some_and(|c| c.reform.load(std::sync::atomic::Ordering::SeqCst))
            && !e.is_done()
        {
            return Err(Error::Interrupted(format!(
                "leaving at step {} for a new generation",
                e.state.step
            )));
        }
        // A stop asked of any rank, agreed at this step's reduction, or
        // this rank's leave (after the agreed checkpoint above).
        if (e.agreed.stop
            || e.agreed.leave
            || e.opts.stop_after_steps.is_some_and(|s| e.state.step >= s))
            && !e.is_done()
        {
            return Ok(Next::Stop);
        }
        Ok(Next::Continue)
    }

    /// The end of the run: the last checkpoint (always) and, for a
    /// finished run, the final evaluation.
    fn finish(mut self, stopped: bool, mut on_event: impl FnMut(Event<'_>)) -> Result<Summary> {
        let e = &mut *self.engine;
        e.profile_tick(&mut self.profiling, true)?;
        if !stopped {
            if let Some(why) =
                verdict::nothing_applied(e.state.optimizer_steps, e.state.step, self.last_skip)
            {
                return Err(Error::Skipped(why));
            }
        }
        tracing::info!(
            rank = e.collective.rank(),
            stage = e.placement.strategy.stage(),
            optimizer_state_bytes = e.optimizer_state_bytes(),
            gradient_bytes_between_micro_steps = e.most_grad_between,
            gradient_bytes_after_sync = e.gradient_bytes(),
            "optimizer state held by this rank"
        );
        if e.tensor.is_some() {
            // What the tensor group carried (worker/benches/tensor_parallel.py).
            let (layers, other) = crate::comm::tensor_ops::bytes_so_far();
            tracing::info!(
                tensor_rank = e.mesh.tensor_rank(),
                layer_allreduce_bytes = layers,
                other_tensor_bytes = other,
                "tensor-parallel traffic of this rank"
            );
        }
        let checkpoint = e.checkpoint()?;
        on_event(Event::Checkpoint(&checkpoint));
        let eval = if stopped { None } else { e.evaluate()? };
        if let Some(r) = &eval {
            on_event(Event::Eval(r));
        }
        Ok(Summary {
            state: e.state.clone(),
            eval,
            checkpoint,
            finished: !stopped,
        })
    }
}

/// The run loop's profiler ([`RunOptions::profile`]): the session while it
/// records, whether it has been written, and the step this run started at.
#[derive(Default)]
pub(super) struct Profiling {
    session: Option<crate::cuda::profiler::Session>,
    finished: bool,
    from: u64,
}

impl<C: Collective> Engine<C> {
    /// Starts or stops the profiler as [`crate::cuda::profiler::decide`] says,
    /// between windows; `done`: the run loop has ended.
    fn profile_tick(&mut self, p: &mut Profiling, done: bool) -> Result<()> {
        use crate::cuda::profiler::{decide, Act, Session};
        let Some(spec) = &self.opts.profile else {
            return Ok(());
        };
        let steps_run = self.state.step.saturating_sub(p.from);
        let in_window = !done && self.window.in_flight();
        match decide(
            spec,
            steps_run,
            in_window,
            p.session.is_some(),
            done,
            p.finished,
        ) {
            Act::Start => {
                p.session = Some(Session::start(self.device.is_cuda())?);
                tracing::info!(step = self.state.step, path = %spec.path.display(), "profiling");
            }
            Act::Stop => {
                if let Some(session) = p.session.take() {
                    let events = session.finish(&spec.path)?;
                    p.finished = true;
                    tracing::info!(
                        step = self.state.step,
                        events,
                        path = %spec.path.display(),
                        "profile written"
                    );
                }
            }
            Act::Nothing => {}
        }
        Ok(())
    }
}

/// Whether the step just committed (`step`, in `epoch`, which it ended
/// when `epoch_ended`) evaluates: every `every_steps` steps, or at the end
/// of every `every_epochs` epochs; once when both fall on it.
pub(crate) fn eval_due(
    eval: &crate::spec::EvalSpec,
    step: u64,
    epoch: u64,
    epoch_ended: bool,
) -> bool {
    let by_steps = eval.every_steps > 0 && step.is_multiple_of(eval.every_steps);
    let by_epochs = eval.every_epochs > 0 && epoch_ended && epoch.is_multiple_of(eval.every_epochs);
    by_steps || by_epochs
}

#[cfg(test)]
mod eval_tests {
    use super::eval_due;
    use crate::spec::EvalSpec;

    #[test]
    fn evaluation_falls_every_n_steps_or_epochs_once() {
        let spec = |every_steps, every_epochs| EvalSpec {
            every_steps,
            every_epochs,
            ..EvalSpec::default()
        };
        let steps = spec(3, 0);
        let due: Vec<u64> = (1..=10)
            .filter(|&s| eval_due(&steps, s, 0, false))
            .collect();
        assert_eq!(due, vec![3, 6, 9]);
        // Epoch 2 ends at step 8: with every_epochs = 2 it evaluates.
        let both = spec(3, 2);
        assert!(eval_due(&both, 8, 2, true));
        assert!(!eval_due(&both, 4, 1, true));
        assert!(eval_due(&both, 6, 1, false));
        // Neither set: never between windows (the final one is separate).
        assert!(!eval_due(&spec(0, 0), 6, 2, true));
    }
}
