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

use accrue_worker::family::llama::{KvCache, Net};
use accrue_worker::sample::{GenerateOptions, LoadedModel, Stop};
use accrue_worker::spec::LlamaConfig;
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

/// A step-like folder: model.safetensors (HF names) and config.json.
fn write_step(dir: &Path, c: &LlamaConfig, seed: u64) {
    std::fs::create_dir_all(dir).unwrap();
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
    let named: Vec<(&str, &Tensor)> = vars.iter().map(|(n, t)| (n.as_str(), t)).collect();
    Tensor::write_safetensors(&named, dir.join("model.safetensors")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&c.to_hf_json()).unwrap(),
    )
    .unwrap();
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
            stop: None,
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

#[test]
fn greedy_continuation_equals_transformers_generate() {
    tch::set_num_threads(1);
    let tmp = tempfile::TempDir::new().unwrap();
    const N: usize = 24;
    for (i, (name, c)) in [
        ("gqa", config(2, false, false)),
        ("tied_biases", config(4, true, true)),
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

/// A word-level tokenizer.json: "w0" .. "w96", split on whitespace,
/// decoded joined by spaces.
fn write_tokenizer(path: &Path) {
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..VOCAB).map(|i| (format!("w{i}"), i.into())).collect();
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
    std::fs::write(path, serde_json::to_vec_pretty(&json).unwrap()).unwrap();
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
    write_step(&step, &c, 3);
    write_tokenizer(&step.join("tokenizer.json"));
    std::fs::write(ckpt.join("LATEST"), "step-3\n").unwrap();

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
    // LATEST naming a missing step, a negative temperature.
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
        !out.status.success() && err.contains("names step-9, which has no model.safetensors"),
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
        !out.status.success() && err.contains("--temperature -1: must be a finite number >= 0"),
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
