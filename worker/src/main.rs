//! accrue-worker: `train JOB.toml` runs one rank of a job: alone (W = 1), or
//! with static rendezvous (`--rank R --world-size W --peers ...`).
use accrue_worker::comm::mesh::{Mesh, MeshConfig};
use accrue_worker::comm::mesh_collective::MeshCollective;
use accrue_worker::comm::{RingConfig, TcpRing};
use accrue_worker::engine::{Event, RunOptions, Summary};
use accrue_worker::{Collective, Engine, JobSpec, SingleRank};
use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "accrue-worker",
    version,
    about = "accrue worker: runs training ranks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one rank of a job (alone by default, W = 1).
    Train(TrainArgs),
    /// Attach to a coordinator and run the ranks it assigns.
    Daemon(DaemonArgs),
    /// Continue a prompt with a llama checkpoint (KV cache; greedy at
    /// temperature 0).
    Sample(accrue_worker::sample::SampleArgs),
}

#[derive(clap::Args)]
struct DaemonArgs {
    /// The coordinator's gRPC address: HOST:PORT (https:// with --ca,
    /// http:// without), or a URL whose scheme agrees.
    #[arg(long, default_value = "127.0.0.1:50051")]
    coordinator: String,
    /// The cluster CA (PEM) that signed the coordinator's certificate.
    /// With --cert and --key: connect over mutual TLS.
    #[arg(long)]
    ca: Option<PathBuf>,
    /// This worker's client certificate (PEM, signed by the cluster CA; its
    /// SAN must name --id).
    #[arg(long)]
    cert: Option<PathBuf>,
    /// The private key of --cert (PEM).
    #[arg(long)]
    key: Option<PathBuf>,
    /// Run without what is not configured (mutual TLS to the coordinator,
    /// TLS to etcd), with a warning for each. Without it the daemon refuses
    /// to start unless all of them are given: in plaintext anyone on the
    /// network path can read job specs and ring keys.
    #[arg(long)]
    insecure: bool,
    /// This worker's id (default: worker-<host>-<pid>).
    #[arg(long)]
    id: Option<String>,
    /// Data-plane listener (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen_data: String,
    /// The data-plane address other workers connect to (default: the
    /// listener's address; needed when --listen-data is 0.0.0.0:PORT).
    #[arg(long)]
    advertise_data: Option<String>,
    /// Device for every job (auto, cpu, cuda:N); default: the job's own.
    #[arg(long)]
    device: Option<String>,
    /// libtorch intra-op threads for jobs whose spec sets none (default:
    /// libtorch's, i.e. OMP_NUM_THREADS or every core). With several
    /// daemons on one host give each cores / daemons, as `accrue local` does.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    threads: Option<u32>,
    /// data.path and data.eval_path must lie under this folder, after '..'
    /// and symlinks (relative paths resolve under it).
    #[arg(long)]
    data_root: Option<PathBuf>,
    /// model.path and model.init must lie under this folder.
    #[arg(long)]
    model_root: Option<PathBuf>,
    /// Checkpoint folders must lie under this folder.
    #[arg(long)]
    checkpoint_root: Option<PathBuf>,
    /// Seconds between heartbeats.
    #[arg(long, default_value_t = 1.0)]
    heartbeat: f64,
    /// Append, for every committed window, the sample indices this worker's
    /// rank read in it (JSON lines, recorded where the data reader fetched
    /// them) to this file: joined over the workers, an audit of the data
    /// accounting across recoveries.
    #[arg(long)]
    sample_log: Option<PathBuf>,
    /// Sleep this many milliseconds after every micro-step (fault-injection
    /// tests: makes a small job last long enough to kill a rank mid-window).
    #[arg(long, default_value_t = 0)]
    micro_step_delay_ms: u64,
    /// etcd endpoints (comma-separated URLs): register this worker under a
    /// lease and find the leader coordinator there.
    #[arg(long, value_delimiter = ',')]
    etcd: Vec<String>,
    /// Cluster name (etcd keys live under /accrue/<cluster>/).
    #[arg(long, default_value = "default")]
    cluster: String,
    #[command(flatten)]
    etcd_tls: accrue_proto::tls::EtcdTlsFlags,
    /// Refuse jobs estimated to need more memory than this many GiB
    /// (default: the host's physical memory).
    #[arg(long)]
    max_job_memory_gib: Option<f64>,
    /// Serve probes over plain HTTP on this address (e.g. 0.0.0.0:8081;
    /// port 0: any free port, printed as `health ADDR`): GET /healthz is
    /// 200 while the daemon's loop runs, GET /readyz 200 while attached to
    /// a coordinator, else 503 with the reason. Answers hold no secrets.
    /// Default: no probe endpoint.
    #[arg(long, value_name = "ADDR")]
    health_listen: Option<String>,
    /// On SIGTERM or Ctrl-C the daemon detaches, then waits up to this
    /// many seconds for its job's thread to end, so a checkpoint being
    /// written is finished (give Kubernetes' terminationGracePeriodSeconds
    /// more than this).
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0)]
    stop_timeout: f64,
}

