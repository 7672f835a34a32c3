//! ZeRO-3's parameters (issue 41): every parameter sharded over the data
//! axis, gathered unit by unit for the forward and the backward.
//!
//! **Units** are the family's blocks (a Llama's embedding, each decoder
//! layer, the final norm with the head; an mlp's layers). A unit's
//! parameters are views of one flat float32 buffer, the unit's storage;
//! between uses that storage is resized to 0 bytes
//! ([`crate::storage::resize`], FSDP's `untyped_storage().resize_(0)`),
//! which frees the memory under the parameters *and* under every view the
//! forward's graph saved of them. Gathering resizes it back and fills it,
//! so the backward finds the same values through the same views.
//!
//! **The shard** a rank owns is, in every unit, the unit's chunk r of W
//! (`shard::slice(unit length, W, r)`, the ring's reduce-scatter and
//! all-gather layout): gathering a unit is one all-gather, and reducing
//! its gradients one reduce-scatter that leaves each rank exactly its
//! chunk. `owned` is the rank's chunks of every unit, in unit order: what
//! the optimizer steps, with its state in the same layout.
//!
//! **Gradients by unit** (`sync = "every_step"`): each unit's `.grad`s are
//! views of a unit gradient buffer, released the same way; it is zeroed
//! before the unit's backward and reduce-scattered and released after it,
//! so only the units in flight hold gradients.
//!
//! **Whole** (every unit gathered, the shard possibly stale) is the state
//! the engine's other paths read and write parameters in: building,
//! `model.init`, a resume, evaluation and checkpoints
//! ([`ParamShards::unshard`]). [`ParamShards::reshard`] takes the shard
//! from the whole parameters again (at the current layout: the world may
//! have changed) and releases every unit.

use super::{host_f32, host_f32_mut};
use crate::comm::collective::Collective;
use crate::comm::shard;
use crate::error::{Error, Result, TorchContext};
use std::ops::Range;
use tch::{Device, Kind, Tensor};

/// One unit: its parameters' range in the flat order and its storage.
struct Unit {
    /// Parameters `params` of the model (indices).
    params: Range<usize>,
    /// Elements `flat` of the flat parameters (the model's order).
    flat: Range<usize>,
    /// The unit's parameters are views of this buffer.
    full: Tensor,
    gathered: bool,
    /// Gradients by unit: the parameters' `.grad`s are views of this.
    grad: Option<Tensor>,
    grad_open: bool,
}

impl Unit {
    fn len(&self) -> usize {
        self.flat.len()
    }
}

/// Every parameter sharded over the data axis, held as this rank's chunk
/// of each unit and gathered unit by unit (see the module documentation).
pub(in crate::engine) struct ParamShards {
    units: Vec<Unit>,
    /// This rank's chunk of every unit, in unit order (what the optimizer
    /// steps); None while whole before the first reshard.
    owned: Option<Tensor>,
    /// The (world size, rank) `owned` is the chunks of.
    layout: (usize, usize),
}

/// Makes `params` views of `buf` (their `.data`, or with `grads` their
/// `.grad`s), copying their values in first with `values`.
fn point_at(params: &[(String, Tensor)], buf: &Tensor, grads: bool, values: bool) -> Result<()> {
    let mut off = 0i64;
    for (_, t) in params {
        let n = t.numel() as i64;
        let view = buf
            .f_narrow(0, off, n)
            .and_then(|v| v.f_view(t.size().as_slice()))
            .ctx("a unit's view")?;
        if grads {
            crate::storage::set_grad(t, &view).ctx("a unit's gradient view")?;
        } else if values {
            view.shallow_clone().f_copy_(t).ctx("a unit's parameter")?;
            t.shallow_clone().set_data(&view);
        } else {
            t.shallow_clone().set_data(&view);
        }
        off += n;
    }
    Ok(())
}

