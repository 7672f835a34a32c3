//! The coordinator: jobs, workers, the gRPC services. Handlers lock the state
//! in short blocks, decide with the pure functions of `state`, and send or
//! persist after the lock is released.

use crate::state::{self, Waiting};
use crate::store::{JobStore, WriteProgress};
use accrue_proto::v1::{
    self, coordinator_message, worker_message, CoordinatorMessage, Counters, Job, JobEvent,
    JobState, StepReport, WorkerMessage,
};
use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[derive(Clone, Debug)]
pub struct Config {
    pub state_dir: PathBuf,
    /// A worker silent this long is gone.
    pub heartbeat_ttl: Duration,
    /// Largest accepted gRPC message.
    pub max_message_bytes: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            state_dir: "runs".into(),
            heartbeat_ttl: Duration::from_secs(10),
            max_message_bytes: 1 << 20,
        }
    }
}

const LATENCY_WINDOW: usize = 65_536;

type Outbox = mpsc::UnboundedSender<Result<CoordinatorMessage, Status>>;

struct WorkerEntry {
    hello: v1::WorkerHello,
    tx: Outbox,
    conn: u64,
    last_seen_ms: i64,
    job: Option<(String, u32)>,
}

struct JobEntry {
    job: Job,
    secret: Vec<u8>,
    saved_ms: i64,
    /// Since when the job waits for workers to re-form (Recovering).
    recovering_since: Option<i64>,
    /// Re-formations since the last committed step (a job that keeps
    /// failing to re-form fails).
    stalled: u32,
    /// After a coordinator restart: members that have not re-attached by
    /// then are lost.
    reattach_by: Option<i64>,
}

impl JobEntry {
    fn new(job: Job, now: i64) -> Self {
        Self {
            job,
            secret: Vec::new(),
            saved_ms: now,
            recovering_since: None,
            stalled: 0,
            reattach_by: None,
        }
    }
}

/// Re-formations in a row without a committed step before a job fails.
const MAX_STALLED_REFORMS: u32 = 5;

#[derive(Default)]
struct State {
    jobs: BTreeMap<String, JobEntry>,
    /// Submission order.
    order: Vec<String>,
    workers: BTreeMap<String, WorkerEntry>,
    next_conn: u64,
    /// The last report-handling latencies (µs), a ring of LATENCY_WINDOW.
    latencies_us: Vec<u64>,
    latency_next: usize,
    reports: u64,
}

pub struct Coordinator {
    cfg: Config,
    state: Mutex<State>,
    /// None once closed (the coordinator stopped).
    store: Mutex<Option<Box<dyn JobStore>>>,
    events: broadcast::Sender<JobEvent>,
    /// With a store that writes in the background (etcd): messages to
    /// workers wait here, in order, until the job writes made before them
    /// are durable. A new generation is thus in etcd before any worker
    /// trains under it, and a coordinator that restarts never hands out a
    /// generation number that workers already used.
    progress: Option<Arc<WriteProgress>>,
    held: Mutex<VecDeque<(u64, Outbox, CoordinatorMessage)>>,
}

/// What a locked block decided: messages to send and jobs to persist.
#[derive(Default)]
struct Effects {
    send: Vec<(Outbox, CoordinatorMessage)>,
    save: Vec<Job>,
    events: Vec<JobEvent>,
}

fn msg(m: coordinator_message::Msg) -> CoordinatorMessage {
    CoordinatorMessage { msg: Some(m) }
}

