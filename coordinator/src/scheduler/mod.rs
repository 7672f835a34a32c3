//! Every decision of the coordinator, as one pure function:
//! [`Cluster::step`]`(input, now) -> effects`.
//!
//! Inputs are what happened (a worker attached or re-attached, sent a
//! report, finished, was lost or detached; a client submitted or cancelled
//! a job; time passed). Effects say what to do about it, naming worker ids
//! (with the connection they were decided for) and job versions, never
//! channels: send a message, write a job, close a connection, publish an
//! event, answer the caller. The async shell (`service/`) maps ids to
//! streams and the store, and does nothing else. Nothing here reads a clock,
//! a socket or a file, so every case is a unit or property test.
//!
//! Every job write carries a version bumped here, under the shell's lock,
//! so the store can refuse to replace a newer version with an older one.

use crate::domain::state_name;
pub use crate::domain::{Caller, RingKeys};
use crate::error::CoordError;
use crate::paging::seq_of;
use crate::state::{self, Waiting};
use accrue_common::JobSpec;
use accrue_proto::v1::{
    self, coordinator_message, worker_message, CoordinatorMessage, Counters, Job, JobEvent,
    JobState, StepReport, WorkerMessage,
};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

pub use access::{may_cancel, may_resume};
use held::held_spec;
pub use held::{parse_spec, HeldSpec};

mod access;
mod held;
mod membership;
#[cfg(test)]
mod records_tests;
mod recovery;
#[cfg(test)]
mod recovery_tests;
mod reports;
pub use reports::{coords_of, model_dims};
#[cfg(test)]
mod reports_tests;
#[cfg(test)]
mod resume_tests;
#[cfg(test)]
mod spec_tests;
#[cfg(test)]
mod tests;

/// Re-formations in a row without a committed step before a job fails.
pub const MAX_STALLED_REFORMS: u32 = 5;

/// How long a recovery waits for every surviving rank to confirm it left
/// the broken ring (its Interrupted report) before re-forming anyway.
pub const ACK_GRACE_MS: i64 = 10_000;

/// Longest accepted worker id, bytes.
pub const MAX_WORKER_ID: usize = 128;

/// The most bytes of a worker's text (an error, a reason, where its state
/// came from) that a job record keeps, and of a recovery's reasons
/// together: a job is listed, watched and stored whole, so nothing a
/// worker sends may grow it without bound (docs/OPERATIONS.md, "Listing
/// jobs, sizes and limits").
pub const MAX_REASON_BYTES: usize = 4096;

/// `text` cut to at most [`MAX_REASON_BYTES`] (at a character boundary),
/// ending with `… (N bytes)` when it was cut.
pub fn clip(text: &str) -> String {
    if text.len() <= MAX_REASON_BYTES {
        return text.to_string();
    }
    let note = format!("… ({} bytes)", text.len());
    let mut end = MAX_REASON_BYTES - note.len();
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{note}", &text[..end])
}

/// Which refused worker messages are worth a warning: the first of each
/// (job, generation); later ones are logged at debug level. A coordinator
/// restarted under a job that had ended got a report of every step its
/// ranks had buffered and warned about each (651 for one job; issue 28).
#[derive(Debug, Default)]
pub struct RefusalLog {
    /// Refusals so far by (job id, cut to [`MAX_REFUSAL_ID`] bytes,
    /// generation).
    seen: BTreeMap<(String, u64), u64>,
}

/// The most (job, generation) pairs a [`RefusalLog`] remembers: past it,
/// it forgets them all (each warns once more) rather than grow.
pub const MAX_REFUSAL_KEYS: usize = 4096;
/// The most bytes of a job id a [`RefusalLog`] keeps (a real id has at
/// most 84; a worker may send any).
pub const MAX_REFUSAL_ID: usize = 128;

