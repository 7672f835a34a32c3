//! A pipeline stage's place in the model (issue 40): its blocks, by
//! `layers_per_stage` or balanced by parameters or by compute, and the
//! tied embedding the last stage holds too.

use super::{Pipe, PipeSchedule};
use crate::error::Result;
use std::collections::HashSet;
use std::ops::Range;

/// Each unit's parameter count (the default balance).
fn unit_sizes(
    blocks: &[crate::family::Block],
    units: &[Range<usize>],
    shape: &dyn Fn(&str) -> Vec<i64>,
) -> Vec<u64> {
    units
        .iter()
        .map(|u| {
            blocks[u.clone()]
                .iter()
                .flat_map(|b| &b.params)
                .map(|n| shape(n).iter().product::<i64>().max(0) as u64)
                .sum()
        })
        .collect()
}

/// Each unit's forward multiply-adds per token (`balance = "compute"`;
/// the backward is twice the forward everywhere, so it does not move the
/// boundaries): every matrix of a product counts its elements (an
/// embedding's lookup, a norm's or a bias's vector nothing); a block with
/// attention (`self_attn` parameters) adds `attention`; the last unit
/// adds the tied head's matrix, held by another block.
fn unit_costs(
    blocks: &[crate::family::Block],
    units: &[Range<usize>],
    shape: &dyn Fn(&str) -> Vec<i64>,
    tied: Option<&str>,
    attention: u64,
) -> Vec<u64> {
    let matrix = |n: &str| {
        let s = shape(n);
        if s.len() == 2 && !n.contains("embed_tokens") {
            (s[0] * s[1]).max(0) as u64
        } else {
            0
        }
    };
    let last = units.len().saturating_sub(1);
    units
        .iter()
        .enumerate()
        .map(|(i, u)| {
            let own: u64 = blocks[u.clone()]
                .iter()
                .map(|b| {
                    let attends = b.params.iter().any(|n| n.contains("self_attn."));
                    b.params.iter().map(|n| matrix(n)).sum::<u64>()
                        + if attends { attention } else { 0 }
                })
                .sum();
            let head = match tied {
                Some(t) if i == last => shape(t).iter().product::<i64>().max(0) as u64,
                _ => 0,
            };
            own + head
        })
        .collect()
}

/// The stage of `model` for `stage` of `stages`, and the parameter names
/// it trains (its chunks' blocks', and the tied embedding on the last
/// stage).
pub(in crate::engine) fn plan(
    spec: &crate::spec::JobSpec,
    params: &[(String, Vec<i64>)],
    stage: usize,
    stages: usize,
) -> Result<(Pipe, HashSet<String>)> {
    let family = crate::family::family(spec.model.kind);
    let names: Vec<String> = params.iter().map(|(n, _)| n.clone()).collect();
    let blocks = family.blocks(&spec.model, &names)?;
    let plan = family.parallel_plan(&spec.model)?;
    let units = crate::family::units(blocks.len(), &plan.stage_boundaries);
    let shape = |n: &str| {
        params
            .iter()
            .find(|(p, _)| p == n)
            .map_or_else(Vec::new, |(_, s)| s.clone())
    };
    // A head tied to the embedding (the Llama family's
    // `tie_word_embeddings`): the first block's parameter, which the last
    // stage holds too.
    let tied = if spec.model.kind.is_decoder()
        && crate::spec::LlamaConfig::resolve(&spec.model)?.tie_word_embeddings
    {
        blocks.first().and_then(|b| {
            b.params
                .iter()
                .find(|n| n.ends_with("embed_tokens.weight"))
                .cloned()
        })
    } else {
        None
    };
    let sizes = match spec.parallel.balance.unwrap_or_default() {
        crate::spec::StageBalance::Parameters => unit_sizes(&blocks, &units, &shape),
        crate::spec::StageBalance::Compute => {
            // Attention's multiply-adds per token of a decoder layer:
            // T x hidden (scores and values, causal: T / 2 each).
            let attention = if spec.model.kind.is_decoder() {
                let cfg = crate::spec::LlamaConfig::resolve(&spec.model)?;
                spec.data.seq_len.unwrap_or(0) * cfg.hidden_size.max(0) as u64
            } else {
                0
            };
            unit_costs(&blocks, &units, &shape, tied.as_deref(), attention)
        }
    };
    let what = if spec.model.kind.is_decoder() {
        "decoder layers"
    } else {
        "layers"
    };
    let schedule = match spec.parallel.schedule.unwrap_or_default() {
        crate::spec::PipelineSchedule::OneFOneB => PipeSchedule::OneFOneB,
        crate::spec::PipelineSchedule::GPipe => PipeSchedule::GPipe,
        crate::spec::PipelineSchedule::Interleaved1F1B => PipeSchedule::Interleaved1F1B,
    };
    // V chunks a rank (interleaved 1F1B): the units cut into P x V
    // chunks of equal count (or by layers_per_stage), chunk c on rank
    // c mod P.
    let per_rank = match schedule {
        PipeSchedule::Interleaved1F1B => spec.parallel.stages_per_rank.unwrap_or(1).max(1) as usize,
        _ => 1,
    };
    let split = if per_rank > 1 && spec.parallel.layers_per_stage.is_none() {
        even_chunks(units.len(), stages * per_rank, what)?
    } else {
        crate::family::stage_units(
            &sizes,
            stages * per_rank,
            spec.parallel.layers_per_stage.as_deref(),
            what,
        )?
    };
    let layout = crate::engine::trainer::pipeline::Layout::new(stages, per_rank);
    let chunks: Vec<Range<usize>> = (0..per_rank)
        .map(|v| {
            let mine = &split[layout.global(stage, v)];
            units[mine.start].start..units[mine.end - 1].end
        })
        .collect();
    let train: HashSet<String> = chunks
        .iter()
        .flat_map(|r| &blocks[r.clone()])
        .flat_map(|b| b.params.iter().cloned())
        .collect();
    Ok((
        Pipe {
            stage,
            stages,
            schedule,
            chunks,
            tied: tied.filter(|_| stages > 1),
        },
        train,
    ))
}

