//! ZeRO stage 1 (issue 17): W engines in threads over the real TCP ring on
//! loopback, stage 1 against stage 0 (the whole optimizer state on every
//! rank, itself checked against PyTorch elsewhere): the same parameters
//! within 1e-6 for W = 1..4, SGD with momentum, Adam and AdamW, every
//! normalize mode, norm 2 and inf, clip by value, a parameter count not
//! divisible by W, a non-finite gradient on one rank, and checkpoints that
//! resume across stages and world sizes.

mod common;

use accrue_worker::comm::{bind, RingConfig, TcpRing};
use accrue_worker::engine::{Engine, RunOptions};
use common::*;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tch::Tensor;
use tempfile::TempDir;

/// One rank's end: final parameters, skipped steps, optimizer-state bytes.
type RankEnd = (Vec<(String, Tensor)>, u64, usize);

/// Runs `text` on W ranks (threads, one engine each, a fresh ring) with
/// `opts(rank)`; returns every rank's final parameters, skipped steps and
/// optimizer-state bytes.
fn run(text: &str, world: usize, opts: impl Fn(usize) -> RunOptions) -> Vec<RankEnd> {
    let ls: Vec<_> = (0..world).map(|_| bind("127.0.0.1:0").unwrap()).collect();
    let addrs: Vec<String> = ls
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect();
    let handles: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let (addrs, spec, opts) = (addrs.clone(), spec(text), opts(rank));
            std::thread::spawn(move || {
                let mut cfg = RingConfig::new("zero", rank, world, addrs, b"zero".to_vec());
                cfg.timeout = Duration::from_secs(20);
                cfg.connect_timeout = Duration::from_secs(20);
                let ring = TcpRing::start(Some(l), cfg).unwrap();
                let mut e = Engine::new(spec, ring, opts).unwrap_or_else(|e| panic!("{e}"));
                let s = e.run(|_| {}).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                let params = e
                    .parameters()
                    .iter()
                    .map(|(n, t)| (n.clone(), t.detach().copy()))
                    .collect::<Vec<_>>();
                (params, s.state.skipped_steps, e.optimizer_state_bytes())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn in_dir(dir: PathBuf) -> impl Fn(usize) -> RunOptions {
    move |_| RunOptions {
        checkpoint_dir: Some(dir.clone()),
        ..Default::default()
    }
}

/// An MLP 6-13-4 (147 parameters: not divisible by 2 or 4).
fn job(normalize: &str, tables: &str, stage: u32) -> String {
    mlp_job(64, 4, 2, normalize, "")
        .replace("hidden = [16]", "hidden = [13]")
        .replace(
            "[optimizer]\nkind = \"sgd\"\nlr = 0.1\nmomentum = 0.9\nweight_decay = 0.001\n",
            "",
        )
        + tables
        + &format!("\n[sharding]\nstage = {stage}\n")
}

const SGD: &str = "[optimizer]\nkind = \"sgd\"\nlr = 0.1\nmomentum = 0.9\nweight_decay = 0.001\n[clipping]\nmax_norm = 0.5\n";
const ADAM: &str = "[optimizer]\nkind = \"adam\"\nlr = 0.01\nweight_decay = 0.01\n[clipping]\nmax_norm = 0.2\nnorm_type = inf\n";
const ADAMW: &str = "[optimizer]\nkind = \"adamw\"\nlr = 0.01\n[clipping]\nclip_value = 0.05\n";

fn assert_same(a: &[(String, Tensor)], b: &[(String, Tensor)], what: &str) {
    let d = max_rel_diff(a, b);
    assert!(d <= 1e-6, "{what}: max relative difference {d:e}");
}

#[test]
fn stage_1_equals_stage_0_for_w_1_to_4() {
    let cases = [("global_count", SGD), ("mean", ADAM), ("sum", ADAMW)];
    for world in 1..=4 {
        for (normalize, tables) in cases {
            let what = format!("W={world} {normalize} {}", tables.lines().nth(1).unwrap());
            let d0 = TempDir::new().unwrap();
            let d1 = TempDir::new().unwrap();
            let zero = run(&job(normalize, tables, 0), world, in_dir(d0.path().into()));
            let one = run(&job(normalize, tables, 1), world, in_dir(d1.path().into()));
            assert_same(&one[0].0, &zero[0].0, &what);
            for (r, (p, _, _)) in one.iter().enumerate() {
                assert_eq!(max_rel_diff(p, &one[0].0), 0.0, "{what}: rank {r} differs");
            }
            // Each rank holds its slice's state only: together, one whole.
            let whole = zero[0].2;
            assert!(whole > 0);
            assert_eq!(one.iter().map(|x| x.2).sum::<usize>(), whole, "{what}");
            for (r, x) in one.iter().enumerate() {
                assert!(
                    x.2 <= whole / world + 16,
                    "{what}: rank {r} holds {} of {whole}",
                    x.2
                );
            }
            // The checkpoints hold the whole optimizer state by PyTorch's
            // names, the same under both stages.
            let state = |d: &Path| {
                let last = accrue_worker::checkpoint::list_steps(d).unwrap();
                let file = d.join(format!(
                    "step-{}/optimizer.safetensors",
                    last.last().unwrap()
                ));
                let mut t = Tensor::read_safetensors(file).unwrap();
                t.sort_by(|a, b| a.0.cmp(&b.0));
                t
            };
            let (s0, s1) = (state(d0.path()), state(d1.path()));
            assert!(!s0.is_empty());
            assert_same(&s1, &s0, &format!("{what}: optimizer state"));
        }
    }
}

/// Sample 5 holds a NaN: one rank's gradient is non-finite, the global norm
/// assembled from the shards is too, and every rank skips the step.
#[test]
fn a_non_finite_gradient_on_one_rank_skips_on_every_rank() {
    let d = TempDir::new().unwrap();
    let x = Tensor::randn([64, 6], (tch::Kind::Float, tch::Device::Cpu));
    let _ = x.get(5).get(0).fill_(f64::NAN);
    let y = Tensor::arange(64, (tch::Kind::Int64, tch::Device::Cpu)).remainder(4);
    let path = d.path().join("nan.safetensors");
    Tensor::write_safetensors(&[("x", &x), ("y", &y)], &path).unwrap();
    let with_nan = |stage| {
        job("global_count", SGD, stage).replace(
            "kind = \"synthetic\"\nsamples = 64\neval_samples = 0\nshape = [6]\nclasses = 4\n",
            &format!(
                "kind = \"tensors\"\nshuffle = false\npath = \"{}\"\n",
                path.display()
            ),
        )
    };
    assert!(with_nan(1).contains("nan.safetensors"));
    let zero = run(&with_nan(0), 3, in_dir(d.path().join("a")));
    let one = run(&with_nan(1), 3, in_dir(d.path().join("b")));
    for (r, (_, skipped, _)) in one.iter().enumerate() {
        assert_eq!(
            *skipped, 2,
            "rank {r}: sample 5 is in one window of each epoch"
        );
    }
    assert_eq!(zero[0].1, 2);
    assert_same(&one[0].0, &zero[0].0, "with a NaN on one rank");
}

/// A checkpoint written under stage 1 at W = 4 resumes under stage 0 at
/// W = 2, and one written under stage 0 resumes under stage 1: the end
/// equals the same stop-and-resume under stage 0 throughout.
#[test]
fn checkpoints_resume_across_stages_and_world_sizes() {
    let text = |stage| job("global_count", ADAM, stage);
    let stop = |dir: PathBuf| {
        move |_| RunOptions {
            checkpoint_dir: Some(dir.clone()),
            stop_after_steps: Some(5),
            ..Default::default()
        }
    };
    let resume = |dir: PathBuf| {
        move |_| RunOptions {
            checkpoint_dir: Some(dir.clone()),
            resume: true,
            ..Default::default()
        }
    };
    let d = TempDir::new().unwrap();
    let (a, b, c) = (d.path().join("a"), d.path().join("b"), d.path().join("c"));
    // Reference: stage 0 at W = 4, then stage 0 at W = 2.
    run(&text(0), 4, stop(a.clone()));
    let reference = run(&text(0), 2, resume(a));
    // Stage 1 at W = 4, then stage 0 at W = 2.
    run(&text(1), 4, stop(b.clone()));
    let one_then_zero = run(&text(0), 2, resume(b));
    assert_same(
        &one_then_zero[0].0,
        &reference[0].0,
        "stage 1 W=4 -> stage 0 W=2",
    );
    // Stage 0 at W = 4, then stage 1 at W = 2.
    run(&text(0), 4, stop(c.clone()));
    let zero_then_one = run(&text(1), 2, resume(c));
    assert_same(
        &zero_then_one[0].0,
        &reference[0].0,
        "stage 0 W=4 -> stage 1 W=2",
    );
}
