//! Shared helpers for the engine tests.
#![allow(dead_code)]

pub mod lm_ddp;
pub mod procs;

use accrue_worker::comm::{bind, RingConfig, TcpRing};
use accrue_worker::engine::RunOptions;
use accrue_worker::{Engine, JobSpec, SingleRank};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tch::Tensor;

/// The project's Python (with torch), from .cargo/config.toml.
pub fn python() -> PathBuf {
    let p = PathBuf::from(env!("ACCRUE_PYTHON"));
    assert!(
        p.exists(),
        "{} is missing: run `make setup` first",
        p.display()
    );
    p
}

pub fn reference_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/torch_reference.py")
}

/// Runs the PyTorch reference script and returns its stdout.
pub fn torch_reference(args: &[&str]) -> String {
    run_reference(&reference_script(), args)
}

/// Runs a reference script (tests/reference/) with the project's Python;
/// its stdout, after it succeeded.
pub fn run_reference(script: &Path, args: &[&str]) -> String {
    let out = Command::new(python())
        .arg(script)
        .args(args)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "reference script {} {args:?} failed:\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// Set to 1 (scripts/gpu-checks.sh does) to make every CUDA skip a failure.
pub const REQUIRE_CUDA: &str = "ACCRUE_REQUIRE_CUDA";

/// The least bar on a step's loss and gradient norm (and on SGD weights,
/// which move with the clip coefficient) when the two runs compared
/// assemble the clip norm differently: one float32 reduction over the
/// whole buffer (as `clip_grad_norm_`) against partials per pipeline
/// stage, ZeRO shard or tensor rank summed in f64. Those differ by about
/// log2(N) float32 units of the norm (up to 1.1e-6 measured here), which
/// no reordering of the micro-batches reproduces, so a floor measured
/// that way (6e-8 to 2.4e-7) sits below the distance measured (up to
/// 7.6e-7): 1e-6 failed at random. A shard dropped, doubled or sent to
/// the wrong stage moves the norm by its share of the squares, 1e-3 and
/// more in these models.
pub const NORM_ASSEMBLY: f64 = 1e-5;

/// Whether a CUDA test can run. CUDA tests are `#[ignore = "needs CUDA"]`
/// (the harness reports them as ignored; run them with `--ignored`), and
/// call this first. Without CUDA: with `ACCRUE_REQUIRE_CUDA=1` the test
/// fails; otherwise it says so on the terminal (written to stderr
/// directly, past libtest's capture, so a passing run shows it) and the
/// caller returns.
pub fn cuda_or_skip(test: &str) -> bool {
    if tch::Cuda::is_available() {
        return true;
    }
    let why = "CUDA is not available (tch::Cuda::is_available() is false; \
               a GPU build needs ACCRUE_CUDA=1 and a CUDA libtorch)";
    if std::env::var(REQUIRE_CUDA).as_deref() == Ok("1") {
        panic!("{test}: {why}, and {REQUIRE_CUDA}=1 makes that a failure");
    }
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
    false
}

pub fn spec(toml: &str) -> JobSpec {
    JobSpec::from_toml_str(toml, Path::new("test.toml")).unwrap_or_else(|e| panic!("{e}"))
}

pub fn engine(spec: JobSpec, dir: &Path) -> Engine<SingleRank> {
    let opts = RunOptions {
        checkpoint_dir: Some(dir.to_path_buf()),
        ..Default::default()
    };
    Engine::new(spec, SingleRank, opts).unwrap_or_else(|e| panic!("{e}"))
}

/// Trains to the end and returns the final parameters by name.
pub fn train(spec: JobSpec, dir: &Path) -> Vec<(String, Tensor)> {
    let mut e = engine(spec, dir);
    e.run(|_| {}).unwrap_or_else(|e| panic!("{e}"));
    snapshot(&e)
}

pub fn snapshot(e: &Engine<SingleRank>) -> Vec<(String, Tensor)> {
    e.parameters()
        .iter()
        .map(|(n, t)| (n.clone(), t.detach().copy()))
        .collect()
}

/// Largest per-tensor `max|a - b| / max|b|` over all named tensors.
pub fn max_rel_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((na, ta), (nb, tb))| {
            assert_eq!(na, nb);
            let diff = (ta - tb).abs().max().double_value(&[]);
            diff / tb.abs().max().double_value(&[]).max(1e-30)
        })
        .fold(0.0, f64::max)
}

