//! The `accrue` command-line client: submit, status, list, cancel, resume,
//! watch and
//! local (an embedded coordinator plus N worker processes on loopback),
//! dev-certs (a CA, certificates and tokens for a cluster).

pub mod certs;
mod lifecycle;
mod local;
pub mod out;
mod status;
pub mod tokenize;
mod watch;

pub use watch::{fmt_eta, rewatch, step_line, watch, REWATCH_LIMIT};

use accrue_common::JobSpec;
use accrue_proto::tls::{ClientTls, Transport};
use accrue_proto::v1::{self, job_event, job_service_client::JobServiceClient, Job, JobState};
use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

#[derive(Parser)]
#[command(
    name = "accrue",
    version,
    about = "accrue: distributed training with exact gradient accumulation"
)]
pub struct Cli {
    /// The coordinator's gRPC address: HOST:PORT (https:// with --ca,
    /// http:// without), or a URL whose scheme agrees. `accrue local`
    /// writes it, with the CA and a token file, to `<state-dir>/env`.
    #[arg(
        long,
        global = true,
        env = "ACCRUE_COORDINATOR",
        default_value = "127.0.0.1:50051"
    )]
    pub coordinator: String,
    /// Bearer token sent with every call (its scopes decide what is
    /// allowed). Prefer the environment variable or --token-file: a flag is
    /// visible to other users in the process list.
    #[arg(long, global = true, env = "ACCRUE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// A file holding the bearer token (surrounding whitespace ignored).
    #[arg(long, global = true, env = "ACCRUE_TOKEN_FILE", value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// The cluster CA (PEM) that signed the coordinator's certificate:
    /// connect over TLS.
    #[arg(long, global = true, env = "ACCRUE_CA")]
    pub ca: Option<PathBuf>,
    /// Connect in plaintext (no TLS): anyone on the path can read and
    /// change what is sent. Contradicts --ca.
    #[arg(long, global = true, env = "ACCRUE_INSECURE")]
    pub insecure: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Submit a job spec (TOML); prints the job id.
    Submit {
        job: PathBuf,
        /// Watch until the job ends; exit 0 only if it succeeded.
        #[arg(long)]
        wait: bool,
    },
    /// One job in detail, or every job.
    Status { job: Option<String> },
    /// Every job, one line each.
    List,
    /// Cancel a job.
    Cancel { job: String },
    /// Resume a failed or cancelled job under the same id: it is scheduled
    /// again and goes on from the newest checkpoint in its folder.
    Resume {
        job: String,
        /// Watch until the job ends; exit 0 only if it succeeded.
        #[arg(long)]
        wait: bool,
    },
    /// Follow a job: progress bar (plain lines when not a terminal).
    Watch {
        job: String,
        /// Print every job event as one JSON object per line (step
        /// reports with their timing split and byte counters, transitions,
        /// evaluations) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Run a job on an embedded coordinator and N worker processes on loopback.
    Local {
        job: PathBuf,
        /// Worker processes (default: the spec's `workers`); a number that
        /// differs from the spec's replaces it, and says so.
        #[arg(long)]
        workers: Option<u32>,
        /// Coordinator state, checkpoints and logs.
        #[arg(long, default_value = "runs/local")]
        state_dir: PathBuf,
        /// The worker binary (default: accrue-worker next to this binary).
        #[arg(long)]
        worker_bin: Option<PathBuf>,
        /// libtorch intra-op threads per worker when the spec sets none
        /// (default: the host's cores divided by --workers, at least 1, as
        /// torchrun sets OMP_NUM_THREADS for several processes per node).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        threads: Option<u32>,
        /// Print every job event as one JSON object per line (step reports
        /// with their timing split and byte counters) instead of text.
        #[arg(long)]
        json: bool,
        /// Continue the newest job of this spec (by its name) in
        /// --state-dir, interrupted, failed or cancelled, from its newest
        /// checkpoint, instead of submitting a new one.
        #[arg(long)]
        resume: bool,
    },
    /// Write a cluster CA, the coordinator's certificate, worker client
    /// certificates, etcd server and client certificates and a tokens file
    /// into DIR (for development and small clusters; keys and tokens mode
    /// 0600).
    DevCerts {
        dir: PathBuf,
        /// Extra names (DNS or IP) of the coordinator's (and etcd's)
        /// certificate, besides
        /// localhost and 127.0.0.1; repeat or separate with commas.
        #[arg(long, value_delimiter = ',')]
        san: Vec<String>,
        /// Worker ids to write client certificates for (worker-<id>.pem).
        #[arg(long, value_delimiter = ',')]
        workers: Vec<String>,
        /// Days the coordinator and worker certificates are valid (the CA:
        /// ten times as long).
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
    /// Text files, folders or prompt/completion JSON lines into a token
    /// file (llm.c's .bin or safetensors rows) and its tokenizer.json.
    Tokenize(tokenize::TokenizeArgs),
    /// Continue a prompt with a llama checkpoint: `accrue sample STEP_DIR
    /// --prompt TEXT [--max-tokens N --temperature T --top-k K --seed S
    /// --device D --tokenizer PATH]` (runs `accrue-worker sample`, next to
    /// this binary, with the same arguments; `--help` shows them).
    #[command(disable_help_flag = true)]
    Sample {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
        args: Vec<std::ffi::OsString>,
    },
}

/// The CLI's command: [`Cli`] with the coordinator's connection flags
/// hidden from the help of the verbs that talk to no coordinator
/// (`tokenize`, `dev-certs`). Each gets hidden flags of the same names,
/// which clap then does not propagate the global ones over; the values
/// are never read there.
pub fn command() -> clap::Command {
    use clap::{Arg, ArgAction, CommandFactory};
    let hidden = |sub: clap::Command| {
        sub.arg(
            Arg::new("coordinator")
                .long("coordinator")
                .hide(true)
                .default_value("127.0.0.1:50051"),
        )
        .arg(Arg::new("token").long("token").hide(true))
        .arg(
            Arg::new("token_file")
                .long("token-file")
                .hide(true)
                .value_parser(clap::value_parser!(PathBuf)),
        )
        .arg(
            Arg::new("ca")
                .long("ca")
                .hide(true)
                .value_parser(clap::value_parser!(PathBuf)),
        )
        .arg(
            Arg::new("insecure")
                .long("insecure")
                .hide(true)
                .action(ArgAction::SetTrue),
        )
    };
    Cli::command()
        .mut_subcommand("tokenize", hidden)
        .mut_subcommand("dev-certs", hidden)
}

/// The CLI's transport from `--ca` / `--insecure` (one of them is needed);
/// plaintext warns.
pub fn transport(ca: Option<PathBuf>, insecure: bool) -> anyhow::Result<Option<ClientTls>> {
    Ok(match accrue_proto::tls::cli_transport(ca, insecure)? {
        Transport::Tls(t) => Some(t),
        Transport::Plaintext => {
            tracing::warn!("--insecure: talking to the coordinator in plaintext");
            None
        }
    })
}

impl Cli {
    /// The token to send, from --token / ACCRUE_TOKEN or --token-file /
    /// ACCRUE_TOKEN_FILE (both set is an error: which one was meant?).
    pub fn bearer(&self) -> anyhow::Result<BearerToken> {
        match (&self.token, &self.token_file) {
            (Some(_), Some(_)) => bail!(
                "both --token (or ACCRUE_TOKEN) and --token-file (or ACCRUE_TOKEN_FILE) are set; give one"
            ),
            (Some(t), None) => BearerToken::new(t).context("--token (or ACCRUE_TOKEN)"),
            (None, Some(f)) => {
                let text = std::fs::read_to_string(f)
                    .with_context(|| format!("cannot read the token file {}", f.display()))?;
                BearerToken::new(text.trim())
                    .with_context(|| format!("token file {}", f.display()))
            }
            (None, None) => Ok(BearerToken::default()),
        }
    }
}

/// Sends `authorization: Bearer <token>` with every call (nothing when
/// there is no token).
#[derive(Clone, Default)]
pub struct BearerToken(Option<MetadataValue<Ascii>>);

impl BearerToken {
    pub fn new(token: &str) -> anyhow::Result<Self> {
        if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
            bail!("the token must be non-empty visible ASCII without spaces");
        }
        let mut v: MetadataValue<Ascii> = format!("Bearer {token}")
            .parse()
            .context("the token is not a valid header value")?;
        v.set_sensitive(true);
        Ok(Self(Some(v)))
    }
}

