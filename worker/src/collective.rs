//! The communication interface the engine's sync step is written against.
//! The single-rank implementation is the identity; the TCP ring
//! (`comm::TcpRing`) implements the same trait, so the loop does not change.
//! Buffers are passed as `Vec`s so an implementation can hand them to its
//! communication thread and back without copying.

use crate::error::Result;

pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Element-wise sum over all ranks, in place, on a flat f32 buffer of
    /// the same length on every rank.
    fn all_reduce_sum(&mut self, buf: &mut Vec<f32>) -> Result<()>;
    /// Copies `root`'s buffer into every rank's buffer.
    fn broadcast(&mut self, buf: &mut Vec<f32>, root: usize) -> Result<()>;
    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<()>;
    /// Bytes (sent, received) on the wire so far, framing included.
    fn bytes(&self) -> (u64, u64) {
        (0, 0)
    }
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
    fn all_reduce_sum(&mut self, _buf: &mut Vec<f32>) -> Result<()> {
        Ok(())
    }
    fn broadcast(&mut self, _buf: &mut Vec<f32>, _root: usize) -> Result<()> {
        Ok(())
    }
    fn barrier(&mut self) -> Result<()> {
        Ok(())
    }
}
