//! A job's own thread: the ring of each generation, the engine, and the
//! JobDone (or Interrupted) it ends each generation with. libtorch runs
//! here, never in an async task; a panic becomes a failed JobDone.

use super::assign::{assigned_checkpoint_dir, assigned_spec};
use super::{wrap, DaemonConfig};
use crate::comm::mesh::{Mesh, MeshConfig};
use crate::comm::mesh_collective::MeshCollective;
use crate::comm::{RingConfig, TcpRing};
use crate::engine::{Control, Event, RunOptions, StepReport};
use crate::Engine;
use accrue_proto::v1::{self, worker_message, WorkerMessage};
use std::net::TcpListener;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// How long a new generation's rank 0 waits for the checkpoint folder's
/// writer lock: the previous generation's rank 0 (a daemon the coordinator
/// gave up on, still tearing its engine down) lets go within it, or the
/// assignment fails naming it and the coordinator recovers again.
const FOLDER_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(30);
use std::time::Duration;
use tokio::sync::mpsc;

pub(super) fn step_msg(job: &str, generation: u64, rank: u32, r: &StepReport) -> WorkerMessage {
    wrap(worker_message::Msg::Step(v1::StepReport {
        job_id: job.to_string(),
        generation,
        rank,
        step: r.step,
        total_steps: r.total_steps,
        epoch: r.epoch,
        micro_step: r.micro_step,
        loss: r.loss,
        samples: r.samples,
        samples_seen: r.samples_seen,
        grad_norm: r.grad_norm,
        clip_coef: r.clip_coef,
        skipped: r.skipped,
        lr: r.lr,
        samples_per_sec: r.samples_per_sec,
        timing: Some(v1::StepTiming {
            compute_s: r.timing.compute_s,
            comm_s: r.timing.comm_s,
            clip_s: r.timing.clip_s,
            optimizer_s: r.timing.optimizer_s,
            bubble_s: r.timing.bubble_s,
            transfer_s: r.timing.transfer_s,
        }),
        bytes_sent: r.bytes_sent,
        bytes_received: r.bytes_received,
        loss_scale: r.loss_scale,
        graph_replays: r.graph_replays,
        eager_reason: crate::cuda::graphs::reason_text(r.eager_reason.as_ref()),
        sync_graph_replayed: r.sync_graph_replayed,
        sync_eager_reason: crate::cuda::graphs::reason_text(r.sync_eager_reason.as_ref()),
        resumed_from: r.resumed_from.clone(),
        peak_rss_bytes: r.peak_rss_bytes,
    }))
}

fn eval_proto(e: &crate::engine::EvalReport) -> v1::EvalResult {
    v1::EvalResult {
        epoch: e.epoch,
        step: e.step,
        loss: e.loss,
        accuracy: e.accuracy,
        samples: e.samples,
        // The coordinator fills these when the job is read.
        perplexity: None,
        tokens: None,
    }
}

/// The job whose thread runs on this daemon.
pub(super) struct Running {
    pub(super) job: String,
    pub(super) control: Arc<Control>,
    pub(super) thread: std::thread::JoinHandle<()>,
    /// Later generations of the same job go to its thread.
    pub(super) next: std::sync::mpsc::Sender<v1::Assignment>,
}