impl RefusalLog {
    /// Notes one refused message about `job` at `generation`; returns how
    /// many of that pair there have been (1: the first, to warn about).
    pub fn note(&mut self, job: &str, generation: u64) -> u64 {
        let mut end = job.len().min(MAX_REFUSAL_ID);
        while !job.is_char_boundary(end) {
            end -= 1;
        }
        let key = (job[..end].to_string(), generation);
        if !self.seen.contains_key(&key) && self.seen.len() >= MAX_REFUSAL_KEYS {
            self.seen.clear();
        }
        let n = self.seen.entry(key).or_insert(0);
        *n += 1;
        *n
    }
}

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
    /// shell says its record is durable ([`Input::Admit`]). The spec was
    /// parsed and its fields checked at the edge ([`parse_spec`]).
    Submit {
        spec: Box<JobSpec>,
        /// The principal submitting (empty with authentication off): the
        /// job's owner.
        owner: String,
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
        by: Caller,
    },
    /// A client resumes a failed or cancelled job (issue 27). Like a
    /// submission, it is scheduled only once the shell says its record is
    /// durable ([`Input::Admit`]); [`Input::Withdraw`] puts the job back
    /// as it was.
    Resume {
        job: String,
        by: Caller,
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
    /// Write the job's training curve (beside the job, at most every
    /// [`SERIES_SAVE_MS`] while it runs, and once it ends).
    SaveSeries(v1::JobSeries),
    /// Remove the job's record.
    Delete(String),
    /// Close connection `conn` of `worker` (the worker is gone or replaced).
    Close { worker: String, conn: u64 },
    /// A job event for watchers (boxed: a step report is large).
    Event(Box<JobEvent>),
    /// The answer to a Submit, Cancel or Resume.
    Reply(Result<Job, CoordError>),
}

#[derive(Clone, Debug)]
pub struct Policy {
    /// A worker silent this long is lost.
    pub heartbeat_ttl_ms: i64,
    /// Checkpoints of jobs whose spec names no folder go under here.
    pub state_dir: PathBuf,
    /// A job whose estimated memory per worker is above this (bytes) is
    /// refused at submit (see `JobSpec::memory_estimate`).
    pub max_job_memory: u64,
    /// Spec paths must lie under these (absolute) roots; judged here
    /// lexically, the shell adds what this host's file system shows.
    pub roots: accrue_common::spec::Roots,
    /// The coordinator's working folder: a relative `checkpoint.dir`
    /// without a checkpoint root is judged against it (see
    /// [`crate::ownership::effective_dir`]).
    pub cwd: PathBuf,
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
    /// The device it trains on (its hello's).
    pub device: String,
    /// Its last step report in its current job: the step and its own
    /// share of the throughput (the window's samples/s over the world size).
    pub step: Option<(u64, f64)>,
    /// That report's time split (a pipeline stage's bubble among it).
    pub timing: Option<accrue_proto::v1::StepTiming>,
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
    /// The record as stored and shown: its `spec` is the wire form of
    /// [`JobEntry::spec`], written once from it.
    pub job: Job,
    /// The domain spec every decision reads.
    pub spec: HeldSpec,
    saved_ms: i64,
    /// Since when the job waits for workers to re-form (Recovering).
    recovering_since: Option<i64>,
    /// Re-formations since the last committed step.
    stalled: u32,
    /// Why the job last began (or extended) a recovery: a rank's error, a
    /// lost or detached worker. A job that stalls fails naming it.
    last_cause: String,
    /// Members that confirmed (Interrupted) they left the current
    /// generation's ring: a recovery re-forms once every survivor has.
    acked: std::collections::BTreeSet<String>,
    /// After a coordinator restart: members that have not re-attached by
    /// then are lost.
    reattach_by: Option<i64>,
    /// Its record is durable: it may be scheduled.
    admitted: bool,
    /// Its training curve, and when and at which version it was last
    /// written.
    series: v1::JobSeries,
    series_saved_ms: i64,
    series_saved: u64,
    /// The job as it was before a resume not yet admitted: what a
    /// withdrawal puts back.
    before_resume: Option<Job>,
    /// Each rank's peak resident memory in generation `.0` (its step
    /// reports; not stored).
    peaks: (u64, Vec<u64>),
}