#[derive(clap::Args)]
struct TrainArgs {
    /// The job spec (TOML).
    job: PathBuf,
    /// Continue from the checkpoint LATEST names.
    #[arg(long)]
    resume: bool,
    /// Folder for state; checkpoints default to <state-dir>/checkpoints/<name>.
    #[arg(long, default_value = "runs")]
    state_dir: PathBuf,
    /// Overrides checkpoint.dir.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Stop with a checkpoint after this many optimizer steps (resume later).
    #[arg(long)]
    stop_after_steps: Option<u64>,
    /// Overrides the spec's device (auto, cpu, cuda:N).
    #[arg(long)]
    device: Option<String>,
    /// Record libtorch's profiler (CPU ops; CUDA kernels on a GPU) over
    /// --profile-steps optimizer steps after --profile-after, and write a
    /// Chrome trace (chrome://tracing, Perfetto) to this file.
    #[arg(long, value_name = "TRACE.json")]
    profile: Option<PathBuf>,
    /// Optimizer steps of this run before the profile starts (warm-up and
    /// CUDA-graph captures left out).
    #[arg(long, default_value_t = 3, requires = "profile")]
    profile_after: u64,
    /// Optimizer steps the profile covers.
    #[arg(long, default_value_t = 3, requires = "profile",
          value_parser = clap::value_parser!(u64).range(1..))]
    profile_steps: u64,
    /// Overrides the spec's intra-op thread count.
    #[arg(long)]
    threads: Option<u32>,
    /// Print one JSON object per event instead of progress lines.
    #[arg(long)]
    json: bool,
    /// This rank (0-based).
    #[arg(long, default_value_t = 0)]
    rank: usize,
    /// Number of ranks W (the spec's `workers` is ignored here).
    #[arg(long, default_value_t = 1)]
    world_size: usize,
    /// host:port of every rank's data-plane listener, in rank order.
    #[arg(long, value_delimiter = ',')]
    peers: Vec<String>,
    /// File holding the job's shared secret (required when W > 1).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Ring generation (frames of other generations are refused).
    #[arg(long, default_value_t = 0)]
    generation: u64,
    /// Refuse a job estimated to need more memory than this many GiB
    /// (default: the host's physical memory).
    #[arg(long)]
    max_job_memory_gib: Option<f64>,
    /// data.path and data.eval_path must lie under this folder, after '..'
    /// and symlinks (relative paths resolve under it).
    #[arg(long)]
    data_root: Option<PathBuf>,
    /// model.path and model.init must lie under this folder.
    #[arg(long)]
    model_root: Option<PathBuf>,
    /// The checkpoint folder (--checkpoint-dir, checkpoint.dir or the
    /// default under --state-dir) must lie under this folder.
    #[arg(long)]
    checkpoint_root: Option<PathBuf>,
}

