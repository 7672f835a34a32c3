//! Every decision of the coordinator, as one pure function:
//! [`Cluster::step`]`(input, now) -> effects`.
//!
//! Inputs are what happened (a worker attached or re-attached, sent a
//! report, finished, was lost or detached; a client submitted or cancelled
//! a job; time passed). Effects say what to do about it, naming worker ids
//! (with the connection they were decided for) and job versions, never
//! channels: send a message, write a job, close a connection, publish an
//! event, answer the caller. The async shell (`service.rs`) maps ids to
//! streams and the store, and does nothing else. Nothing here reads a clock,
//! a socket or a file, so every case is a unit or property test.
//!
//! Every job write carries a version bumped here, under the shell's lock,
//! so the store can refuse to replace a newer version with an older one.

use crate::error::CoordError;
use crate::http::state_name;
use crate::state::{self, Waiting};
use accrue_proto::v1::{
    self, coordinator_message, worker_message, CoordinatorMessage, Counters, Job, JobEvent,
    JobState, StepReport, WorkerMessage,
};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Re-formations in a row without a committed step before a job fails.
pub const MAX_STALLED_REFORMS: u32 = 5;

/// How long a recovery waits for every surviving rank to confirm it left
/// the broken ring (its Interrupted report) before re-forming anyway.
pub const ACK_GRACE_MS: i64 = 10_000;

/// Longest accepted worker id, bytes.
pub const MAX_WORKER_ID: usize = 128;

/// What happened.
// Inputs are built and consumed at once, never stored: their size does not
// matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum Input {
    /// A worker opened connection `conn` with this hello (it names the job
    /// it is in the middle of, if any).
    Attach {
        conn: u64,
        hello: v1::WorkerHello,
    },
    /// A message on connection `conn` of `worker`.
    Message {
        worker: String,
        conn: u64,
        msg: WorkerMessage,
    },
    /// The connection broke, the heartbeat TTL passed or the etcd lease
    /// expired (`conn` None: whatever connection the worker has).
    Lost {
        worker: String,
        conn: Option<u64>,
        reason: String,
    },
    /// A client submits a job. It is recorded but not scheduled until the
    /// shell says its record is durable ([`Input::Admit`]).
    Submit {
        spec: v1::JobSpec,
    },
    /// The submitted job's record is durable: schedule it.
    Admit {
        job: String,
    },
    /// The submitted job's record could not be made durable in time: take
    /// it back (it never ran), so nothing half-created remains.
    Withdraw {
        job: String,
    },
    Cancel {
        job: String,
    },
    /// Time passed: expire silent workers, move recoveries on.
    Tick,
}

/// What to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Effect {
    /// Send `msg` on connection `conn` of `worker` (dropped if the worker
    /// has re-attached since, on another connection).
    Send {
        worker: String,
        conn: u64,
        msg: CoordinatorMessage,
    },
    /// Write this version of the job.
    Save(Job),
    /// Remove the job's record.
    Delete(String),
    /// Close connection `conn` of `worker` (the worker is gone or replaced).
    Close {
        worker: String,
        conn: u64,
    },
    Event(JobEvent),
    /// The answer to a Submit or Cancel.
    Reply(Result<Job, CoordError>),
}

#[derive(Clone, Debug)]
pub struct Config {
    /// A worker silent this long is lost.
    pub heartbeat_ttl_ms: i64,
    /// Checkpoints of jobs whose spec names no folder go under here.
    pub state_dir: PathBuf,
}

#[derive(Clone, Debug)]
pub struct WorkerEntry {
    pub data_addr: String,
    pub conn: u64,
    pub last_seen_ms: i64,
    /// The job and rank it serves.
    pub job: Option<(String, u32)>,
    /// A job it was told to stop while not a member of it: busy until its
    /// JobDone for that job arrives.
    pub draining: Option<String>,
}

impl WorkerEntry {
    fn free(&self) -> bool {
        self.job.is_none() && self.draining.is_none()
    }
    fn serves(&self, job: &str) -> bool {
        self.job.as_ref().is_some_and(|(j, _)| j == job)
    }
}

#[derive(Clone, Debug)]
pub struct JobEntry {
    pub job: Job,
    /// Data-plane secret of the current generation.
    pub secret: Vec<u8>,
    saved_ms: i64,
    /// Since when the job waits for workers to re-form (Recovering).
    recovering_since: Option<i64>,
    /// Re-formations since the last committed step.
    stalled: u32,
    /// Members that confirmed (Interrupted) they left the current
    /// generation's ring: a recovery re-forms once every survivor has.
    acked: std::collections::BTreeSet<String>,
    /// After a coordinator restart: members that have not re-attached by
    /// then are lost.
    reattach_by: Option<i64>,
    /// Its record is durable: it may be scheduled.
    admitted: bool,
}

impl JobEntry {
    fn new(job: Job, now: i64, admitted: bool) -> Self {
        Self {
            job,
            secret: Vec::new(),
            saved_ms: now,
            recovering_since: None,
            stalled: 0,
            acked: Default::default(),
            reattach_by: None,
            admitted,
        }
    }
}

/// Source of per-generation data-plane secrets (random in the service,
/// fixed in tests).
pub type Secrets = Box<dyn FnMut() -> Vec<u8> + Send>;

/// The coordinator's whole state.
pub struct Cluster {
    cfg: Config,
    jobs: BTreeMap<String, JobEntry>,
    /// Submission order.
    order: Vec<String>,
    workers: BTreeMap<String, WorkerEntry>,
    /// The next job id's sequence number.
    next_seq: u64,
    secrets: Secrets,
}

fn msg(m: coordinator_message::Msg) -> CoordinatorMessage {
    CoordinatorMessage { msg: Some(m) }
}

/// The event announcing that `job` just made transition `t`.
fn transition_event(job: &Job, t: v1::Transition) -> Effect {
    Effect::Event(JobEvent {
        job: Some(job.clone()),
        event: Some(v1::job_event::Event::Transition(t)),
    })
}

/// Records a new version of the job to be written.
fn save(entry: &mut JobEntry, fx: &mut Vec<Effect>) {
    entry.job.version += 1;
    fx.push(Effect::Save(entry.job.clone()));
}

/// The sequence number a job id ends with (`<name>-<n>`).
fn seq_of(id: &str) -> Option<u64> {
    id.rsplit('-').next().and_then(|n| n.parse().ok())
}

impl Cluster {
    pub fn new(cfg: Config, secrets: Secrets) -> Self {
        Self {
            cfg,
            jobs: BTreeMap::new(),
            order: Vec::new(),
            workers: BTreeMap::new(),
            next_seq: 1,
            secrets,
        }
    }

