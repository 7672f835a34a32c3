//! accrue-worker: the training engine of one rank (libtorch through tch).
//!
//! Folders by concern: `comm` (process groups, the ring, c10d, the
//! Collective the engine speaks), `cuda` (how the model runs on a device:
//! autocast, CUDA graphs, fused kernels, libtorch settings, the profiler),
//! `source` (data sets, batches, sharding, random numbers), `family` (model
//! families and the built model), `optim` (the optimizer rule, its
//! back-ends and the learning-rate schedule), `grads` (the
//! gradient-accumulation buffer and the tally that rides in it),
//! `objective` (the losses a job trains with, the language-model head's
//! fused loss), `engine` (the training loop: placement strategies and the
//! trainer over a step schedule), `checkpoint`, `sample` (generation),
//! `daemon` (the worker daemon's job threads). `error` and `ring_buckets`
//! sit at the root: every folder returns the one, and the other joins the
//! ring's errors to it.
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
pub mod objective;
pub mod optim;
mod ring_buckets;
pub mod sample;
pub mod source;
pub mod storage;
pub use accrue_common::spec;

// The modules' paths before worker/src was grouped by concern (issue 38):
// every `crate::x` and `accrue_worker::x` keeps working.
pub use comm::{chunks, collective, shard};
#[cfg(accrue_cuda)]
pub use cuda::cuda_graph;
pub use cuda::{amp, backends, fused_ops, graphs, profiler};
pub use family::model;
pub use grads::tally;
pub use objective::head_loss;
pub use optim::schedule;
pub use source::{batch, data, rng, sampler};

pub use collective::{Collective, SingleRank};
pub use engine::{Engine, Event, RunOptions, StepReport};
pub use error::{Error, Result};
pub use spec::JobSpec;
