//! accrue-coordinator: schedules jobs onto worker daemons and owns their
//! counters (docs/ARCHITECTURE.md, docs/OPERATIONS.md "etcd mode" and "The status page"). No libtorch.

pub mod auth;
pub mod domain;
pub mod error;
pub mod etcd;
pub mod gate;
pub mod grpc;
pub mod http;
pub mod ownership;
pub mod paging;
pub mod ringkey;
pub mod scheduler;
pub mod series;
pub mod service;
pub mod state;
pub mod store;
pub mod tensorboard;
#[cfg(test)]
mod test_specs;
pub mod tls;

pub use error::CoordError;
pub use service::{
    parse_watch_buffer, watch_buffer_from_env, Config, Coordinator, WatchBufferError,
    DEFAULT_MAX_JOB_MEMORY_GIB, DEFAULT_WATCH_BUFFER,
};

use accrue_proto::v1::{
    job_service_server::JobServiceServer, worker_service_server::WorkerServiceServer,
};
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;

/// A running coordinator: its addresses and a way to stop it.
pub struct Handle {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub gate: Arc<gate::Gate>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    /// The tokens file (None: authentication off), and whether the status
    /// endpoint serves TLS: what a sign-in link needs.
    tokens: Option<Arc<auth::Tokens>>,
    https: bool,
}

impl Handle {
    /// A one-use link to the status page, `https://HOST:PORT/#signin=CODE`,
    /// that signs the page in as `token` (a token of the tokens file with
    /// `read`; the page gets that token, so its scopes too) once, within
    /// [`auth::signin::CODE_TTL`]. None when authentication is off or the
    /// token is not such a token.
    pub fn sign_in_link(&self, token: &str) -> Option<String> {
        let code = self.tokens.as_ref()?.sign_in_code(token).ok()?;
        let scheme = if self.https { "https" } else { "http" };
        Some(format!("{scheme}://{}/#signin={code}", self.http_addr))
    }

    /// The coordinator, when this process leads (always in embedded mode).
    pub fn coordinator(&self) -> Option<Arc<Coordinator>> {
        self.gate.coordinator()
    }

