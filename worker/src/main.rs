//! accrue-worker: `train JOB.toml` runs one rank (W = 1) of a job.
use accrue_worker::engine::{Event, RunOptions};
use accrue_worker::{Engine, JobSpec, SingleRank};
use anyhow::Context;
use clap::{Parser, Subcommand};
use std::path::PathBuf;

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
    /// Run a job as a single rank (W = 1), for debugging and small jobs.
    Train {
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
        /// Overrides the spec's intra-op thread count.
        #[arg(long)]
        threads: Option<u32>,
        /// Print one JSON object per event instead of progress lines.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Train {
            job,
            resume,
            state_dir,
            checkpoint_dir,
            stop_after_steps,
            device,
            threads,
            json,
        } => {
            let mut spec = JobSpec::load(&job)?;
            if let Some(d) = device {
                spec.device = d;
            }
            if threads.is_some() {
                spec.threads = threads;
            }
            let opts = RunOptions {
                checkpoint_dir,
                state_dir: Some(state_dir),
                resume,
                stop_after_steps,
            };
            let mut engine = Engine::new(spec, SingleRank, opts).context("cannot start the job")?;
            let summary = engine
                .run(|event| match (json, event) {
                    (true, Event::Step(r)) => println!("{}", serde_json::json!({ "event": "step", "step": r })),
                    (true, Event::Eval(e)) => println!("{}", serde_json::json!({ "event": "eval", "eval": e })),
                    (true, Event::Checkpoint(p)) => {
                        println!("{}", serde_json::json!({ "event": "checkpoint", "path": p }))
                    }
                    (false, Event::Step(r)) => println!(
                        "step {}/{} epoch {} loss {:.4} grad_norm {:.4} clip {:.3} lr {:.5} samples/s {:.0}{}",
                        r.step,
                        r.total_steps,
                        r.epoch,
                        r.loss,
                        r.grad_norm,
                        r.clip_coef,
                        r.lr,
                        r.samples_per_sec,
                        if r.skipped { " SKIPPED (non-finite gradient)" } else { "" }
                    ),
                    (false, Event::Eval(e)) => println!(
                        "eval epoch {} step {} loss {:.4} accuracy {:.4} ({} samples)",
                        e.epoch, e.step, e.loss, e.accuracy, e.samples
                    ),
                    (false, Event::Checkpoint(p)) => println!("checkpoint {}", p.display()),
                })
                .context("training failed")?;
            if !json {
                let s = &summary.state;
                println!(
                    "{} at step {}: {} samples, {} skipped steps, checkpoint {}",
                    if summary.finished {
                        "finished"
                    } else {
                        "stopped"
                    },
                    s.step,
                    s.samples_seen,
                    s.skipped_steps,
                    summary.checkpoint.display()
                );
                if let Some(e) = &summary.eval {
                    println!(
                        "final accuracy {:.2}% (loss {:.4})",
                        100.0 * e.accuracy,
                        e.loss
                    );
                }
            }
            Ok(())
        }
    }
}
