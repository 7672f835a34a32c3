//! Worker daemon: attaches to the coordinator, runs assignments with the
//! engine and the ring on a thread of their own (libtorch never runs inside
//! an async task), reports every optimizer step, obeys stop, abort and
//! checkpoint-now, and returns to idle for the next job.

use crate::comm::{RingConfig, TcpRing};
use crate::engine::{Control, Event, RunOptions, StepReport};
use crate::Engine;
use accrue_proto::v1::{
    self, coordinator_message, worker_message, worker_service_client::WorkerServiceClient,
    WorkerMessage,
};
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// e.g. http://127.0.0.1:50051
    pub coordinator: String,
    pub worker_id: String,
    /// Data-plane listener, host:port (port 0: any free port).
    pub listen_data: String,
    /// Overrides the jobs' device (cpu, cuda:N, auto).
    pub device: Option<String>,
    /// Relative data paths in job specs are resolved under this folder.
    pub data_root: Option<PathBuf>,
    pub heartbeat: Duration,
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
}

/// Runs one assignment to its end on the calling (dedicated) thread.
fn run_assignment(
    a: v1::Assignment,
    listener: Option<TcpListener>,
    cfg: &DaemonConfig,
    control: Arc<Control>,
    out: &mpsc::UnboundedSender<WorkerMessage>,
) {
    let (job, generation, rank) = (a.job_id.clone(), a.generation, a.rank);
    let result = (|| -> Result<crate::engine::Summary, String> {
        let proto = a.spec.clone().ok_or("the assignment has no spec")?;
        let mut spec = accrue_proto::spec_from_proto(&proto).map_err(|e| e.to_string())?;
        if let Some(d) = &cfg.device {
            spec.device = d.clone();
        }
        if let Some(root) = &cfg.data_root {
            for p in [
                &mut spec.data.path,
                &mut spec.data.eval_path,
                &mut spec.model.init,
                &mut spec.model.path,
            ]
            .into_iter()
            .flatten()
            {
                if p.is_relative() {
                    *p = root.join(&*p);
                }
            }
        }
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
        let ring = TcpRing::start(listener, ring_cfg).map_err(|e| e.to_string())?;
        let opts = RunOptions {
            checkpoint_dir: (!a.checkpoint_dir.is_empty())
                .then(|| PathBuf::from(&a.checkpoint_dir)),
            resume: a.resume_step > 0,
            control: Some(control.clone()),
            ..Default::default()
        };
        let mut engine = Engine::new(spec, ring, opts).map_err(|e| e.to_string())?;
        engine
            .run(|ev| {
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
            })
            .map_err(|e| e.to_string())
    })();
    let stopped = control.stopping();
    let done = match result {
        Ok(s) => v1::JobDone {
            job_id: job.clone(),
            generation,
            rank,
            ok: true,
            error: String::new(),
            checkpoint: s.checkpoint.display().to_string(),
            eval: s.eval.as_ref().map(eval_proto),
            stopped: stopped || !s.finished,
        },
        Err(e) => {
            if !stopped {
                tracing::error!(job = %job, rank, error = %e, "job failed");
            }
            v1::JobDone {
                job_id: job.clone(),
                generation,
                rank,
                ok: stopped,
                error: e,
                stopped,
                ..Default::default()
            }
        }
    };
    let _ = out.send(wrap(worker_message::Msg::Done(done)));
}

/// Attaches and serves assignments until the process is stopped; re-attaches
/// when the coordinator goes away (reports made meanwhile are kept and sent
/// after re-attaching).
pub async fn run(cfg: DaemonConfig) -> Result<(), DaemonError> {
    let listener = TcpListener::bind(&cfg.listen_data).map_err(|source| DaemonError::Listen {
        addr: cfg.listen_data.clone(),
        source,
    })?;
    let data_addr = listener
        .local_addr()
        .map_err(|source| DaemonError::Listen {
            addr: cfg.listen_data.clone(),
            source,
        })?
        .to_string();
    let (events_tx, mut events_rx) = mpsc::unbounded_channel::<WorkerMessage>();
    let mut running: Option<Running> = None;
    let mut backoff = Duration::from_millis(50);
    loop {
        let client = match WorkerServiceClient::connect(cfg.coordinator.clone()).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(coordinator = %cfg.coordinator, error = %e, "cannot reach the coordinator; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        let mut client = client.max_decoding_message_size(16 << 20);
        let (tx, rx) = mpsc::unbounded_channel::<WorkerMessage>();
        let hello = v1::WorkerHello {
            worker_id: cfg.worker_id.clone(),
            data_addr: data_addr.clone(),
            device: cfg.device.clone().unwrap_or_else(|| "auto".into()),
            capacity: 1,
            version: env!("CARGO_PKG_VERSION").into(),
        };
        let _ = tx.send(wrap(worker_message::Msg::Hello(hello)));
        let mut inbound = match client
            .attach(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
        {
            Ok(r) => r.into_inner(),
            Err(e) => {
                tracing::warn!(error = %e.message(), "attach refused; retrying");
                tokio::time::sleep(backoff).await;
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        tracing::info!(worker = %cfg.worker_id, data = %data_addr, "attached");
        let mut beat = tokio::time::interval(cfg.heartbeat);
        loop {
            tokio::select! {
                _ = beat.tick() => {
                    if tx.send(wrap(worker_message::Msg::Heartbeat(v1::Heartbeat {}))).is_err() { break; }
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
                    if tx.send(m).is_err() { break; }
                }
                msg = inbound.message() => {
                    let m = match msg {
                        Ok(Some(m)) => m,
                        Ok(None) => { tracing::warn!("the coordinator closed the stream"); break; }
                        Err(e) => { tracing::warn!(error = %e.message(), "attach stream failed"); break; }
                    };
                    match m.msg {
                        Some(coordinator_message::Msg::Assign(a)) => {
                            if let Some(r) = &running {
                                tracing::warn!(job = %a.job_id, busy = %r.job, "assignment while busy; ignored");
                                continue;
                            }
                            let control = Arc::new(Control::default());
                            let l = listener.try_clone().ok();
                            let (cfg2, out, c2, job) = (cfg.clone(), events_tx.clone(), control.clone(), a.job_id.clone());
                            tracing::info!(job = %job, rank = a.rank, world = a.world_size, "assignment");
                            let thread = std::thread::Builder::new()
                                .name(format!("accrue-job-{job}"))
                                .spawn(move || run_assignment(a, l, &cfg2, c2, &out));
                            match thread {
                                Ok(thread) => running = Some(Running { job, control, thread }),
                                Err(e) => tracing::error!(error = %e, "cannot start the job thread"),
                            }
                        }
                        Some(coordinator_message::Msg::Stop(s)) => stop(&running, &s.job_id, &s.reason),
                        Some(coordinator_message::Msg::Abort(a)) => stop(&running, &a.job_id, &a.reason),
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
        }
        tokio::time::sleep(backoff).await;
    }
}

fn stop(running: &Option<Running>, job: &str, reason: &str) {
    if let Some(r) = running.as_ref().filter(|r| r.job == job) {
        tracing::info!(job, reason, "stopping the job");
        r.control.stop.store(true, Ordering::SeqCst);
    }
}
