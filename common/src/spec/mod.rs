//! The job spec (docs/SPEC.md): TOML parsed with `deny_unknown_fields`,
//! then validated as a whole so that every bad value is reported at once with
//! its field path, the value and the allowed range.

use serde::{Deserialize, Serialize};

mod check;
mod family;
mod kinds;
mod load;
mod memory;
mod model;
mod parallel;
mod paths;
mod pipeline_check;
pub use check::{shown, Checker, MAX_SHOWN_CHARS};
pub use family::{
    decoder_kinds, Decoder, DecoderArch, FamilyFields, FieldSet, LlamaConfig, LlamaSpec,
    RopeScaling, Window,
};
pub use kinds::*;
pub use load::LoadError;
pub use memory::{host_memory_bytes, MemoryEstimate, GIB};
pub use model::ModelSpec;
pub use parallel::{Axis, Coords, ParallelDims};
pub use paths::{
    confine_field, confine_lexically, normalize, Area, Lexical, LocalFs, RootError, Roots, View,
};
use std::fmt;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    pub name: String,
    /// W: number of ranks.
    #[serde(default = "one_u32")]
    pub workers: u32,
    pub min_workers: Option<u32>,
    pub max_workers: Option<u32>,
    #[serde(default)]
    pub seed: u64,
    /// Passes over the training data (default 1 when `max_steps` is absent).
    pub epochs: Option<u64>,
    /// Stop after this many optimizer steps (takes precedence over `epochs`).
    pub max_steps: Option<u64>,
    /// `auto` (CUDA when present), `cpu` or `cuda:N`.
    #[serde(default = "auto")]
    pub device: String,
    /// libtorch intra-op threads for this rank (default: libtorch's choice).
    pub threads: Option<u32>,
    pub model: ModelSpec,
    pub data: DataSpec,
    #[serde(default)]
    pub accumulation: AccumulationSpec,
    #[serde(default)]
    pub clipping: ClippingSpec,
    pub optimizer: OptimizerSpec,
    #[serde(default)]
    pub schedule: ScheduleSpec,
    #[serde(default)]
    pub checkpoint: CheckpointSpec,
    #[serde(default)]
    pub eval: EvalSpec,
    #[serde(default)]
    pub comm: CommSpec,
    #[serde(default)]
    pub sharding: ShardingSpec,
    /// Autocast type of the forward and the loss (issue 18).
    #[serde(default)]
    pub precision: Precision,
    /// fp16's dynamic loss scaling (torch.amp.GradScaler's defaults).
    #[serde(default)]
    pub loss_scaling: LossScalingSpec,
    /// How the worker runs the job on its device (issue 19).
    #[serde(default)]
    pub performance: PerformanceSpec,
    /// The largest share of the job's optimizer steps that may be skipped
    /// (no loss term in the window, non-finite gradients, fp16 overflow)
    /// before the job fails with that reason (default 0.5); a job that
    /// applies no optimizer step at all fails whatever this says.
    pub max_skipped_fraction: Option<f64>,
    /// The device mesh's degrees (issue 38).
    #[serde(default)]
    pub parallel: ParallelSpec,
}

/// `[parallel]`: how the workers split into data, pipeline and tensor
/// ranks ([`ParallelDims`]). Pipeline and tensor default to 1, data to
/// workers / (pipeline x tensor); their product must be `workers`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ParallelSpec {
    pub data: Option<u32>,
    pub pipeline: Option<u32>,
    pub tensor: Option<u32>,
    /// With pipeline > 1: the stages' order of forwards and backwards
    /// (default 1f1b).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<PipelineSchedule>,
    /// With `schedule = "interleaved_1f1b"`: V >= 2, the model chunks each
    /// pipeline rank holds (the model cut into pipeline x V chunks; absent:
    /// 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stages_per_rank: Option<u32>,
    /// With pipeline > 1: each stage's count of pipeline units (a Llama's
    /// decoder layers, an mlp's layers), first to last; default: balanced
    /// by parameter count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers_per_stage: Option<Vec<u64>>,
    /// With pipeline > 1 and no `layers_per_stage`: what the stage
    /// boundaries balance (default: the parameter count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balance: Option<StageBalance>,
}

