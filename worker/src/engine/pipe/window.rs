//! The pipeline window's executor: one loop that runs any schedule's op
//! list (engine/trainer/pipeline.rs) for this rank's model chunks, with
//! what each (chunk, micro-batch) keeps between its forward and backward.
//!
//! A forward of chunk 0 reads the micro-batch's inputs, one of the last
//! chunk its targets (packed rows: every chunk reads the rows' positions);
//! the last chunk runs the head, the loss and its backward with its
//! forward, as one process's micro-step. Sends are posted and waited for
//! later: an activation's once the gradient computed from it has arrived
//! (its storage goes with the backward), a gradient's at the window's end.
//! A receive takes its own message from the channel (pipe/channel.rs). An
//! empty micro-batch's ops are no-ops but for ZeRO-3's share of the
//! collectives and `sync = "every_step"`'s reduction.

use super::channel::{send_msg, Stash};
use super::wire::{group_err, Posted};
use super::Pipe;
use crate::comm::collective::Collective;
use crate::engine::recompute::Recompute;
use crate::engine::trainer::pipeline::{rank_ops, Layout, MsgKind, PipeOp};
use crate::engine::trainer::Op;
use crate::engine::{Engine, StepReport};
use crate::error::{Error, Result, TorchContext};
use crate::spec::Axis;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tch::{Kind, Tensor};

/// A (global chunk, micro-batch) pair.
type Key = (usize, usize);

/// What a chunk keeps of a micro-batch between its forward and backward.
struct InFlight {
    /// The chunk's input (with its gradient after the backward; None on
    /// chunk 0).
    input: Option<Tensor>,
    /// The output to back-propagate the next chunk's gradient through
    /// (None on the last chunk, whose backward ran with its forward).
    output: Option<Tensor>,
    /// The output's posted sends to the next chunk's rank: complete once
    /// its gradient for this micro-batch has arrived (it needed them).
    sent: Vec<Posted>,
    /// Activation checkpointing (or ZeRO-3's one block a segment): the
    /// chunk's segments, what their forward kept and packed rows' inputs.
    kept: Option<Kept>,
}

/// What a chunk run in segments keeps of a micro-batch's forward.
type Kept = (Recompute, Vec<Tensor>, Option<Tensor>);

/// The window's state between its ops.
struct Run {
    pipe: Pipe,
    layout: Layout,
    /// The window's micro-batches (their plan indices) and which are empty.
    micros: Vec<usize>,
    empty: Vec<bool>,
    /// Received activations and gradients, by the chunk they are for.
    inputs: HashMap<Key, Tensor>,
    grads: HashMap<Key, Tensor>,
    flight: HashMap<Key, InFlight>,
    /// Inputs' gradients computed and not yet sent.
    input_grads: HashMap<Key, Tensor>,
    stash: Stash,
    /// Posted gradient sends (waited for at the window's end).
    sends: Vec<Posted>,
    bubble: Duration,
    transfer: Duration,
}

impl Run {
    fn blocks(&self, chunk: usize) -> std::ops::Range<usize> {
        self.pipe.chunks[self.layout.local(chunk)].clone()
    }
}