/// A small synthetic-data MLP job; `extra` is appended (TOML tables).
pub fn mlp_job(samples: u64, batch: u64, k: u64, normalize: &str, extra: &str) -> String {
    format!(
        r#"
name = "t"
seed = 5
epochs = 2
device = "cpu"
threads = 1
[model]
kind = "mlp"
hidden = [16]
[data]
kind = "synthetic"
samples = {samples}
eval_samples = 0
shape = [6]
classes = 4
batch_size = {batch}
[accumulation]
steps = {k}
normalize = "{normalize}"
[optimizer]
kind = "sgd"
lr = 0.1
momentum = 0.9
weight_decay = 0.001
{extra}
"#
    )
}

/// The head of a job training the reference MLP ([16, 12], weights from
/// `d`/init.safetensors) on `d`/data.safetensors, shuffled, one thread:
/// the tables that follow ([accumulation], [clipping], [optimizer], ...)
/// come from `rest`.
pub fn tensors_mlp_job(
    name: &str,
    d: &Path,
    device: &str,
    epochs: u64,
    batch: u64,
    rest: &str,
) -> String {
    format!(
        r#"
name = "{name}"
seed = 11
epochs = {epochs}
device = "{device}"
threads = 1
[model]
kind = "mlp"
hidden = [16, 12]
init = "{d}/init.safetensors"
[data]
kind = "tensors"
path = "{d}/data.safetensors"
batch_size = {batch}
shuffle = true
{rest}"#,
        d = d.display()
    )
}

