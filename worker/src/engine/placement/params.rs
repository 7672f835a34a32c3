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
//! **The shard** a rank owns is stage 1 and 2's: its slice of the flat
//! parameters, `shard::slice(total, W, r)` (the optimizer state's and the
//! reduce-scatter's layout too, so checkpoints and resumes are stage 1 and
//! 2's). A unit's range spans the slices of one or more ranks; gathering
//! it is an all-reduce of a buffer in which every rank writes the elements
//! it owns and `-0.0` elsewhere: `x + (-0.0) = x` for every float, signed
//! zeros included, so the sum is exactly the owner's values (a
//! reduce-scatter then an all-gather of the unit).
//!
//! **Whole** (every unit gathered, the shard possibly stale) is the state
//! the engine's other paths read and write parameters in: building,
//! `model.init`, a resume, a state broadcast, evaluation and checkpoints
//! ([`ParamShards::unshard`]). [`ParamShards::reshard`] takes the shard
//! from the whole parameters again (at the current layout: the world may
//! have changed) and releases every unit.

use super::{host_f32, host_f32_mut};
use crate::collective::Collective;
use crate::error::{Error, Result, TorchContext};
use crate::shard;
use std::ops::Range;
use tch::{Device, Kind, Tensor};

/// One unit: its parameters' range in the flat order and its storage.
struct Unit {
    /// Elements `flat` of the flat parameters (the model's order).
    flat: Range<usize>,
    /// The unit's parameters are views of this buffer.
    full: Tensor,
    gathered: bool,
}

/// Every parameter sharded over the data axis, held as this rank's flat
/// slice and gathered unit by unit (see the module documentation).
pub(in crate::engine) struct ParamShards {
    units: Vec<Unit>,
    /// This rank's slice of the flat parameters (what the optimizer
    /// steps); None while whole before the first reshard.
    owned: Option<Tensor>,
    /// The (world size, rank) `owned` is the slice of.
    layout: (usize, usize),
    total: usize,
}