impl ParamShards {
    /// Makes each unit's parameters views of one buffer holding their
    /// current values (whole: nothing is sharded until
    /// [`ParamShards::reshard`]). `units`: ranges of parameter indices,
    /// in order and covering every parameter. `by_unit`: their gradients
    /// too, by unit (every `.grad` must be defined).
    pub fn new(params: &[(String, Tensor)], units: &[Range<usize>], by_unit: bool) -> Result<Self> {
        Self::make(params, units, by_unit, true)
    }

    /// [`ParamShards::new`]; `whole`: the parameters hold their values
    /// (copied into the units, which start gathered), else their storage
    /// is released already (the units start released).
    fn make(
        params: &[(String, Tensor)],
        units: &[Range<usize>],
        by_unit: bool,
        whole: bool,
    ) -> Result<Self> {
        let covered: Vec<usize> = units.iter().flat_map(Clone::clone).collect();
        if covered != (0..params.len()).collect::<Vec<_>>() {
            return Err(Error::Sharding(format!(
                "sharding.stage = 3 needs the model's blocks to hold its {} parameters in order, each once; they hold {covered:?}",
                params.len()
            )));
        }
        let _guard = tch::no_grad_guard();
        let mut out = Vec::with_capacity(units.len());
        let mut at = 0;
        for range in units {
            let ps = &params[range.clone()];
            if let Some((name, t)) = ps
                .iter()
                .find(|(_, t)| t.kind() != Kind::Float || t.device() != Device::Cpu)
            {
                return Err(Error::Sharding(format!(
                    "sharding.stage = 3 shards float32 parameters on the CPU; {name} is {:?} on {:?}",
                    t.kind(),
                    t.device()
                )));
            }
            let len: usize = ps.iter().map(|(_, t)| t.numel()).sum();
            let full =
                Tensor::f_empty([len as i64], (Kind::Float, Device::Cpu)).ctx("a unit's buffer")?;
            point_at(ps, &full, false, whole)?;
            if !whole {
                // (Views are made of allocated storage, then released.)
                crate::storage::resize(&full, 0).ctx("a unit's buffer")?;
            }
            let grad = if by_unit {
                let g = Tensor::f_zeros([len as i64], (Kind::Float, Device::Cpu))
                    .ctx("a unit's gradient buffer")?;
                point_at(ps, &g, true, false)?;
                crate::storage::resize(&g, 0).ctx("releasing a unit's gradients")?;
                Some(g)
            } else {
                None
            };
            out.push(Unit {
                params: range.clone(),
                flat: at..at + len,
                full,
                gathered: whole,
                grad,
                grad_open: false,
            });
            at += len;
        }
        Ok(Self {
            units: out,
            owned: None,
            layout: (1, 0),
        })
    }

    /// ZeRO-3's build ([`crate::family::model::Model::build_sharded`]):
    /// the parameters' storage is released already and this rank's chunks
    /// at `layout` are `owned` ([`ShardTaker`]). The units start released.
    pub fn from_built(
        params: &[(String, Tensor)],
        units: &[Range<usize>],
        by_unit: bool,
        owned: Tensor,
        layout: (usize, usize),
    ) -> Result<Self> {
        let mut s = Self::make(params, units, by_unit, false)?;
        s.set_owned(owned, layout)?;
        Ok(s)
    }

    /// This rank's chunks at `layout` given whole (the sharded build or a
    /// resume took them); every unit released.
    pub fn set_owned(&mut self, owned: Tensor, layout: (usize, usize)) -> Result<()> {
        if owned.numel() != self.owned_len(layout) {
            return Err(Error::Sharding(format!(
                "{} elements of the parameters taken for rank {} of {}, which owns {}",
                owned.numel(),
                layout.1,
                layout.0,
                self.owned_len(layout)
            )));
        }
        self.owned = Some(owned);
        self.layout = layout;
        let all: Vec<usize> = (0..self.units.len()).collect();
        self.release(&all)
    }

