//! Pipeline schedules as data (issues 40 and 57): a schedule turns a
//! window (k micro-batches, the rank's place in the pipeline) into the
//! rank's list of operations, every transfer explicit, and one executor
//! (engine/pipe/) runs any list. A pure function of (schedule, rank, P,
//! V, k): every rank computes its own list, and the lists of all ranks
//! together run to completion when sends are posted without waiting and a
//! receive waits for its own message ([`simulate`] runs them; the tests
//! prove it for every P <= 8, V <= 4 and k <= 17).
//!
//! The model is cut into P x V chunks; rank r holds V of them, global
//! chunk c = v P + r (Megatron's virtual pipeline: chunk c + 1 is always
//! on the next rank, and rank P - 1 hands chunk P - 1's output to rank
//! 0's chunk P). GPipe and 1F1B are the V = 1 cases.
//!
//! - **GPipe**: every forward, then every backward (in micro-batch
//!   order); activations of all k micro-batches live at once.
//! - **1F1B** (Megatron's `forward_backward_pipelining_without_interleaving`):
//!   rank r runs min(P - r - 1, k) warm-up forwards, then alternates one
//!   forward and one backward, then the remaining backwards; rank 0 holds
//!   at most P micro-batches' activations.
//! - **Interleaved 1F1B** (Megatron-core's
//!   `forward_backward_pipelining_with_interleaving`, its
//!   `get_schedule_table` with micro-batch groups of P, the last group
//!   taking the remainder, so any k runs: [`forward_order`]): the
//!   forwards go group by group,
//!   each group through chunk 0, then chunk 1, ...; the backwards in the
//!   same order with the chunks reversed. Warm-up: (P - r - 1) x 2 +
//!   (V - 1) x G forwards (G the last group's size: P when P divides
//!   k), at most k V; then one forward and one backward
//!   alternate; then the remaining backwards.
//!
//! Transfers: a forward of chunk c > 0 first receives its input from
//! chunk c - 1's rank; one of c < C - 1 (C = P V) ends by sending its
//! output to chunk c + 1's. A backward of c < C - 1 first receives its
//! output's gradient from c + 1's rank; one of c > 0 ends by sending its
//! input's gradient to c - 1's. The last chunk runs its loss's backward
//! with its forward (its Backward op only marks the micro-batch done).
//! With V >= 2 one direction between two ranks carries activations and
//! gradients, in an order no FIFO rule pairs: every message names
//! ([`Msg`]) what it is, for which chunk and micro-batch, and a receive
//! takes its own message from the channel, keeping those meant for later
//! receives (the executor's stash).

/// Which schedule a pipeline job runs (`[parallel] schedule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PipeSchedule {
    OneFOneB,
    GPipe,
    Interleaved1F1B,
}

/// The pipeline's shape: P ranks of V chunks each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// P: the pipeline group's ranks.
    pub stages: usize,
    /// V: model chunks a rank holds (1 but for interleaved 1F1B).
    pub per_rank: usize,
}

impl Layout {
    pub fn new(stages: usize, per_rank: usize) -> Self {
        Self { stages, per_rank }
    }
    /// C = P x V: the model's chunks.
    pub fn chunks(&self) -> usize {
        self.stages * self.per_rank
    }
    /// The rank holding global chunk `c`.
    pub fn rank_of(&self, c: usize) -> usize {
        c % self.stages
    }
    /// Rank `rank`'s local chunk `v` as a global chunk.
    pub fn global(&self, rank: usize, v: usize) -> usize {
        v * self.stages + rank
    }
    /// Global chunk `c`'s index among its rank's chunks.
    pub fn local(&self, c: usize) -> usize {
        c / self.stages
    }
    /// Whether chunk `c` ends the model (the head and the loss).
    pub fn is_last(&self, c: usize) -> bool {
        c + 1 == self.chunks()
    }
}

/// One operation of a rank; `chunk` is the global chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PipeOp {
    /// Chunk `chunk`'s input for micro-batch `micro` (0-based within the
    /// window), from chunk `chunk - 1`'s rank.
    RecvActivation { chunk: usize, micro: usize },
    /// The forward of `micro` through `chunk` (with the loss and its
    /// backward on the last chunk).
    Forward { chunk: usize, micro: usize },
    /// The forward's output to chunk `chunk + 1`'s rank (posted).
    SendActivation { chunk: usize, micro: usize },
    /// The output's gradient from chunk `chunk + 1`'s rank.
    RecvGradient { chunk: usize, micro: usize },
    /// The backward of `micro` through `chunk`.
    Backward { chunk: usize, micro: usize },
    /// The input's gradient to chunk `chunk - 1`'s rank (posted).
    SendGradient { chunk: usize, micro: usize },
}

