//! checkpoint-bench: what a durable checkpoint write costs
//! (docs/BENCHMARKS.md). Builds the model (ResNet-18 by default) with
//! Adam-shaped optimizer state (two tensors per parameter), serialises it
//! once, then writes it `--iters` times with fsync (every file, the step
//! folder, the parent after each rename) and `--iters` times without,
//! alternating, into `--dir`; prints the median and spread of each and
//! the manifest verification time of a read.
//!
//!   checkpoint-bench [--model resnet18] [--iters 7] [--dir /tmp/ckbench] [--keep]
use accrue_worker::checkpoint::{self, disk, owner::Owner, Payload, TrainerState, WriteOptions};
use accrue_worker::family::model::Model;
use anyhow::Context;
use clap::Parser;
use std::time::Instant;

#[derive(Parser)]
#[command(name = "checkpoint-bench")]
struct Cli {
    #[arg(long, default_value = "resnet18")]
    model: String,
    #[arg(long, default_value_t = 7)]
    iters: usize,
    #[arg(long, default_value = "/tmp/checkpoint-bench")]
    dir: std::path::PathBuf,
    /// Leave the last checkpoint in --dir (the PyTorch side of
    /// worker/benches/checkpoint_vs_pytorch.py writes the same tensors).
    #[arg(long)]
    keep: bool,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let spec: accrue_worker::spec::ModelSpec =
        toml::from_str(&format!("kind = \"{}\"", cli.model)).context("--model")?;
    let model = Model::build(&spec, &[3, 32, 32], 10, tch::Device::Cpu, 1)?;
    let tensors: Vec<(String, tch::Tensor)> = model
        .state()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    let opt: Vec<(String, tch::Tensor)> = model
        .params
        .iter()
        .flat_map(|(n, p)| ["exp_avg", "exp_avg_sq"].map(|k| (format!("{n}.{k}"), p.zeros_like())))
        .collect();
    let state = TrainerState {
        job: "bench".into(),
        job_id: "bench".into(),
        ..Default::default()
    };
    let t = Instant::now();
    let mut payload = Payload::new(&state, &tensors, &opt, u64::MAX)?;
    let serialise_s = t.elapsed().as_secs_f64();
    let bytes = payload.model.iter().map(|(_, b)| b.len()).sum::<usize>()
        + payload.optimizer.len()
        + payload.trainer.len();
    let opts = WriteOptions {
        keep: 1,
        owner: Owner {
            job_id: "bench".into(),
            cluster: String::new(),
            spec_hash: String::new(),
            created_unix_ms: 0,
        },
        protect_upto: None,
        max_shard: u64::MAX,
    };
    let _ = std::fs::remove_dir_all(&cli.dir);
    let (mut synced, mut unsynced) = (Vec::new(), Vec::new());
    for i in 0..cli.iters as u64 * 2 {
        // trainer.json says the step its folder is named after.
        payload.trainer = serde_json::to_vec_pretty(&TrainerState {
            step: i + 1,
            ..state.clone()
        })?;
        let t = Instant::now();
        if i % 2 == 0 {
            checkpoint::write_on(&mut disk::Local, &cli.dir, i + 1, &payload, &opts)?;
            synced.push(t.elapsed().as_secs_f64());
        } else {
            checkpoint::write_on(&mut disk::Unsynced, &cli.dir, i + 1, &payload, &opts)?;
            unsynced.push(t.elapsed().as_secs_f64());
        }
    }
    let t = Instant::now();
    let loaded = checkpoint::read_latest(&cli.dir)?.context("no LATEST")?;
    let read_s = t.elapsed().as_secs_f64();
    let spread = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::MAX, f64::min);
        let hi = v.iter().copied().fold(0.0, f64::max);
        format!("{:.1}..{:.1} ms", lo * 1e3, hi * 1e3)
    };
    println!(
        "{} checkpoint: {:.1} MB ({} tensors + {} optimizer tensors); serialise {:.1} ms once",
        cli.model,
        bytes as f64 / 1e6,
        tensors.len(),
        opt.len(),
        serialise_s * 1e3
    );
    println!(
        "write with fsync:    median {:.1} ms ({}, {} runs)",
        median(&mut synced.clone()) * 1e3,
        spread(&synced),
        synced.len()
    );
    println!(
        "write without fsync: median {:.1} ms ({}, {} runs)",
        median(&mut unsynced.clone()) * 1e3,
        spread(&unsynced),
        unsynced.len()
    );
    println!(
        "read + verify (sizes, CRC-32) + parse: {:.1} ms (step {})",
        read_s * 1e3,
        loaded.state.step
    );
    if !cli.keep {
        std::fs::remove_dir_all(&cli.dir).ok();
    }
    Ok(())
}
