//! The window's transfers between pipeline ranks, matched by identity:
//! every message carries a header naming what it is (activation or
//! gradient), the chunk that receives it, the micro-batch, and its shape
//! and type. With interleaved 1F1B one direction between two ranks carries
//! both kinds in an order no first-in-first-out rule pairs, so a receive
//! reads its channel until its own message arrives, stashing the others
//! for the receives they are meant for (the simulator's rule,
//! `pipeline::run_programs`).

use super::wire::{code_kind, group_err, kind_code, Posted};
use crate::comm::group::Group;
use crate::engine::trainer::pipeline::{Msg, MsgKind};
use crate::error::{Error, Result, TorchContext};
use std::collections::HashMap;
use tch::{Kind, Tensor};

/// The header's length: rank and up to 4 dims, the type, then the
/// message's kind, chunk and micro-batch.
const HEADER: usize = 9;

fn kind_of(code: i64) -> MsgKind {
    match code {
        1 => MsgKind::Gradient,
        _ => MsgKind::Activation,
    }
}

fn code_of(kind: MsgKind) -> i64 {
    match kind {
        MsgKind::Activation => 0,
        MsgKind::Gradient => 1,
    }
}

/// Posts `t` to group rank `to` as message `msg` (through the host when
/// the group carries host tensors and `t` is on a GPU).
pub(super) fn send_msg(g: &mut dyn Group, msg: Msg, t: Tensor, to: usize) -> Result<Vec<Posted>> {
    let t = t.f_to_device(g.device()).ctx("sending to another stage")?;
    let size = t.size();
    if size.len() > 4 {
        return Err(Error::Schedule(format!(
            "a pipeline transfer of {} dims (at most 4): {size:?}",
            size.len()
        )));
    }
    let mut header = vec![size.len() as i64];
    header.extend(size.iter().copied());
    header.resize(5, 0);
    header.push(kind_code(t.kind()));
    header.extend([code_of(msg.kind), msg.chunk as i64, msg.micro as i64]);
    let h = Tensor::f_from_slice(&header).ctx("sending to another stage")?;
    let a = g.send(&h, to).map_err(group_err)?;
    let b = g.send(&t, to).map_err(group_err)?;
    Ok(vec![(a, h), (b, t)])
}

/// Messages read ahead of their receive, by (peer, message).
#[derive(Default)]
pub(super) struct Stash {
    early: HashMap<(usize, Msg), Tensor>,
}

impl Stash {
    /// Message `want` from group rank `from`, on `device`: from the stash,
    /// or read from the channel, stashing the messages before it.
    pub(super) fn recv(
        &mut self,
        g: &mut dyn Group,
        from: usize,
        want: Msg,
        device: tch::Device,
    ) -> Result<Tensor> {
        loop {
            if let Some(t) = self.early.remove(&(from, want)) {
                return t.f_to_device(device).ctx("receiving from another stage");
            }
            let (msg, t) = read(g, from)?;
            if self.early.insert((from, msg), t).is_some() {
                return Err(Error::Schedule(format!(
                    "pipeline rank {from} sent {msg:?} twice in one window"
                )));
            }
        }
    }

    /// The messages nobody received (none after a window that ran its
    /// schedule).
    pub(super) fn left(&self) -> Vec<(usize, Msg)> {
        self.early.keys().copied().collect()
    }
}

/// The next message on the channel from `from`.
fn read(g: &mut dyn Group, from: usize) -> Result<(Msg, Tensor)> {
    let what = "receiving from another stage";
    let h = Tensor::f_zeros([HEADER as i64], (Kind::Int64, tch::Device::Cpu)).ctx(what)?;
    g.recv(&h, from)
        .map_err(group_err)?
        .wait()
        .map_err(group_err)?;
    let header = Vec::<i64>::try_from(&h).ctx(what)?;
    let dims = header[0].clamp(0, 4) as usize;
    let t = Tensor::f_zeros(&header[1..1 + dims], (code_kind(header[5]), g.device())).ctx(what)?;
    g.recv(&t, from)
        .map_err(group_err)?
        .wait()
        .map_err(group_err)?;
    let msg = Msg {
        kind: kind_of(header[6]),
        chunk: header[7].max(0) as usize,
        micro: header[8].max(0) as usize,
    };
    Ok((msg, t))
}
