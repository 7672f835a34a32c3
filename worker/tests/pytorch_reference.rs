//! The engine against PyTorch itself (the installed torch 2.11.0): clipping,
//! DistributedSampler order, and a whole training run.

mod common;

use accrue_worker::clip;
use accrue_worker::sampler::ShardSpec;
use common::*;
use tch::Tensor;
use tempfile::TempDir;

fn get(named: &[(String, Tensor)], name: &str) -> Tensor {
    named
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("{name} missing"))
        .1
        .copy()
}

fn assert_close(a: &Tensor, b: &Tensor, what: &str) {
    let diff = (a - b).abs().max().double_value(&[]);
    let scale = b.abs().max().double_value(&[]).max(1e-30);
    assert!(
        diff / scale < 1e-6,
        "{what}: relative difference {:e}",
        diff / scale
    );
}

/// clip_grad_norm_ (norm 2 and inf) and clip_grad_value_ on the same
/// gradients, once where clipping bites and once where it does not.
#[test]
fn clipping_equals_pytorch() {
    let dir = TempDir::new().unwrap();
    let file = dir.path().join("clip.safetensors");
    torch_reference(&["clip", file.to_str().unwrap()]);
    let named = Tensor::read_safetensors(&file).unwrap();
    for case in ["big", "small"] {
        let fresh = || {
            (0..4)
                .map(|i| get(&named, &format!("{case}.grad.{i}")))
                .collect::<Vec<_>>()
        };
        for (tag, norm_type) in [("l2", 2.0), ("inf", f64::INFINITY)] {
            let grads = fresh();
            let total = clip::total_norm(&grads, norm_type).unwrap();
            assert_close(
                &total.reshape([1]),
                &get(&named, &format!("{case}.{tag}.total")),
                "total norm",
            );
            let coef = clip::clip_by_norm(&grads, &total, 1.0).unwrap();
            if case == "big" {
                assert!(
                    coef < 0.5,
                    "{tag}: gradients of scale 3 must be clipped (coef {coef})"
                );
            } else {
                assert_eq!(coef, 1.0, "{tag}: small gradients must not be clipped");
            }
            for (i, g) in grads.iter().enumerate() {
                assert_close(
                    g,
                    &get(&named, &format!("{case}.{tag}.clipped.{i}")),
                    &format!("{case} {tag} grad {i}"),
                );
            }
        }
        let grads = fresh();
        clip::clip_by_value(&grads, 0.5).unwrap();
        for (i, g) in grads.iter().enumerate() {
            let want = get(&named, &format!("{case}.value.clipped.{i}"));
            assert!(g.equal(&want), "{case} value clip grad {i} differs");
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
/// GPU-NOTES saw 2.1e-7 for this kind of run. Skipped where CUDA is absent.
#[test]
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

/// Trains the e2e MLP with the engine (k = 4, b = 8, clipping) and PyTorch
/// (one batch of 32 per step), both on `device` (cpu or cuda:N), and returns
/// their largest relative difference.
fn e2e(kind: &str, optimizer: &str, lr: f64, cfg_extra: &str, device: &str) -> f64 {
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    torch_reference(&["e2e-prepare", d.to_str().unwrap()]);
    let job = format!(
        r#"
name = "e2e"
seed = 11
epochs = 3
device = "{device}"
threads = 1
[model]
kind = "mlp"
hidden = [16, 12]
init = "{d}/init.safetensors"
[data]
kind = "tensors"
path = "{d}/data.safetensors"
batch_size = 8
shuffle = true
[accumulation]
steps = 4
[clipping]
max_norm = 0.5
[optimizer]
kind = "{kind}"
lr = {lr}
{optimizer}
"#,
        d = d.display()
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
