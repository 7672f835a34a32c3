//! Causal language models (issue 30) through the engine's lifecycle: a run
//! stopped mid-epoch and resumed ends bitwise where the straight run ends
//! (AdamW state, schedule, shuffled cursor of an llm.c token file), and
//! ZeRO stages 1 and 2 end where stage 0 ends at W = 2 (threads over the
//! real loopback ring) on a sequences file of very uneven rows, so every
//! window's token count differs between the ranks.

mod common;

use accrue_worker::engine::{Engine, Event, RunOptions};
use accrue_worker::SingleRank;
use common::*;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::path::{Path, PathBuf};
use tch::Tensor;
use tempfile::TempDir;

type Named = Vec<(String, Tensor)>;

/// Row `i` of the sequences file: its tokens and loss mask (24 rows of 1
/// to 13 tokens, cut to T + 1 = 9 by the reader; the first two tokens of
/// every third row are not predicted and row 5 is masked whole).
fn row(i: usize) -> (Vec<u16>, Vec<u8>) {
    let len = 1 + (i * 7 + i * i) % 13;
    (0..len)
        .map(|j| {
            let t = ((i * 13 + j * 5 + 1) % 64) as u16;
            (t, u8::from(!(i == 5 || (i.is_multiple_of(3) && j < 2))))
        })
        .unzip()
}

/// Targets row `i` contributes at T = 8: positions 1..=8 whose mask is 1.
fn row_targets(i: usize) -> u64 {
    let (_, mask) = row(i);
    mask.iter().skip(1).take(8).map(|&m| u64::from(m)).sum()
}

/// The 24 rows as a sequences file (tokens U16, offsets I64, loss_mask
/// U8), written with the safetensors crate.
fn sequences_file(dir: &Path) -> PathBuf {
    let (mut tokens, mut offsets, mut mask) = (Vec::<u16>::new(), vec![0i64], Vec::<u8>::new());
    for i in 0..24 {
        let (t, m) = row(i);
        tokens.extend(t);
        mask.extend(m);
        offsets.push(tokens.len() as i64);
    }
    let tb: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let ob: Vec<u8> = offsets.iter().flat_map(|t| t.to_le_bytes()).collect();
    let views = vec![
        (
            "tokens",
            TensorView::new(Dtype::U16, vec![tokens.len()], &tb).unwrap(),
        ),
        (
            "offsets",
            TensorView::new(Dtype::I64, vec![offsets.len()], &ob).unwrap(),
        ),
        (
            "loss_mask",
            TensorView::new(Dtype::U8, vec![mask.len()], &mask).unwrap(),
        ),
    ];
    let p = dir.join("rows.safetensors");
    std::fs::write(&p, safetensors::serialize(views, &None).unwrap()).unwrap();
    p
}

/// A tiny Llama (vocab 64, width 16, one layer, GQA 2:1) on `data` (the
/// [data] table's kind-specific lines), T = 8, b = 2, k = 2, AdamW with
/// warm-up and cosine, clipping; `extra` is appended.
fn llama_job(data: &str, epochs: u64, extra: &str) -> String {
    let model = tiny_llama_model(1, 2, 1, false);
    format!(
        r#"
name = "lm"
seed = 3
epochs = {epochs}
device = "cpu"
threads = 1
{model}[data]
{data}
seq_len = 8
batch_size = 2
[accumulation]
steps = 2
normalize = "global_count"
[clipping]
max_norm = 0.5
[optimizer]
kind = "adamw"
lr = 0.01
weight_decay = 0.1
[schedule]
kind = "cosine"
warmup_steps = 2
{extra}
"#
    )
}

fn tokens_data(path: &Path) -> String {
    format!(
        "kind = \"tokens\"\npath = \"{}\"\nshuffle = true",
        path.display()
    )
}

