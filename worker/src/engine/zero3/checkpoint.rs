//! ZeRO-3's checkpoints, written by every rank (docs/SEMANTICS.md).

use crate::collective::Collective;
use crate::engine::Engine;
use crate::error::{Error, Result, TorchContext};
use tch::Tensor;

/// Which rank writes unit `u` of `units` at world size `w`: contiguous
/// runs of units, so the shard files number in the model's order.
pub(in crate::engine) fn writer_of(u: usize, units: usize, w: usize) -> usize {
    u * w / units.max(1)
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
        use crate::checkpoint::{self, shards as files};
        use crate::engine::pipe::checkpoint::{decode, encode, sizes, write_stage, Outcome};
        let (w, r) = (self.collective.world_size(), self.collective.rank());
        let stage = self.pipe.as_ref().map_or(0, |p| p.stage);
        let step = self.state.step;
        let dir = self.checkpoint_dir.clone();
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
        let writer = r == 0 && stage == 0;
        if writer {
            model.extend(
                self.model
                    .buffers
                    .iter()
                    .map(|(n, t)| (n.clone(), t.shallow_clone())),
            );
        }
        let max_shard = accrue_common::spec::shard_size_bytes(&self.spec.checkpoint.max_shard_size)
            .unwrap_or(u64::MAX);
        let plan = files::plan(&sizes(&model)?, max_shard);
        // Every rank's place (stage, data rank) and shard count, in world
        // rank order: the files number in the model's order (stage by
        // stage, data rank by data rank), the optimizer parts too.
        let place = (stage as u64) << 32 | r as u64;
        let places = self.collective.world_gather_u64(place)?;
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
            Some(tmp) => write_stage(tmp, &model, &plan, first, total, &opt, part, places.len())
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
