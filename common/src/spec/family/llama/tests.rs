//! The spec of a language model: llama fields, config files and token
//! data (issue 30).

use crate::spec::tests::{invalid, BASE};
use crate::spec::*;
use std::path::Path;

/// A llama job on `sequences` data with `model` and `data` lines added.
fn llama_text(model: &str, data: &str) -> String {
    format!(
        "name = \"lm\"\n[model]\nkind = \"llama\"\n{model}\n[data]\nkind = \"sequences\"\npath = \"rows.safetensors\"\nbatch_size = 4\n{data}\n[optimizer]\nkind = \"adamw\"\nlr = 0.001\n"
    )
}

const TINY: &str = "vocab_size = 97\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 2\nnum_attention_heads = 4";

fn llama_spec(model: &str, data: &str) -> JobSpec {
    JobSpec::fields_from_toml_str(&llama_text(model, data), Path::new("t.toml"))
        .unwrap_or_else(|e| panic!("{e}"))
}

fn shown_errors(text: &str) -> Vec<String> {
    invalid(text).iter().map(ToString::to_string).collect()
}

#[test]
fn llama_resolves_with_hugging_face_defaults() {
    let s = llama_spec(TINY, "seq_len = 12");
    let c = LlamaConfig::resolve(&s.model).unwrap();
    assert_eq!(
        c,
        LlamaConfig {
            vocab_size: 97,
            hidden_size: 32,
            intermediate_size: 64,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 4,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            max_position_embeddings: 2048,
            tie_word_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
            initializer_range: 0.02,
            rope_scaling: Default::default(),
            arch: Default::default(),
            sliding_window: None,
            explicit_head_dim: None,
        }
    );
    assert_eq!(c.head_dim(), 8);
    // transformers' LlamaForCausalLM(...).num_parameters() for these.
    assert_eq!(c.parameter_count(), 26_848);
    let other = LlamaConfig {
        tie_word_embeddings: true,
        num_key_value_heads: 2,
        attention_bias: true,
        mlp_bias: true,
        ..c.clone()
    };
    assert_eq!(other.parameter_count(), 22_208);
    // The memory estimate counts them: parameter, gradient, buffer and
    // AdamW's two states.
    assert_eq!(s.memory_estimate().model, 26_848 * 4 * 5);
    // Unset fields stay out of the serialized spec (hashes unchanged).
    let json = toml::to_string(&llama_spec(TINY, "seq_len = 12")).unwrap();
    assert!(
        !json.contains("rope_theta") && !json.contains("pad_id"),
        "{json}"
    );
}

