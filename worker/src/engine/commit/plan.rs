//! The pure decisions of a checkpoint: which rank writes which tensors
//! ([`plan`], [`Plan::role`]), how the writers' files are numbered
//! ([`numbering`]), their names ([`model_file`], [`optimizer_file`]) and
//! when the step folder is complete ([`complete`]).

use crate::checkpoint::{self, manifest::Entry, shards};
use std::ops::Range;

/// Where a rank sits in the mesh, as a checkpoint asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Seat {
    /// Its pipeline stage (0 without stages) and the number of stages.
    pub stage: usize,
    pub stages: usize,
    /// Its rank on the data axis and the data degree.
    pub data: usize,
    pub datas: usize,
    /// Its rank on the tensor axis (0 without tensor parallelism).
    pub tensor: usize,
}

/// How the ranks of a data group split a stage's tensors among them: in
/// groups of parameters (contiguous index ranges, in order, covering
/// every parameter once), each gathered whole by every rank of the group
/// together and kept by one of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Each group and the data rank that keeps it.
    pub groups: Vec<(Range<usize>, usize)>,
    /// ZeRO-3: a group is a unit, its parameters gathered with their
    /// state and written by its keeper; otherwise a group is a run of
    /// optimizer state and data rank 0 writes the parameters (whole on
    /// every rank).
    pub by_unit: bool,
    /// The data ranks that have files in the step: `0..writers`.
    pub writers: usize,
}

/// What one rank writes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Role {
    /// Whether it has files in the step (an optimizer part, and its model
    /// shards if it has tensors); false: it hands nothing.
    pub writes: bool,
    /// Its stage's parameters whose tensors it writes (indices, in order).
    pub params: Vec<usize>,
    /// Whether it writes the buffers (the first stage's data rank 0).
    pub buffers: bool,
    /// The parameters whose optimizer state it writes.
    pub state: Vec<usize>,
}

/// Which rank writes unit `u` of `units` at data degree `w`: contiguous
/// runs of units, so the shard files number in the model's order.
pub(crate) fn writer_of(u: usize, units: usize, w: usize) -> usize {
    u * w / units.max(1)
}

/// Each of `w` ranks' run of tensors of sizes `numels` (contiguous, in
/// order, about equal in elements: a tensor goes to the rank its first
/// element falls to); a run may be empty.
pub(crate) fn runs_by_size(numels: &[usize], w: usize) -> Vec<Range<usize>> {
    let total: usize = numels.iter().sum::<usize>().max(1);
    let mut runs = vec![0..0; w.max(1)];
    let mut start = 0usize;
    for (i, &n) in numels.iter().enumerate() {
        let q = (start * w / total).min(w.max(1) - 1);
        if runs[q].is_empty() {
            runs[q] = i..i;
        }
        runs[q].end = i + 1;
        start += n;
    }
    runs
}

/// How a stage's data group writes its tensors under ZeRO stage `zero`,
/// given its parameters' (whole) sizes `numels` and, under ZeRO-3, the
/// parameter ranges of its `units`:
/// - stage 3: every data rank writes its run of the units
///   ([`writer_of`]), parameters and optimizer state;
/// - stages 1 and 2 without pipeline stages (the state sharded over the
///   data axis): data rank 0 writes the parameters, every data rank the
///   optimizer state of its run ([`runs_by_size`]), gathered run by run;
/// - otherwise (stage 0; stages 1 and 2 within pipeline stages, gathered
///   whole): data rank 0 writes everything.
pub(crate) fn plan(seat: Seat, zero: u32, numels: &[usize], units: &[Range<usize>]) -> Plan {
    let w = seat.datas.max(1);
    if zero == 3 {
        let n = units.len();
        return Plan {
            groups: (units.iter().enumerate())
                .map(|(u, r)| (r.clone(), writer_of(u, n, w)))
                .collect(),
            by_unit: true,
            writers: w,
        };
    }
    let (groups, writers) = match zero {
        1 | 2 if seat.stages <= 1 && w > 1 => (
            runs_by_size(numels, w)
                .into_iter()
                .enumerate()
                .map(|(q, r)| (r, q))
                .collect(),
            w,
        ),
        _ => (vec![(0..numels.len(), 0)], 1),
    };
    Plan {
        groups,
        by_unit: false,
        writers,
    }
}

