//! Process-wide libtorch settings a job may ask for, as `torch.backends`
//! sets them in PyTorch (through the shim in csrc/amp.cpp, which every
//! build compiles).

use crate::error::{Error, Result};

extern "C" {
    fn accrue_set_cudnn_deterministic(on: i32) -> i32;
    fn accrue_cudnn_deterministic() -> i32;
}

/// `torch.backends.cudnn.deterministic = on`: convolutions use cuDNN's
/// deterministic algorithms only. Process-wide (a daemon sets it for each
/// job it starts).
pub fn set_cudnn_deterministic(on: bool) -> Result<()> {
    // SAFETY: a plain C function of the shim; it sets one flag of
    // libtorch's global context and catches every C++ exception.
    if unsafe { accrue_set_cudnn_deterministic(i32::from(on)) } != 0 {
        return Err(Error::Backend {
            setting: "performance.cudnn_deterministic",
            reason: format!("libtorch refused {on}"),
        });
    }
    Ok(())
}

/// Whether cuDNN's deterministic algorithms are on (None: libtorch threw).
pub fn cudnn_deterministic() -> Option<bool> {
    // SAFETY: as above; reads one flag.
    match unsafe { accrue_cudnn_deterministic() } {
        1 => Some(true),
        0 => Some(false),
        _ => None,
    }
}
