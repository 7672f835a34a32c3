//! ZeRO-3 (issue 41, `[sharding] stage = 3`): W engines in threads over
//! the real TCP ring on loopback, every parameter sharded over the ranks
//! and gathered block by block, against stage 0 (itself checked against
//! PyTorch elsewhere): the mlp and a tied Llama with GQA, W = 2 and 4,
//! `sync = "boundary"` and `"every_step"`, fp32 and bf16, with and without
//! activation checkpointing; checkpoints written under stage 3 resume
//! under stage 0 and the reverse.

mod common;

use accrue_worker::engine::{Engine, RunOptions};
use common::*;
use std::path::{Path, PathBuf};
use tch::Tensor;
use tempfile::TempDir;

type Named = Vec<(String, Tensor)>;

/// Every step's (loss, grad norm) and evaluation's (loss, accuracy), and
/// the final parameters of each rank.
fn run(text: &str, world: usize, dir: &Path) -> Vec<(Vec<(f64, f64)>, Named)> {
    run_with(text, world, dir, RunOptions::default())
}

/// [`run`] with `opts` (its checkpoint folder: `dir`).
fn run_with(
    text: &str,
    world: usize,
    dir: &Path,
    opts: RunOptions,
) -> Vec<(Vec<(f64, f64)>, Named)> {
    let (text, dir) = (text.to_string(), dir.to_path_buf());
    on_ring(world, move |rank, ring| {
        let opts = RunOptions {
            checkpoint_dir: Some(dir.clone()),
            ..opts.clone()
        };
        let mut e = Engine::new(spec(&text), ring, opts).unwrap_or_else(|e| panic!("{e}"));
        let mut steps = Vec::new();
        e.run(|ev| match ev {
            accrue_worker::Event::Step(r) => steps.push((r.loss, r.grad_norm)),
            // Evaluations join the list: (loss, accuracy).
            accrue_worker::Event::Eval(r) => steps.push((r.loss, r.accuracy)),
            _ => {}
        })
        .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        (steps, e.whole_parameters().unwrap())
    })
}

fn staged(text: &str, stage: u32) -> String {
    format!("{text}\n[sharding]\nstage = {stage}\n")
}

/// Stage 3 against stage 0 at W ranks (all-reduce, whole steps): every
/// rank's final parameters within `tol` (relative) and every step's loss
/// and norm within 1e-6.
fn against_stage_0(text: &str, world: usize, tol: f64, what: &str) {
    against_stage(text, world, 0, tol, StepBar::Fixed(1e-6), what);
}

/// The bar on each step's loss and norm (relative to max(|stage base's|,
/// 1)).
enum StepBar<'a> {
    Fixed(f64),
    /// max(NORM_ASSEMBLY, 4 x floor), the floor measured in the test: stage `base`
    /// against stage `base` of this job (the same windows, the same
    /// samples per step, in another valid order: micro-batches summed on
    /// one rank instead of over the ring) at this many ranks.
    Floor(&'a str, usize),
}

/// Worst relative difference of the steps' (loss, norm) pairs.
fn steps_diff(a: &[(f64, f64)], b: &[(f64, f64)]) -> f64 {
    assert_eq!(a.len(), b.len(), "step counts differ: {a:?} against {b:?}");
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1.0);
    a.iter()
        .zip(b)
        .map(|(a, b)| rel(a.0, b.0).max(rel(a.1, b.1)))
        .fold(0.0, f64::max)
}

