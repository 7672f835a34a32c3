//! The gRPC adapters: JobService and WorkerService, through the gate (the
//! leader serves; a follower answers UNAVAILABLE naming the leader). They
//! turn requests into coordinator calls and [`CoordError`]s into statuses,
//! and hold no state of their own. Who calls was decided before they run
//! (the [`auth::GrpcAuthLayer`]); they read the principal it left in the
//! request's extensions.

use crate::auth::{self, Principal};
use crate::error::{CoordError, ErrorCode};
use crate::gate::Gate;
use accrue_proto::layout::LEADER_HEADER;
use accrue_proto::v1::{self, worker_message, CoordinatorMessage, Job, JobEvent, WorkerMessage};
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt};
use tonic::{Code, Request, Response, Status, Streaming};

/// A [`CoordError`]'s gRPC code (the HTTP status is `http`'s).
impl CoordError {
    pub fn grpc_code(&self) -> Code {
        match self.code() {
            ErrorCode::InvalidArgument => Code::InvalidArgument,
            ErrorCode::NotFound => Code::NotFound,
            ErrorCode::FailedPrecondition => Code::FailedPrecondition,
            ErrorCode::Unavailable => Code::Unavailable,
            ErrorCode::Internal => Code::Internal,
            ErrorCode::Unauthenticated => Code::Unauthenticated,
            ErrorCode::PermissionDenied => Code::PermissionDenied,
        }
    }
}

