//! accrue-worker: the training engine of one rank (libtorch through tch).
//!
//! See docs/SEMANTICS.md for the accumulation, normalization and clipping
//! contract and docs/ARCHITECTURE.md for where this crate sits.

pub mod amp;
pub mod backends;
pub mod batch;
pub mod checkpoint;
pub mod chunks;
pub mod collective;
pub mod comm;
#[cfg(accrue_cuda)]
pub mod cuda_graph;
pub mod daemon;
pub mod data;
pub mod engine;
pub mod error;
pub mod family;
pub mod fused_ops;
pub mod grads;
pub mod graphs;
pub mod head_loss;
pub mod model;
pub mod objective;
pub mod optim;
pub mod profiler;
mod ring_buckets;
pub mod rng;
pub mod sample;
pub mod sampler;
pub mod schedule;
pub mod shard;
pub mod source;
pub mod tally;
pub use accrue_common::spec;

pub use collective::{Collective, SingleRank};
pub use engine::{Engine, Event, RunOptions, StepReport};
pub use error::{Error, Result};
pub use spec::JobSpec;