/// 24 steps straight equal 13 steps (stopped in the second epoch, its
/// shuffled cursor mid-way), then a resume to 24: bitwise.
#[test]
fn lm_resume_mid_epoch_is_bitwise() {
    let d = TempDir::new().unwrap();
    // (385 - 1) / 8 = 48 samples: 12 windows of 4 per epoch, 2 epochs.
    let data = token_file(d.path(), 385);
    let job = llama_job(&tokens_data(&data), 2, "");
    let straight = train(spec(&job), &d.path().join("a"));

    let b = d.path().join("b");
    let opts = |resume, stop| RunOptions {
        checkpoint_dir: Some(b.clone()),
        resume,
        stop_after_steps: stop,
        ..Default::default()
    };
    let mut first = Engine::new(spec(&job), SingleRank, opts(false, Some(13))).unwrap();
    let s1 = first.run(|_| {}).unwrap();
    assert!(!s1.finished);
    assert_eq!(s1.state.step, 13);
    assert_eq!(s1.state.epoch, 1, "stopped in the second epoch");
    assert!(s1.state.cursor > 0, "stopped mid-epoch: {:?}", s1.state);
    let stopped = snapshot(&first);
    drop(first);
    let mut second = Engine::new(spec(&job), SingleRank, opts(true, None)).unwrap();
    assert_eq!(second.state().step, 13);
    let s2 = second.run(|_| {}).unwrap();
    assert!(s2.finished);
    assert_eq!(s2.state.step, 24);
    let resumed = snapshot(&second);
    let rel = max_rel_diff(&resumed, &straight);
    eprintln!("resumed vs straight: {rel:e}");
    assert_eq!(
        rel, 0.0,
        "resumed run differs from the straight run by {rel:e}"
    );
    // The comparison sees a difference where there is one.
    let moved = max_rel_diff(&stopped, &straight);
    assert!(moved > 1e-4, "steps 14..24 changed nothing: {moved:e}");
}

/// Beside checkpoint folder `dir` (created by the first checkpoint only):
/// rank `rank`'s sample log.
fn sample_log(dir: &Path, rank: usize) -> PathBuf {
    let name = dir.file_name().unwrap().to_str().unwrap();
    dir.with_file_name(format!("{name}-samples-{rank}.jsonl"))
}

/// One rank's end: final parameters, optimizer-state bytes, each step's
/// reported count of targets (N, over both ranks).
type RankEnd = (Named, usize, Vec<u64>);

fn run_w(text: &str, world: usize, dir: PathBuf) -> Vec<RankEnd> {
    let text = text.to_string();
    on_ring(world, move |rank, ring| {
        let opts = RunOptions {
            checkpoint_dir: Some(dir.clone()),
            sample_log: Some(sample_log(&dir, rank)),
            ..Default::default()
        };
        let mut e = Engine::new(spec(&text), ring, opts).unwrap_or_else(|e| panic!("{e}"));
        let mut counts = Vec::new();
        e.run(|ev| {
            if let Event::Step(r) = ev {
                counts.push(r.samples);
            }
        })
        .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        let params = e
            .parameters()
            .iter()
            .map(|(n, t)| (n.clone(), t.detach().copy()))
            .collect::<Vec<_>>();
        (params, e.optimizer_state_bytes(), counts)
    })
}

fn last_optimizer_state(d: &Path) -> Named {
    // (Under ZeRO 1 and 2, one part a rank.)
    let last = accrue_worker::checkpoint::list_steps(d).unwrap();
    let step = d.join(format!("step-{}", last.last().unwrap()));
    let mut t = accrue_worker::checkpoint::read(&step).unwrap().optimizer;
    t.sort_by(|a, b| a.0.cmp(&b.0));
    t
}

