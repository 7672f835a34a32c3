//! Pipeline parallelism in the engine (issue 40): this rank's stage, its
//! window run as the schedule's forwards and backwards with the
//! activations and their gradients crossing to the neighbouring stages,
//! and what the sync step, evaluation and checkpoints add over the
//! pipeline group (engine/trainer/pipeline.rs has the schedules; the
//! family's `Staged` runs a stage's blocks).
//!
//! Transfers: a forward's output is sent with a small i64 header (its
//! rank and dims) so the next stage needs no shape rules; its gradient
//! comes back with the shape the sender knows (pipe/wire.rs). Sends are
//! posted and waited for at the end of the window (the schedules are
//! deadlock-free that way: `pipeline::simulate`), an activation's once the
//! next stage's gradient for it has arrived. A tied embedding's two copies
//! are kept in step by pipe/tied.rs. Every stage reads the micro-batch's indices; the
//! first stage its inputs, the last its targets. Only the last stage counts
//! loss terms and non-empty micro-batches; the sync step sums the tally
//! over the stages before any division, so every stage divides by the same
//! N.

use super::recompute::Recompute;
use super::trainer::pipeline::{rank_ops, Layout, PipeOp, PipeSchedule};
use super::trainer::Op;
use super::{Engine, StepReport};
use crate::comm::collective::Collective;
use crate::error::{Error, Result, TorchContext};
use std::collections::HashSet;
use std::ops::Range;
use std::time::{Duration, Instant};
use tch::{Kind, Tensor};

mod plan;
mod tied;
mod wire;

pub(in crate::engine) use plan::plan;
use wire::{group_err, recv_into, recv_with_shape, send_with_shape, sum_over, Posted};

/// This rank's place in the pipeline.
#[derive(Debug, Clone)]
pub(super) struct Pipe {
    pub stage: usize,
    pub stages: usize,
    pub schedule: PipeSchedule,
    /// The family's blocks this stage runs.
    pub blocks: Range<usize>,
    /// A tied embedding: its name. The first stage trains it (embedding);
    /// the last uses a copy as its head, sends its gradient to the first
    /// before the data reduction and takes the updated values after the
    /// step, so the norm, the optimizer state and ZeRO's shards see it
    /// once.
    pub tied: Option<String>,
}

impl Pipe {
    pub fn is_first(&self) -> bool {
        self.stage == 0
    }
    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }
}

/// What a stage keeps of a micro-batch between its forward and backward.
struct InFlight {
    /// The stage's input (with its gradient after the backward; None on
    /// the first stage).
    input: Option<Tensor>,
    /// The output to back-propagate the next stage's gradient through
    /// (None on the last stage, which runs its backward with its forward,
    /// as one process's micro-step does).
    output: Option<Tensor>,
    /// The output's posted sends to the next stage: complete once that
    /// stage's gradient for this micro-batch has arrived (it needed them),
    /// waited for then, so the activation's storage goes with the
    /// backward instead of at the window's end.
    sent: Vec<Posted>,
    /// Activation checkpointing (or ZeRO-3's one block a segment): the
    /// stage's segments, what their forward kept (each one's input, and
    /// under ZeRO-3 without recomputing its output with its graph) and
    /// packed rows' inputs.
    kept: Option<Kept>,
}

/// What a stage run in segments keeps of a micro-batch's forward.
type Kept = (Recompute, Vec<Tensor>, Option<Tensor>);

