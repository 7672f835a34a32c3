//! Every mesh the spec accepts trains and evaluates, from the seed and
//! from a Hugging Face `init` folder, with tied and untied embeddings:
//! data x pipeline x tensor meshes with each ZeRO stage, over real
//! `accrue-worker` processes, against the same job on one process. A
//! pipeline job's held-out evaluation equals one process's on the same
//! weights (loss, perplexity, accuracy and token count) on every rank.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use tempfile::TempDir;

/// One mesh: data, pipeline and tensor degrees and the ZeRO stage.
#[derive(Clone, Copy, Debug)]
struct Mesh {
    data: u32,
    pipeline: u32,
    tensor: u32,
    zero: u32,
}

impl Mesh {
    fn workers(&self) -> u32 {
        self.data * self.pipeline * self.tensor
    }
}

/// The tiny Llama job (4 layers, 4 heads, 2 key-value heads, vocabulary
/// 64) at `mesh`, `k` micro-batches per replica, from `init` when given,
/// evaluating on the token file after steps 2 and 4.
fn job(tokens: &Path, tied: bool, init: Option<&Path>, mesh: Mesh, k: u32) -> String {
    let mut tail = format!(
        "[eval]\nevery_steps = 2\n[sharding]\nstage = {}\n",
        mesh.zero
    );
    if mesh.pipeline > 1 || mesh.tensor > 1 {
        tail += &format!(
            "[parallel]\npipeline = {}\ntensor = {}\n",
            mesh.pipeline, mesh.tensor
        );
    }
    let mut text = tiny_llama_job(tokens, mesh.workers(), tied, &tail)
        .replacen(
            "steps = 4\n[clipping]",
            &format!("steps = {k}\n[clipping]"),
            1,
        )
        .replacen(
            "batch_size = 2\n",
            &format!("batch_size = 2\neval_path = \"{}\"\n", tokens.display()),
            1,
        );
    if let Some(init) = init {
        text = text.replacen(
            &format!("tie_word_embeddings = {tied}\n"),
            &format!(
                "tie_word_embeddings = {tied}\ninit = \"{}\"\n",
                init.display()
            ),
            1,
        );
    }
    text
}

/// One run's step reports (loss, gradient norm, tokens) and evaluations.
struct Run {
    steps: Vec<serde_json::Value>,
    evals: Vec<serde_json::Value>,
}

/// The JSON events named `event` in `stdout`.
fn events(stdout: &str, event: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == event)
        .map(|v| v[event].clone())
        .collect()
}

/// `text` on one process (its final checkpoint in `dir`).
fn alone(text: &str, dir: &Path) -> Run {
    let mut e = engine(spec(text), dir);
    let (mut steps, mut evals) = (Vec::new(), Vec::new());
    e.run(|ev| match ev {
        accrue_worker::Event::Step(r) => steps.push(serde_json::to_value(r).unwrap()),
        accrue_worker::Event::Eval(r) => evals.push(serde_json::to_value(r).unwrap()),
        _ => {}
    })
    .unwrap_or_else(|e| panic!("{e}"));
    Run { steps, evals }
}

/// `text` on its mesh's processes: rank 0's steps and the loss owner's
/// evaluations, every rank's evaluations required to be the same.
fn on_mesh(text: &str, mesh: Mesh) -> Run {
    let d = TempDir::new().unwrap();
    let ranks = common::procs::run_ranks(d.path(), text, mesh.workers() as usize, |_| {});
    let evals: Vec<_> = ranks.iter().map(|r| events(&r.stdout(), "eval")).collect();
    for (r, e) in evals.iter().enumerate() {
        assert_eq!(
            e, &evals[0],
            "{mesh:?}: rank {r}'s evaluations differ from rank 0's"
        );
    }
    Run {
        steps: ranks[0].steps(),
        evals: evals[0].clone(),
    }
}

/// The largest relative difference of `got[key]` from `want[key]` over
/// the reports, the other keys (`exact`) equal.
fn worst(
    got: &[serde_json::Value],
    want: &[serde_json::Value],
    keys: &[&str],
    exact: &[&str],
    what: &str,
) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: report count");
    let mut worst: f64 = 0.0;
    for (g, w) in got.iter().zip(want) {
        for key in exact {
            assert_eq!(g[key], w[key], "{what}: {key}");
        }
        for key in keys {
            let (a, b) = (g[key].as_f64(), w[key].as_f64());
            let (Some(a), Some(b)) = (a, b) else {
                panic!("{what}: {key} is {} against {}", g[key], w[key]);
            };
            worst = worst.max((a - b).abs() / b.abs().max(1.0));
        }
    }
    worst
}

/// The final checkpoint folder under `dir`.
fn last_step(dir: &Path) -> PathBuf {
    let mut steps: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").exists())
        .collect();
    steps.sort();
    steps
        .pop()
        .unwrap_or_else(|| panic!("no step folder in {}", dir.display()))
}