impl tonic::service::Interceptor for BearerToken {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// A JobService client that sends the token with every call.
pub type Client = JobServiceClient<InterceptedService<Channel, BearerToken>>;

pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    // Only the verbs that talk to a coordinator need its CA (or --insecure)
    // and a token; `local` brings its own, `dev-certs` makes them.
    let remote = !matches!(
        cli.command,
        Command::Local { .. }
            | Command::DevCerts { .. }
            | Command::Tokenize(_)
            | Command::Sample { .. }
    );
    let (token, tls) = if remote {
        (cli.bearer()?, transport(cli.ca.clone(), cli.insecure)?)
    } else {
        (BearerToken::default(), None)
    };
    let url = cli.coordinator.as_str();
    let connect_as = |url: &str, token: &BearerToken| {
        let (url, token, tls) = (url.to_string(), token.clone(), tls.clone());
        async move { connect_client(&url, tls.as_ref(), &token).await }
    };
    match cli.command {
        Command::Tokenize(args) => tokenize_cmd(&args),
        Command::Sample { args } => sample_cmd(&args),
        Command::Submit { job, wait } => {
            // A spec the fields check refuses is refused here, before
            // any connection (the coordinator checks it again).
            JobSpec::load_fields(&job)?;
            let mut client = connect_as(url, &token).await?;
            let j = submit(&mut client, &job, None).await?;
            println!("{}", j.id);
            if wait {
                let end = watch(&mut client, &j.id, false).await?;
                return Ok(exit_for(&end));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { job: Some(id) } => {
            let mut client = connect_as(url, &token).await?;
            let j = client
                .get_job(v1::GetJobRequest { id })
                .await
                .map_err(status_err)?
                .into_inner();
            status::print_job(&j);
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { job: None } | Command::List => {
            let mut client = connect_as(url, &token).await?;
            println!("{}", status::list_header());
            // Every page, in creation order, printed as it comes.
            let mut pages = Pages::default();
            while let Some(jobs) = pages.next(&mut client).await? {
                for j in jobs {
                    println!("{}", status::list_row(&j));
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Cancel { job } => {
            let mut client = connect_as(url, &token).await?;
            let j = client
                .cancel_job(v1::CancelJobRequest { id: job })
                .await
                .map_err(status_err)?
                .into_inner();
            println!("{} {}", j.id, state_name(j.state()));
            Ok(ExitCode::SUCCESS)
        }
        Command::Resume { job, wait } => {
            let mut client = connect_as(url, &token).await?;
            let j = client
                .resume_job(v1::ResumeJobRequest { id: job })
                .await
                .map_err(status_err)?
                .into_inner();
            // The resume's own transition (the job may be placed already).
            let why = j
                .history
                .iter()
                .rev()
                .find(|h| h.to == JobState::Pending as i32)
                .map_or("", |h| h.reason.as_str());
            println!("{}: {why}", j.id);
            if wait {
                let end = watch(&mut client, &j.id, false).await?;
                return Ok(exit_for(&end));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Watch { job, json } => {
            let mut client = connect_as(url, &token).await?;
            let end = watch(&mut client, &job, json).await?;
            Ok(exit_for(&end))
        }
        Command::Local {
            job,
            workers,
            state_dir,
            worker_bin,
            threads,
            json,
            resume,
        } => {
            let opts = local::LocalOptions {
                workers,
                state_dir,
                worker_bin,
                threads,
                json,
                insecure: cli.insecure,
                resume,
            };
            local::local(&job, opts).await
        }
        Command::DevCerts {
            dir,
            san,
            workers,
            days,
        } => {
            let w = certs::dev_certs(
                &dir,
                &certs::DevCerts {
                    sans: san,
                    workers,
                    days,
                },
            )?;
            if w.reused_ca {
                println!("signed with the existing CA in {}", dir.display());
            }
            if !w.tokens {
                println!("kept the existing tokens.toml");
            }
            for f in &w.files {
                println!("wrote {}", f.display());
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `accrue sample`: the model runs in `accrue-worker` (libtorch), which
/// replaces this process with the same arguments.
fn sample_cmd(args: &[std::ffi::OsString]) -> anyhow::Result<ExitCode> {
    use std::os::unix::process::CommandExt;
    let bin = std::env::current_exe()?.with_file_name("accrue-worker");
    if !bin.exists() {
        bail!(
            "worker binary {} not found (build it with `cargo build -p accrue-worker`)",
            bin.display()
        );
    }
    let err = std::process::Command::new(&bin)
        .arg("sample")
        .args(args)
        .exec();
    Err(anyhow::Error::new(err).context(format!("cannot run {}", bin.display())))
}

/// `accrue tokenize`: CPU-bound and synchronous, off the async workers.
fn tokenize_cmd(args: &tokenize::TokenizeArgs) -> anyhow::Result<ExitCode> {
    if let Some(dir) = &args.dump_gpt2_files {
        let (vocab, merges) = tokenize::dump_gpt2_files(dir)?;
        println!("wrote {}", vocab.display());
        println!("wrote {}", merges.display());
        return Ok(ExitCode::SUCCESS);
    }
    let summary = tokio::task::block_in_place(|| tokenize::tokenize(args))?;
    for line in summary.lines() {
        println!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}

fn exit_for(j: &Job) -> ExitCode {
    if j.state() == JobState::Succeeded {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// The coordinator's job list, page by page, in creation order.
#[derive(Default)]
pub(crate) struct Pages {
    token: String,
    done: bool,
}

impl Pages {
    /// The next page's jobs; None after the last.
    pub(crate) async fn next(&mut self, client: &mut Client) -> anyhow::Result<Option<Vec<Job>>> {
        if self.done {
            return Ok(None);
        }
        let page = client
            .list_jobs(v1::ListJobsRequest {
                page_size: accrue_proto::layout::MAX_PAGE_SIZE as i32,
                page_token: self.token.clone(),
            })
            .await
            .map_err(status_err)?
            .into_inner();
        if page.next_page_token.is_empty() {
            self.done = true;
        } else if page.next_page_token == self.token {
            bail!("the coordinator answered the same page token twice");
        }
        self.token = page.next_page_token;
        Ok(Some(page.jobs))
    }
}

/// An evaluation's numbers in words: accuracy and loss, or a language
/// model's loss per token and perplexity (`-` when it had no target).
pub(crate) fn eval_words(e: &v1::EvalResult, lm: bool) -> String {
    if lm {
        match accrue_coordinator::http::perplexity(e.loss) {
            Some(p) => format!("perplexity {p:.2} (loss {:.4} per token)", e.loss),
            None => "perplexity - (no target token evaluated)".to_string(),
        }
    } else {
        format!("accuracy {:.2}% (loss {:.4})", 100.0 * e.accuracy, e.loss)
    }
}

fn status_err(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", s.code(), s.message())
}

pub fn state_name(s: JobState) -> &'static str {
    accrue_coordinator::domain::state_name(s)
}

/// A JobService client for the coordinator at `url` (HOST:PORT or a URL),
/// over TLS when `tls` is given.
pub async fn connect_with(
    url: &str,
    tls: Option<&ClientTls>,
) -> anyhow::Result<JobServiceClient<Channel>> {
    // Requests above the coordinator's limit are refused there, with
    // OUT_OF_RANGE naming the size.
    Ok(JobServiceClient::new(channel(url, tls).await?)
        .max_decoding_message_size(accrue_proto::layout::MAX_RESPONSE_BYTES))
}

/// A client of the coordinator at `url`, over TLS when `tls` is given,
/// sending `token` with every call.
pub async fn connect_client(
    url: &str,
    tls: Option<&ClientTls>,
    token: &BearerToken,
) -> anyhow::Result<Client> {
    Ok(
        JobServiceClient::with_interceptor(channel(url, tls).await?, token.clone())
            .max_decoding_message_size(accrue_proto::layout::MAX_RESPONSE_BYTES),
    )
}

async fn channel(url: &str, tls: Option<&ClientTls>) -> anyhow::Result<Channel> {
    accrue_proto::tls::endpoint(url, tls)?
        .connect_timeout(Duration::from_secs(5))
        .http2_keep_alive_interval(Duration::from_secs(20))
        .connect()
        .await
        .with_context(|| format!("cannot reach the coordinator at {url}"))
}

/// Reads a spec (fields checked here; files are the workers' to check) and
/// submits it, with `workers` overriding W when given.
pub async fn submit(client: &mut Client, path: &Path, workers: Option<u32>) -> anyhow::Result<Job> {
    let mut spec = JobSpec::load_fields(path)?;
    if let Some(w) = workers {
        spec.workers = w;
    }
    let req = v1::SubmitJobRequest {
        spec: Some(accrue_proto::spec_to_proto(&spec)),
        ..Default::default()
    };
    Ok(client
        .submit_job(req)
        .await
        .map_err(status_err)?
        .into_inner())
}

/// One job event as a JSON object (`accrue local --json`): the step
/// report with its timing split and byte counters, a transition or an
/// evaluation.
pub fn event_json(ev: &v1::JobEvent) -> Option<serde_json::Value> {
    use serde_json::json;
    Some(match ev.event.as_ref()? {
        job_event::Event::Step(r) => {
            let t = r.timing.unwrap_or_default();
            json!({
                "event": "step",
                "step": r.step,
                "total_steps": r.total_steps,
                "epoch": r.epoch,
                "micro_step": r.micro_step,
                "rank": r.rank,
                "generation": r.generation,
                "loss": r.loss,
                "samples": r.samples,
                "samples_seen": r.samples_seen,
                "grad_norm": r.grad_norm,
                "clip_coef": r.clip_coef,
                "skipped": r.skipped,
                "lr": r.lr,
                "samples_per_sec": r.samples_per_sec,
                "timing": {
                    "compute_s": t.compute_s,
                    "comm_s": t.comm_s,
                    "clip_s": t.clip_s,
                    "optimizer_s": t.optimizer_s,
                },
                "bytes_sent": r.bytes_sent,
                "bytes_received": r.bytes_received,
                "loss_scale": r.loss_scale,
                "graph_replays": r.graph_replays,
                "eager_reason": r.eager_reason,
                "sync_graph_replayed": r.sync_graph_replayed,
                "sync_eager_reason": r.sync_eager_reason,
            })
        }
        job_event::Event::Transition(t) => json!({
            "event": "transition",
            "from": state_name(JobState::try_from(t.from).unwrap_or(JobState::Unspecified)),
            "to": state_name(JobState::try_from(t.to).unwrap_or(JobState::Unspecified)),
            "reason": t.reason,
        }),
        job_event::Event::Eval(e) => json!({
            "event": "eval",
            "epoch": e.epoch,
            "step": e.step,
            "loss": e.loss,
            "accuracy": e.accuracy,
            "samples": e.samples,
        }),
    })
}

#[cfg(test)]
mod words_tests {
    use super::*;

    /// Issue 37, item 13: a language model's evaluation is a perplexity
    /// (none when it saw no target), never a "final accuracy".
    #[test]
    fn an_evaluation_in_its_models_words() {
        let e = v1::EvalResult {
            loss: 2.0,
            accuracy: 0.25,
            ..Default::default()
        };
        assert_eq!(eval_words(&e, false), "accuracy 25.00% (loss 2.0000)");
        assert_eq!(
            eval_words(&e, true),
            "perplexity 7.39 (loss 2.0000 per token)"
        );
        let none = v1::EvalResult {
            loss: f64::NAN,
            ..e
        };
        assert_eq!(
            eval_words(&none, true),
            "perplexity - (no target token evaluated)"
        );
    }
}