/// Stage 3 against stage `base` as [`against_stage_0`], each step's loss
/// and norm within `steps`; returns the steps' bar it used.
fn against_stage(text: &str, world: usize, base: u32, tol: f64, steps: StepBar, what: &str) -> f64 {
    let (d0, d3) = (TempDir::new().unwrap(), TempDir::new().unwrap());
    let zero = run(&staged(text, base), world, d0.path());
    let three = run(&staged(text, 3), world, d3.path());
    assert!(zero[0].0.len() >= 2, "{what}: {:?}", zero[0].0);
    let bar = match steps {
        StepBar::Fixed(bar) => bar,
        StepBar::Floor(other, other_world) => {
            let d = TempDir::new().unwrap();
            let floor = steps_diff(
                &run(&staged(other, base), other_world, d.path())[0].0,
                &zero[0].0,
            );
            let bar = NORM_ASSEMBLY.max(4.0 * floor);
            eprintln!(
                "{what}: stage {base}'s floor (W={other_world} in another order) {floor:e}, \
                 steps' bar {bar:e}"
            );
            bar
        }
    };
    for (r, (steps, params)) in three.iter().enumerate() {
        let worst = steps_diff(steps, &zero[0].0);
        eprintln!("{what}: rank {r}: steps within {worst:e} of stage {base}'s (bar {bar:e})");
        assert!(
            worst <= bar,
            "{what}: rank {r}: steps {steps:?} {worst:e} from stage {base}'s {:?}, bar {bar:e}",
            zero[0].0
        );
        let d = max_rel_diff(params, &zero[0].1);
        eprintln!("{what}: rank {r}: {d:e}");
        assert!(d <= tol, "{what}: rank {r}: max relative difference {d:e}");
    }
    bar
}

/// An mlp 6-13-11-4 (not divisible by 2 or 4), AdamW with clipping, 16
/// held-out samples (evaluated at the end: stage 3 runs the blocks one
/// unit at a time there too).
fn mlp(sync: &str) -> String {
    mlp_job(64, 4, 2, "global_count", "")
        .replace("eval_samples = 0", "eval_samples = 16")
        .replace("hidden = [16]", "hidden = [13, 11]")
        .replace(
            "[optimizer]\nkind = \"sgd\"\nlr = 0.1\nmomentum = 0.9\nweight_decay = 0.001\n",
            "[optimizer]\nkind = \"adamw\"\nlr = 0.01\n[clipping]\nmax_norm = 0.5\n",
        )
        .replace(
            "normalize = \"global_count\"\n",
            &format!("normalize = \"global_count\"\nsync = \"{sync}\"\n"),
        )
}

#[test]
fn stage_3_mlp_equals_stage_0() {
    for world in [2, 4] {
        for sync in ["boundary", "every_step"] {
            against_stage_0(&mlp(sync), world, 1e-6, &format!("mlp W={world} {sync}"));
        }
    }
    // 18 samples over 4 ranks unpadded (5, 5, 4, 4) in windows of 2 x 2:
    // ranks
    // with empty micro-batches reduce zeros unit by unit beside ranks that
    // ran a backward (the collectives must line up).
    let uneven = mlp("every_step")
        .replace("samples = 64", "samples = 18")
        .replace("batch_size = 4", "batch_size = 2\npad = false");
    assert!(uneven.contains("samples = 18") && uneven.contains("pad = false"));
    against_stage_0(&uneven, 4, 1e-6, "mlp W=4 every_step, empty micro-batches");
    let ac = format!(
        "{}\n[performance]\nactivation_checkpointing = \"full\"\n",
        mlp("every_step")
    );
    against_stage_0(&ac, 2, 1e-6, "mlp W=2 every_step, activation checkpointing");
}

