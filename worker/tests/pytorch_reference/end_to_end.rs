//! Whole training runs against PyTorch (SGD, Adam, AdamW, fused), on the CPU and on CUDA.

use super::*;

/// The same MLP, initial weights and data order trained by PyTorch with one
/// large batch per step (SGD momentum + weight decay + clip_grad_norm_) ends
/// where the engine's k = 4, b = 8 run ends; PyTorch loads the engine's
/// model.safetensors strictly.
#[test]
fn end_to_end_equals_pytorch() {
    let rel = e2e(
        "sgd",
        "momentum = 0.9\nweight_decay = 0.01\nnesterov = true",
        0.2,
        r#""momentum":0.9,"weight_decay":0.01,"nesterov":true"#,
        "cpu",
    );
    assert!(
        rel < 1e-5,
        "engine and PyTorch (SGD) differ by {rel:e} (relative)"
    );
}

/// The same run on `cuda:0` against PyTorch training on CUDA: SGD and
/// AdamW. Tolerance as on the CPU, 1e-5 relative: the MLP has no
/// convolutions, so no TF32 (matmuls stay fp32 by default on both sides);
/// an early GPU run measured 2.1e-7 for this kind of run, and an H100
/// 2.4e-7 (SGD) and 2.0e-7 (AdamW) (docs/BENCHMARKS.md section 10).
/// Ignored (needs CUDA): scripts/gpu-checks.sh runs it.
#[test]
#[ignore = "needs CUDA"]
fn end_to_end_on_cuda_equals_pytorch_on_cuda() {
    if !cuda_or_skip("end_to_end_on_cuda_equals_pytorch_on_cuda") {
        return;
    }
    let sgd = e2e(
        "sgd",
        "momentum = 0.9\nweight_decay = 0.01\nnesterov = true",
        0.2,
        r#""momentum":0.9,"weight_decay":0.01,"nesterov":true"#,
        "cuda:0",
    );
    let adamw = e2e(
        "adamw",
        "weight_decay = 0.01",
        0.01,
        r#""weight_decay":0.01"#,
        "cuda:0",
    );
    eprintln!("cuda: SGD within {sgd:e}, AdamW within {adamw:e} of PyTorch on CUDA");
    assert!(
        sgd < 1e-5,
        "engine and PyTorch (SGD, CUDA) differ by {sgd:e}"
    );
    assert!(
        adamw < 1e-5,
        "engine and PyTorch (AdamW, CUDA) differ by {adamw:e}"
    );
}

/// Adam and AdamW (PyTorch's for-loop implementation) through the same run.
#[test]
fn end_to_end_adam_and_adamw_equal_pytorch() {
    for kind in ["adam", "adamw"] {
        let rel = e2e(
            kind,
            "weight_decay = 0.01",
            0.01,
            r#""weight_decay":0.01"#,
            "cpu",
        );
        assert!(
            rel < 1e-5,
            "engine and PyTorch ({kind}) differ by {rel:e} (relative)"
        );
    }
}

/// `fused = true` against PyTorch's `fused=True` Adam and AdamW (the
/// same ATen kernel on both sides, so the same numbers up to the
/// gradients' rounding). The fused step must also not be the for-loop
/// one: its parameters differ from the default's.
#[test]
fn end_to_end_fused_adam_and_adamw_equal_pytorch_fused() {
    for kind in ["adam", "adamw"] {
        let rel = e2e(
            kind,
            "weight_decay = 0.01\nfused = true",
            0.01,
            r#""weight_decay":0.01,"fused":true"#,
            "cpu",
        );
        eprintln!("fused {kind}: within {rel:e} of PyTorch's fused=True");
        assert!(
            rel < 1e-5,
            "engine and PyTorch ({kind}, fused) differ by {rel:e} (relative)"
        );
    }
}

