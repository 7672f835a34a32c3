//! `accrue sample` (issue 30): generation with the KV cache equals
//! generation with a full forward of the whole sequence for every token;
//! greedy continuation equals transformers' `model.generate(do_sample =
//! False)` on a checkpoint accrue wrote; `accrue-worker sample` prints the
//! prompt then the continuation, finds the step through LATEST, and a
//! missing tokenizer.json is a clear error.
//!
//! The tiny models (vocab 97, width 32, 2 layers, 4 heads) get weights
//! from a fixed pseudo-random pattern of unit scale (not transformers'
//! 0.02 init, whose near-uniform logits would make greedy choices ties
//! to within rounding), so the argmax is decided by clear margins.

use accrue_worker::checkpoint::{self, owner::Owner, TrainerState, WriteOptions};
use accrue_worker::family::llama::{KvCache, Net};
use accrue_worker::sample::{load_tokenizer, read_step_files, GenerateOptions, LoadedModel, Stop};
use accrue_worker::spec::{DecoderArch, LlamaConfig, ModelKind};
use std::path::{Path, PathBuf};
use std::process::Command;
use tch::{nn, Device, Kind, Tensor};

const VOCAB: i64 = 97;
const TOL: f64 = 1e-5;
const PROMPT: [i64; 5] = [5, 17, 42, 8, 63];

fn config(kv_heads: i64, tied: bool, biases: bool) -> LlamaConfig {
    LlamaConfig {
        vocab_size: VOCAB,
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: kv_heads,
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        max_position_embeddings: 64,
        tie_word_embeddings: tied,
        attention_bias: biases,
        mlp_bias: biases,
        initializer_range: 0.02,
        rope_scaling: Default::default(),
        arch: Default::default(),
        sliding_window: None,
        explicit_head_dim: None,
    }
}

/// `n` values uniform in [-1, 1) from a 64-bit LCG seeded with `seed`.
fn pattern(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// A model's parameters with Hugging Face names, sorted, from a fixed
/// pattern of unit scale.
fn weights(c: &LlamaConfig, seed: u64) -> Vec<(String, Tensor)> {
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = Net::new(&vs.root(), c).unwrap();
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    tch::no_grad(|| {
        for (i, (name, t)) in vars.iter().enumerate() {
            let size = t.size();
            let numel = size.iter().product::<i64>() as usize;
            let u =
                Tensor::from_slice(&pattern(numel, seed * 1000 + i as u64)).view(size.as_slice());
            // Unit-scale activations: weights of std about 1/sqrt(fan in),
            // embeddings of std about 1, norms about 1.
            let value = if name.ends_with("norm.weight") {
                u * 0.2 + 1.0
            } else if name.ends_with(".bias") {
                u * 0.1
            } else if name.contains("embed_tokens") {
                u * 1.7
            } else {
                let fan_in = size[1] as f64;
                u * (3.0 / fan_in).sqrt() * 1.5
            };
            t.shallow_clone().copy_(&value);
        }
    });
    vars
}

/// A step-like folder: model.safetensors (HF names) and config.json.
fn write_step(dir: &Path, c: &LlamaConfig, seed: u64) {
    std::fs::create_dir_all(dir).unwrap();
    let vars = weights(c, seed);
    let named: Vec<(&str, &Tensor)> = vars.iter().map(|(n, t)| (n.as_str(), t)).collect();
    Tensor::write_safetensors(&named, dir.join("model.safetensors")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&c.to_hf_json()).unwrap(),
    )
    .unwrap();
}

/// Step `step` of checkpoint folder `ckpt` as training writes it
/// (checkpoint::write: the manifest, LATEST, pruning to the newest
/// `keep`), with config.json and a tokenizer.json of VOCAB words.
fn write_checkpoint(ckpt: &Path, step: u64, c: &LlamaConfig, seed: u64, keep: usize) {
    write_checkpoint_sharded(ckpt, step, c, seed, keep, u64::MAX)
}