/// The spec at `args.job` with its paths confined under the roots given
/// (relative ones resolved under them), then checked against the files;
/// and the checkpoint folder to use, confined too.
fn load_confined(args: &TrainArgs) -> anyhow::Result<(JobSpec, Option<PathBuf>)> {
    use accrue_worker::spec::{confine_field, Area, LocalFs, Roots};
    let roots = Roots {
        data: args.data_root.clone(),
        model: args.model_root.clone(),
        checkpoint: args.checkpoint_root.clone(),
    }
    .absolute()?;
    if roots.is_empty() {
        return Ok((JobSpec::load(&args.job)?, args.checkpoint_dir.clone()));
    }
    let spec = JobSpec::load_fields(&args.job)?
        .confined(&roots, &LocalFs)
        .with_context(|| format!("job spec {}", args.job.display()))?;
    spec.validate()
        .with_context(|| format!("job spec {}", args.job.display()))?;
    let (field, dir) = match (&args.checkpoint_dir, &spec.checkpoint.dir) {
        (Some(d), _) => ("--checkpoint-dir", d.clone()),
        (None, Some(d)) => ("checkpoint.dir", d.clone()),
        (None, None) => (
            "--state-dir",
            accrue_proto::layout::default_checkpoint_dir(&args.state_dir, &spec.name),
        ),
    };
    // Flags name paths from the current folder, not from the root.
    let dir = if field == "checkpoint.dir" {
        dir
    } else {
        std::path::absolute(&dir).with_context(|| format!("{field} {}", dir.display()))?
    };
    let confined = confine_field(&roots, Area::Checkpoint, field, &dir, &LocalFs)
        .map_err(|e| anyhow::anyhow!("invalid checkpoint folder: {e}"))?;
    Ok((spec, Some(confined.unwrap_or(dir))))
}

/// `--max-job-memory-gib`, or the host's memory (64 GiB when unknown).
fn memory_limit(gib: Option<f64>) -> anyhow::Result<u64> {
    use accrue_worker::spec::{host_memory_bytes, GIB};
    match gib {
        Some(g) if g.is_finite() && g > 0.0 => Ok((g * GIB as f64) as u64),
        Some(g) => bail!("--max-job-memory-gib {g}: must be a number > 0"),
        None => Ok(host_memory_bytes().unwrap_or(64 * GIB)),
    }
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line, each cause once (docs/OPERATIONS.md, "Errors").
            eprintln!("error: {}", accrue_proto::error_chain(e.as_ref()));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let args = match cli.command {
        Command::Train(args) => args,
        Command::Daemon(d) => return daemon(d),
        Command::Sample(s) => {
            accrue_worker::sample::run(&s, &mut std::io::stdout().lock())?;
            return Ok(());
        }
    };
    let (mut spec, checkpoint_dir) = load_confined(&args)?;
    spec.check_memory(memory_limit(args.max_job_memory_gib)?)?;
    if let Some(d) = &args.device {
        spec.device = d.clone();
    }
    if args.threads.is_some() {
        spec.threads = args.threads;
    }
    // A language model counts target tokens where others count samples.
    let lm = spec.model.kind.is_decoder();
    let opts = RunOptions {
        checkpoint_dir,
        state_dir: Some(args.state_dir.clone()),
        resume: args.resume,
        stop_after_steps: args.stop_after_steps,
        profile: args
            .profile
            .clone()
            .map(|path| accrue_worker::cuda::profiler::Profile {
                path,
                after_steps: args.profile_after,
                steps: args.profile_steps,
            }),
        ..Default::default()
    };
    // One rank trains alone, except when its spec asks for c10d: then its
    // groups are c10d groups of one, the path a larger job takes (NCCL on
    // one GPU: docs/SPEC.md, "[comm]").
    let alone = spec.comm.backend != accrue_worker::spec::CommBackend::C10d;
    let summary = if args.world_size <= 1 && alone {
        train(spec, SingleRank, opts, args.json, lm)?
    } else {
        let Some(secret_file) = &args.secret_file else {
            bail!("--secret-file is required when --world-size > 1 or [comm] backend = \"c10d\"");
        };
        let secret = std::fs::read(secret_file)
            .with_context(|| format!("cannot read the secret file {}", secret_file.display()))?;
        let secret = secret.trim_ascii_end().to_vec();
        if secret.is_empty() {
            bail!("the secret file {} is empty", secret_file.display());
        }
        let mut cfg = RingConfig::new(
            spec.name.clone(),
            args.rank,
            args.world_size,
            args.peers.clone(),
            secret,
        );
        cfg.generation = args.generation;
        cfg.timeout = Duration::from_secs_f64(spec.comm.timeout_s);
        cfg.connect_timeout = Duration::from_secs_f64(spec.comm.connect_timeout_s);
        let ring = TcpRing::start(None, cfg).context("cannot join the ring")?;
        let mesh_cfg = MeshConfig::for_job(
            &spec,
            args.world_size as u32,
            &args.peers,
            args.rank,
            on_cuda(&spec),
        )
        .map_err(anyhow::Error::msg)?;
        let mesh = Mesh::form(ring, &mesh_cfg).context("cannot form the process groups")?;
        train(spec, MeshCollective::new(mesh), opts, args.json, lm)?
    };
    if !args.json {
        let s = &summary.state;
        println!(
            "{} at step {}: {} {}, {} skipped steps, checkpoint {}",
            if summary.finished {
                "finished"
            } else {
                "stopped"
            },
            s.step,
            s.samples_seen,
            if lm { "tokens" } else { "samples" },
            s.skipped_steps,
            summary.checkpoint.display()
        );
        match &summary.eval {
            Some(e) if lm => match e.perplexity {
                Some(p) => println!("final perplexity {p:.2} (loss {:.4} per token)", e.loss),
                None => println!("final perplexity - (no target token evaluated)"),
            },
            Some(e) => println!(
                "final accuracy {:.2}% (loss {:.4})",
                100.0 * e.accuracy,
                e.loss
            ),
            None => {}
        }
    }
    Ok(())
}

