//! What the coordinator, the worker daemon and the CLI must agree on, in one
//! place: the etcd key layout, gRPC message size limits and the default
//! checkpoint folder.

use std::path::{Path, PathBuf};

/// Largest message a client or worker may send the coordinator (specs,
/// reports): the coordinator refuses bigger ones (gRPC OUT_OF_RANGE). A
/// maximal spec (five 4 KiB paths, see `accrue_common::spec`) is about
/// 21 KiB.
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

/// The gRPC metadata key a follower coordinator sets on its UNAVAILABLE
/// answer: the leader's address (`host:port`), when one is elected. Clients
/// may redirect to it; over HTTP the same address travels in the JSON
/// body's `leader` field.
pub const LEADER_HEADER: &str = "x-accrue-leader";

/// What every standard gRPC client accepts by default (grpc-core, grpcio,
/// grpc-java, grpc-go and tonic: 4 MiB).
pub const STANDARD_CLIENT_LIMIT: usize = 4 << 20;

/// Largest message the coordinator sends (a job, a page of jobs, a job
/// event, an assignment with its spec): the standard client limit, so
/// that any gRPC client with its defaults reads every answer. A page of
/// ListJobs is cut to fit it (see `MAX_LIST_PAGE_BYTES`); clients and
/// daemons accept up to this.
pub const MAX_RESPONSE_BYTES: usize = STANDARD_CLIENT_LIMIT;

/// The most jobs one ListJobs page holds (`page_size` above it is
/// clamped), and the page size when the request names none (AIP-158).
pub const MAX_PAGE_SIZE: usize = 1000;
pub const DEFAULT_PAGE_SIZE: usize = 100;

/// The longest page token the coordinator issues (hex of a version byte,
/// a sequence number and a job id of at most 84 bytes), with room to spare.
pub const MAX_PAGE_TOKEN_BYTES: usize = 512;

/// The bytes a ListJobs page's jobs may take, encoded as their
/// `repeated Job jobs = 1` field: the response limit less the largest
/// `next_page_token` field (tag, length, token). A page of any jobs thus
/// fits `MAX_RESPONSE_BYTES`, as long as one job alone does.
pub const MAX_LIST_PAGE_BYTES: usize = MAX_RESPONSE_BYTES - (1 + 2 + MAX_PAGE_TOKEN_BYTES);

// Every answer fits a standard client.
const _: () = assert!(MAX_RESPONSE_BYTES <= STANDARD_CLIENT_LIMIT);

/// The etcd key layout (docs/OPERATIONS.md, "etcd mode"): everything of one cluster lives
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

    /// The sizes of issue 28, computed: a maximal spec (every path 4096
    /// bytes, the longest name, 64 hidden widths) is about 21 KiB, so a
    /// default page (100) of such jobs fits a standard client whole and a
    /// page of 1000 must be cut by bytes; the jobs' budget plus the
    /// largest token field is exactly the response limit, itself what a
    /// standard client accepts.
    #[test]
    fn a_page_of_maximal_jobs_fits_a_standard_client() {
        use crate::v1;
        use accrue_common::spec::MAX_PATH_BYTES;
        use prost::Message;
        let token = v1::ListJobsResponse {
            jobs: Vec::new(),
            next_page_token: "f".repeat(MAX_PAGE_TOKEN_BYTES),
        };
        assert_eq!(
            MAX_LIST_PAGE_BYTES + token.encoded_len(),
            MAX_RESPONSE_BYTES
        );
        let path = |c: char| Some(c.to_string().repeat(MAX_PATH_BYTES));
        let text = format!(
            "name = \"{}\"\n[model]\nkind = \"mlp\"\nhidden = [{}]\n[data]\nkind = \"synthetic\"\nbatch_size = 8\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n",
            "n".repeat(63),
            vec!["1048576"; 64].join(", ")
        );
        let mut spec =
            accrue_common::JobSpec::fields_from_toml_str(&text, "t.toml".as_ref()).unwrap();
        spec.data.path = path('d').map(Into::into);
        spec.data.eval_path = path('e').map(Into::into);
        spec.model.init = path('i').map(Into::into);
        spec.checkpoint.dir = path('c').map(Into::into);
        // model.path (TorchScript only) instead of the hidden widths: the
        // larger of the two.
        spec.validate_fields().unwrap();
        let mlp = crate::spec_to_proto(&spec).encoded_len();
        spec.model.kind = accrue_common::spec::ModelKind::Torchscript;
        spec.model.hidden.clear();
        spec.model.path = path('m').map(Into::into);
        spec.validate_fields().unwrap();
        let ts = crate::spec_to_proto(&spec);
        let bytes = ts.encoded_len().max(mlp);
        assert!((20 << 10..22 << 10).contains(&bytes), "{bytes}");
        let job = v1::Job {
            id: format!("{}-{}", "n".repeat(63), u64::MAX),
            spec: Some(ts),
            ..Default::default()
        };
        let each = prost::encoding::message::encoded_len(1, &job);
        assert!(DEFAULT_PAGE_SIZE * each <= MAX_LIST_PAGE_BYTES);
        assert!(MAX_PAGE_SIZE * each > MAX_LIST_PAGE_BYTES);
        assert!(
            (190..=210).contains(&(MAX_LIST_PAGE_BYTES / each)),
            "{} per page",
            MAX_LIST_PAGE_BYTES / each
        );
    }

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
