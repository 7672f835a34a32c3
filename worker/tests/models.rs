//! Built-in models: PyTorch parameter names and sizes, and TorchScript.

mod common;

use accrue_worker::model::Model;
use accrue_worker::spec::ModelSpec;
use common::*;
use tch::Device;
use tempfile::TempDir;

fn model_spec(kind: &str) -> ModelSpec {
    ModelSpec {
        kind: kind.parse().unwrap(),
        hidden: vec![],
        num_classes: None,
        path: None,
        init: None,
    }
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

/// The same seed gives the same initial weights, whatever else runs at once.
#[test]
fn initial_weights_follow_the_seed() {
    let spec = ModelSpec {
        hidden: vec![8],
        ..model_spec("mlp")
    };
    let a = Model::build(&spec, &[5], 3, Device::Cpu, 9).unwrap();
    let b = Model::build(&spec, &[5], 3, Device::Cpu, 9).unwrap();
    let c = Model::build(&spec, &[5], 3, Device::Cpu, 10).unwrap();
    assert!(a.params[0].1.equal(&b.params[0].1));
    assert!(!a.params[0].1.equal(&c.params[0].1));
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
    assert!(rel < 1e-6, "torchscript and built-in differ by {rel:e}");
    let saved = tch::Tensor::read_safetensors(d.join("a/step-8/model.safetensors")).unwrap();
    assert!(
        saved.iter().any(|(n, _)| n == "4.weight"),
        "{:?}",
        saved.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
}