    /// Whether every unit is gathered (the parameters readable).
    pub fn is_whole(&self) -> bool {
        self.units.iter().all(|u| u.gathered)
    }

    /// Whether gradients are kept by unit (`sync = "every_step"`).
    pub fn by_unit(&self) -> bool {
        self.units.first().is_some_and(|u| u.grad.is_some())
    }

    /// Unit `u`'s chunk this rank owns, within the unit.
    fn mine(&self, u: usize) -> Range<usize> {
        self.mine_at(u, self.layout)
    }

    fn mine_at(&self, u: usize, layout: (usize, usize)) -> Range<usize> {
        shard::slice(self.units[u].len(), layout.0, layout.1)
    }

    /// Where unit `u`'s chunk lies in `owned`.
    fn owned_range(&self, u: usize) -> Range<usize> {
        self.owned_range_at(u, self.layout)
    }

    fn owned_range_at(&self, u: usize, layout: (usize, usize)) -> Range<usize> {
        let at: usize = (0..u).map(|v| self.mine_at(v, layout).len()).sum();
        at..at + self.mine_at(u, layout).len()
    }

    /// Elements this rank owns at `layout` (the optimizer's slice).
    pub fn owned_len(&self, layout: (usize, usize)) -> usize {
        self.units
            .iter()
            .map(|u| shard::slice(u.len(), layout.0, layout.1).len())
            .sum()
    }

    /// This rank's chunks (what the optimizer steps in place).
    pub fn owned(&self) -> Result<Tensor> {
        self.owned
            .as_ref()
            .map(Tensor::shallow_clone)
            .ok_or_else(|| Error::Sharding("the parameters are not sharded yet".into()))
    }

    /// The flat parameter ranges and parameter ranges of every unit.
    pub fn layout_of_units(&self) -> Vec<(Range<usize>, Range<usize>)> {
        self.units
            .iter()
            .map(|u| (u.flat.clone(), u.params.clone()))
            .collect()
    }

    /// Gathers units `which` (each once; those gathered stay).
    pub fn gather<C: Collective>(&mut self, which: &[usize], c: &mut C) -> Result<()> {
        for &u in which {
            self.gather_one(u, c)?;
        }
        Ok(())
    }

    fn gather_one<C: Collective>(&mut self, u: usize, c: &mut C) -> Result<()> {
        if self.units.get(u).is_none_or(|x| x.gathered) {
            return Ok(());
        }
        let owned = self.owned()?;
        let full = &self.units[u].full;
        crate::storage::resize(full, self.units[u].len() * 4).ctx("gathering a unit")?;
        self.gather_into(host_f32_mut(full)?, host_f32(&owned)?, u, self.layout, c)?;
        // Only now: a gather a lost peer broke leaves the unit ungathered
        // (its storage allocated; the next gather fills it).
        self.units[u].gathered = true;
        Ok(())
    }

    /// Releases units `which` (their storage to 0 bytes).
    pub fn release(&mut self, which: &[usize]) -> Result<()> {
        for &u in which {
            if let Some(unit) = self.units.get_mut(u).filter(|u| u.gathered) {
                crate::storage::resize(&unit.full, 0).ctx("releasing a unit")?;
                unit.gathered = false;
            }
        }
        Ok(())
    }

    /// Gradients by unit: zeroed buffers under units `which` (those open
    /// stay as they are).
    pub fn open_grads(&mut self, which: &[usize]) -> Result<()> {
        for &u in which {
            let Some(unit) = self.units.get_mut(u).filter(|u| !u.grad_open) else {
                continue;
            };
            if let Some(g) = &unit.grad {
                crate::storage::resize(g, unit.flat.len() * 4).ctx("a unit's gradients")?;
                host_f32_mut(g)?.fill(0.0);
                unit.grad_open = true;
            }
        }
        Ok(())
    }

