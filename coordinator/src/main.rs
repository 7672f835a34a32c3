//! accrue-coordinator: parse flags, set up tracing, serve.
use clap::Parser;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "accrue-coordinator",
    version,
    about = "accrue coordinator: schedules training jobs"
)]
struct Args {
    /// gRPC address (JobService, WorkerService).
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: String,
    /// Status endpoint address (/healthz, /readyz, /v1/jobs, /metrics, /).
    #[arg(long, default_value = "127.0.0.1:8080")]
    http: String,
    /// Jobs and checkpoints live here (embedded redb database).
    #[arg(long, default_value = "runs/coordinator")]
    state_dir: PathBuf,
    /// Seconds without a heartbeat before a worker counts as lost.
    #[arg(long, default_value_t = 10.0)]
    heartbeat_ttl: f64,
    /// etcd endpoints (comma-separated URLs): jobs, membership and leader
    /// election live in etcd; several replicas may run, one leads.
    #[arg(long, value_delimiter = ',')]
    etcd: Vec<String>,
    /// Cluster name: keys live under /accrue/<cluster>/.
    #[arg(long, default_value = "default")]
    cluster: String,
    #[command(flatten)]
    etcd_tls: accrue_proto::tls::EtcdTlsFlags,
    /// gRPC address other processes reach this replica at (etcd mode;
    /// default: the address it listens on).
    #[arg(long)]
    advertise: Option<String>,
    /// Leader lease TTL in seconds (etcd mode): how long a dead leader
    /// holds on before a follower takes over.
    #[arg(long, default_value_t = 3)]
    lease_ttl: i64,
    /// Seconds a submission waits for its record to be durable before it
    /// is taken back and refused with UNAVAILABLE.
    #[arg(long, default_value_t = 5.0)]
    durable_timeout: f64,
    /// A job whose estimated memory per worker (data, model state, batches)
    /// is above this many GiB is refused at submit.
    #[arg(long, default_value_t = accrue_coordinator::DEFAULT_MAX_JOB_MEMORY_GIB)]
    max_job_memory_gib: u64,
    /// Tokens file (TOML: [[token]] name, sha256, scopes): JobService and
    /// every HTTP path but /healthz and /readyz then need `authorization:
    /// Bearer <token>` with the right scope. Re-read when it changes.
    /// Without it, no authentication.
    #[arg(long, value_name = "FILE")]
    tokens: Option<PathBuf>,
    /// Confine data.path and data.eval_path of every spec under this folder
    /// (after '..' and symlinks; relative paths resolve under it).
    #[arg(long)]
    data_root: Option<PathBuf>,
    /// Confine model.path and model.init under this folder.
    #[arg(long)]
    model_root: Option<PathBuf>,
    /// Confine checkpoint.dir under this folder; <state-dir>/checkpoints
    /// (the default checkpoint folder) must lie under it.
    #[arg(long)]
    checkpoint_root: Option<PathBuf>,
    /// This coordinator's TLS certificate (PEM; its SANs must name the
    /// addresses clients use). Both ports then speak TLS.
    #[arg(long)]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long)]
    tls_key: Option<PathBuf>,
    /// The cluster CA (PEM) worker client certificates must chain to:
    /// WorkerService then takes only workers whose certificate names them.
    #[arg(long)]
    client_ca: Option<PathBuf>,
    /// Run without what is not configured (TLS, --tokens, TLS to etcd),
    /// with a warning for each. Without it the coordinator refuses to start
    /// unless all of them are given: plaintext lets anyone who can reach
    /// the ports attach as a worker and read every job's spec and ring key.
    #[arg(long)]
    insecure: bool,
    /// The ring master secret (32 or more random bytes, used as they are):
    /// every job generation's data-plane key is derived from it. Default:
    /// <state-dir>/ring-master.key, created (mode 0600) on first start;
    /// in etcd mode, a random in-memory secret per replica.
    #[arg(long, value_name = "FILE")]
    ring_secret_file: Option<PathBuf>,
    /// TensorBoard event files: one run folder per job (its id) under this
    /// folder, written as steps and evaluations come (`tensorboard
    /// --logdir <this>`). Default: <state-dir>/tensorboard.
    #[arg(long, value_name = "DIR")]
    tensorboard_dir: Option<PathBuf>,
    /// Job events kept for watchers (WatchJob, the status page), 1 to
    /// 1048576: a watcher that falls further behind gets a fresh snapshot
    /// of its job and goes on.
    #[arg(long, env = "ACCRUE_WATCH_BUFFER", default_value_t = accrue_coordinator::DEFAULT_WATCH_BUFFER,
          value_parser = |v: &str| accrue_coordinator::parse_watch_buffer("--watch-buffer", v))]
    watch_buffer: usize,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match serve().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line, each cause once (docs/OPERATIONS.md, "Errors").
            eprintln!("error: {}", accrue_proto::error_chain(e.as_ref()));
            std::process::ExitCode::FAILURE
        }
    }
}

async fn serve() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let a = Args::parse();
    let tls = accrue_coordinator::tls::server_transport(a.tls_cert, a.tls_key, a.client_ca)?;
    let etcd_tls = a.etcd_tls.for_endpoints(&a.etcd)?;
    let tensorboard_dir = a
        .tensorboard_dir
        .unwrap_or_else(|| a.state_dir.join("tensorboard"));
    let cfg = accrue_coordinator::Config {
        state_dir: a.state_dir,
        heartbeat_ttl: Duration::try_from_secs_f64(a.heartbeat_ttl)
            .map_err(|e| anyhow::anyhow!("--heartbeat-ttl {}: {e}", a.heartbeat_ttl))?,
        durable_timeout: Duration::try_from_secs_f64(a.durable_timeout)
            .map_err(|e| anyhow::anyhow!("--durable-timeout {}: {e}", a.durable_timeout))?,
        max_job_memory: a
            .max_job_memory_gib
            .saturating_mul(accrue_common::spec::GIB),
        tokens: a.tokens,
        roots: accrue_common::spec::Roots {
            data: a.data_root,
            model: a.model_root,
            checkpoint: a.checkpoint_root,
        },
        tls,
        ring_secret_file: a.ring_secret_file,
        insecure: a.insecure,
        tensorboard_dir: Some(tensorboard_dir),
        watch_buffer: a.watch_buffer,
    };
    let handle = if a.etcd.is_empty() {
        accrue_coordinator::start(cfg, &a.listen, &a.http).await?
    } else {
        let etcd = accrue_coordinator::etcd::EtcdConfig {
            endpoints: a.etcd,
            cluster: a.cluster,
            lease_ttl_s: a.lease_ttl.max(1),
            tls: etcd_tls,
        };
        accrue_coordinator::start_etcd(cfg, &a.listen, &a.http, etcd, a.advertise).await?
    };
    println!("grpc {} http {}", handle.grpc_addr, handle.http_addr);
    tokio::signal::ctrl_c().await?;
    handle.stop().await;
    Ok(())
}
