//! Where jobs live: a trait, and the embedded default (redb under
//! `--state-dir`). Jobs are stored as their protobuf encoding.
//!
//! Writes are ordered and never go backwards: the scheduler stamps every
//! version of a job under the coordinator's lock, `put` queues it in that
//! order, and a store never replaces a newer version with an older one
//! ([`supersedes`]). Both stores write on a thread of their own, so no
//! handler (and no async runtime thread) waits on a disk or on etcd;
//! [`WriteProgress`] tells how far the writes are durable.

use accrue_proto::v1::{Job, JobSeries};
use prost::Message;
use redb::{Database, ReadableTable, TableDefinition};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

const JOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("jobs");
/// Each job's training curve (`JobSeries`), by job id.
const SERIES: TableDefinition<&str, &[u8]> = TableDefinition::new("series");

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("job store {path}: {reason}")]
    Backend { path: PathBuf, reason: String },
    #[error("job store {path}: closed")]
    Closed { path: PathBuf },
}

/// Whether a job version `incoming` may replace the stored one (None:
/// nothing stored). Equal versions are the same write: nothing to do.
pub fn supersedes(stored: Option<u64>, incoming: u64) -> bool {
    stored.is_none_or(|s| incoming > s)
}

pub trait JobStore: Send + Sync {
    /// Queues the job's version for writing; returns its ticket (durable
    /// once `progress().durable()` reaches it).
    fn put(&self, job: &Job) -> Result<u64, StoreError>;
    /// Queues the removal of a job's record (a submission taken back).
    fn delete(&self, id: &str) -> Result<u64, StoreError>;
    /// The jobs stored when the store was opened, in submission order.
    fn list(&self) -> Result<Vec<Job>, StoreError>;
    /// Queues a job's training curve for writing (kept beside the job; a
    /// newer `version` replaces an older, never the reverse; removed with
    /// the job).
    fn put_series(&self, series: &JobSeries) -> Result<u64, StoreError>;
    /// The training curves stored when the store was opened.
    fn list_series(&self) -> Result<Vec<JobSeries>, StoreError>;
    /// Err (in words) while writes cannot reach the backend.
    fn health(&self) -> Result<(), String> {
        Ok(())
    }
    /// How far the queued writes are durable.
    fn progress(&self) -> Arc<WriteProgress>;
    /// Stops taking writes, writes what is queued (while the backend takes
    /// it) and releases the backend (redb's file lock).
    fn close(&self) {}
}

type Waker = Box<dyn Fn() + Send + Sync>;

/// Tickets of background writes: every `put` takes the next ticket, and
/// `durable` is the newest ticket up to which every write has reached the
/// backend. The coordinator holds its messages to workers until the writes
/// they follow from are durable, so no worker acts on a decision (a new
/// generation, above all) that a restarted coordinator would not know.
pub struct WriteProgress {
    issued: AtomicU64,
    /// The durable ticket; those who wait on it (a submission) subscribe.
    durable: tokio::sync::watch::Sender<u64>,
    waker: Mutex<Option<Waker>>,
}

impl Default for WriteProgress {
    fn default() -> Self {
        Self {
            issued: AtomicU64::new(0),
            durable: tokio::sync::watch::Sender::new(0),
            waker: Mutex::new(None),
        }
    }
}

impl WriteProgress {
    /// The next ticket. Take it in the order the writes are queued.
    pub fn issue(&self) -> u64 {
        self.issued.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// The newest ticket issued so far.
    pub fn issued(&self) -> u64 {
        self.issued.load(Ordering::SeqCst)
    }

    pub fn durable(&self) -> u64 {
        *self.durable.borrow()
    }

    /// Changes of the durable ticket.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.durable.subscribe()
    }

    /// Every write up to `ticket` is durable; wakes whoever waits.
    pub fn advance(&self, ticket: u64) {
        let moved = self.durable.send_if_modified(|d| {
            let newer = ticket > *d;
            *d = (*d).max(ticket);
            newer
        });
        if moved {
            if let Some(w) = self
                .waker
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
            {
                w();
            }
        }
    }

