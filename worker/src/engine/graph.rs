//! The micro-step as a CUDA graph (issue 19): the graph's static tensors,
//! and the engine's side of warm-up, capture and replay. Decisions are in
//! crate::cuda::graphs; the shim's wrappers in crate::cuda::cuda_graph (ACCRUE_CUDA=1
//! builds only).
//!
//! A graph replays fixed device addresses, so everything the body reads or
//! writes is a tensor that lives as long as the graph: the index buffer
//! (this micro-batch's sample indices, copied in before each replay; the
//! data set is on the device already), or, for a source read on the host
//! (a language model's token files), the staged batch (its inputs and
//! targets copied into static buffers before each replay, its count of
//! loss terms taken on the host), fp16's scale / k (filled before
//! each replay), the parameters and their `.grad` views of the flat
//! gradient buffer (backward adds into them in place), BatchNorm's buffers
//! (updated in place) and the window's loss accumulator (added to in
//! place, zeroed at each window start). Nothing in the body reads a value
//! back to the host.

use super::window::LossScaleBy;
use super::Engine;
use crate::comm::collective::Collective;
use crate::cuda::graphs::{self, Action, EagerReason, Mode, Phase};
use crate::error::{Error, InPlace, Result, TorchContext};
use tch::{Kind, Tensor};

/// What the micro-step's graph and the sync step's graph
/// (engine/sync_graph.rs) each keep: where the graph is, the eager reason
/// last logged, and the captured graph.
#[derive(Default)]
pub(super) struct GraphHolder {
    pub(super) phase: Phase,
    logged: Option<EagerReason>,
    #[cfg(accrue_cuda)]
    graph: Option<crate::cuda::cuda_graph::Graph>,
}

/// A captured graph (none can exist in a build without ACCRUE_CUDA=1).
#[cfg(accrue_cuda)]
pub(super) type Captured = crate::cuda::cuda_graph::Graph;
#[cfg(not(accrue_cuda))]
pub(super) type Captured = std::convert::Infallible;

impl GraphHolder {
    /// Forgets the captured graph (a re-formed ring, reloaded state): the
    /// next runs warm up and capture again.
    pub(super) fn reset(&mut self) {
        if self.phase == Phase::Captured {
            self.phase = Phase::default();
        }
        #[cfg(accrue_cuda)]
        {
            self.graph = None;
        }
    }

    /// Logs that `what` runs eagerly when the reason changed; the reason,
    /// for the step report.
    pub(super) fn eager(&mut self, what: &'static str, reason: &EagerReason) -> EagerReason {
        if self.logged.as_ref() != Some(reason) {
            tracing::info!(reason = %reason, "{what} run eagerly");
            self.logged = Some(reason.clone());
        }
        reason.clone()
    }

    pub(super) fn keep(&mut self, graph: Captured) {
        #[cfg(accrue_cuda)]
        {
            self.graph = Some(graph);
        }
        #[cfg(not(accrue_cuda))]
        match graph {}
    }

    /// Replays the captured graph.
    pub(super) fn replay(&self, device: tch::Device) -> Result<()> {
        #[cfg(accrue_cuda)]
        if let Some(g) = &self.graph {
            return g.replay();
        }
        Err(no_graphs(device))
    }
}

/// Runs a graph's body eagerly: before its capture on a side stream on
/// CUDA (`capturing`), as torch.cuda.graphs warms up; otherwise as is.
pub(super) fn warm_up(
    device: tch::Device,
    capturing: bool,
    body: impl FnOnce() -> Result<()>,
) -> Result<()> {
    #[cfg(accrue_cuda)]
    if let (tch::Device::Cuda(d), true) = (device, capturing) {
        let side = crate::cuda::cuda_graph::SideStream::enter(d)?;
        let ran = body();
        side.exit()?;
        return ran;
    }
    let _ = (device, capturing);
    body()
}

