//! Where jobs live: a trait, and the embedded default (redb under
//! `--state-dir`). Jobs are stored as their protobuf encoding.

use accrue_proto::v1::Job;
use prost::Message;
use redb::{Database, ReadableTable, TableDefinition};
use std::path::{Path, PathBuf};

const JOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("jobs");

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("job store {path}: {reason}")]
    Backend { path: PathBuf, reason: String },
}

pub trait JobStore: Send + Sync {
    fn put(&self, job: &Job) -> Result<(), StoreError>;
    fn list(&self) -> Result<Vec<Job>, StoreError>;
    /// Err (in words) while writes cannot reach the backend.
    fn health(&self) -> Result<(), String> {
        Ok(())
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
