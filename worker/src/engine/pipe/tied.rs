//! A tied embedding across stages (the Llama family's
//! `tie_word_embeddings`): the first stage's parameter, the last stage's
//! copy as its head. The head's gradient joins the embedding's before the
//! data reduction (at the sync step, or with each micro-batch under
//! `sync = "every_step"`); after the step the new values go to the copy.

use super::wire::{group_err, recv_into, Posted};
use crate::comm::collective::Collective;
use crate::engine::Engine;
use crate::error::{Error, Result, TorchContext};
use crate::spec::Axis;
use tch::Tensor;

impl<C: Collective> Engine<C> {
    /// The tied embedding's name, where this job has one across stages.
    fn tied_across(&self) -> Option<String> {
        let pipe = self.pipe.as_ref()?;
        pipe.tied.clone().filter(|_| self.mesh.has(Axis::Pipeline))
    }

    /// The tied embedding: the first stage's parameter, or (`copy`) the
    /// last stage's head copy.
    fn tied_tensor(&self, name: &str, copy: bool) -> Result<Tensor> {
        let list = if copy {
            &self.model.shared
        } else {
            &self.model.params
        };
        list.iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.shallow_clone())
            .ok_or_else(|| Error::Schedule(format!("no tied embedding {name} on this stage")))
    }

    /// `t` to stage `to` (`send`) or from it into `t`, waited for
    /// (through the host when the group carries host tensors).
    fn exchange(&mut self, t: &Tensor, peer: usize, send: bool) -> Result<()> {
        let group = self.mesh.group(&mut self.collective, Axis::Pipeline)?;
        if !send {
            return recv_into(group, t, peer, "receiving from another stage");
        }
        let t = t
            .f_to_device(group.device())
            .ctx("sending to another stage")?;
        group
            .send(&t, peer)
            .map_err(group_err)?
            .wait()
            .map_err(group_err)
    }

    /// A tied embedding's head gradient (the last stage's copy) added to
    /// the first stage's embedding gradient, before the data reduction;
    /// the copy's gradient is cleared.
    pub(in crate::engine) fn pipeline_tied_grads(&mut self) -> Result<()> {
        let Some(name) = self.tied_across() else {
            return Ok(());
        };
        // sync = every_step sent them with each micro-batch.
        if self.spec.accumulation.sync == crate::spec::SyncMode::EveryStep {
            return Ok(());
        }
        let _guard = tch::no_grad_guard();
        if self.mesh.is_last_stage() {
            let mut g = self.tied_tensor(&name, true)?.grad();
            let sent = g.f_contiguous().ctx("sending the tied gradient")?;
            self.exchange(&sent, 0, true)?;
            let _ = g.f_zero_().ctx("clearing the tied gradient")?;
        } else if self.mesh.is_first_stage() {
            self.add_tied_from_last(&name)?;
        }
        Ok(())
    }

    /// The first stage: the last stage's tied head gradient received and
    /// added to the embedding's.
    fn add_tied_from_last(&mut self, name: &str) -> Result<()> {
        let mut g = self.tied_tensor(name, false)?.grad();
        let other = g.f_zeros_like().ctx("receiving the tied gradient")?;
        self.exchange(&other, self.mesh.last_stage(), false)?;
        let _ = g.f_add_(&other).ctx("adding the tied gradient")?;
        Ok(())
    }

    /// sync = every_step: the last stage posts its tied head's gradient
    /// of this micro-batch (zeros for an empty one) to the first stage and
    /// clears it; the first stage adds it to the embedding's gradient
    /// before that micro-batch's reduction.
    pub(super) fn pipeline_tied_micro(&mut self, sends: &mut Vec<Posted>) -> Result<()> {
        let Some(name) = self.tied_across() else {
            return Ok(());
        };
        let _guard = tch::no_grad_guard();
        if self.mesh.is_last_stage() {
            let copy = self.tied_tensor(&name, true)?;
            let mut g = copy.grad();
            let group = self.mesh.group(&mut self.collective, Axis::Pipeline)?;
            let sent = if g.defined() {
                g.f_detach_copy()
            } else {
                copy.f_zeros_like()
            }
            .and_then(|t| t.f_to_device(group.device()))
            .ctx("sending the tied gradient")?;
            sends.push((group.send(&sent, 0).map_err(group_err)?, sent));
            if g.defined() {
                let _ = g.f_zero_().ctx("clearing the tied gradient")?;
            }
        } else if self.mesh.is_first_stage() {
            // (ZeRO-3 with gradients by unit: the embedding's unit was
            // kept open for this, and is reduced now.)
            self.zero3_reduce_tied(|e| e.add_tied_from_last(&name))?;
        }
        Ok(())
    }

    /// After the step: the first stage's tied embedding (its updated
    /// values) into the last stage's copy.
    pub(in crate::engine) fn pipeline_tied_values(&mut self) -> Result<()> {
        let Some(name) = self.tied_across() else {
            return Ok(());
        };
        let _guard = tch::no_grad_guard();
        if self.mesh.is_first_stage() {
            // ZeRO-3: the embedding's unit (the stage's first) gathered
            // for this.
            self.zero3_gather(&[0])?;
            let values = self
                .tied_tensor(&name, false)?
                .f_detach_copy()
                .ctx("sending the tied embedding")?;
            self.zero3_release(&[0])?;
            self.exchange(&values, self.mesh.last_stage(), true)?;
        } else if self.mesh.is_last_stage() {
            let mut copy = self.tied_tensor(&name, true)?;
            let fresh = copy.f_zeros_like().ctx("receiving the tied embedding")?;
            self.exchange(&fresh, 0, false)?;
            copy.f_copy_(&fresh).ctx("receiving the tied embedding")?;
        }
        Ok(())
    }
}
