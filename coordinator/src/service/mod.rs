//! The async shell around the scheduler: feeds it inputs with the time,
//! executes its effects, and does nothing else.
//!
//! ```text
//!  gRPC handlers, tick ──Input──▶ Cluster::step (pure, under one lock)
//!                                      │ Vec<Effect>
//!                                      ▼
//!   Save/Delete ─▶ store queue (ticket, in decision order) ─▶ writer thread
//!   Send        ─▶ held behind the newest ticket ─▶ worker stream by (id, conn)
//!   Close       ─▶ drop the worker's stream      Event ─▶ watchers
//! ```
//!
//! Effects are queued under the same lock the decision was made under, so
//! writes reach the store's queue in version order and messages and events
//! queue in decision order; nothing there waits on I/O. Messages are sent
//! and events published after the lock is let go, each queue drained in
//! order.

use crate::domain::Caller;
use crate::error::CoordError;
use crate::ringkey::RingMaster;
use crate::scheduler::{self, Cluster, Effect, Input};
use crate::store::{JobStore, WriteProgress};
use accrue_common::spec::{confine_field, Area, LocalFs};
use accrue_common::JobSpec;
use accrue_proto::v1::{self, CoordinatorMessage, Job, JobEvent};
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{broadcast, mpsc};
use tonic::Status;

mod config;
mod watch;
pub use config::{
    parse_watch_buffer, watch_buffer_from_env, Config, WatchBufferError,
    DEFAULT_MAX_JOB_MEMORY_GIB, DEFAULT_WATCH_BUFFER,
};

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

const LATENCY_WINDOW: usize = 65_536;

pub(crate) type Outbox = mpsc::UnboundedSender<Result<CoordinatorMessage, Status>>;

/// The last LATENCY_WINDOW latencies (µs) of one kind, and how many there
/// were in all.
#[derive(Default)]
struct Latencies {
    ring: Vec<u64>,
    next: usize,
    count: u64,
}

impl Latencies {
    fn record(&mut self, us: u64) {
        self.count += 1;
        if self.ring.len() < LATENCY_WINDOW {
            self.ring.push(us);
        } else {
            self.ring[self.next] = us;
        }
        self.next = (self.next + 1) % LATENCY_WINDOW;
    }

    /// (p50, p99, count).
    fn quantiles(&self) -> (u64, u64, u64) {
        let mut l = self.ring.clone();
        if l.is_empty() {
            return (0, 0, self.count);
        }
        l.sort_unstable();
        let q = |p: f64| l[((l.len() - 1) as f64 * p).round() as usize];
        (q(0.5), q(0.99), self.count)
    }
}

struct Inner {
    cluster: Cluster,
    next_conn: u64,
    /// Worker messages: lock + decision.
    decided: Latencies,
    /// Worker messages: lock + decision + executing the effects.
    handled: Latencies,
}

/// A message waiting for the writes before it to be durable.
struct Held {
    ticket: u64,
    worker: String,
    conn: u64,
    msg: CoordinatorMessage,
}

