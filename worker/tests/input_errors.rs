//! Bad data and bad model files through the real `accrue-worker train`,
//! in the real formats: each is refused before the first step with one
//! line that names the field and the value (docs/OPERATIONS.md, "Errors";
//! the checks: docs/SPEC.md, "Where a spec is checked"), never a panic
//! (exit 101), an out-of-memory kill or libtorch's C++ stack.

use std::path::{Path, PathBuf};
use std::process::Command;
use tch::{Kind, Tensor};
use tempfile::TempDir;

/// A one-epoch CPU job with `model` and `data` as its tables' bodies.
fn job(dir: &Path, name: &str, model: &str, data: &str) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(
        &path,
        format!(
            "name = \"{name}\"\nepochs = 1\ndevice = \"cpu\"\nthreads = 1\n\
             [model]\n{model}\n[data]\n{data}\nbatch_size = 4\n\
             [optimizer]\nkind = \"sgd\"\nlr = 0.1\n"
        ),
    )
    .unwrap();
    path
}

/// Runs `accrue-worker train JOB --state-dir DIR/state ARGS`.
fn train(dir: &Path, job: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_accrue-worker"))
        .arg("train")
        .arg(job)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args(args)
        .output()
        .unwrap()
}

/// The refusal of a run that must fail: exit status 1 (not a panic's
/// 101), no panic, and exactly one `error:` line of under 300 characters
/// without C++ stack frames; returns that line.
fn refusal(out: std::process::Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!stderr.contains("frame #"), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line expected:\n{stderr}");
    let line = lines[0];
    assert!(line.starts_with("error: "), "{stderr}");
    assert!(line.len() < 300, "{} characters: {line}", line.len());
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .all(|l| !l.starts_with("step ")),
        "a step ran before the refusal"
    );
    line.to_string()
}

/// Writes a `tensors` file (safetensors with `x` and `y`).
fn tensors(path: &Path, x: &Tensor, y: &Tensor) {
    Tensor::write_safetensors(&[("x", x), ("y", y)], path).unwrap();
}

fn features(n: i64, d: i64) -> Tensor {
    Tensor::arange(n * d, (Kind::Float, tch::Device::Cpu))
        .view([n, d])
        .g_div_scalar(100.0)
}

fn labels(values: &[i64]) -> Tensor {
    Tensor::from_slice(values)
}

fn data(path: &Path) -> String {
    format!("kind = \"tensors\"\npath = \"{}\"", path.display())
}

#[test]
fn a_label_beyond_num_classes_names_the_field() {
    let d = TempDir::new().unwrap();
    let file = d.path().join("digits.safetensors");
    tensors(&file, &features(8, 3), &labels(&[0, 1, 4, 1, 0, 1, 0, 1]));
    let job = job(
        d.path(),
        "label",
        "kind = \"mlp\"\nnum_classes = 2",
        &data(&file),
    );
    let line = refusal(train(d.path(), &job, &[]));
    assert!(
        line.contains("model.num_classes = 2: label 4 at sample 2 of the training split"),
        "{line}"
    );
    assert!(line.contains("0..=1"), "{line}");
}

#[test]
fn an_inferred_class_count_above_the_limit_is_refused() {
    let d = TempDir::new().unwrap();
    let file = d.path().join("huge.safetensors");
    let y = labels(&[0, 1, 1_000_000_000, 1, 0, 1, 0, 1]);
    tensors(&file, &features(8, 3), &y);
    let job = job(d.path(), "huge", "kind = \"mlp\"", &data(&file));
    let line = refusal(train(d.path(), &job, &[]));
    assert!(
        line.contains("model.num_classes = 1000000001 (unset: inferred from the labels)"),
        "{line}"
    );
    assert!(line.contains("label 1000000000 at sample 2"), "{line}");
    assert!(line.contains("1048576"), "{line}");
}

