//! The spec's kinds as typed enums (their TOML and proto names, the field
//! each belongs to), and the check that reports every refused kind of a
//! TOML document at once while the rest of the spec is still checked.

use super::{FieldError, SpecErrors};
use serde::{Deserialize, Serialize};
use std::fmt;

/// A closed set of names a spec field takes (`model.kind`, ...): the Rust
/// enum, its TOML names and the field it belongs to, for messages.
pub trait SpecEnum: Copy + Sized + 'static {
    /// Every value, in the order messages list them.
    const ALL: &'static [Self];
    /// The spec field, e.g. `model.kind`.
    const FIELD: &'static str;
    fn as_str(self) -> &'static str;
    fn parse(s: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|v| v.as_str() == s)
    }
    /// "must be one of a, b, c".
    fn allowed() -> String {
        let names: Vec<&str> = Self::ALL.iter().map(|v| v.as_str()).collect();
        format!("must be one of {}", names.join(", "))
    }
}

macro_rules! spec_enum {
    ($(#[$meta:meta])* $name:ident, $field:literal, { $($(#[$vmeta:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize, Serialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl SpecEnum for $name {
            const ALL: &'static [Self] = &[$($name::$variant),+];
            const FIELD: &'static str = $field;
            fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl $name {
            pub const ALL: &'static [Self] = <Self as SpecEnum>::ALL;
            pub fn as_str(self) -> &'static str {
                <Self as SpecEnum>::as_str(self)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = FieldError;
            fn from_str(s: &str) -> Result<Self, FieldError> {
                <Self as SpecEnum>::parse(s).ok_or_else(|| FieldError {
                    field: $field.into(),
                    value: format!("{s:?}"),
                    allowed: <Self as SpecEnum>::allowed(),
                })
            }
        }
    };
}

spec_enum!(
    /// `model.kind`.
    ModelKind, "model.kind", {
        Mlp = "mlp",
        Lenet5 = "lenet5",
        Resnet18 = "resnet18",
        Resnet34 = "resnet34",
        /// A user's module saved with torch.jit.save (`model.path`).
        Torchscript = "torchscript",
        /// A decoder-only language model, Hugging Face LlamaForCausalLM's
        /// layout and names (issue 30).
        Llama = "llama",
        /// Qwen2ForCausalLM: Llama with biases on q, k and v (issue 39).
        Qwen2 = "qwen2",
        /// MistralForCausalLM: Llama with a sliding attention window
        /// (issue 39).
        Mistral = "mistral",
        /// Qwen3ForCausalLM: Llama with per-head RMSNorms on q and k.
        Qwen3 = "qwen3",
    }
);

spec_enum!(
    /// `data.kind`.
    DataKind, "data.kind", {
        Mnist = "mnist",
        Cifar10 = "cifar10",
        Tensors = "tensors",
        Synthetic = "synthetic",
        /// Token rows of different lengths (a safetensors file of `tokens`,
        /// `offsets` and an optional `loss_mask`), cut or padded to
        /// `data.seq_len`.
        Sequences = "sequences",
        /// One flat token stream (llm.c's format, or headerless with
        /// `data.dtype`), sample j is `tokens[jT : jT + T + 1]`.
        Tokens = "tokens",
    }
);

spec_enum!(
    /// `data.dtype`: the token type of a headerless `tokens` file.
    TokenDtype, "data.dtype", {
        U16 = "u16",
        U32 = "u32",
    }
);

spec_enum!(
    /// `accumulation.normalize` (docs/SEMANTICS.md, "Normalization").
    #[derive(Default)]
    Normalize, "accumulation.normalize", {
        /// Summed losses, gradients divided by the global sample count.
        #[default]
        GlobalCount = "global_count",
        /// Per-micro-batch mean loss, divided by the global micro-batch count.
        Mean = "mean",
        /// Paddle `avg = false`: averaged over ranks only.
        Sum = "sum",
    }
);

spec_enum!(
    /// `accumulation.sync`: when gradients are all-reduced.
    #[derive(Default)]
    SyncMode, "accumulation.sync", {
        /// Once per window, at the sync step.
        #[default]
        Boundary = "boundary",
        /// After every micro-step.
        EveryStep = "every_step",
    }
);

spec_enum!(
    /// `clipping.on_nonfinite`: what a non-finite gradient norm does.
    #[derive(Default)]
    OnNonfinite, "clipping.on_nonfinite", {
        /// Every rank skips the step (counted and reported).
        #[default]
        Skip = "skip",
        /// The job fails.
        Error = "error",
    }
);

spec_enum!(
    /// `precision` (issue 18): the forward's and the loss's autocast type;
    /// parameters, gradients and the optimizer stay fp32.
    #[derive(Default)]
    Precision, "precision", {
        #[default]
        Fp32 = "fp32",
        Bf16 = "bf16",
        /// With dynamic loss scaling (`[loss_scaling]`).
        Fp16 = "fp16",
    }
);

spec_enum!(
    /// `comm.backend` (issue 38): which transport carries the groups. auto:
    /// the TCP ring for the data axis on the CPU, libtorch's c10d (gloo on
    /// the CPU) for every other axis and for everything on CUDA.
    #[derive(Default)]
    CommBackend, "comm.backend", {
        #[default]
        Auto = "auto",
        Ring = "ring",
        C10d = "c10d",
    }
);

spec_enum!(
    /// `parallel.schedule` (issue 40): the order of a pipeline stage's
    /// forwards and backwards (the worker's engine/trainer/pipeline.rs).
    #[derive(Default)]
    PipelineSchedule, "parallel.schedule", {
        /// Megatron's one-forward-one-backward: at most P micro-batches'
        /// activations per stage.
        #[default]
        #[serde(rename = "1f1b")]
        OneFOneB = "1f1b",
        /// Every forward, then every backward.
        #[serde(rename = "gpipe")]
        GPipe = "gpipe",
        /// Megatron's interleaved 1F1B: `stages_per_rank` model chunks per
        /// rank, a smaller bubble for more transfers.
        #[serde(rename = "interleaved_1f1b")]
        Interleaved1F1B = "interleaved_1f1b",
    }
);

spec_enum!(
    /// `parallel.balance` (issue 40): what the default stage boundaries
    /// even out (without `layers_per_stage`).
    #[derive(Default)]
    StageBalance, "parallel.balance", {
        /// Each stage's parameter count (the embedding counts as much as
        /// the head).
        #[default]
        Parameters = "parameters",
        /// Each stage's estimated compute per token: the multiply-adds of
        /// its matrix products (the head's, tied or not; an embedding's
        /// lookup costs none) and its attention (T x hidden a layer).
        Compute = "compute",
    }
);

spec_enum!(
    /// `performance.activation_checkpointing` (issue 41): whether a
    /// model's blocks keep their activations for the backward or recompute
    /// them from their input.
    #[derive(Default)]
    ActivationCheckpointing, "performance.activation_checkpointing", {
        #[default]
        None = "none",
        /// Every `checkpoint_every`-th block boundary keeps only its input;
        /// the blocks between recompute their activations in the backward.
        Full = "full",
    }
);

spec_enum!(
    /// `optimizer.kind`.
    OptimizerKind, "optimizer.kind", {
        Sgd = "sgd",
        Adam = "adam",
        Adamw = "adamw",
    }
);

spec_enum!(
    /// `schedule.kind`.
    #[derive(Default)]
    ScheduleKind, "schedule.kind", {
        #[default]
        Constant = "constant",
        Cosine = "cosine",
        Step = "step",
        LinearWarmup = "linear_warmup",
    }
);

/// Where each typed kind lives in the TOML: (section, key) and a check of
/// its value that returns the enum's name list on refusal.
struct KindField {
    section: &'static str,
    key: &'static str,
    field: &'static str,
    /// A valid name that stands in for a refused value so that the rest of
    /// the spec still deserializes and is checked.
    placeholder: &'static str,
    allowed: fn() -> String,
    parses: fn(&str) -> bool,
}

fn kind_field<E: SpecEnum>(section: &'static str, key: &'static str, placeholder: E) -> KindField {
    KindField {
        section,
        key,
        field: E::FIELD,
        placeholder: placeholder.as_str(),
        allowed: E::allowed,
        parses: |s| E::parse(s).is_some(),
    }
}

fn kind_fields() -> [KindField; 13] {
    [
        // Placeholders with the fewest requirements of their own (synthetic
        // data names no files); what still depends on a refused kind is
        // dropped by `merge_kind_errors`.
        kind_field("model", "kind", ModelKind::Mlp),
        kind_field("data", "kind", DataKind::Synthetic),
        kind_field("data", "dtype", TokenDtype::U16),
        kind_field("accumulation", "normalize", Normalize::GlobalCount),
        kind_field("accumulation", "sync", SyncMode::Boundary),
        kind_field("clipping", "on_nonfinite", OnNonfinite::Skip),
        kind_field("optimizer", "kind", OptimizerKind::Sgd),
        kind_field("schedule", "kind", ScheduleKind::Constant),
        // A top-level key: section "" is the document itself.
        kind_field("", "precision", Precision::Fp32),
        kind_field("comm", "backend", CommBackend::Auto),
        kind_field("parallel", "schedule", PipelineSchedule::OneFOneB),
        kind_field("parallel", "balance", StageBalance::Parameters),
        kind_field(
            "performance",
            "activation_checkpointing",
            ActivationCheckpointing::None,
        ),
    ]
}

/// Checks every kind field of a parsed TOML document against its allowed
/// names; each refused value is reported and replaced by a valid
/// placeholder, so that deserializing and validating the rest still runs
/// and every error of the spec is reported at once.
pub(super) fn check_kinds(doc: &mut toml::Table) -> Vec<FieldError> {
    let mut errors = Vec::new();
    for k in kind_fields() {
        let section = if k.section.is_empty() {
            &mut *doc
        } else {
            let Some(toml::Value::Table(section)) = doc.get_mut(k.section) else {
                continue;
            };
            section
        };
        let Some(value) = section.get_mut(k.key) else {
            continue;
        };
        let shown = match &*value {
            toml::Value::String(s) if (k.parses)(s) => continue,
            toml::Value::String(s) => format!("{s:?}"),
            other => other.to_string(),
        };
        errors.push(FieldError {
            field: k.field.into(),
            value: shown,
            allowed: (k.allowed)(),
        });
        *value = toml::Value::String(k.placeholder.into());
    }
    errors
}

/// The errors of a spec whose refused kinds (`kind_errors`) were replaced
/// by placeholders before `checked` ran: the kind errors first, then the
/// others, less those that only depend on a refused kind (e.g. "required
/// for data.kind = mnist" when data.kind itself was refused).
pub fn merge_kind_errors(
    kind_errors: Vec<FieldError>,
    checked: Result<(), SpecErrors>,
) -> Result<(), SpecErrors> {
    let mut errors = kind_errors;
    if let Err(SpecErrors(more)) = checked {
        let refused: Vec<String> = errors.iter().map(|e| format!("{} = ", e.field)).collect();
        errors.extend(
            more.into_iter()
                .filter(|e| !refused.iter().any(|r| e.allowed.contains(r.as_str()))),
        );
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(SpecErrors(errors))
    }
}