    /// Takes back the jobs a store holds (a restarted coordinator). Jobs
    /// that were running keep their state: their workers keep training and
    /// re-attach naming the job; members that have not re-attached within
    /// the heartbeat TTL are lost and the job recovers without them.
    pub fn restore(&mut self, jobs: Vec<Job>, now: i64) {
        let grace = self.cfg.heartbeat_ttl_ms;
        for job in jobs {
            let mut e = JobEntry::new(job, now, true);
            match e.job.state() {
                JobState::Rendezvous | JobState::Running => e.reattach_by = Some(now + grace),
                JobState::Recovering => {
                    e.reattach_by = Some(now + grace);
                    e.recovering_since = Some(now);
                }
                _ => {}
            }
            self.next_seq = self.next_seq.max(seq_of(&e.job.id).unwrap_or(0) + 1);
            self.order.push(e.job.id.clone());
            self.jobs.insert(e.job.id.clone(), e);
        }
    }

    pub fn jobs(&self) -> impl Iterator<Item = &Job> {
        self.order
            .iter()
            .filter_map(|id| self.jobs.get(id))
            .map(|e| &e.job)
    }

    pub fn job(&self, id: &str) -> Option<&Job> {
        self.jobs.get(id).map(|e| &e.job)
    }

    pub fn worker(&self, id: &str) -> Option<&WorkerEntry> {
        self.workers.get(id)
    }

    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    /// Decides what `input` means at time `now` (unix ms). Of several
    /// writes of one job, only the newest is kept.
    pub fn step(&mut self, input: Input, now: i64) -> Vec<Effect> {
        let mut fx = Vec::new();
        match input {
            Input::Attach { conn, hello } => self.attach(conn, hello, now, &mut fx),
            Input::Message { worker, conn, msg } => self.message(&worker, conn, msg, now, &mut fx),
            Input::Lost {
                worker,
                conn,
                reason,
            } => self.lost(&worker, conn, &reason, now, &mut fx),
            Input::Submit { spec } => self.submit(spec, now, &mut fx),
            Input::Admit { job } => {
                if let Some(e) = self.jobs.get_mut(&job) {
                    e.admitted = true;
                }
                self.schedule(now, &mut fx);
            }
            Input::Withdraw { job } => self.withdraw(&job, &mut fx),
            Input::Cancel { job } => self.cancel(&job, now, &mut fx),
            Input::Tick => self.tick(now, &mut fx),
        }
        // Only the newest version of each job needs writing.
        let mut newest: BTreeMap<String, u64> = BTreeMap::new();
        for e in &fx {
            if let Effect::Save(j) = e {
                let v = newest.entry(j.id.clone()).or_default();
                *v = (*v).max(j.version);
            }
        }
        fx.retain(|e| match e {
            Effect::Save(j) => newest.get(&j.id) == Some(&j.version),
            _ => true,
        });
        fx
    }

    fn submit(&mut self, spec: v1::JobSpec, now: i64, fx: &mut Vec<Effect>) {
        let domain = match accrue_proto::spec_from_proto(&spec) {
            Ok(d) => d,
            Err(e) => {
                fx.push(Effect::Reply(Err(CoordError::InvalidArgument(
                    e.to_string(),
                ))));
                return;
            }
        };
        let id = format!("{}-{}", domain.name, self.next_seq);
        self.next_seq += 1;
        let mut job = Job {
            id: id.clone(),
            spec: Some(accrue_proto::spec_to_proto(&domain)),
            created_unix_ms: now,
            counters: Some(Counters::default()),
            ..Default::default()
        };
        match state::transition(&mut job, JobState::Pending, "submitted", now) {
            Ok(t) => fx.push(transition_event(&job, t)),
            Err(e) => {
                fx.push(Effect::Reply(Err(CoordError::Internal(e.to_string()))));
                return;
            }
        }
        let mut entry = JobEntry::new(job, now, false);
        save(&mut entry, fx);
        fx.push(Effect::Reply(Ok(entry.job.clone())));
        self.order.push(id.clone());
        self.jobs.insert(id, entry);
    }

    fn withdraw(&mut self, id: &str, fx: &mut Vec<Effect>) {
        if self.jobs.get(id).is_some_and(|e| !e.admitted) {
            self.jobs.remove(id);
            self.order.retain(|j| j != id);
            fx.push(Effect::Delete(id.to_string()));
        }
    }

    fn cancel(&mut self, id: &str, now: i64, fx: &mut Vec<Effect>) {
        let Some(entry) = self.jobs.get_mut(id) else {
            fx.push(Effect::Reply(Err(CoordError::JobNotFound(id.into()))));
            return;
        };
        let from = entry.job.state();
        if state::is_final(from) {
            fx.push(Effect::Reply(Err(CoordError::AlreadyEnded {
                job: id.into(),
                state: state_name(from),
                action: "cancel",
            })));
            return;
        }
        match state::transition(
            &mut entry.job,
            JobState::Cancelled,
            "cancelled by a client",
            now,
        ) {
            Ok(t) => fx.push(transition_event(&entry.job, t)),
            Err(e) => {
                fx.push(Effect::Reply(Err(CoordError::Internal(e.to_string()))));
                return;
            }
        }
        save(entry, fx);
        fx.push(Effect::Reply(Ok(entry.job.clone())));
        self.stop_members(id, "cancelled", fx);
        self.schedule(now, fx);
    }

    /// Tells every worker serving `job` to stop it (each stays busy until
    /// its JobDone arrives).
    fn stop_members(&self, job: &str, reason: &str, fx: &mut Vec<Effect>) {
        for (id, w) in &self.workers {
            if w.serves(job) {
                fx.push(Effect::Send {
                    worker: id.clone(),
                    conn: w.conn,
                    msg: msg(coordinator_message::Msg::Stop(v1::Stop {
                        job_id: job.into(),
                        reason: reason.into(),
                    })),
                });
            }
        }
    }

    /// Fails a job and stops its ranks.
    fn fail(&mut self, job_id: &str, reason: String, now: i64, fx: &mut Vec<Effect>) {
        let Some(entry) = self.jobs.get_mut(job_id) else {
            return;
        };
        if state::is_final(entry.job.state()) {
            return;
        }
        entry.job.error = reason.clone();
        if let Ok(t) = state::transition(&mut entry.job, JobState::Failed, reason.clone(), now) {
            fx.push(transition_event(&entry.job, t));
        }
        save(entry, fx);
        self.stop_members(job_id, &reason, fx);
    }

