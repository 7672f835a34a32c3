//! llama's parameter names, its blocks (the embedding, each decoder
//! layer, the final norm with the head) and their parallel plan:
//! Megatron-LM's tensor-parallel splits (q, k, v, gate and up by column;
//! o and down by row; the embedding and the head by vocabulary; norms
//! replicated) and pipeline stages that begin at a decoder layer.

use crate::family::{Block, ParallelPlan, Split};
use crate::spec::LlamaConfig;

/// A decoder layer's linear layers with their split (a row-split layer's
/// bias is replicated), attention's first.
const ATTENTION: [(&str, Split); 4] = [
    ("q_proj", Split::Column),
    ("k_proj", Split::Column),
    ("v_proj", Split::Column),
    ("o_proj", Split::Row),
];
const MLP: [(&str, Split); 3] = [
    ("gate_proj", Split::Column),
    ("up_proj", Split::Column),
    ("down_proj", Split::Row),
];
const NORMS: [&str; 2] = ["input_layernorm", "post_attention_layernorm"];
/// Qwen3's per-head norms on q and k (after o_proj in its state_dict).
const HEAD_NORMS: [&str; 2] = ["self_attn.q_norm", "self_attn.k_norm"];
const EMBED: &str = "model.embed_tokens.weight";
const NORM: &str = "model.norm.weight";
const HEAD: &str = "lm_head.weight";

/// The linear layers of a decoder layer `at` (`model.layers.{i}` or its
/// pattern): each one's path, whether it has a bias, and its split.
fn linears(at: &str, c: &LlamaConfig) -> Vec<(String, bool, Split)> {
    let attention = ATTENTION.iter().map(|(name, split)| {
        // Qwen2: biases on q, k and v only.
        let bias = c.attention_bias || (c.qkv_bias() && *name != "o_proj");
        (format!("{at}.self_attn.{name}"), bias, *split)
    });
    let mlp = MLP
        .iter()
        .map(|(name, split)| (format!("{at}.mlp.{name}"), c.mlp_bias, *split));
    attention.chain(mlp).collect()
}

/// The parameters of decoder layer `at`, in the order the model creates
/// them (transformers' state_dict order).
fn layer_params(at: &str, c: &LlamaConfig) -> Vec<String> {
    let mut params = Vec::new();
    for (i, (path, bias, _)) in linears(at, c).into_iter().enumerate() {
        if i == ATTENTION.len() {
            params.extend(head_norms(at, c));
        }
        params.push(format!("{path}.weight"));
        if bias {
            params.push(format!("{path}.bias"));
        }
    }
    params.extend(NORMS.iter().map(|n| format!("{at}.{n}.weight")));
    params
}

/// The per-head norms' weights of decoder layer `at` (none without
/// `qk_norm`).
fn head_norms(at: &str, c: &LlamaConfig) -> Vec<String> {
    let norms: &[&str] = if c.qk_norm() { &HEAD_NORMS } else { &[] };
    norms.iter().map(|n| format!("{at}.{n}.weight")).collect()
}

/// The blocks in forward order: `embed`, `layers.0` ... `layers.{L-1}`,
/// `head` (the final norm and, unless tied to the embedding, lm_head).
pub fn blocks(c: &LlamaConfig) -> Vec<Block> {
    let mut blocks = vec![Block {
        name: "embed".into(),
        params: vec![EMBED.into()],
    }];
    blocks.extend((0..c.num_hidden_layers).map(|i| Block {
        name: format!("layers.{i}"),
        params: layer_params(&format!("model.layers.{i}"), c),
    }));
    let mut head = vec![NORM.to_string()];
    if !c.tie_word_embeddings {
        head.push(HEAD.into());
    }
    blocks.push(Block {
        name: "head".into(),
        params: head,
    });
    blocks
}

/// Every parameter's name, block by block.
pub fn param_names(c: &LlamaConfig) -> Vec<String> {
    blocks(c).into_iter().flat_map(|b| b.params).collect()
}

