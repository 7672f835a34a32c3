//! Where jobs live: a trait, and the embedded default (redb under
//! `--state-dir`). Jobs are stored as their protobuf encoding.

use accrue_proto::v1::Job;
use prost::Message;
use redb::{Database, ReadableTable, TableDefinition};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

const JOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("jobs");

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("job store {path}: {reason}")]
    Backend { path: PathBuf, reason: String },
}

pub trait JobStore: Send + Sync {
    /// Records the newest version of a job. A store whose `put` returns
    /// before the write is durable says so through [`JobStore::progress`].
    fn put(&self, job: &Job) -> Result<(), StoreError>;
    fn list(&self) -> Result<Vec<Job>, StoreError>;
    /// Err (in words) while writes cannot reach the backend.
    fn health(&self) -> Result<(), String> {
        Ok(())
    }
    /// For a store that writes in the background: how far its writes are
    /// durable. None: every `put` is durable when it returns.
    fn progress(&self) -> Option<Arc<WriteProgress>> {
        None
    }
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

pub struct RedbStore {
    db: Database,
    path: PathBuf,
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
        txn.commit().map_err(|e| err(e.to_string()))?;
        Ok(Self { db, path })
    }

    fn err(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError::Backend {
            path: self.path.clone(),
            reason: e.to_string(),
        }
    }
}

impl JobStore for RedbStore {
    fn put(&self, job: &Job) -> Result<(), StoreError> {
        let txn = self.db.begin_write().map_err(|e| self.err(e))?;
        {
            let mut t = txn.open_table(JOBS).map_err(|e| self.err(e))?;
            t.insert(job.id.as_str(), job.encode_to_vec().as_slice())
                .map_err(|e| self.err(e))?;
        }
        txn.commit().map_err(|e| self.err(e))
    }

    fn list(&self) -> Result<Vec<Job>, StoreError> {
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        let t = txn.open_table(JOBS).map_err(|e| self.err(e))?;
        let mut jobs = Vec::new();
        for row in t.iter().map_err(|e| self.err(e))? {
            let (_, v) = row.map_err(|e| self.err(e))?;
            jobs.push(Job::decode(v.value()).map_err(|e| self.err(e))?);
        }
        jobs.sort_by_key(|j| (j.created_unix_ms, j.id.clone()));
        Ok(jobs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_survive_reopening() {
        let dir = tempfile::TempDir::new().unwrap();
        {
            let s = RedbStore::open(dir.path()).unwrap();
            s.put(&Job {
                id: "b".into(),
                created_unix_ms: 2,
                ..Default::default()
            })
            .unwrap();
            s.put(&Job {
                id: "a".into(),
                created_unix_ms: 1,
                ..Default::default()
            })
            .unwrap();
            s.put(&Job {
                id: "a".into(),
                created_unix_ms: 1,
                generation: 3,
                ..Default::default()
            })
            .unwrap();
        }
        let s = RedbStore::open(dir.path()).unwrap();
        let jobs = s.list().unwrap();
        assert_eq!(
            jobs.iter().map(|j| j.id.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(jobs[0].generation, 3);
    }
}
