//! Mixed precision against torch.autocast and GradScaler.

use super::*;

/// Mixed precision (issue 18) against PyTorch's own loop on the CPU
/// (worker/tests/reference/amp_reference.py under torchrun, DDP on gloo
/// with no_sync): `torch.autocast("cpu", dtype)` around the forward and
/// the loss, `scaler.scale(loss / k).backward()`, `scaler.unscale_` before
/// clip_grad_norm_, `scaler.step`, `scaler.update`. bf16 and fp16, W = 1
/// and 2, k = 1 and 4; the fp16 cases train on data with one sample of
/// 1e6 (infinite in fp16), so some steps overflow: the same steps are
/// skipped on both sides and the loss scale follows the same trajectory
/// (backing off on each, growing back every `growth_interval` clean
/// steps). Tolerance: see docs/SEMANTICS.md (mixed precision).
#[test]
fn mixed_precision_equals_pytorch_autocast_and_grad_scaler() {
    amp_equals_pytorch("cpu");
}

/// The same on the GPU (both sides on cuda:0, autocast("cuda"), W = 2
/// sharing it; PyTorch's DDP on gloo with CUDA tensors). Ignored (needs
/// CUDA; on the GPU machine a worker built with ACCRUE_CUDA=1).
#[test]
#[ignore = "needs CUDA"]
fn mixed_precision_on_cuda_equals_pytorch_on_cuda() {
    if !cuda_or_skip("mixed_precision_on_cuda_equals_pytorch_on_cuda") {
        return;
    }
    amp_equals_pytorch("cuda");
}

/// accrue against amp_reference.py on `device` (cpu or cuda).
fn amp_equals_pytorch(device: &str) {
    let (lr, momentum, weight_decay, max_norm) = (0.2, 0.9, 0.01, 0.5);
    // (tag, precision, k, data, growth_interval)
    let cases = [
        ("bf16-k1", "bf16", 1, "data", 0),
        ("bf16-k4", "bf16", 4, "data", 0),
        ("fp16-k1", "fp16", 1, "overflow", 3),
        ("fp16-k4", "fp16", 4, "overflow", 2),
    ];
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/amp_reference.py");
    let dirs: Vec<TempDir> = (0..2).map(|_| TempDir::new().unwrap()).collect();
    let mut torchruns = Vec::new();
    for (w, dir) in dirs.iter().enumerate() {
        let d = dir.path();
        prepare(d, 96);
        // One sample far past fp16's range (65504).
        let data = Tensor::read_safetensors(d.join("data.safetensors")).unwrap();
        let x = data.iter().find(|(n, _)| n == "x").unwrap().1.copy();
        let y = &data.iter().find(|(n, _)| n == "y").unwrap().1;
        let _ = x.get(7).get(0).fill_(1e6);
        Tensor::write_safetensors(&[("x", &x), ("y", y)], d.join("overflow.safetensors")).unwrap();
        let cfg = serde_json::json!({
            "lr": lr, "momentum": momentum, "weight_decay": weight_decay,
            "seed": 11, "batch": 4, "epochs": 2, "max_norm": max_norm, "device": device,
            "cases": cases.iter().map(|(tag, p, k, data, gi)| serde_json::json!({
                "tag": tag, "precision": p, "k": k,
                "data": format!("{data}.safetensors"),
                "init_scale": 65536.0, "growth_interval": if *gi > 0 { *gi } else { 2000 },
            })).collect::<Vec<_>>(),
        });
        torchruns.push(Torchrun::start(
            &python(),
            &script,
            w + 1,
            d,
            &[d.to_str().unwrap(), &cfg.to_string()],
        ));
    }
    let mut worst = 0.0f64;
    let mut skipped_total = 0;
    for (w, dir) in dirs.iter().enumerate() {
        let (d, world) = (dir.path(), w + 1);
        // accrue runs while torchrun starts its Pythons.
        let runs: Vec<_> = cases
            .iter()
            .map(|(tag, precision, k, data, gi)| {
                let scaling = if *gi > 0 {
                    format!("[loss_scaling]\ninit_scale = 65536.0\ngrowth_interval = {gi}\n")
                } else {
                    String::new()
                };
                let text = format!("precision = \"{precision}\"\n")
                    + &tensors_mlp_job(
                        "amp",
                        d,
                        device,
                        2,
                        4,
                        &format!(
                            "[accumulation]\nsteps = {k}\nnormalize = \"mean\"\n[clipping]\nmax_norm = {max_norm}\n\
                             [optimizer]\nkind = \"sgd\"\nlr = {lr}\nmomentum = {momentum}\nweight_decay = {weight_decay}\n\
                             {scaling}[comm]\ntimeout_s = 20\nconnect_timeout_s = 30\n"
                        ),
                    )
                    .replace("data.safetensors", &format!("{data}.safetensors"));
                let out = d.join(format!("accrue-{tag}"));
                std::fs::create_dir_all(&out).unwrap();
                let ranks = run_ranks(&out, &text, world, |_| {});
                let latest = std::fs::read_to_string(out.join("ckpt/LATEST")).unwrap();
                let model = Tensor::read_safetensors(
                    out.join("ckpt").join(latest.trim()).join("model.safetensors"),
                )
                .unwrap();
                (tag, model, ranks[0].steps())
            })
            .collect();
        let tr = &mut torchruns[w];
        let status = tr
            .wait(Duration::from_secs(300))
            .unwrap_or_else(|| panic!("torchrun did not finish:\n{}", tr.logs()));
        assert!(status.success(), "torchrun failed:\n{}", tr.logs());
        for (tag, model, steps) in runs {
            let what = format!("{device} W={world} {tag}");
            let want = Tensor::read_safetensors(d.join(format!("amp-{tag}.safetensors"))).unwrap();
            let report: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(d.join(format!("amp-{tag}.json"))).unwrap(),
            )
            .unwrap();
            let want_steps = report["steps"].as_array().unwrap();
            assert_eq!(steps.len(), want_steps.len(), "{what}: step counts");
            let mut norm_rel = 0.0f64;
            for (i, (got, want)) in steps.iter().zip(want_steps).enumerate() {
                assert_eq!(
                    got["skipped"],
                    want["skipped"],
                    "{what}: step {} skipped",
                    i + 1
                );
                assert_eq!(
                    got["loss_scale"].as_f64().unwrap(),
                    want["scale"].as_f64().unwrap(),
                    "{what}: step {} loss scale",
                    i + 1
                );
                if want["skipped"] == false {
                    let (g, w) = (
                        got["grad_norm"].as_f64().unwrap(),
                        want["norm"].as_f64().unwrap(),
                    );
                    norm_rel = norm_rel.max((g - w).abs() / w.abs().max(1e-30));
                }
            }
            let skipped = want_steps.iter().filter(|s| s["skipped"] == true).count();
            if tag.starts_with("fp16") {
                assert!(skipped > 0, "{what}: the overflow must skip steps");
                let scales: Vec<f64> = want_steps
                    .iter()
                    .map(|s| s["scale"].as_f64().unwrap())
                    .collect();
                assert!(
                    scales.windows(2).any(|p| p[1] > p[0]),
                    "{what}: the scale must grow back at least once: {scales:?}"
                );
            }
            skipped_total += skipped;
            let (abs, rel) = differences(&model, &want);
            eprintln!(
                "accrue {what} vs torch.autocast + GradScaler: parameters max abs diff {abs:e}, max rel diff {rel:e}; grad norm max rel diff {norm_rel:e}; {} steps, {skipped} skipped",
                steps.len()
            );
            worst = worst.max(rel).max(norm_rel);
        }
    }
    assert!(skipped_total > 0);
    assert!(worst < 1e-5, "largest relative difference {worst:e}");
}