impl<C: Collective> Engine<C> {
    /// The whole window of a pipeline rank: its schedule's op list, then
    /// the sync step.
    pub(in crate::engine) fn pipeline_window(&mut self) -> Result<StepReport> {
        let pipe = self
            .pipe
            .clone()
            .ok_or_else(|| Error::Schedule("a pipeline window on a job without stages".into()))?;
        let started = Instant::now();
        self.window.started = Some(started);
        self.window.bytes_at_start = self.collective.bytes();
        self.graph.zero_loss(self.device)?;
        if let crate::cuda::graphs::Mode::Off(reason) = self.graph.mode().clone() {
            self.window.eager_reason = Some(self.graph.holder.eager("micro-steps", &reason));
        }
        let micros: Vec<usize> = self
            .step_schedule
            .window(&self.plan, self.state.cursor as usize)
            .into_iter()
            .filter_map(|op| match op {
                Op::Micro { index } => Some(index),
                Op::Sync => None,
            })
            .collect();
        // ZeRO-3 shards the parameters before the first forward; with
        // gradients by unit the flat buffer stays unallocated.
        self.shard_params()?;
        if !self.zero3_by_unit {
            self.placement.grads.restore(&self.model.params)?;
        }
        let layout = pipe.layout();
        let ops = rank_ops(pipe.schedule, &layout, pipe.stage, micros.len());
        let empty = micros
            .iter()
            .map(|&m| {
                let (a, b) = self.plan.micro_batch_range(m);
                a == b
            })
            .collect();
        let mut run = Run {
            pipe,
            layout,
            micros,
            empty,
            inputs: HashMap::new(),
            grads: HashMap::new(),
            flight: HashMap::new(),
            input_grads: HashMap::new(),
            stash: Stash::default(),
            sends: Vec::new(),
            bubble: Duration::ZERO,
            transfer: Duration::ZERO,
        };
        // sync = every_step: each micro-batch's gradients are reduced over
        // the rank's data group where its backward ends on this rank (the
        // last chunk's inside its forward), an empty micro-batch's too, so
        // every replica of a rank reduces at the same ops.
        let every = self.spec.accumulation.sync == crate::spec::SyncMode::EveryStep;
        for op in ops {
            self.run_op(&mut run, op)?;
            let ends = match op {
                PipeOp::SendGradient { chunk, micro } if layout.local(chunk) == 0 => Some(micro),
                PipeOp::Backward { chunk: 0, micro } => Some(micro),
                _ => None,
            };
            if let (true, Some(_)) = (every, ends) {
                // A tied head's gradient of this micro-batch joins the
                // embedding's before the first rank reduces.
                self.pipeline_tied_micro(&mut run.sends)?;
                if !layout.is_last(layout.global(run.pipe.stage, 0)) {
                    self.pipeline_reduce_micro()?;
                }
            }
        }
        let t = Instant::now();
        for (s, _keep) in std::mem::take(&mut run.sends) {
            s.wait().map_err(group_err)?;
        }
        run.transfer += t.elapsed();
        let left = run.stash.left();
        if !left.is_empty() || !run.flight.is_empty() {
            return Err(Error::Schedule(format!(
                "pipeline rank {} ended its window with messages nobody received {left:?} and {} micro-batches without their backward",
                run.pipe.stage,
                run.flight.len()
            )));
        }
        let k = run.micros.len();
        self.window.micro += k;
        self.state.micro_step += k as u64;
        self.window.bubble += run.bubble;
        self.window.transfer += run.transfer;
        self.window.compute += started.elapsed().saturating_sub(run.bubble + run.transfer);
        self.sync_step()
    }

    /// One op of the list.
    fn run_op(&mut self, run: &mut Run, op: PipeOp) -> Result<()> {
        let device = self.device;
        let layout = run.layout;
        match op {
            PipeOp::Forward { chunk, micro } => return self.pipe_forward(run, chunk, micro),
            PipeOp::Backward { chunk, micro } => return self.pipe_backward(run, chunk, micro),
            _ => {}
        }
        let (chunk, micro) = match op {
            PipeOp::RecvActivation { chunk, micro }
            | PipeOp::SendActivation { chunk, micro }
            | PipeOp::RecvGradient { chunk, micro }
            | PipeOp::SendGradient { chunk, micro } => (chunk, micro),
            PipeOp::Forward { .. } | PipeOp::Backward { .. } => return Ok(()),
        };
        if run.empty[micro] {
            return Ok(());
        }
        let key = (chunk, micro);
        let t = Instant::now();
        let g = self.mesh.group(&mut self.collective, Axis::Pipeline)?;
        if let Some((from, want)) = op.receives(&layout) {
            let x = run.stash.recv(g, from, want, device)?;
            match want.kind {
                MsgKind::Activation => run.inputs.insert(key, x),
                MsgKind::Gradient => run.grads.insert(key, x),
            };
            run.bubble += t.elapsed();
            return Ok(());
        }
        let Some((to, msg)) = op.sends(&layout) else {
            return Ok(());
        };
        match msg.kind {
            MsgKind::Activation => {
                let f = run
                    .flight
                    .get_mut(&key)
                    .ok_or_else(|| missing("forward", key))?;
                let out = f
                    .output
                    .as_ref()
                    .ok_or_else(|| missing("output", key))?
                    .f_detach()
                    .ctx("sending an activation")?;
                f.sent = send_msg(g, msg, out, to)?;
            }
            MsgKind::Gradient => {
                let grad = run
                    .input_grads
                    .remove(&key)
                    .ok_or_else(|| missing("backward", key))?;
                run.sends.extend(send_msg(g, msg, grad, to)?);
            }
        }
        run.transfer += t.elapsed();
        Ok(())
    }

