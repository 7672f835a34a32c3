//! CUDA graphs for the micro-step (issue 19): every decision, as pure
//! functions. The engine (engine/graph.rs) asks [`decide`] before each
//! micro-step and feeds the outcome to [`Phase::after`]; the C++ shim
//! (csrc/graph.cpp, built with `ACCRUE_CUDA=1`) only captures and replays.
//!
//! The micro-step's *body* is what a graph holds: the batch copied into
//! static input buffers, forward, loss (times a loss-scale tensor under
//! fp16), backward adding into the flat gradient buffer the `.grad` views
//! point into, and the loss added into a static accumulator. It runs
//! eagerly a few times first (warm-up: cuDNN's algorithm choice, autograd's
//! and the allocator's first-use work happen outside the capture, as
//! `torch.cuda.graphs` does on a side stream), is captured once, then
//! replayed. Anything the graph cannot hold runs the ordinary eager
//! micro-step, with the reason in the log and in the step report.
//!
//! The sync step's work after the all-reduce is a second graph
//! (engine/sync_graph.rs) with its own [`Phase`], decided by
//! [`decide_unless`] with [`sync_blocker`].

use std::fmt;

/// How micro-steps of this job can run, decided once per engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The ordinary eager micro-step, always.
    Off(EagerReason),
    /// The graph body, run eagerly without capturing: what a capture would
    /// hold, on any device (tests check it against the eager micro-step
    /// without a GPU).
    BodyOnly,
    /// Warm up with the body this many times, capture it, then replay.
    Capture { warmup: u32 },
}

/// The text of a step report's eager reason, as the proto and the logs
/// carry it ("" for none).
pub fn reason_text(reason: Option<&EagerReason>) -> String {
    reason.map(ToString::to_string).unwrap_or_default()
}

/// A step report's eager reason in JSON: its text ("" for none).
pub fn serialize_reason<S: serde::Serializer>(
    reason: &Option<EagerReason>,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_str(&reason_text(reason.as_ref()))
}

/// Why a micro-step ran eagerly (the step report's `eager_reason`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EagerReason {
    /// `[performance] cuda_graphs = false`.
    Disabled,
    /// The job runs on the CPU (graphs are a CUDA feature).
    NotCuda,
    /// This worker was built without `ACCRUE_CUDA=1` (no graph shim).
    NotBuilt,
    /// ZeRO stage 2 frees and re-allocates the gradient buffer between
    /// steps: a graph would write into freed memory.
    ReleasedGradients,
    /// A micro-batch of another size than the captured one (the short last
    /// window with `drop_last = false`, an uneven shard with `pad = false`).
    BatchSize { got: usize, captured: usize },
    /// The capture failed (a model that synchronizes with the host, say):
    /// the job runs eagerly from then on.
    CaptureFailed(String),
    /// The sync step: ZeRO stage 1 steps this rank's slice between a
    /// reduce-scatter and an all-gather (engine/zero.rs).
    ShardedStep,
    /// The data source reads each batch from the host (a language model's
    /// token files, memory-mapped) and `normalize = "mean" | "sum"`
    /// divides each micro-batch's loss by its own target count, a host
    /// number the captured graph would keep from its capture.
    PerBatchCount,
    /// The sync step: the optimizer makes its state in its first step
    /// (SGD's momentum buffer is a copy of the first gradient), which a
    /// graph cannot keep.
    NoOptimizerState,
    /// The job runs in pipeline stages: a stage's micro-steps wait for
    /// its neighbours' activations and gradients, and its sync step sums
    /// the gradient norm over the stages between the reduction and the
    /// step (graphing a stage is later work).
    PipelineStage,
    /// `parallel.tensor > 1`: the layers' collectives run inside the
    /// micro-step and wait on the host, and the norm is summed over the
    /// tensor group inside the sync step.
    TensorParallel,
    /// `activation_checkpointing = "full"`: the micro-step runs its blocks
    /// in segments, recomputing each in the backward (graphing that is
    /// later work).
    ActivationCheckpointing,
}

impl fmt::Display for EagerReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Disabled => write!(f, "cuda_graphs = false"),
            Self::NotCuda => write!(f, "the device is the CPU"),
            Self::NotBuilt => write!(f, "this worker was built without ACCRUE_CUDA=1"),
            Self::ReleasedGradients => write!(
                f,
                "sharding stage 2 re-allocates the gradient buffer every step"
            ),
            Self::BatchSize { got, captured } => write!(
                f,
                "a micro-batch of {got} samples (the graph holds {captured})"
            ),
            Self::CaptureFailed(e) => write!(f, "the capture failed: {e}"),
            Self::ShardedStep => write!(
                f,
                "sharding stage 1 steps a slice between a reduce-scatter and an all-gather"
            ),
            Self::PerBatchCount => write!(
                f,
                "normalize = mean | sum divides each micro-batch by its own target count"
            ),
            Self::NoOptimizerState => {
                write!(f, "the optimizer makes its state in its first step")
            }
            Self::PipelineStage => write!(f, "pipeline stages run eagerly"),
            Self::TensorParallel => write!(f, "tensor parallelism runs eagerly"),
            Self::ActivationCheckpointing => {
                write!(f, "activation checkpointing recomputes blocks eagerly")
            }
        }
    }
}