impl<C: Collective> Engine<C> {
    /// The whole window of a pipeline stage: the schedule's forwards and
    /// backwards of its micro-batches, then the sync step.
    pub(super) fn pipeline_window(&mut self) -> Result<StepReport> {
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
        // The blocks in segments: activation checkpointing, or ZeRO-3.
        let segmented = self.stage_recompute(&pipe);
        let zero3 = segmented.as_ref().filter(|_| self.spec.sharding.stage == 3);
        let layout = Layout::new(pipe.stages, 1);
        let ops = rank_ops(pipe.schedule, &layout, pipe.stage, micros.len());
        let mut flight: Vec<Option<InFlight>> = (0..micros.len()).map(|_| None).collect();
        let mut sends: Vec<Posted> = Vec::new();
        let (mut bubble, mut transfer) = (Duration::ZERO, Duration::ZERO);
        let summed = self.spec.accumulation.normalize == crate::spec::Normalize::GlobalCount;
        // sync = every_step: each micro-batch's gradients are reduced over
        // the stage's data group where its backward ends on this stage
        // (the last stage's inside its forward), an empty micro-batch's
        // too, so every replica of a stage reduces at the same ops.
        let every = self.spec.accumulation.sync == crate::spec::SyncMode::EveryStep;
        let packed = self.spec.data.pack;
        for op in ops {
            match op {
                PipeOp::Forward { micro, .. } => {
                    let (a, b) = self.plan.micro_batch_range(micros[micro]);
                    if b == a {
                        // ZeRO-3: the stage's other data ranks gather
                        // (and reduce) unit by unit meanwhile; this one
                        // takes part (its backward's share at the
                        // micro-batch's backward, on the last stage now).
                        match zero3 {
                            Some(rc) if pipe.is_last() => self.zero3_empty_micro_step(rc)?,
                            Some(rc) => self.zero3_empty_forward(&rc.segments)?,
                            None => {}
                        }
                        if every && pipe.is_last() {
                            self.pipeline_reduce_micro()?;
                        }
                        continue;
                    }
                    let idx = self.micro_batch_indices(a, b)?;
                    // Packed rows: every stage reads the rows' positions.
                    let batch = if pipe.is_first() || pipe.is_last() || packed {
                        Some(self.train.batch(&idx)?)
                    } else {
                        None
                    };
                    let input = if pipe.is_first() {
                        None
                    } else {
                        let t = Instant::now();
                        let g = self.collective.pipeline_group()?;
                        let x = recv_with_shape(g, pipe.stage - 1, self.device)?;
                        bubble += t.elapsed();
                        Some(x.set_requires_grad(true))
                    };
                    let x = match (&input, &batch) {
                        (Some(x), _) => x.shallow_clone(),
                        (None, Some(b)) => b.inputs.shallow_clone(),
                        (None, None) => unreachable!("the first stage reads its batch"),
                    };
                    // Activation checkpointing: the stage's blocks in
                    // segments, recomputed in the backward; ZeRO-3: one
                    // block a segment, each gathered (recompute.rs).
                    if let Some(rc) = &segmented {
                        let inputs = batch
                            .as_ref()
                            .filter(|_| packed)
                            .map(|b| b.inputs.shallow_clone());
                        let (output, sent, kept) = if pipe.is_last() {
                            let batch = batch.ok_or_else(|| {
                                Error::Schedule("the last stage reads its batch".into())
                            })?;
                            self.recompute_last(&batch, self.micro_scale(), rc, x)?;
                            self.window.count += batch.count;
                            self.window.batches += 1;
                            if every {
                                self.pipeline_reduce_micro()?;
                            }
                            (None, Vec::new(), None)
                        } else {
                            let (out, saved) =
                                self.forward_segments(rc.keep, &rc.segments, x, inputs.as_ref())?;
                            let t = Instant::now();
                            let g = self.collective.pipeline_group()?;
                            let detached = out.f_detach().ctx("sending an activation")?;
                            let sent = send_with_shape(g, detached, pipe.stage + 1)?;
                            transfer += t.elapsed();
                            (Some(out), sent, Some((rc.clone(), saved, inputs)))
                        };
                        flight[micro] = Some(InFlight {
                            input,
                            output,
                            sent,
                            kept,
                        });
                        if let Some(d) = self.opts.micro_step_delay {
                            std::thread::sleep(d);
                        }
                        continue;
                    }
                    // precision = bf16 | fp16: the forward and the loss
                    // under autocast, as one process's micro-step.
                    let mut autocast = crate::cuda::amp::Autocast::enter_with(
                        self.device,
                        self.spec.precision,
                        true,
                    )?;
                    let staged = self.model.staged().ok_or_else(|| {
                        Error::Schedule("this model does not run in pipeline stages".into())
                    })?;
                    let inputs = batch.as_ref().filter(|_| packed).map(|b| &b.inputs);
                    let out = staged.stage_forward_with(&x, pipe.blocks.clone(), inputs)?;
                    let mut sent = Vec::new();
                    let output = if pipe.is_last() {
                        // The head (a Headed model's stage ends at its
                        // features), the loss and its backward, as one
                        // process's micro-step computes them.
                        let batch = batch.ok_or_else(|| {
                            Error::Schedule("the last stage reads its batch".into())
                        })?;
                        let loss_sum = if summed && self.head_loss_applies() {
                            self.head_loss_of(&out, &batch, false)?
                        } else {
                            let logits = self.stage_logits(out)?;
                            // fp16: the backward of loss * scale / k, as
                            // GradScaler's scaler.scale(loss / k).
                            self.loss_backward(
                                &logits,
                                &batch,
                                self.micro_scale(),
                                autocast.take(),
                            )?
                        };
                        self.graph.add_loss(&loss_sum)?;
                        self.window.count += batch.count;
                        self.window.batches += 1;
                        if every {
                            self.pipeline_reduce_micro()?;
                        }
                        None
                    } else {
                        drop(autocast);
                        let t = Instant::now();
                        let g = self.collective.pipeline_group()?;
                        let detached = out.f_detach().ctx("sending an activation")?;
                        sent = send_with_shape(g, detached, pipe.stage + 1)?;
                        transfer += t.elapsed();
                        Some(out)
                    };
                    flight[micro] = Some(InFlight {
                        input,
                        output,
                        sent,
                        kept: None,
                    });
                    // Fault-injection tests: a micro-step that lasts.
                    if let Some(d) = self.opts.micro_step_delay {
                        std::thread::sleep(d);
                    }
                }
                PipeOp::Backward { micro, .. } => {
                    let f = flight[micro].take();
                    // ZeRO-3: an empty micro-batch's share of its stage's
                    // backward collectives (the last stage's ran above).
                    if let (None, Some(rc), false) = (&f, zero3, pipe.is_last()) {
                        self.zero3_empty_backward(&rc.segments)?;
                    }
                    if let Some(f) = f {
                        // The last stage's backward ran with its forward.
                        if let Some(output) = &f.output {
                            let grad = output.f_zeros_like().ctx("receiving a gradient")?;
                            let t = Instant::now();
                            let g = self.collective.pipeline_group()?;
                            recv_into(g, &grad, pipe.stage + 1, "receiving a gradient")?;
                            bubble += t.elapsed();
                            // The next stage computed this gradient from
                            // the activation: its sends are complete.
                            for (posted, _activation) in f.sent {
                                posted.wait().map_err(group_err)?;
                            }
                            // backward(grad): the backward of sum(output * grad),
                            // whose gradient at the output is `grad` exactly
                            // (recomputed first under activation checkpointing).
                            match f.kept {
                                Some((rc, saved, inputs)) => self.backward_segments(
                                    rc.keep,
                                    &rc.segments,
                                    saved,
                                    grad,
                                    inputs.as_ref(),
                                )?,
                                None => output
                                    .f_mul(&grad)
                                    .and_then(|y| y.f_sum(Kind::Float))
                                    .and_then(|y| y.f_backward())
                                    .ctx("running backward")?,
                            }
                        }
                        if let Some(x) = f.input {
                            let t = Instant::now();
                            let g = self.collective.pipeline_group()?;
                            let g_in =
                                x.grad().f_to_device(g.device()).ctx("sending a gradient")?;
                            sends.push((g.send(&g_in, pipe.stage - 1).map_err(group_err)?, g_in));
                            transfer += t.elapsed();
                        }
                    }
                    if every {
                        // A tied head's gradient of this micro-batch joins
                        // the embedding's before the first stage reduces.
                        self.pipeline_tied_micro(&mut sends)?;
                        if !pipe.is_last() {
                            self.pipeline_reduce_micro()?;
                        }
                    }
                }
                // (The transfers run inside the forwards and backwards.)
                _ => {}
            }
        }
        let t = Instant::now();
        for (s, _keep) in sends {
            s.wait().map_err(group_err)?;
        }
        transfer += t.elapsed();
        self.window.micro += micros.len();
        self.state.micro_step += micros.len() as u64;
        self.window.bubble += bubble;
        self.window.transfer += transfer;
        self.window.compute += started.elapsed().saturating_sub(bubble + transfer);
        self.sync_step()
    }

