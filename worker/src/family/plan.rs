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

/// The pipeline units of `blocks` under `boundaries` (the block indices
/// where a stage may begin): each unit the blocks from one boundary to the
/// next, as a half-open range of block indices. A model with no boundary
/// is one unit.
pub fn units(blocks: usize, boundaries: &[usize]) -> Vec<std::ops::Range<usize>> {
    let mut starts = vec![0];
    starts.extend(boundaries.iter().copied().filter(|&b| b > 0 && b < blocks));
    starts.dedup();
    let mut out: Vec<_> = starts.windows(2).map(|w| w[0]..w[1]).collect();
    if let Some(&last) = starts.last() {
        out.push(last..blocks);
    }
    out
}

/// The stages of a model of `sizes` (each unit's parameter count) for
/// `stages` stages: `per_stage` units each when given (they must add up
/// to the units, each at least 1), else the contiguous split that makes the
/// largest stage smallest (ties: the earliest cuts take the fewest
/// units, so later stages, which also hold the head and the loss, are
/// not heavier). Returns each stage's range of units. `what` names the
/// units in errors ("decoder layers").
pub fn stage_units(
    sizes: &[u64],
    stages: usize,
    per_stage: Option<&[u64]>,
    what: &str,
) -> Result<Vec<std::ops::Range<usize>>, PlanError> {
    let n = sizes.len();
    if stages == 0 || stages > n {
        return Err(PlanError::TooManyStages {
            stages,
            units: n,
            what: what.into(),
        });
    }
    if let Some(given) = per_stage {
        let refuse = |reason: String| PlanError::LayersPerStage {
            given: given.to_vec(),
            reason,
        };
        if given.len() != stages {
            return Err(refuse(format!(
                "{} entries for parallel.pipeline = {stages} stages (one per stage)",
                given.len()
            )));
        }
        if given.contains(&0) {
            return Err(refuse("every stage needs at least 1".into()));
        }
        let total: u64 = given.iter().sum();
        if total != n as u64 {
            return Err(refuse(format!(
                "they add up to {total}, the model has {n} {what}"
            )));
        }
        let mut at = 0;
        return Ok(given
            .iter()
            .map(|&c| {
                let r = at..at + c as usize;
                at = r.end;
                r
            })
            .collect());
    }
    // best[j][i]: the smallest largest stage splitting units 0..i into j
    // stages; cut[j][i] where its last stage begins.
    let prefix: Vec<u64> = std::iter::once(0)
        .chain(sizes.iter().scan(0u64, |acc, &s| {
            *acc += s;
            Some(*acc)
        }))
        .collect();
    let sum = |a: usize, b: usize| prefix[b] - prefix[a];
    let mut best = vec![vec![u64::MAX; n + 1]; stages + 1];
    let mut cut = vec![vec![0usize; n + 1]; stages + 1];
    best[0][0] = 0;
    for j in 1..=stages {
        for i in j..=n {
            // The last stage is units a..i; keep the latest start among
            // equals (fewer units in the last stages).
            for a in (j - 1)..i {
                if best[j - 1][a] == u64::MAX {
                    continue;
                }
                let cost = best[j - 1][a].max(sum(a, i));
                if cost <= best[j][i] {
                    best[j][i] = cost;
                    cut[j][i] = a;
                }
            }
        }
    }
    let mut ranges = Vec::with_capacity(stages);
    let mut end = n;
    for j in (1..=stages).rev() {
        let a = cut[j][end];
        ranges.push(a..end);
        end = a;
    }
    ranges.reverse();
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_run_from_one_boundary_to_the_next() {
        // llama with 3 layers: embed, layers.0-2, head; stages begin at
        // layers 1 and 2 (blocks 2 and 3).
        assert_eq!(units(5, &[2, 3]), vec![0..2, 2..3, 3..5]);
        assert_eq!(units(4, &[]), vec![0..4]);
        assert_eq!(units(3, &[1, 2]), vec![0..1, 1..2, 2..3]);
    }

    #[test]
    fn stages_balance_the_largest_or_follow_the_counts_given() {
        let r = |v: &[std::ops::Range<usize>]| v.to_vec();
        assert_eq!(
            r(&stage_units(&[10, 10, 10, 10], 2, None, "layers").unwrap()),
            vec![0..2, 2..4]
        );
        // A heavy first unit (the embedding with layer 0) stands alone.
        assert_eq!(
            r(&stage_units(&[30, 10, 10, 10], 2, None, "layers").unwrap()),
            vec![0..1, 1..4]
        );
        assert_eq!(
            r(&stage_units(&[1, 1, 1, 1, 1], 2, Some(&[1, 4]), "layers").unwrap()),
            vec![0..1, 1..5]
        );
        let e = stage_units(&[1, 1, 1], 4, None, "decoder layers")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("parallel.pipeline = 4") && e.contains("3 decoder layers"),
            "{e}"
        );
        let e = stage_units(&[1, 1, 1], 2, Some(&[1, 1]), "decoder layers")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("[1, 1]") && e.contains("add up to 2") && e.contains("has 3"),
            "{e}"
        );
        let e = stage_units(&[1, 1, 1], 2, Some(&[3]), "layers")
            .unwrap_err()
            .to_string();
        assert!(e.contains("1 entries for parallel.pipeline = 2"), "{e}");
        let e = stage_units(&[1, 1, 1], 2, Some(&[3, 0]), "layers")
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 1"), "{e}");
    }

    proptest::proptest! {
        /// Contiguous, covering, non-empty, and no other split has a
        /// smaller largest stage (checked against every split).
        #[test]
        fn the_balanced_split_is_optimal(
            sizes in proptest::collection::vec(1u64..100, 1..9), stages in 1usize..5,
        ) {
            proptest::prop_assume!(stages <= sizes.len());
            let got = stage_units(&sizes, stages, None, "units").unwrap();
            proptest::prop_assert_eq!(got.len(), stages);
            proptest::prop_assert_eq!(got[0].start, 0);
            proptest::prop_assert_eq!(got[stages - 1].end, sizes.len());
            for w in got.windows(2) {
                proptest::prop_assert_eq!(w[0].end, w[1].start);
            }
            let largest = |v: &[std::ops::Range<usize>]| {
                v.iter().map(|r| sizes[r.clone()].iter().sum::<u64>()).max().unwrap()
            };
            proptest::prop_assert!(got.iter().all(|r| !r.is_empty()));
            // Every split into `stages` parts by brute force.
            let n = sizes.len();
            let mut best = u64::MAX;
            for mask in 0u32..(1 << (n - 1)) {
                if mask.count_ones() as usize != stages - 1 {
                    continue;
                }
                let mut ranges = Vec::new();
                let mut start = 0;
                for i in 1..n {
                    if mask & (1 << (i - 1)) != 0 {
                        ranges.push(start..i);
                        start = i;
                    }
                }
                ranges.push(start..n);
                best = best.min(largest(&ranges));
            }
            proptest::prop_assert_eq!(largest(&got), best);
        }
    }

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
