//! `[model] kind = "llama"` against transformers' LlamaForCausalLM
//! (issue 30): accrue's initial weights load strictly into transformers'
//! model (and `from_pretrained` reads accrue's config.json beside them),
//! the parameter names and shapes are its state_dict's, and on a
//! right-padded, partly masked batch the logits, the summed token
//! cross-entropy and every gradient are transformers', for a base model,
//! grouped-query attention, tied embeddings, attention and MLP biases and
//! another rope_theta.
//!
//! Tolerance: a tensor agrees when max |accrue - transformers| <= 1e-5 *
//! max(1, max |transformers|), i.e. 1e-5 absolute for values up to 1 and
//! 1e-5 relative to the largest value above (fp32, one thread each side;
//! the same libtorch kernels, so only summation order differs).

use accrue_worker::cuda::amp::Autocast;
use accrue_worker::family::model::{Model, WeightsFrom};
use accrue_worker::spec::{LlamaConfig, ModelSpec, Precision};
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Reduction, Tensor};

const TOL: f64 = 1e-5;
const VOCAB: i64 = 97;
const T: i64 = 12;
/// Real (unpadded) input tokens per row.
const LENGTHS: [i64; 4] = [12, 9, 5, 2];
const PAD: i64 = 0;

fn python() -> PathBuf {
    let p = PathBuf::from(env!("ACCRUE_PYTHON"));
    assert!(
        p.exists(),
        "{} is missing: run `make setup` first",
        p.display()
    );
    p
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/llama_reference.py")
}

/// The tiny model of every case: vocab 97, width 32, 2 layers, 4 heads,
/// MLP 64, plus `extra` TOML lines.
fn spec(extra: &str) -> ModelSpec {
    spec_of("llama", extra)
}

/// [`spec`] of another decoder kind (qwen2, mistral, qwen3).
fn spec_of(kind: &str, extra: &str) -> ModelSpec {
    toml::from_str(&format!(
        "kind = \"{kind}\"\nvocab_size = {VOCAB}\nhidden_size = 32\nintermediate_size = 64\n\
         num_hidden_layers = 2\nnum_attention_heads = 4\nmax_position_embeddings = 64\n{extra}"
    ))
    .unwrap()
}

/// max |a - b| / max(1, max |b|).
fn difference(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    let diff = (a - b).abs().max().double_value(&[]);
    diff / b.abs().max().double_value(&[]).max(1.0)
}

/// input_ids [N, T] right-padded with PAD, targets [N, T] (-100 on pads
/// and on a masked prompt), the attention mask of the real tokens.
fn batch() -> (Tensor, Tensor, Tensor) {
    // Fixed tokens in 1..VOCAB (no generator: tests in parallel re-seed
    // libtorch's global one).
    let n = LENGTHS.len() as i64;
    let tokens: Vec<i64> = (0..n * (T + 1))
        .map(|j| (j * j * 7 + j * 31 + 5) % (VOCAB - 1) + 1)
        .collect();
    let rows = Tensor::from_slice(&tokens).view([n, T + 1]);
    let ids = Tensor::full([n, T], PAD, (Kind::Int64, Device::Cpu));
    let targets = Tensor::full([n, T], -100, (Kind::Int64, Device::Cpu));
    let mask = Tensor::zeros([n, T], (Kind::Int64, Device::Cpu));
    for (i, &len) in LENGTHS.iter().enumerate() {
        let i = i as i64;
        ids.get(i)
            .narrow(0, 0, len)
            .copy_(&rows.get(i).narrow(0, 0, len));
        targets
            .get(i)
            .narrow(0, 0, len)
            .copy_(&rows.get(i).narrow(0, 1, len));
        let _ = mask.get(i).narrow(0, 0, len).fill_(1);
    }
    // Row 1's first three targets are a prompt: not predicted.
    let _ = targets.get(1).narrow(0, 0, 3).fill_(-100);
    (ids, targets, mask)
}