/// tied and untied, from the seed and from `init` (a Hugging Face folder
/// another run wrote), each at three meshes (2 pipeline x 2 tensor, 2 data
/// x 2 pipeline, 2 data x 2 tensor) with the ZeRO stages spread over
/// them so that every (mesh, stage) pair but one runs: every step's loss,
/// gradient norm and tokens, and every evaluation's loss, accuracy and
/// perplexity, as one process's with the same samples per step (k = 4 x
/// data), within 1e-4 relative (measured below 1e-5 where they run; a
/// mesh that drops a stage's evaluation, cuts a vocabulary matrix wrong
/// or counts a shard twice is off by 1e-2 or fails), the token count of
/// each evaluation exactly.
#[test]
fn every_mesh_trains_from_seed_and_init_and_evaluates_as_one_process() {
    let d = TempDir::new().unwrap();
    let tokens = token_file(d.path(), 4 * 4 * 2 * 8 * 2 + 1);
    let mut combo = 0;
    for tied in [false, true] {
        // The seed's run writes the folder the `init` runs start from.
        let seeded = d.path().join(format!("seeded-{tied}"));
        let plain = Mesh {
            data: 1,
            pipeline: 1,
            tensor: 1,
            zero: 0,
        };
        alone(&job(&tokens, tied, None, plain, 4), &seeded);
        let init = last_step(&seeded);
        for from in [None, Some(init.as_path())] {
            let zero = |i: u32| (combo + i) % 4;
            let meshes = [
                Mesh {
                    data: 1,
                    pipeline: 2,
                    tensor: 2,
                    zero: zero(0),
                },
                Mesh {
                    data: 2,
                    pipeline: 2,
                    tensor: 1,
                    zero: zero(1),
                },
                Mesh {
                    data: 2,
                    pipeline: 1,
                    tensor: 2,
                    zero: zero(2),
                },
            ];
            combo += 1;
            let mut refs = std::collections::HashMap::new();
            for mesh in meshes {
                let k = 4 * mesh.data;
                let what = format!(
                    "tied = {tied}, {}, {} data x {} pipeline x {} tensor, ZeRO {}",
                    if from.is_some() { "init" } else { "seed" },
                    mesh.data,
                    mesh.pipeline,
                    mesh.tensor,
                    mesh.zero
                );
                let want = refs.entry(k).or_insert_with(|| {
                    let dir = TempDir::new().unwrap();
                    alone(&job(&tokens, tied, from, plain, k), dir.path())
                });
                assert_eq!(want.evals.len(), 2, "{what}: one process's evaluations");
                assert!(
                    want.evals.iter().all(|e| e["samples"].as_u64() > Some(0)),
                    "{what}: {:?}",
                    want.evals
                );
                let got = on_mesh(&job(&tokens, tied, from, mesh, 4), mesh);
                let steps = worst(
                    &got.steps,
                    &want.steps,
                    &["loss", "grad_norm"],
                    &["samples", "step"],
                    &what,
                );
                let evals = worst(
                    &got.evals,
                    &want.evals,
                    &["loss", "accuracy", "perplexity"],
                    &["samples", "step"],
                    &what,
                );
                eprintln!("{what}: steps within {steps:.2e}, evaluations within {evals:.2e}");
                assert!(steps <= 1e-4, "{what}: steps {steps:e} from one process's");
                assert!(
                    evals <= 1e-4,
                    "{what}: evaluations {evals:e} from one process's"
                );
            }
        }
    }
}

/// `accumulation.global_batch` on a mesh with tensor ranks: every worker
/// takes k from the data degree, as the coordinator does (W = 4 at
/// 2 data x 2 tensor, global batch 16 of rows of 2: k = 16 / (2 x 2) =
/// 4), so the job's steps are those of `steps = 4`, bit for bit. Counting
/// the workers as data x pipeline made k = 8 at T = 2.
#[test]
fn global_batch_at_two_tensor_ranks_takes_k_from_the_data_degree() {
    let d = TempDir::new().unwrap();
    let tokens = token_file(d.path(), 4 * 4 * 2 * 8 * 2 + 1);
    let mesh = Mesh {
        data: 2,
        pipeline: 1,
        tensor: 2,
        zero: 0,
    };
    let by_steps = job(&tokens, false, None, mesh, 4);
    let by_batch = by_steps.replacen("steps = 4\n[clipping]", "global_batch = 16\n[clipping]", 1);
    assert_ne!(by_batch, by_steps);
    // What the step computed (not its timings).
    let numbers = |r: &Run| -> Vec<Vec<serde_json::Value>> {
        r.steps
            .iter()
            .map(|s| {
                [
                    "step",
                    "micro_step",
                    "samples",
                    "loss",
                    "grad_norm",
                    "clip_coef",
                ]
                .iter()
                .map(|k| s[k].clone())
                .collect()
            })
            .collect()
    };
    let want = on_mesh(&by_steps, mesh);
    let got = on_mesh(&by_batch, mesh);
    assert_eq!(
        numbers(&got),
        numbers(&want),
        "global_batch = 16 against steps = 4 (step, micro_step, samples, loss, norm, clip)"
    );
    assert_eq!(got.evals, want.evals);
}