/// W = 2 on uneven rows (the windows' token counts differ between the
/// ranks), AdamW and clipping: stages 1 and 2 end at stage 0's parameters
/// and optimizer state within max(1e-6, 4 x floor) each, the same on both
/// ranks, each rank holding half of the optimizer state, and checkpoints
/// holding the same whole state. The floor: stage 0 against stage 0 in
/// another valid order (one rank, k = 4: the same 8 rows a window, summed
/// on one rank), measured here. It never runs stages 1 or 2, so a broken
/// one cannot widen it; a missed reduction (a rank stepping on its own
/// rows' gradient) or a wrong shard moves the weights and Adam's moments
/// by a fraction of their size, where the floor is float32's last bits
/// amplified by AdamW.
#[test]
fn lm_zero_stages_1_and_2_equal_stage_0() {
    let d = TempDir::new().unwrap();
    let data = sequences_file(d.path());
    let text = |stage: u32, normalize: &str| {
        llama_job(
            &format!(
                "kind = \"sequences\"\npath = \"{}\"\nshuffle = true",
                data.display()
            ),
            2,
            &format!("[sharding]\nstage = {stage}\n"),
        )
        .replace("\"global_count\"", &format!("\"{normalize}\""))
    };
    let world = 2;
    let dir = |s: &str| d.path().join(s);
    let zero = run_w(&text(0, "global_count"), world, dir("s0"));
    assert_eq!(
        max_rel_diff(&zero[1].0, &zero[0].0),
        0.0,
        "stage 0: ranks differ"
    );
    // Each rank's targets per window, from its sample log: they differ.
    let mut counts = std::collections::BTreeMap::<u64, [u64; 2]>::new();
    for rank in 0..world {
        let log = std::fs::read_to_string(sample_log(&dir("s0"), rank)).unwrap();
        for line in log.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let n = v["indices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| row_targets(x.as_u64().unwrap() as usize))
                .sum();
            counts.entry(v["step"].as_u64().unwrap()).or_default()[rank] = n;
        }
    }
    eprintln!("targets per step (rank 0, rank 1): {counts:?}");
    assert_eq!(counts.len(), 6, "2 epochs of 3 windows");
    let summed: Vec<u64> = counts.values().map(|c| c[0] + c[1]).collect();
    assert_eq!(summed, zero[0].2, "the reported N is the ranks' sum");
    assert!(
        counts.values().filter(|c| c[0] != c[1]).count() >= 3,
        "the ranks' counts should differ: {counts:?}"
    );
    let whole = zero[0].1;
    assert!(whole > 0);
    let one_rank = text(0, "global_count")
        .replace("[accumulation]\nsteps = 2\n", "[accumulation]\nsteps = 4\n");
    assert!(one_rank.contains("[accumulation]\nsteps = 4\n"));
    let floor = run_w(&one_rank, 1, dir("floor"));
    let (floor_p, floor_s) = (
        max_rel_diff(&floor[0].0, &zero[0].0),
        max_rel_diff(
            &last_optimizer_state(&dir("floor")),
            &last_optimizer_state(&dir("s0")),
        ),
    );
    let (bar_p, bar_s) = (1e-6_f64.max(4.0 * floor_p), 1e-6_f64.max(4.0 * floor_s));
    eprintln!(
        "stage 0's floor (W=1, k=4): parameters {floor_p:e} (bar {bar_p:e}), \
         optimizer state {floor_s:e} (bar {bar_s:e})"
    );
    for stage in [1, 2] {
        let what = format!("stage {stage}");
        let s = run_w(&text(stage, "global_count"), world, dir(&what));
        let diff = max_rel_diff(&s[0].0, &zero[0].0);
        eprintln!("{what} vs stage 0: {diff:e}");
        assert!(
            diff <= bar_p,
            "{what}: max relative difference {diff:e}, bar {bar_p:e}"
        );
        assert_eq!(max_rel_diff(&s[1].0, &s[0].0), 0.0, "{what}: ranks differ");
        assert_eq!(s[0].1 + s[1].1, whole, "{what}: the state, split");
        for (r, x) in s.iter().enumerate() {
            assert!(
                x.1 <= whole / world + 16,
                "{what}: rank {r} holds {} of {whole}",
                x.1
            );
        }
        let (s0, s1) = (
            last_optimizer_state(&dir("s0")),
            last_optimizer_state(&dir(&what)),
        );
        assert!(!s0.is_empty());
        let diff = max_rel_diff(&s1, &s0);
        eprintln!("{what} vs stage 0: optimizer state {diff:e}");
        assert!(
            diff <= bar_s,
            "{what}: optimizer state off by {diff:e}, bar {bar_s:e}"
        );
    }
    // The counts do differ per rank: the per-micro-batch mean (stage 2)
    // ends elsewhere than the token-weighted mean.
    let mean = run_w(&text(2, "mean"), world, dir("mean"));
    let diff = max_rel_diff(&mean[0].0, &zero[0].0);
    eprintln!("stage 2 mean vs stage 0 global_count: {diff:e}");
    assert!(diff > 1e-4, "mean equals global_count: {diff:e}");
}

/// One in-process run for the staged-graph test: final parameters, per
/// step (count of targets, loss, micro-step eager reason, replays), and
/// the graph's addresses after every micro-step.
type GraphRun = (
    Named,
    Vec<(u64, f64, Option<String>)>,
    Vec<Vec<(String, usize)>>,
);