/// What a transfer carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MsgKind {
    Activation,
    Gradient,
}

/// A transfer's identity: what it is, the chunk that receives it and the
/// micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Msg {
    pub kind: MsgKind,
    pub chunk: usize,
    pub micro: usize,
}

impl PipeOp {
    /// A send: its peer rank and the message.
    pub fn sends(&self, layout: &Layout) -> Option<(usize, Msg)> {
        let (kind, chunk, micro) = match *self {
            PipeOp::SendActivation { chunk, micro } => (MsgKind::Activation, chunk + 1, micro),
            PipeOp::SendGradient { chunk, micro } => {
                (MsgKind::Gradient, chunk.checked_sub(1)?, micro)
            }
            _ => return None,
        };
        Some((layout.rank_of(chunk), Msg { kind, chunk, micro }))
    }

    /// A receive: its peer rank and the message it waits for.
    pub fn receives(&self, layout: &Layout) -> Option<(usize, Msg)> {
        let (kind, chunk, micro, peer) = match *self {
            PipeOp::RecvActivation { chunk, micro } => {
                (MsgKind::Activation, chunk, micro, chunk.checked_sub(1)?)
            }
            PipeOp::RecvGradient { chunk, micro } => (MsgKind::Gradient, chunk, micro, chunk + 1),
            _ => return None,
        };
        Some((layout.rank_of(peer), Msg { kind, chunk, micro }))
    }
}

/// Rank `rank`'s warm-up forwards of a window of `k` (all of them when
/// it reaches the rank's k V).
pub fn warmup(schedule: PipeSchedule, layout: &Layout, rank: usize, k: usize) -> usize {
    let (p, v) = (layout.stages, layout.per_rank);
    let total = k * v;
    match schedule {
        PipeSchedule::GPipe => total,
        PipeSchedule::OneFOneB => (p - rank - 1).min(total),
        PipeSchedule::Interleaved1F1B => {
            ((p - rank - 1) * 2 + (v - 1) * last_group(p, k)).min(total)
        }
    }
}

/// The last (and largest) micro-batch group's size: P plus the
/// remainder, or k when k < 2P (one group).
fn last_group(stages: usize, k: usize) -> usize {
    if k < 2 * stages {
        k
    } else {
        stages + k % stages
    }
}

/// The order of a rank's forwards as (local chunk, micro): micro-batch
/// groups of P, the last one taking the remainder (P to 2P - 1 of them;
/// a window of k < 2P is one group), each group through the chunks in
/// order (Megatron-core's `get_schedule_table`; one chunk: micro-batch
/// order), and the warm-up counts the last group's size where Megatron
/// counts P: the same schedule when P divides k. Megatron's table makes
/// the remainder a short group of its own instead: that deadlocks 74 of
/// the 408 cases P <= 8, 2 <= V <= 4, k <= 17 (the first: P = 4, V = 3,
/// k = 5), a short group not covering the P steps between a rank's chunk
/// and its next; and a larger last group with Megatron's warm-up runs a
/// last chunk's backward before its forward (P = 2, V = 2, k = 3).
fn forward_order(layout: &Layout, k: usize) -> Vec<(usize, usize)> {
    let group = layout.stages.max(1);
    let mut out = Vec::with_capacity(k * layout.per_rank);
    let mut first = 0;
    while first < k {
        // Fewer than P left after this group: they join it.
        let end = if first + 2 * group > k {
            k
        } else {
            first + group
        };
        for v in 0..layout.per_rank {
            out.extend((first..end).map(|m| (v, m)));
        }
        first = end;
    }
    out
}

/// The operations rank `rank` runs for a window of `k` micro-batches,
/// in order.
pub fn rank_ops(schedule: PipeSchedule, layout: &Layout, rank: usize, k: usize) -> Vec<PipeOp> {
    let order = forward_order(layout, k);
    let last = layout.chunks() - 1;
    let v = layout.per_rank;
    let fwd = |ops: &mut Vec<PipeOp>, i: usize| {
        let (local, micro) = order[i];
        let chunk = layout.global(rank, local);
        if chunk > 0 {
            ops.push(PipeOp::RecvActivation { chunk, micro });
        }
        ops.push(PipeOp::Forward { chunk, micro });
        if chunk < last {
            ops.push(PipeOp::SendActivation { chunk, micro });
        }
    };
    // The backwards in the forwards' order, the chunks reversed.
    let bwd = |ops: &mut Vec<PipeOp>, i: usize| {
        let (local, micro) = order[i];
        let chunk = layout.global(rank, v - 1 - local);
        if chunk < last {
            ops.push(PipeOp::RecvGradient { chunk, micro });
        }
        ops.push(PipeOp::Backward { chunk, micro });
        if chunk > 0 {
            ops.push(PipeOp::SendGradient { chunk, micro });
        }
    };
    let n = order.len();
    let w = warmup(schedule, layout, rank, k);
    let mut ops = Vec::with_capacity(6 * n);
    for i in 0..w {
        fwd(&mut ops, i);
    }
    for i in 0..n - w {
        fwd(&mut ops, w + i);
        bwd(&mut ops, i);
    }
    for i in n - w..n {
        bwd(&mut ops, i);
    }
    ops
}