/// `model.init` under stage 3: each rank takes its chunks of the file
/// through a memory map (never the whole model). A stage-3 run at W = 4
/// writes a sharded folder (its 3 layers' shards, ranks 0 to 2 one each,
/// rank 3 none, and their index);
/// that folder, and the same weights as one bf16 file, initialise stage 3
/// and stage 0 at W = 2 alike: every step within 1e-6, the weights within
/// 1e-6. A file of another shape is refused naming the tensor.
#[test]
fn stage_3_takes_its_chunks_of_model_init() {
    let d = TempDir::new().unwrap();
    let first = d.path().join("first");
    let text = format!(
        "{}\n[checkpoint]\nmax_shard_size = \"1KB\"\n",
        staged(&mlp("boundary"), 3)
    );
    let steps = run(&text, 4, &first)[0].0.len();
    let folder = first.join(format!("step-{}", steps - 1));
    assert!(
        folder.join("model.safetensors.index.json").is_file()
            && folder.join("model-00003-of-00003.safetensors").is_file(),
        "{} holds no sharded model",
        folder.display()
    );
    let bf16 = d.path().join("bf16.safetensors");
    let weights: Named = step_model(&folder)
        .into_iter()
        .map(|(n, t)| (n, t.to_kind(tch::Kind::BFloat16)))
        .collect();
    Tensor::write_safetensors(&weights, &bf16).unwrap();
    let with_init = |path: &Path| {
        let t = mlp("every_step");
        assert!(t.contains("hidden = [13, 11]"));
        t.replace(
            "hidden = [13, 11]",
            &format!("hidden = [13, 11]\ninit = \"{}\"", path.display()),
        )
    };
    against_stage_0(&with_init(&folder), 2, 1e-6, "init from a sharded folder");
    against_stage_0(&with_init(&bf16), 2, 1e-6, "init from a bf16 file");
    // A file of another shape: refused before any step, naming it.
    let wrong = d.path().join("wrong.safetensors");
    let mut bad = step_model(&folder);
    for (n, t) in bad.iter_mut() {
        if n == "2.weight" {
            *t = Tensor::zeros([11, 12], (tch::Kind::Float, tch::Device::Cpu));
        }
    }
    Tensor::write_safetensors(&bad, &wrong).unwrap();
    let text = staged(&with_init(&wrong), 3);
    let errs = on_ring(2, move |_, ring| {
        let dir = TempDir::new().unwrap();
        Engine::new(
            spec(&text),
            ring,
            RunOptions {
                checkpoint_dir: Some(dir.path().to_path_buf()),
                ..Default::default()
            },
        )
        .err()
        .map(|e| e.to_string())
    });
    for e in errs {
        let e = e.expect("a wrong model.init was accepted");
        assert!(e.contains("2.weight") && e.contains("[11, 12]"), "{e}");
    }
}

/// A rank lost before any committed step under stage 3: no rank holds
/// the lost chunks, so the survivor builds the initial weights again by
/// the sharded build (its chunks at the new layout only) and trains on;
/// it ends where a run started at W = 1 ends.
#[test]
fn stage_3_rebuilds_its_chunks_when_a_rank_is_lost_before_any_step() {
    use accrue_worker::comm::{bind, RingConfig, TcpRing};
    let text = staged(&mlp("every_step"), 3);
    let d = TempDir::new().unwrap();
    let alone = run(&text, 1, &d.path().join("alone"));
    let dir = d.path().join("shrunk");
    let t = text.clone();
    let got = on_ring(2, move |rank, ring| {
        let opts = RunOptions {
            checkpoint_dir: Some(dir.clone()),
            ..Default::default()
        };
        let mut e = Engine::new(spec(&t), ring, opts).unwrap_or_else(|e| panic!("{e}"));
        if rank == 1 {
            return None;
        }
        // Rank 1 is gone: rank 0 alone on a ring of one.
        let l = bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let cfg = RingConfig::new("alone", 0, 1, vec![addr], b"ring".to_vec());
        e.reconfigure(TcpRing::start(Some(l), cfg).unwrap(), None)
            .unwrap_or_else(|e| panic!("{e}"));
        e.run(|_| {}).unwrap_or_else(|e| panic!("{e}"));
        Some(e.whole_parameters().unwrap())
    });
    let got = got[0].as_ref().expect("rank 0's parameters");
    let diff = max_rel_diff(got, &alone[0].1);
    eprintln!("lost before any step, rebuilt: {diff:e} from W = 1");
    assert!(diff <= 1e-6, "{diff:e}");
}

