//! W = 2 against DDP + no_sync and ZeroRedundancyOptimizer under torchrun, and DistributedSampler's order.

use super::*;

/// W = 2, k = 4, b = 4 in two accrue worker processes against PyTorch's
/// DistributedDataParallel with no_sync on gloo, two processes under
/// torchrun: the same initial weights, data and DistributedSampler order,
/// loss mean / k, clip_grad_norm_ and SGD with momentum and weight decay.
/// accrue runs with `mean` (DDP's normalization) and with the default
/// `global_count` (the same on full windows: 96 samples give 3 full windows
/// per epoch). Parameters are compared tensor by tensor, and every step's
/// grad norm with clip_grad_norm_'s.
///
/// Tolerance: 1e-5 relative (docs/SEMANTICS.md's f32 bound). Both sides sum the same 32
/// per-sample gradients per step in f32, in different orders (backward per
/// micro-batch, then ring vs gloo all-reduce), so only rounding differs.
#[test]
fn two_workers_equal_pytorch_ddp_no_sync() {
    against_ddp(false, &["mean", "global_count"], &[SGD_CASE]);
}

/// ZeRO (issue 17): accrue with `[sharding] stage = 1` and `stage = 2`
/// against DDP with no_sync and torch.distributed.optim.
/// ZeroRedundancyOptimizer (SGD sharded over the two ranks),
/// clip_grad_norm_ on the full gradients; the same 1e-5 tolerance.
#[test]
fn two_workers_stages_1_and_2_equal_pytorch_zero_redundancy_optimizer() {
    against_ddp(true, &["mean"], &[SGD_CASE]);
}

/// ZeRO with Adam (L2 weight decay) and AdamW (decoupled): accrue's
/// stages 1 and 2 against ZeroRedundancyOptimizer wrapping torch.optim.Adam
/// and torch.optim.AdamW (their single-tensor CPU implementation), DDP
/// with no_sync and clip_grad_norm_ (which clips at least once); the same
/// 1e-5 tolerance (see docs/SEMANTICS.md, ZeRO).
#[test]
fn two_workers_stages_1_and_2_with_adam_and_adamw_equal_pytorch_zero_redundancy_optimizer() {
    against_ddp(true, &["mean"], &[ADAM_CASE, ADAMW_CASE]);
}

/// One optimizer setting of the DDP comparison: (tag, accrue's
/// [optimizer] table, the reference's case, torch's optimizer class).
type OptimizerCase = (&'static str, &'static str, &'static str, &'static str);

const SGD_CASE: OptimizerCase = (
    "sgd",
    "kind = \"sgd\"\nlr = 0.2\nmomentum = 0.9\nweight_decay = 0.01\n",
    r#"{"optimizer": "sgd", "lr": 0.2, "momentum": 0.9, "weight_decay": 0.01}"#,
    "SGD",
);

const ADAM_CASE: OptimizerCase = (
    "adam",
    "kind = \"adam\"\nlr = 0.01\nweight_decay = 0.01\n",
    r#"{"optimizer": "adam", "lr": 0.01, "weight_decay": 0.01}"#,
    "Adam",
);

const ADAMW_CASE: OptimizerCase = (
    "adamw",
    "kind = \"adamw\"\nlr = 0.01\nweight_decay = 0.1\n",
    r#"{"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.1}"#,
    "AdamW",
);

