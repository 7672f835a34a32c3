//! A family's model as an ordered list of blocks with a parallel plan:
//! where pipeline stages may begin, and how each weight splits across
//! tensor-parallel ranks (Megatron-LM's scheme: column-split layers feed
//! row-split ones, so one all-reduce closes each pair).

use std::collections::BTreeMap;

/// A run of the model's forward: its name (`embed`, `layers.3`, `head`)
/// and the parameters it owns, by name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    pub name: String,
    pub params: Vec<String>,
}

/// How a parameter is split across the tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// By output rows (dim 0 of a `[out, in]` weight, and its bias): each
    /// rank computes a slice of the outputs (Megatron's
    /// `ColumnParallelLinear`: q, k, v, gate, up).
    Column,
    /// By input columns (dim 1 of the weight): each rank's partial outputs
    /// are summed (`RowParallelLinear`: o, down). Its bias is
    /// [`Split::Replicated`], added once after the sum.
    Row,
    /// By vocabulary rows (dim 0): the embedding
    /// (`VocabParallelEmbedding`) and the output head (logits and loss
    /// over the sharded vocabulary).
    Vocab,
    /// Whole on every rank (norms, the biases of row-split layers).
    Replicated,
}

/// Where a model may be cut into pipeline stages and how its weights
/// split under tensor parallelism.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParallelPlan {
    /// The block indices at which a pipeline stage may begin (a cut
    /// between block `i - 1` and block `i`), ascending; empty: the model
    /// is one stage.
    pub stage_boundaries: Vec<usize>,
    /// Each parameter name pattern with its split, every parameter named
    /// by exactly one pattern; a parameter none names is replicated (a
    /// plan without splits replicates the whole model). In a pattern,
    /// `*` stands for one dot-free segment (a layer's index).
    pub splits: Vec<(String, Split)>,
}

// The plan's error lives in the error module (below every folder).
pub use crate::error::PlanError;

/// Whether `pattern` names `name`: the same dot-separated segments, `*`
/// matching any one segment.
pub fn matches(pattern: &str, name: &str) -> bool {
    let mut p = pattern.split('.');
    let mut n = name.split('.');
    loop {
        match (p.next(), n.next()) {
            (None, None) => return true,
            (Some(a), Some(b)) if a == "*" || a == b => {}
            _ => return false,
        }
    }
}

impl ParallelPlan {
    /// The split of parameter `name`: its pattern's, else replicated.
    pub fn split_of(&self, name: &str) -> Split {
        self.splits
            .iter()
            .find(|(pattern, _)| matches(pattern, name))
            .map_or(Split::Replicated, |(_, split)| *split)
    }
}

/// Checks that `blocks` name each of `params` (a built model's parameter
/// names) exactly once, and nothing else.
pub fn check_blocks(blocks: &[Block], params: &[String]) -> Result<(), PlanError> {
    let mut count: BTreeMap<&str, usize> = params.iter().map(|p| (p.as_str(), 0)).collect();
    for b in blocks {
        for name in &b.params {
            match count.get_mut(name.as_str()) {
                Some(n) => *n += 1,
                None => {
                    return Err(PlanError::Unknown {
                        block: b.name.clone(),
                        name: name.clone(),
                    })
                }
            }
        }
    }
    match count.into_iter().find(|(_, n)| *n != 1) {
        None => Ok(()),
        Some((name, 0)) => Err(PlanError::Uncovered { name: name.into() }),
        Some((name, count)) => Err(PlanError::Repeated {
            name: name.into(),
            count,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_star_matches_one_segment() {
        let p = "model.layers.*.mlp.up_proj.weight";
        assert!(matches(p, "model.layers.0.mlp.up_proj.weight"));
        assert!(matches(p, "model.layers.31.mlp.up_proj.weight"));
        assert!(!matches(p, "model.layers.0.mlp.up_proj.bias"));
        assert!(!matches(p, "model.layers.0.1.mlp.up_proj.weight"));
        assert!(!matches(p, "model.layers.mlp.up_proj.weight"));
        assert!(matches("lm_head.weight", "lm_head.weight"));
        assert!(!matches("lm_head.weight", "lm_head.weight.x"));
    }

    #[test]
    fn blocks_must_cover_every_parameter_once() {
        let params: Vec<String> = ["a.weight", "b.weight"].map(String::from).to_vec();
        let block = |name: &str, params: &[&str]| Block {
            name: name.into(),
            params: params.iter().map(|p| p.to_string()).collect(),
        };
        assert_eq!(
            check_blocks(&[block("x", &["a.weight", "b.weight"])], &params),
            Ok(())
        );
        assert_eq!(
            check_blocks(&[block("x", &["a.weight"])], &params),
            Err(PlanError::Uncovered {
                name: "b.weight".into()
            })
        );
        assert_eq!(
            check_blocks(
                &[
                    block("x", &["a.weight", "b.weight"]),
                    block("y", &["a.weight"])
                ],
                &params
            ),
            Err(PlanError::Repeated {
                name: "a.weight".into(),
                count: 2
            })
        );
        assert_eq!(
            check_blocks(
                &[block("x", &["a.weight", "b.weight", "c.weight"])],
                &params
            ),
            Err(PlanError::Unknown {
                block: "x".into(),
                name: "c.weight".into()
            })
        );
        let plan = ParallelPlan::default();
        assert_eq!(plan.split_of("a.weight"), Split::Replicated);
    }
}
