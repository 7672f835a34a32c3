//! Worker daemon: attaches to the coordinator, runs assignments with the
//! engine and the ring on a thread of their own (libtorch never runs inside
//! an async task), reports every optimizer step, obeys stop, abort and
//! checkpoint-now, and returns to idle for the next job.

use crate::collective::Collective;
use crate::comm::{RingConfig, TcpRing};
use crate::engine::{Control, Event, RunOptions, StepReport};
use crate::Engine;
use accrue_proto::v1::{
    self, coordinator_message, worker_message, worker_service_client::WorkerServiceClient,
    WorkerMessage,
};
use std::collections::VecDeque;
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

mod assign;
mod etcd;
pub mod health;

use assign::{assigned_checkpoint_dir, assigned_spec};
use health::{HealthState, Link};

/// How long one connection attempt to the coordinator (TCP, TLS, HTTP/2)
/// may take before it counts as failed and is retried.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the coordinator may take to answer an Attach before the
/// attempt is retried.
pub const ATTACH_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// e.g. http://127.0.0.1:50051
    pub coordinator: String,
    pub worker_id: String,
    /// Data-plane listener, host:port (port 0: any free port).
    pub listen_data: String,
    /// The data-plane address peers are told to connect to (default: the
    /// listener's own address; set it when listening on 0.0.0.0, or behind
    /// NAT, to an address the other workers can reach).
    pub advertise_data: Option<String>,
    /// Overrides the jobs' device (cpu, cuda:N, auto).
    pub device: Option<String>,
    /// libtorch intra-op threads for jobs whose spec sets none (None:
    /// libtorch's default, which honours OMP_NUM_THREADS).
    pub threads: Option<u32>,
    /// data.path and data.eval_path must lie under this folder (relative
    /// ones resolve under it). Without `model_root`, relative model paths
    /// resolve under it too (not confined), as before roots existed.
    pub data_root: Option<PathBuf>,
    /// model.path and model.init must lie under this folder.
    pub model_root: Option<PathBuf>,
    /// Checkpoint folders (checkpoint.dir, or the coordinator's default)
    /// must lie under this folder.
    pub checkpoint_root: Option<PathBuf>,
    pub heartbeat: Duration,
    /// Audit log: for every committed window, the sample indices this
    /// worker's rank read in it (JSON lines).
    pub sample_log: Option<PathBuf>,
    /// Sleep after every micro-step (fault-injection tests).
    pub micro_step_delay: Option<Duration>,
    /// etcd endpoints: register under a lease there and find the leader
    /// coordinator through it (then `coordinator` is only a fallback).
    pub etcd: Vec<String>,
    pub cluster: String,
    /// Assignments whose estimated memory is above this (bytes) fail at
    /// once, before anything allocates.
    pub max_job_memory: u64,
    /// TLS to the coordinator with this worker's client certificate (its
    /// SAN must name `worker_id`); None: plaintext, as before issue 14.
    /// The files are read again on every (re)connection.
    pub tls: Option<accrue_proto::tls::ClientTls>,
    /// TLS to etcd with a client certificate (None: plaintext etcd).
    pub etcd_tls: Option<accrue_proto::tls::ClientTls>,
    /// On shutdown, how long to wait for the job's thread to end after
    /// detaching (a checkpoint being written is finished, never cut off).
    pub stop_timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("cannot listen for the data plane on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
    #[error("coordinator {url}: {reason}")]
    Coordinator { url: String, reason: String },
    #[error(transparent)]
    Roots(#[from] crate::spec::RootError),
    #[error(transparent)]
    Tls(#[from] accrue_proto::tls::TlsError),
}

impl DaemonConfig {
    /// This config with its roots absolute and lexically normal; a root
    /// that does not exist is only warned about (every path under it will
    /// be refused or fail to open).
    pub fn with_absolute_roots(mut self) -> Result<Self, crate::spec::RootError> {
        let roots = self.roots().absolute()?;
        for (flag, root) in [
            ("--data-root", &roots.data),
            ("--model-root", &roots.model),
            ("--checkpoint-root", &roots.checkpoint),
        ] {
            if let Some(r) = root.as_ref().filter(|r| !r.is_dir()) {
                tracing::warn!(flag, root = %r.display(), "the root is not an existing folder here");
            }
        }
        (self.data_root, self.model_root, self.checkpoint_root) =
            (roots.data, roots.model, roots.checkpoint);
        Ok(self)
    }

    /// The roots of `--data-root`, `--model-root`, `--checkpoint-root`.
    pub fn roots(&self) -> crate::spec::Roots {
        crate::spec::Roots {
            data: self.data_root.clone(),
            model: self.model_root.clone(),
            checkpoint: self.checkpoint_root.clone(),
        }
    }
}

fn wrap(msg: worker_message::Msg) -> WorkerMessage {
    WorkerMessage {
        msg: Some(msg),
        ..Default::default()
    }
}

fn step_msg(job: &str, generation: u64, rank: u32, r: &StepReport) -> WorkerMessage {
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
        }),
        bytes_sent: r.bytes_sent,
        bytes_received: r.bytes_received,
        loss_scale: r.loss_scale,
        graph_replays: r.graph_replays,
        eager_reason: r.eager_reason.clone(),
        sync_graph_replayed: r.sync_graph_replayed,
        sync_eager_reason: r.sync_eager_reason.clone(),
        resumed_from: r.resumed_from.clone(),
    }))
}

