//! A tensor's storage resized in place (csrc/storage.cpp): ZeRO-3 frees a
//! unit's gathered parameters, and every view of them the forward saved,
//! by resizing their one storage to 0 bytes, and resizes it back before
//! refilling it (engine/placement/params.rs).

use crate::fused_ops::{call, handle};
use std::ffi::{c_char, c_void};
use tch::{TchError, Tensor};

extern "C" {
    fn accrue_storage_resize(t: *mut c_void, nbytes: i64, err: *mut c_char, len: usize) -> i32;
    fn accrue_storage_nbytes(t: *mut c_void) -> i64;
}

/// Resizes `t`'s storage to `bytes` (0 frees it); the contents are not
/// kept. Every tensor sharing the storage sees the new one.
pub fn resize(t: &Tensor, bytes: usize) -> Result<(), TchError> {
    let n =
        i64::try_from(bytes).map_err(|_| TchError::Torch(format!("a storage of {bytes} bytes")))?;
    // SAFETY: `handle` is a live `at::Tensor*` for the call's duration.
    call(|err, len| unsafe { accrue_storage_resize(handle(t), n, err, len) })
}

/// The size of `t`'s storage in bytes (None where libtorch threw).
pub fn nbytes(t: &Tensor) -> Option<usize> {
    // SAFETY: as above.
    usize::try_from(unsafe { accrue_storage_nbytes(handle(t)) }).ok()
}