fn run_graph_body(text: &str, body_only: bool, dir: &Path) -> GraphRun {
    let opts = RunOptions {
        checkpoint_dir: Some(dir.to_path_buf()),
        graph_body_only: body_only,
        // The tensor-op step on both sides (what CUDA's graphs run).
        unfused_step: true,
        ..Default::default()
    };
    let mut e = Engine::new(spec(text), SingleRank, opts).unwrap_or_else(|e| panic!("{e}"));
    let (mut steps, mut addresses) = (Vec::new(), Vec::new());
    while !e.is_done() {
        if let Some(r) = e.micro_step().unwrap_or_else(|e| panic!("{e}")) {
            let reason = r.eager_reason.as_ref().map(|r| r.to_string());
            steps.push((r.samples, r.loss, reason));
        }
        addresses.push(e.graph_addresses());
    }
    (snapshot(&e), steps, addresses)
}

/// A language model's micro-step as a graph body (`graph_body_only`, the
/// CPU's stand-in for a capture) reads its batch from the graph's static
/// buffers, staged from the host before each run, and takes the count of
/// targets from the host: on uneven, partly masked rows (the windows'
/// counts differ) it ends bit for bit where
/// the eager run ends, with the same counts and losses per step and
/// buffers that never move. Under `normalize = "mean"` micro-steps stay
/// eager, with the reason.
#[test]
fn lm_graph_body_reads_staged_batches() {
    let d = TempDir::new().unwrap();
    let data = sequences_file(d.path());
    let text = |normalize: &str| {
        llama_job(
            &format!(
                "kind = \"sequences\"\npath = \"{}\"\nshuffle = true",
                data.display()
            ),
            2,
            "",
        )
        .replace("\"global_count\"", &format!("\"{normalize}\""))
    };
    let (eager, eager_steps, _) = run_graph_body(&text("global_count"), false, &d.path().join("e"));
    let (body, body_steps, addresses) =
        run_graph_body(&text("global_count"), true, &d.path().join("b"));
    assert_eq!(eager_steps.len(), 12, "2 epochs of 6 windows");
    let counts: Vec<u64> = body_steps.iter().map(|s| s.0).collect();
    assert!(
        counts.windows(2).any(|w| w[0] != w[1]),
        "the windows' counts should differ: {counts:?}"
    );
    for (i, (b, e)) in body_steps.iter().zip(&eager_steps).enumerate() {
        assert_eq!((b.0, b.1), (e.0, e.1), "step {}: (count, loss)", i + 1);
        assert_eq!(b.2, None, "step {}: the body ran eagerly: {:?}", i + 1, b.2);
    }
    let diff = max_rel_diff(&body, &eager);
    assert_eq!(diff, 0.0, "graph body vs eager: {diff:e}");
    let staged: Vec<_> = addresses[0]
        .iter()
        .filter(|(n, _)| n == "micro.inputs" || n == "micro.targets")
        .collect();
    assert_eq!(staged.len(), 2, "staged buffers: {:?}", addresses[0]);
    // Each tensor keeps the address it had when it was first allocated
    // (the optimizer's state appears at the first step).
    let mut first = std::collections::BTreeMap::new();
    for (i, a) in addresses.iter().enumerate() {
        for (name, at) in a {
            let was = *first.entry(name.clone()).or_insert(*at);
            assert_eq!(was, *at, "{name} moved at micro-step {}", i + 1);
        }
    }
    let (_, mean_steps, _) = run_graph_body(&text("mean"), true, &d.path().join("m"));
    let reason = mean_steps[0].2.clone().unwrap_or_default();
    assert!(
        reason.contains("its own target count"),
        "mean: eager reason {reason:?}"
    );
}

/// Per step of a run on the GPU: (count of targets, loss, grad norm,
/// micro-step replays, sync graph replayed, eager reason).
type CudaStep = (u64, f64, f64, u64, bool, Option<String>);

/// One run on the GPU: final parameters and every step.
type CudaRun = (Named, Vec<CudaStep>);