impl JobEntry {
    fn new(job: Job, spec: HeldSpec, now: i64, admitted: bool) -> Self {
        Self {
            spec,
            saved_ms: now,
            recovering_since: None,
            stalled: 0,
            last_cause: String::new(),
            acked: Default::default(),
            reattach_by: None,
            admitted,
            series: crate::series::new(&job.id),
            series_saved_ms: now,
            series_saved: 0,
            before_resume: None,
            peaks: (0, Vec::new()),
            job,
        }
    }
}

/// The coordinator's whole state.
pub struct Cluster {
    cfg: Policy,
    jobs: BTreeMap<String, JobEntry>,
    /// Submission order.
    order: Vec<String>,
    workers: BTreeMap<String, WorkerEntry>,
    /// The next job id's sequence number.
    next_seq: u64,
    ring_keys: RingKeys,
    /// Refused worker messages, to warn once per job and generation.
    refusals: RefusalLog,
}

fn msg(m: coordinator_message::Msg) -> CoordinatorMessage {
    CoordinatorMessage { msg: Some(m) }
}

/// The event announcing that `job` just made transition `t`.
fn transition_event(job: &Job, t: v1::Transition) -> Effect {
    Effect::Event(Box::new(JobEvent {
        job: Some(job.clone()),
        event: Some(v1::job_event::Event::Transition(t)),
    }))
}

/// How often a running job's training curve is written, at most (ms): a
/// coordinator that takes over loses at most this much of it.
pub const SERIES_SAVE_MS: i64 = 5000;

/// Records a new version of the job to be written (and its training curve,
/// once it has ended).
fn save(entry: &mut JobEntry, fx: &mut Vec<Effect>) {
    entry.job.version += 1;
    fx.push(Effect::Save(entry.job.clone()));
    if state::is_final(entry.job.state()) {
        save_series(entry, entry.saved_ms, fx);
    }
}

/// Writes the job's training curve if it changed since it was last written.
fn save_series(entry: &mut JobEntry, now: i64, fx: &mut Vec<Effect>) {
    if entry.series.version != entry.series_saved {
        entry.series_saved = entry.series.version;
        entry.series_saved_ms = now;
        fx.push(Effect::SaveSeries(entry.series.clone()));
    }
}

impl Cluster {
    pub fn new(cfg: Policy, ring_keys: RingKeys) -> Self {
        Self {
            cfg,
            jobs: BTreeMap::new(),
            order: Vec::new(),
            workers: BTreeMap::new(),
            next_seq: 1,
            ring_keys,
            refusals: RefusalLog::default(),
        }
    }

