//! What the coordinator, the worker daemon and the CLI must agree on, in one
//! place: the etcd key layout, gRPC message size limits and the default
//! checkpoint folder.

use std::path::{Path, PathBuf};

/// Largest message a client or worker may send the coordinator (specs,
/// reports): the coordinator refuses bigger ones (gRPC OUT_OF_RANGE).
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

/// Largest message the coordinator sends (a job list, an assignment with its
/// spec): clients and daemons accept up to this.
pub const MAX_RESPONSE_BYTES: usize = 16 << 20;

/// The etcd key layout (DESIGN section 7): everything of one cluster lives
/// under `/accrue/<cluster>/`.
pub mod etcd {
    /// `/accrue/<cluster>/jobs/`: one key per job, its protobuf encoding.
    pub fn jobs_prefix(cluster: &str) -> String {
        format!("/accrue/{cluster}/jobs/")
    }
    pub fn job_key(cluster: &str, job_id: &str) -> String {
        format!("{}{job_id}", jobs_prefix(cluster))
    }
    /// `/accrue/<cluster>/series/`: each job's training curve
    /// (`JobSeries`), beside its record rather than inside it, so the
    /// frequent job writes stay small.
    pub fn series_prefix(cluster: &str) -> String {
        format!("/accrue/{cluster}/series/")
    }
    pub fn series_key(cluster: &str, job_id: &str) -> String {
        format!("{}{job_id}", series_prefix(cluster))
    }
    /// `/accrue/<cluster>/workers/`: one key per worker daemon, under the
    /// daemon's lease.
    pub fn workers_prefix(cluster: &str) -> String {
        format!("/accrue/{cluster}/workers/")
    }
    pub fn worker_key(cluster: &str, worker_id: &str) -> String {
        format!("{}{worker_id}", workers_prefix(cluster))
    }
    /// `/accrue/<cluster>/leader`: the leading coordinator's gRPC address,
    /// under its lease.
    pub fn leader_key(cluster: &str) -> String {
        format!("/accrue/{cluster}/leader")
    }
}

/// Where a job's checkpoints go when its spec names no `checkpoint.dir`:
/// `<state-dir>/checkpoints/<job-id>` (a job run without a coordinator,
/// `accrue-worker train`, has no id: its name stands in).
pub fn default_checkpoint_dir(state_dir: &Path, job_id: &str) -> PathBuf {
    state_dir.join("checkpoints").join(job_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_nest_under_the_cluster() {
        assert_eq!(etcd::job_key("c", "j-1"), "/accrue/c/jobs/j-1");
        assert!(etcd::job_key("c", "j-1").starts_with(&etcd::jobs_prefix("c")));
        assert_eq!(etcd::worker_key("c", "w0"), "/accrue/c/workers/w0");
        assert_eq!(etcd::leader_key("c"), "/accrue/c/leader");
        // A worker id never lands among the jobs, nor the leader key.
        assert!(!etcd::worker_key("c", "x").starts_with(&etcd::jobs_prefix("c")));
        assert!(!etcd::leader_key("c").starts_with(&etcd::workers_prefix("c")));
        assert_eq!(
            default_checkpoint_dir(Path::new("runs"), "j-1"),
            PathBuf::from("runs/checkpoints/j-1")
        );
    }
}
