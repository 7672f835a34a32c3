//! The calling convention of accrue's C++ shim (csrc/: the fused
//! operations, the storage resize, the fused optimizer, the flat copies):
//! tensor handles in, an error buffer, tensors made by the shim taken
//! over. A leaf: it uses nothing of the crate, so every module that calls
//! the shim (comm, cuda, optim, storage) can without a cycle.

use std::ffi::{c_char, c_void, CStr};
use tch::{TchError, Tensor};

/// A tensor's handle as the shim takes it (`at::Tensor*`).
pub(crate) fn handle(t: &Tensor) -> *mut c_void {
    t.as_ptr() as *mut c_void
}

/// Calls a shim function with an error buffer: Err carries the first
/// line of libtorch's message.
pub(crate) fn call(f: impl FnOnce(*mut c_char, usize) -> i32) -> Result<(), TchError> {
    let mut buf = [0 as c_char; 1024];
    if f(buf.as_mut_ptr(), buf.len()) == 0 {
        return Ok(());
    }
    // SAFETY: the buffer starts zeroed and the shim NUL-terminates what it
    // writes into it.
    let text = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
    Err(TchError::Torch(
        text.lines().next().unwrap_or_default().to_string(),
    ))
}

/// Calls a shim function that makes one tensor.
pub(crate) fn one(
    f: impl FnOnce(*mut *mut c_void, *mut c_char, usize) -> i32,
) -> Result<Tensor, TchError> {
    let mut out = std::ptr::null_mut();
    call(|err, len| f(&mut out, err, len))?;
    // SAFETY: on success the shim set `out` to a new handle.
    Ok(unsafe { owned(out) })
}

/// Takes ownership of a tensor handle the shim made.
///
/// # Safety
/// `p` is a live `at::Tensor*` allocated by the shim with `new`, owned by
/// nobody else.
pub(crate) unsafe fn owned(p: *mut c_void) -> Tensor {
    Tensor::from_ptr(p.cast())
}
