//! The coordinator's one error type, mapped once to a gRPC code and an HTTP
//! status: the same failure answers the same way on every path.

use axum::http::StatusCode;
use tonic::Code;

#[derive(Clone, Debug, thiserror::Error, PartialEq)]
pub enum CoordError {
    /// A spec, a hello or a request that cannot be taken as it is.
    #[error("{0}")]
    InvalidArgument(String),
    #[error("no job {0:?}")]
    JobNotFound(String),
    #[error("job {job} already ended ({state}); nothing to {action}")]
    AlreadyEnded {
        job: String,
        state: &'static str,
        action: &'static str,
    },
    /// ResumeJob of a job that succeeded or has not ended.
    #[error(transparent)]
    NotResumable(#[from] crate::state::NotResumable),
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

impl CoordError {
    pub fn grpc_code(&self) -> Code {
        match self {
            Self::InvalidArgument(_) | Self::Attach(_) => Code::InvalidArgument,
            Self::JobNotFound(_) => Code::NotFound,
            Self::AlreadyEnded { .. } | Self::NotResumable(_) | Self::CheckpointDir(_) => {
                Code::FailedPrecondition
            }
            Self::NotLeader { .. } | Self::StoreUnavailable(_) => Code::Unavailable,
            Self::Internal(_) => Code::Internal,
            Self::Unauthenticated(_) => Code::Unauthenticated,
            Self::PermissionDenied(_) => Code::PermissionDenied,
        }
    }

    pub fn http_status(&self) -> StatusCode {
        match self {
            Self::InvalidArgument(_) | Self::Attach(_) => StatusCode::BAD_REQUEST,
            Self::JobNotFound(_) => StatusCode::NOT_FOUND,
            Self::AlreadyEnded { .. } | Self::NotResumable(_) | Self::CheckpointDir(_) => {
                StatusCode::CONFLICT
            }
            Self::NotLeader { .. } | Self::StoreUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            Self::PermissionDenied(_) => StatusCode::FORBIDDEN,
        }
    }
}

impl From<CoordError> for tonic::Status {
    fn from(e: CoordError) -> Self {
        let mut s = tonic::Status::new(e.grpc_code(), e.to_string());
        if let CoordError::NotLeader {
            leader: Some(leader),
        } = &e
        {
            if let Ok(v) = leader.parse() {
                s.metadata_mut().insert(crate::gate::LEADER_HEADER, v);
            }
        }
        s
    }
}

impl axum::response::IntoResponse for CoordError {
    fn into_response(self) -> axum::response::Response {
        let mut body = serde_json::json!({ "error": self.to_string() });
        if let CoordError::NotLeader { leader } = &self {
            body["leader"] = serde_json::json!(leader.clone().unwrap_or_default());
        }
        (self.http_status(), axum::Json(body)).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_failure_one_code_on_both_paths() {
        let cases = [
            (
                CoordError::InvalidArgument("x".into()),
                Code::InvalidArgument,
                400,
            ),
            (CoordError::JobNotFound("j".into()), Code::NotFound, 404),
            (
                CoordError::AlreadyEnded {
                    job: "j".into(),
                    state: "succeeded",
                    action: "cancel",
                },
                Code::FailedPrecondition,
                409,
            ),
            (
                CoordError::NotResumable(crate::state::NotResumable {
                    job: "j".into(),
                    state: accrue_proto::v1::JobState::Succeeded,
                }),
                Code::FailedPrecondition,
                409,
            ),
            (
                CoordError::CheckpointDir(crate::ownership::DirConflict::Reserved {
                    folder: crate::ownership::Folder {
                        dir: "/s/checkpoints/x".into(),
                        explicit: true,
                    },
                    root: "/s/checkpoints".into(),
                    contains: false,
                }),
                Code::FailedPrecondition,
                409,
            ),
            (
                CoordError::NotLeader { leader: None },
                Code::Unavailable,
                503,
            ),
            (
                CoordError::StoreUnavailable("etcd".into()),
                Code::Unavailable,
                503,
            ),
            (CoordError::Internal("x".into()), Code::Internal, 500),
            (
                CoordError::Unauthenticated("x".into()),
                Code::Unauthenticated,
                401,
            ),
            (
                CoordError::PermissionDenied("x".into()),
                Code::PermissionDenied,
                403,
            ),
        ];
        for (e, code, http) in cases {
            let s: tonic::Status = e.clone().into();
            assert_eq!(s.code(), code, "{e}");
            assert_eq!(s.message(), e.to_string());
            assert_eq!(e.http_status().as_u16(), http, "{e}");
        }
        let s: tonic::Status = CoordError::NotLeader {
            leader: Some("10.0.0.1:50051".into()),
        }
        .into();
        assert_eq!(
            s.metadata().get(crate::gate::LEADER_HEADER).unwrap(),
            "10.0.0.1:50051"
        );
        assert!(s.message().contains("10.0.0.1:50051"));
    }
}
