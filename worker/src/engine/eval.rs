//! Evaluation on the held-out split: the objective's metrics summed over
//! its batches.

use super::{Engine, EvalReport};
use crate::collective::Collective;
use crate::error::Result;
use crate::objective::EvalSums;

impl<C: Collective> Engine<C> {
    /// Loss, accuracy (and a language model's perplexity) on the held-out
    /// split (None without one).
    pub fn evaluate(&mut self) -> Result<Option<EvalReport>> {
        let Some(eval) = &self.eval else {
            return Ok(None);
        };
        let _guard = tch::no_grad_guard();
        self.model.set_train(false)?;
        let n = eval.len() as i64;
        let bs = self.spec.eval.batch_size as i64;
        let mut sums = EvalSums::default();
        let mut start = 0;
        while start < n {
            let len = bs.min(n - start);
            let batch = eval.range(start, len, self.device)?;
            let output = self.model.forward(&batch.inputs, false)?;
            sums.add(self.objective.evaluate(&output, &batch)?);
            start += len;
        }
        self.model.set_train(true)?;
        Ok(Some(EvalReport {
            epoch: self.state.epoch,
            step: self.state.step,
            loss: sums.loss(),
            accuracy: sums.accuracy(),
            perplexity: self.objective.has_perplexity().then(|| sums.loss().exp()),
            samples: sums.count,
        }))
    }
}
