//! A process group: the ranks of one mesh axis (or the whole world) and the
//! collectives they run together, on tensors of f32, bf16, f16 or i64 on
//! their own device. Two transports implement it: libtorch's c10d
//! ([`crate::comm::c10d::C10dGroup`], gloo) and accrue's TCP ring
//! ([`RingGroup`]). Every operation returns a [`Pending`] handle to wait on;
//! a wait is bounded by the group's timeout and a failure leaves the group
//! unusable (the generation re-forms, as with the ring today).

use crate::comm::{CommError, TcpRing};
use tch::{Device, Kind, Tensor};

/// How elements combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum = 0,
    Max = 1,
}

#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    /// The group could not form (rendezvous, credentials, timeout).
    #[error("{0}")]
    Setup(String),
    /// An operation failed or timed out: a peer is lost; the group is done.
    #[error("{0}")]
    Failed(String),
    /// The call itself is wrong (shapes, ranks, a dtype or operation the
    /// transport does not offer); nothing was sent.
    #[error("{0}")]
    Usage(String),
}

impl From<CommError> for GroupError {
    fn from(e: CommError) -> Self {
        GroupError::Failed(e.to_string())
    }
}

impl From<tch::TchError> for GroupError {
    fn from(e: tch::TchError) -> Self {
        GroupError::Usage(e.to_string())
    }
}

/// Bytes as an i64 tensor of ceil(len / 8) words (zero-padded): a group
/// carries f32, bf16, f16 and i64, so bytes travel this way.
pub fn bytes_as_words(bytes: &[u8]) -> Result<Tensor, tch::TchError> {
    let mut padded = bytes.to_vec();
    padded.resize(bytes.len().div_ceil(8) * 8, 0);
    Tensor::f_from_data_size(&padded, &[(padded.len() / 8) as i64], Kind::Int64)
}

/// The first `len` bytes of words made by [`bytes_as_words`].
pub fn words_as_bytes(words: &Tensor, len: usize) -> Result<Vec<u8>, tch::TchError> {
    let n = len.div_ceil(8);
    let mut bytes = vec![0u8; n * 8];
    words.f_copy_data_u8(&mut bytes, n)?;
    bytes.truncate(len);
    Ok(bytes)
}

/// A started operation.
pub trait Wait: Send {
    fn wait(&mut self) -> Result<(), GroupError>;
}

/// The handle of a started operation; its buffers must not be touched
/// until [`Pending::wait`] returns.
pub struct Pending(Option<Box<dyn Wait>>);

impl Pending {
    pub fn new(w: Box<dyn Wait>) -> Self {
        Self(Some(w))
    }
    /// An operation that already finished.
    pub fn done() -> Self {
        Self(None)
    }
    /// Waits for the operation, at most the group's timeout.
    pub fn wait(mut self) -> Result<(), GroupError> {
        match self.0.as_mut() {
            Some(w) => w.wait(),
            None => Ok(()),
        }
    }
}