/// The most (chunk, micro-batch) activations a rank holds at once under
/// `ops` (forwards run, backwards not yet).
pub fn peak_in_flight(ops: &[PipeOp]) -> usize {
    let (mut live, mut peak) = (0usize, 0usize);
    for op in ops {
        match op {
            PipeOp::Forward { .. } => {
                live += 1;
                peak = peak.max(live);
            }
            PipeOp::Backward { .. } => live -= 1,
            _ => {}
        }
    }
    peak
}

/// Why a set of op lists does not run to completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SimError {
    /// Every rank waits: each one's position in its list.
    Deadlock { at: Vec<usize> },
    /// A rank waits for a message its channel holds none of, while the
    /// channel holds others nobody will take first.
    Mismatch {
        rank: usize,
        from: usize,
        want: Msg,
        queued: Vec<Msg>,
    },
    /// Every list ended with messages nobody received.
    Undelivered { left: Vec<(usize, usize, Msg)> },
}

/// When each op of each rank ran (a round number, rounds in which every
/// rank that can runs one op).
pub type Trace = Vec<Vec<usize>>;

/// Runs every rank's list of `schedule` as the engine transfers.
pub fn simulate(schedule: PipeSchedule, layout: &Layout, k: usize) -> Result<Trace, SimError> {
    let programs: Vec<Vec<PipeOp>> = (0..layout.stages)
        .map(|r| rank_ops(schedule, layout, r, k))
        .collect();
    run_programs(layout, &programs)
}

/// Runs given lists, one per rank: a send is posted and not waited for
/// (the rank goes on; the window waits for its sends before the sync
/// step), a receive waits until its own message has been posted on its
/// (from, to) channel and takes it, whatever else the channel holds.
/// With sends that waited for their receive, 1F1B would deadlock at P = 2,
/// k = 2 (both ranks sending at once): Megatron posts the pair together
/// for the same reason (`send_forward_recv_backward`).
pub fn run_programs(layout: &Layout, programs: &[Vec<PipeOp>]) -> Result<Trace, SimError> {
    let ranks = programs.len();
    // Messages posted and not yet received, by (from, to).
    let mut channel: Vec<Vec<Vec<Msg>>> = vec![vec![Vec::new(); ranks]; ranks];
    let mut at = vec![0usize; ranks];
    let mut trace: Trace = programs.iter().map(|p| vec![0; p.len()]).collect();
    let mut round = 0;
    loop {
        if (0..ranks).all(|r| at[r] == programs[r].len()) {
            let mut left = Vec::new();
            for (from, row) in channel.iter().enumerate() {
                for (to, msgs) in row.iter().enumerate() {
                    left.extend(msgs.iter().map(|m| (from, to, *m)));
                }
            }
            return if left.is_empty() {
                Ok(trace)
            } else {
                Err(SimError::Undelivered { left })
            };
        }
        round += 1;
        let mut moved = false;
        for r in 0..ranks {
            let Some(op) = programs[r].get(at[r]) else {
                continue;
            };
            if let Some((to, msg)) = op.sends(layout) {
                channel[r][to].push(msg);
            } else if let Some((from, msg)) = op.receives(layout) {
                let queue = &mut channel[from][r];
                match queue.iter().position(|m| *m == msg) {
                    Some(i) => {
                        queue.remove(i);
                    }
                    None => continue,
                }
            }
            trace[r][at[r]] = round;
            at[r] += 1;
            moved = true;
        }
        if !moved {
            // Every rank waits (or is done): a waiting receive whose
            // channel holds messages, none its own, is a mismatch.
            for r in 0..ranks {
                let waits = programs[r].get(at[r]).and_then(|op| op.receives(layout));
                if let Some((from, want)) = waits {
                    let queued = channel[from][r].clone();
                    if !queued.is_empty() {
                        return Err(SimError::Mismatch {
                            rank: r,
                            from,
                            want,
                            queued,
                        });
                    }
                }
            }
            return Err(SimError::Deadlock { at });
        }
    }
}

#[cfg(test)]
#[path = "pipeline_tests.rs"]
mod tests;