pub struct Coordinator {
    cfg: Config,
    inner: Mutex<Inner>,
    store: Box<dyn JobStore>,
    progress: Arc<WriteProgress>,
    /// Each attached worker's current connection and its stream.
    conns: Mutex<BTreeMap<String, (u64, Outbox)>>,
    held: Mutex<VecDeque<Held>>,
    /// Events decided but not yet published (kept in decision order).
    unpublished: Mutex<VecDeque<JobEvent>>,
    events: broadcast::Sender<JobEvent>,
    /// Set when the coordinator stops (or steps down): nothing more is
    /// decided or written.
    closed: AtomicBool,
    /// TensorBoard event files (`--tensorboard-dir`), fed as events are
    /// published.
    tensorboard: Option<crate::tensorboard::TensorBoard>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Coordinator {
    /// Takes back every job the store holds (see [`Cluster::restore`]),
    /// with a random in-memory ring master secret (see
    /// [`Coordinator::with_ring_master`]).
    pub fn new(
        cfg: Config,
        store: Box<dyn JobStore>,
    ) -> Result<Arc<Self>, crate::store::StoreError> {
        Self::with_ring_master(cfg, store, RingMaster::random())
    }

    /// Takes back every job the store holds; every generation's ring key
    /// is derived from `master`.
    pub fn with_ring_master(
        cfg: Config,
        store: Box<dyn JobStore>,
        master: RingMaster,
    ) -> Result<Arc<Self>, crate::store::StoreError> {
        let mut cluster = Cluster::new(
            scheduler::Policy {
                heartbeat_ttl_ms: cfg.heartbeat_ttl.as_millis() as i64,
                state_dir: std::path::absolute(&cfg.state_dir)
                    .unwrap_or_else(|_| cfg.state_dir.clone()),
                max_job_memory: cfg.max_job_memory,
                roots: cfg.roots.clone(),
                // A working folder that was removed: relative folders are
                // judged from `/` (the workers resolve them on their own).
                cwd: std::env::current_dir().unwrap_or_else(|_| "/".into()),
            },
            master.keys(),
        );
        cluster.restore(store.list()?, now_ms());
        cluster.restore_series(store.list_series()?);
        // broadcast::channel panics on 0; the flag refuses it.
        let (events, _) = broadcast::channel(cfg.watch_buffer.max(1));
        let progress = store.progress();
        let tensorboard = cfg.tensorboard_dir.clone().and_then(|dir| {
            crate::tensorboard::TensorBoard::start(dir)
                .inspect_err(|e| tracing::warn!(error = %e, "no TensorBoard event files: cannot start their writer"))
                .ok()
        });
        let c = Arc::new(Self {
            cfg,
            inner: Mutex::new(Inner {
                cluster,
                next_conn: 0,
                decided: Latencies::default(),
                handled: Latencies::default(),
            }),
            store,
            progress,
            conns: Mutex::default(),
            held: Mutex::default(),
            unpublished: Mutex::default(),
            events,
            closed: AtomicBool::new(false),
            tensorboard,
        });
        let weak = Arc::downgrade(&c);
        c.progress.set_waker(Box::new(move || {
            if let Some(c) = weak.upgrade() {
                c.release();
            }
        }));
        Ok(c)
    }

    /// Stops deciding: writes what is queued (while the store takes it),
    /// releases the store (its file lock, so another coordinator can open
    /// the same state dir), and closes every worker stream so the daemons
    /// re-attach (to the new leader, in etcd mode).
    pub fn close(&self) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        self.store.close();
        lock(&self.held).clear();
        lock(&self.conns).clear();
        if let Some(tb) = &self.tensorboard {
            tb.close(Duration::from_secs(5));
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Decides `input` now and executes the effects; returns the reply
    /// (for a submission or a cancellation).
    fn handle(&self, input: Input) -> Option<Result<Job, CoordError>> {
        self.handle_with(|_, _| input)
    }

    /// `handle` of the input `make` builds under the decision lock (it may
    /// register a connection first).
    fn handle_with(
        &self,
        make: impl FnOnce(&mut Inner, &Self) -> Input,
    ) -> Option<Result<Job, CoordError>> {
        if self.is_closed() {
            return Some(Err(CoordError::NotLeader { leader: None }));
        }
        let started = std::time::Instant::now();
        let (reply, report, decided) = {
            let mut inner = lock(&self.inner);
            let input = make(&mut inner, self);
            let report = matches!(input, Input::Message { .. });
            let fx = inner.cluster.step(input, now_ms());
            let decided = started.elapsed();
            (self.queue(fx), report, decided)
        };
        // Outside the lock, each in the order it was queued.
        self.release();
        self.publish();
        if report {
            let mut inner = lock(&self.inner);
            inner.decided.record(decided.as_micros() as u64);
            inner.handled.record(started.elapsed().as_micros() as u64);
        }
        reply
    }

    /// Queues the effects (called under the decision lock, so writes queue
    /// in version order and messages and events in decision order; nothing
    /// here blocks). Sending and publishing happen after the lock is let go.
    fn queue(&self, fx: Vec<Effect>) -> Option<Result<Job, CoordError>> {
        let mut reply = None;
        let mut sends = Vec::new();
        for e in fx {
            match e {
                Effect::Save(job) => {
                    if let Err(e) = self.store.put(&job) {
                        tracing::error!(job = %job.id, error = %e, "cannot queue the job write");
                    }
                }
                Effect::SaveSeries(series) => {
                    if let Err(e) = self.store.put_series(&series) {
                        tracing::error!(job = %series.job_id, error = %e, "cannot queue the series write");
                    }
                }
                Effect::Delete(id) => {
                    if let Err(e) = self.store.delete(&id) {
                        tracing::error!(job = %id, error = %e, "cannot queue the job removal");
                    }
                }
                Effect::Send { worker, conn, msg } => sends.push((worker, conn, msg)),
                Effect::Close { worker, conn } => {
                    let mut conns = lock(&self.conns);
                    if conns.get(&worker).is_some_and(|(c, _)| *c == conn) {
                        conns.remove(&worker);
                    }
                }
                Effect::Event(ev) => lock(&self.unpublished).push_back(*ev),
                Effect::Reply(r) => reply = Some(r),
            }
        }
        if !sends.is_empty() {
            // Behind every write decided so far, those of this step included.
            let ticket = self.progress.issued();
            lock(&self.held).extend(sends.into_iter().map(|(worker, conn, msg)| Held {
                ticket,
                worker,
                conn,
                msg,
            }));
        }
        reply
    }

    /// Publishes queued events to the watchers (and the TensorBoard
    /// writer, which never blocks), oldest first.
    fn publish(&self) {
        let mut q = lock(&self.unpublished);
        while let Some(ev) = q.pop_front() {
            if let Some(tb) = &self.tensorboard {
                tb.observe(&ev);
            }
            let _ = self.events.send(ev);
        }
    }

    /// Sends the held messages whose writes are durable, oldest first, to
    /// the connection they were decided for (dropped if it is gone).
    fn release(&self) {
        let mut held = lock(&self.held);
        let durable = self.progress.durable();
        while held.front().is_some_and(|h| h.ticket <= durable) {
            let Some(h) = held.pop_front() else { break };
            let conns = lock(&self.conns);
            if let Some((c, tx)) = conns.get(&h.worker) {
                if *c == h.conn {
                    let _ = tx.send(Ok(h.msg));
                }
            }
        }
    }

    /// Waits until every write issued so far is durable, at most `limit`.
    async fn durable_within(&self, limit: Duration) -> bool {
        let ticket = self.progress.issued();
        let mut rx = self.progress.subscribe();
        // wait_for looks at the current value first.
        tokio::time::timeout(limit, rx.wait_for(|d| *d >= ticket))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Messages to workers still waiting for their writes to be durable.
    pub fn held_messages(&self) -> usize {
        lock(&self.held).len()
    }

    /// `f` of the scheduler's state, under the decision lock (keep it
    /// short: reports wait meanwhile).
    pub fn with_cluster<R>(&self, f: impl FnOnce(&scheduler::Cluster) -> R) -> R {
        f(&lock(&self.inner).cluster)
    }

    /// Every job event from now on (all jobs).
    pub fn subscribe(&self) -> broadcast::Receiver<JobEvent> {
        self.events.subscribe()
    }

    pub fn jobs(&self) -> Vec<Job> {
        lock(&self.inner).cluster.jobs().cloned().collect()
    }

    /// One ListJobs page (see [`crate::paging`]): at most `page_size` jobs
    /// (0: 100; at most 1000) after `page_token`, and within
    /// [`MAX_LIST_PAGE_BYTES`](accrue_proto::layout::MAX_LIST_PAGE_BYTES)
    /// encoded, so the answer fits what a standard gRPC client accepts.
    pub fn list_page(
        &self,
        page_size: i64,
        page_token: &str,
    ) -> Result<v1::ListJobsResponse, CoordError> {
        use accrue_proto::layout::MAX_LIST_PAGE_BYTES;
        let req = crate::paging::request(page_size, page_token)
            .map_err(|e| CoordError::InvalidArgument(e.to_string()))?;
        // As `repeated Job jobs = 1` encodes it: tag, length, message.
        // Measured as sent: with the fields a reader sees.
        let bytes = |j: &Job| prost::encoding::message::encoded_len(1, &read_view(j));
        let inner = lock(&self.inner);
        let (jobs, next_page_token) = inner.cluster.jobs_page(&req, bytes, MAX_LIST_PAGE_BYTES);
        Ok(v1::ListJobsResponse {
            jobs: jobs.into_iter().map(read_view).collect(),
            next_page_token,
        })
    }

    pub fn job(&self, id: &str) -> Result<Job, CoordError> {
        let mut j = lock(&self.inner)
            .cluster
            .job_view(id)
            .ok_or_else(|| CoordError::JobNotFound(id.into()))?;
        crate::domain::add_reader_fields(&mut j);
        Ok(j)
    }

    /// `id`'s training curve for GetSeries: the buckets from `from_step`
    /// merged down to `max_points` (0: the default), its skipped steps,
    /// evaluations (with perplexity for a language model) and recoveries.
    pub fn series(
        &self,
        id: &str,
        from_step: u64,
        max_points: u32,
    ) -> Result<v1::GetSeriesResponse, CoordError> {
        let max_points = match max_points {
            0 => crate::series::DEFAULT_POINTS,
            n => n as usize,
        };
        if let Some(why) = crate::series::check_points(max_points) {
            return Err(CoordError::InvalidArgument(why));
        }
        let inner = lock(&self.inner);
        let cl = &inner.cluster;
        let (Some(job), Some(s)) = (cl.job(id), cl.series(id)) else {
            return Err(CoordError::JobNotFound(id.into()));
        };
        Ok(crate::series::query(s, job, from_step, max_points))
    }

    /// Err (in words) while the job store cannot be written.
    pub fn store_health(&self) -> Result<(), String> {
        if self.is_closed() {
            return Err("the coordinator stopped".into());
        }
        self.store.health()
    }

    /// TensorBoard points dropped so far (0 without event files).
    pub fn tensorboard_dropped(&self) -> u64 {
        self.tensorboard.as_ref().map_or(0, |t| t.dropped())
    }

    pub fn worker_count(&self) -> usize {
        lock(&self.inner).cluster.worker_count()
    }

    /// (p50, p99, count) in µs of the recent worker messages: the time to
    /// take the lock and decide, and to also execute the effects (queue the
    /// writes, release messages, fan out to watchers).
    pub fn report_latency(&self) -> [(u64, u64, u64); 2] {
        let inner = lock(&self.inner);
        [inner.decided.quantiles(), inner.handled.quantiles()]
    }

    /// Records a job, waits (bounded) until its record is durable, then
    /// schedules it. A store that cannot take the write in time gets the
    /// submission taken back and UNAVAILABLE naming why: a job is either
    /// acknowledged and durable, or refused and gone.
    pub async fn submit(&self, spec: v1::JobSpec) -> Result<Job, CoordError> {
        self.submit_as(spec, String::new()).await
    }

    /// [`Coordinator::submit`] for `owner` (the principal), recorded on
    /// the job.
    pub async fn submit_as(&self, spec: v1::JobSpec, owner: String) -> Result<Job, CoordError> {
        if let Err(why) = self.store_health() {
            return Err(CoordError::StoreUnavailable(why));
        }
        // The one conversion of a submission: a bad field (an over-long
        // path among them) is refused before anything here reads the file
        // system for the spec.
        let spec = scheduler::parse_spec(&spec)?;
        self.submit_spec(spec, owner).await
    }

    /// [`Coordinator::submit_as`] for a spec already parsed and its fields
    /// checked (a TOML submission, or one converted from the wire).
    pub async fn submit_spec(&self, spec: JobSpec, owner: String) -> Result<Job, CoordError> {
        if let Err(why) = self.store_health() {
            return Err(CoordError::StoreUnavailable(why));
        }
        self.check_local_paths(&spec).await?;
        self.check_owner_record(&spec).await?;
        let job = self
            .handle(Input::Submit {
                spec: Box::new(spec),
                owner,
            })
            .unwrap_or_else(|| Err(CoordError::Internal("submit decided nothing".into())))?;
        self.admit_when_durable(&job.id, "job", "was not created")
            .await?;
        tracing::info!(job = %job.id, "submitted");
        self.job(&job.id)
    }

    /// Admits `id` once the decision about it is durable; when the store
    /// does not make it durable within `--durable-timeout`, withdraws it
    /// and answers UNAVAILABLE ("<what> <id> was not durable within ... and
    /// <undone>").
    async fn admit_when_durable(
        &self,
        id: &str,
        what: &str,
        undone: &str,
    ) -> Result<(), CoordError> {
        let limit = self.cfg.durable_timeout;
        if !self.durable_within(limit).await {
            self.handle(Input::Withdraw { job: id.into() });
            let why = self
                .store_health()
                .err()
                .unwrap_or_else(|| "the write is still queued".into());
            return Err(CoordError::StoreUnavailable(format!(
                "{what} {id} was not durable within {:.1} s and {undone} ({why}); retry",
                limit.as_secs_f64()
            )));
        }
        self.handle(Input::Admit { job: id.into() });
        Ok(())
    }

    /// What the scheduler cannot see: where the spec's paths land on this
    /// host's file system (symlinks followed), off the runtime (the roots
    /// may be network mounts).
    async fn check_local_paths(&self, spec: &JobSpec) -> Result<(), CoordError> {
        if self.cfg.roots.is_empty() {
            return Ok(());
        }
        let domain = spec.clone();
        let roots = self.cfg.roots.clone();
        tokio::task::spawn_blocking(move || domain.confined(&roots, &LocalFs).map(|_| ()))
            .await
            .map_err(|e| CoordError::Internal(format!("the path check did not finish: {e}")))?
            .map_err(|e| CoordError::InvalidArgument(e.to_string()))
    }

    /// One owner per checkpoint folder, as this host's file system shows
    /// it: a spec naming a folder that holds an ownership record
    /// (`OWNER.json`, see [`crate::ownership::check_record`]) is refused.
    /// Read off the runtime; a folder this host cannot see passes (the
    /// workers check the record again before they touch the folder).
    async fn check_owner_record(&self, spec: &JobSpec) -> Result<(), CoordError> {
        use crate::ownership::{check_record, Folder, OWNER_FILE};
        let Some(dir) = spec.checkpoint.dir.as_deref() else {
            return Ok(());
        };
        let lexical = self.with_cluster(|cl| cl.checkpoint_folder("", Some(dir)));
        let roots = self.cfg.roots.clone();
        let read = tokio::task::spawn_blocking(move || {
            // Where the folder really is here (symlinks followed).
            let real = match &roots.checkpoint {
                Some(_) => confine_field(&roots, Area::Checkpoint, "checkpoint.dir", &lexical, &LocalFs)
                    .ok()
                    .flatten()
                    .unwrap_or(lexical),
                None => lexical,
            };
            let file = real.join(OWNER_FILE);
            let text = match std::fs::read_to_string(&file) {
                Ok(t) => Some(t),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => {
                    tracing::warn!(file = %file.display(), error = %e, "cannot read the ownership record; the workers check it");
                    None
                }
            };
            (real, text)
        })
        .await
        .map_err(|e| CoordError::Internal(format!("the ownership check did not finish: {e}")))?;
        let (real, text) = read;
        let folder = Folder {
            dir: real,
            explicit: true,
        };
        self.with_cluster(|cl| {
            check_record(&folder, text.as_deref(), |id| cl.job(id).map(|j| j.state()))
        })
        .map_err(CoordError::from)
    }

    /// Resumes a failed or cancelled job for `by` (its owner, or admin;
    /// see [`scheduler::may_resume`]): pending again under the same id,
    /// scheduled once the change is durable, as a submission is. A store
    /// that cannot take it in time gets the job put back as it was and
    /// UNAVAILABLE naming why.
    pub async fn resume_as(&self, id: &str, by: Caller) -> Result<Job, CoordError> {
        if let Err(why) = self.store_health() {
            return Err(CoordError::StoreUnavailable(why));
        }
        let job = self
            .handle(Input::Resume { job: id.into(), by })
            .unwrap_or_else(|| Err(CoordError::Internal("resume decided nothing".into())))?;
        self.admit_when_durable(&job.id, "the resume of job", "was taken back")
            .await?;
        tracing::info!(job = %job.id, "resumed");
        self.job(&job.id)
    }

    pub fn cancel(&self, id: &str) -> Result<Job, CoordError> {
        self.cancel_as(id, Caller::Anyone)
    }

    /// Cancels `id` if `by` may (its owner, or admin; see
    /// [`scheduler::may_cancel`]).
    pub fn cancel_as(&self, id: &str, by: Caller) -> Result<Job, CoordError> {
        let r = self
            .handle(Input::Cancel { job: id.into(), by })
            .unwrap_or_else(|| Err(CoordError::Internal("cancel decided nothing".into())));
        if r.is_ok() {
            tracing::info!(job = %id, "cancelled");
        }
        r
    }

    /// A worker opened a stream: registers its connection, then lets the
    /// scheduler decide. Returns the connection id.
    pub fn attach(&self, hello: v1::WorkerHello, tx: Outbox) -> Result<u64, CoordError> {
        let id = hello.worker_id.clone();
        let mut conn = 0;
        let reply = self.handle_with(|inner, me| {
            inner.next_conn += 1;
            conn = inner.next_conn;
            lock(&me.conns).insert(id.clone(), (conn, tx));
            Input::Attach { conn, hello }
        });
        match reply {
            Some(Err(e)) => {
                let mut conns = lock(&self.conns);
                if conns.get(&id).is_some_and(|(c, _)| *c == conn) {
                    conns.remove(&id);
                }
                Err(e)
            }
            _ => Ok(conn),
        }
    }

    /// A message on connection `conn` of `worker`.
    pub fn on_message(&self, worker: &str, conn: u64, msg: v1::WorkerMessage) {
        self.handle(Input::Message {
            worker: worker.into(),
            conn,
            msg,
        });
    }

    /// A worker is gone (`conn` None: whichever connection it has).
    pub fn lost(&self, worker: &str, conn: Option<u64>, reason: &str) {
        self.handle(Input::Lost {
            worker: worker.into(),
            conn,
            reason: reason.into(),
        });
    }

    /// Time passed.
    pub fn tick(&self) {
        self.handle(Input::Tick);
    }
}

/// A job as a reader sees it ([`crate::domain::add_reader_fields`]).
fn read_view(j: &Job) -> Job {
    let mut j = j.clone();
    crate::domain::add_reader_fields(&mut j);
    j
}

#[cfg(test)]
mod tests;
