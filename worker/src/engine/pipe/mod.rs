//! Pipeline parallelism in the engine (issue 40): this rank's stage, its
//! window run as the schedule's forwards and backwards with the
//! activations and their gradients crossing to the neighbouring stages,
//! and what the sync step, evaluation and checkpoints add over the
//! pipeline group (engine/trainer/pipeline.rs has the schedules; the
//! family's `Staged` runs a stage's blocks).
//!
//! The window (pipe/window.rs) runs the rank's op list from the schedule:
//! every transfer carries a small i64 header (what it is, for which chunk
//! and micro-batch, its shape and type: pipe/channel.rs), so the receiver
//! needs no shape rules and takes its own message whatever the order.
//! Sends are posted and waited for later (the schedules are deadlock-free
//! that way: `pipeline::simulate`), an activation's once the next chunk's
//! gradient for it has arrived. Under interleaved 1F1B a rank holds V
//! chunks of the model (`Pipe::chunks`). A tied embedding's two copies
//! are kept in step by pipe/tied.rs. Every stage reads the micro-batch's indices; the
//! first stage its inputs, the last its targets. Only the last stage counts
//! loss terms and non-empty micro-batches; the sync step sums the tally
//! over the stages before any division, so every stage divides by the same
//! N.

use super::trainer::pipeline::{Layout, PipeSchedule};
use super::Engine;
use crate::comm::collective::Collective;
use crate::error::{Error, Result, TorchContext};
use crate::spec::Axis;
use std::collections::HashSet;
use std::ops::Range;
use std::time::Instant;
use tch::Tensor;

mod channel;
mod plan;
mod tied;
mod window;
mod wire;

pub(in crate::engine) use plan::plan;
use wire::{group_err, recv_with_shape, send_with_shape, sum_over};

/// This rank's place in the pipeline.
#[derive(Debug, Clone)]
pub(super) struct Pipe {
    pub stage: usize,
    pub stages: usize,
    pub schedule: PipeSchedule,
    /// The family's blocks of each model chunk this rank runs, in order:
    /// its global chunks rank, P + rank, ... (one but for interleaved
    /// 1F1B; chunk 0 holds the embedding, the last chunk the head).
    pub chunks: Vec<Range<usize>>,
    /// A tied embedding: its name. The first stage trains it (embedding);
    /// the last uses a copy as its head, sends its gradient to the first
    /// before the data reduction and takes the updated values after the
    /// step, so the norm, the optimizer state and ZeRO's shards see it
    /// once.
    pub tied: Option<String>,
}

impl Pipe {
    /// P ranks of V chunks.
    pub fn layout(&self) -> Layout {
        Layout::new(self.stages, self.chunks.len())
    }
    /// The blocks from this rank's first chunk's start to its last's end:
    /// all of them with one chunk (what ZeRO-3 in stages shards, which
    /// interleaved 1F1B does not run with).
    pub fn blocks(&self) -> Range<usize> {
        let start = self.chunks.first().map_or(0, |c| c.start);
        start..self.chunks.last().map_or(start, |c| c.end)
    }
}

impl<C: Collective> Engine<C> {
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
        if !self.mesh.tally_axes().contains(&Axis::Pipeline) {
            return Ok(());
        }
        let t = Tensor::f_from_slice(stats).ctx("summing the tally over the stages")?;
        sum_over(self.mesh.group(&mut self.collective, Axis::Pipeline)?, &t)?;
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
        if !self.mesh.has(Axis::Pipeline) {
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
        let Some((stage, stages)) = self.mesh.stages() else {
            return Ok(vec![mine.to_vec()]);
        };
        let n = mine.len();
        let mut slots = vec![0i64; stages * n];
        for (i, v) in mine.iter().enumerate() {
            slots[stage * n + i] = v.to_bits() as i64;
        }
        let t = Tensor::f_from_slice(&slots).ctx("gathering over the stages")?;
        sum_over(self.mesh.group(&mut self.collective, Axis::Pipeline)?, &t)?;
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
            let ends = self.mesh.is_first_stage() || self.mesh.is_last_stage();
            let batch = if ends || packed {
                Some(eval.range(start, len, self.device)?)
            } else {
                None
            };
            if let Some(b) = &batch {
                read = Some(read.unwrap_or(0) + b.count);
            }
            // Through the chunks in order: rank 0's chunk 0, rank 1's
            // chunk 1, ..., rank 0's chunk P, ... (one at a time, so each
            // channel's messages come in order).
            let layout = pipe.layout();
            for (v, blocks) in pipe.chunks.iter().enumerate() {
                let chunk = layout.global(pipe.stage, v);
                let x = match &batch {
                    Some(b) if chunk == 0 => b.inputs.shallow_clone(),
                    _ => {
                        let (device, from) = (self.device, layout.rank_of(chunk - 1));
                        recv_with_shape(
                            self.mesh.group(&mut self.collective, Axis::Pipeline)?,
                            from,
                            device,
                        )?
                    }
                };
                let inputs = batch.as_ref().filter(|_| packed).map(|b| &b.inputs);
                let out = self.blocks_forward(&x, blocks.clone(), inputs)?;
                if layout.is_last(chunk) {
                    let batch = batch
                        .as_ref()
                        .ok_or_else(|| Error::Schedule("the last stage reads its batch".into()))?;
                    let logits = self.stage_logits(out)?;
                    sums.add(self.objective.evaluate(&logits, batch)?);
                } else {
                    let g = self.mesh.group(&mut self.collective, Axis::Pipeline)?;
                    for (p, _keep) in send_with_shape(g, out, layout.rank_of(chunk + 1))? {
                        p.wait().map_err(group_err)?;
                    }
                }
            }
            start += len;
        }
        Ok((sums, read))
    }
}
