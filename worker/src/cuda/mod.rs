//! How the model runs on a device: autocast (amp), CUDA graphs (graphs,
//! and cuda_graph's shim with `ACCRUE_CUDA=1`), the fused operations and
//! kernels (fused_ops), process-wide libtorch settings (backends) and the
//! profiler.

pub mod amp;
pub mod backends;
#[cfg(accrue_cuda)]
pub mod cuda_graph;
pub mod fused_ops;
pub mod graphs;
pub mod profiler;
