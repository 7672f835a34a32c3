//! The sync step as a CUDA graph (issue 19): the work after the
//! all-reduce (normalize, the norm, the clip, the optimizer, zeroing the
//! gradients) captured once and replayed, so a step is one graph launch
//! after the reduction. Decisions are in crate::cuda::graphs.
//!
//! A graph cannot read the norm back to decide on the host whether to
//! step, so the whole decision is on the device: the norm of the
//! normalized gradients, its finiteness, the clip coefficient (in float64,
//! as the eager path computes it on the host), the multiplier applied to
//! the gradients; a non-finite step zeroes the gradients and turns every
//! optimizer number into its neutral value, which leaves the parameters and
//! the state as they were ([`crate::optim::MaskedCoefs`]). After the run
//! the host reads one number, once: the norm, whose finiteness it tests in
//! the same float64 arithmetic as the device. From it the host reports,
//! counts the optimizer step, applies `on_nonfinite` and fp16's scale
//! update exactly as on the eager path.
//!
//! The per-step inputs (the divisor, which carries fp16's unscaling, and
//! the optimizer's numbers: the learning rate of the schedule, Adam's bias
//! corrections) are device tensors the host fills before each run.

use super::graph::{capture, warm_up, GraphHolder};
use super::Engine;
use crate::comm::collective::Collective;
use crate::cuda::graphs::{self, Action, EagerReason};
use crate::error::{Error, InPlace, Result, TorchContext};
use tch::{Kind, Tensor};

/// The sync step's graph and its static tensors.
#[derive(Default)]
pub(super) struct SyncGraph {
    pub(super) holder: GraphHolder,
    /// [divisor, max_norm] (float64 on the device).
    inputs: Option<Tensor>,
    /// The optimizer's numbers of this step (row 0) and their neutral
    /// values (row 1), float32 on the device.
    coefs: Option<Tensor>,
    /// What the host reads after a run: the norm of the summed gradients
    /// (float64 on the device).
    out: Option<Tensor>,
}

impl SyncGraph {
    /// The static tensors allocated so far, by name (see
    /// [`Engine::graph_addresses`]).
    pub(super) fn tensors(&self) -> Vec<(&'static str, Tensor)> {
        [
            ("sync.inputs", &self.inputs),
            ("sync.coefs", &self.coefs),
            ("sync.out", &self.out),
        ]
        .into_iter()
        .filter_map(|(n, t)| t.as_ref().map(|t| (n, t.shallow_clone())))
        .collect()
    }
}

impl<C: Collective> Engine<C> {
    /// The sync step's work after the reduction, on the device, as
    /// [`graphs::decide_unless`] says: Some(norm of the summed gradients)
    /// when it ran there (stepped, or left everything as it was if the
    /// norm is not finite; the gradients zeroed either way), None when the
    /// caller runs the eager path (the reason is in the window's report).
    pub(super) fn sync_on_device(&mut self, divisor: f64, lr: f64) -> Result<Option<f64>> {
        let blocked = graphs::sync_blocker(
            self.placement.strategy.stage(),
            self.placement.optimizer.has_state(),
        );
        let action =
            graphs::decide_unless(self.graph.mode(), &self.sync_graph.holder.phase, blocked);
        let mut failure = None;
        let ran = match &action {
            Action::Eager(reason) => {
                self.eager_sync(reason);
                false
            }
            Action::Body => {
                self.fill_sync(divisor, lr)?;
                self.warm_up_sync()?;
                true
            }
            Action::Capture => {
                self.fill_sync(divisor, lr)?;
                match self.capture_sync() {
                    Ok(()) => {
                        tracing::info!("the sync step is captured as a CUDA graph");
                        self.replay_sync()?;
                        true
                    }
                    Err(e) => {
                        // Nothing ran during the capture: the eager path
                        // runs this step, and the job's next ones.
                        self.eager_sync(&EagerReason::CaptureFailed(e.to_string()));
                        failure = Some(e.to_string());
                        false
                    }
                }
            }
            Action::Replay => {
                self.fill_sync(divisor, lr)?;
                self.replay_sync()?;
                true
            }
        };
        self.sync_graph.holder.phase = self.sync_graph.holder.phase.after(&action, failure);
        if !ran {
            return Ok(None);
        }
        // The one read back of the step: the norm (the host tests it for
        // finiteness as the device did, in the same float64 arithmetic).
        let Some(out) = &self.sync_graph.out else {
            return Err(not_allocated("the sync step's result"));
        };
        out.f_double_value(&[])
            .map(Some)
            .ctx("reading the sync step's result")
    }

    /// Records why this sync step runs eagerly (logged on a change).
    fn eager_sync(&mut self, reason: &EagerReason) {
        self.window.sync_eager_reason = Some(self.sync_graph.holder.eager("sync steps", reason));
    }

