//! Built-in models: PyTorch parameter names and sizes, forward and backward
//! against the same networks built in PyTorch, seeding, and TorchScript.

mod common;

use accrue_worker::family::model::Model;
use accrue_worker::optim::Optimizer;
use accrue_worker::spec::ModelSpec;
use common::*;
use tch::{Device, Tensor};
use tempfile::TempDir;

fn model_spec(kind: &str) -> ModelSpec {
    toml::from_str(&format!("kind = {kind:?}")).unwrap()
}

fn numel(m: &Model) -> i64 {
    m.params.iter().map(|(_, t)| t.numel() as i64).sum()
}

/// torchvision.models.resnet18(num_classes=10): 62 parameter tensors,
/// 11,181,642 parameters; resnet34: 110 tensors, 21,289,802 parameters.
#[test]
fn resnets_have_torchvision_names_and_sizes() {
    let r18 = Model::build(&model_spec("resnet18"), &[3, 32, 32], 10, Device::Cpu, 1).unwrap();
    assert_eq!((r18.params.len(), numel(&r18)), (62, 11_181_642));
    let names: Vec<&str> = r18.state().map(|(n, _)| n.as_str()).collect();
    for n in [
        "conv1.weight",
        "bn1.weight",
        "bn1.running_mean",
        "layer1.0.conv1.weight",
        "layer2.0.downsample.0.weight",
        "layer2.0.downsample.1.running_var",
        "layer4.1.bn2.bias",
        "fc.weight",
        "fc.bias",
    ] {
        assert!(names.contains(&n), "resnet18 lacks {n}");
    }
    assert_eq!(r18.params[0].0, "conv1.weight");
    let r34 = Model::build(&model_spec("resnet34"), &[3, 32, 32], 10, Device::Cpu, 1).unwrap();
    assert_eq!((r34.params.len(), numel(&r34)), (110, 21_289_802));
    let err = Model::build(&model_spec("resnet18"), &[1, 28, 28], 10, Device::Cpu, 1)
        .err()
        .unwrap();
    assert!(err.to_string().contains("3-channel"), "{err}");
}

/// LeNet-5 on 28x28: conv1 1->6 (5x5, pad 2), conv2 6->16 (5x5), 400->120->84->10:
/// 156 + 2,416 + 48,120 + 10,164 + 850 = 61,706 parameters.
#[test]
fn lenet5_names_and_size() {
    let m = Model::build(&model_spec("lenet5"), &[1, 28, 28], 10, Device::Cpu, 1).unwrap();
    let names: Vec<&str> = m.params.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "conv1.weight",
            "conv1.bias",
            "conv2.weight",
            "conv2.bias",
            "fc1.weight",
            "fc1.bias",
            "fc2.weight",
            "fc2.bias",
            "fc3.weight",
            "fc3.bias"
        ]
    );
    assert_eq!(numel(&m), 61_706);
}

