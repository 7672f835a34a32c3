//! TensorBoard event files, one run per job (docs/OPERATIONS.md,
//! "TensorBoard"): `<dir>/<job-id>/events.out.tfevents.*`.
//!
//! The coordinator already sees every committed step and evaluation of
//! every job (the events it publishes to watchers, where the status page's
//! series takes its points); [`TensorBoard::observe`] turns them into
//! scalars ([`step_scalars`], [`eval_scalars`]) and hands them to a writer
//! thread through a bounded channel. Nothing on the decision path waits
//! for the file system: when the channel is full the points are dropped
//! and counted ([`TensorBoard::dropped`]). Write errors are logged once per
//! job and never touch the job.
//!
//! - The spec (as TOML, tag `spec`, at step 0) is written when a run file
//!   is opened: when the job starts running (its ring formed), at its
//!   first step or evaluation this coordinator sees, and again after a
//!   restart or a resume. A step event carries no spec
//!   ([`crate::domain::step_view`]): a job that this coordinator took
//!   over running gets its spec with its next evaluation, or when it next
//!   starts running.
//! - A rollback (recovery from a checkpoint) writes the redone steps again:
//!   TensorBoard keeps, per tag, the later value of a step (a new record
//!   at step s replaces the ones at steps >= s).
//! - A coordinator restart, a new leader or a resume starts a new file in
//!   the same run folder; TensorBoard merges the files of a folder.
//! - Files are flushed every second, when the job ends and when the
//!   coordinator stops.

pub mod events;

use accrue_proto::v1::{self, job_event, EvalResult, JobEvent, StepReport};
use events::EventFile;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Messages the channel to the writer holds before points are dropped.
pub const QUEUE: usize = 8192;
/// How often the writer flushes its open files.
pub const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// The text tag of the spec.
pub const SPEC_TAG: &str = "spec";

/// The scalars of a committed step: `skipped_total` is the job's count of
/// skipped steps so far (its counters', this report included). A language
/// model counts tokens where the others count samples.
pub fn step_scalars(r: &StepReport, lm: bool, skipped_total: u64) -> Vec<(&'static str, f64)> {
    let mut v = vec![
        ("train/loss", r.loss),
        ("train/grad_norm", r.grad_norm),
        ("train/clip_coef", r.clip_coef),
        ("train/lr", r.lr),
        (
            if lm {
                "train/tokens_per_sec"
            } else {
                "train/samples_per_sec"
            },
            r.samples_per_sec,
        ),
        ("train/skipped_steps", skipped_total as f64),
    ];
    if r.loss_scale > 0.0 {
        // fp16: GradScaler's scale.
        v.push(("train/loss_scale", r.loss_scale));
    }
    v
}

/// The scalars of an evaluation: its loss and accuracy (a language
/// model's: per target token, next-token accuracy) and, for a language
/// model, its perplexity exp(loss) when that is finite.
pub fn eval_scalars(e: &EvalResult, lm: bool) -> Vec<(&'static str, f64)> {
    let mut v = vec![("eval/loss", e.loss), ("eval/accuracy", e.accuracy)];
    if lm {
        if let Some(p) = crate::domain::perplexity(e.loss) {
            v.push(("eval/perplexity", p));
        }
    }
    v
}

/// The spec as the text plugin shows it: its TOML in a fenced code block
/// (the plugin renders Markdown). Err: the spec does not convert.
pub fn spec_text(spec: &v1::JobSpec) -> Result<String, String> {
    let domain = accrue_proto::spec_from_proto(spec).map_err(|e| e.to_string())?;
    let toml = toml::to_string(&domain).map_err(|e| e.to_string())?;
    Ok(format!("```toml\n{}\n```", toml.trim_end()))
}

/// The TOML inside [`spec_text`]'s fence (for readers of the files).
pub fn spec_toml(text: &str) -> &str {
    let t = text.strip_prefix("```toml\n").unwrap_or(text);
    t.strip_suffix("```").unwrap_or(t)
}

/// Job `id`'s run folder under `root` (None for an id that is not one
/// plain path component; the scheduler's ids always are).
pub fn run_dir(root: &Path, id: &str) -> Option<PathBuf> {
    let plain = !id.is_empty()
        && id != "."
        && id != ".."
        && !id.contains(['/', '\\', '\0'])
        && Path::new(id).components().count() == 1;
    plain.then(|| root.join(id))
}

