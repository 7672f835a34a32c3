//! The communication interface the engine's sync step is written against.
//! The single-rank implementation is the identity; the TCP ring
//! (`comm::TcpRing`) implements the same trait, so the loop does not change.
//! Buffers are passed as `Vec`s so an implementation can hand them to its
//! communication thread and back without copying; the gradient buckets of
//! the sync step go through [`Collective::all_reduce_buckets`], which works
//! in place on the engine's flat gradient buffer (no copy at all on CPU).
//!
//! This layer sits below every transport and below the worker's error: it
//! names neither the ring nor `error::Error` (which converts from
//! [`CollectiveError`] above it). Stage callbacks keep the caller's own
//! error type `E`.

use crate::spec::{Axis, Coords, ParallelDims};

/// Why a collective did not complete. Either way the rank's committed
/// state is intact and a new generation can re-form the communicator.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// The transport failed (the ring's `CommError`, boxed: this layer is
    /// below the ring and does not name it).
    #[error(transparent)]
    Transport(Box<dyn std::error::Error + Send + Sync + 'static>),
    /// The communicator of this generation is gone (closed between
    /// generations).
    #[error("{0}")]
    Interrupted(String),
}

/// This rank's place in the job's mesh: the degrees and its coordinates
/// (the arithmetic between them is [`ParallelDims`]'s).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MeshPlace {
    pub dims: ParallelDims,
    pub at: Coords,
}

impl MeshPlace {
    /// Data parallelism alone over `world` ranks, this one `rank`.
    pub fn data_only(world: usize, rank: usize) -> Self {
        let dims = ParallelDims::data_only(world as u32);
        Self {
            dims,
            at: dims.coords(rank as u32),
        }
    }

    /// `rank`'s place in `dims` (`rank` a world rank).
    pub fn of(dims: ParallelDims, rank: u32) -> Self {
        Self {
            dims,
            at: dims.coords(rank),
        }
    }
}

pub type Result<T, E = CollectiveError> = std::result::Result<T, E>;

/// Called with a bucket's index and its host memory: before the bucket is
/// reduced (`copy_in`, e.g. a device-to-host copy) or after (`copy_out`).
/// `E` is the caller's error, which the collective's own converts into.
pub type BucketCopy<'a, E> = &'a mut dyn FnMut(usize, &mut [f32]) -> Result<(), E>;

pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Element-wise sum over all ranks, in place, on a flat f32 buffer of
    /// the same length on every rank.
    fn all_reduce_sum(&mut self, buf: &mut Vec<f32>) -> Result<()>;
    /// Copies `root`'s buffer into every rank's buffer.
    fn broadcast(&mut self, buf: &mut Vec<f32>, root: usize) -> Result<()>;
    /// Copies `root`'s bytes into every rank's `buf`, resizing it: the other
    /// ranks need not know the length beforehand.
    fn broadcast_bytes(&mut self, buf: &mut Vec<u8>, root: usize) -> Result<()>;
    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<()>;
    /// Sums every bucket over all ranks, in place, in order. `copy_in(i)`
    /// runs before bucket i is reduced and `copy_out(i)` after. The default
    /// runs them in sequence through [`Collective::all_reduce_sum`] (one copy
    /// per bucket; none for W = 1); the TCP ring works on the buckets' own
    /// memory and runs `copy_in(i + 1)` while bucket i is on the wire.
    fn all_reduce_buckets<E: From<CollectiveError>>(
        &mut self,
        buckets: &mut [&mut [f32]],
        copy_in: BucketCopy<'_, E>,
        copy_out: BucketCopy<'_, E>,
    ) -> Result<(), E> {
        let single = self.world_size() == 1;
        for (i, b) in buckets.iter_mut().enumerate() {
            copy_in(i, b)?;
            if !single {
                let mut v = b.to_vec();
                self.all_reduce_sum(&mut v)?;
                b.copy_from_slice(&v);
            }
            copy_out(i, b)?;
        }
        Ok(())
    }
    /// ZeRO's reduce-scatter: afterwards slice `rank` of `buf`
    /// ([`crate::comm::shard::slice`]) holds the sum over all ranks; the rest is
    /// scratch. The default goes through [`Collective::all_reduce_sum`]
    /// (right, but all-reduce traffic); the TCP ring sends (W-1)/W.
    fn reduce_scatter_sum(&mut self, buf: &mut [f32]) -> Result<()> {
        if self.world_size() > 1 {
            let mut v = buf.to_vec();
            self.all_reduce_sum(&mut v)?;
            buf.copy_from_slice(&v);
        }
        Ok(())
    }
    /// ZeRO's all-gather: every rank's slice `rank` of `buf` copied into
    /// every rank's `buf`. The default sums buffers zeroed outside each
    /// rank's slice.
    fn all_gather(&mut self, buf: &mut [f32]) -> Result<()> {
        let w = self.world_size();
        if w > 1 {
            let own = crate::comm::shard::slice(buf.len(), w, self.rank());
            let mut v = vec![0f32; buf.len()];
            v[own.clone()].copy_from_slice(&buf[own]);
            self.all_reduce_sum(&mut v)?;
            buf.copy_from_slice(&v);
        }
        Ok(())
    }
    /// Bytes (sent, received) on the wire so far, framing included.
    fn bytes(&self) -> (u64, u64) {
        (0, 0)
    }
    /// Where this rank sits in the job's mesh: the degrees of every axis
    /// and its coordinates on them. The default is data parallelism
    /// alone: this collective's world and rank are the data axis's.
    fn place(&self) -> MeshPlace {
        MeshPlace::data_only(self.world_size(), self.rank())
    }
    /// This rank's group along a model-split `axis` (pipeline: its rank
    /// is the stage, the activations and their gradients travel there;
    /// tensor: its rank is the tensor rank, the model's operations take
    /// it through [`crate::comm::group::Group::tensor_group`]). The data
    /// axis's group is the collective itself. The default has no split
    /// axis: an error naming it.
    fn group(&mut self, axis: Axis) -> Result<&mut dyn crate::comm::group::Group> {
        Err(CollectiveError::Interrupted(format!(
            "this job has no {} axis (its degree is 1)",
            axis.name()
        )))
    }
    /// Every rank's `mine` over the whole world (every stage of every
    /// replica), in world rank order. The default is [`gather_u64`] over
    /// this collective, whose ranks are the world's when the model is not
    /// split.
    fn world_gather_u64(&mut self, mine: u64) -> Result<Vec<u64>>
    where
        Self: Sized,
    {
        gather_u64(self, mine)
    }
    /// [`Collective::broadcast_bytes`] over the whole world (`root` a
    /// world rank, in [`Collective::world_gather_u64`]'s order). The
    /// default is this collective's, whose ranks are the world's when the
    /// model is not split.
    fn world_broadcast_bytes(&mut self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
        self.broadcast_bytes(buf, root)
    }
}

/// Every rank's `mine` over `c`, in rank order: one 8-byte broadcast from
/// each rank.
pub fn gather_u64(c: &mut impl Collective, mine: u64) -> Result<Vec<u64>> {
    let rank = c.rank();
    (0..c.world_size())
        .map(|root| {
            let mut b = if root == rank {
                mine.to_le_bytes().to_vec()
            } else {
                Vec::new()
            };
            c.broadcast_bytes(&mut b, root)?;
            let v: [u8; 8] = b.as_slice().try_into().map_err(|_| {
                CollectiveError::Interrupted(format!(
                    "rank {root} sent {} bytes for an 8-byte value",
                    b.len()
                ))
            })?;
            Ok(u64::from_le_bytes(v))
        })
        .collect()
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
    fn broadcast_bytes(&mut self, _buf: &mut Vec<u8>, _root: usize) -> Result<()> {
        Ok(())
    }
    fn barrier(&mut self) -> Result<()> {
        Ok(())
    }
}