#[test]
fn llama_fields_come_from_a_config_file_and_must_agree() {
    let dir = tempfile::TempDir::new().unwrap();
    let path = dir.path().join("config.json");
    // As transformers 5 writes it: extra keys, rope_parameters.
    std::fs::write(
        &path,
        r#"{"architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 1, "eos_token_id": 2, "head_dim": 8, "hidden_act": "silu", "hidden_size": 32,
  "initializer_range": 0.02, "intermediate_size": 64, "max_position_embeddings": 128,
  "mlp_bias": false, "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2,
  "num_key_value_heads": 2, "pad_token_id": null, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
  "tie_word_embeddings": true, "transformers_version": "5.24.0", "use_cache": true, "vocab_size": 97}"#,
    )
    .unwrap();
    let cfg = format!("config = {:?}", path.display().to_string());
    let s = llama_spec(&cfg, "seq_len = 12");
    let c = LlamaConfig::resolve(&s.model).unwrap();
    assert_eq!(
        (
            c.num_key_value_heads,
            c.rope_theta,
            c.rms_norm_eps,
            c.tie_word_embeddings
        ),
        (2, 500000.0, 1e-5, true)
    );
    assert_eq!(c.max_position_embeddings, 128);
    // The same value in both is fine.
    let s = llama_spec(
        &format!("{cfg}\nhidden_size = 32\nrope_theta = 500000.0"),
        "seq_len = 12",
    );
    assert_eq!(LlamaConfig::resolve(&s.model).unwrap(), c);
    // Another value is refused naming the field and both values.
    let s = llama_spec(
        &format!("{cfg}\nhidden_size = 64\nnum_key_value_heads = 4"),
        "seq_len = 12",
    );
    let errs: Vec<String> = LlamaConfig::resolve(&s.model)
        .unwrap_err()
        .0
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(errs.len(), 2, "{errs:?}");
    assert!(
        errs[0].starts_with("model.hidden_size = 64: disagrees with model.config (")
            && errs[0].ends_with("which gives 32"),
        "{errs:?}"
    );
    assert!(
        errs[1].starts_with("model.num_key_value_heads = 4:") && errs[1].ends_with("which gives 2")
    );
    // And found by the full check (files read) as well.
    let text = llama_text(&format!("{cfg}\nhidden_size = 64"), "seq_len = 12").replace(
        "path = \"rows.safetensors\"",
        &format!("path = {:?}", path.display().to_string()),
    );
    let err = JobSpec::from_toml_str(&text, Path::new("t.toml"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.hidden_size = 64: disagrees"), "{err}");
    // seq_len above the file's max_position_embeddings.
    let text = llama_text(&cfg, "seq_len = 129").replace(
        "path = \"rows.safetensors\"",
        &format!("path = {:?}", path.display().to_string()),
    );
    let err = JobSpec::from_toml_str(&text, Path::new("t.toml"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("data.seq_len = 129: must be <= model.max_position_embeddings = 128"),
        "{err}"
    );

    // What accrue cannot build is refused, naming the key.
    let bad = dir.path().join("bad.json");
    std::fs::write(
        &bad,
        r#"{"model_type": "llama", "hidden_act": "gelu", "vocab_size": 97, "hidden_size": 32,
  "intermediate_size": 64, "num_hidden_layers": "2", "num_attention_heads": 4,
  "rope_scaling": {"rope_type": "yarn"}}"#,
    )
    .unwrap();
    let s = llama_spec(
        &format!("config = {:?}", bad.display().to_string()),
        "seq_len = 12",
    );
    let err = LlamaConfig::resolve(&s.model).unwrap_err().to_string();
    for want in [
        "num_hidden_layers = \"2\" in the file: must be an integer",
        "hidden_act = \"gelu\" in the file",
        "rope_scaling.rope_type = \"yarn\" in the file: must be \"default\", \"linear\", \"dynamic\" or \"llama3\"",
        "model.num_hidden_layers = \"(missing)\"",
    ] {
        assert!(err.contains(want), "{want} not in {err}");
    }
    // A file that is not there, or not JSON.
    let s = llama_spec("config = \"/no/such/config.json\"", "seq_len = 12");
    let err = LlamaConfig::resolve(&s.model).unwrap_err().to_string();
    assert!(
        err.contains("model.config = \"/no/such/config.json\": must name a readable"),
        "{err}"
    );
    std::fs::write(&bad, "[1, 2]").unwrap();
    let s = llama_spec(
        &format!("config = {:?}", bad.display().to_string()),
        "seq_len = 12",
    );
    let err = LlamaConfig::resolve(&s.model).unwrap_err().to_string();
    assert!(err.contains("must hold a JSON object"), "{err}");
}

#[test]
fn to_hf_json_reads_back_as_the_same_config() {
    let s = llama_spec(
        &format!("{TINY}\nnum_key_value_heads = 2\ntie_word_embeddings = true\nrope_theta = 500000.0\nattention_bias = true"),
        "seq_len = 12",
    );
    let c = LlamaConfig::resolve(&s.model).unwrap();
    let json = c.to_hf_json();
    assert_eq!(json["architectures"][0], "LlamaForCausalLM");
    assert_eq!(json["model_type"], "llama");
    assert_eq!(json["head_dim"], 8);
    assert_eq!(json["hidden_act"], "silu");
    assert_eq!(json["rope_parameters"]["rope_theta"], 500000.0);
    let dir = tempfile::TempDir::new().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&json).unwrap()).unwrap();
    let s = llama_spec(
        &format!("config = {:?}", path.display().to_string()),
        "seq_len = 12",
    );
    assert_eq!(LlamaConfig::resolve(&s.model).unwrap(), c);
}

