//! What the Llama-layout decoders differ in: the architecture
//! ([`DecoderArch`]: Llama, Qwen2, Mistral) and RoPE's frequency scaling
//! ([`RopeScaling`]).

use super::DEFAULT_MAX_POSITION_EMBEDDINGS;
use crate::spec::ModelKind;
use serde_json::{json, Value};

/// The decoders built on the Llama layout (the same parameter names and
/// blocks): what each adds is a rule here and its folder
/// (spec/family/qwen2, spec/family/mistral).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DecoderArch {
    #[default]
    Llama,
    /// Biases on q_proj, k_proj and v_proj, none on o_proj or the MLP.
    Qwen2,
    /// No biases; an optional sliding attention window.
    Mistral,
}

impl DecoderArch {
    pub const ALL: [DecoderArch; 3] =
        [DecoderArch::Llama, DecoderArch::Qwen2, DecoderArch::Mistral];

    /// transformers' `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            DecoderArch::Llama => "llama",
            DecoderArch::Qwen2 => "qwen2",
            DecoderArch::Mistral => "mistral",
        }
    }

    /// transformers' class (`architectures` in config.json).
    pub fn architecture(self) -> &'static str {
        match self {
            DecoderArch::Llama => "LlamaForCausalLM",
            DecoderArch::Qwen2 => "Qwen2ForCausalLM",
            DecoderArch::Mistral => "MistralForCausalLM",
        }
    }

    pub fn kind(self) -> ModelKind {
        match self {
            DecoderArch::Llama => ModelKind::Llama,
            DecoderArch::Qwen2 => ModelKind::Qwen2,
            DecoderArch::Mistral => ModelKind::Mistral,
        }
    }

    /// transformers' default `max_position_embeddings` of its config class.
    pub fn default_max_positions(self) -> i64 {
        match self {
            DecoderArch::Llama => DEFAULT_MAX_POSITION_EMBEDDINGS,
            DecoderArch::Qwen2 => 32768,
            DecoderArch::Mistral => 131072,
        }
    }

    pub fn of_kind(kind: ModelKind) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.kind() == kind)
    }

    pub fn from_model_type(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.model_type() == s)
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