impl ParamShards {
    /// Makes each unit's parameters views of one buffer holding their
    /// current values (whole: nothing is sharded until
    /// [`ParamShards::reshard`]). `units`: ranges of parameter indices,
    /// in order and covering every parameter.
    pub fn new(params: &[(String, Tensor)], units: &[Range<usize>]) -> Result<Self> {
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
            let len: usize = params[range.clone()].iter().map(|(_, t)| t.numel()).sum();
            let full =
                Tensor::f_empty([len as i64], (Kind::Float, Device::Cpu)).ctx("a unit's buffer")?;
            let mut off = 0i64;
            for (name, t) in &params[range.clone()] {
                if t.kind() != Kind::Float || t.device() != Device::Cpu {
                    return Err(Error::Sharding(format!(
                        "sharding.stage = 3 shards float32 parameters on the CPU; {name} is {:?} on {:?}",
                        t.kind(),
                        t.device()
                    )));
                }
                let n = t.numel() as i64;
                let view = full
                    .f_narrow(0, off, n)
                    .and_then(|v| v.f_view(t.size().as_slice()))
                    .ctx("a unit's parameter")?;
                view.shallow_clone().f_copy_(t).ctx("a unit's parameter")?;
                t.shallow_clone().set_data(&view);
                off += n;
            }
            out.push(Unit {
                flat: at..at + len,
                full,
                gathered: true,
            });
            at += len;
        }
        Ok(Self {
            units: out,
            owned: None,
            layout: (1, 0),
            total: at,
        })
    }

    /// Whether every unit is gathered (the parameters readable).
    pub fn is_whole(&self) -> bool {
        self.units.iter().all(|u| u.gathered)
    }

    /// This rank's slice of the flat parameters (what the optimizer
    /// steps in place).
    pub fn owned(&self) -> Result<Tensor> {
        self.owned
            .as_ref()
            .map(Tensor::shallow_clone)
            .ok_or_else(|| Error::Sharding("the parameters are not sharded yet".into()))
    }

    /// Gathers units `which` (each once; those gathered stay).
    pub fn gather<C: Collective>(&mut self, which: &[usize], c: &mut C) -> Result<()> {
        for &u in which {
            self.gather_one(u, c)?;
        }
        Ok(())
    }

    fn gather_one<C: Collective>(&mut self, u: usize, c: &mut C) -> Result<()> {
        let owned = self.owned()?;
        let total = self.total;
        let (w, r) = self.layout;
        let unit = self
            .units
            .get_mut(u)
            .ok_or_else(|| Error::Sharding(format!("no unit {u}")))?;
        if unit.gathered {
            return Ok(());
        }
        crate::storage::resize(&unit.full, unit.flat.len() * 4).ctx("gathering a unit")?;
        let buf = host_f32_mut(&unit.full)?;
        buf.fill(-0.0);
        // The elements of this unit this rank owns.
        let mine = shard::slice(total, w, r);
        let (a, b) = (mine.start.max(unit.flat.start), mine.end.min(unit.flat.end));
        if a < b {
            let src = host_f32(&owned)?;
            buf[a - unit.flat.start..b - unit.flat.start]
                .copy_from_slice(&src[a - mine.start..b - mine.start]);
        }
        c.reduce_scatter_sum(buf)?;
        c.all_gather(buf)?;
        // Only now: a gather a lost peer broke leaves the unit ungathered
        // (its storage allocated; the next gather fills it).
        unit.gathered = true;
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

    /// After an interrupted generation: units a forward or backward left
    /// gathered (or half gathered, a peer lost meanwhile) are released,
    /// so that every rank gathers each unit again (no collective). Whole
    /// parameters stay whole: they are all there.
    pub fn settle(&mut self) -> Result<()> {
        if self.is_whole() || self.owned.is_none() {
            return Ok(());
        }
        let all: Vec<usize> = (0..self.units.len()).collect();
        self.release(&all)
    }

    /// Whether this rank's parameters are usable at `layout` without
    /// anyone else's: whole, or sharded at exactly that layout.
    pub fn in_place(&self, layout: (usize, usize)) -> bool {
        self.is_whole() || (self.owned.is_some() && self.layout == layout)
    }

    /// Takes this rank's slice at `layout` from the whole parameters
    /// (they may have been written meanwhile) and releases every unit.
    pub fn reshard(&mut self, layout: (usize, usize)) -> Result<()> {
        if !self.is_whole() {
            return Err(Error::Sharding(
                "resharding needs every unit gathered".into(),
            ));
        }
        let s = shard::slice(self.total, layout.0, layout.1);
        let mut mine = vec![0f32; s.len()];
        for unit in &self.units {
            let (a, b) = (s.start.max(unit.flat.start), s.end.min(unit.flat.end));
            if a < b {
                let src = host_f32(&unit.full)?;
                mine[a - s.start..b - s.start]
                    .copy_from_slice(&src[a - unit.flat.start..b - unit.flat.start]);
            }
        }
        self.owned = Some(Tensor::f_from_slice(&mine).ctx("this rank's parameter shard")?);
        self.layout = layout;
        let all: Vec<usize> = (0..self.units.len()).collect();
        self.release(&all)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::SingleRank;

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
        let mut s = ParamShards::new(&ps, &[0..2, 2..3]).unwrap();
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
        // The signed zero comes back as it was.
        let b = Vec::<f32>::try_from(&ps[1].1).unwrap();
        assert!(b.iter().all(|x| *x == 0.0 && x.is_sign_negative()));
        s.release(&[0]).unwrap();
        s.unshard(&mut c).unwrap();
        assert_eq!(Vec::<f32>::try_from(&ps[2].1).unwrap(), vec![2.5; 4]);
    }

    #[test]
    fn units_must_cover_every_parameter_in_order() {
        let e = ParamShards::new(&params(), &[0..1, 2..3])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("3 parameters"), "{e}");
    }
}
