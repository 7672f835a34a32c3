//! llama's model fields (common's `LlamaSpec`) <-> the proto `LlamaSpec`
//! (`ModelSpec.llama`); a job stored before issue 38 has them flat in
//! `ModelSpec` (fields 7 to 19), read when `llama` is absent.

use super::FamilyProto;
use crate::v1;
use accrue_common::spec::{FamilyFields, LlamaSpec};
use std::path::PathBuf;

pub(super) struct Llama;

impl FamilyProto for Llama {
    fn write(&self, from: &FamilyFields, to: &mut v1::ModelSpec) {
        let l = &from.llama;
        // A spec without llama fields has no message (as a job stored
        // before issue 38 had none of the flat fields).
        if *l == LlamaSpec::default() {
            return;
        }
        to.llama = Some(v1::LlamaSpec {
            vocab_size: l.vocab_size,
            hidden_size: l.hidden_size,
            intermediate_size: l.intermediate_size,
            num_hidden_layers: l.num_hidden_layers,
            num_attention_heads: l.num_attention_heads,
            num_key_value_heads: l.num_key_value_heads,
            rms_norm_eps: l.rms_norm_eps,
            rope_theta: l.rope_theta,
            max_position_embeddings: l.max_position_embeddings,
            tie_word_embeddings: l.tie_word_embeddings,
            attention_bias: l.attention_bias,
            mlp_bias: l.mlp_bias,
            config: l.config.as_ref().map(|p| p.display().to_string()),
        });
    }

    fn read(&self, from: &v1::ModelSpec, to: &mut FamilyFields) {
        let l = from.llama.clone().unwrap_or_else(|| legacy(from));
        to.llama = LlamaSpec {
            vocab_size: l.vocab_size,
            hidden_size: l.hidden_size,
            intermediate_size: l.intermediate_size,
            num_hidden_layers: l.num_hidden_layers,
            num_attention_heads: l.num_attention_heads,
            num_key_value_heads: l.num_key_value_heads,
            rms_norm_eps: l.rms_norm_eps,
            rope_theta: l.rope_theta,
            max_position_embeddings: l.max_position_embeddings,
            tie_word_embeddings: l.tie_word_embeddings,
            attention_bias: l.attention_bias,
            mlp_bias: l.mlp_bias,
            config: l.config.map(PathBuf::from),
        };
    }
}

/// The fields as a job stored before issue 38 has them, flat in
/// `ModelSpec`.
fn legacy(m: &v1::ModelSpec) -> v1::LlamaSpec {
    v1::LlamaSpec {
        vocab_size: m.vocab_size,
        hidden_size: m.hidden_size,
        intermediate_size: m.intermediate_size,
        num_hidden_layers: m.num_hidden_layers,
        num_attention_heads: m.num_attention_heads,
        num_key_value_heads: m.num_key_value_heads,
        rms_norm_eps: m.rms_norm_eps,
        rope_theta: m.rope_theta,
        max_position_embeddings: m.max_position_embeddings,
        tie_word_embeddings: m.tie_word_embeddings,
        attention_bias: m.attention_bias,
        mlp_bias: m.mlp_bias,
        config: m.config.clone(),
    }
}

#[cfg(test)]
mod tests {
    use crate::convert::{spec_from_proto, spec_to_proto};
    use crate::v1;
    use accrue_common::spec::JobSpec;

    /// A job stored before issue 38 (llama's fields flat in the proto
    /// `ModelSpec`, fields 7 to 19) reads back as the same spec; a spec
    /// written now carries them in `ModelSpec.llama` only, and a model
    /// without llama fields carries no `llama` message.
    #[test]
    fn llama_fields_stored_flat_before_issue_38_read_back() {
        let text = "name = \"lm\"\n[model]\nkind = \"llama\"\nvocab_size = 97\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 2\nnum_attention_heads = 4\nnum_key_value_heads = 2\nrms_norm_eps = 1e-5\nrope_theta = 500000.0\nmax_position_embeddings = 256\ntie_word_embeddings = true\nattention_bias = true\nmlp_bias = false\nconfig = \"hf/config.json\"\n[data]\nkind = \"tokens\"\npath = \"train.bin\"\nseq_len = 64\nbatch_size = 8\n[optimizer]\nkind = \"adamw\"\nlr = 0.001\n";
        let spec = JobSpec::fields_from_toml_str(text, std::path::Path::new("lm.toml")).unwrap();
        let new = spec_to_proto(&spec);
        let m = new.model.as_ref().unwrap();
        assert_eq!(
            (m.vocab_size, m.hidden_size, m.config.as_deref()),
            (None, None, None)
        );
        let l = m.llama.clone().unwrap();
        let mut old = new.clone();
        old.model = Some(v1::ModelSpec {
            kind: m.kind,
            vocab_size: l.vocab_size,
            hidden_size: l.hidden_size,
            intermediate_size: l.intermediate_size,
            num_hidden_layers: l.num_hidden_layers,
            num_attention_heads: l.num_attention_heads,
            num_key_value_heads: l.num_key_value_heads,
            rms_norm_eps: l.rms_norm_eps,
            rope_theta: l.rope_theta,
            max_position_embeddings: l.max_position_embeddings,
            tie_word_embeddings: l.tie_word_embeddings,
            attention_bias: l.attention_bias,
            mlp_bias: l.mlp_bias,
            config: l.config,
            ..Default::default()
        });
        assert_eq!(spec_from_proto(&old).unwrap(), spec);
        // Bytes as the earlier coordinator wrote them decode alike.
        use prost::Message;
        let bytes = old.encode_to_vec();
        assert_eq!(
            spec_from_proto(&v1::JobSpec::decode(bytes.as_slice()).unwrap()).unwrap(),
            spec
        );
        let mlp = JobSpec::fields_from_toml_str(
            "name = \"m\"\n[model]\nkind = \"mlp\"\n[data]\nkind = \"synthetic\"\nbatch_size = 8\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n",
            std::path::Path::new("m.toml"),
        )
        .unwrap();
        assert_eq!(spec_to_proto(&mlp).model.unwrap().llama, None);
    }
}