    /// The model's output from the last stage's: a headed model's stage
    /// ends at its features, the head makes the logits.
    pub(super) fn stage_logits(&self, out: Tensor) -> Result<Tensor> {
        match self.model.headed() {
            // fp32 logits whatever the autocast type, as the whole model's
            // head gives them.
            Some(h) => h.logits(&out),
            None => Ok(out),
        }
    }

    /// The sync step's tally summed over the stages (only the last stage
    /// counted terms; any stage may ask to stop or checkpoint).
    pub(super) fn pipeline_tally(&mut self, stats: &mut [f32]) -> Result<()> {
        if self.pipe.is_none() {
            return Ok(());
        }
        let t = Tensor::f_from_slice(stats).ctx("summing the tally over the stages")?;
        sum_over(self.collective.pipeline_group()?, &t)?;
        let summed = Vec::<f32>::try_from(&t).ctx("summing the tally over the stages")?;
        stats.copy_from_slice(&summed);
        Ok(())
    }

    /// sync = every_step: one micro-batch's gradients reduced over the
    /// stage's data group into the window's sums (the buffer back for the
    /// next backward: ZeRO 2 frees it).
    fn pipeline_reduce_micro(&mut self) -> Result<()> {
        let t = Instant::now();
        self.reduce_micro_step()?;
        if !self.zero3_by_unit {
            self.placement.grads.restore(&self.model.params)?;
        }
        self.window.comm += t.elapsed();
        Ok(())
    }

