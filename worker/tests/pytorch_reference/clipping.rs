//! The engine's clipping (norm 2, inf, value) at W = 1 and 2 against one large batch in PyTorch.

use super::*;

/// One run of the engine's clipping against its PyTorch twin.
#[derive(Clone, Copy, Debug)]
struct ClipCase {
    world: usize,
    clip: Clip,
    /// "sgd": the fused CPU pass (crate::optim's CPU loop) clips; "adam": at W = 1
    /// the tensor ops over the flat buffer (FlatGrads::prepare, with
    /// `unfused_step`), at W = 2 the fused Adam pass.
    optimizer: &'static str,
}

impl ClipCase {
    /// W·b = 8, k = 4: windows of 32 samples at every W (100 samples:
    /// 32, 32, 32 and a short window of 4 per epoch).
    fn batch(&self) -> usize {
        8 / self.world
    }

    fn lr(&self) -> f64 {
        if self.optimizer == "sgd" {
            0.2
        } else {
            0.01
        }
    }

    fn job(&self, d: &Path) -> String {
        let clip = match self.clip {
            Clip::NormInf(m) => format!("max_norm = {m}\nnorm_type = inf"),
            Clip::Value(v) => format!("clip_value = {v}"),
        };
        let extra = if self.optimizer == "sgd" {
            "momentum = 0.9\nweight_decay = 0.01"
        } else {
            "weight_decay = 0.01"
        };
        tensors_mlp_job(
            "clip",
            d,
            "cpu",
            2,
            self.batch() as u64,
            &format!(
                r#"[accumulation]
steps = 4
[clipping]
{clip}
[optimizer]
kind = "{opt}"
lr = {lr}
{extra}
[comm]
timeout_s = 20
connect_timeout_s = 30
"#,
                opt = self.optimizer,
                lr = self.lr()
            ),
        )
    }

    /// The reference script's configuration (torch_reference.py clip-train).
    fn reference(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "world": self.world, "k": 4, "batch": self.batch(), "seed": 11,
            "epochs": 2, "optimizer": self.optimizer, "lr": self.lr(),
        });
        match self.clip {
            Clip::NormInf(m) => {
                v["max_norm"] = m.into();
                v["norm_type"] = "inf".into();
            }
            Clip::Value(c) => v["clip_value"] = c.into(),
        }
        v
    }

    /// Trains with the engine (W = 1 in this process, W = 2 as two worker
    /// processes over the TCP ring) and returns the final parameters and
    /// each step's (grad_norm, clip_coef).
    fn run(&self, d: &Path, out: &Path) -> (Named, Vec<(f64, f64)>) {
        std::fs::create_dir_all(out).unwrap();
        let text = self.job(d);
        if self.world == 1 {
            let mut e = if self.optimizer == "adam" {
                let opts = RunOptions {
                    checkpoint_dir: Some(out.join("ckpt")),
                    unfused_step: true,
                    ..Default::default()
                };
                Engine::new(spec(&text), SingleRank, opts).unwrap_or_else(|e| panic!("{e}"))
            } else {
                engine(spec(&text), &out.join("ckpt"))
            };
            let mut steps = Vec::new();
            e.run(|ev| {
                if let accrue_worker::Event::Step(r) = ev {
                    steps.push((r.grad_norm, r.clip_coef));
                }
            })
            .unwrap_or_else(|e| panic!("{e}"));
            return (snapshot(&e), steps);
        }
        let ranks = run_ranks(out, &text, self.world, |_| {});
        let steps = ranks[0]
            .steps()
            .iter()
            .map(|r| {
                (
                    r["grad_norm"].as_f64().unwrap(),
                    r["clip_coef"].as_f64().unwrap(),
                )
            })
            .collect::<Vec<_>>();
        let model = Tensor::read_safetensors(
            out.join(format!("ckpt/step-{}/model.safetensors", steps.len())),
        )
        .unwrap();
        (model, steps)
    }
}

