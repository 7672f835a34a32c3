//! accrue's shared domain types: the job spec (docs/SPEC.md) and its
//! validation. No libtorch: the coordinator and the CLI use this crate too.
pub mod flock;
pub mod ringkey;
pub mod small_file;
pub mod spec;
pub mod strict_modes;

pub use spec::JobSpec;