/// The status a failure answers with; a follower's names the leader in
/// [`LEADER_HEADER`] metadata.
impl From<CoordError> for Status {
    fn from(e: CoordError) -> Self {
        let mut s = Status::new(e.grpc_code(), e.to_string());
        if let CoordError::NotLeader {
            leader: Some(leader),
        } = &e
        {
            if let Ok(v) = leader.parse() {
                s.metadata_mut().insert(LEADER_HEADER, v);
            }
        }
        s
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// gRPC JobService.
#[derive(Clone)]
pub struct JobApi(pub Arc<Gate>);

#[tonic::async_trait]
impl v1::job_service_server::JobService for JobApi {
    async fn submit_job(
        &self,
        req: Request<v1::SubmitJobRequest>,
    ) -> Result<Response<Job>, Status> {
        let owner = req
            .extensions()
            .get::<Principal>()
            .map(|p| p.name.clone())
            .unwrap_or_default();
        let spec = submitted_spec(req.into_inner())?;
        // Answers once the job is durable (bounded; UNAVAILABLE otherwise).
        Ok(Response::new(self.0.get()?.submit_spec(spec, owner).await?))
    }
    async fn get_job(&self, req: Request<v1::GetJobRequest>) -> Result<Response<Job>, Status> {
        Ok(Response::new(self.0.get()?.job(&req.into_inner().id)?))
    }
    async fn list_jobs(
        &self,
        req: Request<v1::ListJobsRequest>,
    ) -> Result<Response<v1::ListJobsResponse>, Status> {
        let r = req.into_inner();
        let page = self.0.get()?.list_page(r.page_size.into(), &r.page_token)?;
        Ok(Response::new(page))
    }
    async fn cancel_job(
        &self,
        req: Request<v1::CancelJobRequest>,
    ) -> Result<Response<Job>, Status> {
        // The layer checked the token's scope; ownership is the scheduler's.
        let by = auth::caller(req.extensions().get::<Principal>());
        Ok(Response::new(
            self.0.get()?.cancel_as(&req.into_inner().id, by)?,
        ))
    }
    async fn resume_job(
        &self,
        req: Request<v1::ResumeJobRequest>,
    ) -> Result<Response<Job>, Status> {
        // As CancelJob: the layer checked the scope, the scheduler decides
        // ownership; the answer comes once the change is durable.
        let by = auth::caller(req.extensions().get::<Principal>());
        Ok(Response::new(
            self.0.get()?.resume_as(&req.into_inner().id, by).await?,
        ))
    }
    async fn get_series(
        &self,
        req: Request<v1::GetSeriesRequest>,
    ) -> Result<Response<v1::GetSeriesResponse>, Status> {
        let r = req.into_inner();
        Ok(Response::new(self.0.get()?.series(
            &r.id,
            r.from_step,
            r.max_points,
        )?))
    }
    type WatchJobStream = BoxStream<JobEvent>;
    async fn watch_job(
        &self,
        req: Request<v1::WatchJobRequest>,
    ) -> Result<Response<Self::WatchJobStream>, Status> {
        let s = self.0.get()?.watch(&req.into_inner().id)?;
        Ok(Response::new(Box::pin(s)))
    }
}

/// The spec of a SubmitJob, parsed once here at the edge: the structured
/// one converted from the wire, or the TOML text parsed and checked as
/// `accrue submit` checks a file (its fields; the coordinator's own checks
/// follow for both).
fn submitted_spec(r: v1::SubmitJobRequest) -> Result<accrue_common::JobSpec, CoordError> {
    match (r.spec, r.spec_toml.is_empty()) {
        (Some(_), false) => Err(CoordError::InvalidArgument(
            "spec and spec_toml are both set: give one".into(),
        )),
        (Some(spec), true) => crate::scheduler::parse_spec(&spec),
        (None, false) => {
            let origin = std::path::Path::new("spec_toml");
            accrue_common::JobSpec::fields_from_toml_str(&r.spec_toml, origin)
                .map_err(|e| CoordError::InvalidArgument(e.to_string()))
        }
        (None, true) => Err(CoordError::InvalidArgument(
            "spec: (missing): required (the structured spec or spec_toml)".into(),
        )),
    }
}

/// Who may attach to WorkerService.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerAuth {
    /// Anyone who can reach the port (plaintext, `--insecure`).
    Open,
    /// Only a client certificate from the cluster CA naming the worker id
    /// of the hello ([`crate::tls::authorize_worker`]).
    ClientCert,
}

/// gRPC WorkerService.
#[derive(Clone)]
pub struct WorkerApi(pub Arc<Gate>, pub WorkerAuth);

#[tonic::async_trait]
impl v1::worker_service_server::WorkerService for WorkerApi {
    type AttachStream = BoxStream<CoordinatorMessage>;
    async fn attach(
        &self,
        req: Request<Streaming<WorkerMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let peer = req.peer_certs();
        let remote = req.remote_addr();
        let refuse = |e: crate::tls::PeerError| {
            tracing::warn!(?remote, error = %e, "attach refused");
            Status::from(e)
        };
        if self.1 == WorkerAuth::ClientCert && peer.is_none() {
            return Err(refuse(crate::tls::PeerError::NoClientCert));
        }
        let coord = self.0.get()?;
        let mut inbound = req.into_inner();
        let first = inbound
            .next()
            .await
            .ok_or_else(|| CoordError::Attach("empty stream".into()))??;
        let Some(worker_message::Msg::Hello(hello)) = first.msg else {
            return Err(CoordError::Attach("the first message must be a hello".into()).into());
        };
        if self.1 == WorkerAuth::ClientCert {
            crate::tls::authorize_worker(peer.as_deref().map(Vec::as_slice), &hello.worker_id)
                .map_err(refuse)?;
        }
        let id = hello.worker_id.clone();
        let (tx, rx) = mpsc::unbounded_channel();
        let conn = coord.attach(hello, tx)?;
        tokio::spawn(async move {
            let mut detached = false;
            let reason = loop {
                match inbound.next().await {
                    Some(Ok(m)) => {
                        detached |= matches!(m.msg, Some(worker_message::Msg::Detach(_)));
                        coord.on_message(&id, conn, m)
                    }
                    Some(Err(e)) => break format!("stream error: {}", e.message()),
                    None => break "stream closed".to_string(),
                }
            };
            // After a Detach the worker is already gone: a planned exit is
            // not a loss.
            if !detached {
                coord.lost(&id, Some(conn), &reason);
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
        )))
    }
}

#[cfg(test)]
mod tests {
    use crate::error::CoordError;
    use accrue_proto::layout::LEADER_HEADER;
    use tonic::Code;

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
                    state: accrue_proto::v1::JobState::Succeeded,
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
        assert_eq!(s.metadata().get(LEADER_HEADER).unwrap(), "10.0.0.1:50051");
        assert!(s.message().contains("10.0.0.1:50051"));
    }
}