    /// Stops serving and waits for the servers to finish.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let _ = (&mut self.task).await;
        if let Some(c) = self.gate.coordinator() {
            // Closing joins the store's writer thread: off the runtime.
            let _ = tokio::task::spawn_blocking(move || c.close()).await;
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error(transparent)]
    Tokens(#[from] auth::TokensError),
    #[error(transparent)]
    Roots(#[from] accrue_common::spec::RootError),
    #[error(transparent)]
    Tls(#[from] accrue_proto::tls::TlsError),
    #[error("TLS set-up: {0}")]
    TlsSetup(String),
    #[error(transparent)]
    RingKey(#[from] ringkey::RingKeyError),
    #[error(transparent)]
    Security(#[from] accrue_proto::secure::SecurityError),
    #[error("state dir {}: {source}", dir.display())]
    StateDir {
        dir: std::path::PathBuf,
        source: accrue_common::strict_modes::StrictModesError,
    },
}

/// Binds both listeners (port 0 allowed), opens the store under
/// `cfg.state_dir` and serves until stopped.
pub async fn start(cfg: Config, grpc: &str, http: &str) -> Result<Handle, StartError> {
    cfg.check_security(None)?;
    let cfg = cfg.with_checked_roots()?;
    // Created 0700; refused when another user owns or may write it or
    // what is in it (the ring secret, the job store, `accrue local`'s
    // credentials): before anything in it is read.
    accrue_common::strict_modes::create_private_dir(&cfg.state_dir).map_err(|source| {
        StartError::StateDir {
            dir: cfg.state_dir.clone(),
            source,
        }
    })?;
    let master = ringkey::RingMaster::resolve(cfg.ring_secret_file.as_deref(), &cfg.state_dir)?;
    let store = store::RedbStore::open(&cfg.state_dir)?;
    let coordinator = Coordinator::with_ring_master(cfg.clone(), Box::new(store), master)?;
    serve(cfg, grpc, http, gate::Gate::leading(coordinator)).await
}

/// etcd mode: serves at once (as a follower that names the leader) and
/// campaigns for leadership in the background; `advertise` is the gRPC
/// address other processes reach this replica at (default: the bound one).
pub async fn start_etcd(
    cfg: Config,
    grpc: &str,
    http: &str,
    etcd: etcd::EtcdConfig,
    advertise: Option<String>,
) -> Result<Handle, StartError> {
    cfg.check_security(Some(etcd.tls_configured()))?;
    if let Some(t) = &etcd.tls {
        t.config()?; // the etcd TLS files are readable, or no start
    }
    let cfg = cfg.with_checked_roots()?;
    // Replicas need not share a master: a generation's key is derived and
    // sent by the one leader that forms it (docs/SECURITY.md, Data plane).
    let master = match &cfg.ring_secret_file {
        Some(f) => ringkey::RingMaster::from_file(f)?,
        None => {
            tracing::warn!("no --ring-secret-file: this replica derives ring keys from a random in-memory master secret");
            ringkey::RingMaster::random()
        }
    };
    let g = gate::Gate::follower();
    let handle = serve(cfg.clone(), grpc, http, g.clone()).await?;
    let advertise = advertise.unwrap_or_else(|| handle.grpc_addr.to_string());
    tokio::spawn(etcd::lead(cfg, etcd, advertise, g, master));
    Ok(handle)
}

async fn serve(
    cfg: Config,
    grpc: &str,
    http: &str,
    gate: Arc<gate::Gate>,
) -> Result<Handle, StartError> {
    let bind = |addr: String| async move {
        TcpListener::bind(&addr)
            .await
            .map_err(|source| StartError::Bind { addr, source })
    };
    let grpc_l = bind(grpc.to_string()).await?;
    let http_l = bind(http.to_string()).await?;
    let grpc_addr = grpc_l.local_addr().map_err(|source| StartError::Bind {
        addr: grpc.into(),
        source,
    })?;
    let http_addr = http_l.local_addr().map_err(|source| StartError::Bind {
        addr: http.into(),
        source,
    })?;
    let tokens = match &cfg.tokens {
        Some(path) => Some(Arc::new(auth::Tokens::load(path)?)),
        None => None,
    };
    // TLS files are read and checked before anything serves.
    let tls = match &cfg.tls {
        Some(t) => {
            accrue_proto::tls::install_crypto_provider();
            Some(t.load()?)
        }
        None => None,
    };
    let mut builder = tonic::transport::Server::builder();
    let mut http_tls = None;
    let worker_auth = match &tls {
        Some(t) => {
            builder = builder
                .tls_config(t.grpc())
                .map_err(|e| StartError::TlsSetup(format!("gRPC: {e}")))?;
            http_tls = Some(
                t.http()
                    .map_err(|e| StartError::TlsSetup(format!("HTTP: {e}")))?,
            );
            grpc::WorkerAuth::ClientCert
        }
        None => grpc::WorkerAuth::Open,
    };
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    use accrue_proto::layout::{MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES};
    let jobs = JobServiceServer::new(grpc::JobApi(gate.clone()))
        .max_decoding_message_size(MAX_REQUEST_BYTES)
        .max_encoding_message_size(MAX_RESPONSE_BYTES);
    let workers = WorkerServiceServer::new(grpc::WorkerApi(gate.clone(), worker_auth))
        .max_decoding_message_size(MAX_REQUEST_BYTES)
        .max_encoding_message_size(MAX_RESPONSE_BYTES);
    let (stop_tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let https = http_tls.is_some();
    let router = http::router(gate.clone(), tokens.clone())
        .layer(axum::Extension(http::Stopping(stop_tx.clone())));
    let ticker = gate.clone();
    let ttl = cfg.heartbeat_ttl;
    let grpc_tokens = tokens.clone();
    let task = tokio::spawn(async move {
        let mut stop_grpc = stop_tx.subscribe();
        let mut stop_http = stop_tx.subscribe();
        let grpc = builder
            .layer(auth::GrpcAuthLayer::new(grpc_tokens))
            .add_service(jobs)
            .add_service(workers)
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(grpc_l),
                async move {
                    let _ = stop_grpc.recv().await;
                },
            );
        let stopped = async move {
            let _ = stop_http.recv().await;
        };
        let http = match http_tls {
            None => tokio::spawn(
                axum::serve(http_l, router)
                    .with_graceful_shutdown(stopped)
                    .into_future(),
            ),
            Some(config) => match tls::TlsListener::new(http_l, config) {
                Ok(l) => tokio::spawn(
                    axum::serve(l, router)
                        .with_graceful_shutdown(stopped)
                        .into_future(),
                ),
                Err(e) => tokio::spawn(async move { Err(e) }),
            },
        };
        let tick = async move {
            let mut every = tokio::time::interval(ttl / 4);
            loop {
                every.tick().await;
                if let Some(c) = ticker.coordinator() {
                    c.tick();
                }
            }
        };
        tokio::select! {
            _ = rx => { let _ = stop_tx.send(()); }
            r = grpc => { if let Err(e) = r { tracing::error!(error = %e, "gRPC server stopped"); } }
            _ = tick => {}
        }
        let _ = stop_tx.send(());
        let _ = http.await;
    });
    tracing::info!(%grpc_addr, %http_addr, tls = cfg.tls.is_some(), "coordinator serving");
    Ok(Handle {
        grpc_addr,
        http_addr,
        gate,
        shutdown: Some(tx),
        task,
        tokens,
        https,
    })
}