fn daemon(d: DaemonArgs) -> anyhow::Result<()> {
    use accrue_proto::secure::{decide, Waiver};
    let tls =
        accrue_proto::tls::client_files(["--ca", "--cert", "--key"], d.ca, d.cert, d.key, true)?;
    let etcd_tls = d.etcd_tls.for_endpoints(&d.etcd)?;
    let mut pieces = vec![(Waiver::WorkerTls, tls.is_some())];
    if !d.etcd.is_empty() {
        pieces.push((Waiver::EtcdTls, etcd_tls.is_some()));
    }
    for w in decide("the worker daemon", &pieces, d.insecure)? {
        tracing::warn!(waived = ?w, "--insecure: {}; give {} to close it", w.risk(), w.flags());
    }
    let host = accrue_worker::checkpoint::lock::hostname();
    let cfg = accrue_worker::daemon::DaemonConfig {
        coordinator: d.coordinator,
        worker_id: d
            .id
            .unwrap_or_else(|| format!("worker-{}-{}", host.trim(), std::process::id())),
        listen_data: d.listen_data,
        advertise_data: d.advertise_data,
        device: d.device,
        threads: d.threads,
        data_root: d.data_root,
        model_root: d.model_root,
        checkpoint_root: d.checkpoint_root,
        heartbeat: Duration::from_secs_f64(d.heartbeat),
        sample_log: d.sample_log,
        micro_step_delay: (d.micro_step_delay_ms > 0)
            .then(|| Duration::from_millis(d.micro_step_delay_ms)),
        etcd: d.etcd,
        cluster: d.cluster,
        max_job_memory: memory_limit(d.max_job_memory_gib)?,
        tls,
        etcd_tls,
        stop_timeout: Duration::try_from_secs_f64(d.stop_timeout)
            .map_err(|e| anyhow::anyhow!("--stop-timeout {}: {e}", d.stop_timeout))?,
    };
    // Bound before anything else, so a busy port stops the daemon at once
    // and port 0 is known (printed) before the first attach.
    let health_listener = match &d.health_listen {
        Some(addr) => {
            let l = std::net::TcpListener::bind(addr)
                .with_context(|| format!("--health-listen {addr}: cannot listen"))?;
            l.set_nonblocking(true)?;
            let bound = l.local_addr()?;
            println!("health {bound}");
            tracing::info!(addr = %bound, "probe endpoint: GET /healthz, /readyz (plain HTTP)");
            Some(l)
        }
        None => None,
    };
    let health = accrue_worker::daemon::health::HealthState::default();
    let stale_after = accrue_worker::daemon::health::stale_after(cfg.heartbeat);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        if let Some(l) = health_listener {
            let server = accrue_worker::daemon::health::serve(
                tokio::net::TcpListener::from_std(l)?,
                health.clone(),
                stale_after,
            );
            tokio::spawn(async move {
                if let Err(e) = server.await {
                    tracing::error!(error = %e, "the probe endpoint stopped");
                }
            });
        }
        // SIGTERM (Kubernetes, `accrue local`) or Ctrl-C: a planned exit.
        let stop = async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            tokio::select! {
                _ = term.recv() => {}
                r = tokio::signal::ctrl_c() => r?,
            }
            Ok::<(), std::io::Error>(())
        };
        accrue_worker::daemon::run_with(cfg, health, async {
            if let Err(e) = stop.await {
                tracing::error!(error = %e, "cannot listen for signals; running until killed");
                std::future::pending::<()>().await;
            }
        })
        .await?;
        Ok::<(), anyhow::Error>(())
    })?;
    Ok(())
}

