//! The worker-to-worker data plane (DESIGN section 8).
pub mod chunks;
pub mod ring;
pub mod wire;

pub use ring::{bind, CommError, RingConfig, TcpRing};