    /// Gradients by unit: reduce-scatters unit `u`'s gradients (zeros
    /// when not open: a micro-step without a backward), adds this rank's
    /// chunk into `sum` (owned's layout), and releases them.
    pub fn reduce_grads<C: Collective>(&mut self, u: usize, c: &mut C, sum: &Tensor) -> Result<()> {
        let (mine, at) = (self.mine(u), self.owned_range(u));
        let unit = &mut self.units[u];
        let Some(g) = &unit.grad else {
            return Err(Error::Sharding("gradients are not kept by unit".into()));
        };
        if !unit.grad_open {
            crate::storage::resize(g, unit.flat.len() * 4).ctx("a unit's gradients")?;
            host_f32_mut(g)?.fill(0.0);
        }
        let buf = host_f32_mut(g)?;
        c.reduce_scatter_sum(buf)?;
        let acc = &mut host_f32_mut(sum)?[at];
        for (a, b) in acc.iter_mut().zip(&buf[mine]) {
            *a += *b;
        }
        crate::storage::resize(g, 0).ctx("releasing a unit's gradients")?;
        unit.grad_open = false;
        Ok(())
    }

    /// After an interrupted generation: units a forward or backward left
    /// gathered (or half gathered, a peer lost meanwhile) are released,
    /// and gradients left open too, so that every rank starts each unit
    /// afresh (no collective). Whole parameters stay whole: they are all
    /// there.
    pub fn settle(&mut self) -> Result<()> {
        for unit in &mut self.units {
            if let (Some(g), true) = (&unit.grad, unit.grad_open) {
                crate::storage::resize(g, 0).ctx("releasing a unit's gradients")?;
                unit.grad_open = false;
            }
        }
        if self.is_whole() || self.owned.is_none() {
            return Ok(());
        }
        let all: Vec<usize> = (0..self.units.len()).collect();
        self.release(&all)
    }

    /// Every unit gathered: the parameters are whole and readable.
    /// Returns whether anything was sharded.
    pub fn unshard<C: Collective>(&mut self, c: &mut C) -> Result<bool> {
        if self.is_whole() {
            return Ok(false);
        }
        let all: Vec<usize> = (0..self.units.len()).collect();
        self.gather(&all, c)?;
        Ok(true)
    }

    /// Every unit's storage allocated again *without* gathering (no
    /// collective): for a caller that writes every parameter next (a
    /// resume, a fresh initialisation). The values are NaN until then.
    /// Returns whether anything was sharded.
    pub fn unshard_local(&mut self) -> Result<bool> {
        let mut any = false;
        for unit in self.units.iter_mut().filter(|u| !u.gathered) {
            crate::storage::resize(&unit.full, unit.flat.len() * 4).ctx("allocating a unit")?;
            host_f32_mut(&unit.full)?.fill(f32::NAN);
            unit.gathered = true;
            any = true;
        }
        Ok(any)
    }

    /// Whether this rank's parameters are usable at `layout` without
    /// anyone else's: whole, or sharded at exactly that layout.
    pub fn in_place(&self, layout: (usize, usize)) -> bool {
        self.is_whole() || (self.owned.is_some() && self.layout == layout)
    }

    /// Takes this rank's chunks at `layout` from the whole parameters
    /// (they may have been written meanwhile) and releases every unit.
    pub fn reshard(&mut self, layout: (usize, usize)) -> Result<()> {
        if !self.is_whole() {
            return Err(Error::Sharding(
                "resharding needs every unit gathered".into(),
            ));
        }
        self.layout = layout;
        let mut mine = Vec::with_capacity(self.owned_len(layout));
        for (u, unit) in self.units.iter().enumerate() {
            let r = shard::slice(unit.len(), layout.0, layout.1);
            debug_assert_eq!(mine.len(), self.owned_range(u).start);
            mine.extend_from_slice(&host_f32(&unit.full)?[r]);
        }
        self.owned = Some(Tensor::f_from_slice(&mine).ctx("this rank's parameter shard")?);
        let all: Vec<usize> = (0..self.units.len()).collect();
        self.release(&all)
    }