#[test]
fn zero_sized_or_1_d_features_are_refused() {
    let d = TempDir::new().unwrap();
    let empty = d.path().join("empty.safetensors");
    tensors(
        &empty,
        &Tensor::zeros([200, 0], (Kind::Float, tch::Device::Cpu)),
        &Tensor::zeros([200], (Kind::Int64, tch::Device::Cpu)),
    );
    let job1 = job(d.path(), "empty", "kind = \"mlp\"", &data(&empty));
    let line = refusal(train(d.path(), &job1, &[]));
    assert!(
        line.contains("empty.safetensors: x has shape [200, 0]"),
        "{line}"
    );

    let flat = d.path().join("flat.safetensors");
    tensors(
        &flat,
        &features(8, 1).view([8]),
        &labels(&[0, 1, 0, 1, 0, 1, 0, 1]),
    );
    let job2 = job(d.path(), "flat", "kind = \"mlp\"", &data(&flat));
    let line = refusal(train(d.path(), &job2, &[]));
    assert!(line.contains("flat.safetensors: x has shape [8]"), "{line}");
    assert!(line.contains("at least 2 dimensions"), "{line}");
}

#[test]
fn idx_images_with_zero_rows_are_refused() {
    let d = TempDir::new().unwrap();
    let mnist = d.path().join("mnist");
    std::fs::create_dir(&mnist).unwrap();
    let images = |n: u32| {
        let mut b = Vec::new();
        for v in [0x0803, n, 0, 28] {
            b.extend_from_slice(&u32::to_be_bytes(v));
        }
        b
    };
    let labels = |n: u32| {
        let mut b = Vec::new();
        for v in [0x0801, n] {
            b.extend_from_slice(&u32::to_be_bytes(v));
        }
        b.extend(std::iter::repeat_n(0u8, n as usize));
        b
    };
    for (split, n) in [("train", 4), ("t10k", 2)] {
        std::fs::write(mnist.join(format!("{split}-images-idx3-ubyte")), images(n)).unwrap();
        std::fs::write(mnist.join(format!("{split}-labels-idx1-ubyte")), labels(n)).unwrap();
    }
    let data = format!("kind = \"mnist\"\npath = \"{}\"", mnist.display());
    let job = job(d.path(), "rows", "kind = \"mlp\"", &data);
    let line = refusal(train(d.path(), &job, &[]));
    assert!(
        line.contains("train-images-idx3-ubyte: the header declares images of rows = 0"),
        "{line}"
    );
}

/// A file that is not TorchScript, a module without parameters and one
/// whose output ignores its parameters: each named as `model.path`.
#[test]
fn bad_torchscript_files_are_named_as_model_path() {
    let d = TempDir::new().unwrap();
    let file = d.path().join("two.safetensors");
    tensors(&file, &features(8, 3), &labels(&[0, 1, 0, 1, 0, 1, 0, 1]));
    let garbage = d.path().join("garbage.pt");
    std::fs::write(&garbage, b"not a TorchScript module").unwrap();
    let script = "import sys, torch\n\
        class NoParams(torch.nn.Module):\n\
        \x20   def forward(self, x):\n\
        \x20       return x[:, :2] * 2.0\n\
        class Ignores(torch.nn.Module):\n\
        \x20   def __init__(self):\n\
        \x20       super().__init__()\n\
        \x20       self.fc = torch.nn.Linear(3, 2)\n\
        \x20   def forward(self, x):\n\
        \x20       return x[:, :2] * 2.0\n\
        torch.jit.save(torch.jit.script(NoParams()), sys.argv[1] + '/noparams.pt')\n\
        torch.jit.save(torch.jit.script(Ignores()), sys.argv[1] + '/ignores.pt')\n";
    let py = d.path().join("export.py");
    std::fs::write(&py, script).unwrap();
    let out = Command::new(env!("ACCRUE_PYTHON"))
        .arg(&py)
        .arg(d.path())
        .output()
        .expect("run the project's Python");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cases = [
        ("garbage.pt", "not a TorchScript module libtorch can load"),
        (
            "noparams.pt",
            "the TorchScript module has no parameters to train",
        ),
        (
            "ignores.pt",
            "output does not depend on any of its parameters",
        ),
    ];
    for (i, (name, why)) in cases.iter().enumerate() {
        let model = format!(
            "kind = \"torchscript\"\npath = \"{}\"\nnum_classes = 2",
            d.path().join(name).display()
        );
        let job = job(d.path(), &format!("script{i}"), &model, &data(&file));
        let line = refusal(train(d.path(), &job, &[]));
        let field = format!("model.path = \"{}\": ", d.path().join(name).display());
        assert!(
            line.contains(&field) && line.contains(why),
            "{name}: {line}"
        );
        assert!(!line.contains("initial weights"), "{line}");
    }
}