/// `body(rank, ring)` on W threads over a fresh loopback ring; the results
/// in rank order.
pub fn on_ring<T: Send + 'static>(
    world: usize,
    body: impl Fn(usize, TcpRing) -> T + Clone + Send + 'static,
) -> Vec<T> {
    let ls: Vec<_> = (0..world).map(|_| bind("127.0.0.1:0").unwrap()).collect();
    let addrs: Vec<String> = ls
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect();
    let handles: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let (addrs, body) = (addrs.clone(), body.clone());
            std::thread::spawn(move || {
                let mut cfg = RingConfig::new("ring", rank, world, addrs, b"ring".to_vec());
                cfg.timeout = Duration::from_secs(20);
                cfg.connect_timeout = Duration::from_secs(20);
                body(rank, TcpRing::start(Some(l), cfg).unwrap())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Writes 64 samples of 6 random features (labels 0..4 in turn) to
/// `dir`/`name` with feature `col` of sample `row` set to `value` (a NaN
/// for a non-finite gradient, 1e6 to overflow fp16); returns the path.
pub fn poisoned_data(dir: &Path, name: &str, row: i64, col: i64, value: f64) -> PathBuf {
    let x = Tensor::randn([64, 6], (tch::Kind::Float, tch::Device::Cpu));
    let _ = x.get(row).get(col).fill_(value);
    let y = Tensor::arange(64, (tch::Kind::Int64, tch::Device::Cpu)).remainder(4);
    let path = dir.join(name);
    Tensor::write_safetensors(&[("x", &x), ("y", &y)], &path).unwrap();
    path
}

/// `text` with its [data] table of 64 synthetic samples of shape [6] and 4
/// classes replaced by the `tensors` file `path`.
pub fn on_tensors(text: &str, path: &Path, shuffle: bool) -> String {
    let synthetic =
        "kind = \"synthetic\"\nsamples = 64\neval_samples = 0\nshape = [6]\nclasses = 4\n";
    assert!(
        text.contains(synthetic),
        "no 64-sample synthetic table in {text}"
    );
    text.replace(
        synthetic,
        &format!(
            "kind = \"tensors\"\nshuffle = {shuffle}\npath = \"{}\"\n",
            path.display()
        ),
    )
}

/// An llm.c-format token file (`train.bin` in `dir`) of `count` u16 tokens
/// below 64 from a fixed linear congruential sequence.
pub fn token_file(dir: &Path, count: usize) -> PathBuf {
    let mut header = [0i32; 256];
    header[0] = 20240520;
    header[1] = 1;
    header[2] = count as i32;
    let mut bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut x: u32 = 7;
    for _ in 0..count {
        x = x.wrapping_mul(1103515245).wrapping_add(12345);
        bytes.extend_from_slice(&(((x >> 16) % 64) as u16).to_le_bytes());
    }
    let p = dir.join("train.bin");
    std::fs::write(&p, bytes).unwrap();
    p
}

/// A step folder's model, whatever its form: `model.safetensors`, or the
/// shards a pipeline job's stages write (`model-0000i-of-0000n`, each
/// stage's tensors), joined; sorted by name.
pub fn step_model(folder: &Path) -> Vec<(String, Tensor)> {
    let one = folder.join("model.safetensors");
    let mut files = if one.exists() {
        vec![one]
    } else {
        let mut v: Vec<PathBuf> = std::fs::read_dir(folder)
            .unwrap_or_else(|e| panic!("{}: {e}", folder.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| {
                let n = p.file_name().unwrap().to_string_lossy();
                n.starts_with("model-") && n.ends_with(".safetensors")
            })
            .collect();
        v.sort();
        v
    };
    assert!(!files.is_empty(), "{}: no model files", folder.display());
    let mut m: Vec<(String, Tensor)> = files
        .drain(..)
        .flat_map(|p| {
            Tensor::read_safetensors(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        })
        .collect();
    m.sort_by(|a, b| a.0.cmp(&b.0));
    m
}

/// A sequences file: tokens and offsets (I64) and a U8 loss mask.
pub fn write_sequences(path: &Path, tokens: &[i64], offsets: &[i64], mask: &[u8]) {
    use safetensors::tensor::{Dtype, TensorView};
    let bytes = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (tb, ob) = (bytes(tokens), bytes(offsets));
    let views = [
        (
            "tokens",
            TensorView::new(Dtype::I64, vec![tokens.len()], &tb).unwrap(),
        ),
        (
            "offsets",
            TensorView::new(Dtype::I64, vec![offsets.len()], &ob).unwrap(),
        ),
        (
            "loss_mask",
            TensorView::new(Dtype::U8, vec![mask.len()], mask).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(views, &None, path).unwrap();
}

/// A sequences file at `path` of rows of `lens` tokens (ids `(37 t + 11)
/// mod 97`), each a two-token prompt (masked) and its completion.
pub fn prompt_rows(path: &Path, lens: &[usize]) {
    let tokens: Vec<i64> = (0..lens.iter().sum::<usize>() as i64)
        .map(|t| (t * 37 + 11) % 97)
        .collect();
    let mut offsets = vec![0i64];
    let mut mask = Vec::new();
    for &l in lens {
        offsets.push(offsets.last().unwrap() + l as i64);
        mask.extend((0..l).map(|i| u8::from(i >= 2)));
    }
    write_sequences(path, &tokens, &offsets, &mask);
}

/// transformers' `from_pretrained` on a step folder gives its tensors.
pub fn from_pretrained_equals(step: &Path, want: &[(String, Tensor)]) {
    let out = step.with_file_name("loaded.safetensors");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/load_step.py");
    let run = std::process::Command::new(python())
        .arg(script)
        .arg(step)
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let loaded = Tensor::read_safetensors(&out).unwrap();
    for (name, t) in want {
        let (_, l) = loaded
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("transformers loaded no {name}"));
        assert!(l.equal(t), "{name} differs after from_pretrained");
    }
}

/// Copies folder `from` into `to`, recursively.
pub fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

/// A tiny Llama with GQA (vocabulary 64, width 16, 4 layers, 4 heads, 2
/// key-value heads) on llm.c token file `tokens`, T = 8, b = 2, k = 4,
/// AdamW, clipped at 0.5, 4 steps on `workers` ranks, on the CPU; `tail`
/// ends it (a `[parallel]` table).
pub fn tiny_llama_job(tokens: &Path, workers: u32, tied: bool, tail: &str) -> String {
    format!(
        r#"
name = "pp-lm"
seed = 3
workers = {workers}
max_steps = 4
device = "cpu"
threads = 1
{model}[data]
kind = "tokens"
path = "{path}"
seq_len = 8
batch_size = 2
[accumulation]
steps = 4
[clipping]
max_norm = 0.5
[optimizer]
kind = "adamw"
lr = 0.01
weight_decay = 0.1
[comm]
timeout_s = 20
connect_timeout_s = 30
{tail}"#,
        path = tokens.display(),
        model = tiny_llama_model(4, 4, 2, tied),
    )
}

/// A tiny Llama's `[model]` table: vocabulary 64, width 16, MLP 32,
/// `layers` layers of `heads` heads and `kv_heads` key-value heads,
/// positions up to 16, tied or untied embeddings.
pub fn tiny_llama_model(layers: u32, heads: u32, kv_heads: u32, tied: bool) -> String {
    format!(
        "[model]\nkind = \"llama\"\nvocab_size = 64\nhidden_size = 16\n\
         intermediate_size = 32\nnum_hidden_layers = {layers}\n\
         num_attention_heads = {heads}\nnum_key_value_heads = {kv_heads}\n\
         max_position_embeddings = 16\ntie_word_embeddings = {tied}\n"
    )
}