/// A tied Llama with GQA (the embedding, 3 layers, the final norm),
/// AdamW with clipping, k = 2.
fn llama(tokens: &Path) -> String {
    format!(
        r#"
name = "z3"
seed = 5
max_steps = 3
device = "cpu"
threads = 1
{model}[data]
kind = "tokens"
path = "{}"
seq_len = 8
batch_size = 2
[accumulation]
steps = 2
[clipping]
max_norm = 0.5
[optimizer]
kind = "adamw"
lr = 0.01
weight_decay = 0.1
"#,
        tokens.display(),
        model = tiny_llama_model(3, 4, 2, true),
    )
}

fn tokens(d: &Path) -> PathBuf {
    token_file(d, 4 * 3 * 2 * 2 * 8 + 1)
}

#[test]
fn stage_3_tied_llama_equals_stage_0() {
    let d = TempDir::new().unwrap();
    let text = llama(&tokens(d.path()));
    // AdamW amplifies the last bits the reduction's order changes.
    let tol = 5e-5;
    // The steps' bar: max(NORM_ASSEMBLY, 4 x stage 0's floor), the floor stage 0
    // against itself with the same windows in another valid order (one
    // rank, k = 4: the same 8 rows a step, summed on one rank; measured
    // 2.4e-7 tied, 6.0e-8 untied, the largest of the orders tried). The
    // floor never runs stage 3, so a broken stage 3 cannot widen it; a
    // missed reduction (a rank stepping on its half of the window) or a
    // wrong shard (a rank's chunk of another unit) moves the norms and
    // the losses from step 2 by far more than 4 x a floor of float32's
    // last bits. Most of stage 3's distance (6.0e-7 tied) is step 1's
    // norm, where the gradients are the same bits at W = 2: stage 3 sums
    // its squares in f64, stage 0 in float32 (clip_grad_norm_'s), which
    // no reordering of stage 0 moves; the 1e-6 minimum covers it.
    let one_rank = |t: &str, k: u32| {
        let k = format!("[accumulation]\nsteps = {k}\n");
        t.replace("[accumulation]\nsteps = 2\n", &k)
    };
    assert!(one_rank(&text, 4).contains("[accumulation]\nsteps = 4\n"));
    let bar = against_stage(
        &text,
        2,
        0,
        tol,
        StepBar::Floor(&one_rank(&text, 4), 1),
        "tied llama W=2 fp32",
    );
    // At W = 2 `every_step` is no other order than `boundary` (a sum of
    // two, the same both ways) and activation checkpointing recomputes the
    // same forward: the same windows, the same floor.
    let every = text.replace("steps = 2\n", "steps = 2\nsync = \"every_step\"\n");
    let fixed = StepBar::Fixed;
    against_stage(&every, 2, 0, tol, fixed(bar), "tied llama W=2 every_step");
    let untied = text.replace("tie_word_embeddings = true", "tie_word_embeddings = false");
    let floor = StepBar::Floor(&one_rank(&untied, 8), 1);
    against_stage(&untied, 4, 0, tol, floor, "untied llama W=4");
    let bf16 = text.replace("threads = 1", "threads = 1\nprecision = \"bf16\"");
    // bf16: stage 3 against stage 2, the same sharded arithmetic. Stage 0
    // reduces whole bf16 gradients in another order; how far that moves
    // depends on the CPU's bf16 kernels (on an AVX2-only AMD EPYC stages
    // 1, 2 and 3 all ended 1.6e-2 from stage 0 on the parameters, 2.4e-4
    // on the steps; stage 0 with its micro-batches in another valid order,
    // W = 1 and k = 4, ended 0.30 and 5.0e-3 from itself), so stage 0 is
    // no bar here.
    against_stage(&bf16, 2, 2, tol, fixed(1e-6), "tied llama W=2 bf16");
    // fp16 with the loss scaler (its scale, its skips) on every rank.
    let fp16 = every.replace("threads = 1", "threads = 1\nprecision = \"fp16\"")
        + "[loss_scaling]\ninit_scale = 32768.0\n";
    // Under fp16 every sharded stage is 1.4e-3 from stage 0 after 3
    // steps (the norm from f64 partials moves step 1's clip in the last
    // bits; fp16's rounding amplifies it, and stages 1 and 2 end at the
    // same place): stage 3 against stage 2, the same sharded arithmetic.
    let (d2, d3) = (TempDir::new().unwrap(), TempDir::new().unwrap());
    let two = run(&staged(&fp16, 2), 2, d2.path());
    let three = run(&staged(&fp16, 3), 2, d3.path());
    // At 32768 the first step overflows: every rank skips it (its norm
    // non-finite), the scale halves and the rest step.
    assert!(!three[0].0[0].1.is_finite(), "fp16: {:?}", three[0].0);
    for (r, (a, b)) in three.iter().zip(&two).enumerate() {
        for (x, y) in a.0.iter().zip(&b.0) {
            let same_skip = !x.1.is_finite() && !y.1.is_finite();
            assert!(
                (x.0 - y.0).abs() <= 1e-6 * y.0.abs()
                    && (same_skip || (x.1 - y.1).abs() <= 1e-6 * y.1.abs()),
                "fp16, rank {r}: {x:?} against stage 2's {y:?}"
            );
        }
        let d = max_rel_diff(&a.1, &b.1);
        eprintln!("tied llama W=2 fp16, every_step, against stage 2: rank {r}: {d:e}");
        assert!(d <= 1e-5, "fp16, rank {r}: {d:e} from stage 2");
    }
    let ac = format!("{text}\n[performance]\nactivation_checkpointing = \"full\"\n");
    let what = "tied llama W=2 activation checkpointing";
    against_stage(&ac, 2, 0, tol, fixed(bar), what);
    // Units kept gathered from the forward to the backward, and units
    // gathered only when needed (no prefetch): the same operations on the
    // same values, so the same bits as releasing and prefetching them
    // (with activation checkpointing too).
    for base in [&text, &every, &ac] {
        let d = TempDir::new().unwrap();
        let released = run(&staged(base, 3), 2, d.path());
        for option in ["reshard_after_forward = false", "prefetch = false"] {
            let d = TempDir::new().unwrap();
            let other = run(&format!("{}{option}\n", staged(base, 3)), 2, d.path());
            for (r, (a, b)) in other.iter().zip(&released).enumerate() {
                assert_eq!(a.0, b.0, "{option}, rank {r}: steps");
                assert_eq!(max_rel_diff(&a.1, &b.1), 0.0, "{option}, rank {r}");
            }
        }
    }
}