pub trait Group: Send {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// "c10d" (gloo), "c10d-nccl" or "ring".
    fn transport(&self) -> &'static str;
    /// Where the group's operations want their tensors: the CPU for gloo
    /// and the ring (which copies a device tensor through the host), the
    /// group's CUDA device for NCCL.
    fn device(&self) -> Device {
        Device::Cpu
    }
    /// Element-wise reduction over the group, in place.
    fn all_reduce(&mut self, t: &Tensor, op: ReduceOp) -> Result<Pending, GroupError>;
    /// `out` (1/size of `input`'s elements) receives the reduction of every
    /// rank's slice `rank` of `input`.
    fn reduce_scatter(
        &mut self,
        out: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<Pending, GroupError>;
    /// `out` (size times `input`'s elements) receives every rank's `input`
    /// in rank order.
    fn all_gather(&mut self, out: &Tensor, input: &Tensor) -> Result<Pending, GroupError>;
    /// `root`'s tensor into every rank's.
    fn broadcast(&mut self, t: &Tensor, root: usize) -> Result<Pending, GroupError>;
    /// Point to point: `t` to group rank `dst`, which receives it with
    /// [`Group::recv`] from this rank.
    fn send(&mut self, t: &Tensor, dst: usize) -> Result<Pending, GroupError>;
    fn recv(&mut self, t: &Tensor, src: usize) -> Result<Pending, GroupError>;
    /// Fails every pending and later operation at once.
    fn abort(&mut self);
    /// The group as tensor parallelism's in-graph operations take it
    /// (crate::comm::tensor_ops): c10d groups only.
    fn tensor_group(&self) -> Option<crate::comm::tensor_ops::TensorGroup> {
        None
    }
}

/// The dtypes groups carry.
pub const KINDS: [Kind; 4] = [Kind::Float, Kind::BFloat16, Kind::Half, Kind::Int64];

fn check_kind(t: &Tensor) -> Result<Kind, GroupError> {
    let k = t.kind();
    if KINDS.contains(&k) {
        Ok(k)
    } else {
        Err(GroupError::Usage(format!(
            "groups carry f32, bf16, f16 and i64 tensors, not {k:?}"
        )))
    }
}

/// `part` holds 1/size of `whole`'s elements, same dtype and device, both
/// contiguous (reduce-scatter's output, all-gather's input).
pub fn check_scatter(part: &Tensor, whole: &Tensor, size: usize) -> Result<(), GroupError> {
    let (p, w) = (part.numel(), whole.numel());
    if p * size != w || part.kind() != whole.kind() || part.device() != whole.device() {
        return Err(GroupError::Usage(format!(
            "a shard of {p} {:?} elements on {:?} and a whole of {w} {:?} on {:?} do not fit a group of {size}",
            part.kind(),
            part.device(),
            whole.kind(),
            whole.device()
        )));
    }
    if !part.is_contiguous() || !whole.is_contiguous() {
        return Err(GroupError::Usage(
            "collective buffers must be contiguous".into(),
        ));
    }
    check_kind(part).map(|_| ())
}

/// The TCP ring as a group: f32 sums on the ring's own reduce-scatter and
/// all-gather (bf16 and f16 widened to f32 and rounded once at the end),
/// the rest (i64, max) exactly through byte broadcasts. It completes each
/// operation before returning (its handle is already done) and has no
/// point-to-point: the ring serves the data axis.
pub struct RingGroup {
    ring: TcpRing,
}

impl RingGroup {
    pub fn new(ring: TcpRing) -> Self {
        Self { ring }
    }

    pub fn ring(&mut self) -> &mut TcpRing {
        &mut self.ring
    }

    pub fn ring_ref(&self) -> &TcpRing {
        &self.ring
    }

    fn host_f32(t: &Tensor) -> Result<Vec<f32>, GroupError> {
        let flat = t.f_to_kind(Kind::Float)?.f_flatten(0, -1)?;
        Ok(Vec::<f32>::try_from(&flat)?)
    }

    fn store_f32(t: &Tensor, v: &[f32]) -> Result<(), GroupError> {
        let src = Tensor::from_slice(v)
            .f_view(t.size().as_slice())?
            .f_to_device(t.device())?;
        t.shallow_clone().f_copy_(&src)?;
        Ok(())
    }