/// logits, summed cross-entropy and gradients by name of one forward and
/// backward through accrue's model.
fn accrue_step(model: &Model, ids: &Tensor, targets: &Tensor) -> (Tensor, Tensor, Vec<Tensor>) {
    for (_, p) in &model.params {
        let mut g = p.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
    let logits = model.forward(ids, true).unwrap();
    assert_eq!(logits.kind(), Kind::Float);
    assert_eq!(logits.size(), [LENGTHS.len() as i64, T, VOCAB]);
    let loss = logits.view([-1, VOCAB]).cross_entropy_loss::<Tensor>(
        &targets.view([-1]),
        None,
        Reduction::Sum,
        -100,
        0.0,
    );
    loss.backward();
    (logits.detach(), loss.detach(), model.grads())
}

struct Case {
    name: &'static str,
    extra: &'static str,
    dir: PathBuf,
    model: Model,
    spec: ModelSpec,
}

#[test]
fn llama_equals_transformers_llama_for_causal_lm() {
    tch::set_num_threads(1);
    let tmp = tempfile::TempDir::new().unwrap();
    let (ids, targets, mask) = batch();
    let variants = [
        ("base", ""),
        ("gqa", "num_key_value_heads = 2"),
        ("tied", "tie_word_embeddings = true"),
        ("biases", "attention_bias = true\nmlp_bias = true"),
        ("rope_theta", "rope_theta = 500000.0\nrms_norm_eps = 1e-5"),
        // Llama 3.1's RoPE scaling (issue 39), from a config.json: with
        // head_dim 8 one frequency is in the smoothed band, three are
        // divided by the factor.
        (
            "llama3",
            "config = llama3 rope_scaling (factor 8, 1, 4, 16)",
        ),
        // The families that extend Llama (issue 39), from their own
        // config.json: Qwen2's q, k, v biases; Mistral's window of 4
        // positions, shorter than the rows (12), so that it matters.
        ("qwen2", "kind = qwen2, model_type qwen2"),
        // A head width other than hidden / heads (Mistral Nemo's kind):
        // q_proj 32 -> 4 x 16.
        ("head_dim", "config = head_dim 16 (hidden 32, 4 heads)"),
        ("mistral", "kind = mistral, sliding_window = 4"),
        // Qwen3: per-head q/k norms, its own head width (16 against
        // 32 / 4 = 8), grouped-query attention and attention biases.
        (
            "qwen3",
            "kind = qwen3, head_dim 16, 2 kv heads, attention_bias",
        ),
    ];
    let mut cases = Vec::new();
    for (i, (name, extra)) in variants.into_iter().enumerate() {
        let spec = if name == "llama3" {
            let mut json = LlamaConfig::resolve(&spec("")).unwrap().to_hf_json();
            json["rope_scaling"] = serde_json::json!({
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
            });
            json.as_object_mut().unwrap().remove("rope_parameters");
            let file = tmp.path().join("llama3-config.json");
            std::fs::write(&file, serde_json::to_vec(&json).unwrap()).unwrap();
            let spec = spec(&format!("config = \"{}\"", file.display()));
            let resolved = LlamaConfig::resolve(&spec).unwrap();
            assert_eq!(resolved.rope_scaling.name(), "llama3");
            spec
        } else if name == "head_dim" {
            let mut json = LlamaConfig::resolve(&spec("")).unwrap().to_hf_json();
            json["head_dim"] = 16.into();
            let file = tmp.path().join("head-dim-config.json");
            std::fs::write(&file, serde_json::to_vec(&json).unwrap()).unwrap();
            let spec = spec(&format!("config = \"{}\"", file.display()));
            assert_eq!(LlamaConfig::resolve(&spec).unwrap().head_dim(), 16);
            spec
        } else if name == "qwen2" || name == "mistral" || name == "qwen3" {
            let mut json = LlamaConfig::resolve(&spec("")).unwrap().to_hf_json();
            let o = json.as_object_mut().unwrap();
            o.remove("attention_bias");
            o.remove("mlp_bias");
            o.insert("model_type".into(), name.into());
            if name == "mistral" {
                o.insert("sliding_window".into(), 4.into());
            } else {
                o.insert("use_sliding_window".into(), false.into());
            }
            if name == "qwen3" {
                o.insert("head_dim".into(), 16.into());
                o.insert("num_key_value_heads".into(), 2.into());
                o.insert("attention_bias".into(), true.into());
            }
            let file = tmp.path().join(format!("{name}-config.json"));
            std::fs::write(&file, serde_json::to_vec(&json).unwrap()).unwrap();
            let spec = spec_of(name, &format!("config = \"{}\"", file.display()));
            let resolved = LlamaConfig::resolve(&spec).unwrap();
            assert_eq!(resolved.arch.model_type(), name);
            spec
        } else {
            spec(extra)
        };
        let config = LlamaConfig::resolve(&spec).unwrap();
        let model = Model::build(&spec, &[T], VOCAB, Device::Cpu, 7 + i as u64).unwrap();
        // transformers' init: normal(0, 0.02) weights, zero biases, unit norms.
        for (n, p) in &model.params {
            if n.ends_with("norm.weight") {
                assert_eq!(p.min().double_value(&[]), 1.0, "{name}: {n}");
                assert_eq!(p.max().double_value(&[]), 1.0, "{name}: {n}");
            } else if n.ends_with(".bias") {
                assert_eq!(p.abs().max().double_value(&[]), 0.0, "{name}: {n}");
            } else {
                let std = p.std(true).double_value(&[]);
                let mean = p.mean(Kind::Float).double_value(&[]);
                assert!((0.017..0.023).contains(&std), "{name}: {n} std {std}");
                assert!(mean.abs() < 0.004, "{name}: {n} mean {mean}");
            }
        }
        // Biases and norms off their initial values, so that using them
        // (and where) shows in the outputs; queries and keys 20 times
        // larger, so that attention is far from uniform and positions
        // (RoPE) weigh in the logits.
        tch::no_grad(|| {
            for (n, p) in &model.params {
                let mut p = p.shallow_clone();
                if n.ends_with(".bias") || n.ends_with("norm.weight") {
                    // A fixed pattern (no generator, as in batch()).
                    let k = p.numel() as i64;
                    let wave = (Tensor::arange(k, (Kind::Float, Device::Cpu)) * 0.7 + i as f64)
                        .sin()
                        .view(p.size().as_slice());
                    let _ = p.f_add_(&(wave * 0.1)).unwrap();
                } else if n.ends_with("q_proj.weight") || n.ends_with("k_proj.weight") {
                    let _ = p.f_mul_scalar_(20.0).unwrap();
                }
            }
        });
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_vec_pretty(&config.to_hf_json()).unwrap(),
        )
        .unwrap();
        let named: Vec<(&str, &Tensor)> =
            model.params.iter().map(|(n, t)| (n.as_str(), t)).collect();
        Tensor::write_safetensors(&named, dir.join("model.safetensors")).unwrap();
        Tensor::write_safetensors(
            &[
                ("input_ids", &ids),
                ("targets", &targets),
                ("attention_mask", &mask),
            ],
            dir.join("batch.safetensors"),
        )
        .unwrap();
        cases.push(Case {
            name,
            extra,
            dir,
            model,
            spec,
        });
    }
    let list: Vec<serde_json::Value> = cases
        .iter()
        .map(|c| serde_json::json!({"dir": c.dir, "bf16": c.name == "gqa" || c.name == "qwen3"}))
        .collect();
    let list_path = tmp.path().join("cases.json");
    std::fs::write(&list_path, serde_json::to_vec(&list).unwrap()).unwrap();
    let out = std::process::Command::new(python())
        .arg(script())
        .arg(&list_path)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "llama_reference.py failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reports: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));

    let mut base_logits = None;
    for (case, report) in cases.iter().zip(&reports) {
        let name = case.name;
        assert_eq!(report["attn"], "sdpa", "{name}");
        let class = match name {
            "qwen2" => "Qwen2ForCausalLM",
            "mistral" => "MistralForCausalLM",
            "qwen3" => "Qwen3ForCausalLM",
            _ => "LlamaForCausalLM",
        };
        assert_eq!(report["class"], class, "{name}");
        assert_eq!(report["same_weights_from_pretrained"], true, "{name}");
        // Names and shapes: the state_dict's, in its order (lm_head aside
        // when tied).
        let tied = report["tied"].as_bool().unwrap();
        let want: Vec<(String, Vec<i64>)> = report["names"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap().to_string())
            .filter(|n| !(tied && n == "lm_head.weight"))
            .map(|n| {
                let shape = report["shapes"][n.as_str()]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_i64().unwrap())
                    .collect();
                (n, shape)
            })
            .collect();
        let got: Vec<(String, Vec<i64>)> = case
            .model
            .params
            .iter()
            .map(|(n, t)| (n.clone(), t.size()))
            .collect();
        assert_eq!(got, want, "{name}: names and shapes");
        assert!(case.model.buffers.is_empty(), "{name}");
        assert!(
            report["mask_diff"].as_f64().unwrap() < TOL,
            "{name}: {report}"
        );

        let reference = Tensor::read_safetensors(case.dir.join("reference.safetensors")).unwrap();
        let get = |k: &str| {
            reference
                .iter()
                .find(|(n, _)| n == k)
                .unwrap_or_else(|| panic!("{name}: reference has no {k}"))
                .1
                .shallow_clone()
        };
        let (logits, loss, grads) = accrue_step(&case.model, &ids, &targets);
        let d = difference(&logits, &get("logits"));
        assert!(d <= TOL, "{name}: logits differ by {d}");
        let want_loss = get("loss").double_value(&[0]);
        let got_loss = loss.double_value(&[]);
        assert!(
            (got_loss - want_loss).abs() <= TOL * want_loss.abs().max(1.0),
            "{name}: loss {got_loss} vs transformers' {want_loss}"
        );
        let mut worst = 0f64;
        for ((n, _), g) in case.model.params.iter().zip(&grads) {
            let d = difference(g, &get(&format!("grad.{n}")));
            assert!(d <= TOL, "{name}: gradient of {n} differs by {d}");
            worst = worst.max(d);
        }
        eprintln!(
            "{name} ({}): loss {got_loss:.6} (transformers {want_loss:.6}), logits within \
             {:.1e}, gradients within {worst:.1e}",
            case.extra.replace('\n', ", "),
            difference(&logits, &get("logits"))
        );
        if name == "base" {
            base_logits = Some(get("logits"));
        }
        // From the folder transformers wrote with save_pretrained above
        // its shard size (model-0000i-of-0000n.safetensors + the index):
        // the same logits and gradients.
        let sharded = case.dir.join("hf-sharded");
        assert!(
            sharded.join("model.safetensors.index.json").is_file(),
            "{name}: not sharded"
        );
        let mut from_hf = Model::build(&case.spec, &[T], VOCAB, Device::Cpu, 99).unwrap();
        let weights = accrue_worker::engine::read_init(&sharded).unwrap();
        from_hf
            .load_named(WeightsFrom::Init(&sharded), weights)
            .unwrap();
        let (logits, _, grads) = accrue_step(&from_hf, &ids, &targets);
        let d = difference(&logits, &get("logits"));
        assert!(
            d <= TOL,
            "{name}: logits from the sharded folder differ by {d}"
        );
        for ((n, _), g) in from_hf.params.iter().zip(&grads) {
            let d = difference(g, &get(&format!("grad.{n}")));
            assert!(
                d <= TOL,
                "{name}: gradient of {n} from the sharded folder differs by {d}"
            );
        }
        if name == "gqa" || name == "qwen3" {
            bf16_equals_autocast(&case.model, &case.dir, &ids, &targets);
        }
    }

    // The comparison can fail: the base weights under another rope_theta
    // give other logits, by far more than the tolerance.
    let base = &cases[0];
    let mut other =
        Model::build(&spec("rope_theta = 20000.0"), &[T], VOCAB, Device::Cpu, 1).unwrap();
    let weights = Tensor::read_safetensors(base.dir.join("model.safetensors")).unwrap();
    other
        .load_named(
            WeightsFrom::Init(&base.dir.join("model.safetensors")),
            weights,
        )
        .unwrap();
    let logits = other.forward(&ids, false).unwrap();
    let d = difference(&logits, base_logits.as_ref().unwrap());
    eprintln!("rope_theta 20000 instead of 10000: logits differ by {d:.1e}");
    assert!(
        d > 100.0 * TOL,
        "another rope_theta changes the logits by only {d}"
    );
}

