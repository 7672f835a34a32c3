//! Fault tolerance of a causal language model (issue 30), as
//! tests/recovery.rs does it for the MLP: a worker daemon training a tiny
//! Llama on an llm.c token file is killed with SIGKILL mid-run with a spare
//! attached; the spare takes its place and the job ends at the parameters
//! of the same job run without the kill, with every sample read exactly
//! once per epoch (the daemons' sample logs, joined over ranks).

mod common;

use accrue_proto::v1::JobState;
use common::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Child;
use tempfile::TempDir;

/// One worker daemon with a sample log, slowed so a window lasts long
/// enough to be interrupted.
fn spawn_slow_worker(grpc: &str, id: &str, dir: &Path) -> Child {
    let samples = dir.join(format!("samples-{id}.jsonl"));
    let samples = samples.to_str().unwrap();
    common::spawn_worker(
        grpc,
        id,
        dir,
        &["--micro-step-delay-ms", "12", "--sample-log", samples],
    )
}

/// The committed windows of job `name` from every daemon's sample log (as
/// tests/recovery.rs reads them): step -> (epoch, rank -> indices read).
/// Of a step's attempts (told apart by world size, then by time) the
/// newest counts; a (step, rank) logged twice in one attempt (a window
/// read again after an abort) must hold the same reads.
fn committed_windows(dir: &Path, name: &str) -> BTreeMap<u64, (u64, BTreeMap<u64, Vec<u64>>)> {
    type Attempt = (u64, u64, BTreeMap<u64, Vec<u64>>); // newest t, epoch, reads
    let mut attempts: BTreeMap<(u64, u64), Attempt> = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let p: PathBuf = entry.unwrap().path();
        let file = p.file_name().unwrap().to_str().unwrap().to_string();
        if !file.starts_with("samples-") {
            continue;
        }
        for line in std::fs::read_to_string(&p).unwrap().lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            if v["job"] != name {
                continue;
            }
            let field = |k: &str| {
                v[k].as_u64()
                    .unwrap_or_else(|| panic!("{k} missing in {line}"))
            };
            let (step, epoch, world, rank, t) = (
                field("step"),
                field("epoch"),
                field("world"),
                field("rank"),
                field("t"),
            );
            let idx: Vec<u64> = v["indices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            let a = attempts
                .entry((step, world))
                .or_insert_with(|| (0, epoch, BTreeMap::new()));
            a.0 = a.0.max(t);
            assert_eq!(a.1, epoch, "ranks disagree on the epoch of step {step}");
            let prev = a.2.entry(rank).or_insert_with(|| idx.clone());
            assert_eq!(
                *prev, idx,
                "rank {rank}'s reads of step {step} differ ({file})"
            );
        }
    }
    let mut out: BTreeMap<u64, Attempt> = BTreeMap::new();
    for ((step, _), a) in attempts {
        if out.get(&step).is_none_or(|b| a.0 > b.0) {
            out.insert(step, a);
        }
    }
    out.into_iter()
        .map(|(step, (_, epoch, reads))| (step, (epoch, reads)))
        .collect()
}

/// Every step 1..=steps committed with a record from each of `world`
/// ranks, and every epoch read each of the `samples` indices exactly once
/// over all ranks.
fn assert_exact_accounting(dir: &Path, name: &str, steps: u64, epochs: u64, samples: u64) {
    let windows = committed_windows(dir, name);
    assert_eq!(
        windows.keys().copied().collect::<Vec<_>>(),
        (1..=steps).collect::<Vec<_>>(),
        "committed steps"
    );
    for (step, (_, reads)) in &windows {
        assert_eq!(reads.len(), 2, "step {step}: a record from both ranks");
    }
    for e in 0..epochs {
        let mut seen: Vec<u64> = windows
            .values()
            .filter(|w| w.0 == e)
            .flat_map(|w| w.1.values().flatten().copied())
            .collect();
        seen.sort_unstable();
        assert_eq!(
            seen,
            (0..samples).collect::<Vec<_>>(),
            "epoch {e}: every sample exactly once over both ranks' reads"
        );
    }
}

/// An llm.c token file (magic 20240520: u16 tokens) of `count` tokens
/// over a vocabulary of 64.
fn token_file(dir: &Path, count: usize) -> PathBuf {
    let mut header = [0i32; 256];
    header[0] = 20240520;
    header[1] = 1;
    header[2] = count as i32;
    let mut bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut x: u32 = 11;
    for _ in 0..count {
        x = x.wrapping_mul(1103515245).wrapping_add(12345);
        bytes.extend_from_slice(&(((x >> 16) % 64) as u16).to_le_bytes());
    }
    let p = dir.join("train.bin");
    std::fs::write(&p, bytes).unwrap();
    p
}