/// Captures what `body` queues on `device` (nothing runs: replay it
/// after).
pub(super) fn capture(device: tch::Device, body: impl FnOnce() -> Result<()>) -> Result<Captured> {
    #[cfg(accrue_cuda)]
    if let tch::Device::Cuda(d) = device {
        return crate::cuda::cuda_graph::Graph::capture(d, body);
    }
    // Only a forced capture (RunOptions::force_graph_capture) gets here.
    drop(body);
    let reason = if cfg!(accrue_cuda) {
        format!("{device:?} is not a CUDA device")
    } else {
        "this worker was built without ACCRUE_CUDA=1".to_string()
    };
    Err(Error::Graph {
        what: "capturing",
        reason,
    })
}

/// The micro-step's graph, its static tensors and the window's loss.
pub(super) struct MicroGraph {
    mode: Mode,
    pub(super) holder: GraphHolder,
    /// The graph's input: this micro-batch's indices (int64, the spec's
    /// batch size, on the device).
    idx: Option<Tensor>,
    /// fp16: the loss scale / k the body multiplies the loss by (0-dim
    /// float32 on the device).
    scale: Option<Tensor>,
    /// The window's loss, summed over its loss terms (0-dim float64 on
    /// the device): eager micro-steps and the body both add into it.
    loss: Option<Tensor>,
    /// The count of loss terms of the batch the graph was captured on
    /// (every replay consumes a batch of the same shape), or, staged, of
    /// the batch copied in last.
    count: u64,
    /// Whether micro-batches are staged (the source reads on the host).
    staged: bool,
    /// Staged: the batch's inputs and targets (static buffers on the
    /// device, filled before each run of the body or replay).
    inputs: Option<Tensor>,
    targets: Option<Tensor>,
}

impl MicroGraph {
    pub(super) fn new(mode: Mode, staged: bool) -> Self {
        Self {
            mode,
            holder: GraphHolder::default(),
            idx: None,
            scale: None,
            loss: None,
            count: 0,
            staged,
            inputs: None,
            targets: None,
        }
    }

    /// Staged: the batch in the static buffers (shallow), with the count
    /// the host took; None when the source is not staged.
    pub(super) fn staged_batch(&self) -> Option<crate::source::batch::Batch> {
        match (&self.inputs, &self.targets) {
            (Some(i), Some(t)) if self.staged => Some(crate::source::batch::Batch {
                inputs: i.shallow_clone(),
                targets: t.shallow_clone(),
                count: self.count,
            }),
            _ => None,
        }
    }

    /// Staged: copies `batch` into the static buffers (allocating them
    /// the first time, before any capture) and keeps its count.
    fn stage(&mut self, batch: crate::source::batch::Batch) -> Result<()> {
        for (slot, from) in [
            (&mut self.inputs, &batch.inputs),
            (&mut self.targets, &batch.targets),
        ] {
            let buffer = match slot {
                Some(t) => t,
                slot => slot.insert(
                    from.f_empty_like()
                        .ctx("allocating the graph's batch buffers")?,
                ),
            };
            buffer
                .f_copy_(from)
                .ctx("copying a batch into the graph's buffers")?;
        }
        self.count = batch.count;
        Ok(())
    }

    pub(super) fn mode(&self) -> &Mode {
        &self.mode
    }

    /// Whether graphs are captured (not just their bodies run).
    pub(super) fn capturing(&self) -> bool {
        matches!(self.mode, Mode::Capture { .. })
    }

    /// Zeroes the loss accumulator at a window start (allocating it on
    /// `device` the first time: before any capture, so that the graph adds
    /// into a tensor that outlives it).
    pub(super) fn zero_loss(&mut self, device: tch::Device) -> Result<()> {
        match &mut self.loss {
            Some(l) => l.f_zero_().ctx_("zeroing the window's loss"),
            None => {
                self.loss = Some(
                    Tensor::f_zeros([], (Kind::Double, device)).ctx("allocating the loss sum")?,
                );
                Ok(())
            }
        }
    }

