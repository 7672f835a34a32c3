//! libtorch's c10d process groups (csrc/c10d.cpp): gloo's ProcessGroupGloo
//! on the CPU and, in a CUDA build, ProcessGroupNCCL on a CUDA device: the
//! engines PyTorch's DDP and FSDP run on, as a
//! [`Group`](crate::comm::group::Group). A gloo group takes CPU tensors, an
//! NCCL group tensors on its device ([`Group::device`]). Rendezvous goes through accrue's
//! authenticated store ([`store`]): each group's keys live under its own
//! name in the store world rank 0 hosts for the generation.
//!
//! Every operation returns a handle ([`Work`]) at once; waiting is bounded
//! by the group's timeout (gloo's own operation timeout is the same), so a
//! lost peer is an error on every survivor, never a hang; the group is then
//! done (the generation drops it, or `abort` fails what is still pending).

pub mod store;

use crate::comm::group::{Group, GroupError, Pending, ReduceOp, Wait};
use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use store::{Op, Request, StoreClient};
use tch::{Device, Tensor};

type StoreCall = unsafe extern "C" fn(
    ctx: *mut c_void,
    kind: i32,
    key: *const c_char,
    key_len: usize,
    value: *const u8,
    value_len: usize,
    arg: i64,
    timeout_ms: i64,
    out: *mut *mut u8,
    out_len: *mut usize,
    number: *mut i64,
    err: *mut c_char,
    len: usize,
) -> i32;

