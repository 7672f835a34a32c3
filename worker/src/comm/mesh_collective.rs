//! The engine's [`Collective`] over a generation's [`Mesh`]: the gradient
//! and ZeRO traffic goes over the data axis's group (the control ring
//! itself when the data axis is the world on the ring, as before issue 38;
//! a c10d group otherwise), byte broadcasts and barriers over the control
//! ring. Between generations it is closed: every call is an interruption.
//!
//! The engine hands over host buffers. A group whose tensors live on a CUDA
//! device (NCCL) gets a device copy of each and the result copied back
//! ([`Staged`]): the engine's flat gradients are staged through the host
//! on CUDA today, so NCCL carries the same bytes the ring would.

use crate::comm::collective::{BucketCopy, Collective, CollectiveError, MeshPlace};
use crate::comm::group::{Group, GroupError, ReduceOp};
use crate::comm::mesh::Mesh;
use crate::spec::Axis;
use tch::{Device, Kind, Tensor};

impl From<GroupError> for CollectiveError {
    fn from(e: GroupError) -> Self {
        CollectiveError::Transport(Box::new(e))
    }
}

/// The engine's [`Collective`] over a mesh: its rank and world are the
/// data axis's (what the engine shards samples and reduces gradients
/// over; the world's when the model is not split), and a split model's
/// stages and tensor ranks reach their groups through
/// [`Collective::group`].
pub struct MeshCollective {
    mesh: Option<Mesh>,
    rank: usize,
    world: usize,
    /// The job's degrees and this rank's coordinates.
    place: MeshPlace,
}

impl MeshCollective {
    pub fn new(mesh: Mesh) -> Self {
        let place = MeshPlace::of(*mesh.dims(), mesh.rank());
        Self {
            rank: place.at.data as usize,
            world: place.dims.data as usize,
            place,
            mesh: Some(mesh),
        }
    }

    /// The same place without its groups (dropping them says goodbye to
    /// the peers and stops their threads).
    pub fn closed(&self) -> Self {
        Self {
            mesh: None,
            rank: self.rank,
            world: self.world,
            place: self.place,
        }
    }

    pub fn mesh(&mut self) -> Result<&mut Mesh, CollectiveError> {
        self.mesh.as_mut().ok_or_else(|| {
            CollectiveError::Interrupted("the groups of this generation are closed".into())
        })
    }

    /// Whether the model is split (pipeline stages or tensor shards): the
    /// data axis is not the world then, and each data group agrees among
    /// itself.
    fn split(&self) -> bool {
        self.place.dims.replica() > 1
    }

    /// The data group when it is not the control ring.
    fn data_group(&mut self) -> Result<Option<&mut dyn Group>, CollectiveError> {
        let mesh = self.mesh()?;
        if mesh.on_control(Axis::Data) {
            return Ok(None);
        }
        Ok(Some(mesh.axis(Axis::Data)))
    }
}

/// A CPU tensor over `buf`'s memory (no copy).
///
/// # Safety
/// The tensor must not outlive `buf` nor be used while `buf` is borrowed
/// elsewhere: callers wait for the operation before returning.
unsafe fn over(buf: &mut [f32]) -> Result<Tensor, CollectiveError> {
    Tensor::f_from_blob(
        buf.as_mut_ptr() as *const u8,
        &[buf.len() as i64],
        &[1],
        Kind::Float,
        Device::Cpu,
    )
    .map_err(|e| CollectiveError::Transport(Box::new(e)))
}

/// A host buffer's tensor as a group takes it: itself for a CPU group, a
/// copy on the group's device for an NCCL group, copied back by
/// [`Staged::back`] once the operation is done.
struct Staged {
    host: Tensor,
    on: Tensor,
}

impl Staged {
    fn new(g: &dyn Group, host: Tensor) -> Result<Self, CollectiveError> {
        let on = match g.device() {
            Device::Cpu => host.shallow_clone(),
            d => host
                .f_to_device(d)
                .map_err(|e| CollectiveError::Transport(Box::new(e)))?,
        };
        Ok(Self { host, on })
    }

