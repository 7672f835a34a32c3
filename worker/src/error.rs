//! The worker library's error type. Messages carry their data: the file, the
//! field, the step, what was expected and what was found.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Spec(#[from] crate::spec::SpecErrors),
    #[error(transparent)]
    Load(#[from] crate::spec::LoadError),
    #[error("data file {path}: {reason}")]
    Data { path: PathBuf, reason: String },
    /// The model cannot take the data's samples (found by its family's
    /// checks or the probe batch before the first step).
    #[error("model: {model} {reason}")]
    ModelInput { model: String, reason: String },
    /// The model's output breaks the contract its objective reads.
    #[error(
        "model: {model} returns shape {got:?} for 2 samples, expected [2, {classes}] (logits per class)"
    )]
    ModelOutput {
        model: crate::spec::ModelKind,
        got: Vec<i64>,
        classes: i64,
    },
    /// The model's output breaks another contract than per-class logits
    /// (a language model's logits per position and token).
    #[error("model: {model} returns shape {got:?} for 2 samples, expected {want:?} ({what})")]
    ModelOutputShape {
        model: crate::spec::ModelKind,
        got: Vec<i64>,
        want: Vec<i64>,
        what: &'static str,
    },
    /// Saved optimizer state of another shape than its parameter.
    #[error("optimizer state {name} has shape {got:?}, parameter has {want:?}")]
    OptimizerStateShape {
        name: String,
        got: Vec<i64>,
        want: Vec<i64>,
    },
    /// Saved optimizer state naming a tensor the optimizer does not have.
    #[error("optimizer state names unknown tensor {name}")]
    OptimizerStateUnknown { name: String },
    /// Saved optimizer state holding a kind of state for some parameters
    /// only.
    #[error("optimizer state has {key} for some parameters but not {param}")]
    OptimizerStateMissing { key: String, param: String },
    /// The flat gradient buffer's invariants (the gradient module).
    #[error("gradient buffer: {0}")]
    GradBuffer(String),
    /// Autocast unavailable for the device or the kind.
    #[error("precision: {0}")]
    Precision(String),
    /// A checkpoint part that cannot be encoded.
    #[error("encoding {what}: {reason}")]
    Encode { what: String, reason: String },
    /// State the ranks exchange (engine/state_sync.rs) that does not fit.
    #[error("synchronised state: {0}")]
    StateSync(String),
    #[error("initial weights {path}: {reason}")]
    Init { path: PathBuf, reason: String },
    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },
    #[error("I/O on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "non-finite gradient norm ({norm}) at optimizer step {step} (clipping.on_nonfinite = \"error\"; \
         use \"skip\" to skip such steps)"
    )]
    NonFinite { step: u64, norm: f64 },
    /// Too many optimizer steps skipped, or none applied (the words say
    /// which, with the numbers).
    #[error("{0}")]
    Skipped(String),
    /// The ring failed (its text embedded, not exposed as a source: the
    /// message is whole on its own and a chain printer shows it once).
    #[error("data plane: {0}")]
    Comm(crate::comm::CommError),
    #[error("device {device}: {reason}")]
    Device { device: String, reason: String },
    #[error("sharding: {0}")]
    Sharding(String),
    /// A family's blocks do not name its model's parameters.
    #[error("model plan: {0}")]
    Plan(#[from] PlanError),
    #[error("CUDA graph: {what}: {reason}")]
    Graph { what: &'static str, reason: String },
    /// The step schedule yielded an operation the engine cannot run there.
    #[error("step schedule: {0}")]
    Schedule(String),
    /// An evaluation whose sums do not cover the held-out split.
    #[error("evaluation: {0}")]
    Evaluation(String),
    /// libtorch's profiler refused to start or to write its trace.
    #[error("profiler: {0}")]
    Profiler(String),
    /// A process-wide libtorch setting that libtorch refused.
    #[error("libtorch setting {setting}: {reason}")]
    Backend {
        setting: &'static str,
        reason: String,
    },
    #[error("window interrupted: {0}")]
    Interrupted(String),
    /// A libtorch failure: what accrue was doing and the first line of
    /// libtorch's text (the whole text, with its C++ stack, is logged at
    /// debug level by [`torch_error`]).
    #[error("libtorch error while {context}: {message}")]
    Torch {
        context: &'static str,
        message: String,
    },
    /// A spec field whose value the data, the model file or the world
    /// size refuse (found when the job starts, not by the spec check).
    #[error("{field} = {value}: {reason}")]
    Field {
        field: &'static str,
        value: String,
        reason: String,
    },
}

impl Error {
    /// Whether the rank can keep its committed state and join a new
    /// generation (the ring failed or the coordinator aborted the window),
    /// rather than the job being wrong.
    pub fn is_recoverable(&self) -> bool {
        matches!(self, Error::Comm(_) | Error::Interrupted(_))
    }
}

impl From<crate::comm::CommError> for Error {
    fn from(e: crate::comm::CommError) -> Self {
        Error::Comm(e)
    }
}

/// A collective's failure, from below: the ring's error comes back out as
/// [`Error::Comm`], a closed communicator as [`Error::Interrupted`]; both
/// keep the rank's committed state ([`Error::is_recoverable`]).
impl From<crate::comm::collective::CollectiveError> for Error {
    fn from(e: crate::comm::collective::CollectiveError) -> Self {
        use crate::comm::collective::CollectiveError;
        match e {
            CollectiveError::Interrupted(why) => Error::Interrupted(why),
            CollectiveError::Transport(t) => match t.downcast::<crate::comm::CommError>() {
                Ok(c) => Error::Comm(*c),
                Err(other) => Error::Interrupted(other.to_string()),
            },
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Attaches what was being done to a libtorch error.
pub trait TorchContext<T> {
    fn ctx(self, context: &'static str) -> Result<T>;
}

impl<T> TorchContext<T> for std::result::Result<T, tch::TchError> {
    fn ctx(self, context: &'static str) -> Result<T> {
        self.map_err(|e| torch_error(context, &e))
    }
}

/// The one place a libtorch error becomes an [`Error::Torch`]: users get
/// the operation and libtorch's first line; the full text (C++ stack
/// frames included) goes to the log at debug level.
pub fn torch_error(context: &'static str, e: &tch::TchError) -> Error {
    let message = torch_text(context, e);
    // A tensor-parallel operation that failed inside libtorch (a lost
    // peer of the tensor group, csrc/c10d.cpp marks it): the generation's
    // end, as any collective's failure, not the job's fault.
    if matches!(e, tch::TchError::Torch(t) if tensor_group_failed(t)) {
        return Error::Interrupted(format!("{context}: {message}"));
    }
    Error::Torch { context, message }
}

/// Whether libtorch's `text` is a failed tensor-group operation (the
/// marker csrc/c10d.cpp puts on it).
pub fn tensor_group_failed(text: &str) -> bool {
    text.contains("accrue tensor group: ")
}

/// Longest libtorch text kept in a user-facing message, in characters.
const TORCH_TEXT_MAX: usize = 160;

/// libtorch's message for users: its first line without tch's "Internal
/// torch error: " prefix, cut at a sentence end when long; the whole text
/// is logged at debug level under `context`.
pub fn torch_text(context: &str, e: &tch::TchError) -> String {
    let full = match e {
        tch::TchError::Torch(text) => text.clone(),
        other => other.to_string(),
    };
    tracing::debug!(context, error = %full, "libtorch error (full text)");
    first_line(&full, TORCH_TEXT_MAX)
}

/// The first non-empty line of `text` (a Rust panic message's escaped
/// `\n` counts as a line end too), at most `max` characters: cut after
/// the last sentence that fits, else at `max` with an ellipsis.
pub fn first_line(text: &str, max: usize) -> String {
    let line = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    let line = line.split("\\n").next().unwrap_or(line).trim_end();
    if line.chars().count() <= max {
        return line.to_string();
    }
    let head: String = line.chars().take(max).collect();
    match head.rfind(". ") {
        Some(i) if i > 0 => head[..=i].to_string(),
        _ => format!("{}…", head.trim_end()),
    }
}

pub fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { path, source }
}

/// For in-place libtorch operations, whose returned tensor is the input again.
pub trait InPlace {
    fn ctx_(self, context: &'static str) -> Result<()>;
}

impl InPlace for std::result::Result<tch::Tensor, tch::TchError> {
    fn ctx_(self, context: &'static str) -> Result<()> {
        self.map(drop).map_err(|e| torch_error(context, &e))
    }
}

/// A safetensors error in words (the crate's Display is its Debug:
/// `InvalidOffset("tokens")`, `IoError(Os { .. })`).
pub fn safetensors_words(e: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::InvalidHeader => "its header is not UTF-8 text".into(),
        E::InvalidHeaderStart => {
            "its header does not start with '{' (not a safetensors file)".into()
        }
        E::InvalidHeaderDeserialization => "its header is not valid safetensors JSON".into(),
        E::HeaderTooLarge => "its header is larger than safetensors allows (100 MB)".into(),
        E::HeaderTooSmall => "it is shorter than a safetensors header (8 bytes)".into(),
        E::InvalidHeaderLength => "its header length is larger than the file".into(),
        E::TensorNotFound(n) => format!("it has no tensor {n:?}"),
        E::TensorInvalidInfo => "a tensor's shape, dtype and offsets disagree".into(),
        E::InvalidOffset(n) => format!(
            "the offsets of tensor {n:?} are invalid (out of the file, overlapping or out of order)"
        ),
        E::IoError(io) => format!("cannot read it: {io}"),
        E::JsonError(j) => format!("its header is not valid JSON: {j}"),
        E::InvalidTensorView(dtype, shape, len) => {
            format!("a {dtype:?} tensor of shape {shape:?} cannot be {len} bytes")
        }
        E::MetadataIncompleteBuffer => {
            "its tensors do not cover the data that follows the header (truncated or padded)".into()
        }
        E::ValidationOverflow => "a tensor's shape overflows (a corrupt header)".into(),
        // Kept total for variants of later versions.
        #[allow(unreachable_patterns)]
        other => format!("{other:?}"),
    }
}

/// A plan that does not fit the model it was made for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("parameter {name} is in no block of the model's plan")]
    Uncovered { name: String },
    #[error("parameter {name} is in {count} blocks of the model's plan (one expected)")]
    Repeated { name: String, count: usize },
    #[error("block {block} of the model's plan names {name}, which the model does not have")]
    Unknown { block: String, name: String },
    /// More pipeline stages than places a stage may begin.
    #[error(
        "parallel.pipeline = {stages}: the model has {units} {what}, and a stage holds \
         at least one; at most {units} stages"
    )]
    TooManyStages {
        stages: usize,
        units: usize,
        what: String,
    },
    /// `layers_per_stage` that does not fit the model or the degree.
    #[error("parallel.layers_per_stage = {given:?}: {reason}")]
    LayersPerStage { given: Vec<u64>, reason: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_errors_keep_the_first_line_and_the_operation() {
        let e = tch::TchError::Torch(
            "Target 4 is out of bounds.\nException raised from nll_loss_out_frame at \
             LossNLL.cpp:255 (most recent call first):\nframe #0: c10::Error::Error"
                .into(),
        );
        let msg = torch_error("computing the loss", &e).to_string();
        assert_eq!(
            msg,
            "libtorch error while computing the loss: Target 4 is out of bounds."
        );
        let e = tch::TchError::Shape("[2, 3] vs [4]".into());
        assert_eq!(torch_text("x", &e), "invalid shape: [2, 3] vs [4]");
    }

    #[test]
    fn first_line_cuts_long_lines_and_escaped_newlines() {
        assert_eq!(first_line("\n  a\nb", 10), "a");
        let panic = r#"on an `Err` value: Torch("bad dim\nException raised"#;
        assert_eq!(
            first_line(panic, 100),
            r#"on an `Err` value: Torch("bad dim"#
        );
        let long = format!("{}. {}", "a".repeat(50), "b".repeat(100));
        assert_eq!(first_line(&long, 80), format!("{}.", "a".repeat(50)));
        let words = "c".repeat(100);
        assert_eq!(first_line(&words, 10), format!("{}…", "c".repeat(10)));
        assert_eq!(first_line("", 10), "");
    }
}