/// The engine's own clipping path (the flat buffer's norm, then the fused
/// SGD pass or the tensor ops over the buffer) against
/// torch.nn.utils.clip_grad_norm_ with norm_type = inf and
/// clip_grad_value_, inside whole training runs at W = 1 and at W = 2 (two
/// worker processes, the real ring): the same initial weights and the same
/// windows of samples (DistributedSampler order) give the same parameters
/// and the same per-step norm. PyTorch computes one batch per window.
///
/// Tolerance: 1e-5 relative per tensor and per norm (f32; the engine sums
/// per micro-batch, then over ranks, and applies 1/count and the clip
/// coefficient as one factor, so only rounding differs: the f32 bound of docs/SEMANTICS.md).
#[test]
fn clipping_equals_pytorch() {
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    prepare(d, 100);
    let cases = [
        (1, Clip::NormInf(0.15), "sgd"),
        (1, Clip::NormInf(0.15), "adam"),
        (1, Clip::Value(0.05), "sgd"),
        (1, Clip::Value(0.05), "adam"),
        (2, Clip::NormInf(0.15), "sgd"),
        (2, Clip::Value(0.05), "adam"),
    ]
    .map(|(world, clip, optimizer)| ClipCase {
        world,
        clip,
        optimizer,
    });
    let configs: Vec<_> = cases.iter().map(|c| c.reference()).collect();
    let prefix = d.join("reference-");
    // PyTorch trains while the engine does.
    let reference = std::process::Command::new(python())
        .arg(reference_script())
        .arg("clip-train")
        .arg(d)
        .arg(serde_json::to_string(&configs).unwrap())
        .arg(&prefix)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let runs: Vec<_> = cases
        .iter()
        .enumerate()
        .map(|(i, case)| case.run(d, &d.join(format!("case{i}"))))
        .collect();
    let out = reference.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "clip-train failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reference: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    for (i, case) in cases.iter().enumerate() {
        let r = &reference[i];
        let want_norms: Vec<f64> = r["norms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(
            want_norms.len(),
            8,
            "{case:?}: 4 windows per epoch, 2 epochs"
        );
        let (params, steps) = &runs[i];
        let want =
            Tensor::read_safetensors(format!("{}{i}.safetensors", prefix.display())).unwrap();
        let (abs, rel) = differences(params, &want);
        let norms: Vec<f64> = steps.iter().map(|s| s.0).collect();
        let norm_rel = norm_differences(&norms, &want_norms);
        eprintln!(
            "{case:?}: parameters max abs diff {abs:e}, max rel diff {rel:e}; grad norm max rel diff {norm_rel:e}"
        );
        assert!(
            rel < 1e-5,
            "{case:?}: parameters differ by {rel:e} (relative)"
        );
        assert!(
            norm_rel < 1e-5,
            "{case:?}: grad norms differ by {norm_rel:e}: {norms:?} vs {want_norms:?}"
        );
        match case.clip {
            Clip::NormInf(max_norm) => {
                // Clipping must act on some steps and not on others, and
                // the engine must agree on which.
                let clipped = r["clipped_steps"].as_u64().unwrap() as usize;
                assert!(
                    (1..8).contains(&clipped),
                    "{case:?}: clip_grad_norm_ acted on {clipped} of 8 steps"
                );
                let engine_clipped = steps.iter().filter(|s| s.1 < 1.0).count();
                assert_eq!(engine_clipped, clipped, "{case:?}: {steps:?}");
                for (n, c) in steps {
                    let want = (max_norm / (n + 1e-6)).min(1.0);
                    assert!(
                        (c - want).abs() <= 1e-12,
                        "{case:?}: clip_coef {c} for norm {n}"
                    );
                }
            }
            Clip::Value(_) => {
                assert!(
                    r["clamped_elements"].as_u64().unwrap() > 0,
                    "{case:?}: clip_grad_value_ must clamp something"
                );
                assert!(
                    steps.iter().all(|s| s.1 == 1.0),
                    "{case:?}: no norm clipping"
                );
            }
        }
    }
}