/// One optimizer's steps against PyTorch's on the same gradients: three
/// Adam or AdamW steps of four parameters (66,000 elements) at changing
/// learning rates, on `device`, accrue's with `fused` and PyTorch's with
/// `torch_fused` (`fused=True`, else its for-loop implementation); the
/// number of elements of the parameters and moments that differ, and the
/// largest difference.
fn adam_steps(kind: &str, fused: bool, torch_fused: bool, device: tch::Device) -> (u64, f64) {
    use accrue_worker::optim::Optimizer;
    use accrue_worker::spec::{OptimizerKind, OptimizerSpec};
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    let spec = OptimizerSpec {
        kind: if kind == "adam" {
            OptimizerKind::Adam
        } else {
            OptimizerKind::Adamw
        },
        lr: 0.01,
        momentum: 0.0,
        dampening: 0.0,
        nesterov: false,
        weight_decay: Some(0.05),
        betas: None,
        eps: None,
        fused,
    };
    let lrs = [0.01, 0.004, 0.0025];
    tch::manual_seed(17);
    let shapes: [&[i64]; 4] = [&[1000], &[200, 300], &[5000], &[1, 1]];
    let opts = (tch::Kind::Float, tch::Device::Cpu);
    let mut start: Vec<(String, Tensor)> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("p.{i}"), Tensor::randn(*s, opts)))
        .collect();
    for step in 0..lrs.len() {
        for (i, s) in shapes.iter().enumerate() {
            start.push((format!("g.{step}.{i}"), Tensor::randn(*s, opts)));
        }
    }
    Tensor::write_safetensors(&start, d.join("start.safetensors")).unwrap();
    let on = |t: &Tensor| t.to_device(device);
    let pairs: Vec<(Tensor, Tensor)> = (0..shapes.len())
        .map(|i| (on(&start[i].1), on(&start[i].1).zeros_like()))
        .collect();
    let mut opt = Optimizer::new(&spec, shapes.len());
    for (step, &lr) in lrs.iter().enumerate() {
        for (i, (_, g)) in pairs.iter().enumerate() {
            g.shallow_clone()
                .copy_(&start[shapes.len() * (step + 1) + i].1);
        }
        opt.step_pairs(&pairs, lr).unwrap();
    }
    let mut ours: Vec<(String, Tensor)> = Vec::new();
    for (i, (p, _)) in pairs.iter().enumerate() {
        ours.push((format!("p.{i}"), p.to_device(tch::Device::Cpu)));
    }
    for (name, t) in opt.named_state(
        &(0..shapes.len())
            .map(|i| (format!("{i}"), pairs[i].0.shallow_clone()))
            .collect::<Vec<_>>(),
    ) {
        // "<param>.<state>" -> "<state>.<param>"
        let (param, state) = name.split_once('.').unwrap();
        ours.push((format!("{state}.{param}"), t.to_device(tch::Device::Cpu)));
    }
    Tensor::write_safetensors(&ours, d.join("accrue.safetensors")).unwrap();
    let torch_device = if device == tch::Device::Cpu {
        "cpu"
    } else {
        "cuda"
    };
    let cfg = format!(
        r#"{{"kind":"{kind}","weight_decay":0.05,"fused":{torch_fused},"lrs":{lrs:?},"device":"{torch_device}"}}"#
    );
    let out = torch_reference(&["adam-steps", d.to_str().unwrap(), &cfg]);
    eprintln!(
        "{kind} (fused = {fused}) on {torch_device} against PyTorch's (fused={torch_fused}): {out}"
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["device"].as_str().unwrap().starts_with(torch_device));
    (
        v["differ"].as_u64().unwrap(),
        v["max_abs_diff"].as_f64().unwrap(),
    )
}

/// `fused = true` is PyTorch's `fused=True` to the bit on the same
/// gradients: the same kernel with the same numbers (step count, learning
/// rate, hyper-parameters) in the same order. It is not the for-loop
/// step: that one rounds some elements differently (within 1e-6).
#[test]
fn fused_adam_and_adamw_steps_are_pytorchs_fused_steps_to_the_bit() {
    for kind in ["adam", "adamw"] {
        let (differ, worst) = adam_steps(kind, true, true, tch::Device::Cpu);
        assert_eq!(
            differ, 0,
            "{kind}: {differ} elements differ, by up to {worst:e}"
        );
        let (differ, worst) = adam_steps(kind, true, false, tch::Device::Cpu);
        assert!(
            differ > 0 && worst < 1e-6,
            "{kind}: the fused step against PyTorch's for-loop one: {differ} elements differ, by up to {worst:e}"
        );
    }
}

/// The same on CUDA, where the fused kernel is the point (one launch per
/// step). Ignored (needs CUDA): scripts/gpu-checks.sh runs it.
#[test]
#[ignore = "needs CUDA"]
fn fused_adamw_on_cuda_is_pytorchs_fused_step() {
    if !cuda_or_skip("fused_adamw_on_cuda_is_pytorchs_fused_step") {
        return;
    }
    let (differ, worst) = adam_steps("adamw", true, true, tch::Device::Cuda(0));
    assert_eq!(differ, 0, "{differ} elements differ, by up to {worst:e}");
}

/// Trains the e2e MLP with the engine (k = 4, b = 8, clipping) and PyTorch
/// (one batch of 32 per step), both on `device` (cpu or cuda:N), and returns
/// their largest relative difference.
fn e2e(kind: &str, optimizer: &str, lr: f64, cfg_extra: &str, device: &str) -> f64 {
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    torch_reference(&["e2e-prepare", d.to_str().unwrap()]);
    let job = tensors_mlp_job(
        "e2e",
        d,
        device,
        3,
        8,
        &format!(
            r#"[accumulation]
steps = 4
[clipping]
max_norm = 0.5
[optimizer]
kind = "{kind}"
lr = {lr}
{optimizer}
"#
        ),
    );
    let ckpt = d.join("ckpt");
    let mut e = engine(spec(&job), &ckpt);
    let mut clipped = 0;
    let summary = e
        .run(|ev| {
            if let accrue_worker::Event::Step(r) = ev {
                clipped += (r.clip_coef < 1.0) as u32;
            }
        })
        .unwrap();
    assert_eq!(
        summary.state.step, 12,
        "100 samples, windows of 32: 4 steps per epoch"
    );
    assert!(clipped > 0, "the test must exercise clipping");
    let model = summary.checkpoint.join("model.safetensors");
    let torch_device = if device == "cpu" { "cpu" } else { "cuda" };
    let cfg = format!(
        r#"{{"optimizer":"{kind}","lr":{lr},{cfg_extra},"seed":11,"batch":8,"k":4,"epochs":3,"max_norm":0.5,"device":"{torch_device}"}}"#
    );
    let out = torch_reference(&[
        "e2e-compare",
        d.to_str().unwrap(),
        model.to_str().unwrap(),
        &cfg,
    ]);
    eprintln!("pytorch reference ({kind}): {out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["steps"], 12);
    assert!(
        v["device"].as_str().unwrap().starts_with(torch_device),
        "PyTorch ran on {} for {device}",
        v["device"]
    );
    assert!(
        v["max_change_from_init"].as_f64().unwrap() > 1e-2,
        "training must move the weights: {out}"
    );
    v["max_rel_diff"].as_f64().unwrap()
}