/// A checkpoint written under stage 3 (every rank gathering the
/// parameters for it) resumes at stage 0 on another world size, and
/// stage 0's resumes at stage 3: each continuation equals stage 0's own
/// (within float error: the reduction's order differs).
#[test]
fn stage_3_checkpoints_resume_across_stages_and_world_sizes() {
    let text = |stage| staged(&mlp("boundary").replace("epochs = 2", "epochs = 3"), stage);
    let stop = RunOptions {
        stop_after_steps: Some(5),
        ..Default::default()
    };
    let resume = RunOptions {
        resume: true,
        ..Default::default()
    };
    let d = TempDir::new().unwrap();
    let (a, b, c) = (d.path().join("a"), d.path().join("b"), d.path().join("c"));
    run_with(&text(0), 4, &a, stop.clone());
    let reference = run_with(&text(0), 2, &a, resume.clone());
    assert!(reference[0].0.len() >= 2, "{:?}", reference[0].0);
    run_with(&text(3), 4, &b, stop.clone());
    // Every rank wrote its share: the model as Hugging Face shards with
    // their index, the optimizer state in one part per rank.
    let step = b.join("step-5");
    for f in [
        "model.safetensors.index.json",
        "optimizer-00001-of-00004.safetensors",
        "optimizer-00004-of-00004.safetensors",
    ] {
        assert!(step.join(f).is_file(), "{} lacks {f}", step.display());
    }
    assert!(!step.join("model.safetensors").exists());
    let three_then_zero = run_with(&text(0), 2, &b, resume.clone());
    run_with(&text(0), 4, &c, stop);
    let zero_then_three = run_with(&text(3), 2, &c, resume);
    for (got, what) in [
        (&three_then_zero, "stage 3 W=4 -> stage 0 W=2"),
        (&zero_then_three, "stage 0 W=4 -> stage 3 W=2"),
    ] {
        let d = max_rel_diff(&got[0].1, &reference[0].1);
        eprintln!("{what}: {d:e}");
        assert!(d <= 1e-6, "{what}: max relative difference {d:e}");
        assert_eq!(got[0].0.len(), reference[0].0.len(), "{what}: steps");
    }
}

