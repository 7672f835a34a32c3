//! What the Llama-layout decoders differ in: the architecture
//! ([`Decoder`], declared once in each family's folder, and
//! [`DecoderArch`], a config's handle to it) and RoPE's frequency scaling
//! ([`RopeScaling`]).

use super::{Fields, DEFAULT_MAX_POSITION_EMBEDDINGS};
use crate::spec::{Checker, ModelKind};
use serde_json::{json, Value};

/// A decoder family built on the Llama layout (the same parameter names
/// and blocks), as its folder declares it: its kind, transformers' names
/// for it and how its config class differs from `LlamaConfig`. The spec's
/// checks, `config.json`'s reading and writing, and the worker's network
/// read these fields; no list of the decoders is kept anywhere else (the
/// family registry, spec/family/mod.rs, gives them).
#[derive(Debug)]
pub struct Decoder {
    pub kind: ModelKind,
    /// transformers' `model_type`.
    pub model_type: &'static str,
    /// transformers' class (`architectures` in config.json).
    pub architecture: &'static str,
    /// Its config class's default `max_position_embeddings`.
    pub default_max_positions: i64,
    /// Its config class's `num_key_value_heads` where a config.json leaves
    /// the key out (None: the heads). The spec's own fields default to
    /// the heads for every kind.
    pub file_kv_heads: Option<i64>,
    /// Its config class's `head_dim` where a config.json leaves the key
    /// out (None: hidden_size / num_attention_heads).
    pub file_head_dim: Option<i64>,
    /// Whether its config has the `attention_bias` switch (biases on q,
    /// k, v and o) and the `mlp_bias` one; a family without one refuses
    /// it set true.
    pub attention_bias: bool,
    pub mlp_bias: bool,
    /// Biases on q_proj, k_proj and v_proj always, none on o_proj
    /// (Qwen2's).
    pub qkv_bias: bool,
    /// Its sliding attention window.
    pub window: Window,
    /// An RMSNorm over each head's width on q and k (weights
    /// `self_attn.q_norm.weight`, `self_attn.k_norm.weight`), after the
    /// projection and before RoPE (Qwen3's).
    pub qk_norm: bool,
}

/// A decoder's sliding attention window, as its config class has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    /// None.
    None,
    /// Qwen2's and Qwen3's `use_sliding_window` switch, whose
    /// layer-by-layer window accrue does not build: refused when true.
    Switch,
    /// Mistral's `sliding_window` on every layer (`default` where a
    /// config.json leaves it out; null: none).
    Sliding { default: i64 },
}

/// Llama itself: `LlamaForCausalLM`.
pub(in crate::spec::family) static LLAMA: Decoder = Decoder {
    kind: ModelKind::Llama,
    model_type: "llama",
    architecture: "LlamaForCausalLM",
    default_max_positions: DEFAULT_MAX_POSITION_EMBEDDINGS,
    file_kv_heads: None,
    file_head_dim: None,
    attention_bias: true,
    mlp_bias: true,
    qkv_bias: false,
    window: Window::None,
    qk_norm: false,
};

/// A resolved config's decoder: a handle to its family's [`Decoder`]
/// (compared by kind; Llama's by default).
#[derive(Clone, Copy)]
pub struct DecoderArch(&'static Decoder);

impl Default for DecoderArch {
    fn default() -> Self {
        DecoderArch(&LLAMA)
    }
}

impl PartialEq for DecoderArch {
    fn eq(&self, other: &Self) -> bool {
        self.0.kind == other.0.kind
    }
}

impl Eq for DecoderArch {}

impl std::fmt::Debug for DecoderArch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DecoderArch({})", self.0.kind)
    }
}

impl std::ops::Deref for DecoderArch {
    type Target = Decoder;
    fn deref(&self) -> &Decoder {
        self.0
    }
}

impl DecoderArch {
    /// Every decoder, in the registry's order.
    pub fn all() -> impl Iterator<Item = DecoderArch> {
        crate::spec::family::decoders().map(DecoderArch)
    }

