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
        // Absent, null (no window) or a width.
        let sliding_window = match map.get("sliding_window") {
            None => None,
            Some(Value::Null) => Some(None),
            Some(_) => Some(int("sliding_window")),
        };
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
        let use_sliding_window = flag("use_sliding_window");
        let arch = present("model_type").and_then(|v| {
            let a = v.as_str().and_then(DecoderArch::from_model_type);
            if a.is_none() {
                bad(
                    "model_type",
                    v,
                    &format!("accrue builds {} models", DecoderArch::model_types()),
                );
            }
            a
        });

        if let Some(v) = present("hidden_act").filter(|v| v.as_str() != Some("silu")) {
            bad("hidden_act", v, "accrue's llama uses \"silu\" only");
        }
        let rope_scaling = rope.and_then(|(key, p)| rope_scaling(key, p, &mut bad));
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
            rope_scaling,
            arch,
            sliding_window,
            use_sliding_window,
            source: Some(shown),
        }
    }
}

/// The RoPE scaling of a `rope_scaling` / `rope_parameters` object `p`
/// (under `key`), as transformers 5.24's `ROPE_INIT_FUNCTIONS` and
/// `rope_config_validation` read it: `rope_type`, else `type`, else
/// "default"; the numbers each type requires. Another type (yarn,
/// longrope, ...) or a missing or bad number is refused naming the key.
fn rope_scaling(
    key: &str,
    p: &Map<String, Value>,
    bad: &mut dyn FnMut(&str, &Value, &str),
) -> Option<RopeScaling> {
    let (name, kind) = match p.get("rope_type") {
        Some(k) => ("rope_type", Some(k)),
        None => ("type", p.get("type")),
    };
    let kind_str = match kind {
        None => "default",
        Some(k) => match k.as_str() {
            Some(s) => s,
            None => {
                bad(&format!("{key}.{name}"), k, "must be a string");
                return None;
            }
        },
    };
    let number = |field: &str, bad: &mut dyn FnMut(&str, &Value, &str)| -> Option<f64> {
        let shown = format!("{key}.{field}");
        match p.get(field) {
            Some(v) => match v.as_f64().filter(|f| f.is_finite() && *f > 0.0) {
                Some(f) => Some(f),
                None => {
                    bad(&shown, v, "must be a number > 0");
                    None
                }
            },
            None => {
                bad(
                    &shown,
                    &Value::Null,
                    &format!("is required by rope_type \"{kind_str}\""),
                );
                None
            }
        }
    };
    match kind_str {
        "default" => Some(RopeScaling::Default),
        "linear" => Some(RopeScaling::Linear {
            factor: number("factor", bad)?,
        }),
        "dynamic" => Some(RopeScaling::Dynamic {
            factor: number("factor", bad)?,
        }),
        "llama3" => {
            let factor = number("factor", bad);
            let low = number("low_freq_factor", bad);
            let high = number("high_freq_factor", bad);
            let original = number("original_max_position_embeddings", bad);
            let (factor, low, high, original) = (factor?, low?, high?, original?);
            if high <= low {
                bad(
                    &format!("{key}.high_freq_factor"),
                    &p["high_freq_factor"],
                    "must be above low_freq_factor (the band between them is interpolated)",
                );
                return None;
            }
            if original.fract() != 0.0 {
                bad(
                    &format!("{key}.original_max_position_embeddings"),
                    &p["original_max_position_embeddings"],
                    "must be a whole number of positions",
                );
                return None;
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: original as i64,
            })
        }
        _ => {
            bad(
                &format!("{key}.{name}"),
                kind.unwrap_or(&Value::Null),
                "must be \"default\", \"linear\", \"dynamic\" or \"llama3\": accrue's llama \
                 has no other RoPE scaling (yarn, longrope and the others are refused)",
            );
            None
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

impl LlamaConfig {
    /// A `config.json` that transformers' `LlamaConfig` and
    /// `LlamaForCausalLM.from_pretrained` read (offline), fp32 weights.
    pub fn to_hf_json(&self) -> Value {
        let mut v = json!({
            "architectures": [self.arch.architecture()],
            "model_type": self.arch.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim(),
            "hidden_act": "silu",
            "initializer_range": self.initializer_range,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": self.rope_scaling.to_json(self.rope_theta),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "mlp_bias": self.mlp_bias,
            "pretraining_tp": 1,
            "use_cache": true,
            "dtype": "float32",
            "torch_dtype": "float32",
        });
        // What the families that extend Llama say their own way.
        let o = v.as_object_mut().expect("a JSON object literal");
        let arch = self.arch;
        if !arch.attention_bias {
            o.remove("attention_bias");
        }
        if !arch.mlp_bias {
            o.remove("mlp_bias");
        }
        match arch.window {
            Window::None => {}
            Window::Switch => {
                o.insert("use_sliding_window".into(), false.into());
                o.insert("max_window_layers".into(), self.num_hidden_layers.into());
            }
            Window::Sliding { .. } => {
                o.insert("sliding_window".into(), self.sliding_window.into());
            }
        }
        v
    }
}
