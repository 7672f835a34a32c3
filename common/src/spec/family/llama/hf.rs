//! The Hugging Face side of a llama's configuration: a `config.json` read
//! with bounds and its keys resolved as transformers' `LlamaConfig` does.

use super::*;

impl Fields {
    /// The fields of a HF config.json (other keys ignored), resolved as
    /// transformers' `LlamaConfig` resolves them; keys it has that accrue
    /// cannot build (another `model_type`, activation or RoPE type,
    /// attention dropout) are refused.
    pub(super) fn from_json(path: &Path, map: &Map<String, Value>, c: &mut Checker) -> Self {
        let shown = path.display().to_string();
        let mut bad = |key: &str, v: &Value, want: &str| {
            c.fail(
                "model.config",
                &shown,
                format!("{key} = {v} in the file: {want}"),
            );
        };
        let present = |key: &str| map.get(key).filter(|v| !v.is_null());
        let mut int = |key: &str| {
            let v = present(key)?;
            let i = v.as_i64();
            if i.is_none() {
                bad(key, v, "must be an integer");
            }
            i
        };
        let vocab_size = int("vocab_size");
        let hidden_size = int("hidden_size");
        let intermediate_size = int("intermediate_size");
        let num_hidden_layers = int("num_hidden_layers");
        let num_attention_heads = int("num_attention_heads");
        let num_key_value_heads = int("num_key_value_heads");
        let max_position_embeddings = int("max_position_embeddings");
        let head_dim = int("head_dim");
        // transformers' convert_rope_params_to_dict: a (non-empty)
        // `rope_scaling` (4.x) replaces `rope_parameters` (5.x) whole; the
        // dict's `rope_theta`, else the top-level `rope_theta`, else
        // 10000; its `rope_type`, else its `type`, else "default".
        let mut rope_dict = |key: &'static str| match map.get(key) {
            None | Some(Value::Null) => None,
            Some(Value::Object(o)) => Some((key, o)),
            Some(v) => {
                bad(key, v, "must be an object (the RoPE parameters) or null");
                None
            }
        };
        let scaling = rope_dict("rope_scaling").filter(|(_, o)| !o.is_empty());
        let rope = match scaling {
            Some(s) => Some(s),
            None => rope_dict("rope_parameters"),
        };
        let mut float = |key: &str, v: Option<&Value>| {
            let v = v?;
            let f = v.as_f64();
            if f.is_none() {
                bad(key, v, "must be a number");
            }
            f
        };
        let rms_norm_eps = float("rms_norm_eps", present("rms_norm_eps"));
        let initializer_range = float("initializer_range", present("initializer_range"));
        let attention_dropout = float("attention_dropout", present("attention_dropout"));
        let (theta_key, theta) = match rope.and_then(|(k, o)| Some((k, o.get("rope_theta")?))) {
            Some((k, v)) => (format!("{k}.rope_theta"), Some(v)),
            None => ("rope_theta".to_string(), map.get("rope_theta")),
        };
        // A null theta is transformers' None (its RoPE cannot be built).
        let rope_theta = float(&theta_key, theta);
        let mut flag = |key: &str| {
            let v = present(key)?;
            let b = v.as_bool();
            if b.is_none() {
                bad(key, v, "must be true or false");
            }
            b
        };
        let tie_word_embeddings = flag("tie_word_embeddings");
        let attention_bias = flag("attention_bias");
        let mlp_bias = flag("mlp_bias");
        if let Some(v) = present("model_type").filter(|v| v.as_str() != Some("llama")) {
            bad("model_type", v, "accrue builds \"llama\" models only");
        }
        if let Some(v) = present("hidden_act").filter(|v| v.as_str() != Some("silu")) {
            bad("hidden_act", v, "accrue's llama uses \"silu\" only");
        }
        if let Some((key, p)) = rope {
            let (name, kind) = match p.get("rope_type") {
                Some(k) => ("rope_type", Some(k)),
                None => ("type", p.get("type")),
            };
            if let Some(k) = kind.filter(|k| k.as_str() != Some("default")) {
                bad(
                    &format!("{key}.{name}"),
                    k,
                    "must be \"default\": accrue's llama has no RoPE scaling \
                     (linear, dynamic, yarn, longrope, llama3 and the others are refused)",
                );
            }
        }
        if let Some(v) = present("attention_dropout") {
            if attention_dropout.is_some_and(|p| p != 0.0) {
                bad(
                    "attention_dropout",
                    v,
                    "must be 0: accrue's llama trains without attention dropout",
                );
            }
        }
        if let (Some(v), Some(r)) = (present("initializer_range"), initializer_range) {
            if !(0.0..=1.0).contains(&r) {
                bad(
                    "initializer_range",
                    v,
                    "must be a number in [0, 1] (the standard deviation of the initial weights)",
                );
            }
        }
        Self {
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            rms_norm_eps,
            rope_theta,
            max_position_embeddings,
            tie_word_embeddings,
            attention_bias,
            mlp_bias,
            head_dim,
            initializer_range,
            source: Some(shown),
        }
    }
}

/// A HF config.json's top-level object (errors name `model.config`).
pub(super) fn read_config(path: &Path, c: &mut Checker) -> Option<Map<String, Value>> {
    let shown = path.display().to_string();
    use crate::small_file::{read_small, MAX_CONFIG_BYTES};
    let text = match read_small(path, MAX_CONFIG_BYTES, "config.json") {
        Ok(t) => t,
        Err(e) => {
            c.fail(
                "model.config",
                shown,
                format!(
                    "must name a readable Hugging Face config.json, a regular file of at most {MAX_CONFIG_BYTES} bytes: it {}",
                    e.reason()
                ),
            );
            return None;
        }
    };
    match serde_json::from_slice::<Value>(&text) {
        Ok(Value::Object(map)) => Some(map),
        Ok(_) => {
            c.fail(
                "model.config",
                shown,
                "must hold a JSON object (a Hugging Face config.json)",
            );
            None
        }
        Err(e) => {
            c.fail(
                "model.config",
                shown,
                format!("not valid JSON (a Hugging Face config.json): {e}"),
            );
            None
        }
    }
}
