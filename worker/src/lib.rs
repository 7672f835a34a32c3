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
//! Modules are reached only through their folder
//! (`accrue_worker::source::data`, `crate::cuda::amp`): the root re-exports
//! no module paths, only the few items every user of the crate needs
//! (`Engine`, `Collective`, `SingleRank`, `Error`, `JobSpec`, ...).
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
pub(crate) mod shim;
pub mod source;
pub mod storage;
pub use accrue_common::spec;

pub use comm::collective::{Collective, SingleRank};
pub use engine::{Engine, Event, RunOptions, StepReport};
pub use error::{Error, Result};
pub use spec::JobSpec;