/// Starts the thread of job `a` (its first generation). A thread that
/// cannot start is a failed JobDone on `events`, and None.
pub(super) fn start(
    a: v1::Assignment,
    cfg: &DaemonConfig,
    listener: &TcpListener,
    events: &mpsc::UnboundedSender<WorkerMessage>,
    current: &Current,
) -> Option<Running> {
    let control = Arc::new(Control::default());
    let l = listener.try_clone().ok();
    let (cfg2, out, c2, job, cur) = (
        cfg.clone(),
        events.clone(),
        control.clone(),
        a.job_id.clone(),
        current.clone(),
    );
    let (next_tx, next_rx) = std::sync::mpsc::channel();
    tracing::info!(job = %job, rank = a.rank, world = a.world_size, generation = a.generation, "assignment");
    let (generation, rank) = (a.generation, a.rank);
    // A thread name cannot hold NUL: keep only what a job id may hold.
    let name: String = job
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || "-._".contains(*c))
        .collect();
    let thread = std::thread::Builder::new()
        .name(format!("accrue-job-{name}"))
        .spawn(move || {
            let (job, out2, cur2) = (a.job_id.clone(), out.clone(), cur.clone());
            guarded(&job, (generation, rank), &cur2, &out2, move || {
                run_assignment(a, next_rx, l, &cfg2, c2, &out, cur)
            })
        });
    match thread {
        Ok(thread) => Some(Running {
            job,
            control,
            thread,
            next: next_tx,
        }),
        Err(e) => {
            tracing::error!(error = %e, "cannot start the job thread");
            let _ = events.send(job_failed(
                &job,
                generation,
                rank,
                format!("the worker cannot start a job thread: {e}"),
            ));
            None
        }
    }
}

/// The job, generation and rank this daemon is in (for the hello after a
/// re-attach).
pub(super) type Current = Arc<Mutex<Option<(String, u64, u32)>>>;

/// The groups of the current generation ([`MeshCollective`]); closed
/// between generations (so the old rings' listener threads are gone before
/// the next generation forms).
pub type DaemonRing = MeshCollective;

/// What one generation of a job ended with.
enum Outcome {
    Finished(Box<crate::engine::Summary>),
    /// The window was lost; the committed state is kept for the next
    /// generation.
    Interrupted(String),
    Failed(String),
}

struct JobThread<'a> {
    cfg: &'a DaemonConfig,
    listener: Option<TcpListener>,
    control: Arc<Control>,
    out: &'a mpsc::UnboundedSender<WorkerMessage>,
    engine: Option<Engine<DaemonRing>>,
}