#[test]
fn a_missing_llama_field_names_it_and_the_config_file() {
    let errs = shown_errors(&llama_text(
        "vocab_size = 97\nhidden_size = 32",
        "seq_len = 12",
    ));
    let want = "\"(missing)\": required for model.kind = llama (here, or from the config.json of model.config)";
    assert_eq!(
        errs,
        [
            "model.intermediate_size",
            "model.num_hidden_layers",
            "model.num_attention_heads"
        ]
        .map(|f| format!("{f} = {want}"))
    );
    // With a config file the coordinator cannot read (files unchecked),
    // the fields given are still checked, the missing ones are not.
    let errs = shown_errors(&llama_text(
        "config = \"c.json\"\nhidden_size = 0",
        "seq_len = 12",
    ));
    assert_eq!(
        errs,
        ["model.hidden_size = 0: must be an integer in 1..=65536"]
    );
    assert!(JobSpec::fields_from_toml_str(
        &llama_text("config = \"c.json\"", "seq_len = 12"),
        Path::new("t")
    )
    .is_ok());
}

#[test]
fn llama_shapes_are_checked() {
    let errs = shown_errors(&llama_text(
        "vocab_size = 97\nhidden_size = 30\nintermediate_size = 64\nnum_hidden_layers = 2\nnum_attention_heads = 4\nnum_key_value_heads = 3\nrms_norm_eps = 0.0\nrope_theta = -1.0",
        "seq_len = 12",
    ));
    assert_eq!(
        errs,
        [
            "model.hidden_size = 30: must be a multiple of model.num_attention_heads = 4",
            "model.num_key_value_heads = 3: must divide model.num_attention_heads = 4",
            "model.rms_norm_eps = 0.0: must be a finite number > 0",
            "model.rope_theta = -1.0: must be a finite number > 0",
        ]
    );
    // An odd head width (RoPE rotates halves).
    let errs = shown_errors(&llama_text(
        &TINY.replace("hidden_size = 32", "hidden_size = 12"),
        "seq_len = 12",
    ));
    assert_eq!(
        errs,
        ["model.hidden_size = 12: must give an even head width for RoPE (hidden_size / num_attention_heads = 3)"]
    );
    let errs = shown_errors(&llama_text(
        &format!("{TINY}\nmax_position_embeddings = 8"),
        "seq_len = 12",
    ));
    assert_eq!(
        errs,
        ["data.seq_len = 12: must be <= model.max_position_embeddings = 8"]
    );
    let errs = shown_errors(&llama_text(
        &format!("{TINY}\nnum_classes = 97\npath = \"m.pt\""),
        "seq_len = 12",
    ));
    assert_eq!(
        errs,
        [
            "model.path = \"m.pt\": only allowed with model.kind = torchscript",
            "model.num_classes = 97: not allowed with model.kind = llama (the classes are model.vocab_size)",
        ]
    );
}

