//! accrue-worker: the training engine of one rank (libtorch through tch).
//!
//! Folders by concern: `comm` (process groups, the ring, c10d, the
//! Collective the engine speaks), `cuda` (how the model runs on a device:
//! autocast, CUDA graphs, fused kernels, libtorch settings, the profiler),
//! `source` (data sets, batches, sharding, random numbers), `family` (model
//! families), `optim` (the optimizer rule and its back-ends), `engine` (the
//! training loop), `checkpoint`, `sample` (generation), `daemon` (the worker
//! daemon's job threads).
//!
//! See docs/SEMANTICS.md for the accumulation, normalization and clipping
//! contract and docs/ARCHITECTURE.md for where this crate sits.

pub mod checkpoint;
pub mod comm;
pub mod cuda;
pub mod daemon;
pub mod engine;
pub mod error;
pub mod family;
pub mod grads;
pub mod head_loss;
pub mod model;
pub mod objective;
pub mod optim;
mod ring_buckets;
pub mod sample;
pub mod schedule;
pub mod source;
pub mod tally;
pub use accrue_common::spec;

// The modules' paths before worker/src was grouped by concern (issue 38):
// every `crate::x` and `accrue_worker::x` keeps working.
pub use comm::{chunks, collective, shard};
#[cfg(accrue_cuda)]
pub use cuda::cuda_graph;
pub use cuda::{amp, backends, fused_ops, graphs, profiler};
pub use source::{batch, data, rng, sampler};

pub use collective::{Collective, SingleRank};
pub use engine::{Engine, Event, RunOptions, StepReport};
pub use error::{Error, Result};
pub use spec::JobSpec;