/// A tied Llama with GQA against transformers' model under FSDP2
/// (`fully_shard` on every decoder layer and on the model, gloo; the
/// reference script's "fsdp" mode): W = 2, k = 4, `global_count`,
/// clipping, AdamW, rows of very uneven length, a micro-batch without
/// targets and a fully masked row. `sync = "boundary"` against FSDP2 with
/// `set_requires_gradient_sync(False)` until each window's last
/// micro-batch, `"every_step"` against FSDP2 reducing every micro-batch.
/// Every step's loss and norm within 1e-5; the final parameters within
/// PyTorch's own floor: the larger of its two FSDP2 runs against each
/// other (the same sums, reduced per micro-batch or per window) and of
/// transformers alone (W = 1, k = 8, eager attention) against FSDP2.
#[test]
fn stage_3_llama_equals_fsdp2() {
    let _turn = lm_ddp::torchrun_turn();
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    let mut cfg = lm_ddp::config();
    cfg["model"]["tie_word_embeddings"] = true.into();
    cfg["modes"] = serde_json::json!(["global_count"]);
    cfg["reference"] = "fsdp".into();
    lm_ddp::run_script("prepare", d, &cfg);
    let mut runs = Vec::new();
    for sync in ["boundary", "every_step"] {
        let mut c = cfg.clone();
        c["sync"] = sync.into();
        let mut fsdp = common::procs::Torchrun::start(
            &python(),
            &lm_ddp::script(),
            2,
            d,
            &["train", d.to_str().unwrap(), &c.to_string()],
        );
        let out = d.join(format!("accrue-{sync}"));
        std::fs::create_dir_all(&out).unwrap();
        let text = lm_ddp::job(d, "global_count", 4, 2)
            .replace(
                "rms_norm_eps = 1e-6\n",
                "rms_norm_eps = 1e-6\ntie_word_embeddings = true\n",
            )
            .replace(
                "normalize = \"global_count\"\n",
                &format!("normalize = \"global_count\"\nsync = \"{sync}\"\n"),
            )
            + "[sharding]\nstage = 3\n";
        assert!(text.contains("tie_word_embeddings = true") && text.contains("sync = "));
        let ranks = common::procs::run_ranks(&out, &text, 2, |_| {});
        let steps = ranks[0].steps();
        let step = out.join(format!("ckpt/step-{}", steps.len()));
        let model = step_model(&step);
        // Every rank's shards load as one model in transformers.
        from_pretrained_equals(&step, &model);
        runs.push((format!("stage 3, {sync}"), sync, steps, model));
        // 2 pipeline stages x 2 data ranks, each stage's units sharded
        // over its data group: the same reference.
        let out = d.join(format!("accrue-2x2-{sync}"));
        std::fs::create_dir_all(&out).unwrap();
        let staged = text.replacen("seed = 5\n", "seed = 5\nworkers = 4\n", 1)
            + "[parallel]\npipeline = 2\n";
        assert!(staged.contains("workers = 4"));
        let ranks = common::procs::run_ranks(&out, &staged, 4, |_| {});
        let steps = ranks[0].steps();
        let step = out.join(format!("ckpt/step-{}", steps.len()));
        let model = step_model(&step);
        // Every rank of every stage wrote its share: one optimizer part
        // each, and the shards load as one model in transformers.
        for i in 1..=4 {
            let part = step.join(format!("optimizer-{i:05}-of-00004.safetensors"));
            assert!(part.is_file(), "no {}", part.display());
        }
        from_pretrained_equals(&step, &model);
        runs.push((
            format!("stage 3 in 2 x 2 stages, {sync}"),
            sync,
            steps,
            model,
        ));
        lm_ddp::finish(&mut fsdp, &format!("FSDP2 {sync}: "));
    }
    let reference = |sync: &str| d.join(format!("fsdp-{sync}-global_count-rank0"));
    let read = |sync: &str| lm_ddp::read(&reference(sync).with_extension("safetensors"));
    let mut one_cfg = cfg.clone();
    one_cfg["reference"] = serde_json::Value::Null;
    let (one, mut single) = lm_ddp::start_floor(d, &one_cfg, None);
    lm_ddp::finish(&mut single, "alone: ");
    let alone = lm_ddp::read(&one.join("ddp-global_count-rank0.safetensors"));
    let floors = [
        lm_ddp::rel_diff(&read("boundary"), &read("every_step")),
        lm_ddp::rel_diff(&alone, &read("boundary")),
    ];
    eprintln!(
        "PyTorch's floors: FSDP2 boundary vs every_step {:?}, alone vs FSDP2 {:?}",
        floors[0], floors[1]
    );
    let (floor, floor_name) = floors
        .into_iter()
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .unwrap();
    for (what, sync, steps, model) in &runs {
        let (diff, name) = lm_ddp::rel_diff(model, &read(sync));
        eprintln!(
            "{what}: parameters vs FSDP2 {diff:.3e} ({name}); PyTorch's floor {floor:.3e} \
             ({floor_name})"
        );
        lm_ddp::steps_match(steps, &reference(sync).with_extension("json"), what);
        assert!(
            diff <= 1e-5_f64.max(4.0 * floor),
            "{what}: {name} differs from FSDP2 by {diff:.3e}, PyTorch's floor {floor:.3e}"
        );
    }
}

