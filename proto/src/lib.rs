//! accrue's gRPC API (generated from proto/accrue/v1/accrue.proto) and the
//! conversions between its JobSpec and the domain job spec.

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("accrue.v1");
}

mod convert;
pub mod layout;
pub mod secure;
pub mod tls;

pub use convert::{spec_from_proto, spec_to_proto};