/// The step under bf16 autocast against torch.autocast("cpu",
/// torch.bfloat16) on the same weights (the logits are fp32 at the end on
/// both sides). Tolerance: as above, the same kernels and casts.
fn bf16_equals_autocast(model: &Model, dir: &Path, ids: &Tensor, targets: &Tensor) {
    let reference = Tensor::read_safetensors(dir.join("reference-bf16.safetensors")).unwrap();
    let get = |k: &str| {
        reference
            .iter()
            .find(|(n, _)| n == k)
            .unwrap_or_else(|| panic!("bf16 reference has no {k}"))
            .1
            .shallow_clone()
    };
    let (logits, loss, grads) = {
        let _amp = Autocast::enter(Device::Cpu, Precision::Bf16).unwrap();
        accrue_step(model, ids, targets)
    };
    let d = difference(&logits, &get("logits"));
    assert!(d <= TOL, "bf16: logits differ by {d}");
    let (got, want) = (loss.double_value(&[]), get("loss").double_value(&[0]));
    assert!(
        (got - want).abs() <= TOL * want.abs().max(1.0),
        "bf16: loss {got} vs {want}"
    );
    let mut worst = 0f64;
    for ((n, _), g) in model.params.iter().zip(&grads) {
        let d = difference(g, &get(&format!("grad.{n}")));
        assert!(d <= TOL, "bf16: gradient of {n} differs by {d}");
        worst = worst.max(d);
    }
    // The case's folder is named after it.
    let name = dir.file_name().unwrap_or_default().to_string_lossy();
    eprintln!("{name} under bf16 autocast: loss {got:.6} (torch.autocast {want:.6}), logits within {d:.1e}, gradients within {worst:.1e}");
}