    /// Adds a micro-batch's summed loss to the window's.
    pub(super) fn add_loss(&mut self, sum: &Tensor) -> Result<()> {
        match &mut self.loss {
            Some(l) => l.f_add_(sum).ctx_("accumulating the loss"),
            None => Err(Error::Graph {
                what: "accumulating the loss",
                reason: "the window's loss sum was not allocated at the window start".into(),
            }),
        }
    }

    /// The window's loss sum (a read back to the host: sync steps only).
    pub(super) fn loss_sum(&self) -> Result<f64> {
        match &self.loss {
            Some(l) => l.f_double_value(&[]).ctx("reading the loss"),
            None => Ok(0.0),
        }
    }

    /// The static tensors allocated so far, by name (see
    /// [`Engine::graph_addresses`]).
    fn tensors(&self) -> Vec<(&'static str, Tensor)> {
        [
            ("micro.idx", &self.idx),
            ("micro.scale", &self.scale),
            ("micro.loss", &self.loss),
            ("micro.inputs", &self.inputs),
            ("micro.targets", &self.targets),
        ]
        .into_iter()
        .filter_map(|(n, t)| t.as_ref().map(|t| (n, t.shallow_clone())))
        .collect()
    }
}

impl<C: Collective> Engine<C> {
    /// Every tensor a captured graph reads or writes, by name, with its
    /// address (`data_ptr`): the data set, the index buffer, fp16's scale,
    /// the window's loss, the parameters and their `.grad` views of the
    /// flat gradient buffer, the model's buffers (BatchNorm's statistics),
    /// the sync graph's inputs, numbers and result, and the optimizer's
    /// state and scratch. Those not allocated yet are absent (all are
    /// before a graph is captured). A graph replays fixed addresses: none
    /// of these may move while a graph is kept (tests check them across
    /// steps, epochs, evaluations and checkpoints).
    pub fn graph_addresses(&self) -> Vec<(String, usize)> {
        let mut named: Vec<(String, Tensor)> = self
            .train
            .resident()
            .into_iter()
            .map(|(n, t)| (n.to_string(), t))
            .collect();
        for (n, t) in self
            .graph
            .tensors()
            .into_iter()
            .chain(self.sync_graph.tensors())
        {
            named.push((n.into(), t));
        }
        for (n, p) in &self.model.params {
            named.push((format!("param.{n}"), p.shallow_clone()));
            named.push((format!("grad.{n}"), p.grad()));
        }
        for (n, b) in &self.model.buffers {
            named.push((format!("buffer.{n}"), b.shallow_clone()));
        }
        named.extend(self.placement.optimizer.graph_tensors());
        // data_ptr cannot fail on a defined dense tensor (these all are;
        // a released stage-2 gradient is an empty one, address 0).
        named
            .into_iter()
            .filter(|(_, t)| t.defined())
            .map(|(n, t)| (n, t.data_ptr() as usize))
            .collect()
    }

    /// Runs micro-batch `a..b` as [`graphs::decide`] says: eagerly, as the
    /// graph body (warm-up), captured, or replayed; returns the batch's
    /// count of loss terms.
    pub(super) fn run_micro_batch(&mut self, a: usize, b: usize) -> Result<u64> {
        let idx = self.micro_batch_indices(a, b)?;
        let n = b - a;
        let action = graphs::decide(
            &self.graph.mode,
            &self.graph.holder.phase,
            n,
            self.plan.batch,
        );
        let mut failure = None;
        let count = match &action {
            Action::Eager(reason) => self.eager_micro_batch(&idx, reason)?,
            Action::Body => {
                let (idx, scale) = self.fill_inputs(&idx)?;
                self.warm_up(&idx, scale.as_ref())?
            }
            Action::Capture => {
                let (idx_s, scale) = self.fill_inputs(&idx)?;
                match self.capture(&idx_s, scale.as_ref()) {
                    Ok(()) => {
                        tracing::info!(batch = n, "the micro-step is captured as a CUDA graph");
                        self.replay()?
                    }
                    Err(e) => {
                        // Nothing ran during the capture: this micro-step
                        // runs eagerly, and so do the job's next ones.
                        let reason = EagerReason::CaptureFailed(e.to_string());
                        failure = Some(e.to_string());
                        self.eager_micro_batch(&idx, &reason)?
                    }
                }
            }
            Action::Replay => {
                // The graph reads the buffers: their handles are not needed.
                drop(self.fill_inputs(&idx)?);
                self.replay()?
            }
        };
        self.graph.holder.phase = self.graph.holder.phase.after(&action, failure);
        Ok(count)
    }