fn eval_proto(e: &crate::engine::EvalReport) -> v1::EvalResult {
    v1::EvalResult {
        epoch: e.epoch,
        step: e.step,
        loss: e.loss,
        accuracy: e.accuracy,
        samples: e.samples,
    }
}

struct Running {
    job: String,
    control: Arc<Control>,
    thread: std::thread::JoinHandle<()>,
    /// Later generations of the same job go to its thread.
    next: std::sync::mpsc::Sender<v1::Assignment>,
}

/// The job, generation and rank this daemon is in (for the hello after a
/// re-attach).
type Current = Arc<Mutex<Option<(String, u64, u32)>>>;

/// The ring of the current generation; empty between generations (so the
/// old ring's listener thread is gone before the next ring forms).
pub struct RingSlot {
    ring: Option<TcpRing>,
    rank: usize,
    world: usize,
}

impl RingSlot {
    fn closed(&self) -> Self {
        Self {
            ring: None,
            rank: self.rank,
            world: self.world,
        }
    }
    fn ring(&mut self) -> crate::error::Result<&mut TcpRing> {
        self.ring.as_mut().ok_or_else(|| {
            crate::error::Error::Interrupted("the ring of this generation is closed".into())
        })
    }
}

impl Collective for RingSlot {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_reduce_sum(&mut self, buf: &mut Vec<f32>) -> crate::error::Result<()> {
        Collective::all_reduce_sum(self.ring()?, buf)
    }
    fn broadcast(&mut self, buf: &mut Vec<f32>, root: usize) -> crate::error::Result<()> {
        Collective::broadcast(self.ring()?, buf, root)
    }
    fn broadcast_bytes(&mut self, buf: &mut Vec<u8>, root: usize) -> crate::error::Result<()> {
        Collective::broadcast_bytes(self.ring()?, buf, root)
    }
    fn barrier(&mut self) -> crate::error::Result<()> {
        Collective::barrier(self.ring()?)
    }
    fn all_reduce_buckets(
        &mut self,
        buckets: &mut [&mut [f32]],
        stage_in: crate::collective::Stage<'_>,
        stage_out: crate::collective::Stage<'_>,
    ) -> crate::error::Result<()> {
        Collective::all_reduce_buckets(self.ring()?, buckets, stage_in, stage_out)
    }
    fn reduce_scatter_sum(&mut self, buf: &mut [f32]) -> crate::error::Result<()> {
        Collective::reduce_scatter_sum(self.ring()?, buf)
    }
    fn all_gather(&mut self, buf: &mut [f32]) -> crate::error::Result<()> {
        Collective::all_gather(self.ring()?, buf)
    }
    fn bytes(&self) -> (u64, u64) {
        self.ring.as_ref().map_or((0, 0), Collective::bytes)
    }
}

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
    engine: Option<Engine<RingSlot>>,
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
        let slot = RingSlot {
            ring: Some(ring),
            rank: rank as usize,
            world: a.world_size as usize,
        };
        let ready = match self.engine.as_mut() {
            Some(engine) => engine.reconfigure(slot, spec.accumulation.steps),
            None => {
                let opts = RunOptions {
                    checkpoint_dir,
                    job_id: Some(job.clone()),
                    cluster: self.cfg.cluster.clone(),
                    resume_if_present: a.resume_step > 0 || a.generation > 1,
                    sample_log: self.cfg.sample_log.clone(),
                    micro_step_delay: self.cfg.micro_step_delay,
                    control: Some(self.control.clone()),
                    ..Default::default()
                };
                Engine::new(spec, slot, opts).map(|e| {
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
        let result = engine.run(|ev| {
            let m = match ev {
                Event::Step(r) => step_msg(&job, generation, rank, r),
                Event::Eval(_) if rank != 0 => return,
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
fn guarded(
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

/// How many unsent messages the outbox keeps at most.
const OUTBOX_CAP: usize = 4096;

/// The messages an attach stream refused because it had died (a
/// `SendError` hands the message back), kept for the next stream, where
/// they go first after the hello and in their order. Bounded: past
/// [`OUTBOX_CAP`] the oldest step reports are dropped, never a JobDone or
/// an Interrupted (which the coordinator's decisions wait on).
#[derive(Debug, Default)]
struct Outbox {
    unsent: VecDeque<WorkerMessage>,
}

impl Outbox {
    /// Sends `m` after everything kept before it. False when the stream is
    /// gone; then `m` (and whatever could not go before it) is kept.
    fn send(&mut self, tx: &mpsc::UnboundedSender<WorkerMessage>, m: WorkerMessage) -> bool {
        self.unsent.push_back(m);
        self.flush(tx)
    }

    /// Sends the kept messages in order; false (keeping the rest, the one
    /// that failed first) when the stream is gone.
    fn flush(&mut self, tx: &mpsc::UnboundedSender<WorkerMessage>) -> bool {
        while let Some(m) = self.unsent.pop_front() {
            if let Err(mpsc::error::SendError(m)) = tx.send(m) {
                self.unsent.push_front(m);
                self.trim();
                return false;
            }
        }
        true
    }

    fn trim(&mut self) {
        while self.unsent.len() > OUTBOX_CAP {
            let droppable = self.unsent.iter().position(|m| {
                matches!(
                    m.msg,
                    Some(worker_message::Msg::Step(_) | worker_message::Msg::Heartbeat(_))
                )
            });
            let Some(i) = droppable else { break };
            self.unsent.remove(i);
            tracing::warn!(
                cap = OUTBOX_CAP,
                "outbox full: dropped the oldest unsent step report"
            );
        }
    }

    fn len(&self) -> usize {
        self.unsent.len()
    }
}

/// Attaches and serves assignments until the process is stopped; re-attaches
/// when the coordinator goes away (reports made meanwhile are kept and sent
/// after re-attaching).
pub async fn run(cfg: DaemonConfig) -> Result<(), DaemonError> {
    run_until(cfg, std::future::pending()).await
}

/// [`run`] until `shutdown` completes: then the daemon stops its job,
/// tells the coordinator it detaches (a planned exit, not a lost worker),
/// waits briefly for the coordinator to close the stream, and returns.
pub async fn run_until(
    cfg: DaemonConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), DaemonError> {
    run_with(cfg, HealthState::default(), shutdown).await
}

/// [`run_until`], keeping `health` up to date: every turn of the loop, and
/// where the daemon stands with its coordinator (the probe endpoint,
/// [`health::serve`], answers from it).
pub async fn run_with(
    cfg: DaemonConfig,
    health: HealthState,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), DaemonError> {
    let mut shutdown = std::pin::pin!(shutdown);
    let cfg = cfg.with_absolute_roots()?;
    // A coordinator address whose scheme contradicts the TLS settings is
    // refused now, not retried forever.
    accrue_proto::tls::coordinator_url(&cfg.coordinator, cfg.tls.is_some())?;
    let listener = TcpListener::bind(&cfg.listen_data).map_err(|source| DaemonError::Listen {
        addr: cfg.listen_data.clone(),
        source,
    })?;
    let local = listener
        .local_addr()
        .map_err(|source| DaemonError::Listen {
            addr: cfg.listen_data.clone(),
            source,
        })?;
    let data_addr = match &cfg.advertise_data {
        Some(a) => a.clone(),
        None => {
            if local.ip().is_unspecified() {
                tracing::warn!(%local, "the data plane listens on every interface and advertises {local}, which workers on other hosts cannot reach: pass --advertise-data HOST:PORT");
            }
            local.to_string()
        }
    };
    if !cfg.etcd.is_empty() {
        let info = serde_json::json!({
            "data_addr": data_addr,
            "device": cfg.device.clone().unwrap_or_else(|| "auto".into()),
            "capacity": 1,
            "version": env!("CARGO_PKG_VERSION"),
        })
        .to_string();
        let ttl = (cfg.heartbeat.as_secs_f64() * 5.0).ceil().max(2.0) as i64;
        tokio::spawn(etcd::register(cfg.clone(), info, ttl));
    }
    let (events_tx, mut events_rx) = mpsc::unbounded_channel::<WorkerMessage>();
    let mut running: Option<Running> = None;
    let current: Current = Arc::default();
    let mut backoff = Duration::from_millis(50);
    let mut outbox = Outbox::default();
    loop {
        health.turn();
        let url = etcd::coordinator_url(&cfg).await;
        let endpoint = match accrue_proto::tls::endpoint(&url, cfg.tls.as_ref()) {
            Ok(e) => e,
            Err(e) => {
                // Unreadable certificate files may be being rotated: retry.
                tracing::warn!(coordinator = %url, error = %e, "cannot set up the connection; retrying");
                health.set(Link::Connecting {
                    coordinator: url.clone(),
                    error: e.to_string(),
                });
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = &mut shutdown => return Ok(()),
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        let connected = match tokio::time::timeout(CONNECT_TIMEOUT, endpoint.connect()).await {
            Ok(r) => r.map_err(|e| accrue_proto::error_chain(&e)),
            Err(_) => Err(format!("no connection within {CONNECT_TIMEOUT:?}")),
        };
        let client = match connected.map(WorkerServiceClient::new) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(coordinator = %url, error = %e, "cannot reach the coordinator; retrying");
                health.set(Link::Connecting {
                    coordinator: url.clone(),
                    error: e,
                });
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = &mut shutdown => return Ok(()),
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        let mut client = client.max_decoding_message_size(accrue_proto::layout::MAX_RESPONSE_BYTES);
        let (tx, rx) = mpsc::unbounded_channel::<WorkerMessage>();
        let hello = v1::WorkerHello {
            worker_id: cfg.worker_id.clone(),
            data_addr: data_addr.clone(),
            device: cfg.device.clone().unwrap_or_else(|| "auto".into()),
            capacity: 1,
            version: env!("CARGO_PKG_VERSION").into(),
            ..Default::default()
        };
        let hello = match current.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            Some((job_id, generation, rank)) => v1::WorkerHello {
                job_id,
                generation,
                rank,
                ..hello
            },
            None => hello,
        };
        let _ = tx.send(wrap(worker_message::Msg::Hello(hello)));
        let attached = tokio::time::timeout(
            ATTACH_TIMEOUT,
            client.attach(tokio_stream::wrappers::UnboundedReceiverStream::new(rx)),
        )
        .await;
        let mut inbound = match attached {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(e)) => {
                tracing::warn!(error = %accrue_proto::status_chain(&e), "attach refused; retrying");
                health.set(Link::Refused {
                    coordinator: url.clone(),
                    reason: accrue_proto::status_chain(&e),
                });
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = &mut shutdown => return Ok(()),
                }
                continue;
            }
            Err(_) => {
                tracing::warn!(coordinator = %url, "no answer to the attach within {ATTACH_TIMEOUT:?}; retrying");
                health.set(Link::Connecting {
                    coordinator: url.clone(),
                    error: format!("no answer to the attach within {ATTACH_TIMEOUT:?}"),
                });
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = &mut shutdown => return Ok(()),
                }
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        tracing::info!(worker = %cfg.worker_id, data = %data_addr, unsent = outbox.len(), "attached");
        health.set(Link::Attached {
            coordinator: url.clone(),
        });
        // What the previous stream could not take goes first, right after
        // the hello (queued above).
        if !outbox.flush(&tx) {
            tracing::warn!("the attach stream closed at once; retrying");
            health.set(Link::Lost {
                coordinator: url.clone(),
                reason: "it closed at once".into(),
            });
            tokio::time::sleep(backoff).await;
            continue;
        }
        let mut beat = tokio::time::interval(cfg.heartbeat);
        let ended = loop {
            tokio::select! {
                _ = &mut shutdown => {
                    tracing::info!(worker = %cfg.worker_id, "shutting down: detaching from the coordinator");
                    health.set(Link::Stopping);
                    if let Some(r) = &running {
                        // This rank leaves; the job goes on without it.
                        r.control.leave.store(true, Ordering::SeqCst);
                    }
                    let _ = tx.send(wrap(worker_message::Msg::Detach(v1::Detach {
                        reason: "the daemon was told to stop".into(),
                    })));
                    drop(tx);
                    // The coordinator closes the stream once it has let the
                    // worker go.
                    let _ = tokio::time::timeout(Duration::from_secs(2), async {
                        while let Ok(Some(_)) = inbound.message().await {}
                    })
                    .await;
                    if let Some(r) = running.take() {
                        wait_for_job_thread(&r, cfg.stop_timeout).await;
                    }
                    return Ok(());
                }
                _ = beat.tick() => {
                    health.turn();
                    if tx.send(wrap(worker_message::Msg::Heartbeat(v1::Heartbeat {}))).is_err() { break "the stream refused a heartbeat".to_string(); }
                    if running.as_ref().is_some_and(|r| r.thread.is_finished()) {
                        running = None;
                    }
                }
                Some(m) = events_rx.recv() => {
                    if let Some(worker_message::Msg::Done(_)) = &m.msg {
                        if let Some(r) = running.take() {
                            let _ = tokio::task::spawn_blocking(move || r.thread.join()).await;
                        }
                    }
                    if !outbox.send(&tx, m) { break "the stream refused a report".to_string(); }
                }
                msg = inbound.message() => {
                    let m = match msg {
                        Ok(Some(m)) => m,
                        Ok(None) => { tracing::warn!("the coordinator closed the stream"); break "the coordinator closed the stream".to_string(); }
                        Err(e) => { tracing::warn!(error = %e.message(), "attach stream failed"); break format!("attach stream failed: {}", e.message()); }
                    };
                    match m.msg {
                        Some(coordinator_message::Msg::Assign(a)) => {
                            if let Some(r) = &running {
                                if r.job == a.job_id && !r.thread.is_finished() {
                                    tracing::info!(job = %a.job_id, generation = a.generation, rank = a.rank, world = a.world_size, "new generation");
                                    r.control.reform.store(true, Ordering::SeqCst);
                                    let _ = r.next.send(a);
                                } else {
                                    tracing::warn!(job = %a.job_id, busy = %r.job, "assignment while busy; ignored");
                                }
                                continue;
                            }
                            let control = Arc::new(Control::default());
                            let l = listener.try_clone().ok();
                            let (cfg2, out, c2, job, cur) = (cfg.clone(), events_tx.clone(), control.clone(), a.job_id.clone(), current.clone());
                            let (next_tx, next_rx) = std::sync::mpsc::channel();
                            tracing::info!(job = %job, rank = a.rank, world = a.world_size, generation = a.generation, "assignment");
                            let (generation, rank) = (a.generation, a.rank);
                            let failed = events_tx.clone();
                            // A thread name cannot hold NUL: keep only what
                            // a job id may hold.
                            let name: String = job.chars().filter(|c| c.is_ascii_alphanumeric() || "-._".contains(*c)).collect();
                            let thread = std::thread::Builder::new()
                                .name(format!("accrue-job-{name}"))
                                .spawn(move || {
                                    let (job, out2, cur2) = (a.job_id.clone(), out.clone(), cur.clone());
                                    guarded(&job, (generation, rank), &cur2, &out2, move || {
                                        run_assignment(a, next_rx, l, &cfg2, c2, &out, cur)
                                    })
                                });
                            match thread {
                                Ok(thread) => running = Some(Running { job, control, thread, next: next_tx }),
                                Err(e) => {
                                    tracing::error!(error = %e, "cannot start the job thread");
                                    let _ = failed.send(job_failed(&job, generation, rank, format!("the worker cannot start a job thread: {e}")));
                                }
                            }
                        }
                        Some(coordinator_message::Msg::Stop(s)) => stop(&running, &s.job_id, &s.reason),
                        Some(coordinator_message::Msg::Abort(a)) => {
                            // Drop the window in flight and wait for the next
                            // generation (a stop ends the job instead).
                            let now = current.lock().unwrap_or_else(|p| p.into_inner()).clone();
                            if let Some(r) = running.as_ref().filter(|r| r.job == a.job_id) {
                                if now.is_some_and(|(_, g, _)| g == a.generation) {
                                    tracing::warn!(job = %a.job_id, generation = a.generation, reason = %a.reason, "window aborted");
                                    r.control.abort.store(true, Ordering::SeqCst);
                                }
                            }
                        }
                        Some(coordinator_message::Msg::CheckpointNow(c)) => {
                            if let Some(r) = running.as_ref().filter(|r| r.job == c.job_id) {
                                r.control.checkpoint_now.store(true, Ordering::SeqCst);
                            }
                        }
                        Some(coordinator_message::Msg::Refused(r)) => {
                            tracing::warn!(job = %r.job_id, generation = r.generation, reason = %r.reason, "report refused");
                        }
                        None => {}
                    }
                }
            }
        };
        health.set(Link::Lost {
            coordinator: url.clone(),
            reason: ended,
        });
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = &mut shutdown => return Ok(()),
        }
    }
}

/// Waits (polling, so no blocking task outlives the runtime) until the
/// job's thread has ended, at most `limit`: the window in flight is lost
/// anyway once the daemon detached, but a checkpoint being written is
/// finished rather than cut off at exit.
async fn wait_for_job_thread(r: &Running, limit: Duration) {
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

fn stop(running: &Option<Running>, job: &str, reason: &str) {
    if let Some(r) = running.as_ref().filter(|r| r.job == job) {
        tracing::info!(job, reason, "stopping the job");
        r.control.stop.store(true, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests;
