//! [`Objective`]: the loss a job trains with and the metrics its
//! evaluation reports. The window and the evaluation call it; they own the
//! counting and the normalization (docs/SEMANTICS.md), the objective owns
//! nothing about either.

pub mod head_loss;

use crate::error::{Result, TorchContext};
use crate::source::batch::Batch;
use tch::{Kind, Reduction, Tensor};

/// The loss of one batch: its sum over the batch's loss terms (a 0-dim
/// tensor on the output's device, with its graph for backward) and their
/// count.
pub struct LossSum {
    pub sum: Tensor,
    pub count: u64,
}

/// What an evaluation adds up over the held-out split's batches.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EvalSums {
    /// The loss summed over the loss terms.
    pub loss_sum: f64,
    /// Loss terms.
    pub count: u64,
    /// Terms predicted right (classification: argmax = label).
    pub correct: u64,
}

impl EvalSums {
    pub fn add(&mut self, other: EvalSums) {
        self.loss_sum += other.loss_sum;
        self.count += other.count;
        self.correct += other.correct;
    }

    /// The loss per term.
    pub fn loss(&self) -> f64 {
        self.loss_sum / self.count.max(1) as f64
    }

    /// The share of terms predicted right.
    pub fn accuracy(&self) -> f64 {
        self.correct as f64 / self.count.max(1) as f64
    }
}

/// A training objective.
pub trait Objective: Send + std::fmt::Debug {
    /// The loss summed over `batch`'s loss terms, and their count.
    fn loss(&self, output: &Tensor, batch: &Batch) -> Result<LossSum>;

    /// The loss averaged over `batch`'s terms, as the loss function's own
    /// mean reduction computes it (`normalize = "mean" | "sum"` train with
    /// the per-micro-batch mean; libtorch's mean, not sum / count, keeps
    /// them bitwise equal to PyTorch's references).
    fn mean_loss(&self, output: &Tensor, batch: &Batch) -> Result<Tensor>;

    /// The evaluation's sums over one held-out batch.
    fn evaluate(&self, output: &Tensor, batch: &Batch) -> Result<EvalSums>;

    /// Whether its loss is a per-token log-likelihood whose exponential,
    /// the perplexity, the reports give.
    fn has_perplexity(&self) -> bool {
        false
    }

    /// Whether [`Objective::loss`] is the summed cross-entropy of the
    /// output against `batch.targets` (-100 ignored, one term per target),
    /// so that a model whose output is a linear head may have the head
    /// and this loss computed in one pass (the head_loss module).
    fn is_summed_cross_entropy(&self) -> bool {
        false
    }
}

/// Classification: cross-entropy of `[N, classes]` logits against i64
/// labels (-100 ignored), one term per sample; accuracy by argmax.
#[derive(Clone, Copy, Debug, Default)]
pub struct Classification;

impl Classification {
    fn cross_entropy(output: &Tensor, batch: &Batch, reduction: Reduction) -> Result<Tensor> {
        output
            .f_cross_entropy_loss::<Tensor>(&batch.targets, None, reduction, -100, 0.0)
            .ctx("computing the loss")
    }
}

impl Objective for Classification {
    fn loss(&self, output: &Tensor, batch: &Batch) -> Result<LossSum> {
        Ok(LossSum {
            sum: Self::cross_entropy(output, batch, Reduction::Sum)?,
            count: batch.count,
        })
    }

    fn mean_loss(&self, output: &Tensor, batch: &Batch) -> Result<Tensor> {
        Self::cross_entropy(output, batch, Reduction::Mean)
    }

    fn evaluate(&self, output: &Tensor, batch: &Batch) -> Result<EvalSums> {
        argmax_sums(&self.loss(output, batch)?, output, batch)
    }
}

/// Causal language modelling: cross-entropy of fp32 `[N, T, vocab]` logits
/// against i64 `[N, T]` next-token targets, summed over the targets that
/// are not -100 (padding, masked prompt tokens), one term per target;
/// accuracy is next-token argmax accuracy over those targets. Logits in
/// bf16 or fp16 (the Llama forward under autocast with its fused
/// operations) are widened as transformers' `logits.float()` does; the
/// summed loss of such logits is one fused operation
/// (crate::cuda::fused_ops::cross_entropy_sum: on CUDA without the fp32 logits).
#[derive(Clone, Copy, Debug, Default)]
pub struct CausalLm;

impl CausalLm {
    fn cross_entropy(output: &Tensor, batch: &Batch, reduction: Reduction) -> Result<Tensor> {
        let vocab = output.size().last().copied().unwrap_or(0);
        let low = matches!(output.kind(), Kind::BFloat16 | Kind::Half);
        if low && matches!(reduction, Reduction::Sum) {
            let kernels = crate::cuda::fused_ops::use_kernels(output.device());
            return crate::cuda::fused_ops::cross_entropy_sum(output, &batch.targets, kernels)
                .ctx("computing the loss");
        }
        output
            .f_to_kind(Kind::Float)
            .and_then(|o| o.f_reshape([-1, vocab]))
            .and_then(|o| {
                let targets = batch.targets.f_reshape([-1])?;
                o.f_cross_entropy_loss::<Tensor>(&targets, None, reduction, -100, 0.0)
            })
            .ctx("computing the loss")
    }
}

impl Objective for CausalLm {
    fn loss(&self, output: &Tensor, batch: &Batch) -> Result<LossSum> {
        Ok(LossSum {
            sum: Self::cross_entropy(output, batch, Reduction::Sum)?,
            count: batch.count,
        })
    }

    /// The micro-batch's token mean; 0 (with its graph, so backward adds
    /// zero gradients) when it has no target, where libtorch's mean would
    /// give 0/0.
    fn mean_loss(&self, output: &Tensor, batch: &Batch) -> Result<Tensor> {
        if batch.count == 0 {
            return Self::cross_entropy(output, batch, Reduction::Sum)?
                .f_mul_scalar(0.0)
                .ctx("computing the loss");
        }
        Self::cross_entropy(output, batch, Reduction::Mean)
    }

    fn evaluate(&self, output: &Tensor, batch: &Batch) -> Result<EvalSums> {
        argmax_sums(&self.loss(output, batch)?, output, batch)
    }

    fn has_perplexity(&self) -> bool {
        true
    }

    fn is_summed_cross_entropy(&self) -> bool {
        true
    }
}

/// An evaluation's sums from a batch's loss and its argmax predictions
/// (targets of -100 never match: argmax is never negative).
fn argmax_sums(loss: &LossSum, output: &Tensor, batch: &Batch) -> Result<EvalSums> {
    let loss_sum = loss.sum.f_double_value(&[]).ctx("evaluating")?;
    let correct = output
        .f_argmax(-1, false)
        .and_then(|p| p.f_eq_tensor(&batch.targets))
        .and_then(|e| e.f_sum(Kind::Int64))
        .and_then(|s| s.f_int64_value(&[]))
        .ctx("evaluating")?;
    Ok(EvalSums {
        loss_sum,
        count: loss.count,
        correct: correct as u64,
    })
}
