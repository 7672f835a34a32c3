//! [`Batch`]: what one micro-step consumes.

use tch::Tensor;

/// The tensors a micro-step (or an evaluation step) consumes and its
/// count of loss terms. The window adds `count` up, the sync step sums it
/// over the ranks exactly (the tally module) and `normalize = "global_count"`
/// divides the summed gradients by it.
#[derive(Debug)]
pub struct Batch {
    /// The model's input (classification: f32 [N, ...] samples).
    pub inputs: Tensor,
    /// What the objective compares the output with (classification: i64
    /// [N] labels).
    pub targets: Tensor,
    /// The number of loss terms: samples for classification (N), target
    /// tokens (targets ≠ -100) for a language model.
    pub count: u64,
}

impl Batch {
    /// A batch of `samples` samples with one loss term each.
    pub fn per_sample(inputs: Tensor, targets: Tensor, samples: u64) -> Self {
        Self {
            inputs,
            targets,
            count: samples,
        }
    }
}