    /// The ordinary micro-step, with its reason in the step report and (on
    /// a change) in the log.
    fn eager_micro_batch(&mut self, idx: &Tensor, reason: &EagerReason) -> Result<u64> {
        self.window.eager_reason = Some(self.graph.holder.eager("micro-steps", reason));
        self.forward_backward(idx, self.micro_scale(), false)
    }

    /// Copies the micro-batch's indices into the graph's index buffer (and,
    /// staged, its batch into the batch buffers) and fp16's scale / k into
    /// its scale tensor; returns the index buffer and the scale (shallow).
    fn fill_inputs(&mut self, idx: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        let opts = |kind| (kind, self.device);
        let buffer = match &mut self.graph.idx {
            Some(t) => t,
            slot => slot.insert(
                Tensor::f_empty([self.plan.batch as i64], opts(Kind::Int64))
                    .ctx("allocating the graph's index buffer")?,
            ),
        };
        buffer
            .f_copy_(idx)
            .ctx("copying indices into the graph's buffer")?;
        let buffer = buffer.shallow_clone();
        if self.graph.staged {
            let batch = self.train.batch(idx)?;
            self.graph.stage(batch)?;
        }
        let scale = match self.loss_scale() {
            Some(ls) => {
                let v = f64::from(ls.scale) / self.plan.k as f64;
                let t = match &mut self.graph.scale {
                    Some(t) => {
                        t.f_fill_(v).ctx_("setting the graph's loss scale")?;
                        t
                    }
                    slot => slot.insert(
                        Tensor::f_full([], v, opts(Kind::Float))
                            .ctx("allocating the graph's loss scale")?,
                    ),
                };
                Some(t.shallow_clone())
            }
            None => None,
        };
        Ok((buffer, scale))
    }

    /// The graph body: the micro-step on the static tensors.
    /// (Its count of loss terms is the graph's: kept for the replays.)
    fn body(&mut self, idx: &Tensor, scale: Option<&Tensor>) -> Result<()> {
        let by = scale.map_or(LossScaleBy::One, LossScaleBy::Tensor);
        self.graph.count = self.forward_backward(idx, by, true)?;
        Ok(())
    }

    /// The body run eagerly (warm-up, or Mode::BodyOnly).
    fn warm_up(&mut self, idx: &Tensor, scale: Option<&Tensor>) -> Result<u64> {
        let (device, capturing) = (self.device, self.graph.capturing());
        warm_up(device, capturing, || self.body(idx, scale))?;
        Ok(self.graph.count)
    }

    /// Captures the body (nothing runs: replay it after).
    fn capture(&mut self, idx: &Tensor, scale: Option<&Tensor>) -> Result<()> {
        let graph = capture(self.device, || self.body(idx, scale))?;
        self.graph.holder.keep(graph);
        Ok(())
    }

    /// Replays the captured micro-step; its count of loss terms.
    fn replay(&mut self) -> Result<u64> {
        self.graph.holder.replay(self.device)?;
        self.window.graph_replays += 1;
        Ok(self.graph.count)
    }
}

fn no_graphs(device: tch::Device) -> Error {
    Error::Graph {
        what: "replaying",
        reason: format!("no captured graph on {device:?}"),
    }
}