/// A checkpoint written by another architecture (the spec's hidden widths
/// changed) is refused naming the checkpoint folder, the first differing
/// tensor and both shapes.
#[test]
fn a_checkpoint_of_another_architecture_names_the_checkpoint() {
    let d = TempDir::new().unwrap();
    let file = d.path().join("two.safetensors");
    tensors(&file, &features(8, 3), &labels(&[0, 1, 0, 1, 0, 1, 0, 1]));
    let narrow = job(
        d.path(),
        "arch",
        "kind = \"mlp\"\nhidden = [8]",
        &data(&file),
    );
    let out = train(d.path(), &narrow, &["--stop-after-steps", "1"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let wide = job(
        d.path(),
        "arch",
        "kind = \"mlp\"\nhidden = [16]",
        &data(&file),
    );
    let line = refusal(train(d.path(), &wide, &["--resume"]));
    let folder = d.path().join("state/checkpoints/arch/step-1");
    assert!(
        line.contains(&format!(
            "checkpoint {}: another architecture",
            folder.display()
        )),
        "{line}"
    );
    assert!(
        line.contains("first difference 0.weight: checkpoint [8, 3], model [16, 3]"),
        "{line}"
    );
    assert!(!line.contains("initial weights"), "{line}");
}

/// The tokenizer.json beside token data goes into every checkpoint: one
/// that does not load, or whose ids reach past model.vocab_size (another
/// run's, issue 37), is refused naming the file and both sizes.
#[test]
fn a_tokenizer_beside_the_data_that_does_not_fit_the_model_is_refused() {
    let d = TempDir::new().unwrap();
    let mut bytes: Vec<u8> = [20240520i32, 1, 64]
        .iter()
        .chain(&[0i32; 253])
        .flat_map(|v| v.to_le_bytes())
        .collect();
    bytes.extend((0..64u16).flat_map(|t| t.to_le_bytes()));
    let file = d.path().join("train.bin");
    std::fs::write(&file, bytes).unwrap();
    let model = "kind = \"llama\"\nvocab_size = 64\nhidden_size = 16\nintermediate_size = 32\n\
                 num_hidden_layers = 1\nnum_attention_heads = 2\nnum_key_value_heads = 1\n\
                 max_position_embeddings = 16";
    let data = format!(
        "kind = \"tokens\"\npath = \"{}\"\nseq_len = 8",
        file.display()
    );
    let job = job(d.path(), "tok", model, &data);
    let tokenizer = d.path().join("tokenizer.json");
    // A word-level tokenizer of 100 words.
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..100).map(|i| (format!("w{i}"), i.into())).collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"},
    });
    std::fs::write(&tokenizer, json.to_string()).unwrap();
    let line = refusal(train(d.path(), &job, &[]));
    assert!(
        line.contains(&format!(
            "data file {}: its vocabulary has 100 ids",
            tokenizer.display()
        )) && line.contains("model.vocab_size = 64"),
        "{line}"
    );
    std::fs::write(&tokenizer, "{\"model\": 1}").unwrap();
    let line = refusal(train(d.path(), &job, &[]));
    assert!(
        line.contains(&format!(
            "data file {}: is not a tokenizer",
            tokenizer.display()
        )),
        "{line}"
    );
}
