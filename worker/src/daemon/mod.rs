//! Worker daemon: attaches to the coordinator, runs assignments with the
//! engine and the ring on a thread of their own (libtorch never runs inside
//! an async task), reports every optimizer step, obeys stop, abort and
//! checkpoint-now, and returns to idle for the next job.
//!
//! - `session`: connect, attach, detach, and the one backoff between tries;
//! - `dispatch`: what a coordinator message does (pure);
//! - `job`: the job's own thread (ring, engine, JobDone);
//! - `outbox`: reports a dead stream could not take, kept for the next;
//! - this module: the config and the loop that ties them together.

use accrue_proto::v1::{worker_message, WorkerMessage};
use std::future::Future;
use std::net::TcpListener;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

mod assign;
mod dispatch;
mod etcd;
pub mod health;
mod job;
mod outbox;
mod session;

use dispatch::{on_message, Action, JobSlot};
use health::{HealthState, Link};
use job::{Current, Running};
use outbox::Outbox;
use session::Backoff;

pub use job::DaemonRing;
pub use session::{ATTACH_TIMEOUT, CONNECT_TIMEOUT};

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
    let (events_tx, events_rx) = mpsc::unbounded_channel::<WorkerMessage>();
    let mut daemon = Daemon {
        cfg,
        health,
        listener,
        data_addr,
        events_tx,
        events_rx,
        running: None,
        current: Arc::default(),
        outbox: Outbox::default(),
    };
    let mut backoff = Backoff::default();
    loop {
        daemon.health.turn();
        let url = etcd::coordinator_url(&daemon.cfg).await;
        match daemon.session(&url, &mut backoff, shutdown.as_mut()).await {
            Some(link) => daemon.health.set(link),
            None => return Ok(()),
        }
        if !backoff.pause(shutdown.as_mut()).await {
            return Ok(());
        }
    }
}

/// What the daemon keeps across attach streams.
struct Daemon {
    cfg: DaemonConfig,
    health: HealthState,
    /// The data-plane listener, lent to each job's rings.
    listener: TcpListener,
    data_addr: String,
    /// Reports from the job's thread, to the coordinator.
    events_tx: mpsc::UnboundedSender<WorkerMessage>,
    events_rx: mpsc::UnboundedReceiver<WorkerMessage>,
    running: Option<Running>,
    current: Current,
    outbox: Outbox,
}

impl Daemon {
    /// One attach stream, from connecting to its end: None when the daemon
    /// was told to stop (it detached), else the link state to report
    /// before the next try.
    async fn session<F: Future<Output = ()>>(
        &mut self,
        url: &str,
        backoff: &mut Backoff,
        mut shutdown: Pin<&mut F>,
    ) -> Option<Link> {
        let client = match session::connect(url, self.cfg.tls.as_ref()).await {
            Ok(c) => c,
            Err(link) => return Some(link),
        };
        let hello = session::hello(&self.cfg, &self.data_addr, &self.current);
        let mut stream = match session::attach(client, url, hello).await {
            Ok(s) => s,
            Err(link) => return Some(link),
        };
        backoff.reset();
        tracing::info!(worker = %self.cfg.worker_id, data = %self.data_addr, unsent = self.outbox.len(), "attached");
        self.health.set(Link::Attached {
            coordinator: url.to_string(),
        });
        // What the previous stream could not take goes first, right after
        // the hello (queued by the attach).
        if !self.outbox.flush(&stream.tx) {
            tracing::warn!("the attach stream closed at once; retrying");
            return Some(Link::Lost {
                coordinator: url.to_string(),
                reason: "it closed at once".into(),
            });
        }
        let mut beat = tokio::time::interval(self.cfg.heartbeat);
        let ended = loop {
            tokio::select! {
                _ = &mut shutdown => {
                    self.shut_down(stream).await;
                    return None;
                }
                _ = beat.tick() => {
                    self.health.turn();
                    if stream.tx.send(wrap(worker_message::Msg::Heartbeat(Default::default()))).is_err() {
                        break "the stream refused a heartbeat".to_string();
                    }
                    if self.running.as_ref().is_some_and(|r| r.thread.is_finished()) {
                        self.running = None;
                    }
                }
                Some(m) = self.events_rx.recv() => {
                    if let Some(worker_message::Msg::Done(_)) = &m.msg {
                        if let Some(r) = self.running.take() {
                            let _ = tokio::task::spawn_blocking(move || r.thread.join()).await;
                        }
                    }
                    if !self.outbox.send(&stream.tx, m) {
                        break "the stream refused a report".to_string();
                    }
                }
                msg = stream.inbound.message() => {
                    let m = match msg {
                        Ok(Some(m)) => m,
                        Ok(None) => {
                            tracing::warn!("the coordinator closed the stream");
                            break "the coordinator closed the stream".to_string();
                        }
                        Err(e) => {
                            tracing::warn!(error = %e.message(), "attach stream failed");
                            break format!("attach stream failed: {}", e.message());
                        }
                    };
                    if let Some(msg) = m.msg {
                        for action in on_message(&self.slot(), msg) {
                            self.apply(action);
                        }
                    }
                }
            }
        };
        Some(Link::Lost {
            coordinator: url.to_string(),
            reason: ended,
        })
    }