    fn attach(&mut self, conn: u64, hello: v1::WorkerHello, now: i64, fx: &mut Vec<Effect>) {
        let id = hello.worker_id.clone();
        if id.is_empty() || id.len() > MAX_WORKER_ID {
            return fx.push(Effect::Reply(Err(CoordError::InvalidArgument(format!(
                "worker_id = {:?}: must be 1..={MAX_WORKER_ID} bytes",
                id.chars().take(16).collect::<String>()
            )))));
        }
        let claimed = (!hello.job_id.is_empty())
            .then(|| (hello.job_id.clone(), hello.generation, hello.rank));
        if let Some(old) = self.workers.remove(&id) {
            fx.push(Effect::Close {
                worker: id.clone(),
                conn: old.conn,
            });
            if let Some((job, rank)) = old.job {
                if claimed.as_ref().is_none_or(|(j, _, _)| *j != job) {
                    // The daemon restarted: whatever it held is gone.
                    self.begin_recovery(
                        &job,
                        vec![id.clone()],
                        format!("worker {id} (rank {rank}) re-attached without the job"),
                        now,
                        fx,
                    );
                }
            }
        }
        tracing::info!(worker = %id, data = %hello.data_addr, job = ?claimed, "worker attached");
        self.workers.insert(
            id.clone(),
            WorkerEntry {
                data_addr: hello.data_addr.clone(),
                conn,
                last_seen_ms: now,
                job: None,
                draining: None,
            },
        );
        if let Some((job, generation, rank)) = claimed {
            self.rejoin(&id, conn, &job, generation, rank, now, fx);
        }
        self.schedule(now, fx);
    }

    /// A worker attached while running `job` at `generation` (the
    /// coordinator restarted, or the stream broke and came back). Only a
    /// member of the job's current ring takes its place back; any other
    /// worker is told to stop the job and stays busy until it has.
    #[allow(clippy::too_many_arguments)]
    fn rejoin(
        &mut self,
        worker: &str,
        conn: u64,
        job: &str,
        generation: u64,
        rank: u32,
        now: i64,
        fx: &mut Vec<Effect>,
    ) {
        let live = self
            .jobs
            .get(job)
            .filter(|e| !state::is_final(e.job.state()))
            .map(|e| {
                (
                    e.job.generation,
                    e.job.workers.iter().position(|w| w == worker),
                    e.job.state(),
                )
            });
        let refuse = |reason: String, fx: &mut Vec<Effect>| {
            fx.push(Effect::Send {
                worker: worker.into(),
                conn,
                msg: msg(coordinator_message::Msg::Stop(v1::Stop {
                    job_id: job.into(),
                    reason,
                })),
            });
        };
        let (current, place, job_state) = match live {
            Some((g, Some(p), s)) => (g, p as u32, s),
            Some((g, None, _)) => {
                tracing::info!(
                    worker,
                    job,
                    generation,
                    "re-attached naming a job it is not a member of; stopping it there"
                );
                refuse(
                    format!("worker {worker} is not a member of generation {g} of job {job}"),
                    fx,
                );
                if let Some(w) = self.workers.get_mut(worker) {
                    w.draining = Some(job.into());
                }
                return;
            }
            None => {
                refuse("the job is no longer running".into(), fx);
                if let Some(w) = self.workers.get_mut(worker) {
                    w.draining = Some(job.into());
                }
                return;
            }
        };
        if let Some(w) = self.workers.get_mut(worker) {
            w.job = Some((job.to_string(), place));
        }
        if generation != current {
            // It is in no ring of the current generation.
            if let Some(e) = self.jobs.get_mut(job) {
                e.acked.insert(worker.to_string());
            }
        }
        if generation == current && place == rank && job_state != JobState::Recovering {
            tracing::info!(worker, job, generation, rank, "worker rejoined its job");
            return;
        }
        self.begin_recovery(
            job,
            Vec::new(),
            format!(
                "worker {worker} rejoined from generation {generation} (the job is at {current})"
            ),
            now,
            fx,
        );
    }

    /// A worker is gone (stream ended, lease expired, heartbeat TTL passed,
    /// or it detached): its job recovers without it.
    fn lost(
        &mut self,
        worker: &str,
        conn: Option<u64>,
        reason: &str,
        now: i64,
        fx: &mut Vec<Effect>,
    ) {
        self.remove_worker(worker, conn, reason, false, now, fx);
        self.schedule(now, fx);
    }

    fn remove_worker(
        &mut self,
        worker: &str,
        conn: Option<u64>,
        reason: &str,
        planned: bool,
        now: i64,
        fx: &mut Vec<Effect>,
    ) {
        let matches = self
            .workers
            .get(worker)
            .is_some_and(|w| conn.is_none_or(|c| c == w.conn));
        if !matches {
            return;
        }
        let Some(w) = self.workers.remove(worker) else {
            return;
        };
        if planned {
            tracing::info!(worker, reason, "worker detached");
        } else {
            tracing::warn!(worker, reason, "worker lost");
        }
        fx.push(Effect::Close {
            worker: worker.into(),
            conn: w.conn,
        });
        if let Some((job, rank)) = w.job {
            let what = if planned { "detached" } else { "lost worker" };
            let reason = if planned {
                format!("worker {worker} (rank {rank}) {what}: {reason}")
            } else {
                format!("{what} {worker} (rank {rank}): {reason}")
            };
            self.begin_recovery(&job, vec![worker.to_string()], reason, now, fx);
        }
    }

    fn tick(&mut self, now: i64, fx: &mut Vec<Effect>) {
        let ttl = self.cfg.heartbeat_ttl_ms;
        let seen: Vec<(String, i64)> = self
            .workers
            .iter()
            .map(|(id, w)| (id.clone(), w.last_seen_ms))
            .collect();
        for id in state::expired(now, &seen, ttl) {
            self.remove_worker(&id, None, "no heartbeat within the TTL", false, now, fx);
        }
        let overdue: Vec<(String, Vec<String>)> = self
            .jobs
            .values()
            .filter(|e| e.reattach_by.is_some_and(|t| now >= t))
            .map(|e| {
                let missing = e
                    .job
                    .workers
                    .iter()
                    .filter(|w| self.workers.get(*w).is_none_or(|x| !x.serves(&e.job.id)))
                    .cloned()
                    .collect();
                (e.job.id.clone(), missing)
            })
            .collect();
        for (job, missing) in overdue {
            if let Some(e) = self.jobs.get_mut(&job) {
                e.reattach_by = None;
            }
            if !missing.is_empty() {
                let reason = format!(
                    "{} did not re-attach after the coordinator restarted",
                    missing.join(", ")
                );
                self.begin_recovery(&job, missing, reason, now, fx);
            }
        }
        self.schedule(now, fx);
    }