/// The DDP comparison above for each of `optimizers`, optionally with
/// sharded optimizer state on both sides (`zero`: accrue's stages 1 and 2,
/// ZeroRedundancyOptimizer).
fn against_ddp(zero: bool, normalizes: &[&str], optimizers: &[OptimizerCase]) {
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    prepare(d, 96);
    let max_norm = 0.2;
    let cases: Vec<serde_json::Value> = optimizers
        .iter()
        .map(|(tag, _, case, _)| {
            let mut c: serde_json::Value = serde_json::from_str(case).unwrap();
            c["tag"] = serde_json::json!(tag);
            c
        })
        .collect();
    let cfg = serde_json::json!({
        "seed": 11, "batch": 4, "k": 4, "epochs": 2, "max_norm": max_norm, "zero": zero,
        "cases": cases,
    });
    let stages: &[u32] = if zero { &[1, 2] } else { &[0] };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/ddp_reference.py");
    let mut ddp = Torchrun::start(
        &python(),
        &script,
        2,
        d,
        &[d.to_str().unwrap(), &cfg.to_string()],
    );
    // accrue runs while torchrun starts its two Pythons.
    let mut runs = Vec::new();
    for &(tag, table, _, _) in optimizers {
        for normalize in normalizes {
            for &stage in stages {
                let text = tensors_mlp_job(
                    "ddp",
                    d,
                    "cpu",
                    2,
                    4,
                    &format!(
                        r#"[accumulation]
steps = 4
normalize = "{normalize}"
[clipping]
max_norm = {max_norm}
[optimizer]
{table}[comm]
timeout_s = 20
connect_timeout_s = 30
[sharding]
stage = {stage}
"#
                    ),
                );
                let out = d.join(format!("accrue-{tag}-{normalize}-{stage}"));
                std::fs::create_dir_all(&out).unwrap();
                let ranks = run_ranks(&out, &text, 2, |_| {});
                let norms: Vec<f64> = ranks[0]
                    .steps()
                    .iter()
                    .map(|r| r["grad_norm"].as_f64().unwrap())
                    .collect();
                let model =
                    Tensor::read_safetensors(out.join("ckpt/step-6/model.safetensors")).unwrap();
                runs.push((
                    tag,
                    format!("{tag}, {normalize}, stage {stage}"),
                    model,
                    norms,
                ));
            }
        }
    }
    let status = ddp
        .wait(Duration::from_secs(300))
        .unwrap_or_else(|| panic!("torchrun did not finish:\n{}", ddp.logs()));
    assert!(status.success(), "torchrun failed:\n{}", ddp.logs());
    let init = Tensor::read_safetensors(d.join("init.safetensors")).unwrap();
    for &(tag, _, _, class) in optimizers {
        let ddp_model = |r: usize| {
            Tensor::read_safetensors(d.join(format!("ddp-{tag}-rank{r}.safetensors"))).unwrap()
        };
        let want = ddp_model(0);
        // DDP's replicas are identical (the reference is sane).
        assert_eq!(differences(&ddp_model(1), &want), (0.0, 0.0), "{tag}");
        let report: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(d.join(format!("ddp-{tag}-rank0.json"))).unwrap(),
        )
        .unwrap();
        assert_eq!(report["world"], 2);
        let optimizer = if zero {
            format!("ZeroRedundancyOptimizer({class})")
        } else {
            class.to_string()
        };
        let wrapper = if zero {
            "ZeroRedundancyOptimizer"
        } else {
            class
        };
        assert_eq!(report["optimizer"], wrapper, "{tag}");
        assert_eq!(report["local_optimizer"], class, "{tag}");
        let want_norms: Vec<f64> = report["norms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(want_norms.len(), 6, "{tag}: 3 windows per epoch, 2 epochs");
        assert!(
            want_norms.iter().any(|&n| n > max_norm),
            "{tag}: clipping must act at least once: {want_norms:?}"
        );
        let (moved, _) = differences(&want, &init);
        assert!(
            moved > 1e-2,
            "{tag}: training must move the weights ({moved})"
        );
        for (_, what, model, norms) in runs.iter().filter(|r| r.0 == tag) {
            let (abs, rel) = differences(model, &want);
            let norm_rel = norm_differences(norms, &want_norms);
            eprintln!(
                "accrue W=2 k=4 ({what}) vs DDP no_sync + {optimizer}: parameters max abs diff {abs:e}, max rel diff {rel:e}; grad norm max rel diff {norm_rel:e}"
            );
            assert!(
                rel < 1e-5,
                "{what}: accrue and DDP differ by {rel:e} (relative)"
            );
            assert!(
                norm_rel < 1e-5,
                "{what}: grad norms {norms:?} vs DDP {want_norms:?}"
            );
        }
    }
}

/// Shards equal torch.utils.data.DistributedSampler's, shuffled or not, for
/// padding and drop_last, including a seed above 2^32.
#[test]
fn sampler_equals_distributed_sampler() {
    let cases: serde_json::Value = serde_json::from_str(&torch_reference(&["sampler"])).unwrap();
    let cases = cases.as_array().unwrap();
    assert!(cases.len() >= 5);
    for c in cases {
        let s = ShardSpec {
            len: c["n"].as_u64().unwrap() as usize,
            world: c["world"].as_u64().unwrap() as usize,
            seed: c["seed"].as_u64().unwrap(),
            shuffle: c["shuffle"].as_bool().unwrap(),
            drop_last: c["drop_last"].as_bool().unwrap(),
            pad: true,
            offset: 0,
        };
        let epoch = c["epoch"].as_u64().unwrap();
        for (rank, want) in c["ranks"].as_array().unwrap().iter().enumerate() {
            let want: Vec<usize> = want
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(s.indices(rank, epoch), want, "case {c} rank {rank}");
        }
    }
}
