//! The window: micro-steps (forward, loss, backward into the accumulation
//! buffers) in the step schedule's order, and the sync step that commits
//! them as one optimizer step (the reductions, norm and step are the
//! placement's: engine/placement/; the commit is the trainer's accounting:
//! engine/trainer/accounting.rs), and the sample audit log.

use super::trainer::{Op, SyncOutcome};
use super::{grad_prep, Engine, StepReport};
use crate::comm::collective::Collective;
use crate::cuda::graphs::EagerReason;
use crate::error::{Error, Result, TorchContext};
use crate::grads::tally::WindowTally;
use crate::spec::{Axis, Normalize, SyncMode};
use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tch::Tensor;

/// The window in flight (not yet committed).
#[derive(Debug, Default)]
pub(super) struct Window {
    /// Micro-steps run in this window (the cursor advances by this).
    pub(super) micro: usize,
    /// What the step schedule says is left of this window
    /// (engine/trainer/step_schedule.rs), made at its first micro-step.
    ops: VecDeque<Op>,
    /// Non-empty micro-batches among them (`mean` divides by their global sum).
    pub(super) batches: usize,
    /// Loss terms of the window's batches ([`crate::source::batch::Batch::count`]).
    pub(super) count: u64,
    pub(super) started: Option<Instant>,
    pub(super) compute: Duration,
    pub(super) comm: Duration,
    /// A pipeline stage's waits for its neighbours, and its sends
    /// (engine/pipe/); not in `compute`.
    pub(super) bubble: Duration,
    pub(super) transfer: Duration,
    /// Collective byte counters when the window started.
    pub(super) bytes_at_start: (u64, u64),
    /// With a sample log: the data set indices this rank's reads fetched in
    /// this window, recorded where the reader is called, in reading order.
    read: Vec<i64>,
    /// Micro-steps that replayed the CUDA graph (engine/graph.rs).
    pub(super) graph_replays: u64,
    /// Why the window's last eager micro-step ran eagerly.
    pub(super) eager_reason: Option<EagerReason>,
    /// The sync step replayed its CUDA graph (engine/sync_graph.rs).
    pub(super) sync_replayed: bool,
    /// Why the sync step ran eagerly (None: on the device).
    pub(super) sync_eager_reason: Option<EagerReason>,
    /// ZeRO-3 with gradients by unit: this micro-step's backward reduced
    /// its units' gradients as it went.
    pub(super) units_reduced: bool,
}

impl Window {
    /// Whether a micro-step of this window has run (its sync step has not).
    pub(super) fn in_flight(&self) -> bool {
        self.micro > 0
    }
}

/// This rank's sample indices of one epoch: on the host (the sample log)
/// and on the device, copied there once per epoch, so that a micro-step
/// selects its batch without a host-to-device copy (and a CUDA graph can
/// take its indices from a device buffer).
#[derive(Debug)]
pub(super) struct EpochIndices {
    epoch: u64,
    host: Vec<i64>,
    device: Tensor,
}

impl<C: Collective> Engine<C> {
    /// Forgets the window in flight (its gradients and counts): the
    /// committed state stays as it is. The generation's tensor group is
    /// let go too (its groups close next; a new generation renews it).
    pub fn discard_window(&mut self) -> Result<()> {
        if let Some(t) = &self.tensor {
            t.cell.set(None);
        }
        let w = std::mem::take(&mut self.window);
        self.state.micro_step = self.state.micro_step.saturating_sub(w.micro as u64);
        self.placement.strategy.discard();
        // A last stage's tied head copy gathers its gradient apart.
        for (_, t) in &self.model.shared {
            let mut g = t.grad();
            if g.defined() {
                let _ = g.f_zero_().ctx("clearing the tied gradient")?;
            }
        }
        self.placement.grads.zero()
    }

    /// The device indices of micro-batch `a..b` of this rank's current
    /// epoch (a view of the epoch's index tensor), recorded for the sample
    /// log.
    pub(super) fn micro_batch_indices(&mut self, a: usize, b: usize) -> Result<Tensor> {
        let epoch = self.state.epoch;
        let e = match self.epoch_indices.take() {
            Some(e) if e.epoch == epoch => e,
            _ => {
                let host: Vec<i64> = self
                    .shard
                    .indices(self.collective.rank(), epoch)
                    .into_iter()
                    .map(|i| i as i64)
                    .collect();
                let device = Tensor::from_slice(&host)
                    .f_to_device(self.device)
                    .ctx("moving indices")?;
                EpochIndices {
                    epoch,
                    host,
                    device,
                }
            }
        };
        if self.opts.sample_log.is_some() {
            // The audit's record: the indices the reader is about to fetch.
            self.window.read.extend_from_slice(&e.host[a..b]);
        }
        let idx = e.device.f_narrow(0, a as i64, (b - a) as i64);
        self.epoch_indices = Some(e);
        idx.ctx("selecting a micro-batch")
    }