impl Coordinator {
    /// Loads every job from the store. Jobs that were running keep their
    /// state: their workers keep training and re-attach (naming the job in
    /// their hello); members that do not re-attach within the heartbeat TTL
    /// are lost and the job recovers without them.
    pub fn new(
        cfg: Config,
        store: Box<dyn JobStore>,
    ) -> Result<Arc<Self>, crate::store::StoreError> {
        let mut st = State::default();
        let now = now_ms();
        let grace = cfg.heartbeat_ttl.as_millis() as i64;
        for job in store.list()? {
            let mut entry = JobEntry::new(job, now);
            match entry.job.state() {
                JobState::Rendezvous | JobState::Running => entry.reattach_by = Some(now + grace),
                JobState::Recovering => {
                    entry.reattach_by = Some(now + grace);
                    entry.recovering_since = Some(now);
                }
                _ => {}
            }
            st.order.push(entry.job.id.clone());
            st.jobs.insert(entry.job.id.clone(), entry);
        }
        let (events, _) = broadcast::channel(16384);
        let progress = store.progress();
        let c = Arc::new(Self {
            cfg,
            state: Mutex::new(st),
            store: Mutex::new(Some(store)),
            events,
            progress,
            held: Mutex::default(),
        });
        if let Some(p) = &c.progress {
            let weak = Arc::downgrade(&c);
            p.set_waker(Box::new(move || {
                if let Some(c) = weak.upgrade() {
                    c.release();
                }
            }));
        }
        Ok(c)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Releases the job store (its file lock), so another coordinator can
    /// open the same state dir; later changes are no longer persisted.
    pub fn close_store(&self) {
        self.store.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    fn apply(&self, fx: Effects) {
        if !fx.save.is_empty() {
            let store = self.store.lock().unwrap_or_else(|p| p.into_inner());
            for j in &fx.save {
                match store.as_ref() {
                    Some(s) => {
                        if let Err(e) = s.put(j) {
                            tracing::error!(job = %j.id, error = %e, "cannot persist job");
                        }
                    }
                    None => {
                        tracing::warn!(job = %j.id, "coordinator stopped; change not persisted")
                    }
                }
            }
        }
        self.send(fx.send);
        for e in fx.events {
            let _ = self.events.send(e);
        }
    }

    /// Sends to workers: at once with a store whose writes are durable when
    /// `put` returns; else behind every write issued so far, in order.
    fn send(&self, msgs: Vec<(Outbox, CoordinatorMessage)>) {
        let Some(p) = &self.progress else {
            for (tx, m) in msgs {
                let _ = tx.send(Ok(m));
            }
            return;
        };
        if !msgs.is_empty() {
            let ticket = p.issued();
            self.held
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(msgs.into_iter().map(|(tx, m)| (ticket, tx, m)));
        }
        self.release();
    }

    /// Sends the held messages whose writes are durable, oldest first.
    fn release(&self) {
        let Some(p) = &self.progress else {
            return;
        };
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let durable = p.durable();
        while let Some((ticket, _, _)) = held.front() {
            if *ticket > durable {
                break;
            }
            if let Some((_, tx, m)) = held.pop_front() {
                let _ = tx.send(Ok(m));
            }
        }
    }

    /// Returns once every job write made so far has reached the store's
    /// backend (at once with a store whose writes are durable when made).
    pub async fn wait_durable(&self) {
        let Some(p) = &self.progress else {
            return;
        };
        let ticket = p.issued();
        // wait_for looks at the current value first.
        let _ = p.subscribe().wait_for(|d| *d >= ticket).await;
    }

    /// Messages to workers still waiting for their writes to be durable.
    pub fn held_messages(&self) -> usize {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn jobs(&self) -> Vec<Job> {
        let st = self.lock();
        st.order
            .iter()
            .filter_map(|id| st.jobs.get(id))
            .map(|e| e.job.clone())
            .collect()
    }

    pub fn job(&self, id: &str) -> Option<Job> {
        self.lock().jobs.get(id).map(|e| e.job.clone())
    }

    /// Err (in words) while the job store cannot be written.
    pub fn store_health(&self) -> Result<(), String> {
        match self
            .store
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            Some(s) => s.health(),
            None => Err("the coordinator stopped".into()),
        }
    }

    pub fn worker_count(&self) -> usize {
        self.lock().workers.len()
    }

    /// (p50, p99, count) of the recent report-handling latencies, in µs,
    /// and the number of reports handled so far.
    pub fn report_latency(&self) -> (u64, u64, u64) {
        let (mut l, n) = {
            let st = self.lock();
            (st.latencies_us.clone(), st.reports)
        };
        if l.is_empty() {
            return (0, 0, n);
        }
        l.sort_unstable();
        let q = |p: f64| l[((l.len() - 1) as f64 * p).round() as usize];
        (q(0.5), q(0.99), n)
    }

    pub fn submit(&self, spec: v1::JobSpec) -> Result<Job, Status> {
        let domain = accrue_proto::spec_from_proto(&spec)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let now = now_ms();
        let mut fx = Effects::default();
        let job = {
            let mut st = self.lock();
            let n = st.order.len() + 1;
            let id = format!("{}-{n}", domain.name);
            let mut job = Job {
                id: id.clone(),
                spec: Some(accrue_proto::spec_to_proto(&domain)),
                created_unix_ms: now,
                counters: Some(Counters::default()),
                ..Default::default()
            };
            let t = state::transition(&mut job, JobState::Pending, "submitted", now)
                .map_err(|e| Status::internal(e.to_string()))?;
            fx.events.push(transition_event(&job, t));
            fx.save.push(job.clone());
            st.order.push(id.clone());
            st.jobs.insert(id.clone(), JobEntry::new(job.clone(), now));
            self.schedule(&mut st, now, &mut fx);
            st.jobs[&id].job.clone()
        };
        tracing::info!(job = %job.id, "submitted");
        self.apply(fx);
        Ok(job)
    }

    /// Re-forms and grows running jobs, then places waiting jobs on free
    /// workers (gang, FIFO).
    fn schedule(&self, st: &mut State, now: i64, fx: &mut Effects) {
        self.reform_jobs(st, now, fx);
        let waiting: Vec<Waiting> = st
            .order
            .iter()
            .filter_map(|id| st.jobs.get(id))
            .filter(|e| e.job.state() == JobState::Pending)
            .map(|e| Waiting {
                job: e.job.id.clone(),
                world: e.job.spec.as_ref().map_or(1, |s| s.workers.max(1)) as usize,
            })
            .collect();
        let free = Self::free_workers(st);
        for (job_id, workers) in state::gang_schedule(&waiting, &free) {
            self.form(st, &job_id, workers, now, fx);
        }
    }

    pub fn cancel(&self, id: &str) -> Result<Job, Status> {
        let now = now_ms();
        let mut fx = Effects::default();
        let job = {
            let mut st = self.lock();
            let entry = st
                .jobs
                .get_mut(id)
                .ok_or_else(|| Status::not_found(format!("no job {id:?}")))?;
            let from = entry.job.state();
            if state::is_final(from) {
                return Err(Status::failed_precondition(format!(
                    "job {id} already ended ({from:?}); nothing to cancel"
                )));
            }
            let t = state::transition(
                &mut entry.job,
                JobState::Cancelled,
                "cancelled by a client",
                now,
            )
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
            fx.events.push(transition_event(&entry.job, t));
            fx.save.push(entry.job.clone());
            let job = entry.job.clone();
            for w in st.workers.values() {
                if w.job.as_ref().is_some_and(|(j, _)| j == id) {
                    let stop = v1::Stop {
                        job_id: id.to_string(),
                        reason: "cancelled".into(),
                    };
                    fx.send
                        .push((w.tx.clone(), msg(coordinator_message::Msg::Stop(stop))));
                }
            }
            job
        };
        tracing::info!(job = %id, "cancelled");
        self.apply(fx);
        Ok(job)
    }

    /// Fails a job and aborts its other ranks.
    fn fail(&self, st: &mut State, job_id: &str, reason: String, now: i64, fx: &mut Effects) {
        let Some(entry) = st.jobs.get_mut(job_id) else {
            return;
        };
        if state::is_final(entry.job.state()) {
            return;
        }
        entry.job.error = reason.clone();
        if let Ok(t) = state::transition(&mut entry.job, JobState::Failed, reason.clone(), now) {
            fx.events.push(transition_event(&entry.job, t));
        }
        fx.save.push(entry.job.clone());
        for w in st.workers.values() {
            if w.job.as_ref().is_some_and(|(j, _)| j == job_id) {
                let stop = v1::Stop {
                    job_id: job_id.into(),
                    reason: reason.clone(),
                };
                fx.send
                    .push((w.tx.clone(), msg(coordinator_message::Msg::Stop(stop))));
            }
        }
    }

    fn register(&self, hello: v1::WorkerHello, tx: Outbox) -> Result<u64, Status> {
        if hello.worker_id.is_empty() || hello.worker_id.len() > 128 {
            return Err(Status::invalid_argument("worker_id must be 1..=128 bytes"));
        }
        let now = now_ms();
        let mut fx = Effects::default();
        let conn = {
            let mut st = self.lock();
            st.next_conn += 1;
            let conn = st.next_conn;
            let id = hello.worker_id.clone();
            let claimed = (!hello.job_id.is_empty())
                .then(|| (hello.job_id.clone(), hello.generation, hello.rank));
            let old = st.workers.remove(&id);
            if let Some((job, rank)) = old.and_then(|o| o.job) {
                if claimed.as_ref().is_none_or(|(j, _, _)| *j != job) {
                    // The daemon restarted: whatever it held is gone.
                    self.begin_recovery(
                        &mut st,
                        &job,
                        vec![id.clone()],
                        format!("worker {id} (rank {rank}) re-attached without the job"),
                        now,
                        &mut fx,
                    );
                }
            }
            tracing::info!(worker = %id, data = %hello.data_addr, job = ?claimed, "worker attached");
            st.workers.insert(
                id.clone(),
                WorkerEntry {
                    hello,
                    tx: tx.clone(),
                    conn,
                    last_seen_ms: now,
                    job: None,
                },
            );
            if let Some((job, generation, rank)) = claimed {
                self.rejoin(&mut st, &id, &job, generation, rank, tx, now, &mut fx);
            }
            self.schedule(&mut st, now, &mut fx);
            conn
        };
        self.apply(fx);
        Ok(conn)
    }

    /// A worker attached while running `job` at `generation` (the
    /// coordinator restarted, or the stream broke and came back).
    #[allow(clippy::too_many_arguments)]
    fn rejoin(
        &self,
        st: &mut State,
        worker: &str,
        job: &str,
        generation: u64,
        rank: u32,
        tx: Outbox,
        now: i64,
        fx: &mut Effects,
    ) {
        let live = st
            .jobs
            .get(job)
            .filter(|e| !state::is_final(e.job.state()))
            .map(|e| (e.job.generation, e.job.workers.clone(), e.job.state()));
        let Some((current, members, job_state)) = live else {
            let stop = v1::Stop {
                job_id: job.into(),
                reason: "the job is no longer running".into(),
            };
            fx.send
                .push((tx, msg(coordinator_message::Msg::Stop(stop))));
            return;
        };
        if let Some(w) = st.workers.get_mut(worker) {
            w.job = Some((job.to_string(), rank));
        }
        let in_place = members.get(rank as usize).is_some_and(|m| m == worker);
        if generation == current && in_place && job_state != JobState::Recovering {
            tracing::info!(worker, job, generation, rank, "worker rejoined its job");
            return;
        }
        self.begin_recovery(
            st,
            job,
            Vec::new(),
            format!(
                "worker {worker} rejoined from generation {generation} (the job is at {current})"
            ),
            now,
            fx,
        );
    }

    /// A worker is gone (stream ended, lease expired, or heartbeat TTL
    /// passed): its job recovers without it.
    pub fn lost(&self, worker: &str, conn: Option<u64>, reason: &str) {
        let now = now_ms();
        let mut fx = Effects::default();
        {
            let mut st = self.lock();
            let matches = st
                .workers
                .get(worker)
                .is_some_and(|w| conn.is_none_or(|c| c == w.conn));
            if !matches {
                return;
            }
            let Some(w) = st.workers.remove(worker) else {
                return;
            };
            tracing::warn!(worker, reason, "worker lost");
            if let Some((job, rank)) = w.job {
                self.begin_recovery(
                    &mut st,
                    &job,
                    vec![worker.to_string()],
                    format!("lost worker {worker} (rank {rank}): {reason}"),
                    now,
                    &mut fx,
                );
            }
            self.schedule(&mut st, now, &mut fx);
        }
        self.apply(fx);
    }

    /// Expires workers whose heartbeats stopped, and moves recoveries on
    /// (timeouts, members that never re-attached after a restart).
    pub fn tick(&self, now: i64) {
        let seen: Vec<(String, i64)> = self
            .lock()
            .workers
            .iter()
            .map(|(id, w)| (id.clone(), w.last_seen_ms))
            .collect();
        for id in state::expired(now, &seen, self.cfg.heartbeat_ttl.as_millis() as i64) {
            self.lost(&id, None, "no heartbeat within the TTL");
        }
        let mut fx = Effects::default();
        {
            let mut st = self.lock();
            let overdue: Vec<(String, Vec<String>)> = st
                .jobs
                .values()
                .filter(|e| e.reattach_by.is_some_and(|t| now >= t))
                .map(|e| {
                    let missing = e
                        .job
                        .workers
                        .iter()
                        .filter(|w| {
                            st.workers
                                .get(*w)
                                .is_none_or(|x| x.job.as_ref().is_none_or(|(j, _)| *j != e.job.id))
                        })
                        .cloned()
                        .collect();
                    (e.job.id.clone(), missing)
                })
                .collect();
            for (job, missing) in overdue {
                if let Some(e) = st.jobs.get_mut(&job) {
                    e.reattach_by = None;
                }
                if !missing.is_empty() {
                    let reason = format!(
                        "{} did not re-attach after the coordinator restarted",
                        missing.join(", ")
                    );
                    self.begin_recovery(&mut st, &job, missing, reason, now, &mut fx);
                }
            }
            self.schedule(&mut st, now, &mut fx);
        }
        self.apply(fx);
    }

    /// Starts (or extends) the recovery of a running job: the window in
    /// flight is aborted on every surviving rank, then the ring re-forms
    /// as soon as `reform_decision` allows.
    fn begin_recovery(
        &self,
        st: &mut State,
        job_id: &str,
        lost: Vec<String>,
        reason: String,
        now: i64,
        fx: &mut Effects,
    ) {
        let Some(entry) = st.jobs.get_mut(job_id) else {
            return;
        };
        let from = entry.job.state();
        if !matches!(
            from,
            JobState::Rendezvous | JobState::Running | JobState::Recovering
        ) {
            return;
        }
        tracing::warn!(job = job_id, generation = entry.job.generation, %reason, "recovering");
        let open = entry
            .job
            .recoveries
            .last_mut()
            .filter(|r| r.generation == 0 && from == JobState::Recovering);
        match open {
            Some(r) => {
                r.lost.extend(lost);
                r.reason = format!("{}; {reason}", r.reason);
            }
            None => {
                entry.job.recoveries.push(v1::Recovery {
                    lost,
                    reason: reason.clone(),
                    started_unix_ms: now,
                    ..Default::default()
                });
                if let Ok(t) = state::transition(&mut entry.job, JobState::Recovering, reason, now)
                {
                    fx.events.push(transition_event(&entry.job, t));
                }
                entry.recovering_since = Some(now);
            }
        }
        fx.save.push(entry.job.clone());
        let generation = entry.job.generation;
        for w in st.workers.values() {
            if w.job.as_ref().is_some_and(|(j, _)| j == job_id) {
                let abort = v1::Abort {
                    job_id: job_id.into(),
                    generation,
                    reason: "re-forming the ring".into(),
                };
                fx.send
                    .push((w.tx.clone(), msg(coordinator_message::Msg::Abort(abort))));
            }
        }
    }

    /// Free workers (no job), in id order.
    fn free_workers(st: &State) -> Vec<String> {
        st.workers
            .iter()
            .filter(|(_, w)| w.job.is_none())
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Re-forms recovering jobs that can be, and grows elastic ones that
    /// idle workers can join (recovering jobs come before pending ones:
    /// they hold state).
    fn reform_jobs(&self, st: &mut State, now: i64, fx: &mut Effects) {
        let ids: Vec<String> = st.order.clone();
        for id in ids {
            let Some(entry) = st.jobs.get(&id) else {
                continue;
            };
            let state_now = entry.job.state();
            if state_now != JobState::Recovering && state_now != JobState::Running {
                continue;
            }
            let spec = entry.job.spec.clone().unwrap_or_default();
            let Ok(domain) = accrue_proto::spec_from_proto(&spec) else {
                continue;
            };
            let valid = |n: usize| domain.accumulation_steps(n as u64).is_ok();
            let members = entry.job.workers.clone();
            let survivors: Vec<String> = members
                .iter()
                .filter(|w| {
                    st.workers
                        .get(*w)
                        .is_some_and(|x| x.job.as_ref().is_some_and(|(j, _)| *j == id))
                })
                .cloned()
                .collect();
            let free = Self::free_workers(st);
            let max = domain
                .max_workers
                .unwrap_or(domain.workers)
                .max(domain.workers) as usize;
            let world = if state_now == JobState::Recovering {
                if entry.stalled >= MAX_STALLED_REFORMS {
                    let reason = format!(
                        "{} re-formations in a row without a committed step",
                        entry.stalled
                    );
                    self.fail(st, &id, reason, now, fx);
                    continue;
                }
                let want = (domain.workers as usize).max(survivors.len()).min(max);
                let min = domain.min_workers.unwrap_or(domain.workers) as usize;
                let waited = now - entry.recovering_since.unwrap_or(now);
                let timeout = (domain.comm.rendezvous_timeout_s * 1000.0) as i64;
                if entry.reattach_by.is_some() {
                    // Members may still come back after a restart.
                    continue;
                }
                match state::reform_decision(
                    survivors.len(),
                    free.len(),
                    want,
                    min,
                    waited,
                    timeout,
                    valid,
                ) {
                    state::Reform::Wait => continue,
                    state::Reform::Fail(reason) => {
                        let why = entry
                            .job
                            .recoveries
                            .last()
                            .map(|r| format!(" (recovering from: {})", r.reason))
                            .unwrap_or_default();
                        self.fail(st, &id, format!("{reason}{why}"), now, fx);
                        continue;
                    }
                    state::Reform::Form(n) => n,
                }
            } else {
                let pending = st.jobs.values().any(|e| e.job.state() == JobState::Pending);
                if pending || entry.reattach_by.is_some() || survivors.len() != members.len() {
                    continue;
                }
                match state::grow_decision(members.len(), free.len(), max, valid) {
                    Some(n) => n,
                    None => continue,
                }
            };
            let alive = |w: &str| survivors.iter().any(|s| s == w);
            let newcomers: Vec<String> = free
                .iter()
                .take(world.saturating_sub(survivors.len()))
                .cloned()
                .collect();
            let ranks = state::reform_ranks(&members, alive, &newcomers, world);
            self.form(st, &id, ranks, now, fx);
        }
    }

    /// Starts a new generation of `job_id` on `workers` (by rank).
    fn form(&self, st: &mut State, job_id: &str, workers: Vec<String>, now: i64, fx: &mut Effects) {
        let Some(entry) = st.jobs.get_mut(job_id) else {
            return;
        };
        let spec = entry.job.spec.clone().unwrap_or_default();
        let domain = match accrue_proto::spec_from_proto(&spec) {
            Ok(d) => d,
            Err(e) => {
                let reason = e.to_string();
                self.fail(st, job_id, reason, now, fx);
                return;
            }
        };
        let world = workers.len();
        let k = match domain.accumulation_steps(world as u64) {
            Ok(k) => k as u32,
            Err(e) => {
                let reason = format!("cannot run on {world} workers: {e}");
                self.fail(st, job_id, reason, now, fx);
                return;
            }
        };
        let first = entry.job.generation == 0;
        let growing = entry.job.state() == JobState::Running;
        let previous = entry.job.workers.clone();
        entry.job.generation += 1;
        entry.job.workers = workers.clone();
        entry.job.accumulation_steps = k;
        entry.secret = rand::random::<[u8; 32]>().to_vec();
        entry.recovering_since = None;
        let generation = entry.job.generation;
        let joined: Vec<String> = workers
            .iter()
            .filter(|w| !previous.contains(w))
            .cloned()
            .collect();
        let committed = entry.job.counters.as_ref().map_or(0, |c| c.step);
        let reason = if first {
            format!(
                "assigned to {} (generation {generation})",
                workers.join(", ")
            )
        } else {
            entry.stalled += 1;
            if growing {
                entry.job.recoveries.push(v1::Recovery {
                    reason: format!("growing: {} joined", joined.join(", ")),
                    started_unix_ms: now,
                    ..Default::default()
                });
                if let Ok(t) = state::transition(
                    &mut entry.job,
                    JobState::Recovering,
                    format!("growing to {world} workers"),
                    now,
                ) {
                    fx.events.push(transition_event(&entry.job, t));
                }
            }
            if let Some(r) = entry.job.recoveries.last_mut() {
                r.generation = generation;
                r.joined = joined.clone();
                r.reformed_unix_ms = now;
                r.world_size = world as u32;
                r.accumulation_steps = k;
            }
            format!(
                "re-formed on {} (generation {generation}, W = {world}, k = {k}, from step {committed})",
                workers.join(", ")
            )
        };
        if let Ok(t) = state::transition(&mut entry.job, JobState::Rendezvous, reason, now) {
            fx.events.push(transition_event(&entry.job, t));
        }
        let ckpt = domain
            .checkpoint
            .dir
            .clone()
            .unwrap_or_else(|| self.cfg.state_dir.join("checkpoints").join(job_id));
        let ckpt = std::path::absolute(&ckpt).unwrap_or(ckpt);
        let peers: Vec<String> = workers
            .iter()
            .map(|w| {
                st.workers
                    .get(w)
                    .map(|x| x.hello.data_addr.clone())
                    .unwrap_or_default()
            })
            .collect();
        let secret = entry.secret.clone();
        fx.save.push(entry.job.clone());
        for (rank, w) in workers.iter().enumerate() {
            let a = v1::Assignment {
                job_id: job_id.to_string(),
                spec: Some(spec.clone()),
                rank: rank as u32,
                world_size: world as u32,
                peers: peers.clone(),
                generation,
                secret: secret.clone(),
                accumulation_steps: k,
                resume_step: committed,
                checkpoint_dir: ckpt.display().to_string(),
            };
            if let Some(we) = st.workers.get_mut(w) {
                we.job = Some((job_id.to_string(), rank as u32));
                fx.send
                    .push((we.tx.clone(), msg(coordinator_message::Msg::Assign(a))));
            }
        }
    }

    fn on_message(&self, worker: &str, m: WorkerMessage) {
        let started = std::time::Instant::now();
        let now = now_ms();
        let mut fx = Effects::default();
        {
            let mut st = self.lock();
            let Some(w) = st.workers.get_mut(worker) else {
                return;
            };
            w.last_seen_ms = now;
            let tx = w.tx.clone();
            match m.msg {
                Some(worker_message::Msg::Step(r)) => {
                    self.on_step(&mut st, worker, tx, r, now, &mut fx)
                }
                Some(worker_message::Msg::Eval(e)) => {
                    if let Some(entry) = st.jobs.get_mut(&m.job_id) {
                        if entry.job.generation == m.generation {
                            entry.job.eval = Some(e);
                            fx.events.push(JobEvent {
                                job: Some(entry.job.clone()),
                                event: Some(v1::job_event::Event::Eval(e)),
                            });
                        }
                    }
                }
                Some(worker_message::Msg::Done(d)) => {
                    self.on_done(&mut st, worker, d, now, &mut fx)
                }
                Some(worker_message::Msg::Interrupted(i)) => {
                    let current = st.jobs.get(&i.job_id).is_some_and(|e| {
                        e.job.generation == i.generation
                            && matches!(e.job.state(), JobState::Rendezvous | JobState::Running)
                    });
                    if current {
                        let reason = format!(
                            "rank {} on worker {worker} interrupted at step {}: {}",
                            i.rank, i.step, i.error
                        );
                        self.begin_recovery(&mut st, &i.job_id, Vec::new(), reason, now, &mut fx);
                        self.schedule(&mut st, now, &mut fx);
                    }
                }
                _ => {}
            }
            let us = started.elapsed().as_micros() as u64;
            st.reports += 1;
            if st.latencies_us.len() < LATENCY_WINDOW {
                st.latencies_us.push(us);
            } else {
                let i = st.latency_next;
                st.latencies_us[i] = us;
            }
            st.latency_next = (st.latency_next + 1) % LATENCY_WINDOW;
        }
        self.apply(fx);
    }

    fn on_step(
        &self,
        st: &mut State,
        worker: &str,
        tx: Outbox,
        r: StepReport,
        now: i64,
        fx: &mut Effects,
    ) {
        let Some(entry) = st.jobs.get_mut(&r.job_id) else {
            let refused = v1::Refused {
                job_id: r.job_id.clone(),
                generation: r.generation,
                reason: "unknown job".into(),
            };
            fx.send
                .push((tx, msg(coordinator_message::Msg::Refused(refused))));
            return;
        };
        if r.generation != entry.job.generation || state::is_final(entry.job.state()) {
            let reason = format!(
                "report of generation {} ignored: job {} is at generation {} ({:?})",
                r.generation,
                r.job_id,
                entry.job.generation,
                entry.job.state()
            );
            tracing::warn!(worker, %reason, "stale report");
            let refused = v1::Refused {
                job_id: r.job_id.clone(),
                generation: r.generation,
                reason,
            };
            fx.send
                .push((tx, msg(coordinator_message::Msg::Refused(refused))));
            return;
        }
        if r.rank != 0 {
            return;
        }
        let c = entry.job.counters.get_or_insert_with(Default::default);
        c.step = r.step;
        c.total_steps = r.total_steps;
        c.micro_step = r.micro_step;
        c.window = r.step;
        c.epoch = r.epoch;
        c.samples_seen = r.samples_seen;
        c.skipped_steps += r.skipped as u64;
        c.loss = r.loss;
        c.grad_norm = r.grad_norm;
        c.clip_coef = r.clip_coef;
        c.lr = r.lr;
        c.samples_per_sec = r.samples_per_sec;
        c.timing = r.timing;
        c.bytes_sent = r.bytes_sent;
        entry.stalled = 0;
        if entry.job.state() == JobState::Rendezvous {
            if let Some(rec) = entry
                .job
                .recoveries
                .last_mut()
                .filter(|x| x.generation == r.generation && x.first_step_unix_ms == 0)
            {
                rec.first_step_unix_ms = now;
                rec.resumed_step = r.step.saturating_sub(1);
            }
            let reason = format!(
                "the ring of generation {} formed and step {} committed",
                r.generation, r.step
            );
            if let Ok(t) = state::transition(&mut entry.job, JobState::Running, reason, now) {
                fx.events.push(transition_event(&entry.job, t));
                fx.save.push(entry.job.clone());
                entry.saved_ms = now;
            }
        }
        fx.events.push(JobEvent {
            job: Some(entry.job.clone()),
            event: Some(v1::job_event::Event::Step(r)),
        });
        if now - entry.saved_ms >= 1000 {
            entry.saved_ms = now;
            fx.save.push(entry.job.clone());
        }
    }

    fn on_done(&self, st: &mut State, worker: &str, d: v1::JobDone, now: i64, fx: &mut Effects) {
        if let Some(w) = st.workers.get_mut(worker) {
            if w.job.as_ref().is_some_and(|(j, _)| *j == d.job_id) {
                w.job = None;
            }
        }
        let current = st
            .jobs
            .get(&d.job_id)
            .is_some_and(|e| e.job.generation == d.generation && !state::is_final(e.job.state()));
        if current {
            if !d.ok {
                let reason = format!("rank {} on worker {worker} failed: {}", d.rank, d.error);
                self.fail(st, &d.job_id, reason, now, fx);
            } else if d.rank == 0 {
                if let Some(entry) = st.jobs.get_mut(&d.job_id) {
                    entry.job.checkpoint = d.checkpoint.clone();
                    if d.eval.is_some() {
                        entry.job.eval = d.eval;
                    }
                    let c = entry.job.counters.get_or_insert_with(Default::default);
                    if d.total_steps > 0 && d.step >= c.step {
                        // Reports made while no coordinator listened can be
                        // lost with it; the rank's own end state is exact.
                        c.step = d.step;
                        c.window = d.step;
                        c.samples_seen = d.samples_seen;
                        c.total_steps = d.total_steps;
                        c.epoch = d.epoch;
                    }
                    let steps = entry.job.counters.as_ref().map_or(0, |c| c.step);
                    if let Ok(t) = state::transition(
                        &mut entry.job,
                        JobState::Succeeded,
                        format!("finished {steps} optimizer steps"),
                        now,
                    ) {
                        fx.events.push(transition_event(&entry.job, t));
                    }
                    fx.save.push(entry.job.clone());
                }
            }
        }
        self.schedule(st, now, fx);
    }

    /// Events of one job: a snapshot first, then every change, ending after
    /// a final state.
    pub fn watch(
        &self,
        id: &str,
    ) -> Result<impl Stream<Item = Result<JobEvent, Status>> + Send + 'static, Status> {
        let mut rx = self.events.subscribe();
        let snapshot = self
            .job(id)
            .ok_or_else(|| Status::not_found(format!("no job {id:?}")))?;
        let id = id.to_string();
        let done = state::is_final(snapshot.state());
        Ok(async_stream(move |tx| async move {
            let _ = tx
                .send(Ok(JobEvent {
                    job: Some(snapshot),
                    event: None,
                }))
                .await;
            if done {
                return;
            }
            loop {
                match rx.recv().await {
                    Ok(ev) => {
                        let Some(job) = &ev.job else { continue };
                        if job.id != id {
                            continue;
                        }
                        let last = state::is_final(job.state());
                        if tx.send(Ok(ev)).await.is_err() || last {
                            return;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        let _ = tx
                            .send(Err(Status::data_loss(format!(
                                "watcher fell {n} events behind"
                            ))))
                            .await;
                        return;
                    }
                    Err(_) => return,
                }
            }
        }))
    }
}

/// The event announcing that `job` just made transition `t`.
fn transition_event(job: &Job, t: v1::Transition) -> JobEvent {
    JobEvent {
        job: Some(job.clone()),
        event: Some(v1::job_event::Event::Transition(t)),
    }
}

/// A stream fed by a spawned task.
fn async_stream<T, F, Fut>(f: F) -> impl Stream<Item = T> + Send + 'static
where
    T: Send + 'static,
    F: FnOnce(mpsc::Sender<T>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(256);
    tokio::spawn(f(tx));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// gRPC JobService.
#[derive(Clone)]
pub struct JobApi(pub Arc<Coordinator>);

#[tonic::async_trait]
impl v1::job_service_server::JobService for JobApi {
    async fn submit_job(
        &self,
        req: Request<v1::SubmitJobRequest>,
    ) -> Result<Response<Job>, Status> {
        let spec = req
            .into_inner()
            .spec
            .ok_or_else(|| Status::invalid_argument("spec: (missing): required"))?;
        let job = self.0.submit(spec)?;
        // Acknowledged once it is durable: a coordinator that dies right
        // after never loses a job it said it took (with etcd away, the
        // answer waits until etcd is back).
        self.0.wait_durable().await;
        Ok(Response::new(job))
    }
    async fn get_job(&self, req: Request<v1::GetJobRequest>) -> Result<Response<Job>, Status> {
        let id = req.into_inner().id;
        self.0
            .job(&id)
            .map(Response::new)
            .ok_or_else(|| Status::not_found(format!("no job {id:?}")))
    }
    async fn list_jobs(
        &self,
        _: Request<v1::ListJobsRequest>,
    ) -> Result<Response<v1::ListJobsResponse>, Status> {
        Ok(Response::new(v1::ListJobsResponse {
            jobs: self.0.jobs(),
        }))
    }
    async fn cancel_job(
        &self,
        req: Request<v1::CancelJobRequest>,
    ) -> Result<Response<Job>, Status> {
        self.0.cancel(&req.into_inner().id).map(Response::new)
    }
    type WatchJobStream = BoxStream<JobEvent>;
    async fn watch_job(
        &self,
        req: Request<v1::WatchJobRequest>,
    ) -> Result<Response<Self::WatchJobStream>, Status> {
        let s = self.0.watch(&req.into_inner().id)?;
        Ok(Response::new(Box::pin(s)))
    }
}

/// gRPC WorkerService.
#[derive(Clone)]
pub struct WorkerApi(pub Arc<Coordinator>);

#[tonic::async_trait]
impl v1::worker_service_server::WorkerService for WorkerApi {
    type AttachStream = BoxStream<CoordinatorMessage>;
    async fn attach(
        &self,
        req: Request<Streaming<WorkerMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let mut inbound = req.into_inner();
        let first = inbound
            .next()
            .await
            .ok_or_else(|| Status::invalid_argument("empty Attach stream"))??;
        let Some(worker_message::Msg::Hello(hello)) = first.msg else {
            return Err(Status::invalid_argument(
                "the first Attach message must be a hello",
            ));
        };
        let id = hello.worker_id.clone();
        let (tx, rx) = mpsc::unbounded_channel();
        let conn = self.0.register(hello, tx)?;
        let coord = self.0.clone();
        tokio::spawn(async move {
            let reason = loop {
                match inbound.next().await {
                    Some(Ok(m)) => coord.on_message(&id, m),
                    Some(Err(e)) => break format!("stream error: {}", e.message()),
                    None => break "stream closed".to_string(),
                }
            };
            coord.lost(&id, Some(conn), &reason);
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
        )))
    }
}

/// JobService through the gate: the leader serves, a follower names it.
#[derive(Clone)]
pub struct GatedJobApi(pub Arc<crate::gate::Gate>);

#[tonic::async_trait]
impl v1::job_service_server::JobService for GatedJobApi {
    async fn submit_job(
        &self,
        req: Request<v1::SubmitJobRequest>,
    ) -> Result<Response<Job>, Status> {
        JobApi(self.0.get()?).submit_job(req).await
    }
    async fn get_job(&self, req: Request<v1::GetJobRequest>) -> Result<Response<Job>, Status> {
        JobApi(self.0.get()?).get_job(req).await
    }
    async fn list_jobs(
        &self,
        req: Request<v1::ListJobsRequest>,
    ) -> Result<Response<v1::ListJobsResponse>, Status> {
        JobApi(self.0.get()?).list_jobs(req).await
    }
    async fn cancel_job(
        &self,
        req: Request<v1::CancelJobRequest>,
    ) -> Result<Response<Job>, Status> {
        JobApi(self.0.get()?).cancel_job(req).await
    }
    type WatchJobStream = BoxStream<JobEvent>;
    async fn watch_job(
        &self,
        req: Request<v1::WatchJobRequest>,
    ) -> Result<Response<Self::WatchJobStream>, Status> {
        JobApi(self.0.get()?).watch_job(req).await
    }
}

/// WorkerService through the gate.
#[derive(Clone)]
pub struct GatedWorkerApi(pub Arc<crate::gate::Gate>);

#[tonic::async_trait]
impl v1::worker_service_server::WorkerService for GatedWorkerApi {
    type AttachStream = BoxStream<CoordinatorMessage>;
    async fn attach(
        &self,
        req: Request<Streaming<WorkerMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        WorkerApi(self.0.get()?).attach(req).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store that writes in the background and has not got far: jobs are
    /// kept in memory, durable only as far as the test advances `progress`
    /// (the etcd writer while etcd is slow or away).
    struct Behind {
        jobs: Mutex<BTreeMap<String, Job>>,
        progress: Arc<WriteProgress>,
    }

    impl JobStore for Behind {
        fn put(&self, job: &Job) -> Result<(), crate::store::StoreError> {
            let mut jobs = self.jobs.lock().unwrap();
            self.progress.issue();
            jobs.insert(job.id.clone(), job.clone());
            Ok(())
        }
        fn list(&self) -> Result<Vec<Job>, crate::store::StoreError> {
            Ok(self.jobs.lock().unwrap().values().cloned().collect())
        }
        fn progress(&self) -> Option<Arc<WriteProgress>> {
            Some(self.progress.clone())
        }
    }

    fn spec() -> v1::JobSpec {
        let text = r#"
name = "held"
workers = 2
max_steps = 6
[model]
kind = "mlp"
hidden = [8]
[data]
kind = "synthetic"
samples = 64
shape = [4]
classes = 2
batch_size = 4
[optimizer]
kind = "sgd"
lr = 0.1
"#;
        let s =
            accrue_common::JobSpec::from_toml_str(text, std::path::Path::new("t.toml")).unwrap();
        accrue_proto::spec_to_proto(&s)
    }

    type Inbox = mpsc::UnboundedReceiver<Result<CoordinatorMessage, Status>>;

    fn attach(c: &Coordinator, id: &str) -> Inbox {
        let (tx, rx) = mpsc::unbounded_channel();
        let hello = v1::WorkerHello {
            worker_id: id.into(),
            data_addr: format!("127.0.0.1:{}", 7000 + id.len()),
            ..Default::default()
        };
        c.register(hello, tx).unwrap();
        rx
    }

    fn assigned(rx: &mut Inbox) -> Option<v1::Assignment> {
        match rx.try_recv().ok()?.unwrap().msg {
            Some(coordinator_message::Msg::Assign(a)) => Some(a),
            other => panic!("expected an assignment, got {other:?}"),
        }
    }

    fn behind() -> (Arc<Coordinator>, Arc<WriteProgress>) {
        let progress = Arc::new(WriteProgress::default());
        let store = Behind {
            jobs: Mutex::default(),
            progress: progress.clone(),
        };
        (
            Coordinator::new(Config::default(), Box::new(store)).unwrap(),
            progress,
        )
    }

    #[test]
    fn assignments_wait_until_their_generation_is_durable() {
        let (c, progress) = behind();
        let (mut rx0, mut rx1) = (attach(&c, "w0"), attach(&c, "w1"));
        let job = c.submit(spec()).unwrap();
        // Formed in memory at once (submit saved Pending, the form saved
        // generation 1), but no worker hears of it yet.
        assert_eq!(job.state(), JobState::Rendezvous);
        assert_eq!(job.generation, 1);
        assert_eq!(progress.issued(), 2);
        assert_eq!(c.held_messages(), 2);
        assert!(assigned(&mut rx0).is_none() && assigned(&mut rx1).is_none());
        // Only the submission is durable: still held.
        progress.advance(1);
        assert!(assigned(&mut rx0).is_none() && assigned(&mut rx1).is_none());
        // The generation is durable: both ranks get it, nothing stays held.
        progress.advance(2);
        let a0 = assigned(&mut rx0).expect("rank 0 assigned");
        let a1 = assigned(&mut rx1).expect("rank 1 assigned");
        assert_eq!((a0.generation, a0.rank, a1.rank), (1, 0, 1));
        assert_eq!(c.held_messages(), 0);
    }

    #[test]
    fn a_message_without_a_write_keeps_its_place_behind_held_ones() {
        let (c, progress) = behind();
        let (mut rx0, _rx1) = (attach(&c, "w0"), attach(&c, "w1"));
        let job = c.submit(spec()).unwrap();
        // A report for a job this coordinator does not know: refused, with
        // no write of its own. It must not overtake the held assignment.
        c.on_message(
            "w0",
            WorkerMessage {
                msg: Some(worker_message::Msg::Step(StepReport {
                    job_id: "nope".into(),
                    ..Default::default()
                })),
                ..Default::default()
            },
        );
        assert!(rx0.try_recv().is_err());
        progress.advance(progress.issued());
        assert_eq!(assigned(&mut rx0).unwrap().job_id, job.id);
        match rx0.try_recv().unwrap().unwrap().msg {
            Some(coordinator_message::Msg::Refused(r)) => assert_eq!(r.job_id, "nope"),
            other => panic!("expected the refusal second, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_submission_waits_until_it_is_durable() {
        let (c, progress) = behind();
        c.submit(spec()).unwrap();
        let c2 = c.clone();
        let mut waiting = tokio::spawn(async move { c2.wait_durable().await });
        assert!(
            tokio::time::timeout(Duration::from_millis(100), &mut waiting)
                .await
                .is_err(),
            "returned before the write was durable"
        );
        progress.advance(progress.issued());
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("returns once durable")
            .unwrap();
    }

    #[test]
    fn the_final_counters_come_from_rank_0s_done() {
        let (c, progress) = behind();
        let (_rx0, _rx1) = (attach(&c, "w0"), attach(&c, "w1"));
        let job = c.submit(spec()).unwrap();
        progress.advance(progress.issued());
        // No step report reached this coordinator (lost with the previous
        // one, say); rank 0's end state is what the job shows.
        let done = |rank: u32| WorkerMessage {
            job_id: job.id.clone(),
            generation: 1,
            msg: Some(worker_message::Msg::Done(v1::JobDone {
                job_id: job.id.clone(),
                generation: 1,
                rank,
                ok: true,
                step: 6,
                samples_seen: 6 * 8 * 2,
                total_steps: 6,
                epoch: 1,
                ..Default::default()
            })),
        };
        c.on_message("w1", done(1));
        assert_eq!(c.job(&job.id).unwrap().state(), JobState::Rendezvous);
        c.on_message("w0", done(0));
        let end = c.job(&job.id).unwrap();
        assert_eq!(end.state(), JobState::Succeeded);
        let k = end.counters.unwrap();
        assert_eq!((k.step, k.total_steps, k.samples_seen), (6, 6, 96));
    }
}