/// [`write_checkpoint`] with model files of at most `max_shard` bytes.
fn write_checkpoint_sharded(
    ckpt: &Path,
    step: u64,
    c: &LlamaConfig,
    seed: u64,
    keep: usize,
    max_shard: u64,
) {
    let state = TrainerState {
        job: "sample-test".into(),
        job_id: "sample-test".into(),
        step,
        ..Default::default()
    };
    let extra = vec![
        (
            "config.json".to_string(),
            serde_json::to_vec_pretty(&c.to_hf_json()).unwrap(),
        ),
        ("tokenizer.json".to_string(), tokenizer_json(VOCAB)),
    ];
    let opts = WriteOptions {
        keep,
        owner: Owner {
            job_id: "sample-test".into(),
            cluster: String::new(),
            spec_hash: String::new(),
            created_unix_ms: 0,
        },
        protect_upto: None,
        max_shard,
    };
    checkpoint::write(ckpt, &state, &weights(c, seed), &[], &extra, &opts).unwrap();
}

/// max |a - b| / max(1, max |b|).
fn difference(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    let diff = (a - b).abs().max().double_value(&[]);
    diff / b.abs().max().double_value(&[]).max(1.0)
}

fn greedy(n: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens: n,
        temperature: 0.0,
        ..Default::default()
    }
}

fn none(_: i64) -> accrue_worker::sample::Result<()> {
    Ok(())
}

#[test]
fn kv_cache_generation_equals_full_forward_generation() {
    tch::set_num_threads(1);
    let tmp = tempfile::TempDir::new().unwrap();
    for (i, (name, c)) in [
        ("gqa", config(2, false, false)),
        ("tied_biases", config(4, true, true)),
    ]
    .into_iter()
    .enumerate()
    {
        let dir = tmp.path().join(name);
        write_step(&dir, &c, 1 + i as u64);
        let model = LoadedModel::from_step_dir(&dir, Device::Cpu).unwrap();
        assert_eq!(model.config, c, "{name}: config.json read back");

        // Greedy, 20 tokens: the same tokens, the last logits within TOL.
        let cached = model.generate(&PROMPT, &greedy(20), none).unwrap();
        let full = model.generate_uncached(&PROMPT, &greedy(20), none).unwrap();
        assert_eq!(cached.tokens.len(), 20, "{name}");
        assert_eq!(cached.stop, Stop::MaxTokens);
        assert_eq!(cached.tokens, full.tokens, "{name}: tokens");
        let d = difference(
            cached.last_logits.as_ref().unwrap(),
            full.last_logits.as_ref().unwrap(),
        );
        assert!(d <= TOL, "{name}: last logits differ by {d}");
        // Not a degenerate model: it does not repeat one token.
        let mut distinct = cached.tokens.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() >= 4, "{name}: {:?}", cached.tokens);

        // The cached forward in chunks (several new tokens after a cache:
        // the explicit mask) gives the full forward's logits.
        let seq: Vec<i64> = PROMPT
            .iter()
            .copied()
            .chain(cached.tokens.iter().copied())
            .collect();
        let ids = Tensor::from_slice(&seq).view([1, -1]);
        let whole = tch::no_grad(|| model.net.forward(&ids).unwrap());
        let mut cache = KvCache::new();
        let mut parts = Vec::new();
        for (start, len) in [(0, 3), (3, 1), (4, 7), (11, 1), (12, 13)] {
            parts.push(tch::no_grad(|| {
                model
                    .net
                    .forward_cached(&ids.narrow(1, start, len), &mut cache)
                    .unwrap()
            }));
            assert_eq!(cache.len(), start + len);
        }
        let chunked = Tensor::cat(&parts, 1);
        let d = difference(&chunked, &whole);
        assert!(d <= TOL, "{name}: chunked cached forward differs by {d}");

        // Sampling: the same seed gives the same tokens, with or without
        // the cache; top-k = 1 is greedy.
        let sampled = GenerateOptions {
            max_tokens: 15,
            temperature: 0.9,
            top_k: Some(8),
            seed: Some(11),
            ..Default::default()
        };
        let a = model.generate(&PROMPT, &sampled, none).unwrap();
        let b = model.generate(&PROMPT, &sampled, none).unwrap();
        let u = model.generate_uncached(&PROMPT, &sampled, none).unwrap();
        assert_eq!(a.tokens, b.tokens, "{name}: seeded sampling");
        assert_eq!(a.tokens, u.tokens, "{name}: seeded sampling, no cache");
        assert_ne!(a.tokens, cached.tokens, "{name}: sampling is not greedy");
        let top1 = GenerateOptions {
            top_k: Some(1),
            temperature: 1.0,
            seed: Some(5),
            ..greedy(20)
        };
        assert_eq!(
            model.generate(&PROMPT, &top1, none).unwrap().tokens,
            cached.tokens,
            "{name}: top-k 1"
        );

        // A stop token ends generation before it (it is not returned).
        let stop = cached.tokens[6];
        let at = cached.tokens.iter().position(|&t| t == stop).unwrap();
        let stopped = model
            .generate(
                &PROMPT,
                &GenerateOptions {
                    stop: Some(stop),
                    ..greedy(20)
                },
                none,
            )
            .unwrap();
        assert_eq!(stopped.stop, Stop::EndOfText);
        assert_eq!(stopped.tokens, cached.tokens[..at], "{name}: stop token");

        // The context ends generation at max_position_embeddings.
        let long = model.generate(&PROMPT, &greedy(200), none).unwrap();
        assert_eq!(long.stop, Stop::Context);
        assert_eq!(long.tokens.len() + PROMPT.len(), 64 + 1);
        assert_eq!(long.tokens[..20], cached.tokens[..], "{name}");
    }
}

