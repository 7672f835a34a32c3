//! Tensor parallelism's operations on a tensor group (issue 42): Megatron-
//! LM's mappings as autograd functions of the c10d shim (csrc/c10d.cpp),
//! so the model's forward writes them once and one backward runs their
//! mirrors:
//! - [`TensorGroup::copy`] (Megatron's `f`): the identity forward, the
//!   gradient summed over the group backward (before column-split layers);
//! - [`TensorGroup::reduce`] (`g`): row-split layers' partial outputs
//!   summed forward, the identity backward;
//! - [`TensorGroup::gather_last`]: the vocabulary shards' logits joined,
//!   each rank's columns of the gradient backward;
//! - [`TensorGroup::shared_sum`]: a slice several ranks hold (a key-value
//!   head serving T / kv ranks), its gradient summed over them backward;
//! - [`TensorGroup::all_reduce_`]: a plain reduction outside the graph (the
//!   vocabulary-parallel cross-entropy's max and sums, the clip norm).
//!
//! The group of a generation changes when the mesh re-forms; the model
//! reaches the current one through a [`TensorGroupCell`] the engine sets.

use crate::shim::{handle, one};
use std::ffi::{c_char, c_void};
use std::sync::{Arc, Mutex};
use tch::{TchError, Tensor};

extern "C" {
    fn accrue_tp_copy(
        g: *mut c_void,
        x: *mut c_void,
        out: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    fn accrue_tp_reduce(
        g: *mut c_void,
        x: *mut c_void,
        out: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    fn accrue_tp_gather_last(
        g: *mut c_void,
        x: *mut c_void,
        sizes: *const i64,
        n: i32,
        rank: i32,
        out: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    fn accrue_tp_shared_sum(
        g: *mut c_void,
        x: *mut c_void,
        dim: i64,
        start: i64,
        whole: i64,
        out: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    fn accrue_tp_bytes(layers: *mut i64, other: *mut i64);
    fn accrue_tp_all_reduce(
        g: *mut c_void,
        t: *mut c_void,
        op: i32,
        err: *mut c_char,
        len: usize,
    ) -> i32;
}

/// A c10d tensor group as the model's operations take it: the shim's group
/// and this rank's place in it.
#[derive(Clone, Copy, Debug)]
pub struct TensorGroup {
    ptr: *mut c_void,
    pub rank: usize,
    pub size: usize,
    /// Where the group's reductions want their tensors (NCCL: its GPU;
    /// gloo: the CPU, a CUDA tensor staged through the host).
    pub device: tch::Device,
}

// SAFETY: the pointer is a c10d backend (thread-safe); the engine's thread
// alone runs the model and its backward, and the mesh that owns the group
// outlives every graph made with it (a generation's graphs are dropped
// before its groups).
unsafe impl Send for TensorGroup {}
unsafe impl Sync for TensorGroup {}

/// The reductions [`TensorGroup::all_reduce_`] offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    Max,
}

impl TensorGroup {
    /// # Safety
    /// `ptr` is the shim's live group (csrc/c10d.cpp `Group*`), kept alive
    /// while this value or a graph made with it is used.
    pub unsafe fn new(ptr: *mut c_void, rank: usize, size: usize, device: tch::Device) -> Self {
        Self {
            ptr,
            rank,
            size,
            device,
        }
    }

    /// `f`: `x` forward, its gradient summed over the group backward.
    pub fn copy(&self, x: &Tensor) -> Result<Tensor, TchError> {
        one(|out, err, len| unsafe { accrue_tp_copy(self.ptr, handle(x), out, err, len) })
    }

    /// `g`: `x` summed over the group forward, the identity backward.
    pub fn reduce(&self, x: &Tensor) -> Result<Tensor, TchError> {
        one(|out, err, len| unsafe { accrue_tp_reduce(self.ptr, handle(x), out, err, len) })
    }

    /// Every rank's `x` joined along the last dimension in rank order
    /// (rank r's is `widths[r]` wide; they may differ).
    pub fn gather_last(&self, x: &Tensor, widths: &[i64]) -> Result<Tensor, TchError> {
        let n = i32::try_from(widths.len()).unwrap_or(i32::MAX);
        let rank = i32::try_from(self.rank).unwrap_or(i32::MAX);
        one(|out, err, len| unsafe {
            accrue_tp_gather_last(self.ptr, handle(x), widths.as_ptr(), n, rank, out, err, len)
        })
    }

    /// A slice several ranks hold (rows `start..` of a tensor `whole`
    /// long along `dim`): `x` forward; backward, its gradient summed over
    /// the ranks that hold the same rows (a key-value head that serves
    /// T / kv ranks), so its `.grad` is whole on each of them.
    pub fn shared_sum(
        &self,
        x: &Tensor,
        dim: i64,
        start: i64,
        whole: i64,
    ) -> Result<Tensor, TchError> {
        one(|out, err, len| unsafe {
            accrue_tp_shared_sum(self.ptr, handle(x), dim, start, whole, out, err, len)
        })
    }

    /// `t` (contiguous) reduced over the group in place, outside any graph.
    pub fn all_reduce_(&self, t: &Tensor, op: Reduce) -> Result<(), TchError> {
        let op = match op {
            Reduce::Sum => 0,
            Reduce::Max => 1,
        };
        crate::shim::call(|err, len| unsafe {
            accrue_tp_all_reduce(self.ptr, handle(t), op, err, len)
        })
    }
}

/// The tensor group of the current generation, shared by the model (which
/// runs the operations) and the engine (which sets it when the mesh
/// re-forms, and clears it between generations).
#[derive(Clone, Debug, Default)]
pub struct TensorGroupCell(Arc<Mutex<Option<TensorGroup>>>);

impl TensorGroupCell {
    pub fn set(&self, g: Option<TensorGroup>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = g;
    }

    /// The group, or an error naming what is missing.
    pub fn get(&self) -> Result<TensorGroup, TchError> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .ok_or_else(|| TchError::Torch("the tensor group of this generation is closed".into()))
    }
}

/// Payload bytes this process's tensor-parallel reductions have carried
/// so far: the layers' (f, g, shared slices) and the rest (the
/// cross-entropy's, the logits' gathers, the norm).
pub fn bytes_so_far() -> (u64, u64) {
    let (mut layers, mut other) = (0i64, 0i64);
    // SAFETY: two plain integer outputs.
    unsafe { accrue_tp_bytes(&mut layers, &mut other) };
    (layers.max(0) as u64, other.max(0) as u64)
}
