//! The domain spec the scheduler holds beside each job's record: parsed
//! once from the wire, at submission (by the shell, [`parse_spec`]) or when
//! a stored record is restored ([`held_spec`]); every decision reads it.
//! The record keeps the wire form, written once from it, for the store,
//! the readers and the workers' assignments.

use crate::error::CoordError;
use accrue_common::JobSpec;
use accrue_proto::v1::{self, Job};
use std::sync::Arc;

/// A job's spec as the coordinator decides with it; Err holds why a stored
/// spec did not read back (such a job fails when it would form).
pub type HeldSpec = Result<Arc<JobSpec>, String>;

/// A submitted spec from the wire, parsed and its fields checked: the one
/// conversion of a submission (the scheduler's own checks follow).
pub fn parse_spec(spec: &v1::JobSpec) -> Result<JobSpec, CoordError> {
    accrue_proto::spec_from_proto(spec).map_err(|e| CoordError::InvalidArgument(e.to_string()))
}

/// The domain spec of a stored record, read once when it is restored.
pub(super) fn held_spec(job: &Job) -> HeldSpec {
    let spec = job.spec.clone().unwrap_or_default();
    accrue_proto::spec_from_proto(&spec)
        .map(Arc::new)
        .map_err(|e| e.to_string())
}