#[test]
fn language_models_and_token_data_go_together() {
    // llama on images.
    let text = llama_text(TINY, "").replace("kind = \"sequences\"", "kind = \"mnist\"");
    assert_eq!(
        shown_errors(&text),
        ["data.kind = \"mnist\": model.kind = llama needs data.kind = sequences or tokens"]
    );
    // An MLP on tokens.
    let text = BASE.replace(
        "kind = \"synthetic\"",
        "kind = \"tokens\"\npath = \"t.bin\"\nseq_len = 8",
    );
    assert_eq!(
        shown_errors(&text),
        [format!(
            "model.kind = \"mlp\": data.kind = tokens needs model.kind = {}",
            crate::spec::family::any_decoder()
        )]
    );
    // seq_len: required for token data, refused for the others.
    assert_eq!(
        shown_errors(&llama_text(TINY, "")),
        ["data.seq_len = \"(missing)\": required for data.kind = sequences (an integer in 1..=1048576)"]
    );
    assert_eq!(
        shown_errors(&llama_text(TINY, "seq_len = 0")),
        ["data.seq_len = 0: must be an integer in 1..=1048576"]
    );
    let text = BASE.replace(
        "batch_size = 8",
        "batch_size = 8\nseq_len = 8\npad_id = 3\ndtype = \"u16\"",
    );
    assert_eq!(
        shown_errors(&text),
        [
            "data.seq_len = 8: only allowed with data.kind = sequences or tokens",
            "data.pad_id = 3: only allowed with data.kind = sequences",
            "data.dtype = \"u16\": only allowed with data.kind = tokens (for a file without llm.c's header)",
        ]
    );
    // dtype: tokens only, u16 or u32.
    let text = llama_text(TINY, "seq_len = 8\ndtype = \"u8\"")
        .replace("kind = \"sequences\"", "kind = \"tokens\"");
    assert_eq!(
        shown_errors(&text),
        ["data.dtype = \"u8\": must be one of u16, u32"]
    );
    let text = llama_text(TINY, "seq_len = 8\ndtype = \"u32\"")
        .replace("kind = \"sequences\"", "kind = \"tokens\"");
    let s = JobSpec::fields_from_toml_str(&text, Path::new("t")).unwrap();
    assert_eq!(
        (s.data.kind, s.data.dtype, s.data.seq_len),
        (DataKind::Tokens, Some(TokenDtype::U32), Some(8))
    );
    // The llama fields are refused for another kind, like model.hidden.
    let text = BASE.replace(
        "kind = \"mlp\"",
        "kind = \"mlp\"\nvocab_size = 10\nrope_theta = 5.0\nconfig = \"c.json\"",
    );
    assert_eq!(
        shown_errors(&text),
        ["model.vocab_size", "model.rope_theta", "model.config"].map(|f| format!(
            "{f} = \"(set)\": only allowed with model.kind = {}",
            crate::spec::tests::decoder_names(" or ")
        ))
    );
    // A token data path is required, a pad id in range.
    let text =
        llama_text(TINY, "seq_len = 8\npad_id = -1").replace("path = \"rows.safetensors\"\n", "");
    assert_eq!(
        shown_errors(&text),
        [
            "data.path = \"(missing)\": required for data.kind = sequences",
            "data.pad_id = -1: must be an integer in 0..=16777215",
        ]
    );
}

/// The tiny model's config.json with `extra`'s keys added (a null value
/// removes the key).
fn hf_config(extra: &serde_json::Value) -> serde_json::Value {
    let mut c = serde_json::json!({"model_type": "llama", "vocab_size": 97, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4});
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    c
}