    /// transformers' `model_type`.
    pub fn model_type(self) -> &'static str {
        self.0.model_type
    }

    /// transformers' class (`architectures` in config.json).
    pub fn architecture(self) -> &'static str {
        self.0.architecture
    }

    pub fn kind(self) -> ModelKind {
        self.0.kind
    }

    /// transformers' default `max_position_embeddings` of its config class.
    pub fn default_max_positions(self) -> i64 {
        self.0.default_max_positions
    }

    pub fn of_kind(kind: ModelKind) -> Option<Self> {
        Self::all().find(|a| a.kind() == kind)
    }

    pub fn from_model_type(s: &str) -> Option<Self> {
        Self::all().find(|a| a.model_type() == s)
    }

    /// The `model_type`s accrue builds, for messages: "\"llama\", ... and
    /// \"qwen3\"".
    pub fn model_types() -> String {
        let names: Vec<String> = Self::all()
            .map(|a| format!("\"{}\"", a.model_type()))
            .collect();
        match names.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
            _ => names.join(""),
        }
    }
}

impl Fields {
    /// What the decoder's [`Decoder`] changes in Llama's rules: false
    /// when one failed.
    pub(super) fn arch_rules(&self, arch: DecoderArch, c: &mut Checker) -> bool {
        let mut good = true;
        let name = arch.model_type();
        let file = || self.source.clone().unwrap_or_default();
        for (field, v, has) in [
            ("attention_bias", self.attention_bias, arch.attention_bias),
            ("mlp_bias", self.mlp_bias, arch.mlp_bias),
        ] {
            if v == Some(true) && !has {
                let why = if arch.qkv_bias {
                    format!(
                        "{name} has biases on q_proj, k_proj and v_proj always and none on \
                         o_proj or the MLP: leave it out"
                    )
                } else if arch.attention_bias {
                    format!("{name} has no {field} (its MLP has no biases): leave it out")
                } else {
                    format!("{name} has no biases: leave it out")
                };
                c.fail(&format!("model.{field}"), true, why);
                good = false;
            }
        }
        match arch.window {
            Window::Switch if self.use_sliding_window == Some(true) => {
                c.fail(
                    "model.config",
                    file(),
                    format!(
                        "use_sliding_window = true in the file: accrue's {name} has no sliding \
                         window (its layer-by-layer window is not built); set it false"
                    ),
                );
                good = false;
            }
            Window::Sliding { .. } => {
                if let Some(Some(w)) = self.sliding_window.filter(|w| w.is_some_and(|w| w < 1)) {
                    c.fail(
                        "model.config",
                        file(),
                        format!("sliding_window = {w} in the file: must be >= 1 or null ({name})"),
                    );
                    good = false;
                }
            }
            _ => {}
        }
        good
    }
}

/// RoPE's frequency scaling, as transformers' `ROPE_INIT_FUNCTIONS`
/// computes it for a `rope_type` (issue 39: Llama 3.1 to 3.3 use
/// `llama3`). Every variant's attention factor is 1.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum RopeScaling {
    /// `1 / theta^(2i/d)`.
    #[default]
    Default,
    /// The default frequencies divided by `factor`.
    Linear { factor: f64 },
    /// The default up to `max_position_embeddings` positions; past them
    /// theta grows with the length (NTK-aware).
    Dynamic { factor: f64 },
    /// Llama 3.1's: wavelengths above `original_max_position_embeddings /
    /// low_freq_factor` divided by `factor`, below `.. / high_freq_factor`
    /// kept, and the band between interpolated smoothly.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: i64,
    },
}

impl RopeScaling {
    /// transformers' `rope_type` name.
    pub fn name(&self) -> &'static str {
        match self {
            RopeScaling::Default => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Dynamic { .. } => "dynamic",
            RopeScaling::Llama3 { .. } => "llama3",
        }
    }

    /// The `rope_parameters` object transformers 5 writes (theta with it).
    pub fn to_json(&self, theta: f64) -> Value {
        let mut v = json!({"rope_type": self.name(), "rope_theta": theta});
        match *self {
            RopeScaling::Default => {}
            RopeScaling::Linear { factor } | RopeScaling::Dynamic { factor } => {
                v["factor"] = factor.into();
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                v["factor"] = factor.into();
                v["low_freq_factor"] = low_freq_factor.into();
                v["high_freq_factor"] = high_freq_factor.into();
                v["original_max_position_embeddings"] = original_max_position_embeddings.into();
            }
        }
        v
    }
}
