//! The coordinator's one error type, in the domain layer: thiserror only,
//! no transport. Each adapter maps it on its way out, through one
//! [`ErrorCode`] so the same failure answers the same way on every path
//! (`From<CoordError> for Status` in `grpc`, the HTTP response in
//! `http`).

use crate::domain::{state_name, JobState};

#[derive(Clone, Debug, thiserror::Error, PartialEq)]
pub enum CoordError {
    /// A spec, a hello or a request that cannot be taken as it is.
    #[error("{0}")]
    InvalidArgument(String),
    #[error("no job {0:?}")]
    JobNotFound(String),
    #[error("job {job} already ended ({}); nothing to {action}", state_name(*state))]
    AlreadyEnded {
        job: String,
        state: JobState,
        action: &'static str,
    },
    /// ResumeJob of a job that succeeded or has not ended.
    #[error(transparent)]
    NotResumable(#[from] NotResumable),
    /// A submission's checkpoint folder belongs to (or meets) another
    /// job's, or lies in the reserved default-folder root (issue 27).
    #[error(transparent)]
    CheckpointDir(#[from] crate::ownership::DirConflict),
    /// This replica does not lead; `leader` is where the leader is, when
    /// one is known.
    #[error("{}", match leader { Some(l) => format!("not the leader; the leader is at {l}"), None => "not the leader, and no leader is elected yet; retry".to_string() })]
    NotLeader { leader: Option<String> },
    /// The job store cannot take writes now (etcd away, the coordinator
    /// stopping): retry later.
    #[error("the job store is unavailable: {0}")]
    StoreUnavailable(String),
    #[error("attach stream: {0}")]
    Attach(String),
    #[error("internal error: {0}")]
    Internal(String),
    /// No credentials, or credentials that name no one.
    #[error("{0}")]
    Unauthenticated(String),
    /// A known caller asking for what it may not do.
    #[error("{0}")]
    PermissionDenied(String),
}

/// What kind of failure a [`CoordError`] is, independent of transport:
/// the adapters map it to a gRPC code and an HTTP status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCode {
    InvalidArgument,
    NotFound,
    FailedPrecondition,
    Unavailable,
    Internal,
    Unauthenticated,
    PermissionDenied,
}

impl CoordError {
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::InvalidArgument(_) | Self::Attach(_) => ErrorCode::InvalidArgument,
            Self::JobNotFound(_) => ErrorCode::NotFound,
            Self::AlreadyEnded { .. } | Self::NotResumable(_) | Self::CheckpointDir(_) => {
                ErrorCode::FailedPrecondition
            }
            Self::NotLeader { .. } | Self::StoreUnavailable(_) => ErrorCode::Unavailable,
            Self::Internal(_) => ErrorCode::Internal,
            Self::Unauthenticated(_) => ErrorCode::Unauthenticated,
            Self::PermissionDenied(_) => ErrorCode::PermissionDenied,
        }
    }
}

/// A job that cannot be resumed, and the state it is in.
#[derive(Clone, Debug, thiserror::Error, PartialEq)]
#[error("{}", match state {
    JobState::Succeeded => format!("job {job} succeeded; nothing to resume (its final checkpoint is its result: submit a new job to train further)"),
    s => format!("job {job} is {}; only a failed or cancelled job can be resumed", state_name(*s)),
})]
pub struct NotResumable {
    pub job: String,
    pub state: JobState,
}