    /// The forward of `micro` through `chunk` (on the last chunk with the
    /// head, the loss and its backward).
    fn pipe_forward(&mut self, run: &mut Run, chunk: usize, micro: usize) -> Result<()> {
        let last = run.layout.is_last(chunk);
        let blocks = run.blocks(chunk);
        // The blocks in segments: activation checkpointing, or ZeRO-3.
        let segmented = self.stage_recompute(blocks.clone());
        let zero3 = segmented.as_ref().filter(|_| self.spec.sharding.stage == 3);
        let every = self.spec.accumulation.sync == crate::spec::SyncMode::EveryStep;
        let packed = self.spec.data.pack;
        if run.empty[micro] {
            // ZeRO-3: the rank's other data ranks gather (and reduce) unit
            // by unit meanwhile; this one takes part (its backward's share
            // at the micro-batch's backward, on the last chunk now).
            match zero3 {
                Some(rc) if last => self.zero3_empty_micro_step(rc)?,
                Some(rc) => self.zero3_empty_forward(&rc.segments)?,
                None => {}
            }
            if every && last {
                self.pipeline_reduce_micro()?;
            }
            return Ok(());
        }
        let (a, b) = self.plan.micro_batch_range(run.micros[micro]);
        // Packed rows: every chunk reads the rows' positions.
        let batch = if chunk == 0 || last || packed {
            let idx = self.micro_batch_indices(a, b)?;
            Some(self.train.batch(&idx)?)
        } else {
            None
        };
        let input = match chunk {
            0 => None,
            _ => Some(
                run.inputs
                    .remove(&(chunk, micro))
                    .ok_or_else(|| missing("input", (chunk, micro)))?
                    .set_requires_grad(true),
            ),
        };
        let x = match (&input, &batch) {
            (Some(x), _) => x.shallow_clone(),
            (None, Some(b)) => b.inputs.shallow_clone(),
            (None, None) => return Err(missing("batch", (chunk, micro))),
        };
        let inputs = batch
            .as_ref()
            .filter(|_| packed)
            .map(|b| b.inputs.shallow_clone());
        let last_batch = || Error::Schedule("the last chunk reads its batch".into());
        let (output, kept) = match &segmented {
            // Activation checkpointing: the chunk's blocks in segments,
            // recomputed in the backward; ZeRO-3: one block a segment,
            // each gathered (recompute.rs).
            Some(rc) if last => {
                let batch = batch.ok_or_else(last_batch)?;
                self.recompute_last(&batch, self.micro_scale(), rc, x)?;
                self.pipe_counted(&batch, every)?;
                (None, None)
            }
            Some(rc) => {
                let (out, saved) =
                    self.forward_segments(rc.keep, &rc.segments, x, inputs.as_ref())?;
                (Some(out), Some((rc.clone(), saved, inputs)))
            }
            None => {
                // precision = bf16 | fp16: the forward and the loss under
                // autocast, as one process's micro-step.
                let mut autocast =
                    crate::cuda::amp::Autocast::enter_with(self.device, self.spec.precision, true)?;
                let staged = self.model.staged().ok_or_else(|| {
                    Error::Schedule("this model does not run in pipeline stages".into())
                })?;
                let out = staged.stage_forward_with(&x, blocks, inputs.as_ref())?;
                if last {
                    // The head (a Headed model's chunk ends at its
                    // features), the loss and its backward.
                    let batch = batch.ok_or_else(last_batch)?;
                    let summed =
                        self.spec.accumulation.normalize == crate::spec::Normalize::GlobalCount;
                    let loss_sum = if summed && self.head_loss_applies() {
                        self.head_loss_of(&out, &batch, false)?
                    } else {
                        let logits = self.stage_logits(out)?;
                        // fp16: the backward of loss * scale / k, as
                        // GradScaler's scaler.scale(loss / k).
                        self.loss_backward(&logits, &batch, self.micro_scale(), autocast.take())?
                    };
                    self.graph.add_loss(&loss_sum)?;
                    self.pipe_counted(&batch, every)?;
                    (None, None)
                } else {
                    drop(autocast);
                    (Some(out), None)
                }
            }
        };
        run.flight.insert(
            (chunk, micro),
            InFlight {
                input,
                output,
                sent: Vec::new(),
                kept,
            },
        );
        // Fault-injection tests: a micro-step that lasts.
        if let Some(d) = self.opts.micro_step_delay {
            std::thread::sleep(d);
        }
        Ok(())
    }