fn train<C: Collective>(
    spec: JobSpec,
    collective: C,
    opts: RunOptions,
    json: bool,
    lm: bool,
) -> anyhow::Result<Summary> {
    let unit = if lm { "tokens" } else { "samples" };
    let mut engine = Engine::new(spec, collective, opts).context("cannot start the job")?;
    engine
        .run(|event| match (json, event) {
            (true, Event::Step(r)) => println!("{}", serde_json::json!({ "event": "step", "step": r })),
            (true, Event::Eval(e)) => println!("{}", serde_json::json!({ "event": "eval", "eval": e })),
            (true, Event::Checkpoint(p)) => println!("{}", serde_json::json!({ "event": "checkpoint", "path": p })),
            (false, Event::Step(r)) => println!(
                "step {}/{} epoch {} loss {:.4} grad_norm {:.4} clip {:.3} lr {:.5} {unit}/s {:.0}{}",
                r.step,
                r.total_steps,
                r.epoch,
                r.loss,
                r.grad_norm,
                r.clip_coef,
                r.lr,
                r.samples_per_sec,
                r.skip_reason.map_or(String::new(), |why| format!(" SKIPPED ({why})"))
            ),
            (false, Event::Eval(e)) => match e.perplexity {
                Some(p) => println!(
                    "eval epoch {} step {} loss {:.4} perplexity {p:.2} accuracy {:.4} ({} tokens)",
                    e.epoch, e.step, e.loss, e.accuracy, e.samples
                ),
                None => println!(
                    "eval epoch {} step {} loss {:.4} accuracy {:.4} ({} {unit})",
                    e.epoch, e.step, e.loss, e.accuracy, e.samples
                ),
            },
            (false, Event::Checkpoint(p)) => println!("checkpoint {}", p.display()),
        })
        .context("training failed")
}

/// Whether the job's device resolves to CUDA (auto picks c10d then).
/// The CUDA device the spec's model runs on, if any.
fn on_cuda(spec: &accrue_worker::JobSpec) -> Option<usize> {
    match accrue_worker::engine::resolve_device(&spec.device) {
        Ok(tch::Device::Cuda(i)) => Some(i),
        _ => None,
    }
}
