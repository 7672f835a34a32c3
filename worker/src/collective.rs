//! The communication interface the engine's sync step is written against.
//! The single-rank implementation is the identity; the ring all-reduce of the
//! data-plane issue implements the same trait, so the loop does not change.

use crate::error::Result;

pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Element-wise sum over all ranks, in place, on a flat f32 buffer.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()>;
    /// Copies `root`'s buffer into every rank's buffer.
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<()>;
    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<()>;
}

/// W = 1: every collective is the identity.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleRank;

impl Collective for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&mut self, _buf: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn broadcast(&mut self, _buf: &mut [f32], _root: usize) -> Result<()> {
        Ok(())
    }
    fn barrier(&mut self) -> Result<()> {
        Ok(())
    }
}