    /// The last chunk's micro-batch counted (its loss terms and one
    /// non-empty micro-batch) and, under `every_step`, reduced.
    fn pipe_counted(&mut self, batch: &crate::source::batch::Batch, every: bool) -> Result<()> {
        self.window.count += batch.count;
        self.window.batches += 1;
        if every {
            self.pipeline_reduce_micro()?;
        }
        Ok(())
    }

    /// The backward of `micro` through `chunk` from its output's gradient
    /// (the last chunk's ran with its forward), keeping its input's
    /// gradient for the send.
    fn pipe_backward(&mut self, run: &mut Run, chunk: usize, micro: usize) -> Result<()> {
        let key = (chunk, micro);
        let Some(f) = run.flight.remove(&key) else {
            // ZeRO-3: an empty micro-batch's share of its chunk's backward
            // collectives (the last chunk's ran with its forward).
            if !run.layout.is_last(chunk) {
                let zero3 = self
                    .stage_recompute(run.blocks(chunk))
                    .filter(|_| self.spec.sharding.stage == 3);
                if let Some(rc) = zero3 {
                    self.zero3_empty_backward(&rc.segments)?;
                }
            }
            return Ok(());
        };
        let InFlight {
            input,
            output,
            sent,
            kept,
        } = f;
        if let Some(output) = output {
            let grad = run
                .grads
                .remove(&key)
                .ok_or_else(|| missing("gradient", key))?;
            // The next chunk computed this gradient from the activation:
            // its sends are complete.
            for (posted, _activation) in sent {
                posted.wait().map_err(group_err)?;
            }
            // backward(grad): the backward of sum(output * grad), whose
            // gradient at the output is `grad` exactly (recomputed first
            // under activation checkpointing).
            match kept {
                Some((rc, saved, inputs)) => {
                    self.backward_segments(rc.keep, &rc.segments, saved, grad, inputs.as_ref())?
                }
                None => output
                    .f_mul(&grad)
                    .and_then(|y| y.f_sum(Kind::Float))
                    .and_then(|y| y.f_backward())
                    .ctx("running backward")?,
            }
        }
        if let Some(x) = input {
            run.input_grads.insert(key, x.grad());
        }
        Ok(())
    }
}

/// An op that finds what an earlier op of the list should have left.
fn missing(what: &str, (chunk, micro): Key) -> Error {
    Error::Schedule(format!(
        "pipeline schedule: no {what} for chunk {chunk}, micro-batch {micro} (an op list out of order)"
    ))
}
