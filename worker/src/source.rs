//! [`DataSource`]: where a job's samples come from. MNIST, CIFAR-10,
//! `tensors` and `synthetic` are implementations (data::Dataset,
//! which holds its split in memory); a source may equally read lazily
//! (a memory map, a file read per batch): the engine asks only for the
//! length and for batches by index.

use crate::batch::Batch;
use crate::error::{Result, TorchContext};
use tch::{Device, Kind, Tensor};

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
