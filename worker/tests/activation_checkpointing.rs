//! Activation checkpointing (issue 41, `[performance]
//! activation_checkpointing = "full"`): the blocks recomputed in the
//! backward give the same numbers as the blocks kept, bit for bit on the
//! CPU, for every segment length, in fp32 and under bf16 autocast.

mod common;

use common::*;
use tempfile::TempDir;

/// Tensors by name.
type Named = Vec<(String, tch::Tensor)>;

/// Every step's loss and gradient norm, and the final parameters.
fn trained(text: &str) -> (Vec<(f64, f64)>, Named) {
    let d = TempDir::new().unwrap();
    let mut e = engine(spec(text), d.path());
    let mut steps = Vec::new();
    e.run(|ev| {
        if let accrue_worker::Event::Step(r) = ev {
            steps.push((r.loss, r.grad_norm));
        }
    })
    .unwrap_or_else(|e| panic!("{e}"));
    (steps, snapshot(&e))
}

/// `text` with `[performance]` recomputing segments of `every` blocks.
fn recomputed(text: &str, every: u32) -> String {
    format!(
        "{text}\n[performance]\nactivation_checkpointing = \"full\"\ncheckpoint_every = {every}\n"
    )
}

fn same_bits(text: &str, everies: &[u32], what: &str) {
    let (want_steps, want) = trained(text);
    assert!(want_steps.len() >= 2, "{what}: {want_steps:?}");
    for &every in everies {
        let (steps, got) = trained(&recomputed(text, every));
        assert_eq!(steps, want_steps, "{what}, every {every}: steps");
        let d = max_rel_diff(&got, &want);
        eprintln!("{what}, segments of {every}: {d:e}");
        assert_eq!(d, 0.0, "{what}, every {every}: the weights differ");
    }
}

/// An mlp of 4 layers, AdamW with clipping: segments of 1, 2 and all 4
/// layers.
#[test]
fn recomputed_mlp_blocks_give_the_same_bits() {
    let text =
        mlp_job(96, 8, 2, "global_count", "").replace("hidden = [16]", "hidden = [16, 12, 10]");
    same_bits(&text, &[1, 2, 4], "mlp");
}

/// A tied Llama with GQA (6 blocks: the embedding, 4 layers, the final
/// norm), AdamW with clipping, on `tokens`.
fn llama(tokens: &std::path::Path) -> String {
    format!(
        r#"
name = "ac"
seed = 3
max_steps = 3
device = "cpu"
threads = 1
{model}[data]
kind = "tokens"
path = "{}"
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
"#,
        tokens.display(),
        model = tiny_llama_model(4, 4, 2, true),
    )
}

/// The tied Llama in fp32 (the one-pass head and loss) and under bf16
/// autocast: segments of 1 and 3 blocks.
#[test]
fn recomputed_llama_blocks_give_the_same_bits() {
    let d = TempDir::new().unwrap();
    let tokens = token_file(d.path(), 4 * 4 * 2 * 8 + 1);
    let text = llama(&tokens);
    same_bits(&text, &[1, 3], "tied llama, fp32");
    let bf16 = text.replace("threads = 1", "threads = 1\nprecision = \"bf16\"");
    same_bits(&bf16, &[2], "tied llama, bf16");
}

/// In pipeline stages (2 processes, 1F1B): each stage recomputes its own
/// blocks, the first stage in its backward op, the last with its loss;
/// the final weights and every step equal the same stages without it, bit
/// for bit.
#[test]
fn recomputed_stages_give_the_same_bits() {
    let d = TempDir::new().unwrap();
    let tokens = token_file(d.path(), 4 * 4 * 2 * 8 + 1);
    let staged = format!("workers = 2\n{}[parallel]\npipeline = 2\n", llama(&tokens));
    let run = |text: &str| {
        let dir = TempDir::new().unwrap();
        let ranks = common::procs::run_ranks(dir.path(), text, 2, |_| {});
        let steps: Vec<(f64, f64)> = ranks[0]
            .steps()
            .iter()
            .map(|s| {
                (
                    s["loss"].as_f64().unwrap(),
                    s["grad_norm"].as_f64().unwrap(),
                )
            })
            .collect();
        (steps, step_model(&dir.path().join("ckpt/step-3")))
    };
    let (want_steps, want) = run(&staged);
    assert_eq!(want_steps.len(), 3);
    let (steps, got) = run(&recomputed(&staged, 1));
    assert_eq!(steps, want_steps, "steps");
    let d = max_rel_diff(&got, &want);
    eprintln!("stages recomputed against stages: {d:e}");
    assert_eq!(d, 0.0, "the weights differ");
}