fn python() -> PathBuf {
    let p = PathBuf::from(env!("ACCRUE_PYTHON"));
    assert!(
        p.exists(),
        "{} is missing: run `make setup` first",
        p.display()
    );
    p
}

/// The registry's decoder of `kind`.
fn decoder(kind: ModelKind) -> DecoderArch {
    DecoderArch::of_kind(kind).unwrap()
}

#[test]
fn greedy_continuation_equals_transformers_generate() {
    tch::set_num_threads(1);
    let tmp = tempfile::TempDir::new().unwrap();
    const N: usize = 24;
    // Qwen2 and Mistral (issue 39): a window of 5 positions, shorter than
    // the 29 the generation reaches, so the cache's mask matters.
    let qwen2 = LlamaConfig {
        arch: decoder(ModelKind::Qwen2),
        ..config(2, false, false)
    };
    let mistral = LlamaConfig {
        arch: decoder(ModelKind::Mistral),
        sliding_window: Some(5),
        ..config(2, false, false)
    };
    // Qwen3: per-head q/k norms over a head width of 16 (not 32 / 4),
    // attention biases, over the cache.
    let qwen3 = LlamaConfig {
        arch: decoder(ModelKind::Qwen3),
        explicit_head_dim: Some(16),
        attention_bias: true,
        ..config(2, false, false)
    };
    for (i, (name, c)) in [
        ("gqa", config(2, false, false)),
        ("tied_biases", config(4, true, true)),
        ("qwen2", qwen2),
        ("mistral_window", mistral),
        ("qwen3", qwen3),
    ]
    .into_iter()
    .enumerate()
    {
        let dir = tmp.path().join(name);
        write_step(&dir, &c, 7 + i as u64);
        let model = LoadedModel::from_step_dir(&dir, Device::Cpu).unwrap();
        let ours = model.generate(&PROMPT, &greedy(N), none).unwrap();
        let out = Command::new(python())
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/sample_reference.py"))
            .arg(&dir)
            .arg(serde_json::to_string(&PROMPT).unwrap())
            .arg(N.to_string())
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .output()
            .expect("run python");
        assert!(
            out.status.success(),
            "sample_reference.py failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
        assert_eq!(report["same_weights"], true, "{name}: {report}");
        let theirs: Vec<i64> = report["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_i64().unwrap())
            .collect();
        assert_eq!(ours.tokens, theirs, "{name}: greedy tokens");
        let last: Vec<f32> = report["last_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let d = difference(
            ours.last_logits.as_ref().unwrap(),
            &Tensor::from_slice(&last).to_kind(Kind::Float),
        );
        assert!(
            d <= TOL,
            "{name}: last logits differ from transformers' by {d}"
        );
    }
}

/// A word-level tokenizer.json of `n` words: "w0" .. "w{n-1}", split on
/// whitespace, decoded joined by spaces.
fn tokenizer_json(n: i64) -> Vec<u8> {
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..n).map(|i| (format!("w{i}"), i.into())).collect();
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"},
    });
    serde_json::to_vec_pretty(&json).unwrap()
}