/// What an event of the scheduler becomes.
#[derive(Debug, PartialEq)]
pub enum Point {
    /// Scalars of `job` at `step`.
    Scalars {
        job: String,
        step: u64,
        values: Vec<(&'static str, f64)>,
    },
    /// `job` reached a final state: its file is flushed and closed.
    End { job: String },
}

/// The point `ev` is, if any: a committed step or an evaluation, or a
/// job's final transition (pure).
pub fn point_of(ev: &JobEvent) -> Option<Point> {
    let job = ev.job.as_ref()?;
    let id = job.id.clone();
    match ev.event.as_ref()? {
        job_event::Event::Step(r) => {
            let skipped = job.counters.as_ref().map_or(0, |c| c.skipped_steps);
            // A step's job has no spec, only its unit.
            let lm = crate::domain::is_lm(job) || job.unit == "tokens";
            Some(Point::Scalars {
                job: id,
                step: r.step,
                values: step_scalars(r, lm, skipped),
            })
        }
        job_event::Event::Eval(e) => Some(Point::Scalars {
            job: id,
            step: e.step,
            values: eval_scalars(e, crate::domain::is_lm(job)),
        }),
        job_event::Event::Transition(t) => {
            crate::state::is_final(t.to()).then_some(Point::End { job: id })
        }
    }
}

/// What the writer thread is asked to do.
#[derive(Debug)]
pub enum Msg {
    /// Writes the spec's text at step 0.
    Spec {
        job: String,
        spec: Box<v1::JobSpec>,
        wall: f64,
    },
    Scalars {
        job: String,
        step: i64,
        wall: f64,
        values: Vec<(&'static str, f32)>,
    },
    /// Flushes and closes the job's file (the next point opens a new one).
    End { job: String },
}

fn wall_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The coordinator's TensorBoard writer: the sending half (cheap, never
/// blocks) and the thread that writes.
pub struct TensorBoard {
    dir: PathBuf,
    tx: Mutex<Option<SyncSender<Msg>>>,
    /// Jobs whose spec was sent since their file was last closed.
    seen: Mutex<HashSet<String>>,
    dropped: AtomicU64,
    /// Says when the thread has ended.
    ended: Mutex<Option<Receiver<()>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl TensorBoard {
    /// Starts the writer thread for run folders under `dir` (created when
    /// the first point comes).
    pub fn start(dir: PathBuf) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        let (ended_tx, ended) = mpsc::channel();
        let root = dir.clone();
        std::thread::Builder::new()
            .name("tensorboard".into())
            .spawn(move || {
                let mut w = Writers::new(root);
                w.run(rx);
                drop(ended_tx);
            })?;
        tracing::info!(dir = %dir.display(), "TensorBoard event files: one run folder per job");
        Ok(Self {
            dir,
            tx: Mutex::new(Some(tx)),
            seen: Mutex::default(),
            dropped: AtomicU64::new(0),
            ended: Mutex::new(Some(ended)),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Points dropped because the writer fell behind.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Takes a published event (never blocks: see the module's doc).
    pub fn observe(&self, ev: &JobEvent) {
        let wall = wall_now();
        // The transition the steps follow carries the whole job (a step's
        // job has no spec).
        if let (Some(j), Some(job_event::Event::Transition(t))) = (&ev.job, &ev.event) {
            if t.to() == v1::JobState::Running {
                self.spec_once(j, wall);
            }
        }
        let Some(p) = point_of(ev) else { return };
        match p {
            Point::Scalars { job, step, values } => {
                if let Some(j) = &ev.job {
                    self.spec_once(j, wall);
                }
                self.send(Msg::Scalars {
                    job,
                    step: step.min(i64::MAX as u64) as i64,
                    wall,
                    values: values.into_iter().map(|(t, v)| (t, v as f32)).collect(),
                });
            }
            Point::End { job } => {
                lock(&self.seen).remove(&job);
                self.send(Msg::End { job });
            }
        }
    }

    /// Queues the spec of `job` (when it carries one) unless it was sent
    /// since the job's file was last closed.
    fn spec_once(&self, job: &v1::Job, wall: f64) {
        if lock(&self.seen).contains(&job.id) {
            return;
        }
        if let Some(spec) = job.spec.clone() {
            let m = Msg::Spec {
                job: job.id.clone(),
                spec: Box::new(spec),
                wall,
            };
            if self.send(m) {
                lock(&self.seen).insert(job.id.clone());
            }
        }
    }

    /// Queues `m` unless the queue is full (then counts it as dropped).
    fn send(&self, m: Msg) -> bool {
        let tx = lock(&self.tx);
        let Some(tx) = tx.as_ref() else { return false };
        match tx.try_send(m) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
                if n.is_power_of_two() {
                    tracing::warn!(
                        dropped = n,
                        "the TensorBoard writer fell behind: points dropped"
                    );
                }
                false
            }
            Err(TrySendError::Disconnected(_)) => false,
        }
    }

    /// Stops taking points, lets the thread write and flush what is
    /// queued, and waits for it at most `limit`.
    pub fn close(&self, limit: Duration) {
        lock(&self.tx).take();
        if let Some(ended) = lock(&self.ended).take() {
            if let Err(RecvTimeoutError::Timeout) = ended.recv_timeout(limit) {
                tracing::warn!("the TensorBoard writer did not finish within {limit:?}");
            }
        }
    }
}

impl Drop for TensorBoard {
    fn drop(&mut self) {
        // The thread flushes and ends once the sender is gone.
        lock(&self.tx).take();
    }
}

/// One job's run: its open file, or why there is none.
enum Run {
    Open(EventFile),
    /// Opening or writing failed (logged); retried after the job's end.
    Broken,
}

/// The writer thread's state: an open file per job (pure of threads, so
/// tests drive it directly).
pub struct Writers {
    root: PathBuf,
    host: String,
    pid: u32,
    /// Files opened so far by this process (the name's last piece).
    opened: u64,
    runs: HashMap<String, Run>,
    /// Jobs an error was logged for.
    warned: HashSet<String>,
}

impl Writers {
    pub fn new(root: PathBuf) -> Self {
        Self {
            root,
            host: events::host_name(),
            pid: std::process::id(),
            opened: 0,
            runs: HashMap::new(),
            warned: HashSet::new(),
        }
    }

    /// Takes messages until every sender is gone, flushing every
    /// [`FLUSH_EVERY`]; flushes all at the end.
    pub fn run(&mut self, rx: Receiver<Msg>) {
        let mut flushed = Instant::now();
        loop {
            let wait = FLUSH_EVERY.saturating_sub(flushed.elapsed());
            match rx.recv_timeout(wait) {
                Ok(m) => self.apply(m),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            if flushed.elapsed() >= FLUSH_EVERY {
                self.flush_all();
                flushed = Instant::now();
            }
        }
        self.flush_all();
    }

    pub fn apply(&mut self, m: Msg) {
        match m {
            Msg::Spec { job, spec, wall } => {
                let text = match spec_text(&spec) {
                    Ok(t) => t,
                    Err(e) => format!("(the spec does not convert to TOML: {e})"),
                };
                let ev = events::text_event(wall, 0, SPEC_TAG, &text);
                self.write(&job, wall, &ev);
            }
            Msg::Scalars {
                job,
                step,
                wall,
                values,
            } => {
                let ev = events::scalars_event(wall, step, &values);
                self.write(&job, wall, &ev);
            }
            Msg::End { job } => {
                if let Some(Run::Open(mut f)) = self.runs.remove(&job) {
                    if let Err(e) = f.flush() {
                        self.warn(&job, f.path(), &e);
                    }
                }
            }
        }
    }

    /// Writes `ev` to `job`'s file, opening one first if need be.
    fn write(&mut self, job: &str, wall: f64, ev: &events::Event) {
        if !self.runs.contains_key(job) {
            let run = match self.open(job, wall) {
                Ok(f) => Run::Open(f),
                Err((path, e)) => {
                    self.warn(job, &path, &e);
                    Run::Broken
                }
            };
            self.runs.insert(job.to_string(), run);
        }
        let Some(Run::Open(f)) = self.runs.get_mut(job) else {
            return;
        };
        if let Err(e) = f.write(ev) {
            let path = f.path().to_path_buf();
            self.runs.insert(job.to_string(), Run::Broken);
            self.warn(job, &path, &e);
        }
    }

    fn open(&mut self, job: &str, wall: f64) -> Result<EventFile, (PathBuf, std::io::Error)> {
        let Some(dir) = run_dir(&self.root, job) else {
            let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a folder name");
            return Err((self.root.clone(), e));
        };
        let secs = wall.max(0.0) as u64;
        // A name taken (by another process of the same pid) is skipped.
        for _ in 0..8 {
            let name = events::file_name(secs, &self.host, self.pid, self.opened);
            self.opened += 1;
            match EventFile::create(&dir, &name, wall) {
                Ok(f) => return Ok(f),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err((dir.join(name), e)),
            }
        }
        let e = std::io::Error::new(std::io::ErrorKind::AlreadyExists, "no free file name");
        Err((dir, e))
    }

    fn warn(&mut self, job: &str, path: &Path, e: &std::io::Error) {
        if self.warned.insert(job.to_string()) {
            tracing::warn!(job, file = %path.display(), error = %e, "cannot write the job's TensorBoard events (the job is not affected; further errors for it are not logged)");
        }
    }

    /// Flushes every open file (a file that fails is given up).
    pub fn flush_all(&mut self) {
        let mut failed = Vec::new();
        for (job, run) in &mut self.runs {
            if let Run::Open(f) = run {
                if let Err(e) = f.flush() {
                    failed.push((job.clone(), f.path().to_path_buf(), e));
                }
            }
        }
        for (job, path, e) in failed {
            self.runs.insert(job.clone(), Run::Broken);
            self.warn(&job, &path, &e);
        }
    }

    /// The path of `job`'s open file.
    pub fn file_of(&self, job: &str) -> Option<&Path> {
        match self.runs.get(job)? {
            Run::Open(f) => Some(f.path()),
            Run::Broken => None,
        }
    }
}

#[cfg(test)]
mod tests;