/// A tiny Llama (vocab 64, width 16, one layer) on `data`, T = 8, b = 4,
/// W = 2, k = 4, AdamW and clipping.
fn job(name: &str, data: &Path, epochs: u64) -> String {
    format!(
        r#"
name = "{name}"
workers = 2
seed = 11
epochs = {epochs}
device = "cpu"
threads = 1
[model]
kind = "llama"
vocab_size = 64
hidden_size = 16
intermediate_size = 32
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
max_position_embeddings = 16
[data]
kind = "tokens"
path = "{data}"
seq_len = 8
batch_size = 4
shuffle = true
[accumulation]
steps = 4
[clipping]
max_norm = 1.0
[optimizer]
kind = "adamw"
lr = 0.01
weight_decay = 0.1
[comm]
timeout_s = 10
connect_timeout_s = 30
rendezvous_timeout_s = 1.5
"#,
        data = data.display()
    )
}

/// The F32 tensors of a safetensors file by name.
fn read_f32(path: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let v = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (name, v)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Max over tensors of max|a - b| / max|b| between two safetensors files
/// (the same names).
fn relative_difference(a: &Path, b: &Path) -> f64 {
    let (a, b) = (read_f32(a), read_f32(b));
    assert_eq!(
        a.iter().map(|x| &x.0).collect::<Vec<_>>(),
        b.iter().map(|x| &x.0).collect::<Vec<_>>()
    );
    a.iter()
        .zip(&b)
        .map(|((_, x), (_, y))| {
            let diff = x
                .iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs() as f64)
                .fold(0.0, f64::max);
            let scale = y.iter().map(|q| q.abs() as f64).fold(0.0, f64::max);
            diff / scale.max(1e-12)
        })
        .fold(0.0, f64::max)
}

/// kill -9 of a rank mid-window with a spare attached: the spare takes the
/// lost rank's place and the Llama ends at the parameters of the same job
/// run without the kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lm_kill_9_mid_run_ends_at_the_undisturbed_parameters() {
    let d = TempDir::new().unwrap();
    // (1537 - 1) / 8 = 192 samples; W k b = 32: 6 windows per epoch, 18
    // steps in 3 epochs.
    let data = token_file(d.path(), 1537);
    let h = coordinator(d.path()).await;
    let grpc = h.grpc_addr.to_string();
    let ids = ["l0", "l1", "l2"];
    let mut w = Workers(
        ids.iter()
            .map(|id| spawn_slow_worker(&grpc, id, d.path()))
            .collect(),
    );
    let mut c = client(&grpc).await;
    let hurt = submit_text(&mut c, &job("lmhurt", &data, 3)).await;
    let running = wait_step(&mut c, &hurt.id, 4).await;
    assert_eq!(running.state(), JobState::Running, "{running:?}");
    let seen = running.counters.unwrap().step;
    let victim = running.workers[1].clone();
    let at = ids.iter().position(|x| *x == victim).unwrap();
    w.0[at].kill().unwrap();
    let spare: Vec<&str> = ids
        .iter()
        .copied()
        .filter(|x| !running.workers.iter().any(|r| r == x))
        .collect();
    let end = ended(&mut c, &hurt.id).await;
    assert_eq!(end.state(), JobState::Succeeded, "{end:?}");
    assert_eq!(end.recoveries.len(), 1, "{:?}", end.recoveries);
    let r = &end.recoveries[0];
    assert_eq!(r.lost, std::slice::from_ref(&victim));
    assert_eq!(r.joined, spare);
    assert_eq!((r.world_size, r.accumulation_steps), (2, 4));
    assert_eq!(
        end.workers[1], spare[0],
        "the spare takes the lost rank's place"
    );
    assert!(r.resumed_step >= 3, "{r:?}");
    eprintln!(
        "lm recovery: killed after step {seen} was seen, resumed after step {}",
        r.resumed_step
    );
    let counters = end.counters.unwrap();
    assert_eq!((counters.step, counters.total_steps), (18, 18));
    // An LM job counts targets (the tokens seen): every sample's 8, once.
    assert_eq!(counters.samples_seen, 3 * 192 * 8);
    assert_exact_accounting(d.path(), "lmhurt", 18, 3, 192);

    // The same job without the kill, on the two daemons left.
    let calm = submit_text(&mut c, &job("lmcalm", &data, 3)).await;
    let calm_end = ended(&mut c, &calm.id).await;
    assert_eq!(calm_end.state(), JobState::Succeeded, "{calm_end:?}");
    assert!(calm_end.recoveries.is_empty());
    let model = |j: &accrue_proto::v1::Job| Path::new(&j.checkpoint).join("model.safetensors");
    let diff = relative_difference(&model(&end), &model(&calm_end));
    eprintln!("final parameters, interrupted vs uninterrupted: max relative difference {diff:e}");
    assert!(diff <= 1e-5, "relative difference {diff}");

    // The comparison can tell runs apart: one epoch fewer ends elsewhere.
    let short = submit_text(&mut c, &job("lmshort", &data, 2)).await;
    let short_end = ended(&mut c, &short.id).await;
    assert_eq!(short_end.state(), JobState::Succeeded, "{short_end:?}");
    let moved = relative_difference(&model(&short_end), &model(&calm_end));
    eprintln!("2 epochs vs 3: {moved:e}");
    assert!(moved > 1e-3, "{moved}");
    h.stop().await;
}