    /// A whole flat tensor (the flat parameters' layout) of every unit's
    /// chunks at `c`'s layout, gathered unit by unit: `part` is this
    /// rank's (the optimizer state).
    pub fn gather_flat<C: Collective>(&self, part: &Tensor, c: &mut C) -> Result<Tensor> {
        let units: Vec<Tensor> = (0..self.units.len())
            .map(|u| self.gather_unit_of(part, u, c))
            .collect::<Result<_>>()?;
        Tensor::f_cat(&units, 0).ctx("gathering state")
    }

    /// Unit `u` into `buf` (its length): this rank's chunk at `layout`
    /// from `src` (`owned`'s order), every other rank's all-gathered.
    fn gather_into<C: Collective>(
        &self,
        buf: &mut [f32],
        src: &[f32],
        u: usize,
        layout: (usize, usize),
        c: &mut C,
    ) -> Result<()> {
        buf[self.mine_at(u, layout)].copy_from_slice(&src[self.owned_range_at(u, layout)]);
        Ok(c.all_gather(buf)?)
    }

    /// Unit `u`'s whole values of `part` (this rank's chunks in
    /// `owned`'s layout at `c`'s: the optimizer state), all-gathered.
    pub fn gather_unit_of<C: Collective>(
        &self,
        part: &Tensor,
        u: usize,
        c: &mut C,
    ) -> Result<Tensor> {
        let layout = (c.world_size(), c.rank());
        let unit = &self.units[u];
        let whole = Tensor::f_zeros([unit.len() as i64], (Kind::Float, Device::Cpu))
            .ctx("gathering state")?;
        self.gather_into(host_f32_mut(&whole)?, host_f32(part)?, u, layout, c)?;
        Ok(whole)
    }

    /// This rank's chunks at `layout`, in `owned`'s order, of a whole
    /// flat vector (the flat parameters' layout).
    pub fn chunks_of(&self, whole: &[f32], layout: (usize, usize)) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.owned_len(layout));
        for (u, unit) in self.units.iter().enumerate() {
            let r = self.mine_at(u, layout);
            out.extend_from_slice(&whole[unit.flat.start + r.start..unit.flat.start + r.end]);
        }
        out
    }

    /// This rank's chunks at `layout` of the flat buffer `flat` after a
    /// reduce-scatter of each unit's range.
    pub fn chunks_of_tensor(&self, flat: &Tensor, layout: (usize, usize)) -> Result<Tensor> {
        let v = self.chunks_of(host_f32(flat)?, layout);
        Tensor::f_from_slice(&v).ctx("this rank's gradient chunks")
    }
}

/// What ZeRO-3's build takes of each parameter as the family makes it
/// ([`crate::family::model::Take`]): the parameter's part of this rank's
/// chunk of its unit, copied into `owned`'s layout.
pub(in crate::engine) struct ShardTaker {
    /// Each parameter: (its unit's chunk at `layout` within the unit, the
    /// parameter's range within the unit, where the chunk starts in
    /// `owned`), by name.
    places: std::collections::HashMap<String, (Range<usize>, Range<usize>, usize)>,
    owned: Vec<f32>,
}

impl ShardTaker {
    /// For parameters `names` with `numels` (the model's order) in
    /// `units` (ranges of parameter indices), rank `layout.1` of
    /// `layout.0`.
    pub fn new(
        names: &[String],
        numels: &[usize],
        units: &[Range<usize>],
        layout: (usize, usize),
    ) -> Self {
        let mut places = std::collections::HashMap::new();
        let mut at = 0;
        for range in units {
            let len: usize = numels[range.clone()].iter().sum();
            let chunk = shard::slice(len, layout.0, layout.1);
            let mut off = 0;
            for i in range.clone() {
                places.insert(names[i].clone(), (chunk.clone(), off..off + numels[i], at));
                off += numels[i];
            }
            at += chunk.len();
        }
        Self {
            places,
            owned: vec![0.0; at],
        }
    }

