//! Evaluation on the held-out split: the objective's metrics summed over
//! its batches.

use crate::comm::collective::Collective;
use crate::engine::{Engine, EvalReport};
use crate::error::Result;
use crate::objective::EvalSums;
use crate::spec::Axis;

impl<C: Collective> Engine<C> {
    /// Loss, accuracy (and a language model's perplexity) on the held-out
    /// split (None without one).
    pub fn evaluate(&mut self) -> Result<Option<EvalReport>> {
        if self.eval.is_none() {
            return Ok(None);
        }
        // (Under ZeRO-3 the blocks run one unit at a time, engine/zero3.rs.)
        // Taken for the evaluation (which borrows the engine mutably) and
        // put back: the pipeline path takes the source as an argument.
        let eval = self.eval.take();
        let out = self.evaluate_on(eval.as_deref());
        self.eval = eval;
        out
    }

    fn evaluate_on(
        &mut self,
        eval: Option<&dyn crate::source::DataSource>,
    ) -> Result<Option<EvalReport>> {
        let Some(eval) = eval else {
            return Ok(None);
        };
        let _guard = tch::no_grad_guard();
        self.model.set_train(false)?;
        let n = eval.len() as i64;
        let bs = eval_chunk(&self.spec, self.objective.has_perplexity());
        let (sums, read) = if self.mesh.has(Axis::Pipeline) {
            // Through the stages (engine/pipe/).
            self.pipeline_eval(eval, bs)?
        } else {
            let mut sums = EvalSums::default();
            let mut read = 0;
            let mut start = 0;
            while start < n {
                let len = bs.min(n - start);
                let batch = eval.range(start, len, self.device)?;
                read += batch.count;
                let output = if self.placement.strategy.stage() == 3 {
                    self.zero3_eval_forward(&batch.inputs)?
                } else {
                    self.model.forward(&batch.inputs, false)?
                };
                sums.add(self.objective.evaluate(&output, &batch)?);
                start += len;
            }
            (sums, Some(read))
        };
        self.model.set_train(true)?;
        check_counted(sums.count, read)?;
        // No loss term (a held-out set whose rows have no target within
        // T + 1 tokens): no loss, accuracy or perplexity, never 0 and 1.0.
        let (loss, accuracy) = if sums.count == 0 {
            (f64::NAN, f64::NAN)
        } else {
            (sums.loss(), sums.accuracy())
        };
        Ok(Some(EvalReport {
            epoch: self.state.epoch,
            step: self.state.step,
            loss,
            accuracy,
            perplexity: self
                .objective
                .has_perplexity()
                .then(|| loss.exp())
                .filter(|p| p.is_finite()),
            samples: sums.count,
        }))
    }
}

/// The evaluation's loss terms against those of the batches this rank
/// read (`read`; None on a pipeline stage that reads none): a metric over
/// fewer terms than the held-out set holds (none evaluated in a set that
/// has targets) is an error, never a dash or a partial number.
pub(crate) fn check_counted(counted: u64, read: Option<u64>) -> Result<()> {
    match read {
        Some(read) if read != counted => Err(crate::error::Error::Evaluation(format!(
            "counted {counted} loss terms of the {read} the held-out split holds"
        ))),
        _ => Ok(()),
    }
}

/// Rows per evaluation forward. A language model's logits (rows x T x
/// vocab) dominate its memory: it evaluates in chunks of at most the
/// training micro-batch (`data.batch_size`), whose logits the memory
/// estimate counts, so `eval.batch_size` (256 by default) never asks for
/// more (issue 37). Other models take `eval.batch_size` rows at once.
/// The sums, and so the metrics, do not depend on the chunking.
pub(crate) fn eval_chunk(spec: &crate::spec::JobSpec, language_model: bool) -> i64 {
    let rows = if language_model {
        spec.eval.batch_size.min(spec.data.batch_size)
    } else {
        spec.eval.batch_size
    };
    rows.max(1) as i64
}

#[cfg(test)]
mod tests {
    use super::check_counted;

    #[test]
    fn an_evaluation_short_of_its_split_is_an_error() {
        assert!(check_counted(96, Some(96)).is_ok());
        // A set without targets evaluates to nothing, rightly.
        assert!(check_counted(0, Some(0)).is_ok());
        // A middle pipeline stage reads no batch: nothing to hold it to.
        assert!(check_counted(96, None).is_ok());
        let e = check_counted(0, Some(96)).unwrap_err().to_string();
        assert_eq!(
            e,
            "evaluation: counted 0 loss terms of the 96 the held-out split holds"
        );
        assert!(check_counted(48, Some(96)).is_err());
    }
}