    /// Takes back the jobs a store holds (a restarted coordinator). Jobs
    /// that were running keep their state: their workers keep training and
    /// re-attach naming the job; members that have not re-attached within
    /// the heartbeat TTL are lost and the job recovers without them.
    pub fn restore(&mut self, jobs: Vec<Job>, now: i64) {
        let grace = self.cfg.heartbeat_ttl_ms;
        for job in jobs {
            let spec = held_spec(&job);
            let mut e = JobEntry::new(job, spec, now, true);
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
        // Creation order (a store lists by key, where `a-10` comes before
        // `a-9`); every later submission has a higher number, so `order`
        // stays sorted by `paging::Key` (what listing pages rely on).
        self.order.sort_by_key(|id| crate::paging::Key::of(id));
        self.order.dedup();
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

    /// Job `id`'s domain spec (None: no such job, or a stored spec that
    /// did not read back).
    pub fn spec(&self, id: &str) -> Option<&JobSpec> {
        self.jobs.get(id).and_then(|e| e.spec.as_deref().ok())
    }

    /// One ListJobs page: the jobs after `req.after` in creation order, at
    /// most `req.size` of them and `budget` by `bytes` (see
    /// [`crate::paging::page`]), and the next page's token ("" at the end).
    pub fn jobs_page(
        &self,
        req: &crate::paging::PageRequest,
        bytes: impl Fn(&Job) -> usize,
        budget: usize,
    ) -> (Vec<&Job>, String) {
        let size = |id: &String| self.jobs.get(id).map_or(0, |e| bytes(&e.job));
        let (ids, next) = crate::paging::page(
            &self.order,
            |id| crate::paging::Key::of(id),
            req,
            size,
            budget,
        );
        let jobs = ids
            .iter()
            .filter_map(|id| self.jobs.get(id))
            .map(|e| &e.job)
            .collect();
        (jobs, next)
    }

    /// A job's training curve.
    pub fn series(&self, id: &str) -> Option<&v1::JobSeries> {
        self.jobs.get(id).map(|e| &e.series)
    }

    /// Takes back the training curves a store holds (after [`Cluster::restore`]).
    pub fn restore_series(&mut self, series: Vec<v1::JobSeries>) {
        for s in series {
            if let Some(e) = self.jobs.get_mut(&s.job_id) {
                e.series_saved = s.version;
                e.series = s;
            }
        }
    }

    /// Every attached worker, by id.
    pub fn workers(&self) -> impl Iterator<Item = (&String, &WorkerEntry)> {
        self.workers.iter()
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
            Input::Submit { spec, owner } => self.submit(spec, owner, now, &mut fx),
            Input::Admit { job } => {
                if let Some(e) = self.jobs.get_mut(&job) {
                    e.admitted = true;
                    e.before_resume = None;
                }
                self.schedule(now, &mut fx);
            }
            Input::Withdraw { job } => self.withdraw(&job, &mut fx),
            Input::Cancel { job, by } => self.cancel(&job, &by, now, &mut fx),
            Input::Resume { job, by } => self.resume(&job, &by, now, &mut fx),
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

    fn submit(&mut self, domain: Box<JobSpec>, owner: String, now: i64, fx: &mut Vec<Effect>) {
        let checked = domain
            .confined(&self.cfg.roots, &accrue_common::spec::Lexical)
            .and_then(|_| domain.check_memory(self.cfg.max_job_memory));
        if let Err(e) = checked {
            fx.push(Effect::Reply(Err(CoordError::InvalidArgument(
                e.to_string(),
            ))));
            return;
        }
        let id = format!("{}-{}", domain.name, self.next_seq);
        if let Err(e) = self.check_folder(&id, domain.checkpoint.dir.as_deref()) {
            fx.push(Effect::Reply(Err(e.into())));
            return;
        }
        self.next_seq += 1;
        let mut job = Job {
            id: id.clone(),
            spec: Some(accrue_proto::spec_to_proto(&domain)),
            created_unix_ms: now,
            counters: Some(Counters::default()),
            owner,
            ..Default::default()
        };
        match state::transition(&mut job, JobState::Pending, "submitted", now) {
            Ok(t) => fx.push(transition_event(&job, t)),
            Err(e) => {
                fx.push(Effect::Reply(Err(CoordError::Internal(e.to_string()))));
                return;
            }
        }
        let mut entry = JobEntry::new(job, Ok(Arc::from(domain)), now, false);
        save(&mut entry, fx);
        fx.push(Effect::Reply(Ok(entry.job.clone())));
        self.order.push(id.clone());
        self.jobs.insert(id, entry);
    }

    /// The effective checkpoint folder of job `id` whose spec names
    /// `dir` (see [`crate::ownership::effective_dir`]).
    pub fn checkpoint_folder(&self, id: &str, dir: Option<&std::path::Path>) -> PathBuf {
        crate::ownership::effective_dir(
            dir,
            id,
            &self.cfg.state_dir,
            self.cfg.roots.checkpoint.as_deref(),
            &self.cfg.cwd,
        )
    }

    /// One owner per checkpoint folder (see [`crate::ownership`]): the
    /// folder job `id` would use against every known job's.
    fn check_folder(
        &self,
        id: &str,
        dir: Option<&std::path::Path>,
    ) -> Result<(), crate::ownership::DirConflict> {
        use crate::ownership::{check, default_root, Claim, Folder};
        let known: Vec<Claim> = self
            .jobs()
            .map(|j| Claim {
                job: j.id.clone(),
                state: j.state(),
                dir: self.checkpoint_folder(
                    &j.id,
                    self.jobs
                        .get(&j.id)
                        .and_then(|e| e.spec.as_ref().ok())
                        .and_then(|s| s.checkpoint.dir.as_deref()),
                ),
            })
            .collect();
        let folder = Folder {
            dir: self.checkpoint_folder(id, dir),
            explicit: dir.is_some(),
        };
        check(
            &folder,
            &known,
            &default_root(&self.cfg.state_dir, &self.cfg.cwd),
        )
    }

    /// Takes back a submission, or a resume, whose record did not become
    /// durable: a new job is removed, a resumed one put back as it was.
    fn withdraw(&mut self, id: &str, fx: &mut Vec<Effect>) {
        let Some(entry) = self.jobs.get_mut(id).filter(|e| !e.admitted) else {
            return;
        };
        if let Some(mut before) = entry.before_resume.take() {
            before.version = entry.job.version;
            entry.job = before;
            entry.admitted = true;
            save(entry, fx);
            // Watchers that saw it pending see it ended again.
            fx.push(Effect::Event(Box::new(JobEvent {
                job: Some(entry.job.clone()),
                event: None,
            })));
            return;
        }
        self.jobs.remove(id);
        self.order.retain(|j| j != id);
        fx.push(Effect::Delete(id.to_string()));
    }

    /// Resumes a failed or cancelled job (see [`state::resume`]): pending
    /// again, waiting for admission (its record durable), then gang
    /// scheduled like any other; its next generation loads the newest
    /// checkpoint of its folder.
    fn resume(&mut self, id: &str, by: &Caller, now: i64, fx: &mut Vec<Effect>) {
        let Some(entry) = self.jobs.get_mut(id) else {
            fx.push(Effect::Reply(Err(CoordError::JobNotFound(id.into()))));
            return;
        };
        if let Err(e) = may_resume(id, &entry.job.owner, by) {
            fx.push(Effect::Reply(Err(e)));
            return;
        }
        let before = entry.job.clone();
        match state::resume(&mut entry.job, &by.who(), now) {
            Ok(t) => fx.push(transition_event(&entry.job, t)),
            Err(e) => {
                fx.push(Effect::Reply(Err(e.into())));
                return;
            }
        }
        entry.before_resume = Some(before);
        entry.admitted = false;
        entry.stalled = 0;
        entry.acked.clear();
        entry.recovering_since = None;
        entry.reattach_by = None;
        save(entry, fx);
        fx.push(Effect::Reply(Ok(entry.job.clone())));
        // Ranks of the ended generation that have not confirmed their stop
        // yet are members no more: busy until their JobDone, and told to
        // stop again (their late reports are refused).
        for (w, we) in self.workers.iter_mut().filter(|(_, w)| w.serves(id)) {
            we.job = None;
            we.step = None;
            we.draining = Some(id.to_string());
            fx.push(Effect::Send {
                worker: w.clone(),
                conn: we.conn,
                msg: msg(coordinator_message::Msg::Stop(v1::Stop {
                    job_id: id.into(),
                    reason: "the job ended; it was resumed as a new generation".into(),
                })),
            });
        }
    }

    fn cancel(&mut self, id: &str, by: &Caller, now: i64, fx: &mut Vec<Effect>) {
        let Some(entry) = self.jobs.get_mut(id) else {
            fx.push(Effect::Reply(Err(CoordError::JobNotFound(id.into()))));
            return;
        };
        if let Err(e) = may_cancel(id, &entry.job.owner, by) {
            fx.push(Effect::Reply(Err(e)));
            return;
        }
        let from = entry.job.state();
        if state::is_final(from) {
            fx.push(Effect::Reply(Err(CoordError::AlreadyEnded {
                job: id.into(),
                state: from,
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
}