    /// Takes parameter `name`'s part of this rank's chunk (of any float
    /// kind: reading only that part of `t`).
    pub fn take(&mut self, name: &str, t: &Tensor) -> Result<()> {
        let (chunk, within, at) = self.places.get(name).cloned().ok_or_else(|| {
            Error::Sharding(format!("the build made {name}, which no block holds"))
        })?;
        let (a, b) = (chunk.start.max(within.start), chunk.end.min(within.end));
        if a >= b {
            return Ok(());
        }
        let flat = t
            .f_detach()
            .and_then(|v| v.f_reshape([-1]))
            .and_then(|v| v.f_narrow(0, (a - within.start) as i64, (b - a) as i64))
            .and_then(|v| v.f_to_kind(Kind::Float))
            .and_then(|v| v.f_contiguous())
            .ctx("taking a parameter's chunk")?;
        let dst = at + (a - chunk.start);
        self.owned[dst..dst + (b - a)].copy_from_slice(host_f32(&flat)?);
        Ok(())
    }

    /// The chunks taken, as `owned`.
    pub fn finish(self) -> Result<Tensor> {
        Tensor::f_from_slice(&self.owned).ctx("this rank's parameter shard")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::collective::SingleRank;

    fn params() -> Vec<(String, Tensor)> {
        let t = |n: i64, v: f64| Tensor::full([n], v, (Kind::Float, Device::Cpu));
        vec![
            ("a".into(), t(3, 1.0)),
            ("b".into(), t(2, -0.0)),
            ("c".into(), t(4, 2.5)),
        ]
    }

    #[test]
    fn units_round_trip_through_the_shard_and_release_their_storage() {
        let ps = params();
        let mut s = ParamShards::new(&ps, &[0..2, 2..3], false).unwrap();
        assert!(s.is_whole());
        s.reshard((1, 0)).unwrap();
        assert!(!s.is_whole());
        // Released: the parameters' storage holds nothing.
        assert_eq!(crate::storage::nbytes(&ps[0].1), Some(0));
        assert_eq!(s.owned().unwrap().numel(), 9);
        let mut c = SingleRank;
        s.gather(&[0], &mut c).unwrap();
        assert_eq!(crate::storage::nbytes(&ps[0].1), Some(5 * 4));
        assert_eq!(Vec::<f32>::try_from(&ps[0].1).unwrap(), vec![1.0; 3]);
        let b = Vec::<f32>::try_from(&ps[1].1).unwrap();
        assert!(b.iter().all(|x| *x == 0.0 && x.is_sign_negative()));
        s.release(&[0]).unwrap();
        s.unshard(&mut c).unwrap();
        assert_eq!(Vec::<f32>::try_from(&ps[2].1).unwrap(), vec![2.5; 4]);
    }

    #[test]
    fn each_unit_is_chunked_over_the_ranks() {
        let ps = params();
        let mut s = ParamShards::new(&ps, &[0..2, 2..3], false).unwrap();
        // Rank 1 of 2: chunk 1 of unit 0 (5 elements: 3..5) and of unit 1
        // (4 elements: 2..4).
        s.reshard((2, 1)).unwrap();
        assert_eq!(s.owned_len((2, 1)), 4);
        assert_eq!(
            Vec::<f32>::try_from(&s.owned().unwrap()).unwrap(),
            vec![-0.0, -0.0, 2.5, 2.5]
        );
        let whole: Vec<f32> = (0..9).map(|i| i as f32).collect();
        assert_eq!(s.chunks_of(&whole, (2, 1)), vec![3.0, 4.0, 7.0, 8.0]);
    }

    #[test]
    fn units_must_cover_every_parameter_in_order() {
        let e = ParamShards::new(&params(), &[0..1, 2..3], false)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("3 parameters"), "{e}");
    }
}
