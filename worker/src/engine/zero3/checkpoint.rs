//! Checkpoints written by every rank (docs/SEMANTICS.md): ZeRO-3's (each
//! rank its run of the units), and ZeRO 1 and 2's (rank 0 the parameters,
//! every rank its run's optimizer state), never whole on one rank.

use crate::comm::collective::Collective;
use crate::engine::Engine;
use crate::error::{Error, Result, TorchContext};
use tch::Tensor;

/// Which rank writes unit `u` of `units` at world size `w`: contiguous
/// runs of units, so the shard files number in the model's order.
pub(in crate::engine) fn writer_of(u: usize, units: usize, w: usize) -> usize {
    u * w / units.max(1)
}

/// Each of `w` ranks' run of tensors of sizes `numels` (contiguous, in
/// order, about equal in elements: a tensor goes to the rank its first
/// element falls to); a run may be empty.
pub(in crate::engine) fn runs_by_size(numels: &[usize], w: usize) -> Vec<std::ops::Range<usize>> {
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

impl<C: Collective> Engine<C> {
    /// A ZeRO-3 checkpoint written by every rank, never whole on one
    /// (docs/SEMANTICS.md): rank r of a data group writes the whole
    /// tensors of its run of the units ([`writer_of`]) as shards of one
    /// Hugging Face checkpoint, and their optimizer state as an
    /// `optimizer-0000i-of-0000N` part; each unit is gathered once (every
    /// rank of the group takes part) and kept only by its writer. In
    /// pipeline stages each stage's data group writes its stage's units,
    /// the files numbered stage by stage. The first stage's data rank 0
    /// (holding the folder's lock) begins the step, writes the index, the
    /// trainer state and the other files, and publishes it under the
    /// usual rules (engine/pipe/checkpoint.rs); only names, sizes,
    /// checksums and outcomes cross the world.
    pub(in crate::engine) fn zero3_checkpoint(&mut self) -> Result<std::path::PathBuf> {
        let (w, r) = (self.collective.world_size(), self.collective.rank());
        let stage = self.pipe.as_ref().map_or(0, |p| p.stage);
        let units = match self.placement.strategy.param_shards() {
            Some(s) => s.layout_of_units(),
            None => return Err(Error::Sharding("a ZeRO-3 checkpoint below stage 3".into())),
        };
        let n = units.len();
        let state = self.placement.optimizer.first_state();
        let mut model: Vec<(String, Tensor)> = Vec::new();
        let mut opt: Vec<(String, Tensor)> = Vec::new();
        for (u, (_, params)) in units.iter().enumerate() {
            let mine = writer_of(u, n, w) == r;
            self.zero3_gather(&[u])?;
            if mine {
                for (name, t) in &self.model.params[params.clone()] {
                    model.push((name.clone(), t.f_detach_copy().ctx("copying a parameter")?));
                }
            }
            self.zero3_release(&[u])?;
            for (key, t) in &state {
                let whole = match self.placement.strategy.param_shards() {
                    Some(s) => s.gather_unit_of(t, u, &mut self.collective)?,
                    None => continue,
                };
                if !mine {
                    continue;
                }
                opt.extend(crate::engine::placement::views_by_name(
                    &self.model.params[params.clone()],
                    &whole,
                    key,
                )?);
            }
        }
        if r == 0 && stage == 0 {
            model.extend(
                self.model
                    .buffers
                    .iter()
                    .map(|(n, t)| (n.clone(), t.shallow_clone())),
            );
        }
        // Tensor parallelism: each unit's writer gathers its tensors whole
        // over its tensor ranks (the same units on each), and tensor rank
        // 0 writes them.
        let model = self.tensor_whole(model)?;
        let opt = self.tensor_whole(opt)?;
        if self.tensor_rank() != 0 {
            return self.checkpoint_by_ranks(Vec::new(), Vec::new());
        }
        self.checkpoint_by_ranks(model, opt)
    }

    /// ZeRO 1 and 2 without pipeline stages: rank 0 writes the parameters
    /// (whole on every rank) and the buffers; every rank writes the
    /// optimizer state of its run of the parameters ([`runs_by_size`]),
    /// gathered run by run, so no rank holds more than its run's state
    /// beside its own slice (where gathering the whole state on every
    /// rank would hold it all).
    pub(in crate::engine) fn sharded_checkpoint(&mut self) -> Result<std::path::PathBuf> {
        let (w, r) = (self.collective.world_size(), self.collective.rank());
        // The whole tensors' sizes: under tensor parallelism every tensor
        // rank then takes the same run.
        let split = self.model.tensor_split.as_ref();
        let numels: Vec<usize> = self
            .model
            .params
            .iter()
            .map(|(n, t)| {
                split
                    .and_then(|s| s.whole.get(n))
                    .map_or(t.numel(), |w| w.iter().product::<i64>() as usize)
            })
            .collect();
        let mut opt = Vec::new();
        for (q, run) in runs_by_size(&numels, w).into_iter().enumerate() {
            let state = self.optimizer_state_of(run)?;
            if q == r {
                opt = state;
            }
        }
        // Tensor parallelism: whole, gathered over the tensor ranks; tensor
        // rank 0 writes (engine/tensor.rs).
        let opt = self.tensor_whole(opt)?;
        let model = if r == 0 {
            let state = self.model_state();
            self.tensor_whole(state)?
        } else {
            Vec::new()
        };
        if self.tensor_rank() != 0 {
            return self.checkpoint_by_ranks(Vec::new(), Vec::new());
        }
        self.checkpoint_by_ranks(model, opt)
    }

    /// Writes the committed step from every rank's `model` tensors and
    /// `opt` state: the files numbered in the model's order (stage by
    /// stage, data rank by data rank); the first stage's data rank 0 (the
    /// writer, holding the folder's lock) begins the step, takes every
    /// rank's outcome and finishes it. Every rank returns the step
    /// folder's path, or the same failure.
    fn checkpoint_by_ranks(
        &mut self,
        model: Vec<(String, Tensor)>,
        opt: Vec<(String, Tensor)>,
    ) -> Result<std::path::PathBuf> {
        use crate::checkpoint::{self, shards as files};
        use crate::engine::pipe::checkpoint::{decode, encode, sizes, write_stage, Outcome};
        let r = self.collective.rank();
        let stage = self.pipe.as_ref().map_or(0, |p| p.stage);
        let step = self.state.step;
        let dir = self.checkpoint_dir.clone();
        // A tensor rank past 0 writes nothing (its tensor rank 0 writes the
        // whole tensors): no place.
        let silent = self.tensor_rank() != 0;
        let writer = r == 0 && stage == 0 && !silent;
        let max_shard = accrue_common::spec::shard_size_bytes(&self.spec.checkpoint.max_shard_size)
            .unwrap_or(u64::MAX);
        // (A rank without model tensors writes no shard.)
        let plan = match model.is_empty() {
            true => Vec::new(),
            false => files::plan(&sizes(&model)?, max_shard),
        };
        // Every rank's place (stage, data rank) and shard count, in world
        // rank order: the files number in the model's order (stage by
        // stage, data rank by data rank), the optimizer parts too.
        let place = if silent {
            u64::MAX
        } else {
            (stage as u64) << 32 | r as u64
        };
        let places = self.collective.world_gather_u64(place)?;
        let writers = places.iter().filter(|&&p| p != u64::MAX).count();
        let counts = self.collective.world_gather_u64(plan.len() as u64)?;
        let before = |p: u64| places.iter().zip(&counts).filter(move |(q, _)| **q < p);
        let first = before(place).map(|(_, c)| c).sum::<u64>() as usize;
        let total = counts.iter().sum::<u64>() as usize;
        let part = before(place).count();
        let root = places.iter().position(|&p| p == 0).ok_or_else(|| {
            Error::Sharding(format!("no rank holds stage 0's data rank 0: {places:?}"))
        })?;
        // The writer begins; every rank learns the temporary folder
        // (empty: the writer could not begin, and says why at the end).
        let began = if writer {
            if self.folder_lock.is_none() {
                self.take_folder_lock()?;
            }
            checkpoint::begin_step(&mut checkpoint::disk::Local, &dir, step, &self.owner).map(Some)
        } else {
            Ok(None)
        };
        let mut name = match &began {
            Ok(Some(tmp)) => tmp.to_string_lossy().into_owned().into_bytes(),
            _ => Vec::new(),
        };
        self.collective.world_broadcast_bytes(&mut name, root)?;
        let tmp = (!name.is_empty())
            .then(|| std::path::PathBuf::from(String::from_utf8_lossy(&name).into_owned()));
        let outcome: Outcome = match &tmp {
            Some(_) if silent => Ok(Default::default()),
            Some(tmp) => write_stage(tmp, &model, &plan, first, total, &opt, part, writers)
                .map_err(|e| e.to_string()),
            None => Err("the writer could not begin the step".into()),
        };
        drop((model, opt));
        // Every outcome to the writer, in the files' order.
        let mut parts = Vec::with_capacity(places.len());
        for (from, &at) in places.iter().enumerate() {
            let mut b = if at == place {
                encode(&outcome)?
            } else {
                Vec::new()
            };
            self.collective.world_broadcast_bytes(&mut b, from)?;
            if writer {
                parts.push((at, decode::<Outcome>(&b, from)?));
            }
        }
        parts.sort_by_key(|(p, _)| *p);
        let parts = parts.into_iter().map(|(_, o)| o).collect();
        let result = if writer {
            match (began, tmp) {
                (Ok(Some(_)), Some(tmp)) => self.finish_parts(&tmp, parts),
                (Err(e), _) => Err(e),
                _ => Err(Error::Sharding("the writer began no step".into())),
            }
        } else {
            Ok(dir.join(checkpoint::step_name(step)))
        };
        let mut done = encode(&match &result {
            Ok(_) => Ok(()),
            Err(e) => Err(format!("the writer's write failed: {e}")),
        })?;
        self.collective.world_broadcast_bytes(&mut done, root)?;
        let done: std::result::Result<(), String> = decode(&done, root)?;
        match done {
            Ok(()) => result,
            Err(reason) => Err(Error::Checkpoint { path: dir, reason }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::runs_by_size;

    #[test]
    fn runs_cover_the_tensors_in_order_by_size() {
        assert_eq!(runs_by_size(&[10, 10, 10, 10], 2), vec![0..2, 2..4]);
        // One large tensor first: it is rank 0's; the rest follow.
        assert_eq!(runs_by_size(&[90, 5, 5], 2), vec![0..1, 1..3]);
        assert_eq!(runs_by_size(&[1, 1], 4), vec![0..1, 0..0, 1..2, 0..0]);
        assert_eq!(runs_by_size(&[], 3), vec![0..0, 0..0, 0..0]);
        for w in 1..6 {
            let sizes = [3, 7, 1, 12, 5, 5, 9];
            let runs = runs_by_size(&sizes, w);
            let covered: Vec<usize> = runs.iter().flat_map(Clone::clone).collect();
            assert_eq!(covered, (0..sizes.len()).collect::<Vec<_>>(), "w = {w}");
        }
    }
}
