//! The Llama family's fused operations under autocast (csrc/fused_ops.cpp,
//! docs/SEMANTICS.md "Fused kernels"): autograd functions that compute
//! what a chain of transformers' ops computes, with its roundings, in one
//! CUDA kernel forward and one backward (csrc/kernels.cu, built with
//! `ACCRUE_CUDA=1`), or through ATen's ops (the reference: the CPU, and
//! CUDA when `kernels` is false).
//!
//! - [`rms_norm_cast`]: LlamaRMSNorm of the fp32 residual stream, then
//!   autocast's cast for the next projection; [`add_rms_norm_cast`] the
//!   same after the residual add of a bf16 or fp16 branch;
//! - [`rope_qkv`]: the fused q/k/v projection's output split into heads,
//!   q and k rotated (transformers' `apply_rotary_pos_emb` in fp32), cast
//!   as autocast casts them for the attention;
//! - [`swiglu`]: `silu(gate) * up` of the fused gate/up projection's
//!   output, in the activation type;
//! - [`cross_entropy_sum`]: the summed cross-entropy of the head's bf16
//!   or fp16 logits as transformers computes it on `logits.float()`,
//!   without the fp32 logits (their gradient comes back in their type).

use crate::shim::{call, handle, one, owned};
use std::ffi::{c_char, c_void};
use tch::{Kind, TchError, Tensor};

extern "C" {
    fn accrue_ops_have_kernels() -> i32;
    fn accrue_op_rms_norm_cast(
        x: *mut c_void,
        w: *mut c_void,
        eps: f64,
        dtype: i32,
        kernels: i32,
        out: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    fn accrue_op_add_rms_norm_cast(
        x: *mut c_void,
        a: *mut c_void,
        w: *mut c_void,
        eps: f64,
        kernels: i32,
        sum: *mut *mut c_void,
        out: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    fn accrue_op_rope_qkv(
        y: *mut c_void,
        cos: *mut c_void,
        sin: *mut c_void,
        hq: i64,
        hkv: i64,
        kernels: i32,
        q: *mut *mut c_void,
        k: *mut *mut c_void,
        v: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    fn accrue_op_cross_entropy_sum(
        logits: *mut c_void,
        targets: *mut c_void,
        kernels: i32,
        out: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    fn accrue_op_swiglu(
        y: *mut c_void,
        kernels: i32,
        out: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
}

/// Whether this build has accrue's CUDA kernels (`ACCRUE_CUDA=1`).
pub fn kernels_built() -> bool {
    // SAFETY: a plain C function returning a constant.
    unsafe { accrue_ops_have_kernels() == 1 }
}

/// Whether the fused operations on `device` run accrue's kernels: CUDA,
/// a build that has them, and not `ACCRUE_FUSED_KERNELS=0` in the
/// environment (the reference then, docs/OPERATIONS.md).
pub fn use_kernels(device: tch::Device) -> bool {
    // Read once: the loss asks in every micro-step.
    static SWITCHED_OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off =
        *SWITCHED_OFF.get_or_init(|| std::env::var("ACCRUE_FUSED_KERNELS").as_deref() == Ok("0"));
    device.is_cuda() && kernels_built() && !off
}

/// c10::ScalarType's number of an autocast type (as amp.rs maps it).
fn dtype_code(kind: Kind) -> Result<i32, TchError> {
    crate::cuda::amp::scalar_type(kind).ok_or_else(|| {
        TchError::Kind(format!(
            "fused operations cast to bf16 or fp16, not {kind:?}"
        ))
    })
}

/// `cast_kind(w * (x * rsqrt(mean(x^2) + eps)))` over the last dimension
/// of float32 `x` with float32 weight `w`.
pub fn rms_norm_cast(
    x: &Tensor,
    w: &Tensor,
    eps: f64,
    kind: Kind,
    kernels: bool,
) -> Result<Tensor, TchError> {
    let dtype = dtype_code(kind)?;
    // SAFETY: live tensor handles borrowed for the call; the shim catches
    // every C++ exception and writes at most `len` bytes into `err`.
    one(|out, err, len| unsafe {
        accrue_op_rms_norm_cast(
            handle(x),
            handle(w),
            eps,
            dtype,
            i32::from(kernels),
            out,
            err,
            len,
        )
    })
}

/// The residual stream's add `s = x + a` (float32 `x`, `a` the branch in
/// the autocast type) and the next norm cast to `a`'s type: `(s,
/// cast(w * (s * rsqrt(mean(s^2) + eps))))`, both with gradients.
pub fn add_rms_norm_cast(
    x: &Tensor,
    a: &Tensor,
    w: &Tensor,
    eps: f64,
    kernels: bool,
) -> Result<(Tensor, Tensor), TchError> {
    let (mut sum, mut out) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: as in rms_norm_cast.
    call(|err, len| unsafe {
        accrue_op_add_rms_norm_cast(
            handle(x),
            handle(a),
            handle(w),
            eps,
            i32::from(kernels),
            &mut sum,
            &mut out,
            err,
            len,
        )
    })?;
    // SAFETY: on success the shim set both to new handles.
    Ok(unsafe { (owned(sum), owned(out)) })
}

/// q `[N, hq, T, D]`, k and v `[N, hkv, T, D]` (contiguous, in `y`'s
/// type) of the fused projection's output `y` `[N, T, (hq + 2 hkv) D]`,
/// q and k rotated with float32 `cos` and `sin` `[T, D/2]`.
pub fn rope_qkv(
    y: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    hq: i64,
    hkv: i64,
    kernels: bool,
) -> Result<[Tensor; 3], TchError> {
    let (mut q, mut k, mut v) = (
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    // SAFETY: as in rms_norm_cast.
    call(|err, len| unsafe {
        accrue_op_rope_qkv(
            handle(y),
            handle(cos),
            handle(sin),
            hq,
            hkv,
            i32::from(kernels),
            &mut q,
            &mut k,
            &mut v,
            err,
            len,
        )
    })?;
    // SAFETY: on success the shim set all three to new handles.
    Ok(unsafe { [owned(q), owned(k), owned(v)] })
}

/// `silu(gate) * up` of `y` `[..., 2I]` (gate | up), in `y`'s type.
pub fn swiglu(y: &Tensor, kernels: bool) -> Result<Tensor, TchError> {
    // SAFETY: as in rms_norm_cast.
    one(|out, err, len| unsafe { accrue_op_swiglu(handle(y), i32::from(kernels), out, err, len) })
}

/// `sum(-log_softmax(logits.float())[target])` over the targets that are
/// not -100: `logits` `[..., V]` bf16 or fp16, `targets` int64 `[...]`; a
/// float32 0-dim tensor whose gradient flows back to `logits` in their
/// type.
pub fn cross_entropy_sum(
    logits: &Tensor,
    targets: &Tensor,
    kernels: bool,
) -> Result<Tensor, TchError> {
    // SAFETY: as in rms_norm_cast.
    one(|out, err, len| unsafe {
        accrue_op_cross_entropy_sum(
            handle(logits),
            handle(targets),
            i32::from(kernels),
            out,
            err,
            len,
        )
    })
}