/// Warm-up runs of the body before the capture (torch.cuda.make_graphed_callables
/// and the CUDA-graphs notes use three).
pub const WARMUP: u32 = 3;

/// The mode for a job: `setting` is `[performance] cuda_graphs` (None:
/// the default, on for CUDA), `cuda` whether the device is a GPU, `built`
/// whether the graph shim is compiled in, `stage` the sharding stage.
pub fn mode(setting: Option<bool>, cuda: bool, built: bool, stage: u32) -> Mode {
    if setting == Some(false) {
        Mode::Off(EagerReason::Disabled)
    } else if !cuda {
        Mode::Off(EagerReason::NotCuda)
    } else if !built {
        Mode::Off(EagerReason::NotBuilt)
    } else if stage >= 2 {
        Mode::Off(EagerReason::ReleasedGradients)
    } else {
        Mode::Capture { warmup: WARMUP }
    }
}

/// Where a job's graph is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// This many warm-up bodies have run.
    Warming(u32),
    /// A graph is captured and replays.
    Captured,
    /// The capture failed; never tried again.
    Failed(String),
}

impl Default for Phase {
    fn default() -> Self {
        Self::Warming(0)
    }
}

/// What to run for one micro-step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Eager(EagerReason),
    /// The graph body, eagerly (warm-up, or [`Mode::BodyOnly`]).
    Body,
    /// Capture the body, then replay it once (a capture runs nothing).
    Capture,
    Replay,
}

/// The action for a micro-batch of `batch` samples when the graph holds
/// `full` (the spec's batch size).
pub fn decide(mode: &Mode, phase: &Phase, batch: usize, full: usize) -> Action {
    let blocked = (batch != full).then_some(EagerReason::BatchSize {
        got: batch,
        captured: full,
    });
    decide_unless(mode, phase, blocked)
}

/// The action for work a graph holds unless `blocked` says why this time
/// it cannot (the micro-step: [`decide`]; the sync step: [`sync_blocker`]).
pub fn decide_unless(mode: &Mode, phase: &Phase, blocked: Option<EagerReason>) -> Action {
    let warmup = match (mode, blocked) {
        (Mode::Off(reason), _) => return Action::Eager(reason.clone()),
        (_, Some(reason)) => return Action::Eager(reason),
        (Mode::BodyOnly, None) => return Action::Body,
        (Mode::Capture { warmup }, None) => *warmup,
    };
    match phase {
        Phase::Failed(e) => Action::Eager(EagerReason::CaptureFailed(e.clone())),
        Phase::Captured => Action::Replay,
        Phase::Warming(done) if *done < warmup => Action::Body,
        Phase::Warming(_) => Action::Capture,
    }
}

/// Why this sync step cannot be its graph's body (None: it can). The sync
/// graph holds the work after the all-reduce (normalize, norm, clip,
/// optimizer, zeroing) on the flat gradient buffer: under sharding
/// `stage` >= 1 the step is a slice's, and an optimizer without its state
/// (`optimizer_state`) makes it in this step.
pub fn sync_blocker(stage: u32, optimizer_state: bool) -> Option<EagerReason> {
    if stage >= 1 {
        Some(EagerReason::ShardedStep)
    } else if !optimizer_state {
        Some(EagerReason::NoOptimizerState)
    } else {
        None
    }
}