    /// The whole model's gradient norm from this stage's: squares summed
    /// over the stages (max for inf); a tied embedding is the first stage's
    /// only.
    pub(super) fn pipeline_norm(&mut self, norm: f64, norm_type: f64) -> Result<f64> {
        if self.pipe.is_none() {
            return Ok(norm);
        }
        let inf = norm_type.is_infinite();
        let mine = if inf { norm } else { norm.powf(norm_type) };
        let each: Vec<f64> = self
            .pipeline_each(&[mine])?
            .into_iter()
            .map(|v| v[0])
            .collect();
        Ok(if inf {
            each.into_iter().fold(0.0, f64::max)
        } else {
            each.into_iter().sum::<f64>().powf(1.0 / norm_type)
        })
    }

    /// Every stage's `mine` (a few values), in stage order, exactly: f64
    /// bits in i64 slots of their own, the others 0, summed over the
    /// pipeline group in one reduction.
    fn pipeline_each(&mut self, mine: &[f64]) -> Result<Vec<Vec<f64>>> {
        let Some(pipe) = &self.pipe else {
            return Ok(vec![mine.to_vec()]);
        };
        let n = mine.len();
        let mut slots = vec![0i64; pipe.stages * n];
        for (i, v) in mine.iter().enumerate() {
            slots[pipe.stage * n + i] = v.to_bits() as i64;
        }
        let t = Tensor::f_from_slice(&slots).ctx("gathering over the stages")?;
        sum_over(self.collective.pipeline_group()?, &t)?;
        let back = Vec::<i64>::try_from(&t).ctx("gathering over the stages")?;
        Ok(back
            .chunks(n.max(1))
            .map(|c| c.iter().map(|&b| f64::from_bits(b as u64)).collect())
            .collect())
    }
}