extern "C" {
    fn accrue_c10d_store_new(ctx: *mut c_void, call: *mut c_void) -> *mut c_void;
    fn accrue_c10d_store_free(store: *mut c_void);
    fn accrue_c10d_gloo_new(
        store: *mut c_void,
        hostname: *const c_char,
        rank: i32,
        size: i32,
        timeout_ms: i64,
        group: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    fn accrue_c10d_has_nccl() -> i32;
    fn accrue_c10d_nccl_new(
        store: *mut c_void,
        rank: i32,
        size: i32,
        timeout_ms: i64,
        device: i32,
        group: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    fn accrue_c10d_group_free(g: *mut c_void);
    fn accrue_c10d_group_abort(g: *mut c_void, err: *mut c_char, len: usize) -> i32;
    fn accrue_c10d_all_reduce(
        g: *mut c_void,
        t: *mut c_void,
        op: i32,
        work: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    fn accrue_c10d_reduce_scatter(
        g: *mut c_void,
        out: *mut c_void,
        input: *mut c_void,
        op: i32,
        work: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    fn accrue_c10d_all_gather(
        g: *mut c_void,
        out: *mut c_void,
        input: *mut c_void,
        work: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    fn accrue_c10d_broadcast(
        g: *mut c_void,
        t: *mut c_void,
        root: i32,
        work: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    fn accrue_c10d_send(
        g: *mut c_void,
        t: *mut c_void,
        dst: i32,
        tag: i32,
        work: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    fn accrue_c10d_recv(
        g: *mut c_void,
        t: *mut c_void,
        src: i32,
        tag: i32,
        work: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> i32;
    fn accrue_c10d_work_wait(w: *mut c_void, timeout_ms: i64, err: *mut c_char, len: usize) -> i32;
    fn accrue_c10d_work_free(w: *mut c_void);
}

/// Calls a shim function with an error buffer: Err carries the first line
/// of its message.
fn call(f: impl FnOnce(*mut c_char, usize) -> i32) -> Result<(), String> {
    let mut buf = [0 as c_char; 1024];
    if f(buf.as_mut_ptr(), buf.len()) == 0 {
        return Ok(());
    }
    // SAFETY: the buffer starts zeroed and the shim NUL-terminates what it writes.
    let text = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
    Err(text.lines().next().unwrap_or_default().to_string())
}

fn handle(t: &Tensor) -> *mut c_void {
    t.as_ptr() as *mut c_void
}

/// What the C++ store's callback reaches: the rank's connection and the
/// group's key prefix.
struct StoreCtx {
    client: Arc<Mutex<StoreClient>>,
    prefix: String,
}

/// The C++ store's callback (see `StoreCallbacks` in csrc/c10d.cpp).
unsafe extern "C" fn store_call(
    ctx: *mut c_void,
    kind: i32,
    key: *const c_char,
    key_len: usize,
    value: *const u8,
    value_len: usize,
    arg: i64,
    timeout_ms: i64,
    out: *mut *mut u8,
    out_len: *mut usize,
    number: *mut i64,
    err: *mut c_char,
    len: usize,
) -> i32 {
    // SAFETY (whole function): the C++ side passes the ctx it was given
    // (a live StoreCtx owned by the group), key/value spans it owns for
    // the call, and out-pointers to its locals.
    let ctx = &*(ctx as *const StoreCtx);
    let key = std::slice::from_raw_parts(key as *const u8, key_len);
    let value = if value.is_null() {
        &[][..]
    } else {
        std::slice::from_raw_parts(value, value_len)
    };
    let result = (|| {
        let op = u8::try_from(kind)
            .ok()
            .and_then(Op::from_code)
            .ok_or_else(|| format!("unknown store call {kind}"))?;
        let mut full = ctx.prefix.as_bytes().to_vec();
        full.extend_from_slice(key);
        let r = Request {
            op,
            key: full,
            value: value.to_vec(),
            arg,
            timeout_ms,
        };
        ctx.client
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .call(&r)
    })();
    match result {
        Ok((bytes, n)) => {
            *number = n;
            if !bytes.is_empty() {
                let p = libc::malloc(bytes.len()) as *mut u8;
                if p.is_null() {
                    write_err("out of memory", err, len);
                    return -1;
                }
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len());
                *out = p;
                *out_len = bytes.len();
            }
            0
        }
        Err(m) => {
            write_err(&m, err, len);
            -1
        }
    }
}

/// # Safety
/// `err` points to `len` writable bytes (or is null).
unsafe fn write_err(m: &str, err: *mut c_char, len: usize) {
    if err.is_null() || len == 0 {
        return;
    }
    let n = m.len().min(len - 1);
    std::ptr::copy_nonoverlapping(m.as_ptr() as *const c_char, err, n);
    *err.add(n) = 0;
}

/// One c10d group (gloo or NCCL): this rank's place in it and its
/// communicator.
pub struct C10dGroup {
    ptr: *mut c_void,
    store: *mut c_void,
    _ctx: Box<StoreCtx>,
    rank: usize,
    size: usize,
    timeout: Duration,
    name: String,
    /// Where its tensors live: the CPU (gloo) or the CUDA device (NCCL).
    device: Device,
}

// SAFETY: the group and store pointers are libtorch objects safe to use
// from any thread (c10d's backends are thread-safe); accrue uses a group
// from one thread at a time (&mut self for every operation).
unsafe impl Send for C10dGroup {}

/// Whether this build makes NCCL groups (built with ACCRUE_CUDA=1).
pub fn has_nccl() -> bool {
    // SAFETY: no arguments, no state.
    unsafe { accrue_c10d_has_nccl() == 1 }
}

impl C10dGroup {
    /// Joins gloo group `name` as `rank` of `size` through the store
    /// `client` reaches, its pairs on `host`'s interface. Returns once every
    /// rank joined, or fails after `timeout` (also each operation's).
    pub fn gloo(
        client: Arc<Mutex<StoreClient>>,
        name: &str,
        host: &str,
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<Self, GroupError> {
        let host_c = CString::new(host).map_err(|_| {
            GroupError::Setup(format!("c10d group {name}: host {host:?} has a NUL"))
        })?;
        Self::join(
            client,
            name,
            rank,
            size,
            timeout,
            Device::Cpu,
            |store, r, s, ms, g, e, l| {
                // SAFETY: store and host are live for the call.
                unsafe { accrue_c10d_gloo_new(store, host_c.as_ptr(), r, s, ms, g, e, l) }
            },
        )
    }

    /// Joins NCCL group `name` as `rank` of `size` on CUDA device `device`
    /// (each member on its own GPU: NCCL refuses two ranks on one). The
    /// communicator is made before this returns, or it fails after
    /// `timeout`; a build without CUDA says so.
    pub fn nccl(
        client: Arc<Mutex<StoreClient>>,
        name: &str,
        rank: usize,
        size: usize,
        timeout: Duration,
        device: usize,
    ) -> Result<Self, GroupError> {
        let index = i32::try_from(device).map_err(|_| {
            GroupError::Setup(format!(
                "c10d group {name}: CUDA device {device} is too large"
            ))
        })?;
        let on = Device::Cuda(device);
        Self::join(
            client,
            name,
            rank,
            size,
            timeout,
            on,
            |store, r, s, ms, g, e, l| {
                // SAFETY: the store is live for the call.
                unsafe { accrue_c10d_nccl_new(store, r, s, ms, index, g, e, l) }
            },
        )
    }

    /// Makes the store over `client` (keys under `name/`) and the group
    /// `make` builds on it.
    #[allow(clippy::type_complexity)]
    fn join(
        client: Arc<Mutex<StoreClient>>,
        name: &str,
        rank: usize,
        size: usize,
        timeout: Duration,
        device: Device,
        make: impl FnOnce(*mut c_void, i32, i32, i64, *mut *mut c_void, *mut c_char, usize) -> i32,
    ) -> Result<Self, GroupError> {
        let setup = |m: String| GroupError::Setup(format!("c10d group {name}: {m}"));
        let (rank_i, size_i) = (
            i32::try_from(rank).map_err(|_| setup(format!("rank {rank} is too large")))?,
            i32::try_from(size).map_err(|_| setup(format!("size {size} is too large")))?,
        );
        let ctx = Box::new(StoreCtx {
            client,
            prefix: format!("{name}/"),
        });
        let call_ptr = store_call as StoreCall as *mut c_void;
        // SAFETY: ctx lives in the returned group, longer than the store
        // (freed in Drop after the group).
        let store =
            unsafe { accrue_c10d_store_new(&*ctx as *const StoreCtx as *mut c_void, call_ptr) };
        let mut ptr = std::ptr::null_mut();
        let ms = timeout.as_millis().min(i64::MAX as u128) as i64;
        let r = call(|e, l| make(store, rank_i, size_i, ms, &mut ptr, e, l));
        if let Err(m) = r {
            // SAFETY: the store was made above and nothing else holds it.
            unsafe { accrue_c10d_store_free(store) };
            return Err(setup(m));
        }
        Ok(Self {
            ptr,
            store,
            _ctx: ctx,
            rank,
            size,
            timeout,
            name: name.to_string(),
            device,
        })
    }

    fn start(
        &mut self,
        what: &'static str,
        keep: Vec<Tensor>,
        f: impl FnOnce(*mut c_void, *mut *mut c_void, *mut c_char, usize) -> i32,
    ) -> Result<Pending, GroupError> {
        let mut work = std::ptr::null_mut();
        call(|e, l| f(self.ptr, &mut work, e, l)).map_err(|m| self.failed(what, m))?;
        Ok(Pending::new(Box::new(Work {
            ptr: work,
            timeout: self.timeout,
            _keep: keep,
            what,
            group: self.name.clone(),
        })))
    }

    fn failed(&self, what: &str, m: String) -> GroupError {
        GroupError::Failed(format!("c10d group {} {what}: {m}", self.name))
    }
}

fn check_root(peer: usize, size: usize, what: &str) -> Result<i32, GroupError> {
    if peer >= size {
        return Err(GroupError::Usage(format!(
            "{what} rank {peer} is outside a group of {size}"
        )));
    }
    // Below size, which fit an i32 when the group was made.
    Ok(peer as i32)
}

impl Group for C10dGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn transport(&self) -> &'static str {
        match self.device {
            Device::Cpu => "c10d",
            _ => "c10d-nccl",
        }
    }
    fn device(&self) -> Device {
        self.device
    }
    fn all_reduce(&mut self, t: &Tensor, op: ReduceOp) -> Result<Pending, GroupError> {
        let code = op as i32;
        let h = handle(t);
        // SAFETY: the tensor handle is live; the work keeps its own reference.
        self.start("all-reduce", vec![t.shallow_clone()], |g, w, e, l| unsafe {
            accrue_c10d_all_reduce(g, h, code, w, e, l)
        })
    }
    fn reduce_scatter(
        &mut self,
        out: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<Pending, GroupError> {
        crate::comm::group::check_scatter(out, input, self.size)?;
        let (o, i, code) = (handle(out), handle(input), op as i32);
        let keep = vec![out.shallow_clone(), input.shallow_clone()];
        // SAFETY: as in all_reduce.
        self.start("reduce-scatter", keep, |g, w, e, l| unsafe {
            accrue_c10d_reduce_scatter(g, o, i, code, w, e, l)
        })
    }
    fn all_gather(&mut self, out: &Tensor, input: &Tensor) -> Result<Pending, GroupError> {
        crate::comm::group::check_scatter(input, out, self.size)?;
        let (o, i) = (handle(out), handle(input));
        let keep = vec![out.shallow_clone(), input.shallow_clone()];
        // SAFETY: as in all_reduce.
        self.start("all-gather", keep, |g, w, e, l| unsafe {
            accrue_c10d_all_gather(g, o, i, w, e, l)
        })
    }
    fn broadcast(&mut self, t: &Tensor, root: usize) -> Result<Pending, GroupError> {
        let root = check_root(root, self.size, "broadcast root")?;
        let h = handle(t);
        // SAFETY: as in all_reduce.
        self.start("broadcast", vec![t.shallow_clone()], |g, w, e, l| unsafe {
            accrue_c10d_broadcast(g, h, root, w, e, l)
        })
    }
    fn send(&mut self, t: &Tensor, dst: usize) -> Result<Pending, GroupError> {
        let dst = check_root(dst, self.size, "send destination")?;
        let h = handle(t);
        // SAFETY: as in all_reduce.
        self.start("send", vec![t.shallow_clone()], |g, w, e, l| unsafe {
            accrue_c10d_send(g, h, dst, 0, w, e, l)
        })
    }
    fn recv(&mut self, t: &Tensor, src: usize) -> Result<Pending, GroupError> {
        let src = check_root(src, self.size, "receive source")?;
        let h = handle(t);
        // SAFETY: as in all_reduce.
        self.start("receive", vec![t.shallow_clone()], |g, w, e, l| unsafe {
            accrue_c10d_recv(g, h, src, 0, w, e, l)
        })
    }
    fn tensor_group(&self) -> Option<crate::comm::tensor_ops::TensorGroup> {
        // SAFETY: the group lives as long as this value; the engine drops
        // the model's graphs before the generation's groups.
        Some(unsafe {
            crate::comm::tensor_ops::TensorGroup::new(self.ptr, self.rank, self.size, self.device)
        })
    }
    fn abort(&mut self) {
        // SAFETY: the group is live.
        if let Err(m) = call(|e, l| unsafe { accrue_c10d_group_abort(self.ptr, e, l) }) {
            tracing::warn!(group = %self.name, error = %m, "aborting a c10d group failed");
        }
    }
}

impl Drop for C10dGroup {
    fn drop(&mut self) {
        // SAFETY: both were made by the shim and are freed once, the group
        // (which holds a reference to the store) first.
        unsafe {
            accrue_c10d_group_free(self.ptr);
            accrue_c10d_store_free(self.store);
        }
    }
}

/// One started c10d operation.
struct Work {
    ptr: *mut c_void,
    timeout: Duration,
    _keep: Vec<Tensor>,
    what: &'static str,
    group: String,
}

// SAFETY: c10d's Work objects may be waited on from any thread.
unsafe impl Send for Work {}

impl Wait for Work {
    fn wait(&mut self) -> Result<(), GroupError> {
        let ms = self.timeout.as_millis().min(i64::MAX as u128) as i64;
        // SAFETY: the work is live until Drop.
        call(|e, l| unsafe { accrue_c10d_work_wait(self.ptr, ms, e, l) }).map_err(|m| {
            GroupError::Failed(format!("c10d group {} {}: {m}", self.group, self.what))
        })
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        // SAFETY: made by the shim, freed once.
        unsafe { accrue_c10d_work_free(self.ptr) }
    }
}
