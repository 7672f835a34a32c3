//! The micro-step as a CUDA graph (issue 19): the graph's static tensors,
//! and the engine's side of warm-up, capture and replay. Decisions are in
//! crate::graphs; the shim's wrappers in crate::cuda_graph (ACCRUE_CUDA=1
//! builds only).
//!
//! A graph replays fixed device addresses, so everything the body reads or
//! writes is a tensor that lives as long as the graph: the index buffer
//! (this micro-batch's sample indices, copied in before each replay; the
//! data set is on the device already), fp16's scale / k (filled before
//! each replay), the parameters and their `.grad` views of the flat
//! gradient buffer (backward adds into them in place), BatchNorm's buffers
//! (updated in place) and the window's loss accumulator (added to in
//! place, zeroed at each window start). Nothing in the body reads a value
//! back to the host.

use super::window::LossScaleBy;
use super::Engine;
use crate::collective::Collective;
use crate::error::{Error, InPlace, Result, TorchContext};
use crate::graphs::{self, Action, EagerReason, Mode, Phase};
use tch::{Kind, Tensor};

/// The micro-step's graph, its static tensors and the window's loss.
pub(super) struct MicroGraph {
    mode: Mode,
    phase: Phase,
    /// The graph's input: this micro-batch's indices (int64, the spec's
    /// batch size, on the device).
    idx: Option<Tensor>,
    /// fp16: the loss scale / k the body multiplies the loss by (0-dim
    /// float32 on the device).
    scale: Option<Tensor>,
    /// The window's loss, summed over its samples (0-dim float32 on the
    /// device): eager micro-steps and the body both add into it.
    loss: Option<Tensor>,
    /// The reason last written to the log (a change is logged once).
    logged: Option<EagerReason>,
    #[cfg(accrue_cuda)]
    graph: Option<crate::cuda_graph::Graph>,
}

impl MicroGraph {
    pub(super) fn new(mode: Mode) -> Self {
        Self {
            mode,
            phase: Phase::default(),
            idx: None,
            scale: None,
            loss: None,
            logged: None,
            #[cfg(accrue_cuda)]
            graph: None,
        }
    }

    pub(super) fn mode(&self) -> &Mode {
        &self.mode
    }

    /// Forgets the captured graph (a re-formed ring): the next micro-steps
    /// warm up and capture again.
    pub(super) fn reset(&mut self) {
        if self.phase == Phase::Captured {
            self.phase = Phase::default();
        }
        #[cfg(accrue_cuda)]
        {
            self.graph = None;
        }
    }

    /// Zeroes the loss accumulator at a window start (allocating it on
    /// `device` the first time: before any capture, so that the graph adds
    /// into a tensor that outlives it).
    pub(super) fn zero_loss(&mut self, device: tch::Device) -> Result<()> {
        match &mut self.loss {
            Some(l) => l.f_zero_().ctx_("zeroing the window's loss"),
            None => {
                self.loss = Some(
                    Tensor::f_zeros([], (Kind::Float, device)).ctx("allocating the loss sum")?,
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
}

impl<C: Collective> Engine<C> {
    /// Runs micro-batch `a..b` as [`graphs::decide`] says: eagerly, as the
    /// graph body (warm-up), captured, or replayed.
    pub(super) fn run_micro_batch(&mut self, a: usize, b: usize) -> Result<()> {
        let idx = self.micro_batch_indices(a, b)?;
        let n = b - a;
        let action = graphs::decide(&self.graph.mode, &self.graph.phase, n, self.plan.batch);
        let mut failure = None;
        match &action {
            Action::Eager(reason) => self.eager_micro_batch(&idx, n, reason)?,
            Action::Body => {
                let (idx, scale) = self.stage(&idx)?;
                self.warm_up(&idx, scale.as_ref())?;
            }
            Action::Capture => {
                let (idx_s, scale) = self.stage(&idx)?;
                match self.capture(&idx_s, scale.as_ref()) {
                    Ok(()) => {
                        tracing::info!(batch = n, "the micro-step is captured as a CUDA graph");
                        self.replay()?;
                    }
                    Err(e) => {
                        // Nothing ran during the capture: this micro-step
                        // runs eagerly, and so do the job's next ones.
                        let reason = EagerReason::CaptureFailed(e.to_string());
                        self.eager_micro_batch(&idx, n, &reason)?;
                        failure = Some(e.to_string());
                    }
                }
            }
            Action::Replay => {
                // The graph reads the buffers: their handles are not needed.
                drop(self.stage(&idx)?);
                self.replay()?;
            }
        }
        self.graph.phase = self.graph.phase.after(&action, failure);
        Ok(())
    }

    /// The ordinary micro-step, with its reason in the step report and (on
    /// a change) in the log.
    fn eager_micro_batch(&mut self, idx: &Tensor, n: usize, reason: &EagerReason) -> Result<()> {
        if self.graph.logged.as_ref() != Some(reason) {
            tracing::info!(reason = %reason, "micro-steps run eagerly");
            self.graph.logged = Some(reason.clone());
        }
        self.window.eager_reason = Some(reason.to_string());
        let k = self.plan.k as f64;
        let scale = match self.loss_scale() {
            Some(ls) => LossScaleBy::Scalar(f64::from(ls.scale) / k),
            None => LossScaleBy::One,
        };
        self.forward_backward(idx, n, scale, false)
    }

    /// Copies the micro-batch's indices into the graph's index buffer and
    /// fp16's scale / k into its scale tensor; returns both (shallow).
    fn stage(&mut self, idx: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
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
    fn body(&mut self, idx: &Tensor, scale: Option<&Tensor>) -> Result<()> {
        let by = scale.map_or(LossScaleBy::One, LossScaleBy::Tensor);
        self.forward_backward(idx, self.plan.batch, by, true)
    }

    /// The body run eagerly: before the capture (on a side stream on
    /// CUDA, as torch.cuda.graphs warms up), or always (Mode::BodyOnly).
    fn warm_up(&mut self, idx: &Tensor, scale: Option<&Tensor>) -> Result<()> {
        #[cfg(accrue_cuda)]
        if let (tch::Device::Cuda(d), Mode::Capture { .. }) = (self.device, &self.graph.mode) {
            let side = crate::cuda_graph::SideStream::enter(d)?;
            let ran = self.body(idx, scale);
            side.exit()?;
            return ran;
        }
        self.body(idx, scale)
    }

    /// Captures the body (nothing runs: replay it after).
    #[cfg(accrue_cuda)]
    fn capture(&mut self, idx: &Tensor, scale: Option<&Tensor>) -> Result<()> {
        let tch::Device::Cuda(d) = self.device else {
            return Err(no_graphs(self.device));
        };
        let graph = crate::cuda_graph::Graph::capture(d, || self.body(idx, scale))?;
        self.graph.graph = Some(graph);
        Ok(())
    }

    #[cfg(not(accrue_cuda))]
    fn capture(&mut self, _idx: &Tensor, _scale: Option<&Tensor>) -> Result<()> {
        Err(no_graphs(self.device))
    }

    /// Replays the captured micro-step.
    fn replay(&mut self) -> Result<()> {
        #[cfg(accrue_cuda)]
        if let Some(g) = &self.graph.graph {
            g.replay()?;
            self.window.graph_replays += 1;
            return Ok(());
        }
        Err(no_graphs(self.device))
    }
}

fn no_graphs(device: tch::Device) -> Error {
    Error::Graph {
        what: "capture or replay",
        reason: format!("no captured graph on {device:?} in this build"),
    }
}
