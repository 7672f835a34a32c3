//! Evaluation on the held-out split.

use super::{Engine, EvalReport};
use crate::collective::Collective;
use crate::error::{Result, TorchContext};
use tch::{Kind, Reduction, Tensor};

impl<C: Collective> Engine<C> {
    /// Loss and accuracy on the held-out split (None without one).
    pub fn evaluate(&mut self) -> Result<Option<EvalReport>> {
        let Some(eval) = &self.eval else {
            return Ok(None);
        };
        let _guard = tch::no_grad_guard();
        self.model.set_train(false)?;
        let n = eval.len() as i64;
        let bs = self.spec.eval.batch_size as i64;
        let (mut loss, mut correct) = (0.0, 0i64);
        let mut start = 0;
        while start < n {
            let len = bs.min(n - start);
            let x = eval.x.f_narrow(0, start, len).ctx("evaluating")?;
            let y = eval.y.f_narrow(0, start, len).ctx("evaluating")?;
            let logits = self.model.forward(&x, false)?;
            let l = logits
                .f_cross_entropy_loss::<Tensor>(&y, None, Reduction::Sum, -100, 0.0)
                .ctx("evaluating")?;
            loss += l.f_double_value(&[]).ctx("evaluating")?;
            let hits = logits
                .f_argmax(-1, false)
                .and_then(|p| p.f_eq_tensor(&y))
                .and_then(|e| e.f_sum(Kind::Int64))
                .and_then(|s| s.f_int64_value(&[]))
                .ctx("evaluating")?;
            correct += hits;
            start += len;
        }
        self.model.set_train(true)?;
        Ok(Some(EvalReport {
            epoch: self.state.epoch,
            step: self.state.step,
            loss: loss / n.max(1) as f64,
            accuracy: correct as f64 / n.max(1) as f64,
            samples: n as u64,
        }))
    }
}