/// The probe: token ids in, `[2, T, vocab]` out; a model built for other
/// data is refused with the reason.
#[test]
fn llama_builds_for_token_rows_only() {
    let m = Model::build(&spec(""), &[T], VOCAB, Device::Cpu, 1).unwrap();
    assert_eq!(m.params.len(), 1 + 2 * 9 + 1 + 1);
    // A token id outside the vocabulary is an error of the step, not a
    // panic of its thread.
    let ids = Tensor::from_slice(&[1i64, 2, VOCAB]).view([1, 3]);
    let err = m.forward(&ids, true).err().unwrap().to_string();
    assert!(
        err.starts_with(
            "libtorch error while running the model's forward pass: index out of range"
        ),
        "{err}"
    );
    let err = Model::build(&spec(""), &[1, 28, 28], VOCAB, Device::Cpu, 1)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("needs token rows of shape [T]"), "{err}");
    let err = Model::build(&spec(""), &[T], 10, Device::Cpu, 1)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("vocab_size = 97"), "{err}");
    let err = Model::build(&spec(""), &[65], VOCAB, Device::Cpu, 1)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("max_position_embeddings = 64"), "{err}");
    let err = Model::build(
        &spec("num_key_value_heads = 3"),
        &[T],
        VOCAB,
        Device::Cpu,
        1,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("model.num_key_value_heads = 3: must divide model.num_attention_heads = 4"),
        "{err}"
    );
}