fn run_on_cuda(text: &str, dir: &Path) -> CudaRun {
    let opts = RunOptions {
        checkpoint_dir: Some(dir.to_path_buf()),
        ..Default::default()
    };
    let mut e = Engine::new(spec(text), SingleRank, opts).unwrap_or_else(|e| panic!("{e}"));
    let mut steps = Vec::new();
    while !e.is_done() {
        if let Some(r) = e.micro_step().unwrap_or_else(|e| panic!("{e}")) {
            let reason = r.eager_reason.as_ref().map(|r| r.to_string());
            steps.push((
                r.samples,
                r.loss,
                r.grad_norm,
                r.graph_replays,
                r.sync_graph_replayed,
                reason,
            ));
        }
    }
    (snapshot(&e), steps)
}

/// On the GPU (issue 31): a language model's micro-steps captured as CUDA
/// graphs (batches staged into the graph's buffers, the count taken on the
/// host) end where the same job with `cuda_graphs = false` ends, with the
/// same target counts per step and losses and grad norms within 1e-5; the
/// graphed run replays both graphs and the eager one none. fp32 under
/// AdamW: parameters within 1e-6 relative (the H100 gave 4.5e-7: the
/// graphed sync step's clip and AdamW round in another order, as the
/// MLP's do in tests/graphs.rs). bf16 under SGD: within 1e-5 (the H100
/// gave 0, 2026-11-27). bf16 under AdamW is printed, not bounded: its runs
/// agree bit for bit until that last-bit difference of the sync step
/// appears (step 7 on the H100), then bf16 weights and AdamW's normalized
/// update at lr = 0.01 grow it to 2.6e-3 by step 24. A second eager run
/// gives the run-to-run floor of the eager path itself. Every difference
/// is printed before any assertion, so one run on the device gives all
/// the numbers.
#[test]
#[ignore = "needs CUDA"]
fn lm_cuda_graphed_equals_eager() {
    if !common::cuda_or_skip("lm_cuda_graphed_equals_eager") {
        return;
    }
    let d = TempDir::new().unwrap();
    let data = sequences_file(d.path());
    let mut failures = Vec::new();
    // (precision, optimizer, asserted): bf16 under AdamW is printed, not
    // held to a bound. On the H100 (2026-11-27) its graphed and eager runs
    // gave the same losses bit for bit for 6 steps (12 with the kernels
    // off), then a grad norm 1.6e-7 apart (the graphed sync step's clip
    // and AdamW round in another order, as the MLP's do: 1.2e-7); bf16
    // weights under AdamW at lr = 0.01 turn that into 2.6e-3 by step 24.
    // SGD keeps a last-bit difference a last-bit difference, so bf16 is
    // held to its bound under SGD.
    for (precision, optimizer, asserted) in [
        ("fp32", "adamw", true),
        ("bf16", "sgd", true),
        ("bf16", "adamw", false),
    ] {
        let text = llama_job(
            &format!(
                "kind = \"sequences\"\npath = \"{}\"\nshuffle = true",
                data.display()
            ),
            4,
            "",
        )
        .replace(
            "device = \"cpu\"",
            &format!("device = \"cuda\"\nprecision = \"{precision}\""),
        )
        .replace(
            "kind = \"adamw\"\nlr = 0.01\nweight_decay = 0.1",
            &format!("kind = \"{optimizer}\"\nlr = 0.01\nweight_decay = 0.1"),
        );
        let precision = format!("{precision}-{optimizer}");
        let (graphed, g_steps) = run_on_cuda(&text, &d.path().join(format!("g-{precision}")));
        let (eager, e_steps) = run_on_cuda(
            &format!("{text}\n[performance]\ncuda_graphs = false\n"),
            &d.path().join(format!("e-{precision}")),
        );
        let (again, _) = run_on_cuda(
            &format!("{text}\n[performance]\ncuda_graphs = false\n"),
            &d.path().join(format!("a-{precision}")),
        );
        let floor = max_rel_diff(&again, &eager);
        let diff = max_rel_diff(&graphed, &eager);
        let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-30);
        let (mut loss, mut norm) = (0.0f64, 0.0f64);
        for (g, e) in g_steps.iter().zip(&e_steps) {
            loss = loss.max(rel(g.1, e.1));
            norm = norm.max(rel(g.2, e.2));
        }
        // Where the runs part: each step's loss and norm, graphed
        // against eager (relative), up to the first difference and two
        // after it.
        let parted = g_steps
            .iter()
            .zip(&e_steps)
            .position(|(g, e)| g.1 != e.1 || g.2 != e.2);
        if let Some(first) = parted {
            for (i, (g, e)) in g_steps.iter().zip(&e_steps).enumerate().skip(first).take(3) {
                eprintln!(
                    "{precision}, step {}: loss {} vs {} ({:e}), norm {} vs {} ({:e})",
                    i + 1,
                    g.1,
                    e.1,
                    rel(g.1, e.1),
                    g.2,
                    e.2,
                    rel(g.2, e.2)
                );
            }
        }
        let replays: u64 = g_steps.iter().map(|s| s.3).sum();
        let syncs = g_steps.iter().filter(|s| s.4).count();
        let eager_replays: u64 = e_steps.iter().map(|s| s.3).sum();
        eprintln!(
            "{precision}: graphed vs eager: parameters {diff:e} (eager vs eager {floor:e}), losses {loss:e}, grad norms {norm:e}; \
             {replays} micro-step replays and {syncs} sync replays in {} steps; eager reasons {:?}",
            g_steps.len(),
            e_steps.iter().map(|s| s.5.clone()).collect::<std::collections::BTreeSet<_>>()
        );
        let counts = |s: &[CudaStep]| s.iter().map(|s| s.0).collect::<Vec<_>>();
        if counts(&g_steps) != counts(&e_steps) {
            failures.push(format!(
                "{precision}: counts {:?} != {:?}",
                counts(&g_steps),
                counts(&e_steps)
            ));
        }
        if replays == 0 || syncs == 0 || eager_replays != 0 {
            failures.push(format!(
                "{precision}: replays graphed {replays} (sync {syncs}), eager {eager_replays}: {g_steps:?}"
            ));
        }
        let tol = if precision.starts_with("fp32") {
            1e-6
        } else {
            1e-5
        };
        if asserted && (diff > tol || loss > 1e-5 || norm > 1e-5) {
            failures.push(format!(
                "{precision}: parameters {diff:e} (tolerance {tol:e}), losses {loss:e}, norms {norm:e}"
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Runs worker/tests/reference/lm_cuda_reference.py `cmd` on `dir`.
fn cuda_reference(cmd: &str, dir: &Path, cfg: &serde_json::Value) -> serde_json::Value {
    let script = reference_script().with_file_name("lm_cuda_reference.py");
    let text = run_reference(&script, &[cmd, dir.to_str().unwrap(), &cfg.to_string()]);
    serde_json::from_str(text.lines().last().unwrap_or("null")).unwrap_or(serde_json::Value::Null)
}

/// The relative L2 distance of two sets of named tensors (same names).
fn l2_rel(a: &Named, b: &Named) -> f64 {
    let (mut diff, mut norm) = (0f64, 0f64);
    for ((na, ta), (nb, tb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        let (ta, tb) = (
            ta.to_device(tch::Device::Cpu).to_kind(tch::Kind::Double),
            tb.to_kind(tch::Kind::Double),
        );
        diff += (&ta - &tb)
            .square()
            .sum(tch::Kind::Double)
            .double_value(&[]);
        norm += tb.square().sum(tch::Kind::Double).double_value(&[]);
    }
    (diff / norm.max(1e-300)).sqrt()
}

/// On the GPU (issues 30 and 31): accrue's Llama under bf16 autocast on
/// CUDA (the fused operations with accrue's kernels, one product for q/k/v
/// and for gate/up, fused AdamW, CUDA graphs) against PyTorch's eager loop
/// on the same GPU from the same initial weights and batches
/// (lm_cuda_reference.py: transformers' model in plain PyTorch,
/// torch.autocast, fused AdamW), 6 steps of 2 micro-batches. bf16 has no
/// single right answer: the floor is PyTorch against itself with the
/// division by the window's token count moved (accrue's order, after the
/// window, against transformers' order, before each backward), which
/// changes only roundings. accrue must be as close to PyTorch (accrue's
/// order) as that floor, within a factor 4, or within 2e-3 for the first
/// step's loss (the same weights: forward roundings only). Every number is
/// printed before the assertions.
#[test]
#[ignore = "needs CUDA"]
fn lm_bf16_on_cuda_equals_pytorch() {
    if !common::cuda_or_skip("lm_bf16_on_cuda_equals_pytorch") {
        return;
    }
    lm_bf16_equals_pytorch("cuda");
}

/// The same on the CPU, where accrue computes transformers' chain of ops
/// itself (no fused operations): it checks the comparison's harness (the
/// reference script, the shared weights, batches and order) wherever the
/// tests run, so the GPU run can only fail on the GPU's numbers.
#[test]
fn lm_bf16_on_the_cpu_equals_pytorch() {
    lm_bf16_equals_pytorch("cpu");
}

fn lm_bf16_equals_pytorch(device: &str) {
    let d = TempDir::new().unwrap();
    // N = k * b * T = 192 targets a window: not a power of two, so moving
    // the division by N changes roundings (the floor below is not 0).
    let (t, b, k, steps) = (24usize, 4usize, 2usize, 6usize);
    token_file(d.path(), steps * k * b * t + 1);
    let model = serde_json::json!({
        "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    });
    let cfg = |order: &str| {
        serde_json::json!({
            "seed": 0, "model": model, "seq_len": t, "batch": b, "k": k, "steps": steps,
            "lr": 3e-3, "weight_decay": 0.1, "max_norm": 1.0, "order": order,
            "device": device,
        })
    };
    cuda_reference("init", d.path(), &cfg("after"));
    let text = format!(
        r#"
name = "lm-cuda"
seed = 0
max_steps = {steps}
device = "{device}"
threads = 1
precision = "bf16"
[model]
kind = "llama"
init = "{init}"
vocab_size = 64
hidden_size = 64
intermediate_size = 96
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = {t}
tie_word_embeddings = true
[data]
kind = "tokens"
path = "{data}"
seq_len = {t}
batch_size = {b}
shuffle = false
[accumulation]
steps = {k}
normalize = "global_count"
[clipping]
max_norm = 1.0
[optimizer]
kind = "adamw"
lr = 3e-3
weight_decay = 0.1
fused = true
"#,
        init = d.path().join("init.safetensors").display(),
        data = d.path().join("train.bin").display(),
    );
    let (ours, our_steps) = run_on_cuda(&text, &d.path().join("ckpt"));
    let after = cuda_reference("train", d.path(), &cfg("after"));
    let before = cuda_reference("train", d.path(), &cfg("before"));
    let series = |v: &serde_json::Value, key: &str| -> Vec<f64> {
        v[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-30);
    let worst = |a: &[f64], b: &[f64]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| rel(*x, *y))
            .fold(0f64, f64::max)
    };
    let (l_after, l_before) = (series(&after, "losses"), series(&before, "losses"));
    let (n_after, n_before) = (series(&after, "norms"), series(&before, "norms"));
    let l_ours: Vec<f64> = our_steps.iter().map(|s| s.1).collect();
    let n_ours: Vec<f64> = our_steps.iter().map(|s| s.2).collect();
    let read = |name: &str| {
        let mut v = Tensor::read_safetensors(d.path().join(name)).unwrap();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let (p_after, p_before) = (
        read("torch-after.safetensors"),
        read("torch-before.safetensors"),
    );
    let mut p_ours = ours;
    p_ours.sort_by(|a, b| a.0.cmp(&b.0));
    let floor = (
        worst(&l_before, &l_after),
        worst(&n_before, &n_after),
        l2_rel(&p_before, &p_after),
    );
    let got = (
        worst(&l_ours, &l_after),
        worst(&n_ours, &n_after),
        l2_rel(&p_ours, &p_after),
    );
    eprintln!(
        "{device} bf16 llama against PyTorch: losses {l_ours:?} vs {l_after:?}; norms {n_ours:?} vs {n_after:?}; \
         accrue (losses, norms, parameters L2) {got:?}, PyTorch's floor {floor:?}"
    );
    assert_eq!(l_ours.len(), steps, "accrue's steps");
    assert!(
        rel(l_ours[0], l_after[0]) <= 2e-3,
        "first loss {} vs {}",
        l_ours[0],
        l_after[0]
    );
    assert!(
        got.0 <= (4.0 * floor.0).max(2e-3),
        "losses {got:?} vs floor {floor:?}"
    );
    assert!(
        got.1 <= (4.0 * floor.1).max(1e-2),
        "grad norms {got:?} vs floor {floor:?}"
    );
    assert!(
        got.2 <= (4.0 * floor.2).max(1e-3),
        "parameters {got:?} vs floor {floor:?}"
    );
}
