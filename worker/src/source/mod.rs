//! [`DataSource`]: where a job's samples come from. MNIST, CIFAR-10,
//! `tensors` and `synthetic` are implementations (data::Dataset,
//! which holds its split in memory); a source may equally read lazily
//! (a memory map, a file read per batch): the engine asks only for the
//! length and for batches by index.
//!
//! Language-model data (lazy, memory-mapped, validated whole at open):
//! [`tokens::TokenStream`] (one flat token stream, llm.c's `.bin` format or
//! headerless) and [`sequences::Sequences`] (rows of a safetensors file,
//! with an optional loss mask). Both give `inputs` and `targets` as i64
//! `[N, T]`, targets of [`IGNORE_INDEX`] meaning "no target", and count the
//! other targets exactly on the host.

use crate::error::{Result, TorchContext};
use crate::source::batch::Batch;
use tch::{Device, Kind, Tensor};

pub mod batch;
pub mod data;
mod lm;
pub mod pack;
pub mod rng;
pub mod sampler;
pub mod sequences;
pub mod tokens;

pub use sequences::Sequences;
pub use tokens::TokenStream;

/// The target of a position that is not predicted (padding, a masked
/// prompt token): cross-entropy's `ignore_index`, as in PyTorch and
/// Hugging Face.
pub const IGNORE_INDEX: i64 = -100;

/// The width of a token in a file without a header (`data.dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenDtype {
    U16,
    U32,
}

impl TokenDtype {
    /// Bytes per token.
    pub fn width(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }

    /// The spec's spelling (`"u16"`, `"u32"`).
    pub fn name(self) -> &'static str {
        match self {
            TokenDtype::U16 => "u16",
            TokenDtype::U32 => "u32",
        }
    }
}

/// What a language-model reader needs from the spec.
#[derive(Debug, Clone)]
pub struct TokenOptions {
    /// T (`data.seq_len`): the positions of a sample.
    pub seq_len: usize,
    /// The input id of padding positions (`data.pad_id`; rows shorter than
    /// T). Must lie in `0..vocab_size`.
    pub pad_id: i64,
    /// `model.vocab_size`: every token of the file must lie in
    /// `0..vocab_size`.
    pub vocab_size: i64,
    /// `data.dtype`: the token width of a headerless token file; `None`
    /// for an llm.c file (its header says the width). Not used by
    /// [`Sequences`] (its tensors carry their dtype).
    pub dtype: Option<TokenDtype>,
    /// Where batches go: they are built on the host (the indices are read
    /// there too) and then moved to this device.
    pub device: Device,
}

/// A split of samples, indexed 0..len.
pub trait DataSource: Send + std::fmt::Debug {
    /// Samples in the split (the sampler shards 0..len).
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The samples at `indices` (int64, 1-D, on the engine's device) as a
    /// batch on the source's device. The micro-step's CUDA graph calls it
    /// in its body: an implementation that a graph may capture reads only
    /// tensors on the device (see [`DataSource::resident`]).
    fn batch(&self, indices: &Tensor) -> Result<Batch>;

    /// The consecutive samples `start..start + len` (evaluation).
    fn range(&self, start: i64, len: i64, device: Device) -> Result<Batch> {
        let idx = Tensor::f_arange_start(start, start + len, (Kind::Int64, device))
            .ctx("selecting samples")?;
        self.batch(&idx)
    }

    /// The device tensors [`DataSource::batch`] reads, by name: a CUDA
    /// graph replays their addresses, so they must not move. Empty for a
    /// source that reads lazily (such a source cannot be captured).
    fn resident(&self) -> Vec<(&'static str, Tensor)> {
        Vec::new()
    }
}