/// `[performance]`: execution choices that leave the numbers as they are.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PerformanceSpec {
    /// Capture the micro-step once as a CUDA graph and replay it (absent:
    /// on for CUDA jobs; no effect on the CPU, which the step report says).
    pub cuda_graphs: Option<bool>,
    /// Only cuDNN's deterministic algorithms for convolutions, as
    /// `torch.backends.cudnn.deterministic = True` (absent: false, cuDNN's
    /// heuristics, whose choices may add with atomics: a CUDA run of a
    /// convolutional model is then not bit-for-bit repeatable).
    pub cudnn_deterministic: Option<bool>,
    /// Recompute the blocks' activations in the backward (issue 41;
    /// absent: "none").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_checkpointing: Option<ActivationCheckpointing>,
    /// With `activation_checkpointing = "full"`: blocks per recomputed
    /// segment (absent: 1, every block).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_every: Option<u32>,
}

/// `[loss_scaling]`: dynamic loss scaling for `precision = "fp16"`, as
/// torch.amp.GradScaler does it (its defaults).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LossScalingSpec {
    #[serde(default = "init_scale")]
    pub init_scale: f64,
    /// The scale is multiplied by this after `growth_interval` steps in a
    /// row without a non-finite gradient.
    #[serde(default = "growth_factor")]
    pub growth_factor: f64,
    /// ... and by this after a step with one (the step is skipped).
    #[serde(default = "backoff_factor")]
    pub backoff_factor: f64,
    #[serde(default = "growth_interval")]
    pub growth_interval: u64,
}

fn init_scale() -> f64 {
    65536.0
}
fn growth_factor() -> f64 {
    2.0
}
fn backoff_factor() -> f64 {
    0.5
}
fn growth_interval() -> u64 {
    2000
}

impl Default for LossScalingSpec {
    fn default() -> Self {
        Self {
            init_scale: init_scale(),
            growth_factor: growth_factor(),
            backoff_factor: backoff_factor(),
            growth_interval: growth_interval(),
        }
    }
}

/// ZeRO sharding of the optimizer state (issue 17).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ShardingSpec {
    /// 0: every rank keeps the whole optimizer state (the default); 1: each
    /// rank keeps and steps the state of its slice of the flat parameters,
    /// then the parameters are all-gathered; 2: also frees the gradients
    /// outside the rank's slice (after the sync step, or with sync =
    /// "every_step" after each micro-step's reduce-scatter); 3: also the
    /// parameters, gathered block by block for the forward and the
    /// backward (issue 41).
    #[serde(default)]
    pub stage: u32,
    /// Stage 3: release each unit's gathered parameters after its forward
    /// and gather them again for its backward (None: true, FSDP2's
    /// default); false keeps them from the forward to the backward (more
    /// memory, half the gathers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reshard_after_forward: Option<bool>,
    /// Stage 3: gather the next unit on a thread beside the current
    /// unit's forward or backward (None: true, as FSDP2 prefetches);
    /// false gathers each unit when it is needed (one unit less held).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch: Option<bool>,
}

/// The sharding stages built so far.
pub const SHARDING_STAGES: &str = "0 (none), 1 (optimizer state sharded), 2 (optimizer state and gradients sharded) or 3 (parameters too)";

/// Data-plane settings.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CommSpec {
    /// A peer silent this long during a collective is lost (seconds).
    #[serde(default = "sixty")]
    pub timeout_s: f64,
    /// How long ranks wait for the ring to form (seconds).
    #[serde(default = "sixty")]
    pub connect_timeout_s: f64,
    /// Gradient bucket size in MiB (DDP's bucket_cap_mb).
    #[serde(default = "bucket_cap")]
    pub bucket_cap_mb: f64,
    /// After a lost worker, how long the coordinator waits for a replacement
    /// before shrinking to `min_workers` (or failing below it), seconds.
    #[serde(default = "thirty")]
    pub rendezvous_timeout_s: f64,
    /// Which transport carries the process groups (docs/ARCHITECTURE.md,
    /// "The device mesh").
    #[serde(default)]
    pub backend: CommBackend,
}

impl Default for CommSpec {
    fn default() -> Self {
        Self {
            timeout_s: sixty(),
            connect_timeout_s: sixty(),
            bucket_cap_mb: bucket_cap(),
            rendezvous_timeout_s: thirty(),
            backend: CommBackend::Auto,
        }
    }
}