/// Deterministic inputs without libtorch's global generator (drawing from it
/// here could interleave with a model being seeded on another test thread).
fn inputs(batch: i64, shape: [i64; 3], classes: i64) -> (Tensor, Tensor) {
    let n = batch * shape.iter().product::<i64>();
    let x: Vec<f32> = (0..n)
        .map(|i| ((i as u64).wrapping_mul(2_654_435_761) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let y: Vec<i64> = (0..batch).map(|i| (3 * i + 1) % classes).collect();
    (
        Tensor::from_slice(&x).view([batch, shape[0], shape[1], shape[2]]),
        Tensor::from_slice(&y),
    )
}

/// Runs accrue's model on a training forward (summed cross-entropy,
/// backward) and an eval forward, hands its initial weights, inputs and
/// results to the same network built in PyTorch (torch_reference.py
/// model-check), and checks names, shapes, and every output, gradient and
/// BatchNorm statistic within `tol` of PyTorch's, relative to the largest
/// magnitude of each tensor. Returns the largest relative difference.
fn equals_pytorch(kind: &str, shape: [i64; 3], classes: i64, batch: i64, tol: f64) -> f64 {
    // One intra-op thread on this test thread (libtorch's OpenMP setting is
    // per calling thread) and in PyTorch: same kernels, same summation order.
    tch::set_num_threads(1);
    let dir = TempDir::new().unwrap();
    let m = Model::build(&model_spec(kind), &shape, classes, Device::Cpu, 17).unwrap();
    let mut file: Vec<(String, Tensor)> = m
        .state()
        .map(|(n, t)| (format!("init.{n}"), t.detach().copy()))
        .collect();
    let (x, y) = inputs(batch, shape, classes);
    let logits = m.forward(&x, true).unwrap();
    logits
        .cross_entropy_loss::<Tensor>(&y, None, tch::Reduction::Sum, -100, 0.0)
        .backward();
    let eval_logits = tch::no_grad(|| m.forward(&x, false).unwrap());
    for (n, p) in &m.params {
        assert!(p.grad().defined(), "{kind}: {n} has no gradient");
        file.push((format!("grad.{n}"), p.grad().copy()));
    }
    for (n, b) in &m.buffers {
        file.push((format!("after.{n}"), b.copy()));
    }
    file.push(("x".into(), x));
    file.push(("y".into(), y));
    file.push(("out.logits".into(), logits.detach()));
    file.push(("out.eval_logits".into(), eval_logits));
    let path = dir.path().join("model.safetensors");
    Tensor::write_safetensors(&file, &path).unwrap();
    let out = torch_reference(&[
        "model-check",
        kind,
        &shape[0].to_string(),
        &shape[1].to_string(),
        &shape[2].to_string(),
        &classes.to_string(),
        path.to_str().unwrap(),
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let listed = |key: &str| -> Vec<(String, Vec<i64>)> {
        v[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let dims = e[1].as_array().unwrap();
                let dims = dims.iter().map(|d| d.as_i64().unwrap()).collect();
                (e[0].as_str().unwrap().to_string(), dims)
            })
            .collect()
    };
    // Names and shapes in module.parameters() order; buffers by name.
    let ours: Vec<(String, Vec<i64>)> = m
        .params
        .iter()
        .map(|(n, t)| (n.clone(), t.size()))
        .collect();
    assert_eq!(
        ours,
        listed("params"),
        "{kind}: parameters differ from PyTorch's"
    );
    let mut theirs = listed("buffers");
    theirs.sort();
    let ours: Vec<(String, Vec<i64>)> = m
        .buffers
        .iter()
        .map(|(n, t)| (n.clone(), t.size()))
        .collect();
    assert_eq!(ours, theirs, "{kind}: buffers differ from PyTorch's");
    let diffs = v["diffs"].as_object().unwrap();
    assert_eq!(diffs.len(), 2 + m.params.len() + m.buffers.len());
    let mut worst = (0.0, String::new());
    for (key, d) in diffs {
        let (diff, scale) = (d[0].as_f64().unwrap(), d[1].as_f64().unwrap());
        assert!(
            scale > 0.0,
            "{kind}: PyTorch's {key} is all zeros; the check would be empty"
        );
        let rel = diff / scale;
        assert!(
            rel <= tol,
            "{kind}: {key} differs from PyTorch by {diff:e} (max |value| {scale:e}, relative {rel:e} > {tol:e})"
        );
        if rel >= worst.0 {
            worst = (rel, key.clone());
        }
    }
    let logits = &diffs["out.logits"];
    eprintln!(
        "{kind}: {} tensors compared; logits max abs diff {:e}; worst relative {:e} ({})",
        diffs.len(),
        logits[0].as_f64().unwrap(),
        worst.0,
        worst.1
    );
    worst.0
}

/// LeNet-5 on 3x32x32 (CIFAR shape) against the same network in PyTorch:
/// names, shapes, logits and every gradient.
#[test]
fn lenet5_forward_backward_equal_pytorch() {
    equals_pytorch("lenet5", [3, 32, 32], 10, 4, TOL);
}

#[test]
fn resnet18_forward_backward_equal_pytorch() {
    equals_pytorch("resnet18", [3, 32, 32], 10, 2, TOL);
}

#[test]
fn resnet34_forward_backward_equal_pytorch() {
    equals_pytorch("resnet34", [3, 32, 32], 10, 2, TOL);
}

/// Relative to each tensor's largest magnitude. Both sides run the same
/// libtorch 2.11 kernels on one thread, and the differences seen are exactly
/// 0; 1e-5 leaves room for a different kernel choice (reordered f32 sums:
/// with 2 threads against 1, ResNet-18's `bn1.bias` gradient, a sum over
/// 2x16x16 positions feeding BatchNorm over batches of 2, differed by
/// 3.6e-4) only where a real change would also show: BatchNorm's eps at 1e-3
/// instead of 1e-5 moves a running mean by 7e-4, a tanh for a ReLU moves
/// LeNet's gradients by more than 1.
const TOL: f64 = 1e-5;

/// What a model built with `seed` does: its initial parameters, its logits
/// on fixed inputs, and its parameters and logits after one SGD step
/// (accrue's optimizer, momentum and weight decay) on those inputs.
struct SeededRun {
    names: Vec<String>,
    init: Vec<Tensor>,
    logits: Tensor,
    stepped: Vec<Tensor>,
    logits_after: Tensor,
}

fn seeded_run(kind: &str, seed: u64) -> SeededRun {
    let (shape, classes) = ([1, 16, 16], 4);
    let m = Model::build(&model_spec(kind), &shape, classes, Device::Cpu, seed).unwrap();
    let copies =
        |m: &Model| -> Vec<Tensor> { m.params.iter().map(|(_, t)| t.detach().copy()).collect() };
    let init = copies(&m);
    let (x, y) = inputs(8, shape, classes);
    let logits = m.forward(&x, true).unwrap();
    logits.cross_entropy_for_logits(&y).backward();
    let opt = spec(&mlp_job(8, 8, 1, "global_count", "")).optimizer;
    let mut optimizer = Optimizer::new(&opt, m.params.len());
    optimizer.step(&m.params, 0.1).unwrap();
    let logits_after = tch::no_grad(|| m.forward(&x, true).unwrap());
    SeededRun {
        names: m.params.iter().map(|(n, _)| n.clone()).collect(),
        init,
        logits: logits.detach(),
        stepped: copies(&m),
        logits_after,
    }
}

fn same(a: &[Tensor], b: &[Tensor]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| a.equal(b))
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// The seed decides the initial weights, even with models being built on
/// other threads at the same time: builds with the same seed (made at once
/// on four threads) give bit-identical weights, logits and first training
/// step; another seed gives other weights, logits and step.
#[test]
fn initial_weights_follow_the_seed() {
    for kind in ["mlp", "lenet5"] {
        let runs: Vec<SeededRun> = std::thread::scope(|s| {
            let handles: Vec<_> = [9, 9, 10, 9]
                .into_iter()
                .map(|seed| s.spawn(move || seeded_run(kind, seed)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let (a, other) = (&runs[0], &runs[2]);
        for b in [&runs[1], &runs[3]] {
            assert!(same(&a.init, &b.init), "{kind}: same seed, other weights");
            assert!(a.logits.equal(&b.logits), "{kind}: same seed, other logits");
            assert!(
                same(&a.stepped, &b.stepped),
                "{kind}: same seed, other step"
            );
            assert!(
                a.logits_after.equal(&b.logits_after),
                "{kind}: same seed, other logits after the step"
            );
        }
        // The step is real: it moved the weights and the logits.
        assert!(
            !same(&a.init, &a.stepped),
            "{kind}: the step changed nothing"
        );
        assert!(
            max_abs_diff(&a.logits, &a.logits_after) > 1e-4,
            "{kind}: logits did not move"
        );
        // Another seed: other weights (every weight matrix and kernel;
        // tch starts conv biases at zero whatever the seed), other logits,
        // other step.
        for ((n, x), y) in a.names.iter().zip(&a.init).zip(&other.init) {
            if n.ends_with("weight") {
                assert!(!x.equal(y), "{kind}: {n} is the same under seeds 9 and 10");
            }
        }
        let d = max_abs_diff(&a.logits, &other.logits);
        assert!(d > 1e-3, "{kind}: seeds 9 and 10 give logits within {d:e}");
        assert!(!same(&a.stepped, &other.stepped));
        eprintln!("{kind}: seeds 9 and 10 differ in logits by up to {d:e}; seed 9 builds agree bit for bit");
    }
}

/// A torch.jit.script module trains like the built-in MLP from the same
/// weights, and its checkpoint keeps PyTorch's dotted names.
#[test]
fn torchscript_trains_like_the_builtin() {
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    torch_reference(&["script-export", d.to_str().unwrap()]);
    let base = mlp_job(64, 8, 2, "global_count", "");
    let script = base.replace(
        "kind = \"mlp\"\nhidden = [16]",
        &format!(
            "kind = \"torchscript\"\npath = \"{}/model.pt\"\nnum_classes = 4",
            d.display()
        ),
    );
    let builtin = base.replace(
        "kind = \"mlp\"\nhidden = [16]",
        &format!(
            "kind = \"mlp\"\nhidden = [16, 12]\ninit = \"{}/script_init.safetensors\"",
            d.display()
        ),
    );
    assert!(script.contains("torchscript") && builtin.contains("script_init"));
    let a = train(spec(&script), &d.join("a"));
    let b = train(spec(&builtin), &d.join("b"));
    let rel = max_rel_diff(&a, &b);
    eprintln!("torchscript vs built-in: {rel:e}");
    assert!(rel < 1e-6, "torchscript and built-in differ by {rel:e}");
    let saved = tch::Tensor::read_safetensors(d.join("a/step-8/model.safetensors")).unwrap();
    assert!(
        saved.iter().any(|(n, _)| n == "4.weight"),
        "{:?}",
        saved.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
}