    /// Called (from the writer's thread) whenever `durable` moves on.
    pub fn set_waker(&self, w: Waker) {
        *self.waker.lock().unwrap_or_else(|p| p.into_inner()) = Some(w);
    }
}

/// One queued write: the newest version of a job, or its removal.
pub enum Write {
    Put(Box<Job>),
    Series(Box<JobSeries>),
    /// The job's record and its series.
    Delete(String),
}

impl Write {
    /// The job it is about.
    pub fn id(&self) -> &str {
        match self {
            Write::Put(j) => &j.id,
            Write::Series(s) => &s.job_id,
            Write::Delete(id) => id,
        }
    }
    /// What it replaces: a newer write of the same key makes it moot.
    pub fn key(&self) -> String {
        match self {
            Write::Series(s) => format!("series/{}", s.job_id),
            w => format!("job/{}", w.id()),
        }
    }
}

/// The queue between the coordinator and a store's writer thread: tickets
/// are taken under its lock, so they reach the writer in issue order.
pub struct WriteQueue {
    tx: Mutex<Option<mpsc::Sender<(u64, Write)>>>,
    progress: Arc<WriteProgress>,
    path: PathBuf,
    /// The writer thread, joined on close.
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl WriteQueue {
    pub fn new(path: PathBuf) -> (Self, mpsc::Receiver<(u64, Write)>) {
        let (tx, rx) = mpsc::channel();
        (
            Self {
                tx: Mutex::new(Some(tx)),
                progress: Arc::default(),
                path,
                writer: Mutex::new(None),
            },
            rx,
        )
    }

    /// The thread that drains this queue (joined on close).
    pub fn set_writer(&self, t: std::thread::JoinHandle<()>) {
        *self.writer.lock().unwrap_or_else(|p| p.into_inner()) = Some(t);
    }

    pub fn push(&self, w: Write) -> Result<u64, StoreError> {
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        let closed = || StoreError::Closed {
            path: self.path.clone(),
        };
        let tx = tx.as_ref().ok_or_else(closed)?;
        let ticket = self.progress.issue();
        tx.send((ticket, w)).map_err(|_| closed())?;
        Ok(ticket)
    }

    pub fn progress(&self) -> Arc<WriteProgress> {
        self.progress.clone()
    }

    /// No more writes: the writer drains what is queued (as far as its
    /// backend takes it) and ends; returns once it has.
    pub fn close(&self) {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
        let t = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = t {
            let _ = t.join();
        }
    }
}

pub struct RedbStore {
    queue: WriteQueue,
    at_open: Vec<Job>,
    series_at_open: Vec<JobSeries>,
    health: Arc<Mutex<Option<String>>>,
}

impl RedbStore {
    pub fn open(state_dir: &Path) -> Result<Self, StoreError> {
        let path = state_dir.join("coordinator.redb");
        let err = |reason: String| StoreError::Backend {
            path: path.clone(),
            reason,
        };
        std::fs::create_dir_all(state_dir).map_err(|e| err(e.to_string()))?;
        let db = Database::create(&path).map_err(|e| err(e.to_string()))?;
        let txn = db.begin_write().map_err(|e| err(e.to_string()))?;
        txn.open_table(JOBS).map_err(|e| err(e.to_string()))?;
        txn.open_table(SERIES).map_err(|e| err(e.to_string()))?;
        txn.commit().map_err(|e| err(e.to_string()))?;
        let at_open = read_all(&db).map_err(&err)?;
        let series_at_open = read_series(&db).map_err(err)?;
        let (queue, rx) = WriteQueue::new(path.clone());
        let health = Arc::new(Mutex::new(None));
        let (progress, h2) = (queue.progress(), health.clone());
        let thread = std::thread::Builder::new()
            .name("accrue-redb-writer".into())
            .spawn(move || redb_writer(db, rx, &progress, &h2))
            .map_err(|e| err(e.to_string()))?;
        queue.set_writer(thread);
        Ok(Self {
            queue,
            at_open,
            series_at_open,
            health,
        })
    }
}

fn read_all(db: &Database) -> Result<Vec<Job>, String> {
    let txn = db.begin_read().map_err(|e| e.to_string())?;
    let t = txn.open_table(JOBS).map_err(|e| e.to_string())?;
    let mut jobs = Vec::new();
    for row in t.iter().map_err(|e| e.to_string())? {
        let (k, v) = row.map_err(|e| e.to_string())?;
        jobs.push(Job::decode(v.value()).map_err(|e| format!("job {}: {e}", k.value()))?);
    }
    jobs.sort_by_key(|j| (j.created_unix_ms, j.id.clone()));
    Ok(jobs)
}

/// Applies a batch in one transaction, each write only if it supersedes
/// what is stored.
fn read_series(db: &Database) -> Result<Vec<JobSeries>, String> {
    let txn = db.begin_read().map_err(|e| e.to_string())?;
    let t = txn.open_table(SERIES).map_err(|e| e.to_string())?;
    let mut all = Vec::new();
    for row in t.iter().map_err(|e| e.to_string())? {
        let (k, v) = row.map_err(|e| e.to_string())?;
        all.push(JobSeries::decode(v.value()).map_err(|e| format!("series {}: {e}", k.value()))?);
    }
    Ok(all)
}

fn redb_apply(db: &Database, batch: &[(u64, Write)]) -> Result<(), String> {
    let txn = db.begin_write().map_err(|e| e.to_string())?;
    {
        let mut t = txn.open_table(JOBS).map_err(|e| e.to_string())?;
        let mut series = txn.open_table(SERIES).map_err(|e| e.to_string())?;
        for (_, w) in batch {
            match w {
                Write::Put(job) => {
                    let stored = t
                        .get(job.id.as_str())
                        .map_err(|e| e.to_string())?
                        .and_then(|v| Job::decode(v.value()).ok())
                        .map(|j| j.version);
                    if supersedes(stored, job.version) {
                        t.insert(job.id.as_str(), job.encode_to_vec().as_slice())
                            .map_err(|e| e.to_string())?;
                    }
                }
                Write::Series(s) => {
                    let stored = series
                        .get(s.job_id.as_str())
                        .map_err(|e| e.to_string())?
                        .and_then(|v| JobSeries::decode(v.value()).ok())
                        .map(|s| s.version);
                    if supersedes(stored, s.version) {
                        series
                            .insert(s.job_id.as_str(), s.encode_to_vec().as_slice())
                            .map_err(|e| e.to_string())?;
                    }
                }
                Write::Delete(id) => {
                    t.remove(id.as_str()).map_err(|e| e.to_string())?;
                    series.remove(id.as_str()).map_err(|e| e.to_string())?;
                }
            }
        }
    }
    txn.commit().map_err(|e| e.to_string())
}

fn redb_writer(
    db: Database,
    rx: mpsc::Receiver<(u64, Write)>,
    progress: &WriteProgress,
    health: &Mutex<Option<String>>,
) {
    while let Ok(first) = rx.recv() {
        let batch: Vec<(u64, Write)> = std::iter::once(first).chain(rx.try_iter()).collect();
        let last = batch.last().map_or(0, |(t, _)| *t);
        let mut backoff = Duration::from_millis(50);
        loop {
            match redb_apply(&db, &batch) {
                Ok(()) => {
                    health.lock().unwrap_or_else(|p| p.into_inner()).take();
                    progress.advance(last);
                    break;
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot write the job store; retrying");
                    *health.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
    }
}

impl JobStore for RedbStore {
    fn put(&self, job: &Job) -> Result<u64, StoreError> {
        self.queue.push(Write::Put(Box::new(job.clone())))
    }
    fn delete(&self, id: &str) -> Result<u64, StoreError> {
        self.queue.push(Write::Delete(id.to_string()))
    }
    fn list(&self) -> Result<Vec<Job>, StoreError> {
        Ok(self.at_open.clone())
    }
    fn put_series(&self, series: &JobSeries) -> Result<u64, StoreError> {
        self.queue.push(Write::Series(Box::new(series.clone())))
    }
    fn list_series(&self) -> Result<Vec<JobSeries>, StoreError> {
        Ok(self.series_at_open.clone())
    }
    fn health(&self) -> Result<(), String> {
        match self
            .health
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            None => Ok(()),
            Some(e) => Err(format!("cannot write the job store: {e}")),
        }
    }
    fn progress(&self) -> Arc<WriteProgress> {
        self.queue.progress()
    }
    fn close(&self) {
        self.queue.close();
    }
}

impl Drop for RedbStore {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn job(id: &str, created: i64, version: u64) -> Job {
        Job {
            id: id.into(),
            created_unix_ms: created,
            version,
            generation: version,
            ..Default::default()
        }
    }

    fn flushed(s: &RedbStore) {
        let p = s.progress();
        assert_eq!(p.durable(), p.issued(), "close drains the queue");
    }

    #[test]
    fn series_survive_reopening_newest_first_and_go_with_their_job() {
        let dir = tempfile::TempDir::new().unwrap();
        let series = |id: &str, version: u64| JobSeries {
            job_id: id.into(),
            version,
            width: version,
            ..Default::default()
        };
        {
            let s = RedbStore::open(dir.path()).unwrap();
            s.put(&job("a", 1, 1)).unwrap();
            s.put(&job("b", 2, 1)).unwrap();
            s.put_series(&series("a", 7)).unwrap();
            s.put_series(&series("a", 5)).unwrap();
            s.put_series(&series("b", 3)).unwrap();
            s.delete("b").unwrap();
            s.close();
            flushed(&s);
        }
        let s = RedbStore::open(dir.path()).unwrap();
        let all = s.list_series().unwrap();
        assert_eq!(all.len(), 1, "{all:?}");
        assert_eq!((all[0].job_id.as_str(), all[0].version), ("a", 7));
    }

    #[test]
    fn jobs_survive_reopening() {
        let dir = tempfile::TempDir::new().unwrap();
        {
            let s = RedbStore::open(dir.path()).unwrap();
            s.put(&job("b", 2, 1)).unwrap();
            s.put(&job("a", 1, 1)).unwrap();
            s.put(&job("a", 1, 3)).unwrap();
            s.put(&job("c", 3, 1)).unwrap();
            s.delete("c").unwrap();
            s.close();
            flushed(&s);
        }
        let s = RedbStore::open(dir.path()).unwrap();
        let jobs = s.list().unwrap();
        assert_eq!(
            jobs.iter().map(|j| j.id.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(jobs[0].generation, 3);
    }

    /// Defect: versions written out of order (threads reaching the store in
    /// another order than they decided) let an older version win.
    #[test]
    fn an_older_version_never_replaces_a_newer_one() {
        let dir = tempfile::TempDir::new().unwrap();
        {
            let s = RedbStore::open(dir.path()).unwrap();
            s.put(&job("a", 1, 5)).unwrap();
            s.put(&job("a", 1, 4)).unwrap();
            s.put(&job("a", 1, 2)).unwrap();
            s.close();
        }
        let s = RedbStore::open(dir.path()).unwrap();
        assert_eq!(s.list().unwrap()[0].version, 5);
        assert_eq!(s.list().unwrap()[0].generation, 5);
    }

    #[test]
    fn put_returns_at_once_and_the_write_becomes_durable() {
        let dir = tempfile::TempDir::new().unwrap();
        let s = RedbStore::open(dir.path()).unwrap();
        let p = s.progress();
        let mut rx = p.subscribe();
        let t = s.put(&job("a", 1, 1)).unwrap();
        assert_eq!(t, 1);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|d| *d >= t))
                .await
                .expect("durable within 10 s")
                .unwrap();
        });
        s.close();
        assert!(matches!(
            s.put(&job("a", 1, 2)),
            Err(StoreError::Closed { .. })
        ));
    }

    proptest! {
        /// Whatever order versions arrive in, what stays is the newest.
        #[test]
        fn the_newest_version_wins_in_any_order(order in Just((1u64..=12).collect::<Vec<_>>()).prop_shuffle()) {
            let mut stored: Option<u64> = None;
            for v in &order {
                if supersedes(stored, *v) {
                    stored = Some(*v);
                }
            }
            prop_assert_eq!(stored, Some(12));
        }
    }
}
