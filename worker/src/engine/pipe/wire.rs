//! What crosses between stages: tensors with a small i64 header of their
//! shape and type, received on the caller's device through the group's.

use crate::comm::collective::CollectiveError;
use crate::comm::group::{Group, Pending, ReduceOp};
use crate::error::{Error, Result, TorchContext};
use tch::{Kind, Tensor};

pub(super) fn group_err(e: crate::comm::group::GroupError) -> Error {
    CollectiveError::from(e).into()
}

/// `t` summed over `g` in place (waited for).
pub(super) fn sum_over(g: &mut dyn Group, t: &Tensor) -> Result<()> {
    g.all_reduce(t, ReduceOp::Sum)
        .map_err(group_err)?
        .wait()
        .map_err(group_err)
}

/// A posted send and the tensor it reads, kept alive until it is done.
pub(super) type Posted = (Pending, Tensor);

/// The header's code of an activation's type (the forward's: fp32, or
/// bf16 and fp16 where autocast leaves them so).
pub(super) fn kind_code(kind: Kind) -> i64 {
    match kind {
        Kind::BFloat16 => 1,
        Kind::Half => 2,
        _ => 0,
    }
}

pub(super) fn code_kind(code: i64) -> Kind {
    match code {
        1 => Kind::BFloat16,
        2 => Kind::Half,
        _ => Kind::Float,
    }
}

/// Posts `t` to stage `to` with its shape and type first (through the
/// host when the group carries host tensors and `t` is on a GPU).
pub(super) fn send_with_shape(g: &mut dyn Group, t: Tensor, to: usize) -> Result<Vec<Posted>> {
    let t = t.f_to_device(g.device()).ctx("sending an activation")?;
    let size = t.size();
    let mut header = vec![size.len() as i64];
    header.extend(size.iter().copied());
    header.resize(5, 0);
    header.push(kind_code(t.kind()));
    let h = Tensor::f_from_slice(&header).ctx("sending an activation")?;
    let a = g.send(&h, to).map_err(group_err)?;
    let b = g.send(&t, to).map_err(group_err)?;
    Ok(vec![(a, h), (b, t)])
}

/// Receives a tensor [`send_with_shape`] sent from stage `from`, on
/// `device`.
pub(super) fn recv_with_shape(
    g: &mut dyn Group,
    from: usize,
    device: tch::Device,
) -> Result<Tensor> {
    let h = Tensor::f_zeros([6], (Kind::Int64, tch::Device::Cpu)).ctx("receiving an activation")?;
    g.recv(&h, from)
        .map_err(group_err)?
        .wait()
        .map_err(group_err)?;
    let header = Vec::<i64>::try_from(&h).ctx("receiving an activation")?;
    let dims = header[0].clamp(0, 4) as usize;
    let shape = &header[1..1 + dims];
    let t = Tensor::f_zeros(shape, (code_kind(header[5]), g.device()))
        .ctx("receiving an activation")?;
    g.recv(&t, from)
        .map_err(group_err)?
        .wait()
        .map_err(group_err)?;
    t.f_to_device(device).ctx("receiving an activation")
}

/// Receives into `t` from group rank `from` (waited for), through a
/// buffer on the group's device when `t` is elsewhere.
pub(super) fn recv_into(
    g: &mut dyn Group,
    t: &Tensor,
    from: usize,
    what: &'static str,
) -> Result<()> {
    let on = g.device();
    let buffer = if t.device() == on {
        t.shallow_clone()
    } else {
        Tensor::f_zeros(t.size(), (t.kind(), on)).ctx(what)?
    };
    g.recv(&buffer, from)
        .map_err(group_err)?
        .wait()
        .map_err(group_err)?;
    if t.device() != on {
        t.shallow_clone().f_copy_(&buffer).ctx(what)?;
    }
    Ok(())
}
