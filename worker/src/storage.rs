//! A tensor's storage resized in place (csrc/storage.cpp): ZeRO-3 frees a
//! unit's gathered parameters, and every view of them the forward saved,
//! by resizing their one storage to 0 bytes, and resizes it back before
//! refilling it (engine/placement/params.rs).

use crate::shim::{call, handle};
use std::ffi::{c_char, c_void};
use tch::{TchError, Tensor};

extern "C" {
    fn accrue_storage_resize(t: *mut c_void, nbytes: i64, err: *mut c_char, len: usize) -> i32;
    fn accrue_set_grad(t: *mut c_void, g: *mut c_void, err: *mut c_char, len: usize) -> i32;
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

/// Makes `g` the `.grad` of `t` (same shape): no backward runs and
/// none of `t`'s values are read.
pub fn set_grad(t: &Tensor, g: &Tensor) -> Result<(), TchError> {
    // SAFETY: both handles are live `at::Tensor*` for the call's duration.
    call(|err, len| unsafe { accrue_set_grad(handle(t), handle(g), err, len) })
}

/// The size of `t`'s storage in bytes (None where libtorch threw).
pub fn nbytes(t: &Tensor) -> Option<usize> {
    // SAFETY: as above.
    usize::try_from(unsafe { accrue_storage_nbytes(handle(t)) }).ok()
}

/// Large allocations from their own mappings, given back to the system
/// when freed: glibc's `M_MMAP_THRESHOLD` fixed at 1 MiB. By default glibc
/// raises that threshold to the size of each mapped block freed, so after
/// ZeRO-3 frees its first gathered unit every later unit comes from the
/// heap, which keeps the freed memory resident (measured: a worker's peak
/// 627 MiB against 420 with the threshold fixed; docs/BENCHMARKS.md
/// section 15). Process-wide; a no-op off glibc.
pub fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets an allocator parameter; glibc takes
        // it at any time.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        }
    }
}
