//! llama's own `[model]` fields (issue 30), named as in Hugging Face's
//! `LlamaConfig`: given in the spec, resolved with `config` and the
//! defaults by [`super::LlamaConfig::resolve`].

use super::super::fields::spec_fields;
use std::path::PathBuf;

spec_fields! {
    /// `model.<field>` of a `llama` model (`ModelSpec::fields.llama`);
    /// each one absent unless given.
    pub struct LlamaSpec {
        /// Tokens in the vocabulary (embedding rows, logits per position).
        vocab_size: i64,
        /// The model width.
        hidden_size: i64,
        /// The MLP's inner width.
        intermediate_size: i64,
        /// Decoder layers.
        num_hidden_layers: i64,
        /// Query heads.
        num_attention_heads: i64,
        /// Key/value heads (default: `num_attention_heads`; fewer is GQA).
        num_key_value_heads: i64,
        /// RMSNorm's epsilon (default 1e-6).
        rms_norm_eps: f64,
        /// RoPE's base (default 10000).
        rope_theta: f64,
        /// The longest sequence (default 2048).
        max_position_embeddings: i64,
        /// The output head is the embedding (default false).
        tie_word_embeddings: bool,
        /// Biases on q, k, v and o (default false).
        attention_bias: bool,
        /// Biases on the MLP's projections (default false).
        mlp_bias: bool,
        /// A Hugging Face `config.json` giving the fields above (a field
        /// given here too must agree).
        config: PathBuf,
    }
    paths: [config]
}