    /// Told to stop: this rank leaves its job, the daemon detaches, and the
    /// job's thread gets up to `--stop-timeout` to end.
    async fn shut_down(&mut self, stream: session::Attached) {
        tracing::info!(worker = %self.cfg.worker_id, "shutting down: detaching from the coordinator");
        self.health.set(Link::Stopping);
        if let Some(r) = &self.running {
            // This rank leaves; the job goes on without it.
            r.control.leave.store(true, Ordering::SeqCst);
        }
        session::detach(stream).await;
        if let Some(r) = self.running.take() {
            job::wait_for_job_thread(&r, self.cfg.stop_timeout).await;
        }
    }

    /// What the job slot holds, for [`on_message`].
    fn slot(&self) -> JobSlot {
        match &self.running {
            None => JobSlot::Free,
            Some(r) => JobSlot::Busy {
                job: r.job.clone(),
                ended: r.thread.is_finished(),
                generation: self
                    .current
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .as_ref()
                    .map(|(_, g, _)| *g),
            },
        }
    }

    /// Carries out one decision of [`on_message`].
    fn apply(&mut self, action: Action) {
        let running = self.running.as_ref();
        match action {
            Action::Start(a) => {
                self.running =
                    job::start(a, &self.cfg, &self.listener, &self.events_tx, &self.current);
            }
            Action::NewGeneration(a) => {
                if let Some(r) = running {
                    tracing::info!(job = %a.job_id, generation = a.generation, rank = a.rank, world = a.world_size, "new generation");
                    r.control.reform.store(true, Ordering::SeqCst);
                    let _ = r.next.send(a);
                }
            }
            Action::Busy { job, busy } => {
                tracing::warn!(job = %job, busy = %busy, "assignment while busy; ignored");
            }
            Action::Stop { job, reason } => {
                if let Some(c) = running.map(|r| &r.control) {
                    tracing::info!(job, reason, "stopping the job");
                    c.stop.store(true, Ordering::SeqCst);
                }
            }
            Action::Abort {
                job,
                generation,
                reason,
            } => {
                if let Some(c) = running.map(|r| &r.control) {
                    tracing::warn!(job = %job, generation, reason = %reason, "window aborted");
                    c.abort.store(true, Ordering::SeqCst);
                }
            }
            Action::CheckpointNow => {
                if let Some(c) = running.map(|r| &r.control) {
                    c.checkpoint_now.store(true, Ordering::SeqCst);
                }
            }
            Action::Refused(r) => {
                tracing::warn!(job = %r.job_id, generation = r.generation, reason = %r.reason, "report refused");
            }
        }
    }
}

#[cfg(test)]
mod tests;