impl JobThread<'_> {
    /// Forms this generation's ring, builds the engine (or moves the one
    /// that survived onto the new ring) and trains.
    fn generation(&mut self, a: &v1::Assignment) -> Outcome {
        let (job, generation, rank) = (a.job_id.clone(), a.generation, a.rank);
        let (spec, checkpoint_dir) = match assigned_spec(a, self.cfg)
            .and_then(|s| Ok((s, assigned_checkpoint_dir(a, self.cfg)?)))
        {
            Ok(s) => s,
            Err(e) => return Outcome::Failed(e),
        };
        let mut ring_cfg = RingConfig::new(
            job.clone(),
            rank as usize,
            a.world_size as usize,
            a.peers.clone(),
            a.secret.clone(),
        );
        ring_cfg.generation = generation;
        ring_cfg.timeout = Duration::from_secs_f64(spec.comm.timeout_s);
        ring_cfg.connect_timeout = Duration::from_secs_f64(spec.comm.connect_timeout_s);
        let listener = self.listener.as_ref().and_then(|l| l.try_clone().ok());
        let ring = match TcpRing::start(listener, ring_cfg) {
            Ok(r) => r,
            Err(e) => return Outcome::Interrupted(e.to_string()),
        };
        let mesh_cfg = match MeshConfig::for_job(
            &spec,
            a.world_size,
            &a.peers,
            a.rank as usize,
            match crate::engine::resolve_device(&spec.device) {
                Ok(tch::Device::Cuda(i)) => Some(i),
                _ => None,
            },
        ) {
            Ok(c) => c,
            Err(e) => return Outcome::Failed(e),
        };
        let mesh_dims = mesh_cfg.dims;
        let ring = match Mesh::form(ring, &mesh_cfg) {
            Ok(m) => MeshCollective::new(m),
            Err(e) => return Outcome::Interrupted(e.to_string()),
        };
        // A survivor moved to another pipeline stage (the coordinator
        // keeps survivors at their stage when it can) holds the wrong
        // stage's layers: it starts anew, taking its stage's state from
        // that stage's replicas or the checkpoint.
        if self
            .engine
            .as_ref()
            .is_some_and(|e| e.stage() != crate::engine::Mesh::of(&ring).stages())
        {
            tracing::info!(
                job,
                generation,
                "this rank changes pipeline stage: a new engine"
            );
            self.engine = None;
        }
        let ready = match self.engine.as_mut() {
            Some(engine) => engine.reconfigure(ring, spec.accumulation.steps),
            None => {
                let opts = RunOptions {
                    checkpoint_dir,
                    job_id: Some(job.clone()),
                    cluster: self.cfg.cluster.clone(),
                    resume_if_present: a.resume_step > 0 || a.generation > 1,
                    sample_log: self.cfg.sample_log.clone(),
                    micro_step_delay: self.cfg.micro_step_delay,
                    control: Some(self.control.clone()),
                    lock_wait: FOLDER_LOCK_WAIT,
                    ..Default::default()
                };
                Engine::new(spec, ring, opts).map(|e| {
                    self.engine = Some(e);
                })
            }
        };
        if let Err(e) = ready {
            return if e.is_recoverable() {
                Outcome::Interrupted(e.to_string())
            } else {
                Outcome::Failed(e.to_string())
            };
        }
        let Some(engine) = self.engine.as_mut() else {
            return Outcome::Failed("no engine".into());
        };
        let out = self.out;
        // The evaluation reports come from the rank that owns the loss.
        let loss_owner = mesh_dims.loss_owner();
        let result = engine.run(|ev| {
            let m = match ev {
                Event::Step(r) => step_msg(&job, generation, rank, r),
                Event::Eval(_) if rank != loss_owner => return,
                Event::Eval(e) => WorkerMessage {
                    msg: Some(worker_message::Msg::Eval(eval_proto(e))),
                    job_id: job.clone(),
                    generation,
                },
                Event::Checkpoint(_) => return,
            };
            let _ = out.send(m);
        });
        match result {
            Ok(s) => Outcome::Finished(Box::new(s)),
            Err(e) if e.is_recoverable() && !self.control.stopping() => {
                Outcome::Interrupted(e.to_string())
            }
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// A JobDone that fails the job with `error`.
fn job_failed(job: &str, generation: u64, rank: u32, error: String) -> WorkerMessage {
    wrap(worker_message::Msg::Done(v1::JobDone {
        job_id: job.to_string(),
        generation,
        rank,
        ok: false,
        error,
        ..Default::default()
    }))
}

/// Runs `f` (a job's thread); a panic in it becomes a JobDone failure of
/// the generation the thread was in (`first` before it recorded one), with
/// the panic's message, so the coordinator fails the job and frees this
/// worker; the daemon itself never goes down with a job.
pub(super) fn guarded(
    job: &str,
    first: (u64, u32),
    current: &Current,
    out: &mpsc::UnboundedSender<WorkerMessage>,
    f: impl FnOnce(),
) {
    let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) else {
        return;
    };
    let what = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into());
    let (generation, rank) = current
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
        .map_or(first, |(_, g, r)| (g, r));
    tracing::error!(job, generation, rank, panic = %what, "the job thread panicked");
    let _ = out.send(job_failed(
        job,
        generation,
        rank,
        format!("the job thread panicked: {what}"),
    ));
}

