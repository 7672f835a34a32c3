//! The Rust side of the CUDA-graph shim (csrc/graph.cpp), compiled only
//! with `ACCRUE_CUDA=1` (cfg `accrue_cuda`). Thin wrappers that own the C++
//! objects; when to use them is decided in crate::cuda::graphs.

use crate::error::{Error, Result};
use std::ffi::{c_char, c_void, CStr};
use std::sync::{Mutex, MutexGuard};

/// One graph operation at a time in this process. A capture registers the
/// graph with libtorch's default CUDA generator (its `registered_graphs_`
/// set, unguarded), a replay advances that generator's offsets and a drop
/// unregisters the graph; two threads doing these at once (ranks sharing a
/// process, as the tests run them) corrupt the set: on the H100
/// (2026-11-26) a graph's destructor then aborted the process with "The
/// graph should be registered to the state". A worker process has one
/// engine thread, so this lock is never contended there.
static GRAPH_OPS: Mutex<()> = Mutex::new(());

fn graph_ops() -> MutexGuard<'static, ()> {
    // The guarded state is libtorch's, not the unit: a panic while holding
    // it leaves nothing of ours half-changed.
    GRAPH_OPS.lock().unwrap_or_else(|p| p.into_inner())
}

extern "C" {
    fn accrue_side_stream_enter(device: i32, err: *mut c_char, len: usize) -> *mut c_void;
    fn accrue_side_stream_exit(handle: *mut c_void, err: *mut c_char, len: usize) -> i32;
    fn accrue_graph_new(err: *mut c_char, len: usize) -> *mut c_void;
    fn accrue_graph_free(graph: *mut c_void);
    fn accrue_graph_capture_begin(graph: *mut c_void, err: *mut c_char, len: usize) -> i32;
    fn accrue_graph_capture_end(graph: *mut c_void, err: *mut c_char, len: usize) -> i32;
    fn accrue_graph_replay(graph: *mut c_void, err: *mut c_char, len: usize) -> i32;
}

/// Calls a shim function with an error buffer; Err carries its message.
fn call(what: &'static str, f: impl FnOnce(*mut c_char, usize) -> bool) -> Result<()> {
    let mut buf = [0 as c_char; 1024];
    if f(buf.as_mut_ptr(), buf.len()) {
        return Ok(());
    }
    // SAFETY: the shim NUL-terminates what it writes into the buffer, and
    // the buffer starts zeroed (an empty message if it wrote nothing).
    let reason = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    Err(Error::Graph { what, reason })
}

/// A stream from libtorch's pool, current on this thread for `device`
/// while the guard lives; it waits for the work queued before it, and the
/// previous stream waits for its work when it ends.
#[must_use = "the side stream ends when the guard is dropped"]
pub struct SideStream(*mut c_void);

impl SideStream {
    pub fn enter(device: usize) -> Result<Self> {
        let mut handle = std::ptr::null_mut();
        call("entering a side stream", |e, n| {
            // SAFETY: a plain C function of the shim; it catches every C++
            // exception and writes at most n bytes into e.
            handle = unsafe { accrue_side_stream_enter(device as i32, e, n) };
            !handle.is_null()
        })?;
        Ok(Self(handle))
    }

    /// Ends the side stream, reporting a failure (drop logs it instead).
    pub fn exit(mut self) -> Result<()> {
        let h = std::mem::replace(&mut self.0, std::ptr::null_mut());
        // SAFETY: h came from accrue_side_stream_enter and is freed once:
        // drop sees the null left here.
        call("leaving a side stream", |e, n| unsafe {
            accrue_side_stream_exit(h, e, n) == 0
        })
    }
}

impl Drop for SideStream {
    fn drop(&mut self) {
        if self.0.is_null() {
            return;
        }
        let h = self.0;
        // SAFETY: as in exit.
        if let Err(e) = call("leaving a side stream", |e, n| unsafe {
            accrue_side_stream_exit(h, e, n) == 0
        }) {
            tracing::error!(error = %e, "side stream");
        }
    }
}

/// A captured CUDA graph (at::cuda::CUDAGraph on its private memory pool).
pub struct Graph(*mut c_void);

// SAFETY: a CUDAGraph is used from one thread at a time (the engine's
// thread owns it); CUDA graphs are not tied to the thread that captured them.
unsafe impl Send for Graph {}

impl Graph {
    /// Captures what `body` queues on `device` (on a side stream, as
    /// torch.cuda.graph does). Nothing runs during a capture: replay it
    /// for the work to happen. A body or capture failure leaves no graph.
    pub fn capture(device: usize, body: impl FnOnce() -> Result<()>) -> Result<Self> {
        let mut raw = std::ptr::null_mut();
        call("creating a graph", |e, n| {
            // SAFETY: as in SideStream::enter.
            raw = unsafe { accrue_graph_new(e, n) };
            !raw.is_null()
        })?;
        let graph = Self(raw);
        // Held through the capture: the begin registers the graph, the body
        // queues nothing that takes the lock (it records; nothing replays).
        let ops = graph_ops();
        let side = SideStream::enter(device)?;
        // SAFETY (these three): raw is a live CUDAGraph owned by `graph`.
        call("beginning the capture", |e, n| unsafe {
            accrue_graph_capture_begin(raw, e, n) == 0
        })?;
        let ran = body();
        let ended = call("ending the capture", |e, n| unsafe {
            accrue_graph_capture_end(raw, e, n) == 0
        });
        side.exit()?;
        drop(ops);
        ran?;
        ended?;
        Ok(graph)
    }

    /// Launches the graph on the current stream.
    pub fn replay(&self) -> Result<()> {
        let _ops = graph_ops();
        // SAFETY: self.0 is a live, captured CUDAGraph.
        call("replaying", |e, n| unsafe {
            accrue_graph_replay(self.0, e, n) == 0
        })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let _ops = graph_ops();
        // SAFETY: self.0 came from accrue_graph_new and is freed once, here.
        unsafe { accrue_graph_free(self.0) }
    }
}