    /// Fills the run's inputs: the divisor, max_norm and the optimizer's
    /// numbers for this step (allocated the first time, before any
    /// capture, so the graph reads tensors that outlive it).
    fn fill_sync(&mut self, divisor: f64, lr: f64) -> Result<()> {
        let device = self.device;
        let g = &mut self.sync_graph;
        let inputs = match &mut g.inputs {
            Some(t) => t,
            slot => {
                // max_norm is the job's: filled once.
                let max_norm = self.spec.clipping.max_norm.unwrap_or(0.0);
                slot.insert(
                    Tensor::f_full([2], max_norm, (Kind::Double, device))
                        .ctx("allocating the sync inputs")?,
                )
            }
        };
        fill(inputs, &[0], divisor)?;
        let c = self.placement.optimizer.masked_coefs(lr);
        let n = c.values.len() as i64;
        // How many numbers there are is the optimizer rule's (3 for SGD and
        // fused Adam/AdamW, 6 for Adam and AdamW), fixed for the engine's life: the tensor is
        // allocated once, before the first capture. Another count would be
        // a bug; it is refused rather than re-allocated under a captured
        // graph, which would then read freed memory.
        let coefs = match &mut g.coefs {
            Some(t) if t.size() == [2, n] => t,
            Some(t) => {
                return Err(Error::Graph {
                    what: "filling the optimizer's numbers",
                    reason: format!(
                        "{n} numbers for a tensor of shape {:?} allocated for the graph",
                        t.size()
                    ),
                })
            }
            slot => slot.insert(
                Tensor::f_zeros([2, n], (Kind::Float, device))
                    .ctx("allocating the optimizer's numbers")?,
            ),
        };
        for (row, vs) in [c.values, c.neutral].into_iter().enumerate() {
            for (i, v) in vs.into_iter().enumerate() {
                fill(coefs, &[row as i64, i as i64], v)?;
            }
        }
        if g.out.is_none() {
            g.out = Some(Tensor::f_zeros([], (Kind::Double, device)).ctx("allocating the result")?);
        }
        Ok(())
    }

    /// The sync graph's body: on the static tensors, nothing read back.
    fn sync_body(&mut self) -> Result<()> {
        let _guard = tch::no_grad_guard();
        let g = &self.sync_graph;
        let (Some(inputs), Some(coefs), Some(out)) = (&g.inputs, &g.coefs, &g.out) else {
            return Err(not_allocated("the sync step's inputs"));
        };
        let (inputs, coefs, out) = (
            inputs.shallow_clone(),
            coefs.shallow_clone(),
            out.shallow_clone(),
        );
        let at = |t: &Tensor, i: i64| t.f_select(0, i).ctx("a sync input");
        let divisor = at(&inputs, 0)?;
        // On CUDA, ATen divides by a host scalar as a multiplication by
        // its float32 reciprocal: the eager path does, so this does.
        let reciprocal = self.device.is_cuda();
        let norm = self
            .placement
            .grads
            .norm(self.spec.norm_type())?
            .f_to_kind(Kind::Double)
            .ctx("the gradient norm")?;
        let grad_norm = norm.f_div(&divisor).ctx("normalizing the norm")?;
        let finite = grad_norm.f_isfinite().ctx("testing the norm")?;
        let mut view = self.placement.grads.view()?;
        // What the eager path's GradPrep does, with the same roundings.
        if self.spec.clipping.max_norm.is_some() {
            // clip_grad_norm_: min(1, max_norm / (norm + 1e-6)), with
            // 1/divisor, as one float32 multiplier.
            let coef = at(&inputs, 1)?
                .f_div(&grad_norm.f_add_scalar(1e-6).ctx("clip coefficient")?)
                .and_then(|c| c.f_clamp_max(1.0))
                .and_then(|c| c.f_div(&divisor))
                .and_then(|c| c.f_to_kind(Kind::Float))
                .ctx("clip coefficient")?;
            view.f_mul_(&coef).ctx_("scaling gradients")?;
        } else {
            let d = divisor.f_to_kind(Kind::Float).ctx("the divisor")?;
            if reciprocal {
                let r = d.f_reciprocal().ctx("the divisor")?;
                view.f_mul_(&r)
            } else {
                view.f_div_(&d)
            }
            .ctx_("normalizing gradients")?;
            if let Some(v) = self.spec.clipping.clip_value {
                view.f_clamp_(-v, v).ctx_("clipping gradients by value")?;
            }
        }
        // A non-finite step: zero gradients and neutral numbers.
        let skip = finite.f_logical_not().ctx("testing the norm")?;
        view.f_masked_fill_(&skip, 0.0)
            .ctx_("zeroing skipped gradients")?;
        let eff = at(&coefs, 0)?
            .f_where_self(&finite, &at(&coefs, 1)?)
            .ctx("the optimizer's numbers")?;
        let pairs = crate::optim::with_grads(&self.model.params);
        self.placement
            .optimizer
            .step_masked(&pairs, &eff, reciprocal)?;
        self.placement.grads.zero()?;
        out.shallow_clone()
            .f_copy_(&norm)
            .ctx("the sync step's result")
    }

    /// The body run eagerly (warm-up, or Mode::BodyOnly).
    fn warm_up_sync(&mut self) -> Result<()> {
        let (device, capturing) = (self.device, self.graph.capturing());
        warm_up(device, capturing, || self.sync_body())
    }

    fn capture_sync(&mut self) -> Result<()> {
        let graph = capture(self.device, || self.sync_body())?;
        self.sync_graph.holder.keep(graph);
        Ok(())
    }

    fn replay_sync(&mut self) -> Result<()> {
        self.sync_graph.holder.replay(self.device)?;
        self.window.sync_replayed = true;
        Ok(())
    }
}

/// Fills element `at` of `t` with `v` (a kernel on the device: no copy
/// from host memory, which would wait for the stream).
fn fill(t: &Tensor, at: &[i64], v: f64) -> Result<()> {
    let mut e = t.shallow_clone();
    for &i in at {
        e = e.f_select(0, i).ctx("a sync input")?;
    }
    e.f_fill_(v).ctx_("filling a sync input")
}

fn not_allocated(what: &'static str) -> Error {
    Error::Graph {
        what,
        reason: "not allocated before the run".into(),
    }
}