/// Runs a job to its end on the calling (dedicated) thread, through as many
/// generations as the coordinator forms.
fn run_assignment(
    first: v1::Assignment,
    next: std::sync::mpsc::Receiver<v1::Assignment>,
    listener: Option<TcpListener>,
    cfg: &DaemonConfig,
    control: Arc<Control>,
    out: &mpsc::UnboundedSender<WorkerMessage>,
    current: Current,
) {
    let job = first.job_id.clone();
    let mut a = first;
    let mut t = JobThread {
        cfg,
        listener,
        control: control.clone(),
        out,
        engine: None,
    };
    let done = loop {
        control.abort.store(false, Ordering::SeqCst);
        control.reform.store(false, Ordering::SeqCst);
        *current.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((job.clone(), a.generation, a.rank));
        let (generation, rank) = (a.generation, a.rank);
        match t.generation(&a) {
            Outcome::Finished(s) => {
                break v1::JobDone {
                    job_id: job.clone(),
                    generation,
                    rank,
                    ok: true,
                    error: String::new(),
                    checkpoint: s.checkpoint.display().to_string(),
                    eval: s.eval.as_ref().map(eval_proto),
                    stopped: control.stopping() || !s.finished,
                    step: s.state.step,
                    samples_seen: s.state.samples_seen,
                    total_steps: t.engine.as_ref().map_or(0, |e| e.total_steps()),
                    epoch: s.state.epoch,
                }
            }
            Outcome::Failed(e) => {
                let stopped = control.stopping();
                if !stopped {
                    tracing::error!(job = %job, rank, error = %e, "job failed");
                }
                break v1::JobDone {
                    job_id: job.clone(),
                    generation,
                    rank,
                    ok: stopped,
                    error: e,
                    stopped,
                    ..Default::default()
                };
            }
            Outcome::Interrupted(e) => {
                let step = match t.engine.as_mut() {
                    Some(engine) => {
                        if let Err(e) = engine.discard_window() {
                            tracing::error!(error = %e, "cannot discard the window");
                        }
                        let closed = engine.collective_mut().closed();
                        // Dropping the old ring says goodbye to its peers
                        // and stops its listener thread.
                        *engine.collective_mut() = closed;
                        engine.state().step
                    }
                    None => 0,
                };
                tracing::warn!(job = %job, generation, rank, step, error = %e, "window interrupted; waiting for a new generation");
                let _ = out.send(wrap(worker_message::Msg::Interrupted(v1::Interrupted {
                    job_id: job.clone(),
                    generation,
                    rank,
                    error: e,
                    step,
                })));
                let waited = loop {
                    match next.recv_timeout(Duration::from_millis(100)) {
                        Ok(n) if n.generation > generation => break Some(n),
                        Ok(_) => continue,
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                            if control.stopping() {
                                break None;
                            }
                        }
                        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break None,
                    }
                };
                match waited {
                    Some(n) => {
                        // Several may have queued up: the newest wins.
                        a = std::iter::once(n)
                            .chain(next.try_iter())
                            .max_by_key(|x| x.generation)
                            .unwrap_or_default();
                    }
                    None => {
                        break v1::JobDone {
                            job_id: job.clone(),
                            generation,
                            rank,
                            ok: true,
                            stopped: true,
                            error: "stopped between generations".into(),
                            ..Default::default()
                        }
                    }
                }
            }
        }
    };
    *current.lock().unwrap_or_else(|p| p.into_inner()) = None;
    let _ = out.send(wrap(worker_message::Msg::Done(done)));
}

/// Waits (polling, so no blocking task outlives the runtime) until the
/// job's thread has ended, at most `limit`: the window in flight is lost
/// anyway once the daemon detached, but a checkpoint being written is
/// finished rather than cut off at exit.
pub(super) async fn wait_for_job_thread(r: &Running, limit: Duration) {
    if r.thread.is_finished() {
        return;
    }
    tracing::info!(job = %r.job, limit = ?limit, "waiting for the job's thread to end");
    let started = std::time::Instant::now();
    while !r.thread.is_finished() {
        if started.elapsed() >= limit {
            tracing::warn!(job = %r.job, limit = ?limit, "the job's thread is still running; exiting anyway (--stop-timeout)");
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tracing::info!(job = %r.job, waited = ?started.elapsed(), "the job's thread ended");
}