/// `units` units in `chunks` chunks of equal count (the spec's check
/// refused any other count).
fn even_chunks(units: usize, chunks: usize, what: &str) -> Result<Vec<Range<usize>>> {
    if chunks == 0 || !units.is_multiple_of(chunks) {
        return Err(crate::error::Error::Schedule(format!(
            "{units} {what} do not cut into {chunks} chunks of equal size"
        )));
    }
    let each = units / chunks;
    Ok((0..chunks).map(|c| c * each..(c + 1) * each).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Llama of 4 layers, H = 128, vocab 4,096, T = 64 (the pipeline
    /// benchmark's), in 2 stages.
    fn spec(balance: &str, tied: bool) -> crate::spec::JobSpec {
        let text = format!(
            r#"
name = "b"
workers = 2
[model]
kind = "llama"
vocab_size = 4096
hidden_size = 128
intermediate_size = 384
num_hidden_layers = 4
num_attention_heads = 2
max_position_embeddings = 64
tie_word_embeddings = {tied}
[data]
kind = "tokens"
path = "x.bin"
seq_len = 64
batch_size = 4
[optimizer]
kind = "sgd"
lr = 0.1
[parallel]
pipeline = 2
{balance}
"#
        );
        crate::spec::JobSpec::fields_from_toml_str(&text, std::path::Path::new("t")).unwrap()
    }

    fn shapes(s: &crate::spec::JobSpec) -> Vec<(String, Vec<i64>)> {
        let m =
            crate::family::model::Model::build(&s.model, &[64], 4096, tch::Device::Cpu, 1).unwrap();
        m.params
            .iter()
            .map(|(n, t)| (n.clone(), t.size()))
            .collect()
    }

    /// Interleaved 1F1B, P = 2, V = 2 on the 4-layer Llama: 4 chunks of
    /// one layer (blocks: 0 the embedding, 1..=4 the layers, 5 the norm
    /// and head); rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3 with
    /// the tied head; layers_per_stage = [1, 1, 1, 1] cuts the same.
    #[test]
    fn interleaved_ranks_hold_every_pth_chunk() {
        let s = spec("schedule = \"interleaved_1f1b\"\nstages_per_rank = 2", true);
        let all = shapes(&s);
        let (zero, names) = plan(&s, &all, 0, 2).unwrap();
        assert_eq!(zero.chunks, vec![0..2, 3..4]);
        assert_eq!(zero.schedule, PipeSchedule::Interleaved1F1B);
        assert!(names.contains("model.embed_tokens.weight"));
        assert!(names.contains("model.layers.2.mlp.up_proj.weight"));
        assert!(!names.contains("model.layers.1.mlp.up_proj.weight"));
        let (one, _) = plan(&s, &all, 1, 2).unwrap();
        assert_eq!(one.chunks, vec![2..3, 4..6]);
        assert_eq!(one.tied.as_deref(), Some("model.embed_tokens.weight"));
        let s = spec(
            "schedule = \"interleaved_1f1b\"\nstages_per_rank = 2\nlayers_per_stage = [1, 1, 1, 1]",
            false,
        );
        assert_eq!(
            plan(&s, &shapes(&s), 1, 2).unwrap().0.chunks,
            vec![2..3, 4..6]
        );
    }

    fn first_stage_blocks(balance: &str, tied: bool) -> Range<usize> {
        let s = spec(balance, tied);
        plan(&s, &shapes(&s), 0, 2).unwrap().0.blocks()
    }

    /// By parameters the embedding weighs as much as the head: 2 + 2
    /// layers. By compute the lookup costs nothing and the head (tied or
    /// not) a 4,096 x 128 product: 3 + 1. The costs are the math's: a
    /// layer's matrices (4 x 128^2 + 3 x 128 x 384) plus T x H of
    /// attention; the head 4,096 x 128.
    #[test]
    fn compute_balance_counts_the_head_and_not_the_lookup() {
        // Blocks: 0 the embedding, 1..=4 the layers, 5 the norm and head.
        assert_eq!(first_stage_blocks("", false), 0..3);
        assert_eq!(first_stage_blocks("balance = \"parameters\"", false), 0..3);
        assert_eq!(first_stage_blocks("balance = \"compute\"", false), 0..4);
        assert_eq!(first_stage_blocks("balance = \"compute\"", true), 0..4);
        let s = spec("", true);
        let model =
            crate::family::model::Model::build(&s.model, &[64], 4096, tch::Device::Cpu, 1).unwrap();
        let family = crate::family::family(s.model.kind);
        let names: Vec<String> = model.params.iter().map(|(n, _)| n.clone()).collect();
        let blocks = family.blocks(&s.model, &names).unwrap();
        let units = crate::family::units(
            blocks.len(),
            &family.parallel_plan(&s.model).unwrap().stage_boundaries,
        );
        let shape = |n: &str| {
            model
                .params
                .iter()
                .find(|(p, _)| p == n)
                .map_or_else(Vec::new, |(_, t)| t.size())
        };
        let layer = 4 * 128 * 128 + 3 * 128 * 384 + 64 * 128;
        assert_eq!(
            unit_costs(
                &blocks,
                &units,
                &shape,
                Some("model.embed_tokens.weight"),
                64 * 128
            ),
            vec![layer, layer, layer, layer + 4096 * 128]
        );
    }
}