impl<C: Collective> Engine<C> {
    /// The optimizer state of this stage's parameters out of a whole
    /// checkpoint's (`<param>.<state>` names).
    pub(super) fn stage_optimizer_state(
        &self,
        saved: Vec<(String, Tensor)>,
    ) -> Vec<(String, Tensor)> {
        if self.pipe.is_none() {
            return saved;
        }
        let mine: HashSet<&str> = self.model.params.iter().map(|(n, _)| n.as_str()).collect();
        saved
            .into_iter()
            .filter(|(n, _)| n.rsplit_once('.').is_some_and(|(p, _)| mine.contains(p)))
            .collect()
    }
}

impl<C: Collective> Engine<C> {
    /// The held-out split through the stages in chunks of `bs` rows: the
    /// first stage reads the inputs, the last the targets and sums the
    /// metrics, which every stage then takes from it.
    pub(super) fn pipeline_eval(
        &mut self,
        eval: &dyn crate::source::DataSource,
        bs: i64,
    ) -> Result<(crate::objective::EvalSums, Option<u64>)> {
        let pipe = self.pipe.clone().ok_or_else(|| {
            Error::Schedule("a pipeline evaluation on a job without stages".into())
        })?;
        let (sums, read) = self.pipeline_eval_on(&pipe, eval, bs)?;
        // The last stage's sums on every stage (exact: f64, and counts
        // below 2^53).
        let each = self.pipeline_each(&[sums.loss_sum, sums.count as f64, sums.correct as f64])?;
        let last = each.last().cloned().unwrap_or_else(|| vec![0.0; 3]);
        Ok((
            crate::objective::EvalSums {
                loss_sum: last[0],
                count: last[1] as u64,
                correct: last[2] as u64,
            },
            read,
        ))
    }

    fn pipeline_eval_on(
        &mut self,
        pipe: &Pipe,
        eval: &dyn crate::source::DataSource,
        bs: i64,
    ) -> Result<(crate::objective::EvalSums, Option<u64>)> {
        let mut sums = crate::objective::EvalSums::default();
        // The loss terms of the batches this stage read (None on a middle
        // stage that reads none).
        let mut read: Option<u64> = None;
        let n = eval.len() as i64;
        let mut start = 0;
        while start < n {
            let len = bs.min(n - start);
            let packed = self.spec.data.pack;
            let batch = if pipe.is_first() || pipe.is_last() || packed {
                Some(eval.range(start, len, self.device)?)
            } else {
                None
            };
            if let Some(b) = &batch {
                read = Some(read.unwrap_or(0) + b.count);
            }
            let x = match &batch {
                Some(b) if pipe.is_first() => b.inputs.shallow_clone(),
                _ => {
                    let device = self.device;
                    recv_with_shape(self.collective.pipeline_group()?, pipe.stage - 1, device)?
                }
            };
            let inputs = batch.as_ref().filter(|_| packed).map(|b| &b.inputs);
            let out = self.blocks_forward(&x, pipe.blocks.clone(), inputs)?;
            if pipe.is_last() {
                let batch = batch
                    .as_ref()
                    .ok_or_else(|| Error::Schedule("the last stage reads its batch".into()))?;
                let logits = self.stage_logits(out)?;
                sums.add(self.objective.evaluate(&logits, batch)?);
            } else {
                let g = self.collective.pipeline_group()?;
                for (p, _keep) in send_with_shape(g, out, pipe.stage + 1)? {
                    p.wait().map_err(group_err)?;
                }
            }
            start += len;
        }
        Ok((sums, read))
    }
}
