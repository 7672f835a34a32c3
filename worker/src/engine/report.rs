//! What the engine reports: each committed step, each evaluation, each
//! checkpoint, and the run's end.

use crate::checkpoint::TrainerState;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// Wall time of one optimizer step, split by phase.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct Timing {
    pub compute_s: f64,
    pub comm_s: f64,
    pub clip_s: f64,
    pub optimizer_s: f64,
    /// A pipeline stage (issue 40): the window's time waiting for the
    /// neighbouring stages' activations and gradients (the bubble), and
    /// posting its own and waiting for them to be taken (transfer). Not
    /// in `compute_s`; 0 without stages.
    pub bubble_s: f64,
    pub transfer_s: f64,
}

/// What one committed optimizer step did.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct StepReport {
    pub step: u64,
    pub total_steps: u64,
    pub epoch: u64,
    pub micro_step: u64,
    /// Mean loss over the window's loss terms (samples, target tokens) on
    /// all ranks: the loss that was optimized, whatever the normalization.
    pub loss: f64,
    /// Total gradient norm after normalization, before clipping.
    pub grad_norm: f64,
    /// Factor applied by norm clipping (1 when not clipped).
    pub clip_coef: f64,
    pub skipped: bool,
    /// Why the step was skipped: "no loss terms" (the window had no
    /// sample or target token on any rank: N = 0), "non-finite gradients"
    /// (on_nonfinite = "skip") or "fp16 overflow" (the loss scale backs
    /// off); None when it was taken.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skip_reason: Option<&'static str>,
    /// Loss terms in this window over all ranks: samples, or a language
    /// model's target tokens (N).
    pub samples: u64,
    pub samples_seen: u64,
    pub lr: f64,
    pub samples_per_sec: f64,
    pub timing: Timing,
    /// Data-plane bytes this rank sent and received for this step.
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// The same since this process joined the job.
    pub job_bytes_sent: u64,
    pub job_bytes_received: u64,
    /// fp16: the loss scale this step's gradients had (0 otherwise).
    pub loss_scale: f64,
    /// Micro-steps of this window that replayed a CUDA graph.
    pub graph_replays: u64,
    /// Why the window's micro-steps (the last that did) ran eagerly (None:
    /// none did; the proto's "" through [`crate::cuda::graphs::reason_text`]).
    #[serde(serialize_with = "crate::cuda::graphs::serialize_reason")]
    pub eager_reason: Option<crate::cuda::graphs::EagerReason>,
    /// The sync step's work after the reduction replayed its CUDA graph.
    pub sync_graph_replayed: bool,
    /// Why the sync step ran eagerly (None: on the device, as a graph or
    /// its body).
    #[serde(serialize_with = "crate::cuda::graphs::serialize_reason")]
    pub sync_eager_reason: Option<crate::cuda::graphs::EagerReason>,
    /// The first report of this process or generation: where the rank's
    /// state came from and why ("fresh start", "checkpoint step-32 (...)",
    /// "rank 1's state (step 52)"); "" on later reports.
    pub resumed_from: String,
    /// The worker process's peak resident memory so far, bytes (Linux
    /// VmHWM at the commit; 0 where it cannot be read; issue 41).
    pub peak_rss_bytes: u64,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct EvalReport {
    pub epoch: u64,
    pub step: u64,
    pub loss: f64,
    /// Terms predicted right (a language model: next-token argmax).
    pub accuracy: f64,
    /// A language model's exp(loss per token); None for classification.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub perplexity: Option<f64>,
    /// Loss terms evaluated (samples, or target tokens).
    pub samples: u64,
}

pub enum Event<'a> {
    Step(&'a StepReport),
    Eval(&'a EvalReport),
    Checkpoint(&'a Path),
}

#[derive(Debug)]
pub struct Summary {
    pub state: TrainerState,
    pub eval: Option<EvalReport>,
    pub checkpoint: PathBuf,
    /// Whether the run reached the job's last step (false when stopped early).
    pub finished: bool,
}

/// This process's peak resident memory so far (`/proc/self/status`
/// VmHWM), bytes; None where it cannot be read.
pub(crate) fn peak_rss_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    vm_hwm(&text)
}

/// VmHWM of a `/proc/<pid>/status` text, bytes.
fn vm_hwm(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod peak_tests {
    #[test]
    fn the_peak_is_read_from_vm_hwm() {
        let status = "Name:\tw\nVmPeak:\t  900 kB\nVmHWM:\t  1536 kB\nVmRSS:\t 1000 kB\n";
        assert_eq!(super::vm_hwm(status), Some(1536 * 1024));
        assert_eq!(super::vm_hwm("Name:\tw\n"), None);
        assert!(super::peak_rss_bytes().is_some_and(|b| b > 1 << 20));
    }
}