    /// Runs the next micro-step; on the window's last one also the sync step,
    /// whose report it returns.
    pub fn micro_step(&mut self) -> Result<Option<StepReport>> {
        if let Some(c) = &self.opts.control {
            if c.abort.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(Error::Interrupted(
                    "the coordinator aborted the window".into(),
                ));
            }
        }
        if self.mesh.has(Axis::Pipeline) {
            return self.pipeline_window().map(Some);
        }
        let started = Instant::now();
        if self.window.started.is_none() {
            self.window.started = Some(started);
            self.window.bytes_at_start = self.collective.bytes();
            self.graph.zero_loss(self.device)?;
            self.window.ops = self
                .step_schedule
                .window(&self.plan, self.state.cursor as usize);
        }
        let m = match self.window.ops.pop_front() {
            Some(Op::Micro { index }) => index,
            other => {
                return Err(Error::Schedule(format!(
                    "a micro-step expected, the schedule has {other:?}"
                )))
            }
        };
        let (a, b) = self.plan.micro_batch_range(m);
        // ZeRO-3 shards the parameters before the first forward (they are
        // whole after a build, a resume or a state broadcast).
        self.shard_params()?;
        // ZeRO stage 2 freed the buffer after the last reduction (ZeRO-3
        // with gradients by unit keeps it freed: each unit has its own).
        if !self.zero3_by_unit {
            self.placement.grads.restore(&self.model.params)?;
        }
        if b > a {
            // Eagerly, or as a CUDA graph (engine/graph.rs).
            self.window.count += self.run_micro_batch(a, b)?;
            self.window.batches += 1;
        } else if self.placement.strategy.stage() == 3 {
            // The other ranks gather and reduce unit by unit meanwhile.
            let plan = self
                .recompute
                .clone()
                .ok_or_else(|| Error::Sharding("stage 3 runs its blocks in segments".into()))?;
            self.zero3_empty_micro_step(&plan)?;
        }
        if let Some(d) = self.opts.micro_step_delay {
            std::thread::sleep(d);
        }
        self.window.micro += 1;
        self.state.micro_step += 1;
        self.window.compute += started.elapsed();
        if self.spec.accumulation.sync == SyncMode::EveryStep {
            let t = Instant::now();
            self.reduce_micro_step()?;
            self.window.comm += t.elapsed();
        }
        if self.window.ops.front() == Some(&Op::Sync) {
            self.window.ops.pop_front();
            return self.sync_step().map(Some);
        }
        self.most_grad_between = self.most_grad_between.max(self.gradient_bytes());
        Ok(None)
    }

    /// Forward, loss and backward of the micro-batch `idx` selects;
    /// gradients add into `.grad`, the loss summed over the batch into the
    /// window's loss accumulator; returns the batch's count of loss terms.
    /// fp16 scales the loss by `scale`; `graph` marks the graph body
    /// (autocast without its cast cache, which a capture must not keep).
    pub(super) fn forward_backward(
        &mut self,
        idx: &Tensor,
        scale: LossScaleBy<'_>,
        graph: bool,
    ) -> Result<u64> {
        // The graph body of a staged source reads the graph's batch buffers.
        let batch = match self.graph.staged_batch().filter(|_| graph) {
            Some(b) => b,
            None => self.train.batch(idx)?,
        };
        if let Some(plan) = self.recompute.clone() {
            return self.recompute_forward_backward(&batch, scale, &plan);
        }
        let summed = self.spec.accumulation.normalize == Normalize::GlobalCount;
        if summed && matches!(scale, LossScaleBy::One) {
            if let Some(loss_sum) = self.head_loss(&batch, graph)? {
                self.graph.add_loss(&loss_sum)?;
                return Ok(batch.count);
            }
        }
        // precision = bf16 | fp16: the forward and the loss under
        // autocast, as in torch.autocast's `with` block.
        let autocast =
            crate::cuda::amp::Autocast::enter_with(self.device, self.spec.precision, !graph)?;
        let output = self.model.forward(&batch.inputs, true)?;
        let loss_sum = self.loss_backward(&output, &batch, scale, autocast)?;
        self.graph.add_loss(&loss_sum)?;
        Ok(batch.count)
    }

    /// The loss of `output` (summed, or the batch's mean), the end of
    /// `autocast`, the loss's backward, and the batch's loss sum. fp16:
    /// the backward of loss * scale / k, so the half-precision backward
    /// sees what GradScaler's `scaler.scale(loss / k)` gives it (and
    /// overflows where it would).
    pub(super) fn loss_backward(
        &self,
        output: &Tensor,
        batch: &crate::source::batch::Batch,
        scale: LossScaleBy<'_>,
        autocast: Option<crate::cuda::amp::Autocast>,
    ) -> Result<Tensor> {
        let summed = self.spec.accumulation.normalize == Normalize::GlobalCount;
        let loss = if summed {
            self.objective.loss(output, batch)?.sum
        } else {
            self.objective.mean_loss(output, batch)?
        };
        drop(autocast);
        match scale {
            LossScaleBy::One => loss.f_backward(),
            LossScaleBy::Scalar(s) => loss.f_mul_scalar(s).and_then(|l| l.f_backward()),
            LossScaleBy::Tensor(s) => loss.f_mul(s).and_then(|l| l.f_backward()),
        }
        .ctx("running backward")?;
        if summed {
            loss.f_detach()
        } else {
            loss.f_detach()
                .and_then(|l| l.f_mul_scalar(batch.count as f64))
        }
        .ctx("accumulating the loss")
    }

    /// The forward and backward of a model whose output is a linear head
    /// (a language model) under a summed cross-entropy, in fp32: the head
    /// and the loss in one pass without the logits (crate::objective::head_loss),
    /// then the backward of the rest. Returns the batch's loss sum, or
    /// None (having done nothing) where it does not apply: another model
    /// or objective, autocast, or a head weight without a gradient buffer.
    /// In a graph's body every batch takes the masked path (a replay's
    /// batch may have ignored targets where the captured one had none).
    fn head_loss(
        &mut self,
        batch: &crate::source::batch::Batch,
        graph: bool,
    ) -> Result<Option<Tensor>> {
        if !self.head_loss_applies() {
            return Ok(None);
        }
        let Some(model) = self.model.headed() else {
            return Ok(None);
        };
        let features = model.features(&batch.inputs)?;
        self.head_loss_of(&features, batch, graph).map(Some)
    }

    /// Whether [`Engine::head_loss`] applies: a headed model under a summed
    /// cross-entropy in fp32 whose head weight has a gradient buffer.
    pub(super) fn head_loss_applies(&self) -> bool {
        self.model.headed().is_some_and(|m| {
            self.objective.is_summed_cross_entropy()
                && self.spec.precision == crate::spec::Precision::Fp32
                && m.head_weight().grad().defined()
        })
    }

    /// The head and the loss over `features` (with their graph) in one
    /// pass, the head's gradient added into its buffer and the rest
    /// back-propagated; returns the batch's loss sum (a pipeline's last
    /// stage runs it on its stage's output: engine/pipe/).
    pub(super) fn head_loss_of(
        &mut self,
        features: &Tensor,
        batch: &crate::source::batch::Batch,
        graph: bool,
    ) -> Result<Tensor> {
        let model = self
            .model
            .headed()
            .ok_or_else(|| Error::Schedule("the head's loss of a model without a head".into()))?;
        let weight = model.head_weight();
        let weight_grad = weight.grad();
        let flat = features
            .f_detach()
            .and_then(|f| {
                let h = f.size().last().copied().unwrap_or(0);
                f.f_reshape([-1, h])
            })
            .and_then(|f| Ok((f, batch.targets.f_reshape([-1])?)))
            .ctx("computing the loss");
        let (flat, targets) = flat?;
        let all_counted = !graph && batch.count == targets.numel() as u64;
        let vocab = weight.size().first().copied().unwrap_or(1);
        let rows = crate::objective::head_loss::block_rows(vocab, self.device);
        if let Some(shard) = model.vocab_shard() {
            // Tensor parallelism: this rank's vocabulary rows (issue 42).
            let group = shard.group.get().ctx("computing the loss")?;
            let out = crate::objective::head_loss::vocab_parallel_cross_entropy(
                &flat,
                weight,
                &weight_grad,
                &targets,
                shard.start,
                &group,
                rows,
            )?;
            crate::objective::head_loss::backward_into(features, &out.features_grad)?;
            return Ok(out.sum);
        }
        let out = crate::objective::head_loss::linear_cross_entropy(
            &flat,
            weight,
            &weight_grad,
            &targets,
            all_counted,
            rows,
        )?;
        crate::objective::head_loss::backward_into(features, &out.features_grad)?;
        Ok(out.sum)
    }

    /// sync = every_step: reduce this micro-step's gradients now and add
    /// them to the window's sums (as the placement keeps them).
    pub(super) fn reduce_micro_step(&mut self) -> Result<()> {
        if self.zero3_by_unit {
            // Each unit was reduced as its backward ended; a micro-step
            // without a backward reduces zeros, in the same order.
            if !std::mem::take(&mut self.window.units_reduced) {
                return Err(Error::Sharding(
                    "a micro-step under sharding.stage = 3 reduced no unit".into(),
                ));
            }
            return Ok(());
        }
        let (placement, mut parts) = self.placed();
        placement.reduce_micro_step(&mut parts)
    }

    /// The sync-step pipeline.
    pub fn sync_step(&mut self) -> Result<StepReport> {
        let _guard = tch::no_grad_guard();
        // The window's reads are on disk before this rank contributes to
        // the reduction: a window that commits has every rank's line, even
        // a rank killed right after it (a window that aborts leaves lines
        // too; its step is redone and the audit keeps the newest attempt).
        // Pipeline stages read the same indices: the first stage's line
        // speaks for its data rank.
        let logs = self.mesh.is_first_stage();
        if let Some(path) = self.opts.sample_log.clone().filter(|_| logs) {
            self.log_window(&path)?;
        }
        // 1. reduce the gradients over the data axis and the window's
        // tally over the loss owner's group (engine/placement/).
        let t_comm = Instant::now();
        let loss_sum = if self.window.batches > 0 {
            self.graph.loss_sum()?
        } else {
            0.0
        };
        // A stop or checkpoint request reaches each rank at its own time;
        // summed here, every rank honours it after the same step (under
        // sharding a checkpoint is a collective: ranks must agree).
        let (stop, checkpoint, leave) = match &self.opts.control {
            Some(c) => {
                let leave = c.leave.load(Ordering::SeqCst);
                (
                    c.stop.load(Ordering::SeqCst),
                    c.checkpoint_now.load(Ordering::SeqCst) || leave,
                    leave,
                )
            }
            None => (false, false, false),
        };
        let mut stats = WindowTally {
            count: self.window.count,
            batches: self.window.batches as u64,
            loss_sum,
            stop,
            checkpoint,
        }
        .encode()
        .to_vec();
        // Pipeline stages: a tied embedding's head gradient joins the
        // embedding's on the first stage before the data reduction, and
        // the tally is summed over the stages after it (engine/pipe/).
        self.pipeline_tied_grads()?;
        {
            let (placement, mut parts) = self.placed();
            placement.reduce(&mut parts, &mut stats)?;
        }
        self.pipeline_tally(&mut stats)?;
        let comm = self.window.comm + t_comm.elapsed();
        let global = WindowTally::decode(&stats);
        self.agreed = super::Agreed {
            stop: global.stop,
            checkpoint: global.checkpoint,
            leave,
        };
        if self.agreed.checkpoint {
            if let Some(c) = &self.opts.control {
                c.checkpoint_now.store(false, Ordering::SeqCst);
            }
        }
        let global_count = global.count;
        let global_micro = global.batches;
        let world = self.collective.world_size() as f64;
        // fp16: the gradients carry scale / k (forward_backward); unscaled
        // once, here, with the normalization, before the norm and the clip.
        let scaler = self.loss_scale();
        let unscale = scaler.map_or(1.0, |ls| self.plan.k as f64 * f64::from(ls.inv_scale()));
        // 2.-3. normalize and clip: one reduction over the whole buffer for
        // the norm of the summed gradients (the norm of the normalized ones
        // is that divided by the divisor), then one pass that applies
        // 1/divisor and the clip coefficient together.
        let t_clip = Instant::now();
        let normalize = self.spec.accumulation.normalize;
        let divisor = grad_prep::divisor(normalize, global_count, global_micro, world) / unscale;
        let norm_type = self.spec.norm_type();
        let step = self.state.step;
        let lr = self.schedule.lr_at(step);
        // On the device (the sync graph, engine/sync_graph.rs): everything
        // up to the zeroed gradients is done and only the norm comes back.
        let t_device = Instant::now();
        // No loss term in the window on any rank (N = 0; a language
        // model's windows can be all padding or prompt): nothing to
        // normalize by, the step is skipped, not an on_nonfinite failure.
        let no_terms = divisor == 0.0;
        let on_device = if no_terms {
            None
        } else {
            self.sync_on_device(divisor, lr)?
        };
        let device_s = t_device.elapsed();
        let norm = match on_device {
            _ if no_terms => 0.0,
            Some(norm) => norm,
            // Assembled over the mesh's axes in one place (engine/norm.rs).
            None => self.clip_norm(norm_type)?,
        };
        let grad_norm = if no_terms { 0.0 } else { norm / divisor };
        // Skip, fail, or what the gradients go through before the
        // optimizer: 1/divisor and the clip (engine/grad_prep.rs).
        let loss_scale = scaler.map(|ls| ls.scale);
        let decided = grad_prep::decide(divisor, grad_norm, &self.spec.clipping, loss_scale, step)?;
        if let Some(skip) = decided.skip {
            grad_prep::log_skip(skip, step, grad_norm);
        }
        let (prep, clip_coef) = (decided.prep, decided.clip_coef);
        let skipped = decided.skip.is_some();
        let mut clip_s = t_clip.elapsed();
        let mut prep_s = Duration::ZERO;
        // 4. optimizer step of what this rank owns, parameters back on
        // every rank, gradients cleared: the placement's (engine/placement/).
        let t_opt = Instant::now();
        if on_device.is_some() {
            // The device did it all: count the step it took.
            self.placement.optimizer.steps += u64::from(prep.is_some());
            clip_s = Duration::ZERO;
        } else {
            let (placement, mut parts) = self.placed();
            prep_s = placement.step(&mut parts, prep, lr)?;
            clip_s += prep_s;
        }
        // A tied embedding's new values to the last stage's copy.
        self.pipeline_tied_values()?;
        let optimizer_s = match on_device {
            Some(_) => device_s,
            None => t_opt.elapsed().saturating_sub(prep_s),
        };
        // 5. commit: the trainer's accounting (engine/trainer/accounting.rs).
        Ok(self.commit(SyncOutcome {
            global_count,
            loss_sum: global.loss_sum,
            grad_norm,
            clip_coef,
            skipped,
            skip_reason: decided.skip.map(grad_prep::Skip::reason),
            // GradScaler backs off on an overflow only.
            overflow: skipped && !no_terms,
            scaler,
            lr,
            comm,
            clip: clip_s,
            optimizer: optimizer_s,
        }))
    }

    /// fp16's loss scale now (the state's, or the spec's initial one for a
    /// state that has none yet, e.g. resumed from an fp32 checkpoint);
    /// None for fp32 and bf16.
    pub(super) fn loss_scale(&self) -> Option<crate::cuda::amp::LossScale> {
        (self.spec.precision == crate::spec::Precision::Fp16).then(|| {
            self.state
                .loss_scale
                .unwrap_or_else(|| crate::cuda::amp::LossScale::new(&self.spec.loss_scaling))
        })
    }

    /// Appends one line for the window about to be reduced: the sample
    /// indices this rank read in it (recorded at each read, so a rank's
    /// line is what it actually fetched, not a plan) and when (`t`, unix
    /// ms: a step written by several attempts is judged by the newest).
    /// The audit joins the lines of every rank of a step.
    fn log_window(&mut self, path: &Path) -> Result<()> {
        use std::io::Write;
        let line = serde_json::json!({
            "job": self.spec.name,
            "step": self.state.step + 1,
            "epoch": self.state.epoch,
            "rank": self.collective.rank(),
            "world": self.collective.world_size(),
            "indices": self.window.read,
            "t": std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        });
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(crate::error::io_err(path))?;
        // One write of the whole line: a process killed meanwhile leaves
        // whole lines only.
        f.write_all(format!("{line}\n").as_bytes())
            .map_err(crate::error::io_err(path))
    }
}

/// What the loss is multiplied by before backward (fp16's scale / k).
#[derive(Clone, Copy)]
pub(super) enum LossScaleBy<'a> {
    One,
    Scalar(f64),
    /// A 0-dim device tensor (the graph body: a value the graph reads).
    Tensor(&'a Tensor),
}
