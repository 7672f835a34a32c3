//! How a run is set up beyond the spec ([`RunOptions`]), and how another
//! thread steers a running engine ([`Control`], agreed at sync steps).

use std::path::PathBuf;
use std::time::Duration;

/// How a run is set up beyond the spec.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Where checkpoints go; default: spec.checkpoint.dir, else
    /// `<state_dir>/checkpoints/<name>`.
    pub checkpoint_dir: Option<PathBuf>,
    /// Used for the default checkpoint folder (default `runs`).
    pub state_dir: Option<PathBuf>,
    /// The job's id (the coordinator's; default: the spec's name, as
    /// `accrue-worker train` runs it): the owner of the checkpoint folder,
    /// written into every checkpoint and checked on resume.
    pub job_id: Option<String>,
    /// The coordinator's cluster ("" without one), in the ownership record.
    pub cluster: String,
    /// Continue from the newest verified checkpoint (the one LATEST
    /// names, else the newest step whose manifest verifies).
    pub resume: bool,
    /// Continue from the newest verified checkpoint when the folder holds
    /// any step (failing, listing them, when none reads), else start fresh
    /// (a rank joining a job that is being recovered or resumed).
    pub resume_if_present: bool,
    /// Append, for every committed window, the sample indices this rank
    /// read in it (recorded where the data reader fetched them; one JSON
    /// line with job, step, epoch, rank, world and indices) to this file:
    /// joined over all ranks' files, an audit of the data accounting.
    pub sample_log: Option<PathBuf>,
    /// Run the collectives through a separate host buffer on the CPU too,
    /// as on CUDA (tests use it to run the staging path without a GPU).
    pub copy_through_host: bool,
    /// Run every full-size micro-step as the CUDA graph's body (static
    /// index buffer, loss scale from a tensor, autocast without its cast
    /// cache) without capturing, on any device: tests check it against the
    /// eager micro-step without a GPU.
    pub graph_body_only: bool,
    /// Capture graphs whatever the device and the build (warm-up, capture,
    /// replay, as on CUDA): on the CPU, or in a build without
    /// `ACCRUE_CUDA=1`, the capture fails, so tests check the eager
    /// fallback and its reported reason without a GPU.
    pub force_graph_capture: bool,
    /// Step the optimizer with tensor ops on the CPU too, never the fused
    /// CPU pass, as on CUDA (tests compare the sync graph's body with the
    /// eager step CUDA runs).
    pub unfused_step: bool,
    /// Sleep this long after every micro-step (fault-injection tests and
    /// demos: it makes a small job last long enough to kill a rank in the
    /// middle of a window).
    pub micro_step_delay: Option<Duration>,
    /// Stop (with a checkpoint) once this many optimizer steps are committed,
    /// as if preempted; the job can be resumed later.
    pub stop_after_steps: Option<u64>,
    /// Requests from another thread (the worker daemon), honoured at window
    /// boundaries.
    pub control: Option<std::sync::Arc<Control>>,
    /// Record libtorch's profiler (CPU ops; CUDA kernels on a GPU) over
    /// some of this run's optimizer steps and write a Chrome trace
    /// (`accrue-worker train --profile`).
    pub profile: Option<crate::cuda::profiler::Profile>,
    /// How long rank 0 waits for the checkpoint folder's writer lock
    /// (checkpoint/lock.rs) before it refuses: zero for `accrue-worker
    /// train` (a second run is refused at once); the daemon waits a while
    /// for a previous generation's rank 0 to let go.
    pub lock_wait: Duration,
}

/// Flags another thread sets to steer a running engine.
#[derive(Debug, Default)]
pub struct Control {
    /// Stop at the next window boundary (with a checkpoint). Set on any
    /// rank, every rank stops after the same step: the flag rides in the
    /// sync step's reduction.
    pub stop: std::sync::atomic::AtomicBool,
    /// Write a checkpoint at the next window boundary (agreed like `stop`).
    pub checkpoint_now: std::sync::atomic::AtomicBool,
    /// Drop the window in flight at the next micro-step and return
    /// [`Error::Interrupted`] (the coordinator is re-forming the ring).
    pub abort: std::sync::atomic::AtomicBool,
    /// A new generation is waiting: leave at the next window boundary
    /// with [`Error::Interrupted`] (an elastic job grows).
    pub reform: std::sync::atomic::AtomicBool,
    /// This rank leaves (its daemon is shutting down, e.g. SIGTERM) while
    /// the job goes on elsewhere: at the next sync step every rank agrees
    /// to checkpoint (so a sharded rank's slice of the optimizer state is
    /// in it), then this rank stops; the others go on until the coordinator
    /// re-forms the ring without it.
    pub leave: std::sync::atomic::AtomicBool,
}

impl Control {
    /// Whether this rank is on its way out (the job stops, or it leaves).
    pub fn stopping(&self) -> bool {
        self.stop.load(std::sync::atomic::Ordering::SeqCst)
            || self.leave.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Requests a sync step's reduction agreed on (see [`Control`]).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Agreed {
    /// Some rank was asked to stop: every rank stops.
    pub(super) stop: bool,
    /// Some rank was asked for a checkpoint, or is leaving.
    pub(super) checkpoint: bool,
    /// This rank's own leave went into the reduction: it stops.
    pub(super) leave: bool,
}
