//! The proto side of the family registry: each family's own model fields
//! (common's `FamilyFields`) to and from its own message inside the proto
//! `ModelSpec`, one module and one line in [`FAMILIES`] per family that
//! has fields of its own.

mod llama;

use crate::v1;
use accrue_common::spec::FamilyFields;

/// One family's own fields, both ways.
trait FamilyProto: Sync {
    /// Puts `from`'s fields of the family into `to` (its message).
    fn write(&self, from: &FamilyFields, to: &mut v1::ModelSpec);

    /// Reads the family's fields of `from` into `to`.
    fn read(&self, from: &v1::ModelSpec, to: &mut FamilyFields);
}

/// Every family with fields of its own, one line each.
static FAMILIES: &[&dyn FamilyProto] = &[&llama::Llama];

/// Every family's fields into `to`.
pub(super) fn fields_to_proto(from: &FamilyFields, to: &mut v1::ModelSpec) {
    for f in FAMILIES {
        f.write(from, to);
    }
}

/// Every family's fields of `from`.
pub(super) fn fields_from_proto(from: &v1::ModelSpec) -> FamilyFields {
    let mut to = FamilyFields::default();
    for f in FAMILIES {
        f.read(from, &mut to);
    }
    to
}
