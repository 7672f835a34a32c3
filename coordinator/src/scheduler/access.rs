//! Who may change a job: the owner, or a principal with the admin scope
//! (anyone, with authentication off).

use crate::domain::Caller;
use crate::error::CoordError;

/// Whether `by` may cancel `job`, owned by `owner` (empty: submitted with
/// authentication off). **Decision:** a principal cancels the jobs it owns;
/// `admin` cancels any; an ownerless job only `admin` (or anyone, with
/// authentication off).
pub fn may_cancel(job: &str, owner: &str, by: &Caller) -> Result<(), CoordError> {
    may_change(job, owner, by, "cancel", "cancels")
}

/// Whether `by` may resume `job`: the same rule as [`may_cancel`] (the
/// owner, or `admin`).
pub fn may_resume(job: &str, owner: &str, by: &Caller) -> Result<(), CoordError> {
    may_change(job, owner, by, "resume", "resumes")
}

fn may_change(
    job: &str,
    owner: &str,
    by: &Caller,
    verb: &str,
    verbs: &str,
) -> Result<(), CoordError> {
    match by {
        Caller::Anyone => Ok(()),
        Caller::Principal { admin: true, .. } => Ok(()),
        Caller::Principal { name, .. } if !owner.is_empty() && name == owner => Ok(()),
        Caller::Principal { name, .. } => Err(CoordError::PermissionDenied(format!(
            "{name} may not {verb} job {job}: it is owned by {}; a principal {verbs} only its own jobs, the admin scope any",
            if owner.is_empty() { "no one (submitted without authentication)" } else { owner }
        ))),
    }
}