fn sample_cli(args: &[&std::ffi::OsStr]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_accrue-worker"))
        .arg("sample")
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .expect("run accrue-worker sample")
}

#[test]
fn sample_command_prints_prompt_and_continuation() {
    tch::set_num_threads(1);
    let tmp = tempfile::TempDir::new().unwrap();
    let c = config(2, false, false);
    // A checkpoint folder: LATEST names step-3.
    let ckpt = tmp.path().join("ckpt");
    let step = ckpt.join("step-3");
    write_checkpoint(&ckpt, 3, &c, 3, 5);

    let model = LoadedModel::from_step_dir(&step, Device::Cpu).unwrap();
    let want = model.generate(&PROMPT, &greedy(10), none).unwrap().tokens;
    let prompt = PROMPT.map(|t| format!("w{t}")).join(" ");
    let expected = format!(
        "{prompt}{}\n",
        want.iter().map(|t| format!(" w{t}")).collect::<String>()
    );
    for dir in [&step, &ckpt] {
        let out = sample_cli(&[
            dir.as_os_str(),
            "--prompt".as_ref(),
            prompt.as_ref(),
            "--max-tokens".as_ref(),
            "10".as_ref(),
            "--temperature".as_ref(),
            "0".as_ref(),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout), expected, "{dir:?}");
    }

    // Sampling with a seed: the prompt, then 12 words; the same again.
    let seeded = |seed: &str| {
        let out = sample_cli(&[
            ckpt.as_os_str(),
            "--prompt".as_ref(),
            prompt.as_ref(),
            "--max-tokens".as_ref(),
            "12".as_ref(),
            "--top-k".as_ref(),
            "5".as_ref(),
            "--seed".as_ref(),
            seed.as_ref(),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let a = seeded("4");
    assert!(a.starts_with(&format!("{prompt} w")), "{a}");
    assert_eq!(a.trim_end().split(' ').count(), PROMPT.len() + 12, "{a}");
    assert_eq!(a, seeded("4"));

    // No tokenizer.json: the error names the folder and the flag; the
    // flag then gives one.
    let bare = tmp.path().join("bare");
    write_step(&bare, &c, 3);
    let out = sample_cli(&[bare.as_os_str(), "--prompt".as_ref(), prompt.as_ref()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "no tokenizer.json in {}; pass --tokenizer PATH",
            bare.display()
        )),
        "{err}"
    );
    assert!(out.stdout.is_empty());
    let out = sample_cli(&[
        bare.as_os_str(),
        "--prompt".as_ref(),
        prompt.as_ref(),
        "--max-tokens".as_ref(),
        "10".as_ref(),
        "--temperature".as_ref(),
        "0".as_ref(),
        "--tokenizer".as_ref(),
        step.join("tokenizer.json").as_os_str(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), expected);

    // Other clear errors: a folder with neither weights nor LATEST, a
    // LATEST naming a missing step (and no other), a negative temperature.
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = sample_cli(&[empty.as_os_str(), "--prompt".as_ref(), "w1".as_ref()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("neither a step folder") && err.contains("LATEST"),
        "{err}"
    );
    std::fs::write(empty.join("LATEST"), "step-9\n").unwrap();
    let out = sample_cli(&[empty.as_os_str(), "--prompt".as_ref(), "w1".as_ref()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains(
                "no step to sample: LATEST names step-9, which does not verify; \
                 step-9: no such folder"
            ),
        "{err}"
    );
    let out = sample_cli(&[
        step.as_os_str(),
        "--prompt".as_ref(),
        "w1".as_ref(),
        "--temperature=-1".as_ref(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("--temperature -1: must be 0 (greedy) or from 0.001 to 100"),
        "{err}"
    );
}

#[test]
fn bad_checkpoint_files_are_named() {
    let tmp = tempfile::TempDir::new().unwrap();
    let dir = tmp.path().join("step-1");
    write_step(&dir, &config(2, false, false), 1);
    // Weights of another model than config.json's.
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec(&config(4, false, false).to_hf_json()).unwrap(),
    )
    .unwrap();
    let err = LoadedModel::from_step_dir(&dir, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(&format!(
            "weights {}",
            dir.join("model.safetensors").display()
        )) && err.contains("k_proj.weight: file [16, 32], config.json's model [32, 32]"),
        "{err}"
    );
    // A config.json without a required field, one that is not JSON.
    let mut json = config(2, false, false).to_hf_json();
    json.as_object_mut().unwrap().remove("hidden_size");
    std::fs::write(dir.join("config.json"), serde_json::to_vec(&json).unwrap()).unwrap();
    let err = LoadedModel::from_step_dir(&dir, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(&format!(
            "model config {}",
            dir.join("config.json").display()
        )) && err.contains("hidden_size"),
        "{err}"
    );
    std::fs::write(dir.join("config.json"), "{").unwrap();
    let err = LoadedModel::from_step_dir(&dir, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("config.json: not valid JSON"), "{err}");
}

/// `accrue-worker sample` that must fail before printing anything: its
/// stderr, one line.
fn refused(args: &[&std::ffi::OsStr]) -> String {
    let out = sample_cli(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} succeeded: {err}");
    assert!(out.stdout.is_empty(), "{args:?} printed {:?}", out.stdout);
    err
}

/// The words of a sample's output.
fn words(out: &std::process::Output) -> Vec<String> {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// Issue 37, item 11: a temperature that is not finite or whose use would
/// overflow f32 logits, and negative numbers, are refused naming the flag
/// and its range, before any output; the ends of the range work.
#[test]
fn out_of_range_numbers_are_refused_naming_the_flag_and_range() {
    tch::set_num_threads(1);
    let tmp = tempfile::TempDir::new().unwrap();
    let c = config(2, false, false);
    let ckpt = tmp.path().join("ckpt");
    write_checkpoint(&ckpt, 1, &c, 1, 5);
    let step = ckpt.join("step-1");

    // The library refuses it too, before the first token.
    let model = LoadedModel::from_step_dir(&step, Device::Cpu).unwrap();
    let tiny = GenerateOptions {
        temperature: 1e-45,
        seed: Some(1),
        ..greedy(3)
    };
    let mut seen = 0;
    let err = model
        .generate(&PROMPT, &tiny, |_| {
            seen += 1;
            Ok(())
        })
        .unwrap_err()
        .to_string();
    assert_eq!(seen, 0);
    assert!(
        err.contains("--temperature 1e-45: must be 0 (greedy) or from 0.001 to 100"),
        "{err}"
    );

    let temperature = "must be 0 (greedy) or from 0.001 to 100";
    for (flag, value, allowed) in [
        ("--temperature", "1e-45", temperature),
        ("--temperature", "0.0009", temperature),
        ("--temperature", "101", temperature),
        ("--temperature", "-1", temperature),
        ("--temperature", "inf", temperature),
        ("--temperature", "-inf", temperature),
        ("--temperature", "NaN", temperature),
        ("--max-tokens", "-1", "must be 0 or more"),
        ("--top-k", "-1", "must be 1 or more"),
        ("--top-k", "0", "must be 1 or more"),
    ] {
        let err = refused(&[
            step.as_os_str(),
            "--prompt".as_ref(),
            "w1".as_ref(),
            flag.as_ref(),
            value.as_ref(),
        ]);
        assert!(
            err.contains(&format!("{flag} {value}: {allowed}")),
            "{flag} {value}: {err}"
        );
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    }
    let err = refused(&[
        step.as_os_str(),
        "--prompt".as_ref(),
        "w1".as_ref(),
        "--seed".as_ref(),
        "-1".as_ref(),
    ]);
    assert!(
        err.contains(
            "'-1' for '--seed <SEED>': must be a whole number from 0 to 18446744073709551615"
        ),
        "{err}"
    );

    // The ends of the range sample.
    for t in ["0.001", "100"] {
        let out = sample_cli(&[
            step.as_os_str(),
            "--prompt".as_ref(),
            "w1".as_ref(),
            "--max-tokens".as_ref(),
            "4".as_ref(),
            "--temperature".as_ref(),
            t.as_ref(),
            "--seed".as_ref(),
            "2".as_ref(),
        ]);
        assert_eq!(words(&out).len(), 5, "--temperature {t}");
    }
}

/// Issue 37, item 11: a tokenizer with fewer ids than the model's
/// vocab_size (a vocabulary padded past the tokenizer's) samples only
/// among the ids it knows, saying so with both sizes; no sampled token
/// is dropped from the text.
#[test]
fn a_smaller_tokenizer_samples_only_its_ids() {
    tch::set_num_threads(1);
    let tmp = tempfile::TempDir::new().unwrap();
    let step = tmp.path().join("step-1");
    write_step(&step, &config(2, false, false), 5);
    let small = tmp.path().join("tokenizer64.json");
    std::fs::write(&small, tokenizer_json(64)).unwrap();
    // Temperature 100: nearly uniform over the ids allowed, so a third of
    // the draws would be ids 64..97 if they were not excluded.
    let out = sample_cli(&[
        step.as_os_str(),
        "--prompt".as_ref(),
        "w5 w17 w42".as_ref(),
        "--max-tokens".as_ref(),
        "40".as_ref(),
        "--temperature".as_ref(),
        "100".as_ref(),
        "--seed".as_ref(),
        "3".as_ref(),
        "--tokenizer".as_ref(),
        small.as_os_str(),
    ]);
    let got = words(&out);
    assert_eq!(got.len(), 3 + 40, "{got:?}");
    for w in &got {
        let id: i64 = w.strip_prefix('w').unwrap().parse().unwrap();
        assert!((0..64).contains(&id), "{w} in {got:?}");
    }
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("vocab_size = 97") && err.contains("knows 64 of its ids"),
        "{err}"
    );
}

fn greedy_text(dir: &Path, n: &str) -> std::process::Output {
    sample_cli(&[
        dir.as_os_str(),
        "--prompt".as_ref(),
        "w5 w17 w42".as_ref(),
        "--max-tokens".as_ref(),
        n.as_ref(),
        "--temperature".as_ref(),
        "0".as_ref(),
    ])
}

/// Issue 37, item 11: a checkpoint folder whose LATEST names a step that
/// is gone (training pruned it after LATEST was read) or does not verify,
/// or that has no LATEST, is sampled at its newest step that verifies (a
/// note on stderr says which and why); with none, one line in words.
#[test]
fn a_checkpoint_folder_falls_back_to_its_newest_verified_step() {
    tch::set_num_threads(1);
    let tmp = tempfile::TempDir::new().unwrap();
    let c = config(2, false, false);
    let ckpt = tmp.path().join("ckpt");
    write_checkpoint(&ckpt, 2, &c, 21, 5);
    write_checkpoint(&ckpt, 4, &c, 41, 5);
    let step2 = words(&greedy_text(&ckpt.join("step-2"), "12"));
    let step4 = words(&greedy_text(&ckpt, "12"));
    assert_ne!(step2, step4, "two models that continue alike");

    // LATEST names step-4, which is gone.
    std::fs::remove_dir_all(ckpt.join("step-4")).unwrap();
    let out = greedy_text(&ckpt, "12");
    assert_eq!(words(&out), step2);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("step-2") && err.contains("LATEST names step-4, which does not verify"),
        "{err}"
    );

    // No LATEST: the newest step folder.
    std::fs::remove_file(ckpt.join("LATEST")).unwrap();
    let out = greedy_text(&ckpt, "12");
    assert_eq!(words(&out), step2);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no LATEST"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // LATEST names a step whose weights were damaged after the write.
    write_checkpoint(&ckpt, 6, &c, 61, 5);
    let weights = ckpt.join("step-6").join("model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x55;
    std::fs::write(&weights, bytes).unwrap();
    let out = greedy_text(&ckpt, "12");
    assert_eq!(words(&out), step2);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("model.safetensors: checksum"), "{err}");

    // Nothing readable: one line naming the folder and each step's fault.
    std::fs::remove_dir_all(ckpt.join("step-2")).unwrap();
    let err = refused(&[ckpt.as_os_str(), "--prompt".as_ref(), "w1".as_ref()]);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains(&ckpt.display().to_string())
            && err.contains("LATEST names step-6, which does not verify")
            && err.contains("step-6: model.safetensors: checksum"),
        "{err}"
    );
}

/// Issue 37, item 11: sampling a checkpoint folder while training writes
/// to it and prunes to the newest step (keep = 1): every load succeeds.
#[test]
fn sampling_while_training_prunes_never_fails() {
    tch::set_num_threads(1);
    let tmp = tempfile::TempDir::new().unwrap();
    let c = config(2, false, false);
    let ckpt = tmp.path().join("ckpt");
    write_checkpoint(&ckpt, 1, &c, 1, 1);
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (ckpt, c, done) = (ckpt.clone(), c.clone(), done.clone());
        std::thread::spawn(move || {
            for step in 2..=40 {
                write_checkpoint(&ckpt, step, &c, step, 1);
            }
            done.store(true, std::sync::atomic::Ordering::Relaxed);
        })
    };
    let (mut loads, mut failures) = (0, Vec::new());
    while !done.load(std::sync::atomic::Ordering::Relaxed) {
        loads += 1;
        let r = (|| -> accrue_worker::sample::Result<()> {
            let files = read_step_files(&ckpt)?;
            load_tokenizer(&files, None)?;
            LoadedModel::from_files(&files, Device::Cpu)?;
            Ok(())
        })();
        if let Err(e) = r {
            failures.push(e.to_string());
        }
    }
    writer.join().unwrap();
    assert!(loads >= 20, "{loads} loads only");
    assert!(
        failures.is_empty(),
        "{} of {loads} failed: {failures:?}",
        failures.len()
    );
}

/// A folder saved above transformers' shard size (issue 39): shards and
/// `model.safetensors.index.json`, bf16 weights among them, sample as the
/// same weights in one file do; an index that names a file outside its
/// folder is refused naming it.
#[test]
fn a_sharded_folder_samples_as_its_single_file() {
    tch::set_num_threads(1);
    let tmp = tempfile::TempDir::new().unwrap();
    let c = config(2, false, false);
    // The single file, its weights rounded to bf16 (the sharded copy holds
    // them as bf16, which loads exactly into these float32 values).
    let one = tmp.path().join("one");
    std::fs::create_dir_all(&one).unwrap();
    let vars: Vec<(String, Tensor)> = weights(&c, 3)
        .into_iter()
        .map(|(n, t)| (n, t.to_kind(tch::Kind::BFloat16).to_kind(tch::Kind::Float)))
        .collect();
    let named: Vec<(&str, &Tensor)> = vars.iter().map(|(n, t)| (n.as_str(), t)).collect();
    Tensor::write_safetensors(&named, one.join("model.safetensors")).unwrap();
    let sharded = tmp.path().join("sharded");
    std::fs::create_dir_all(&sharded).unwrap();
    let mut map = serde_json::Map::new();
    for (i, chunk) in vars.chunks(vars.len().div_ceil(3)).enumerate() {
        let file = format!("model-{:05}-of-00003.safetensors", i + 1);
        let bf16: Vec<(String, Tensor)> = chunk
            .iter()
            .map(|(n, t)| (n.clone(), t.to_kind(tch::Kind::BFloat16)))
            .collect();
        let named: Vec<(&str, &Tensor)> = bf16.iter().map(|(n, t)| (n.as_str(), t)).collect();
        Tensor::write_safetensors(&named, sharded.join(&file)).unwrap();
        for (n, _) in chunk {
            map.insert(n.clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
    for d in [&one, &sharded] {
        std::fs::write(
            d.join("config.json"),
            serde_json::to_vec(&c.to_hf_json()).unwrap(),
        )
        .unwrap();
        std::fs::write(d.join("tokenizer.json"), tokenizer_json(VOCAB)).unwrap();
    }
    let prompt = PROMPT.map(|t| format!("w{t}")).join(" ");
    let text = |dir: &Path| {
        let out = sample_cli(&[
            dir.as_os_str(),
            "--prompt".as_ref(),
            prompt.as_ref(),
            "--max-tokens".as_ref(),
            "8".as_ref(),
            "--temperature".as_ref(),
            "0".as_ref(),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let want = text(&one);
    assert_eq!(text(&sharded), want);
    // The index may not reach outside the folder.
    let mut bad = index.clone();
    let first = vars[0].0.clone();
    bad["weight_map"][&first] = "../one/model.safetensors".into();
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        serde_json::to_vec(&bad).unwrap(),
    )
    .unwrap();
    let e = match LoadedModel::load(c.clone(), &sharded, Device::Cpu) {
        Ok(_) => panic!("an index naming ../ is refused"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("../one/model.safetensors") && e.contains("plain file name"),
        "{e}"
    );
}

/// Issue 39: a step folder written in shards samples as the same model in
/// one file does, through a checkpoint folder (verified against its
/// manifest) and named directly.
#[test]
fn a_sharded_step_samples_as_the_one_file_step() {
    tch::set_num_threads(1);
    let tmp = tempfile::TempDir::new().unwrap();
    let c = config(2, false, false);
    let one = tmp.path().join("one");
    let sharded = tmp.path().join("sharded");
    write_checkpoint(&one, 1, &c, 7, 5);
    write_checkpoint_sharded(&sharded, 1, &c, 7, 5, 2048);
    let step = sharded.join("step-1");
    assert!(step.join("model.safetensors.index.json").is_file());
    let shards = std::fs::read_dir(&step)
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_string_lossy().starts_with("model-")
        })
        .count();
    assert!(shards >= 3, "{shards} shards");
    let tokens = |dir: &Path| {
        let files = read_step_files(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let model = LoadedModel::from_files(&files, Device::Cpu).unwrap();
        model.generate(&PROMPT, &greedy(8), none).unwrap().tokens
    };
    let want = tokens(&one);
    assert_eq!(tokens(&sharded), want);
    assert_eq!(tokens(&step), want);
}