    /// The result into the host buffer (nothing to do on the CPU).
    fn back(&self) -> Result<(), CollectiveError> {
        if self.on.device() != Device::Cpu {
            let mut host = self.host.shallow_clone();
            host.f_copy_(&self.on)
                .map_err(|e| CollectiveError::Transport(Box::new(e)))?;
        }
        Ok(())
    }
}

/// `root`'s bytes into every member's `buf` over `g`: the length, then the
/// bytes in i64 words (a group carries f32, bf16, f16 and i64).
fn bytes_over(g: &mut dyn Group, buf: &mut Vec<u8>, root: usize) -> Result<(), CollectiveError> {
    let torch = |e: tch::TchError| CollectiveError::Transport(Box::new(e));
    let len = Tensor::f_from_slice(&[buf.len() as i64]).map_err(torch)?;
    g.broadcast(&len, root)?.wait()?;
    let n = len.int64_value(&[0]).max(0) as usize;
    // Non-roots: zeros of the root's length, overwritten by the broadcast.
    buf.resize(n, 0);
    let t = crate::comm::group::bytes_as_words(buf).map_err(torch)?;
    g.broadcast(&t, root)?.wait()?;
    *buf = crate::comm::group::words_as_bytes(&t, n).map_err(torch)?;
    Ok(())
}

fn sum(g: &mut dyn Group, buf: &mut [f32]) -> Result<(), CollectiveError> {
    // SAFETY: waited on before `buf` is released.
    let t = Staged::new(g, unsafe { over(buf)? })?;
    g.all_reduce(&t.on, ReduceOp::Sum)?.wait()?;
    t.back()
}