/// LeNet-5 (convolutions) and ResNet-18 (BatchNorm) under bf16 autocast on
/// the CPU against PyTorch's own loop (amp_reference.py under torchrun, one
/// process: `torch.autocast("cpu", torch.bfloat16)` around the forward and
/// the loss, backward of loss / k, clip_grad_norm_, SGD with momentum and
/// weight decay): the same initial weights (accrue's, written out for
/// PyTorch), data and DistributedSampler order, b = 4, k = 2, one thread.
/// LeNet-5 on 24 images of 1x16x16 for 6 steps with clipping acting;
/// ResNet-18 on 16 images of 3x32x32 for 2 steps (BatchNorm's statistics
/// per micro-batch on both sides) with `max_norm` above every norm, so
/// clipping never acts and every operation is the same kernel on the
/// same inputs on both sides. Parameters and BatchNorm's running
/// statistics are compared tensor by tensor, and every step's grad norm.
/// Tolerances and why (ResNet-18 bit for bit): docs/SEMANTICS.md, mixed
/// precision.
#[test]
fn conv_and_batchnorm_under_bf16_equal_pytorch_autocast() {
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    // (model, [C, H, W], samples, epochs, max_norm, whether it clips,
    // tolerance for parameters and buffers, for grad norms)
    let cases = [
        ("lenet5", [1i64, 16, 16], 24i64, 2, 0.5, true, 1e-5, 1e-5),
        ("resnet18", [3, 32, 32], 16, 1, 1000.0, false, 0.0, 5e-5),
    ];
    let (lr, momentum, weight_decay, k) = (0.05, 0.9, 0.01, 2);
    let mut rng = Mt19937::new(5);
    let engines: Vec<_> = cases
        .iter()
        .map(|&(model, [c, h, w], n, epochs, max_norm, ..)| {
            let x: Vec<f32> = (0..n * c * h * w).map(|_| rng.next_normal()).collect();
            let y: Vec<i64> = (0..n).map(|_| (rng.next_u32() % 4) as i64).collect();
            let x = Tensor::from_slice(&x).view([n, c, h, w]);
            let y = Tensor::from_slice(&y);
            let data = d.join(format!("{model}.safetensors"));
            Tensor::write_safetensors(&[("x", &x), ("y", &y)], &data).unwrap();
            let text = format!(
                r#"precision = "bf16"
name = "amp-{model}"
seed = 11
epochs = {epochs}
device = "cpu"
threads = 1
[model]
kind = "{model}"
num_classes = 4
[data]
kind = "tensors"
path = "{}"
batch_size = 4
shuffle = true
[accumulation]
steps = {k}
normalize = "mean"
[clipping]
max_norm = {max_norm:?}
[optimizer]
kind = "sgd"
lr = {lr}
momentum = {momentum}
weight_decay = {weight_decay}
"#,
                data.display()
            );
            let e = engine(spec(&text), &d.join(format!("ckpt-{model}")));
            // accrue's initial weights and buffers, for PyTorch.
            let init: Vec<(String, Tensor)> = e
                .model()
                .state()
                .map(|(n, t)| (n.clone(), t.detach().copy()))
                .collect();
            let file = d.join(format!("init-{model}.safetensors"));
            Tensor::write_safetensors(&init, file).unwrap();
            (e, init)
        })
        .collect();
    let cfg = serde_json::json!({
        "lr": lr, "momentum": momentum, "weight_decay": weight_decay,
        "seed": 11, "batch": 4, "epochs": 1, "max_norm": 0.0, "device": "cpu",
        "cases": cases.iter().map(|(model, shape, _, epochs, max_norm, ..)| serde_json::json!({
            "tag": model, "precision": "bf16", "k": k, "model": model, "shape": shape,
            "classes": 4, "data": format!("{model}.safetensors"),
            "init": format!("init-{model}.safetensors"), "epochs": epochs,
            "max_norm": max_norm,
        })).collect::<Vec<_>>(),
    });
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/amp_reference.py");
    let mut torchrun = Torchrun::start(
        &python(),
        &script,
        1,
        d,
        &[d.to_str().unwrap(), &cfg.to_string()],
    );
    // accrue trains while torchrun starts its Python.
    let ends: Vec<_> = engines
        .into_iter()
        .zip(&cases)
        .map(|((mut e, init), case)| {
            let mut steps = Vec::new();
            e.run(|ev| {
                if let accrue_worker::Event::Step(r) = ev {
                    steps.push((r.grad_norm, r.skipped, r.loss_scale, r.clip_coef));
                }
            })
            .unwrap_or_else(|e| panic!("{}: {e}", case.0));
            let state: Named = e
                .model()
                .state()
                .map(|(n, t)| (n.clone(), t.detach().copy()))
                .collect();
            (state, steps, init)
        })
        .collect();
    let status = torchrun
        .wait(Duration::from_secs(300))
        .unwrap_or_else(|| panic!("torchrun did not finish:\n{}", torchrun.logs()));
    assert!(status.success(), "torchrun failed:\n{}", torchrun.logs());
    for ((state, steps, init), case) in ends.into_iter().zip(cases) {
        let (model, _, _, _, max_norm, clips, tol, norm_tol) = case;
        let want: Named = Tensor::read_safetensors(d.join(format!("amp-{model}.safetensors")))
            .unwrap()
            .into_iter()
            .filter(|(n, _)| !n.ends_with("num_batches_tracked"))
            .collect();
        let report: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(d.join(format!("amp-{model}.json"))).unwrap(),
        )
        .unwrap();
        let want_steps = report["steps"].as_array().unwrap();
        assert_eq!(steps.len(), want_steps.len(), "{model}: step counts");
        let mut norm_rel = 0.0f64;
        for (i, (&(norm, skipped, scale, _), w)) in steps.iter().zip(want_steps).enumerate() {
            assert!(
                !skipped && w["skipped"] == false,
                "{model}: step {} skipped",
                i + 1
            );
            assert_eq!((scale, w["scale"].as_f64().unwrap()), (0.0, 0.0));
            let want_norm = w["norm"].as_f64().unwrap();
            norm_rel = norm_rel.max((norm - want_norm).abs() / want_norm.abs().max(1e-30));
        }
        let clipped = steps.iter().filter(|s| s.3 < 1.0).count();
        let torch_clipped = want_steps
            .iter()
            .filter(|s| s["norm"].as_f64().unwrap() > max_norm)
            .count();
        assert_eq!(clipped, torch_clipped, "{model}: clipped steps");
        assert_eq!(clipped > 0, clips, "{model}: {clipped} steps clipped");
        let (moved, _) = differences(&want, &init);
        assert!(
            moved > 1e-3,
            "{model}: training must move the weights ({moved})"
        );
        let (abs, rel) = differences(&state, &want);
        eprintln!(
            "accrue {model} bf16 k={k} vs torch.autocast(\"cpu\", bfloat16): parameters and buffers max abs diff {abs:e}, max rel diff {rel:e}; grad norm max rel diff {norm_rel:e}; {} steps, {clipped} clipped",
            steps.len()
        );
        assert!(
            rel <= tol,
            "{model}: parameters and buffers differ by {rel:e} > {tol:e}"
        );
        assert!(
            norm_rel <= norm_tol,
            "{model}: grad norms differ by {norm_rel:e} > {norm_tol:e}"
        );
    }
}