/// The std of a tensor's values.
fn std_of(t: &Tensor) -> f64 {
    t.to_kind(Kind::Double).std(true).double_value(&[])
}

/// The initial weights are transformers' `_init_weights`: normal(0,
/// initializer_range) for the embedding and the linear weights, with the
/// config.json's initializer_range (0.02 without one).
#[test]
fn llama_draws_its_initial_weights_with_the_config_initializer_range() {
    let tmp = tempfile::TempDir::new().unwrap();
    let path = tmp.path().join("config.json");
    let mut config = LlamaConfig::resolve(&spec("")).unwrap().to_hf_json();
    config["initializer_range"] = serde_json::json!(0.2);
    std::fs::write(&path, serde_json::to_vec(&config).unwrap()).unwrap();
    let from_file = spec(&format!("config = {:?}", path.display().to_string()));
    for (spec, want) in [(spec(""), 0.02), (from_file, 0.2)] {
        let m = Model::build(&spec, &[T], VOCAB, Device::Cpu, 1).unwrap();
        for (name, t) in &m.params {
            if name.ends_with("embed_tokens.weight") || name.ends_with("proj.weight") {
                let got = std_of(t);
                assert!(
                    (got / want - 1.0).abs() < 0.15,
                    "{name}: std {got}, initializer_range {want}"
                );
            }
        }
    }
}