impl Plan {
    /// What the rank at `seat` writes: nothing on a tensor rank past 0
    /// (it takes part in gathering the whole tensors, which its tensor
    /// rank 0 writes) or a data rank past the writers.
    pub(crate) fn role(&self, seat: Seat) -> Role {
        if seat.tensor != 0 || seat.data >= self.writers {
            return Role::default();
        }
        let mine: Vec<usize> = (self.groups.iter())
            .filter(|(_, q)| *q == seat.data)
            .flat_map(|(r, _)| r.clone())
            .collect();
        let params = match (self.by_unit, seat.data) {
            (true, _) => mine.clone(),
            (false, 0) => (self.groups.iter()).flat_map(|(r, _)| r.clone()).collect(),
            (false, _) => Vec::new(),
        };
        Role {
            writes: true,
            params,
            buffers: seat.stage == 0 && seat.data == 0,
            state: mine,
        }
    }
}

/// A writer's place in the order of the step's files: its stage, then
/// its data rank.
pub(crate) fn place_code(seat: Seat) -> u64 {
    (seat.stage as u64) << 32 | seat.data as u64
}

/// A rank without files in the step.
pub(crate) const NO_PLACE: u64 = u64::MAX;

/// Where one writer's files fall among every writer's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Numbering {
    /// The index of its first model shard and the step's shard count.
    pub first: usize,
    pub total: usize,
    /// Its optimizer part and the step's part count (one per writer).
    pub part: usize,
    pub parts: usize,
}

/// Every rank's numbering from every rank's place code (in world rank
/// order; [`NO_PLACE`]: no files) and model shard count; None for a rank
/// without files. Files number in place order: stage by stage, data rank
/// by data rank.
pub(crate) fn numbering(places: &[u64], counts: &[u64]) -> Vec<Option<Numbering>> {
    let writing = || places.iter().zip(counts).filter(|(p, _)| **p != NO_PLACE);
    let total = writing().map(|(_, c)| *c as usize).sum();
    let parts = writing().count();
    places
        .iter()
        .map(|&me| {
            (me != NO_PLACE).then(|| {
                let before = || writing().filter(|(p, _)| **p < me);
                Numbering {
                    first: before().map(|(_, c)| *c as usize).sum(),
                    total,
                    part: before().count(),
                    parts,
                }
            })
        })
        .collect()
}

/// The world rank that begins and finishes the step: the first stage's
/// data rank 0 (tensor rank 0), holding the folder's lock.
pub(crate) fn finisher(places: &[u64]) -> Option<usize> {
    places.iter().position(|&p| p == 0)
}

/// Model shard `i` of a step of `total` shards: `model.safetensors` when
/// there is one in all, as a whole model's.
pub(crate) fn model_file(i: usize, total: usize) -> String {
    match total {
        1 => checkpoint::MODEL_FILE.to_string(),
        _ => shards::shard_name(i, total),
    }
}

/// Optimizer part `part` of `parts`: `optimizer.safetensors` when one
/// writer holds it all.
pub(crate) fn optimizer_file(part: usize, parts: usize) -> String {
    match parts {
        1 => checkpoint::OPTIMIZER_FILE.to_string(),
        _ => checkpoint::optimizer_part_name(part, parts),
    }
}

/// What a writer wrote, for the finisher's index and manifest.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Part {
    pub entries: Vec<Entry>,
    /// Tensor name -> its shard file.
    pub weight_map: Vec<(String, String)>,
    /// The tensors' bytes (the index's `total_size`).
    pub bytes: u64,
}

/// A writer's outcome as it crosses to the finisher: its part, or why not.
pub(crate) type Outcome = std::result::Result<Part, String>;

/// Every writer's part joined in place order, the step complete only when
/// each of the `writers` expected places reported success exactly once:
/// otherwise why not (the first failure, a missing or a repeated place),
/// and the folder must not be published.
pub(crate) fn complete(mut outcomes: Vec<(u64, Outcome)>, writers: usize) -> Result<Part, String> {
    outcomes.sort_by_key(|(p, _)| *p);
    if let Some(w) = outcomes.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(format!("place {:#x} reported twice", w[0].0));
    }
    if outcomes.len() != writers {
        return Err(format!("{} of {writers} writers reported", outcomes.len()));
    }
    let mut all = Part::default();
    for (i, (_, o)) in outcomes.into_iter().enumerate() {
        let p = o.map_err(|e| format!("part {i}: {e}"))?;
        all.entries.extend(p.entries);
        all.weight_map.extend(p.weight_map);
        all.bytes += p.bytes;
    }
    Ok(all)
}
