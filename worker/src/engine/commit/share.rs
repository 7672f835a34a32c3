//! What this rank hands to a checkpoint ([`Share`]): the tensors its
//! [`Role`](super::plan::Role) says it writes, gathered whole. Every rank
//! of a data group walks the plan's groups together (a gather under
//! sharding is a collective) and keeps its own; every tensor rank gathers
//! its tensors whole over the tensor group, and tensor rank 0 keeps them.

use super::plan::{self, Plan, Seat, NO_PLACE};
use crate::comm::collective::Collective;
use crate::engine::placement::views_by_name;
use crate::engine::Engine;
use crate::error::{Error, Result, TorchContext};
use crate::family::Named;
use crate::spec::Axis;
use std::ops::Range;

/// One rank's part of a checkpoint: its place in the step's files
/// ([`plan::place_code`]; [`NO_PLACE`]: it writes nothing) and the model
/// tensors and optimizer state it writes there, by name.
pub(in crate::engine) struct Share {
    pub place: u64,
    pub model: Named,
    pub opt: Named,
}

impl<C: Collective> Engine<C> {
    /// This rank's seat in the mesh.
    fn seat(&self) -> Seat {
        let m = &self.mesh;
        Seat {
            stage: m.coord(Axis::Pipeline),
            stages: m.degree(Axis::Pipeline),
            data: m.coord(Axis::Data),
            datas: m.degree(Axis::Data),
            tensor: m.tensor_rank(),
        }
    }

    /// The tensors this rank contributes to the committed step (every
    /// rank calls it: gathering them takes the whole data and tensor
    /// groups).
    pub(in crate::engine) fn checkpoint_share(&mut self) -> Result<Share> {
        let seat = self.seat();
        // The whole tensors' sizes: under tensor parallelism every tensor
        // rank then takes the same run.
        let split = self.model.tensor_split.as_ref();
        let numels: Vec<usize> = (self.model.params.iter())
            .map(|(n, t)| {
                split
                    .and_then(|s| s.whole.get(n))
                    .map_or(t.numel(), |w| w.iter().product::<i64>() as usize)
            })
            .collect();
        let units: Vec<Range<usize>> = match self.placement.strategy.param_shards() {
            Some(s) => s.layout_of_units().into_iter().map(|(_, p)| p).collect(),
            None => Vec::new(),
        };
        let plan = plan::plan(seat, self.placement.strategy.stage(), &numels, &units);
        // What this rank's tensor group keeps (tensor rank 0 writes it).
        let keep = plan.role(Seat { tensor: 0, ..seat });
        let (mut model, opt) = match plan.by_unit {
            true => self.unit_tensors(&plan, seat.data)?,
            false => (
                keep.params
                    .iter()
                    .map(|&i| {
                        let (n, t) = &self.model.params[i];
                        (n.clone(), t.shallow_clone())
                    })
                    .collect(),
                self.run_state(&plan, seat.data)?,
            ),
        };
        if keep.buffers {
            model.extend((self.model.buffers.iter()).map(|(n, t)| (n.clone(), t.shallow_clone())));
        }
        // Tensor parallelism: whole, gathered over the tensor ranks
        // (engine/tensor.rs); tensor rank 0 writes them.
        let opt = self.tensor_whole(opt)?;
        let model = self.tensor_whole(model)?;
        Ok(match seat.tensor == 0 && keep.writes {
            true => Share {
                place: plan::place_code(seat),
                model,
                opt,
            },
            false => Share {
                place: NO_PLACE,
                model: Vec::new(),
                opt: Vec::new(),
            },
        })
    }

    /// The optimizer state of `plan`'s runs this data rank keeps, each run
    /// gathered by every rank (so no rank holds more than its run's state
    /// beside its own slice).
    fn run_state(&mut self, plan: &Plan, data: usize) -> Result<Named> {
        let mut opt = Vec::new();
        let all = 0..self.model.params.len();
        for (run, keeper) in &plan.groups {
            // One run of every parameter: the whole state in one gather.
            let state = match *run == all {
                true => self.optimizer_state()?,
                false => self.optimizer_state_of(run.clone())?,
            };
            if *keeper == data {
                opt.extend(state);
            }
        }
        Ok(opt)
    }

    /// ZeRO-3: the parameters and optimizer state of the units this data
    /// rank keeps, each unit gathered once (every rank of the group takes
    /// part) and copied only by its keeper.
    fn unit_tensors(&mut self, plan: &Plan, data: usize) -> Result<(Named, Named)> {
        let state = self.placement.optimizer.first_state();
        let (mut model, mut opt) = (Vec::new(), Vec::new());
        for (u, (params, keeper)) in plan.groups.iter().enumerate() {
            let mine = *keeper == data;
            self.zero3_gather(&[u])?;
            if mine {
                for (name, t) in &self.model.params[params.clone()] {
                    model.push((name.clone(), t.f_detach_copy().ctx("copying a parameter")?));
                }
            }
            self.zero3_release(&[u])?;
            for (key, t) in &state {
                let shards =
                    self.placement.strategy.param_shards().ok_or_else(|| {
                        Error::Sharding("a ZeRO-3 checkpoint below stage 3".into())
                    })?;
                let whole = shards.gather_unit_of(t, u, &mut self.collective)?;
                if mine {
                    opt.extend(views_by_name(
                        &self.model.params[params.clone()],
                        &whole,
                        key,
                    )?);
                }
            }
        }
        Ok((model, opt))
    }
}