impl Phase {
    /// The phase after `action` ran; `failure` is the capture's error (an
    /// action other than Capture ignores it).
    pub fn after(&self, action: &Action, failure: Option<String>) -> Phase {
        match (self, action) {
            (Phase::Warming(n), Action::Body) => Phase::Warming(n + 1),
            (_, Action::Capture) => match failure {
                Some(e) => Phase::Failed(e),
                None => Phase::Captured,
            },
            (p, _) => p.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_mode_names_the_first_reason() {
        assert_eq!(
            mode(Some(false), true, true, 0),
            Mode::Off(EagerReason::Disabled)
        );
        assert_eq!(mode(None, false, true, 0), Mode::Off(EagerReason::NotCuda));
        assert_eq!(
            mode(Some(true), false, true, 0),
            Mode::Off(EagerReason::NotCuda)
        );
        assert_eq!(mode(None, true, false, 0), Mode::Off(EagerReason::NotBuilt));
        assert_eq!(
            mode(None, true, true, 2),
            Mode::Off(EagerReason::ReleasedGradients)
        );
        assert_eq!(mode(None, true, true, 1), Mode::Capture { warmup: WARMUP });
        assert_eq!(
            mode(Some(true), true, true, 0),
            Mode::Capture { warmup: WARMUP }
        );
    }

    #[test]
    fn warm_up_capture_replay_and_the_short_batch() {
        let m = Mode::Capture { warmup: 2 };
        let mut p = Phase::default();
        let mut seen = Vec::new();
        for batch in [8, 8, 5, 8, 8, 8, 3] {
            let a = decide(&m, &p, batch, 8);
            p = p.after(&a, None);
            seen.push(a);
        }
        let short = |got| Action::Eager(EagerReason::BatchSize { got, captured: 8 });
        assert_eq!(
            seen,
            vec![
                Action::Body,
                Action::Body,
                short(5),
                Action::Capture,
                Action::Replay,
                Action::Replay,
                short(3)
            ]
        );
    }

    #[test]
    fn a_failed_capture_is_not_retried() {
        let m = Mode::Capture { warmup: 0 };
        let a = decide(&m, &Phase::default(), 4, 4);
        assert_eq!(a, Action::Capture);
        let p = Phase::default().after(&a, Some("operation not permitted".into()));
        let next = decide(&m, &p, 4, 4);
        assert_eq!(
            next,
            Action::Eager(EagerReason::CaptureFailed("operation not permitted".into()))
        );
        assert!(next_reason_text(&next).contains("operation not permitted"));
    }

    #[test]
    fn the_sync_step_waits_for_optimizer_state_and_never_runs_sharded() {
        let m = Mode::Capture { warmup: 1 };
        let mut p = Phase::default();
        let mut seen = Vec::new();
        // The first step makes the state; stage 1 never captures.
        for (stage, state) in [(0, false), (0, true), (0, true), (1, true), (0, true)] {
            let a = decide_unless(&m, &p, sync_blocker(stage, state));
            p = p.after(&a, None);
            seen.push(a);
        }
        assert_eq!(
            seen,
            vec![
                Action::Eager(EagerReason::NoOptimizerState),
                Action::Body,
                Action::Capture,
                Action::Eager(EagerReason::ShardedStep),
                Action::Replay,
            ]
        );
        assert_eq!(
            decide_unless(&Mode::BodyOnly, &Phase::default(), sync_blocker(0, true)),
            Action::Body
        );
        assert_eq!(
            decide_unless(&Mode::Off(EagerReason::NotCuda), &p, None),
            Action::Eager(EagerReason::NotCuda)
        );
    }

    fn next_reason_text(a: &Action) -> String {
        match a {
            Action::Eager(r) => r.to_string(),
            _ => String::new(),
        }
    }

    fn any_mode() -> impl Strategy<Value = Mode> {
        prop_oneof![
            Just(Mode::Off(EagerReason::NotCuda)),
            Just(Mode::BodyOnly),
            (0u32..5).prop_map(|warmup| Mode::Capture { warmup }),
        ]
    }

    proptest! {
        /// Over any sequence of batch sizes and capture outcomes: at most
        /// one capture, only after `warmup` full-size bodies; replays only
        /// of full batches after a capture that worked; every batch of
        /// another size eager; nothing but eager when off.
        #[test]
        fn decisions_hold_over_any_run(
            m in any_mode(),
            full in 1usize..6,
            steps in proptest::collection::vec((0usize..7, any::<bool>()), 0..60),
        ) {
            let mut p = Phase::default();
            let (mut bodies, mut captures, mut captured_ok) = (0u32, 0u32, false);
            for (batch, fail) in steps {
                let a = decide(&m, &p, batch, full);
                match &a {
                    Action::Eager(EagerReason::BatchSize { got, captured }) => {
                        prop_assert_eq!((*got, *captured), (batch, full));
                        prop_assert_ne!(batch, full);
                    }
                    Action::Eager(EagerReason::CaptureFailed(_)) => {
                        prop_assert!(captures == 1 && !captured_ok);
                    }
                    Action::Eager(r) => prop_assert_eq!(&m, &Mode::Off(r.clone())),
                    Action::Body => {
                        prop_assert_eq!(batch, full);
                        prop_assert_eq!(captures, 0);
                        bodies += 1;
                    }
                    Action::Capture => {
                        prop_assert_eq!(captures, 0);
                        prop_assert_eq!(&m, &Mode::Capture { warmup: bodies });
                        captures += 1;
                        captured_ok = !fail;
                    }
                    Action::Replay => prop_assert!(captured_ok && batch == full),
                }
                if matches!(m, Mode::Off(_)) {
                    prop_assert!(matches!(a, Action::Eager(_)));
                }
                p = p.after(&a, fail.then(|| "injected".to_string()));
            }
        }
    }
}