fn thirty() -> f64 {
    30.0
}
fn sixty() -> f64 {
    60.0
}
fn bucket_cap() -> f64 {
    25.0
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DataSpec {
    pub kind: DataKind,
    /// mnist/cifar10: the folder; tensors: the training file.
    pub path: Option<PathBuf>,
    /// tensors: the held-out file (optional).
    pub eval_path: Option<PathBuf>,
    /// b: samples per worker per micro-step.
    pub batch_size: u64,
    #[serde(default = "yes")]
    pub shuffle: bool,
    #[serde(default)]
    pub drop_last: bool,
    /// Pad shards to equal size as DistributedSampler does (default); false
    /// reads every sample exactly once and lets ranks differ by one sample.
    #[serde(default = "yes")]
    pub pad: bool,
    /// synthetic: training samples.
    pub samples: Option<u64>,
    /// synthetic: held-out samples.
    pub eval_samples: Option<u64>,
    /// synthetic: per-sample shape, e.g. [32] or [1, 28, 28].
    pub shape: Option<Vec<i64>>,
    /// synthetic: number of classes.
    pub classes: Option<i64>,
    /// sequences/tokens: T, the tokens a sample feeds the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<u64>,
    /// sequences: the input id of padding (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_id: Option<i64>,
    /// tokens: the token type of a headerless file (llm.c's header says it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<TokenDtype>,
    /// sequences: pack rows into samples of `seq_len` positions, each row
    /// with its own positions and attention (a block-diagonal causal mask;
    /// docs/SEMANTICS.md, "Packed rows").
    #[serde(default)]
    pub pack: bool,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct AccumulationSpec {
    /// k: micro-steps per optimizer step.
    pub steps: Option<u64>,
    /// Effective batch W*k*b; k is derived from it when set.
    pub global_batch: Option<u64>,
    #[serde(default)]
    pub normalize: Normalize,
    #[serde(default)]
    pub sync: SyncMode,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct ClippingSpec {
    pub max_norm: Option<f64>,
    /// 2.0 or inf (TOML `inf`), used for clipping and for the reported norm.
    pub norm_type: Option<f64>,
    pub clip_value: Option<f64>,
    #[serde(default)]
    pub on_nonfinite: OnNonfinite,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSpec {
    pub kind: OptimizerKind,
    pub lr: f64,
    #[serde(default)]
    pub momentum: f64,
    #[serde(default)]
    pub dampening: f64,
    #[serde(default)]
    pub nesterov: bool,
    /// Default 0 (sgd, adam) or 0.01 (adamw), as in PyTorch.
    pub weight_decay: Option<f64>,
    pub betas: Option<[f64; 2]>,
    pub eps: Option<f64>,
    /// adam/adamw: PyTorch's fused implementation (`fused=True`,
    /// libtorch's `_fused_adam_`/`_fused_adamw_`: one multi-tensor kernel
    /// per step on CUDA) instead of the single-tensor one.
    #[serde(default)]
    pub fused: bool,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSpec {
    #[serde(default)]
    pub kind: ScheduleKind,
    /// Linear warm-up from lr/warmup_steps to lr over this many steps (any kind).
    #[serde(default)]
    pub warmup_steps: u64,
    /// step: decay every step_size optimizer steps.
    pub step_size: Option<u64>,
    /// step: multiplicative decay (default 0.1).
    pub gamma: Option<f64>,
    /// cosine: the floor (default 0).
    pub min_lr: Option<f64>,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSpec {
    /// Default `<state-dir>/checkpoints/<name>`.
    pub dir: Option<PathBuf>,
    /// 0: only the final checkpoint.
    #[serde(default)]
    pub every_steps: u64,
    #[serde(default = "three")]
    pub keep: u64,
    /// The largest model file of a step folder, as transformers'
    /// `save_pretrained(max_shard_size=...)` takes it ("50GB", "500MB",
    /// "2GiB" or a byte count; [`shard_size_bytes`]): a model above it is
    /// written as shards and `model.safetensors.index.json`.
    #[serde(default = "fifty_gb")]
    pub max_shard_size: String,
}

impl Default for CheckpointSpec {
    fn default() -> Self {
        Self {
            dir: None,
            every_steps: 0,
            keep: three(),
            max_shard_size: fifty_gb(),
        }
    }
}

/// transformers 5's default `max_shard_size`.
pub const DEFAULT_MAX_SHARD_SIZE: &str = "50GB";

fn fifty_gb() -> String {
    DEFAULT_MAX_SHARD_SIZE.into()
}

/// The bytes a `max_shard_size` names, read as transformers'
/// `convert_file_size_to_int` reads it: digits then `GiB`, `MiB` or `KiB`
/// (powers of 2), `GB`, `MB` or `KB` (powers of 10; a lower-case final `b`
/// means bits, an eighth), or digits alone (bytes). Units are
/// case-insensitive. None when `s` is none of these or names 0 bytes.
pub fn shard_size_bytes(s: &str) -> Option<u64> {
    let t = s.trim();
    let upper = t.to_ascii_uppercase();
    let units: [(&str, u64, bool); 6] = [
        ("GIB", 1 << 30, false),
        ("MIB", 1 << 20, false),
        ("KIB", 1 << 10, false),
        ("GB", 1_000_000_000, true),
        ("MB", 1_000_000, true),
        ("KB", 1_000, true),
    ];
    let (digits, bytes) = match units.iter().find(|(u, _, _)| upper.ends_with(u)) {
        Some(&(u, scale, bits_rule)) => {
            let n: u64 = t[..t.len() - u.len()].parse().ok()?;
            let b = n.checked_mul(scale)?;
            (
                n,
                if bits_rule && t.ends_with('b') {
                    b / 8
                } else {
                    b
                },
            )
        }
        None => {
            let n: u64 = t.parse().ok()?;
            (n, n)
        }
    };
    (digits > 0 && bytes > 0).then_some(bytes)
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EvalSpec {
    /// Evaluate every N epochs (0: only at the end).
    #[serde(default)]
    pub every_epochs: u64,
    #[serde(default = "eval_batch")]
    pub batch_size: u64,
    /// Evaluate every N optimizer steps (0: not by steps; both may be set:
    /// a step that ends an epoch evaluates once).
    #[serde(default)]
    pub every_steps: u64,
}

impl Default for EvalSpec {
    fn default() -> Self {
        Self {
            every_epochs: 0,
            batch_size: eval_batch(),
            every_steps: 0,
        }
    }
}

fn one_u32() -> u32 {
    1
}
fn yes() -> bool {
    true
}
fn three() -> u64 {
    3
}
fn eval_batch() -> u64 {
    256
}
fn auto() -> String {
    "auto".into()
}

/// The files an MNIST folder must hold.
pub const MNIST_FILES: [&str; 4] = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
];
/// The files a CIFAR-10 folder must hold.
pub const CIFAR_FILES: [&str; 6] = [
    "data_batch_1.bin",
    "data_batch_2.bin",
    "data_batch_3.bin",
    "data_batch_4.bin",
    "data_batch_5.bin",
    "test_batch.bin",
];

/// The longest job name (a DNS label).
pub const MAX_JOB_NAME: usize = 63;

/// What a job name may be (it names checkpoint folders, metrics and ring
/// tags): 1 to 63 bytes of a-z, 0-9, '.', '_', '-', starting and ending
/// with a letter or digit (`^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$`).
pub fn is_valid_job_name(name: &str) -> bool {
    let b = name.as_bytes();
    let edge = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let inner = |c: u8| edge(c) || matches!(c, b'.' | b'_' | b'-');
    match (b.first(), b.last()) {
        (Some(&first), Some(&last)) => {
            b.len() <= MAX_JOB_NAME && edge(first) && edge(last) && b.iter().all(|&c| inner(c))
        }
        _ => false,
    }
}

pub const JOB_NAME_RULE: &str = "must be 1 to 63 characters of a-z, 0-9, '.', '_', '-', starting and ending with a letter or digit";

/// The longest accepted timeout of `[comm]`, seconds (one day).
pub const MAX_TIMEOUT_S: f64 = 86_400.0;
/// The largest accepted gradient bucket, MiB.
pub const MAX_BUCKET_CAP_MB: f64 = 4096.0;
/// The default `max_skipped_fraction`.
pub const DEFAULT_MAX_SKIPPED_FRACTION: f64 = 0.5;

/// The most ranks a job may ask for (`workers`, `max_workers`).
pub const MAX_WORKERS: u32 = 1024;
/// The most optimizer steps (`max_steps`, and every step count of the
/// schedule and checkpoints): far beyond any run, small enough that step
/// arithmetic never overflows.
pub const MAX_STEPS: u64 = 1_000_000_000_000;
pub const MAX_EPOCHS: u64 = 1_000_000;
/// The most samples per batch (`data.batch_size`, `eval.batch_size`).
pub const MAX_BATCH: u64 = 1 << 20;
/// The most micro-steps per optimizer step.
pub const MAX_ACCUMULATION: u64 = 1 << 16;
/// The most synthetic samples (training or held-out).
pub const MAX_SAMPLES: u64 = 1 << 31;
/// The most classes (`model.num_classes`, `data.classes`).
pub const MAX_CLASSES: i64 = 1 << 20;
/// Synthetic sample shapes: at most this many dimensions of at most
/// `MAX_DIM` each (memory is bounded by the estimate, see memory.rs).
pub const MAX_SHAPE_DIMS: usize = 8;
/// The longest token sequence (`data.seq_len`).
pub const MAX_SEQ_LEN: u64 = 1 << 20;
/// The largest vocabulary (`model.vocab_size`); token ids are below it.
pub const MAX_VOCAB: i64 = 1 << 24;
pub const MAX_DIM: i64 = 1 << 20;
pub const MAX_THREADS: u32 = 1024;
pub const MAX_KEEP: u64 = 1000;
/// The highest CUDA device index `cuda:N` may name.
pub const MAX_CUDA_INDEX: u32 = 1023;
/// The longest path a spec may name (`model.path`, `model.init`,
/// `data.path`, `data.eval_path`, `checkpoint.dir`), bytes: Linux's
/// PATH_MAX. Every job, with its spec, is listed and sent to every rank;
/// the bound keeps a page of jobs within what a gRPC client accepts
/// (docs/SPEC.md; docs/OPERATIONS.md, "Listing jobs, sizes and limits").
pub const MAX_PATH_BYTES: usize = 4096;
/// The largest job spec file, bytes (64 KiB; a spec is a few hundred).
pub const MAX_SPEC_BYTES: usize = 64 << 10;

/// One refused value: where it is, what it was, what is allowed.
#[derive(Clone, Debug, PartialEq)]
pub struct FieldError {
    pub field: String,
    pub value: String,
    pub allowed: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} = {}: {}", self.field, self.value, self.allowed)
    }
}

/// Every problem found in a spec.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("invalid job spec:\n  {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n  "))]
pub struct SpecErrors(pub Vec<FieldError>);

impl JobSpec {
    /// The mesh's degrees for `workers` ranks (errors name `parallel`).
    pub fn parallel_dims(&self) -> Result<ParallelDims, FieldError> {
        self.parallel_dims_for(self.workers)
    }

    /// The mesh's degrees for a world of `world` ranks (an elastic job's
    /// generation): pipeline and tensor as the spec says, data the rest.
    /// An explicit `parallel.data` speaks of `workers`, so it is left to
    /// follow the world here.
    pub fn parallel_dims_for(&self, world: u32) -> Result<ParallelDims, FieldError> {
        let data = (world == self.workers)
            .then_some(self.parallel.data)
            .flatten();
        ParallelDims::resolve(world, data, self.parallel.pipeline, self.parallel.tensor)
    }

    /// Ranks of one model replica (pipeline x tensor; 1 when the model is
    /// not split).
    pub fn replica_size(&self) -> u64 {
        u64::from(self.parallel.pipeline.unwrap_or(1).max(1))
            * u64::from(self.parallel.tensor.unwrap_or(1).max(1))
    }

    /// k for a world of `world` ranks: `steps`, or global_batch / (D*b)
    /// with D the data ranks (world / replica size; the world when the
    /// model is not split).
    pub fn accumulation_steps(&self, world: u64) -> Result<u64, FieldError> {
        let b = self.data.batch_size.max(1);
        match (self.accumulation.steps, self.accumulation.global_batch) {
            (Some(k), _) => Ok(k),
            (None, Some(g)) => {
                let replica = self.replica_size();
                let per_window = (world / replica).max(1) * b;
                let ranks = if replica == 1 {
                    "workers"
                } else {
                    "data ranks (workers / (pipeline x tensor))"
                };
                if g % per_window != 0 || g == 0 {
                    Err(FieldError {
                        field: "accumulation.global_batch".into(),
                        value: g.to_string(),
                        allowed: format!(
                            "must be a positive multiple of {ranks} * data.batch_size = {per_window}"
                        ),
                    })
                } else {
                    Ok(g / per_window)
                }
            }
            (None, None) => Ok(1),
        }
    }

    /// k for `data` data ranks (the data degree, as a worker's data axis
    /// knows it): [`JobSpec::accumulation_steps`] of the whole mesh,
    /// data x pipeline x tensor ranks, so a worker and the coordinator
    /// always agree.
    pub fn accumulation_steps_for_data(&self, data: u64) -> Result<u64, FieldError> {
        self.accumulation_steps(data.max(1) * self.replica_size())
    }

    pub fn norm_type(&self) -> f64 {
        self.clipping.norm_type.unwrap_or(2.0)
    }

    /// `max_skipped_fraction` or its default.
    pub fn max_skipped_fraction(&self) -> f64 {
        self.max_skipped_fraction
            .unwrap_or(DEFAULT_MAX_SKIPPED_FRACTION)
    }

    /// Checks every field, and that the named files exist; file contents are
    /// checked later by the loaders, still before anything is written.
    pub fn validate(&self) -> Result<(), SpecErrors> {
        self.check(true)
    }

    /// Checks every field but not the file system (the coordinator's view of
    /// the workers' files may differ).
    pub fn validate_fields(&self) -> Result<(), SpecErrors> {
        self.check(false)
    }
}

#[cfg(test)]
mod reference_tests;
#[cfg(test)]
mod tests;