    /// Starts (or extends) the recovery of a running job: the window in
    /// flight is aborted on every surviving rank, then the ring re-forms as
    /// soon as `reform_decision` allows.
    fn begin_recovery(
        &mut self,
        job_id: &str,
        lost: Vec<String>,
        reason: String,
        now: i64,
        fx: &mut Vec<Effect>,
    ) {
        let Some(entry) = self.jobs.get_mut(job_id) else {
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
                    fx.push(transition_event(&entry.job, t));
                }
                entry.recovering_since = Some(now);
            }
        }
        save(entry, fx);
        let generation = entry.job.generation;
        for (id, w) in &self.workers {
            if w.serves(job_id) {
                fx.push(Effect::Send {
                    worker: id.clone(),
                    conn: w.conn,
                    msg: msg(coordinator_message::Msg::Abort(v1::Abort {
                        job_id: job_id.into(),
                        generation,
                        reason: "re-forming the ring".into(),
                    })),
                });
            }
        }
    }

    /// Free workers (no job, nothing draining), in id order.
    fn free_workers(&self) -> Vec<String> {
        self.workers
            .iter()
            .filter(|(_, w)| w.free())
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Re-forms and grows running jobs, then places admitted pending jobs
    /// on free workers (gang, FIFO).
    fn schedule(&mut self, now: i64, fx: &mut Vec<Effect>) {
        self.reform_jobs(now, fx);
        let waiting: Vec<Waiting> = self
            .order
            .iter()
            .filter_map(|id| self.jobs.get(id))
            .filter(|e| e.admitted && e.job.state() == JobState::Pending)
            .map(|e| Waiting {
                job: e.job.id.clone(),
                world: e.job.spec.as_ref().map_or(1, |s| s.workers.max(1)) as usize,
            })
            .collect();
        let free = self.free_workers();
        for (job_id, workers) in state::gang_schedule(&waiting, &free) {
            self.form(&job_id, workers, now, fx);
        }
    }

    /// Re-forms recovering jobs that can be, and grows elastic ones that
    /// idle workers can join (recovering jobs come before pending ones:
    /// they hold state).
    fn reform_jobs(&mut self, now: i64, fx: &mut Vec<Effect>) {
        let ids: Vec<String> = self.order.clone();
        for id in ids {
            let Some(entry) = self.jobs.get(&id) else {
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
                .filter(|w| self.workers.get(*w).is_some_and(|x| x.serves(&id)))
                .cloned()
                .collect();
            let free = self.free_workers();
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
                    self.fail(&id, reason, now, fx);
                    continue;
                }
                if entry.reattach_by.is_some() {
                    // Members may still come back after a restart.
                    continue;
                }
                // A survivor still in the broken ring would not hear of the
                // new one (and a peer that died but is not known lost yet
                // would be taken in again): wait until each has confirmed,
                // or the grace has passed.
                let waited = now - entry.recovering_since.unwrap_or(now);
                if waited < ACK_GRACE_MS && survivors.iter().any(|w| !entry.acked.contains(w)) {
                    continue;
                }
                let want = (domain.workers as usize).max(survivors.len()).min(max);
                let min = domain.min_workers.unwrap_or(domain.workers) as usize;
                let timeout = (domain.comm.rendezvous_timeout_s * 1000.0) as i64;
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
                        self.fail(&id, format!("{reason}{why}"), now, fx);
                        continue;
                    }
                    state::Reform::Form(n) => n,
                }
            } else {
                let pending = self
                    .jobs
                    .values()
                    .any(|e| e.admitted && e.job.state() == JobState::Pending);
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
            self.form(&id, ranks, now, fx);
        }
    }

    /// Starts a new generation of `job_id` on `workers` (by rank).
    fn form(&mut self, job_id: &str, workers: Vec<String>, now: i64, fx: &mut Vec<Effect>) {
        let Some(entry) = self.jobs.get_mut(job_id) else {
            return;
        };
        let spec = entry.job.spec.clone().unwrap_or_default();
        let domain = match accrue_proto::spec_from_proto(&spec) {
            Ok(d) => d,
            Err(e) => return self.fail(job_id, e.to_string(), now, fx),
        };
        let world = workers.len();
        // k is decided here, once; the workers take the assignment's value.
        let k = match domain
            .accumulation_steps(world as u64)
            .map_err(|e| e.to_string())
            .and_then(|k| u32::try_from(k).map_err(|_| format!("k = {k} exceeds {}", u32::MAX)))
        {
            Ok(k) => k,
            Err(e) => {
                return self.fail(
                    job_id,
                    format!("cannot run on {world} workers: {e}"),
                    now,
                    fx,
                )
            }
        };
        let first = entry.job.generation == 0;
        let growing = entry.job.state() == JobState::Running;
        let previous = entry.job.workers.clone();
        entry.job.generation += 1;
        entry.job.workers = workers.clone();
        entry.job.accumulation_steps = k;
        entry.secret = (self.secrets)();
        entry.recovering_since = None;
        entry.acked.clear();
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
                    fx.push(transition_event(&entry.job, t));
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
            fx.push(transition_event(&entry.job, t));
        }
        let ckpt = domain.checkpoint.dir.clone().unwrap_or_else(|| {
            accrue_proto::layout::default_checkpoint_dir(&self.cfg.state_dir, job_id)
        });
        let peers: Vec<String> = workers
            .iter()
            .map(|w| {
                self.workers
                    .get(w)
                    .map(|x| x.data_addr.clone())
                    .unwrap_or_default()
            })
            .collect();
        let secret = entry.secret.clone();
        save(entry, fx);
        // Members of the previous generation left out of this one (a
        // shrink to a world that keeps k whole) stop the job and are free
        // once they have.
        for w in previous.iter().filter(|w| !workers.contains(w)) {
            if let Some(we) = self.workers.get_mut(w).filter(|x| x.serves(job_id)) {
                we.job = None;
                we.draining = Some(job_id.to_string());
                fx.push(Effect::Send {
                    worker: w.clone(),
                    conn: we.conn,
                    msg: msg(coordinator_message::Msg::Stop(v1::Stop {
                        job_id: job_id.into(),
                        reason: format!("not a member of generation {generation}"),
                    })),
                });
            }
        }
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
            if let Some(we) = self.workers.get_mut(w) {
                we.job = Some((job_id.to_string(), rank as u32));
                fx.push(Effect::Send {
                    worker: w.clone(),
                    conn: we.conn,
                    msg: msg(coordinator_message::Msg::Assign(a)),
                });
            }
        }
    }

    /// Whether `worker` holds `rank` in the current generation of `job`.
    fn member(&self, job: &str, generation: u64, rank: u32, worker: &str) -> bool {
        self.jobs.get(job).is_some_and(|e| {
            e.job.generation == generation
                && e.job
                    .workers
                    .get(rank as usize)
                    .is_some_and(|w| w == worker)
        })
    }

    fn refuse(
        &self,
        worker: &str,
        conn: u64,
        job: &str,
        generation: u64,
        reason: String,
        fx: &mut Vec<Effect>,
    ) {
        tracing::warn!(worker, %reason, "message refused");
        fx.push(Effect::Send {
            worker: worker.into(),
            conn,
            msg: msg(coordinator_message::Msg::Refused(v1::Refused {
                job_id: job.into(),
                generation,
                reason,
            })),
        });
    }

    /// Why a message about (`job`, `generation`, `rank`) from `worker` is
    /// not taken (None: it is): the job must exist, be live and be at that
    /// generation, and the worker must hold that rank in it.
    fn refusal(&self, worker: &str, job: &str, generation: u64, rank: u32) -> Option<String> {
        let Some(e) = self.jobs.get(job) else {
            return Some("unknown job".into());
        };
        if generation != e.job.generation || state::is_final(e.job.state()) {
            return Some(format!(
                "report of generation {generation} ignored: job {job} is at generation {} ({})",
                e.job.generation,
                state_name(e.job.state())
            ));
        }
        if !self.member(job, generation, rank, worker) {
            return Some(format!(
                "worker {worker} is not rank {rank} of job {job} generation {generation}"
            ));
        }
        None
    }

    fn message(
        &mut self,
        worker: &str,
        conn: u64,
        m: WorkerMessage,
        now: i64,
        fx: &mut Vec<Effect>,
    ) {
        let Some(w) = self.workers.get_mut(worker).filter(|w| w.conn == conn) else {
            // A connection that has been replaced or removed.
            return;
        };
        w.last_seen_ms = now;
        match m.msg {
            Some(worker_message::Msg::Step(r)) => self.on_step(worker, conn, r, now, fx),
            Some(worker_message::Msg::Eval(e)) => {
                let rank0 = self.member(&m.job_id, m.generation, 0, worker);
                if let Some(entry) = self.jobs.get_mut(&m.job_id).filter(|_| rank0) {
                    entry.job.eval = Some(e);
                    fx.push(Effect::Event(JobEvent {
                        job: Some(entry.job.clone()),
                        event: Some(v1::job_event::Event::Eval(e)),
                    }));
                }
            }
            Some(worker_message::Msg::Done(d)) => self.on_done(worker, conn, d, now, fx),
            Some(worker_message::Msg::Interrupted(i)) => {
                if self
                    .refusal(worker, &i.job_id, i.generation, i.rank)
                    .is_some()
                {
                    return;
                }
                let Some(e) = self.jobs.get_mut(&i.job_id) else {
                    return;
                };
                e.acked.insert(worker.to_string());
                if matches!(e.job.state(), JobState::Rendezvous | JobState::Running) {
                    let reason = format!(
                        "rank {} on worker {worker} interrupted at step {}: {}",
                        i.rank, i.step, i.error
                    );
                    self.begin_recovery(&i.job_id, Vec::new(), reason, now, fx);
                }
                self.schedule(now, fx);
            }
            Some(worker_message::Msg::Detach(d)) => {
                self.remove_worker(worker, Some(conn), &d.reason, true, now, fx);
                self.schedule(now, fx);
            }
            Some(worker_message::Msg::Hello(_))
            | Some(worker_message::Msg::Heartbeat(_))
            | None => {}
        }
    }

    fn on_step(&mut self, worker: &str, conn: u64, r: StepReport, now: i64, fx: &mut Vec<Effect>) {
        if let Some(reason) = self.refusal(worker, &r.job_id, r.generation, r.rank) {
            return self.refuse(worker, conn, &r.job_id, r.generation, reason, fx);
        }
        if r.rank != 0 {
            return;
        }
        let Some(entry) = self.jobs.get_mut(&r.job_id) else {
            return;
        };
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
                fx.push(transition_event(&entry.job, t));
                entry.saved_ms = now;
                save(entry, fx);
            }
        }
        fx.push(Effect::Event(JobEvent {
            job: Some(entry.job.clone()),
            event: Some(v1::job_event::Event::Step(r)),
        }));
        if now - entry.saved_ms >= 1000 {
            entry.saved_ms = now;
            save(entry, fx);
        }
    }

    fn on_done(&mut self, worker: &str, conn: u64, d: v1::JobDone, now: i64, fx: &mut Vec<Effect>) {
        // The worker is free again once its thread for the job has ended,
        // whatever the job's state.
        if let Some(w) = self.workers.get_mut(worker) {
            if w.serves(&d.job_id) {
                w.job = None;
            }
            if w.draining.as_deref() == Some(d.job_id.as_str()) {
                w.draining = None;
            }
        }
        let live = self
            .jobs
            .get(&d.job_id)
            .is_some_and(|e| !state::is_final(e.job.state()));
        match self.refusal(worker, &d.job_id, d.generation, d.rank) {
            Some(reason) if live => self.refuse(worker, conn, &d.job_id, d.generation, reason, fx),
            Some(_) => {}
            None if !d.ok => {
                let reason = format!("rank {} on worker {worker} failed: {}", d.rank, d.error);
                self.fail(&d.job_id, reason, now, fx);
            }
            None if d.rank == 0 => {
                if let Some(entry) = self.jobs.get_mut(&d.job_id) {
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
                        fx.push(transition_event(&entry.job, t));
                    }
                    save(entry, fx);
                }
            }
            None => {}
        }
        self.schedule(now, fx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TTL: i64 = 60_000;

    fn cluster() -> Cluster {
        Cluster::new(
            Config {
                heartbeat_ttl_ms: TTL,
                state_dir: "/state".into(),
            },
            Box::new(|| vec![7; 32]),
        )
    }

    fn spec(name: &str, workers: u32, extra: &str) -> v1::JobSpec {
        let text = format!(
            "name = \"{name}\"\nworkers = {workers}\nmax_steps = 6\n{extra}\n[model]\nkind = \"mlp\"\nhidden = [8]\n[data]\nkind = \"synthetic\"\nsamples = 64\nshape = [4]\nclasses = 2\nbatch_size = 4\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n"
        );
        let s =
            accrue_common::JobSpec::from_toml_str(&text, std::path::Path::new("t.toml")).unwrap();
        accrue_proto::spec_to_proto(&s)
    }

    fn hello(id: &str) -> v1::WorkerHello {
        v1::WorkerHello {
            worker_id: id.into(),
            data_addr: format!("{id}:7000"),
            ..Default::default()
        }
    }

    fn sends(fx: &[Effect]) -> Vec<(String, coordinator_message::Msg)> {
        fx.iter()
            .filter_map(|e| match e {
                Effect::Send { worker, msg, .. } => Some((worker.clone(), msg.msg.clone()?)),
                _ => None,
            })
            .collect()
    }

    fn aborts(fx: &[Effect]) -> usize {
        sends(fx)
            .iter()
            .filter(|(_, m)| matches!(m, coordinator_message::Msg::Abort(_)))
            .count()
    }

    fn reply(fx: &[Effect]) -> Result<Job, CoordError> {
        fx.iter()
            .find_map(|e| match e {
                Effect::Reply(r) => Some(r.clone()),
                _ => None,
            })
            .expect("a reply")
    }

    /// Submits and admits a job; returns its id.
    fn submit(c: &mut Cluster, s: v1::JobSpec, now: i64) -> String {
        let id = reply(&c.step(Input::Submit { spec: s }, now)).unwrap().id;
        c.step(Input::Admit { job: id.clone() }, now);
        id
    }

    fn m(msg: worker_message::Msg) -> WorkerMessage {
        WorkerMessage {
            msg: Some(msg),
            ..Default::default()
        }
    }

    fn step_report(job: &str, generation: u64, rank: u32, step: u64) -> WorkerMessage {
        m(worker_message::Msg::Step(StepReport {
            job_id: job.into(),
            generation,
            rank,
            step,
            total_steps: 6,
            ..Default::default()
        }))
    }

    fn done(job: &str, generation: u64, rank: u32, ok: bool) -> WorkerMessage {
        m(worker_message::Msg::Done(v1::JobDone {
            job_id: job.into(),
            generation,
            rank,
            ok,
            stopped: true,
            ..Default::default()
        }))
    }

    fn interrupted(job: &str, generation: u64, rank: u32) -> WorkerMessage {
        m(worker_message::Msg::Interrupted(v1::Interrupted {
            job_id: job.into(),
            generation,
            rank,
            error: "aborted".into(),
            ..Default::default()
        }))
    }

    /// A recovery re-forms once every survivor confirmed, or after the
    /// grace (a survivor that never answers cannot stall it).
    #[test]
    fn a_recovery_waits_for_the_survivors_to_leave_the_broken_ring() {
        let mut c = cluster();
        for (i, w) in ["w0", "w1", "w2", "w3"].iter().enumerate() {
            c.step(
                Input::Attach {
                    conn: i as u64 + 1,
                    hello: hello(w),
                },
                0,
            );
        }
        let job = submit(&mut c, spec("j", 3, ""), 0);
        // Rank 1 saw rank 2 vanish, before the coordinator did.
        deliver(&mut c, "w1", interrupted(&job, 1, 1), 10);
        assert_eq!(c.job(&job).unwrap().state(), JobState::Recovering);
        assert_eq!(
            c.job(&job).unwrap().generation,
            1,
            "w0 and w2 have not confirmed"
        );
        c.step(
            Input::Lost {
                worker: "w2".into(),
                conn: None,
                reason: "gone".into(),
            },
            20,
        );
        assert_eq!(c.job(&job).unwrap().generation, 1, "w0 has not confirmed");
        deliver(&mut c, "w0", interrupted(&job, 1, 0), 30);
        let j = c.job(&job).unwrap();
        assert_eq!(
            (j.generation, j.recoveries.len()),
            (2, 1),
            "one recovery, without the dead w2"
        );
        assert!(!j.workers.contains(&"w2".to_string()));
        assert_eq!(j.workers, ["w0", "w1", "w3"]);
        // A survivor that never confirms holds it only for the grace.
        deliver(&mut c, "w0", step_report(&job, 2, 0, 1), 40);
        c.step(
            Input::Lost {
                worker: "w3".into(),
                conn: None,
                reason: "gone".into(),
            },
            50,
        );
        c.step(
            Input::Attach {
                conn: 9,
                hello: hello("w4"),
            },
            60,
        );
        deliver(&mut c, "w0", interrupted(&job, 2, 0), 70);
        c.step(Input::Tick, 50 + ACK_GRACE_MS - 1);
        assert_eq!(c.job(&job).unwrap().generation, 2, "w1 has not confirmed");
        c.step(Input::Tick, 50 + ACK_GRACE_MS);
        let j = c.job(&job).unwrap();
        assert_eq!(
            (j.generation, j.workers.clone()),
            (3, vec!["w0".to_string(), "w1".into(), "w4".into()])
        );
    }

    fn conn_of(c: &Cluster, w: &str) -> u64 {
        c.worker(w).unwrap().conn
    }

    fn deliver(c: &mut Cluster, w: &str, msg: WorkerMessage, now: i64) -> Vec<Effect> {
        let conn = conn_of(c, w);
        c.step(
            Input::Message {
                worker: w.into(),
                conn,
                msg,
            },
            now,
        )
    }

    /// w0, w1 run job (generation 1); w1's stream breaks, w2 replaces it
    /// (generation 2). Returns the job id.
    fn replaced(c: &mut Cluster) -> String {
        for (i, w) in ["w0", "w1", "w2"].iter().enumerate() {
            c.step(
                Input::Attach {
                    conn: i as u64 + 1,
                    hello: hello(w),
                },
                0,
            );
        }
        let job = submit(c, spec("j", 2, ""), 0);
        assert_eq!(c.job(&job).unwrap().workers, ["w0", "w1"]);
        deliver(c, "w0", step_report(&job, 1, 0, 1), 10);
        c.step(
            Input::Lost {
                worker: "w1".into(),
                conn: Some(2),
                reason: "stream error: h2".into(),
            },
            20,
        );
        // Not before the survivor confirmed it left the broken ring.
        assert_eq!(c.job(&job).unwrap().generation, 1);
        deliver(c, "w0", interrupted(&job, 1, 0), 25);
        let j = c.job(&job).unwrap();
        assert_eq!(
            (j.generation, j.workers.clone()),
            (2, vec!["w0".to_string(), "w2".into()])
        );
        job
    }

    /// Defect 1: a worker whose stream blipped re-attaches naming a job it
    /// is no longer a member of. It must not abort the healthy generation,
    /// must be told to stop, and must be free once it has.
    #[test]
    fn a_stale_member_reattaching_is_stopped_and_freed_without_a_recovery() {
        let mut c = cluster();
        let job = replaced(&mut c);
        deliver(&mut c, "w0", step_report(&job, 2, 0, 2), 30);
        let fx = c.step(
            Input::Attach {
                conn: 9,
                hello: v1::WorkerHello {
                    job_id: job.clone(),
                    generation: 1,
                    rank: 1,
                    ..hello("w1")
                },
            },
            40,
        );
        let j = c.job(&job).unwrap();
        assert_eq!(
            j.state(),
            JobState::Running,
            "the healthy generation goes on"
        );
        assert_eq!(j.generation, 2);
        assert_eq!(aborts(&fx), 0, "no rank of generation 2 is aborted");
        let to_w1 = sends(&fx);
        assert!(
            matches!(&to_w1[..], [(w, coordinator_message::Msg::Stop(s))] if w == "w1" && s.job_id == job && s.reason.contains("not a member")),
            "{to_w1:?}"
        );
        assert!(
            !c.worker("w1").unwrap().free(),
            "busy until its thread ended"
        );
        // Its thread ends: the JobDone of a non-member frees it and changes
        // nothing else.
        let fx = deliver(&mut c, "w1", done(&job, 1, 1, true), 50);
        assert!(c.worker("w1").unwrap().free());
        assert_eq!(c.job(&job).unwrap().state(), JobState::Running);
        assert!(!fx.iter().any(|e| matches!(e, Effect::Save(_))));
        // And it can take the next job.
        let next = submit(&mut c, spec("k", 1, ""), 60);
        assert_eq!(c.job(&next).unwrap().workers, ["w1"]);
    }

    /// Defect 1, other half: a failed JobDone or a step report from the
    /// stale member must not touch the job.
    #[test]
    fn reports_from_outside_the_current_generation_are_refused() {
        let mut c = cluster();
        let job = replaced(&mut c);
        c.step(
            Input::Attach {
                conn: 9,
                hello: hello("w1"),
            },
            30,
        );
        // w1 claims rank 1 of generation 2 (w2's place).
        let fx = deliver(&mut c, "w1", step_report(&job, 2, 0, 5), 40);
        assert!(
            matches!(&sends(&fx)[..], [(_, coordinator_message::Msg::Refused(r))] if r.reason.contains("not rank 0"))
        );
        assert_eq!(c.job(&job).unwrap().counters.unwrap().step, 1);
        let fx = deliver(&mut c, "w1", done(&job, 2, 1, false), 50);
        assert!(matches!(
            &sends(&fx)[..],
            [(_, coordinator_message::Msg::Refused(_))]
        ));
        assert!(!state::is_final(c.job(&job).unwrap().state()));
        // The real rank 1 may.
        deliver(&mut c, "w2", done(&job, 2, 1, false), 60);
        assert_eq!(c.job(&job).unwrap().state(), JobState::Failed);
    }

    #[test]
    fn a_member_reattaching_in_place_keeps_its_generation() {
        let mut c = cluster();
        let job = replaced(&mut c);
        deliver(&mut c, "w0", step_report(&job, 2, 0, 2), 30);
        let fx = c.step(
            Input::Attach {
                conn: 9,
                hello: v1::WorkerHello {
                    job_id: job.clone(),
                    generation: 2,
                    rank: 1,
                    ..hello("w2")
                },
            },
            40,
        );
        assert_eq!(aborts(&fx), 0);
        // The old connection is closed, the new one serves.
        assert!(fx.contains(&Effect::Close {
            worker: "w2".into(),
            conn: 3
        }));
        assert_eq!(conn_of(&c, "w2"), 9);
        assert_eq!(c.job(&job).unwrap().generation, 2);
        assert!(c.worker("w2").unwrap().serves(&job));
    }

    /// Defect 7: a planned exit is not a loss (no warning), but a job the
    /// worker served still re-forms without it.
    #[test]
    fn a_detach_frees_the_worker_and_closes_its_stream() {
        let mut c = cluster();
        c.step(
            Input::Attach {
                conn: 1,
                hello: hello("w0"),
            },
            0,
        );
        let fx = deliver(
            &mut c,
            "w0",
            m(worker_message::Msg::Detach(v1::Detach {
                reason: "SIGTERM".into(),
            })),
            5,
        );
        assert!(c.worker("w0").is_none());
        assert_eq!(
            fx,
            vec![Effect::Close {
                worker: "w0".into(),
                conn: 1
            }]
        );
        let job = replaced(&mut c);
        deliver(
            &mut c,
            "w2",
            m(worker_message::Msg::Detach(v1::Detach {
                reason: "SIGTERM".into(),
            })),
            30,
        );
        let j = c.job(&job).unwrap();
        assert_eq!(j.state(), JobState::Recovering);
        assert!(j.recoveries.last().unwrap().reason.contains("detached"));
    }

    #[test]
    fn a_submission_waits_for_admission_and_can_be_taken_back() {
        let mut c = cluster();
        c.step(
            Input::Attach {
                conn: 1,
                hello: hello("w0"),
            },
            0,
        );
        let fx = c.step(
            Input::Submit {
                spec: spec("a", 1, ""),
            },
            1,
        );
        let job = reply(&fx).unwrap();
        assert_eq!(job.state(), JobState::Pending);
        assert!(sends(&fx).is_empty(), "not scheduled before it is durable");
        c.step(Input::Tick, 2);
        assert_eq!(c.job(&job.id).unwrap().state(), JobState::Pending);
        let fx = c.step(
            Input::Withdraw {
                job: job.id.clone(),
            },
            3,
        );
        assert_eq!(fx, vec![Effect::Delete(job.id.clone())]);
        assert!(c.job(&job.id).is_none());
        // Ids are never reused.
        let again = reply(&c.step(
            Input::Submit {
                spec: spec("a", 1, ""),
            },
            4,
        ))
        .unwrap();
        assert_ne!(again.id, job.id);
        let fx = c.step(
            Input::Admit {
                job: again.id.clone(),
            },
            5,
        );
        assert!(
            matches!(&sends(&fx)[..], [(w, coordinator_message::Msg::Assign(a))] if w == "w0" && a.accumulation_steps == 1)
        );
        // Withdrawing an admitted job does nothing.
        assert!(c
            .step(
                Input::Withdraw {
                    job: again.id.clone()
                },
                6
            )
            .is_empty());
    }

    #[test]
    fn bad_specs_and_worker_ids_are_refused_with_their_field() {
        let mut c = cluster();
        let mut s = spec("a", 1, "");
        s.data.as_mut().unwrap().batch_size = 0;
        let e = reply(&c.step(Input::Submit { spec: s }, 0)).unwrap_err();
        assert!(
            matches!(&e, CoordError::InvalidArgument(m) if m.contains("data.batch_size")),
            "{e}"
        );
        assert_eq!(c.jobs().count(), 0);
        let e = reply(&c.step(
            Input::Attach {
                conn: 1,
                hello: hello(""),
            },
            0,
        ))
        .unwrap_err();
        assert!(e.to_string().contains("worker_id"));
        assert_eq!(c.worker_count(), 0);
    }

    #[test]
    fn every_write_carries_a_newer_version_and_only_the_newest_is_kept() {
        let mut c = cluster();
        c.step(
            Input::Attach {
                conn: 1,
                hello: hello("w0"),
            },
            0,
        );
        let fx = c.step(
            Input::Submit {
                spec: spec("a", 1, ""),
            },
            0,
        );
        let id = reply(&fx).unwrap().id;
        // Admission forms the job: one Save (the newest of the step).
        let fx = c.step(Input::Admit { job: id.clone() }, 1);
        let saves: Vec<u64> = fx
            .iter()
            .filter_map(|e| match e {
                Effect::Save(j) => Some(j.version),
                _ => None,
            })
            .collect();
        assert_eq!(saves, [2]);
        let fx = c.step(Input::Cancel { job: id.clone() }, 2);
        assert!(fx
            .iter()
            .any(|e| matches!(e, Effect::Save(j) if j.version == 3)));
        assert_eq!(reply(&fx).unwrap().state(), JobState::Cancelled);
        let e = reply(&c.step(Input::Cancel { job: id.clone() }, 3)).unwrap_err();
        assert_eq!(e.grpc_code(), tonic::Code::FailedPrecondition);
    }

    #[test]
    fn restored_jobs_keep_their_place_and_ids_continue() {
        let mut c = cluster();
        let job = Job {
            id: "old-7".into(),
            state: JobState::Running as i32,
            generation: 3,
            workers: vec!["w0".into()],
            spec: Some(spec("old", 1, "")),
            version: 40,
            ..Default::default()
        };
        c.restore(vec![job], 0);
        // The member re-attaches in place: no recovery.
        let fx = c.step(
            Input::Attach {
                conn: 1,
                hello: v1::WorkerHello {
                    job_id: "old-7".into(),
                    generation: 3,
                    rank: 0,
                    ..hello("w0")
                },
            },
            10,
        );
        assert_eq!(aborts(&fx), 0);
        c.step(Input::Tick, TTL + 1);
        assert_eq!(c.job("old-7").unwrap().state(), JobState::Running);
        let next = reply(&c.step(
            Input::Submit {
                spec: spec("new", 1, ""),
            },
            20,
        ))
        .unwrap();
        assert_eq!(next.id, "new-8");
    }

    #[test]
    fn silent_workers_expire_after_the_ttl() {
        let mut c = cluster();
        c.step(
            Input::Attach {
                conn: 1,
                hello: hello("w0"),
            },
            0,
        );
        c.step(Input::Tick, TTL);
        assert!(c.worker("w0").is_some());
        let fx = c.step(Input::Tick, TTL + 1);
        assert!(c.worker("w0").is_none());
        assert!(fx.contains(&Effect::Close {
            worker: "w0".into(),
            conn: 1
        }));
    }

    /// Random histories: every invariant of the cluster holds after every
    /// input, and every job's versions only grow.
    #[derive(Clone, Debug)]
    enum Op {
        Attach(usize, bool),
        Lost(usize),
        Detach(usize),
        Submit(u32),
        Admit,
        Cancel(usize),
        Step(usize),
        Done(usize, bool),
        Interrupt(usize),
        Tick(i64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..4, any::<bool>()).prop_map(|(w, c)| Op::Attach(w, c)),
            (0usize..4).prop_map(Op::Lost),
            (0usize..4).prop_map(Op::Detach),
            (1u32..4).prop_map(Op::Submit),
            Just(Op::Admit),
            (0usize..4).prop_map(Op::Cancel),
            (0usize..4).prop_map(Op::Step),
            (0usize..4, any::<bool>()).prop_map(|(w, ok)| Op::Done(w, ok)),
            (0usize..4).prop_map(Op::Interrupt),
            (0i64..100_000).prop_map(Op::Tick),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn invariants_hold_over_random_histories(ops in proptest::collection::vec(op(), 1..60)) {
            let mut c = cluster();
            let mut now = 0i64;
            let mut conn = 0u64;
            let mut versions: BTreeMap<String, u64> = BTreeMap::new();
            let w = |i: usize| format!("w{i}");
            for o in ops {
                now += 100;
                let jobs: Vec<String> = c.jobs().map(|j| j.id.clone()).collect();
                let pick = |i: usize| jobs.get(i % jobs.len().max(1)).cloned().unwrap_or_default();
                let input = match o {
                    Op::Attach(i, claim) => {
                        conn += 1;
                        let served = c.worker(&w(i)).and_then(|x| x.job.clone());
                        let mut h = hello(&w(i));
                        if let (true, Some((j, r))) = (claim, served) {
                            h.job_id = j.clone();
                            h.rank = r;
                            h.generation = c.job(&j).map_or(0, |x| x.generation);
                        }
                        Input::Attach { conn, hello: h }
                    }
                    Op::Lost(i) => Input::Lost { worker: w(i), conn: None, reason: "gone".into() },
                    Op::Detach(i) | Op::Step(i) | Op::Done(i, _) | Op::Interrupt(i) if c.worker(&w(i)).is_none() => Input::Tick,
                    Op::Detach(i) => Input::Message { worker: w(i), conn: conn_of(&c, &w(i)), msg: m(worker_message::Msg::Detach(v1::Detach { reason: "bye".into() })) },
                    Op::Submit(n) => Input::Submit { spec: spec("p", n, "") },
                    Op::Admit => Input::Admit { job: pick(jobs.len().saturating_sub(1)) },
                    Op::Cancel(i) => Input::Cancel { job: pick(i) },
                    Op::Step(i) | Op::Done(i, _) | Op::Interrupt(i) => {
                        let x = c.worker(&w(i)).unwrap();
                        let Some((j, rank)) = x.job.clone() else { continue };
                        let g = c.job(&j).map_or(0, |x| x.generation);
                        let msg = match o {
                            Op::Step(_) => step_report(&j, g, rank, 1),
                            Op::Done(_, ok) => done(&j, g, rank, ok),
                            _ => m(worker_message::Msg::Interrupted(v1::Interrupted { job_id: j, generation: g, rank, ..Default::default() })),
                        };
                        Input::Message { worker: w(i), conn: x.conn, msg }
                    }
                    Op::Tick(dt) => { now += dt; Input::Tick }
                };
                let fx = c.step(input, now);
                for e in &fx {
                    match e {
                        Effect::Save(j) => {
                            let v = versions.entry(j.id.clone()).or_default();
                            prop_assert!(j.version > *v, "job {} went from version {} to {}", j.id, v, j.version);
                            *v = j.version;
                        }
                        Effect::Send { worker, conn, .. } => {
                            // To the worker's current connection (or to one
                            // removed later in the same step: dropped).
                            prop_assert!(c.worker(worker).is_none_or(|x| x.conn == *conn));
                        }
                        _ => {}
                    }
                }
                // No worker serves two ranks; every live member serves its job.
                let mut seen = BTreeMap::new();
                for j in c.jobs() {
                    if state::is_final(j.state()) || j.state() == JobState::Pending {
                        continue;
                    }
                    for (rank, m) in j.workers.iter().enumerate() {
                        if let Some(x) = c.worker(m) {
                            if x.serves(&j.id) {
                                prop_assert_eq!(x.job.as_ref().map(|(_, r)| *r as usize), Some(rank));
                                prop_assert!(seen.insert(m.clone(), j.id.clone()).is_none());
                            }
                        }
                    }
                }
                for id in ["w0", "w1", "w2", "w3"] {
                    if let Some(x) = c.worker(id) {
                        if let Some((j, _)) = &x.job {
                            let job = c.job(j).unwrap();
                            prop_assert!(job.workers.iter().any(|m| m == id), "{} serves {} without being a member", id, j);
                        }
                    }
                }
            }
        }
    }
}