impl Collective for MeshCollective {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn place(&self) -> MeshPlace {
        self.place
    }
    fn world_gather_u64(&mut self, mine: u64) -> Result<Vec<u64>, CollectiveError> {
        crate::comm::collective::gather_u64(self.mesh()?.control(), mine)
    }
    fn world_broadcast_bytes(
        &mut self,
        buf: &mut Vec<u8>,
        root: usize,
    ) -> Result<(), CollectiveError> {
        Collective::broadcast_bytes(self.mesh()?.control(), buf, root)
    }
    fn group(&mut self, axis: Axis) -> Result<&mut dyn Group, CollectiveError> {
        if axis == Axis::Data || self.place.dims.degree(axis) == 1 {
            return Err(CollectiveError::Interrupted(format!(
                "this job has no {} group (data: the collective itself; a split axis needs a degree above 1, it is {})",
                axis.name(),
                self.place.dims.degree(axis)
            )));
        }
        Ok(self.mesh()?.axis(axis))
    }
    fn all_reduce_sum(&mut self, buf: &mut Vec<f32>) -> Result<(), CollectiveError> {
        match self.data_group()? {
            Some(g) => sum(g, buf),
            None => Collective::all_reduce_sum(self.mesh()?.control(), buf),
        }
    }
    fn broadcast(&mut self, buf: &mut Vec<f32>, root: usize) -> Result<(), CollectiveError> {
        match self.data_group()? {
            Some(g) => {
                // SAFETY: waited on before `buf` is released.
                let t = Staged::new(g, unsafe { over(buf)? })?;
                g.broadcast(&t.on, root)?.wait()?;
                t.back()
            }
            None => Collective::broadcast(self.mesh()?.control(), buf, root),
        }
    }
    fn broadcast_bytes(&mut self, buf: &mut Vec<u8>, root: usize) -> Result<(), CollectiveError> {
        // Pipeline stages: the data axis is not the world (each stage's
        // data ranks agree among themselves); its own group carries them.
        if self.split() {
            if let Some(g) = self.data_group()? {
                return bytes_over(g, buf, root);
            }
        }
        Collective::broadcast_bytes(self.mesh()?.control(), buf, root)
    }
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        if self.split() {
            if let Some(g) = self.data_group()? {
                let t = Tensor::f_zeros([1], (Kind::Int64, Device::Cpu))
                    .map_err(|e| CollectiveError::Transport(Box::new(e)))?;
                return Ok(g.all_reduce(&t, ReduceOp::Sum)?.wait()?);
            }
        }
        Collective::barrier(self.mesh()?.control())
    }
    fn all_reduce_buckets<E>(
        &mut self,
        buckets: &mut [&mut [f32]],
        copy_in: BucketCopy<'_, E>,
        copy_out: BucketCopy<'_, E>,
    ) -> Result<(), E>
    where
        E: From<CollectiveError>,
    {
        match self.data_group()? {
            // Each bucket is reduced once copied in; the next bucket's copy
            // overlaps the previous one's reduction.
            Some(g) => {
                let mut pending: Option<(usize, crate::comm::group::Pending, Staged)> = None;
                let n = buckets.len();
                for i in 0..=n {
                    if i < n {
                        copy_in(i, &mut *buckets[i])?;
                    }
                    if let Some((j, p, t)) = pending.take() {
                        p.wait().map_err(CollectiveError::from)?;
                        t.back()?;
                        copy_out(j, &mut *buckets[j])?;
                    }
                    if i < n {
                        // SAFETY: waited on (above, next round) before
                        // the bucket is touched again or released.
                        let t = Staged::new(g, unsafe { over(&mut *buckets[i])? })?;
                        let p = g
                            .all_reduce(&t.on, ReduceOp::Sum)
                            .map_err(CollectiveError::from)?;
                        pending = Some((i, p, t));
                    }
                }
                Ok(())
            }
            None => {
                Collective::all_reduce_buckets(self.mesh()?.control(), buckets, copy_in, copy_out)
            }
        }
    }
    fn reduce_scatter_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let (rank, world) = (self.rank, self.world);
        match self.data_group()? {
            Some(g) => {
                // ZeRO's slices (shard::slice) may be uneven; a c10d
                // reduce-scatter needs even ones, so sum the whole buffer
                // unless they are even.
                let len = buf.len();
                if !len.is_multiple_of(world) {
                    return sum(g, buf);
                }
                let own = crate::comm::shard::slice(len, world, rank);
                // SAFETY: waited on before `buf` is released.
                let whole = Staged::new(g, unsafe { over(buf)? })?;
                let out = Tensor::zeros([own.len() as i64], (Kind::Float, g.device()));
                g.reduce_scatter(&out, &whole.on, ReduceOp::Sum)?.wait()?;
                let out = out
                    .f_to_device(Device::Cpu)
                    .map_err(|e| CollectiveError::Transport(Box::new(e)))?;
                let v = Vec::<f32>::try_from(&out)
                    .map_err(|e| CollectiveError::Transport(Box::new(e)))?;
                buf[own].copy_from_slice(&v);
                Ok(())
            }
            None => Collective::reduce_scatter_sum(self.mesh()?.control(), buf),
        }
    }
    fn all_gather(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let (rank, world) = (self.rank, self.world);
        match self.data_group()? {
            Some(g) => {
                let len = buf.len();
                let own = crate::comm::shard::slice(len, world, rank);
                if !len.is_multiple_of(world) {
                    // Uneven slices: zeros outside this rank's, summed.
                    let mut v = vec![0f32; len];
                    v[own.clone()].copy_from_slice(&buf[own]);
                    sum(g, &mut v)?;
                    buf.copy_from_slice(&v);
                    return Ok(());
                }
                let mine = Tensor::from_slice(&buf[own])
                    .f_to_device(g.device())
                    .map_err(|e| CollectiveError::Transport(Box::new(e)))?;
                // SAFETY: waited on before `buf` is released.
                let whole = Staged::new(g, unsafe { over(buf)? })?;
                g.all_gather(&whole.on, &mine)?.wait()?;
                whole.back()
            }
            None => Collective::all_gather(self.mesh()?.control(), buf),
        }
    }
    fn bytes(&self) -> (u64, u64) {
        match self.mesh.as_ref() {
            Some(m) => m.control_bytes(),
            None => (0, 0),
        }
    }
}