/// Stages begin at a decoder layer other than the first (torchtitan's
/// split points `layers.N`: the embedding stays with the first layer, the
/// final norm and the head with the last); the splits as Megatron-LM's.
pub fn parallel_plan(c: &LlamaConfig) -> ParallelPlan {
    let layers = usize::try_from(c.num_hidden_layers).unwrap_or(0);
    // Block i + 1 is decoder layer i.
    let stage_boundaries = (2..=layers).collect();
    let mut splits = vec![(EMBED.to_string(), Split::Vocab)];
    for (path, bias, split) in linears("model.layers.*", c) {
        splits.push((format!("{path}.weight"), split));
        if bias {
            let bias_split = match split {
                Split::Row => Split::Replicated,
                other => other,
            };
            splits.push((format!("{path}.bias"), bias_split));
        }
    }
    // Norms replicated; the per-head ones' gradients are each rank's
    // heads' and are summed over the group by the model (tensor.rs).
    splits.extend(
        NORMS
            .iter()
            .map(|n| (format!("model.layers.*.{n}.weight"), Split::Replicated))
            .chain(
                head_norms("model.layers.*", c)
                    .into_iter()
                    .map(|n| (n, Split::Replicated)),
            ),
    );
    splits.push((NORM.into(), Split::Replicated));
    if !c.tie_word_embeddings {
        splits.push((HEAD.into(), Split::Vocab));
    }
    ParallelPlan {
        stage_boundaries,
        splits,
    }
}

#[cfg(test)]
mod tests {
    use super::super::Net;
    use super::*;
    use crate::family::{check_blocks, matches};
    use tch::{nn, Device};

    fn config(layers: i64, tied: bool, bias: bool) -> LlamaConfig {
        LlamaConfig {
            vocab_size: 50,
            hidden_size: 32,
            intermediate_size: 48,
            num_hidden_layers: layers,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            max_position_embeddings: 64,
            tie_word_embeddings: tied,
            attention_bias: bias,
            mlp_bias: bias,
            initializer_range: 0.02,
            rope_scaling: Default::default(),
            arch: Default::default(),
            sliding_window: None,
            explicit_head_dim: None,
        }
    }

    /// The parameter names of the model [`Net::new`] builds.
    fn built(c: &LlamaConfig) -> Vec<String> {
        let vs = nn::VarStore::new(Device::Cpu);
        Net::new(&vs.root(), c).unwrap();
        let mut names: Vec<String> = vs.variables().into_keys().collect();
        names.sort();
        names
    }

    /// The blocks and the splits name exactly the built model's
    /// parameters: each in one block and under one pattern, every pattern
    /// naming one at least, with or without biases and a tied head.
    #[test]
    fn the_plan_names_exactly_the_models_parameters() {
        for (layers, tied, bias) in [(2, false, false), (3, true, true), (1, true, false)] {
            let c = config(layers, tied, bias);
            let params = built(&c);
            let blocks = blocks(&c);
            check_blocks(&blocks, &params).unwrap();
            let mut names = param_names(&c);
            names.sort();
            assert_eq!(names, params);
            let plan = parallel_plan(&c);
            for p in &params {
                let n = plan.splits.iter().filter(|(s, _)| matches(s, p)).count();
                assert_eq!(n, 1, "{p}: {n} patterns");
            }
            for (pattern, _) in &plan.splits {
                assert!(params.iter().any(|p| matches(pattern, p)), "{pattern}");
            }
            let names: Vec<&str> = blocks.iter().map(|b| b.name.as_str()).collect();
            assert_eq!(names.len(), layers as usize + 2);
            assert_eq!((names[0], names[1]), ("embed", "layers.0"));
            assert_eq!(names.last(), Some(&"head"));
            let want: Vec<usize> = (2..=layers as usize).collect();
            assert_eq!(plan.stage_boundaries, want);
        }
    }

    /// Megatron-LM's scheme, parameter by parameter.
    #[test]
    fn the_splits_are_megatrons() {
        let plan = parallel_plan(&config(2, false, true));
        let l = |rest: &str| format!("model.layers.1.{rest}");
        for (name, split) in [
            ("model.embed_tokens.weight".into(), Split::Vocab),
            ("lm_head.weight".into(), Split::Vocab),
            ("model.norm.weight".into(), Split::Replicated),
            (l("self_attn.q_proj.weight"), Split::Column),
            (l("self_attn.k_proj.bias"), Split::Column),
            (l("self_attn.v_proj.weight"), Split::Column),
            (l("self_attn.o_proj.weight"), Split::Row),
            (l("self_attn.o_proj.bias"), Split::Replicated),
            (l("mlp.gate_proj.weight"), Split::Column),
            (l("mlp.up_proj.bias"), Split::Column),
            (l("mlp.down_proj.weight"), Split::Row),
            (l("mlp.down_proj.bias"), Split::Replicated),
            (l("input_layernorm.weight"), Split::Replicated),
            (l("post_attention_layernorm.weight"), Split::Replicated),
        ] {
            let name: String = name;
            assert_eq!(plan.split_of(&name), split, "{name}");
        }
    }
}