/// A folder transformers loads loads: RoPE's `inv_freq` buffers (saved
/// by older versions) are ignored, and a tied model's `lm_head.weight`
/// (a `state_dict()` holds it) is accepted when it equals the embedding,
/// refused naming it when it does not.
#[test]
fn llama_init_folder_with_rope_buffers_and_a_tied_head_loads_as_transformers_loads_it() {
    let tied = spec("tie_word_embeddings = true");
    let source = Model::build(&tied, &[T], VOCAB, Device::Cpu, 2).unwrap();
    let embed = &source
        .params
        .iter()
        .find(|(n, _)| n == "model.embed_tokens.weight")
        .unwrap()
        .1;
    let tmp = tempfile::TempDir::new().unwrap();
    let file = tmp.path().join("model.safetensors");
    let write = |head: &Tensor| {
        let buffer = Tensor::from_slice(&[1.0f32, 0.1, 0.01, 0.001]);
        let mut named: Vec<(String, Tensor)> = source
            .params
            .iter()
            .map(|(n, t)| (n.clone(), t.detach().copy()))
            .collect();
        named.push(("lm_head.weight".into(), head.copy()));
        named.push(("model.rotary_emb.inv_freq".into(), buffer.copy()));
        for i in 0..2 {
            let name = format!("model.layers.{i}.self_attn.rotary_emb.inv_freq");
            named.push((name, buffer.copy()));
        }
        Tensor::write_safetensors(&named, &file).unwrap();
        Tensor::read_safetensors(&file).unwrap()
    };
    let mut model = Model::build(&tied, &[T], VOCAB, Device::Cpu, 1).unwrap();
    model
        .load_named(WeightsFrom::Init(&file), write(&embed.detach()))
        .unwrap_or_else(|e| panic!("{e}"));
    for ((n, a), (_, b)) in model.params.iter().zip(&source.params) {
        assert!(a.equal(b), "{n} not loaded");
    }
    let ids = Tensor::from_slice(&[5i64, 17, 42]).view([1, 3]);
    let want = source.forward(&ids, false).unwrap();
    assert!(model.forward(&ids, false).unwrap().equal(&want));

    // Another head than the embedding: refused, naming both.
    let err = model
        .load_named(WeightsFrom::Init(&file), write(&(embed.detach() + 1e-3)))
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        format!(
            "initial weights {}: lm_head.weight (Float [97, 32]) differs from \
             model.embed_tokens.weight (Float [97, 32]), which the model ties it to \
             (tie_word_embeddings = true): lm_head.weight must be absent or equal \
             model.embed_tokens.weight (weights with their own head need \
             tie_word_embeddings = false)",
            file.display()
        )
    );
    // An untied model takes the file's head as its own.
    let mut untied = Model::build(&spec(""), &[T], VOCAB, Device::Cpu, 1).unwrap();
    let head = embed.detach() + 1e-3;
    untied
        .load_named(WeightsFrom::Init(&file), write(&head))
        .unwrap_or_else(|e| panic!("{e}"));
    let (_, got) = untied
        .params
        .iter()
        .find(|(n, _)| n == "lm_head.weight")
        .unwrap();
    assert!(got.equal(&head));
}
