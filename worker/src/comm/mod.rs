//! The worker-to-worker data plane (docs/ARCHITECTURE.md, "The data plane"):
//! process groups per mesh axis ([`group`], formed by [`mesh`]) on two
//! transports, libtorch's c10d ([`c10d`]) and the TCP ring and its wire
//! format. It builds on the pure arithmetic below it ([`crate::comm::chunks`],
//! [`crate::comm::shard`]) and implements [`crate::comm::collective::Collective`]; its
//! errors are its own ([`CommError`]), which the worker's `error::Error`
//! wraps from above.
pub mod admission;
pub mod c10d;
pub mod chunks;
pub mod collective;
pub mod group;
pub mod mesh;
pub mod mesh_collective;
pub mod ring;
pub mod shard;
pub mod tensor_ops;
pub mod wire;

pub use ring::{bind, CommError, RingConfig, TcpRing};