    /// Every rank's bytes of `t` (contiguous, on the host), in rank order.
    fn gather_bytes(&mut self, t: &Tensor) -> Result<Vec<Tensor>, GroupError> {
        let host = t.f_to_device(tch::Device::Cpu)?.f_contiguous()?;
        let n = host.numel() * host.kind().elt_size_in_bytes();
        let mut mine = vec![0u8; n];
        host.f_copy_data_u8(&mut mine, host.numel())?;
        let mut all = Vec::with_capacity(self.ring.config().world);
        for root in 0..self.ring.config().world {
            let mut b = if root == self.ring.config().rank {
                mine.clone()
            } else {
                Vec::new()
            };
            self.ring.broadcast_bytes(&mut b, root)?;
            if b.len() != n {
                return Err(GroupError::Failed(format!(
                    "rank {root} sent {} bytes for a tensor of {n}",
                    b.len()
                )));
            }
            all.push(Tensor::f_from_data_size(&b, &host.size(), host.kind())?);
        }
        Ok(all)
    }
}

impl Group for RingGroup {
    fn rank(&self) -> usize {
        self.ring.config().rank
    }
    fn size(&self) -> usize {
        self.ring.config().world
    }
    fn transport(&self) -> &'static str {
        "ring"
    }
    fn all_reduce(&mut self, t: &Tensor, op: ReduceOp) -> Result<Pending, GroupError> {
        let kind = check_kind(t)?;
        if op == ReduceOp::Sum && kind != Kind::Int64 {
            let mut v = Self::host_f32(t)?;
            self.ring.all_reduce(&mut v)?;
            Self::store_f32(t, &v)?;
        } else {
            let all = Tensor::f_stack(&self.gather_bytes(t)?, 0)?;
            let r = match op {
                ReduceOp::Sum => all.f_sum_dim_intlist(0, false, kind)?,
                ReduceOp::Max => all.f_amax(0, false)?,
            };
            t.shallow_clone().f_copy_(&r.f_to_device(t.device())?)?;
        }
        Ok(Pending::done())
    }
    fn reduce_scatter(
        &mut self,
        out: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<Pending, GroupError> {
        check_scatter(out, input, self.size())?;
        let rank = self.rank();
        let n = out.numel() as i64;
        if op == ReduceOp::Sum && input.kind() != Kind::Int64 {
            let mut v = Self::host_f32(input)?;
            // Equal slices: shard::slice splits a multiple of size evenly.
            self.ring.reduce_scatter(&mut v)?;
            let mine = &v[rank * n as usize..(rank + 1) * n as usize];
            Self::store_f32(out, mine)?;
        } else {
            let whole = input.f_flatten(0, -1)?.copy();
            self.all_reduce(&whole, op)?.wait()?;
            let mine = whole.f_narrow(0, rank as i64 * n, n)?;
            out.shallow_clone()
                .f_copy_(&mine.f_view(out.size().as_slice())?)?;
        }
        Ok(Pending::done())
    }
    fn all_gather(&mut self, out: &Tensor, input: &Tensor) -> Result<Pending, GroupError> {
        check_scatter(input, out, self.size())?;
        let parts = self.gather_bytes(input)?;
        let flat: Vec<Tensor> = parts
            .iter()
            .map(|p| p.f_flatten(0, -1))
            .collect::<Result<_, _>>()?;
        let cat = Tensor::f_cat(&flat, 0)?
            .f_view(out.size().as_slice())?
            .f_to_device(out.device())?;
        out.shallow_clone().f_copy_(&cat)?;
        Ok(Pending::done())
    }
    fn broadcast(&mut self, t: &Tensor, root: usize) -> Result<Pending, GroupError> {
        check_kind(t)?;
        if root >= self.size() {
            return Err(GroupError::Usage(format!(
                "broadcast root {root} is outside a group of {}",
                self.size()
            )));
        }
        let host = t.f_to_device(tch::Device::Cpu)?.f_contiguous()?;
        let n = host.numel() * host.kind().elt_size_in_bytes();
        let mut b = vec![0u8; n];
        if root == self.rank() {
            host.f_copy_data_u8(&mut b, host.numel())?;
        }
        self.ring.broadcast_bytes(&mut b, root)?;
        if b.len() != n {
            return Err(GroupError::Failed(format!(
                "the broadcast root sent {} bytes for a tensor of {n}",
                b.len()
            )));
        }
        let got = Tensor::f_from_data_size(&b, &host.size(), host.kind())?;
        t.shallow_clone().f_copy_(&got.f_to_device(t.device())?)?;
        Ok(Pending::done())
    }
    fn send(&mut self, _t: &Tensor, _dst: usize) -> Result<Pending, GroupError> {
        Err(GroupError::Usage(
            "the ring has no point-to-point: pipeline and tensor axes run on c10d ([comm] backend)"
                .into(),
        ))
    }
    fn recv(&mut self, t: &Tensor, src: usize) -> Result<Pending, GroupError> {
        self.send(t, src)
    }
    fn abort(&mut self) {
        self.ring.abort();
    }
}