/// What transformers' `LlamaConfig.from_dict` (how `from_pretrained`
/// reads a config.json) resolves each of `configs` to: the fields accrue
/// resolves, the RoPE parameters it standardized, the head width and the
/// initial weights' std its `_init_weights` uses. One Python process.
fn transformers_resolves(configs: &[serde_json::Value]) -> Vec<serde_json::Value> {
    use std::io::Write;
    use std::process::{Command, Stdio};
    const SCRIPT: &str = r#"
import json, sys
import transformers
transformers.logging.set_verbosity_error()
from transformers import CONFIG_MAPPING
assert transformers.__version__ == "5.24.0", transformers.__version__
out = []
for d in json.load(sys.stdin):
    # The config class of the file's model_type, as AutoConfig picks it.
    c = CONFIG_MAPPING[d.get("model_type", "llama")].from_dict(d)
    r = c.rope_parameters
    # Qwen2's and Mistral's configs have no bias switches (fixed by the
    # class) and may have no head_dim (hidden / heads then).
    absent = {"attention_bias": False, "mlp_bias": False,
              "head_dim": c.hidden_size // c.num_attention_heads}
    out.append({k: getattr(c, k, absent.get(k)) for k in ["vocab_size", "hidden_size",
        "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "attention_bias",
        "mlp_bias", "head_dim", "attention_dropout"]}
        | {"rope_theta": r["rope_theta"], "rope_type": r["rope_type"],
           "initializer_range": c.initializer_range or 0.02}
        | {k: r.get(k) for k in ["factor", "low_freq_factor", "high_freq_factor",
                                 "original_max_position_embeddings"]}
        | {"sliding_window": getattr(c, "sliding_window", None)})
json.dump(out, sys.stdout)
"#;
    let python = env!("ACCRUE_PYTHON");
    let mut child = Command::new(python)
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{python}: {e} (run `make setup` first)"));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&serde_json::to_vec(configs).unwrap())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// accrue's resolution in transformers' terms (what accrue implements:
/// default RoPE, no attention dropout, head_dim = hidden / heads).
fn as_transformers(c: &LlamaConfig) -> serde_json::Value {
    let mut v = serde_json::json!({"vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": c.attention_bias,
        "mlp_bias": c.mlp_bias, "head_dim": c.head_dim(), "attention_dropout": 0.0,
        "rope_theta": c.rope_theta, "rope_type": c.rope_scaling.name(),
        "initializer_range": c.initializer_range,
        "factor": null, "low_freq_factor": null, "high_freq_factor": null,
        "original_max_position_embeddings": null, "sliding_window": c.sliding_window});
    let rope = c.rope_scaling.to_json(c.rope_theta);
    for k in [
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ] {
        if let Some(x) = rope.get(k) {
            v[k] = x.clone();
        }
    }
    v
}

#[test]
fn hf_config_fields_resolve_as_transformers_resolves_them() {
    use serde_json::json;
    // (what it exercises, keys added to the tiny config).
    let accepted = [
        (
            "rope_parameters (5.x)",
            json!({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
        ),
        ("top-level rope_theta (4.x)", json!({"rope_theta": 250000})),
        (
            "rope_parameters' theta over the top-level one",
            json!({"rope_theta": 1000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
        ),
        (
            "the top-level theta when the dict has none",
            json!({"rope_theta": 1000.0, "rope_parameters": {"rope_type": "default"}}),
        ),
        (
            "rope_scaling replaces rope_parameters whole",
            json!({"rope_scaling": {"rope_type": "default"}, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
        ),
        (
            "rope_scaling's old `type`",
            json!({"rope_scaling": {"type": "default"}, "rope_theta": 123.0}),
        ),
        (
            "an empty rope_scaling does not",
            json!({"rope_scaling": {}, "rope_parameters": {"rope_theta": 7.0}}),
        ),
        (
            "head_dim, null kv heads, no dropout",
            json!({"head_dim": 8, "num_key_value_heads": null, "attention_dropout": 0.0}),
        ),
        ("initializer_range", json!({"initializer_range": 0.05})),
        (
            "initializer_range 0 (the init's 0.02)",
            json!({"initializer_range": 0.0}),
        ),
        (
            "the other fields",
            json!({"num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 128,
            "tie_word_embeddings": true, "attention_bias": true, "mlp_bias": true}),
        ),
        // RoPE scaling (issue 39).
        (
            "llama3 under rope_scaling beside rope_parameters",
            json!({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024}}),
        ),
        (
            "linear under the old `type`",
            json!({"rope_scaling": {"type": "linear", "factor": 2.0}}),
        ),
        (
            "dynamic under rope_parameters",
            json!({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}),
        ),
        // The families that extend Llama (issue 39): their config classes'
        // defaults where a key is left out.
        (
            "qwen2's defaults",
            json!({"model_type": "qwen2", "num_attention_heads": 32, "hidden_size": 64}),
        ),
        (
            "qwen2 without a window",
            json!({"model_type": "qwen2", "use_sliding_window": false, "sliding_window": 64,
            "num_key_value_heads": 2}),
        ),
        (
            "mistral's defaults (window 4096, 8 kv heads of 8)",
            json!({"model_type": "mistral", "num_attention_heads": 8}),
        ),
        (
            "mistral's window",
            json!({"model_type": "mistral", "sliding_window": 6, "num_key_value_heads": 2}),
        ),
        (
            "mistral without a window",
            json!({"model_type": "mistral", "sliding_window": null, "num_key_value_heads": 4}),
        ),
        (
            "another head width (Mistral Nemo's kind)",
            json!({"head_dim": 16}),
        ),
        (
            "qwen3's defaults (head_dim 128, 32 kv heads, 32768 positions)",
            json!({"model_type": "qwen3", "num_attention_heads": 32, "hidden_size": 64}),
        ),
        (
            "qwen3 with its head width and biases, without a window",
            json!({"model_type": "qwen3", "head_dim": 16, "attention_bias": true,
            "use_sliding_window": false, "sliding_window": 64, "num_key_value_heads": 2}),
        ),
    ];
    // (what accrue does not implement, keys added, transformers' field
    // and value, accrue's error).
    let refused = [
        ("yarn under rope_scaling", json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                "original_max_position_embeddings": 32}}),
            ("rope_type", json!("yarn")), "rope_scaling.rope_type = \"yarn\" in the file: must be \"default\", \"linear\", \"dynamic\" or \"llama3\""),
        ("attention dropout", json!({"attention_dropout": 0.1}),
            ("attention_dropout", json!(0.1)), "attention_dropout = 0.1 in the file: must be 0"),
    ];
    let configs: Vec<_> = accepted
        .iter()
        .map(|(_, extra)| hf_config(extra))
        .chain(refused.iter().map(|(_, extra, _, _)| hf_config(extra)))
        .collect();
    let theirs = transformers_resolves(&configs);
    assert_eq!(theirs.len(), configs.len());
    let mut wrong = Vec::new();
    for (((what, _), json), t) in accepted.iter().zip(&configs).zip(&theirs) {
        let ours = match LlamaConfig::from_hf_json(json) {
            Ok(c) => as_transformers(&c),
            Err(e) => {
                wrong.push(format!("{what}: refused ({e}), transformers gives {t}"));
                continue;
            }
        };
        for (field, want) in t.as_object().unwrap() {
            let got = &ours[field];
            let same = match (got.as_f64(), want.as_f64()) {
                (Some(a), Some(b)) => a == b,
                _ => got == want,
            };
            if !same {
                wrong.push(format!("{what}: {field} = {got}, transformers {want}"));
            }
        }
    }
    let offset = accepted.len();
    for (i, (what, _, (field, value), error)) in refused.iter().enumerate() {
        let t = &theirs[offset + i];
        assert_eq!(&t[*field], value, "{what}: transformers resolves {t}");
        match LlamaConfig::from_hf_json(&configs[offset + i]) {
            Ok(c) => wrong.push(format!(
                "{what}: accepted as {c:?}, transformers gives {field} = {value}"
            )),
            Err(e) => {
                let e: Vec<String> = e.0.iter().map(ToString::to_string).collect();
                let want = format!("model.config = \"config.json\": {error}");
                if !(e.len() == 1 && e[0].starts_with(&want)) {
                    wrong.push(format!("{what}: {e:?}"));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// A config.json's head_dim (issue 39): equal to hidden_size /
/// num_attention_heads it is that width; another even one is the head
/// width itself (q_proj has heads x head_dim rows, as in transformers and
/// Mistral Nemo); an odd one is refused naming the file.
#[test]
fn a_head_dim_in_the_file_is_the_head_width() {
    let dir = tempfile::TempDir::new().unwrap();
    let path = dir.path().join("config.json");
    let cfg = format!("config = {:?}", path.display().to_string());
    // The file has no hidden_size: the spec gives it.
    let model = "hidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 2";
    let file = |head_dim: i64| {
        format!(
            r#"{{"model_type": "llama", "vocab_size": 97, "num_attention_heads": 4, "head_dim": {head_dim}}}"#
        )
    };
    let s = llama_spec(&format!("{cfg}\n{model}"), "seq_len = 12");
    std::fs::write(&path, file(16)).unwrap();
    let c = LlamaConfig::resolve(&s.model).unwrap();
    assert_eq!(
        (c.hidden_size, c.head_dim(), c.explicit_head_dim),
        (32, 16, Some(16))
    );
    assert_eq!(c.to_hf_json()["head_dim"], 16);
    // q, k, v and o: 32 x 64 each (4 heads and 4 kv heads of 16); the MLP
    // 3 x 32 x 64; two norms.
    let layer = 4 * 32 * 64 + 3 * 32 * 64 + 2 * 32;
    assert_eq!(c.parameter_count(), (97 * 32 * 2 + 2 * layer + 32) as u64);
    std::fs::write(&path, file(7)).unwrap();
    let err = LlamaConfig::resolve(&s.model).unwrap_err().0;
    assert_eq!(
        err.iter().map(ToString::to_string).collect::<Vec<_>>(),
        [format!(
            "model.config = {:?}: head_dim = 7 in the file: must be an even number in 2..=1024 \
             (RoPE rotates pairs)",
            path.display().to_string()
        )]
    );
    std::fs::write(&path, file(8)).unwrap();
    let c = LlamaConfig::resolve(&s.model).unwrap();
    assert_eq!(
        (c.hidden_size, c.head_dim(), c.explicit_head_dim),
        (32, 8, None)
    );
}

#[test]
fn hf_config_values_accrue_cannot_use_are_refused_naming_the_key() {
    use serde_json::json;
    for (extra, want) in [
        (json!({"initializer_range": 1.5}), "initializer_range = 1.5 in the file: must be a number in [0, 1] (the standard deviation of the initial weights)"),
        (json!({"initializer_range": "x"}), "initializer_range = \"x\" in the file: must be a number"),
        (json!({"attention_dropout": -0.5}), "attention_dropout = -0.5 in the file: must be 0: accrue's llama trains without attention dropout"),
        (json!({"attention_dropout": true}), "attention_dropout = true in the file: must be a number"),
        // transformers resolves these to a None theta (no RoPE).
        (json!({"rope_theta": null}), "rope_theta = null in the file: must be a number"),
        (json!({"rope_parameters": {"rope_type": "default", "rope_theta": null}, "rope_theta": 5.0}),
            "rope_parameters.rope_theta = null in the file: must be a number"),
        (json!({"rope_parameters": {"rope_type": null}}), "rope_parameters.rope_type = null in the file: must be a string"),
        (json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0}}),
            "rope_scaling.original_max_position_embeddings = null in the file: is required by rope_type \"llama3\""),
        (json!({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}),
            "rope_scaling.factor = -2.0 in the file: must be a number > 0"),
        (json!({"rope_scaling": "llama3"}), "rope_scaling = \"llama3\" in the file: must be an object (the RoPE parameters) or null"),
    ] {
        let err = LlamaConfig::from_hf_json(&hf_config(&extra)).unwrap_err().0;
        assert_eq!(
            err.iter().map(ToString::to_string).collect::<Vec<_>>(),
            [format!("model.config = \"config.json\": {want}")],
            "{extra}"
        );
    }
    // The std the weights are drawn with is written back.
    let c = LlamaConfig::from_hf_json(&hf_config(&json!({"initializer_range": 0.05}))).unwrap();
    assert_eq!(c.initializer_range, 0.05);
    assert_eq!(c.to_hf_json()["initializer_range"], 0.05);
    assert_eq!(LlamaConfig::from_hf_json(&c.to_hf_json()).unwrap(), c);
}

/// With `model.config` and no `model.kind` (issue 39), the kind is the
/// file's `model_type`; one accrue does not build is refused with the
/// kinds allowed; a kind given that disagrees with the file names both.
#[test]
fn the_kind_comes_from_the_config_when_left_out() {
    let dir = tempfile::TempDir::new().unwrap();
    let rows = dir.path().join("rows.safetensors");
    std::fs::write(&rows, b"").unwrap();
    let text = |kind: &str, config: &Path| {
        llama_text("", "seq_len = 12")
            .replace("kind = \"llama\"\n", kind)
            .replace(
                "[model]\n",
                &format!("[model]\nconfig = {:?}\n", config.display().to_string()),
            )
            .replace("rows.safetensors", &rows.display().to_string())
    };
    let config = |model_type: &str| {
        let p = dir.path().join(format!("{model_type}.json"));
        let mut json = hf_config(&serde_json::json!({"num_key_value_heads": 2}));
        json["model_type"] = model_type.into();
        std::fs::write(&p, json.to_string()).unwrap();
        p
    };
    let mistral = config("mistral");
    let s = JobSpec::from_toml_str(&text("", &mistral), Path::new("t.toml"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.model.kind, ModelKind::Mistral);
    assert_eq!(
        LlamaConfig::resolve(&s.model).unwrap().arch,
        DecoderArch::of_kind(ModelKind::Mistral).unwrap()
    );
    // Where files are not read (a client submitting for the workers), the
    // kind must be given.
    let e = JobSpec::fields_from_toml_str(&text("", &mistral), Path::new("t.toml"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing field `kind`"), "{e}");
    let gpt2 = config("gpt2");
    let e = JobSpec::from_toml_str(&text("", &gpt2), Path::new("t.toml"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.kind = \"gpt2\": must be one of"), "{e}");
    let e = JobSpec::from_toml_str(&text("kind = \"qwen2\"\n", &mistral), Path::new("t.toml"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model_type = \"mistral\" in the file, but model.kind = \"qwen2\""),
        "{e}"
    );
}
