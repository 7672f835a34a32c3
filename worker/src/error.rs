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
    #[error("model: {0}")]
    Model(String),
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
    #[error("data plane: {0}")]
    Comm(#[from] crate::comm::CommError),
    #[error("device {device}: {reason}")]
    Device { device: String, reason: String },
    #[error("sharding: {0}")]
    Sharding(String),
    #[error("CUDA graph: {what}: {reason}")]
    Graph { what: &'static str, reason: String },
    #[error("window interrupted: {0}")]
    Interrupted(String),
    #[error("libtorch error while {context}: {source}")]
    Torch {
        context: &'static str,
        source: tch::TchError,
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

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Attaches what was being done to a libtorch error.
pub trait TorchContext<T> {
    fn ctx(self, context: &'static str) -> Result<T>;
}

impl<T> TorchContext<T> for std::result::Result<T, tch::TchError> {
    fn ctx(self, context: &'static str) -> Result<T> {
        self.map_err(|source| Error::Torch { context, source })
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
        self.map(drop)
            .map_err(|source| Error::Torch { context, source })
    }
}