/// Issue 41's memory bound: a Llama of 20.5 M parameters (82 MB of fp32
/// weights; AdamW: 16 bytes a parameter, 328 MB of model state at stage
/// 0) trained by two worker processes at stages 0, 2 and 3 under
/// `sync = "every_step"`; each worker's peak resident memory (the step
/// reports' VmHWM: the build and every window) must fall with the stage,
/// with headroom. Measured 583, 516 and 380 MiB (2026-11-28); the model
/// state alone would save about 120 MB (stage 2) and 240 MB (stage 3).
/// Bounds: stage 2 saves at least 30 MiB, stage 3 at least 120 MiB, and
/// stage 3 at least 60 MiB below stage 2. Stage 3 again with `model.init`
/// (stage 0's final weights, one file) built to within 25 MiB of stage
/// 3's build without it (measured 250 against 247 MiB; stage 0's build
/// peaked at 431), and stage 3 resuming stage 0's checkpoint within 25
/// MiB of it plus its optimizer chunks (329 MiB).
#[test]
fn stage_3_peak_memory_is_well_below_stage_0() {
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    let tokens = token_file(d, 4 * 2 * 2 * 33 + 1);
    let text = |stage: u32| {
        format!(
            r#"
name = "mem"
seed = 1
workers = 2
max_steps = 2
device = "cpu"
threads = 1
[model]
kind = "llama"
vocab_size = 8192
hidden_size = 384
intermediate_size = 1024
num_hidden_layers = 8
num_attention_heads = 6
max_position_embeddings = 64
[data]
kind = "tokens"
path = "{}"
seq_len = 32
batch_size = 1
shuffle = false
[accumulation]
steps = 2
sync = "every_step"
[optimizer]
kind = "adamw"
lr = 0.001
[sharding]
stage = {}
"#,
            tokens.display(),
            stage % 10,
        )
    };
    // Stage 3 again (13), initialised from stage 0's final weights (one
    // 82 MB file): each rank reads only its chunks of it.
    // And (23) resuming stage 0's checkpoint (its model and AdamW state
    // in two files, 246 MB) for a third step: each rank takes its chunks
    // through memory maps.
    let init = d.join("stage0/ckpt/step-2");
    let mut builds = Vec::new();
    let peaks: Vec<f64> = [0, 2, 3, 13, 23]
        .iter()
        .map(|&stage| {
            let out = d.join(format!("stage{stage}"));
            std::fs::create_dir_all(&out).unwrap();
            let mut text = text(stage);
            let mut extra: &[&str] = &[];
            if stage == 23 {
                copy_tree(&d.join("stage0/ckpt"), &out.join("ckpt"));
                text = text.replace("max_steps = 2", "max_steps = 3");
                extra = &["--resume"];
            }
            if stage == 13 {
                assert!(init.join("model.safetensors").is_file());
                text = text.replace(
                    "max_position_embeddings = 64\n",
                    &format!(
                        "max_position_embeddings = 64\ninit = \"{}\"\n",
                        init.display()
                    ),
                );
            }
            let ranks = common::procs::run_ranks_with(&out, &text, 2, extra, |_| {});
            // The build's peak: the "engine ready" line's.
            let built = ranks
                .iter()
                .map(|r| {
                    let log = r.stderr();
                    let ready = log
                        .lines()
                        .find(|l| l.contains("engine ready"))
                        .unwrap_or("");
                    let mib = ready.split("peak_rss_mib=").nth(1).and_then(|v| {
                        v.split(|c: char| !c.is_ascii_digit())
                            .next()?
                            .parse::<f64>()
                            .ok()
                    });
                    mib.unwrap_or_else(|| panic!("rank {}: no build peak in {ready:?}", r.rank))
                })
                .fold(0.0, f64::max);
            builds.push(built);
            ranks
                .iter()
                .flat_map(|r| r.steps())
                .map(|s| s["peak_rss_bytes"].as_f64().unwrap() / (1 << 20) as f64)
                .fold(0.0, f64::max)
        })
        .collect();
    let msg = format!(
        "peak MiB per worker: stage 0 {:.0}, stage 2 {:.0}, stage 3 {:.0}, stage 3 with model.init {:.0}, stage 3 resuming stage 0's checkpoint {:.0}",
        peaks[0], peaks[1], peaks[2], peaks[3], peaks[4]
    ) + &format!("; after the build (and the resume): {builds:.0?}");
    eprintln!("{msg}");
    assert!(peaks.iter().all(|&p| p > 100.0), "{msg}");
    assert!(peaks[0] - peaks[1] >= 30.0, "{msg}");
    assert!(peaks[0] - peaks[2] >= 120.0, "{msg}");
    assert!(peaks[1] - peaks[2] >= 60.0, "{msg}");
    // model.init read by chunks: within 25 MiB of the sharded build
    // without it (read whole, the file alone is 78 MiB).
    assert!(builds[3] - builds[2] <= 25.0, "{msg}");
    assert!(peaks[3] - peaks[2] <= 25.0, "{msg}");
    // A resume by chunks: within 25 MiB of the sharded build with its
    // AdamW chunks (2 x 41 MB = 78 MiB, which a fresh build allocates
    // only at its first step); read whole, the two files alone are 235
    // MiB.
    assert!(builds[4] - builds[2] <= 78.0 + 25.0, "{msg}");
    assert!(peaks[4] - peaks[2] <= 25.0, "{msg}");
}
