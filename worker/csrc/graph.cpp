// CUDA graphs for the micro-step (issue 19), built only with ACCRUE_CUDA=1.
// tch does not expose at::cuda::CUDAGraph; these few functions do what
// torch.cuda.graph and torch.cuda.stream do, on the calling thread (the
// current stream is thread-local, and the engine's thread is the one that
// runs the micro-step). Every decision (when to warm up, capture, replay or
// fall back) stays on the Rust side: worker/src/graphs.rs and
// worker/src/engine/graph.rs.
//
// Every function catches every C++ exception and returns -1 (or null) with
// the message in `err` (at most `len` bytes, NUL-terminated).
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>
#include <exception>

namespace {
void put(char* err, size_t len, const char* msg) {
  if (err != nullptr && len > 0) {
    std::strncpy(err, msg, len - 1);
    err[len - 1] = '\0';
  }
}

// A side stream made current, and the stream it replaced.
struct SideStream {
  c10::cuda::CUDAStream previous;
  c10::cuda::CUDAStream side;
};
}  // namespace

extern "C" {

// Makes a stream from libtorch's pool current for `device` on this thread,
// after it waits for the work queued so far on the current stream
// (`s.wait_stream(torch.cuda.current_stream())` then `torch.cuda.stream(s)`).
// Returns the handle for accrue_side_stream_exit, or null.
void* accrue_side_stream_enter(int device, char* err, size_t len) {
  try {
    const auto d = static_cast<c10::DeviceIndex>(device);
    auto previous = c10::cuda::getCurrentCUDAStream(d);
    auto side = c10::cuda::getStreamFromPool(false, d);
    at::cuda::CUDAEvent ready;
    ready.record(previous);
    ready.block(side);
    c10::cuda::setCurrentCUDAStream(side);
    return new SideStream{previous, side};
  } catch (const std::exception& e) {
    put(err, len, e.what());
    return nullptr;
  }
}

// Makes the stream accrue_side_stream_enter replaced current again, after
// it waits for the work queued on the side stream; frees the handle.
int accrue_side_stream_exit(void* handle, char* err, size_t len) {
  auto* s = static_cast<SideStream*>(handle);
  try {
    at::cuda::CUDAEvent done;
    done.record(s->side);
    done.block(s->previous);
    c10::cuda::setCurrentCUDAStream(s->previous);
    delete s;
    return 0;
  } catch (const std::exception& e) {
    c10::cuda::setCurrentCUDAStream(s->previous);
    delete s;
    put(err, len, e.what());
    return -1;
  }
}

// A new, empty graph (null on failure).
void* accrue_graph_new(char* err, size_t len) {
  try {
    return new at::cuda::CUDAGraph();
  } catch (const std::exception& e) {
    put(err, len, e.what());
    return nullptr;
  }
}

void accrue_graph_free(void* graph) { delete static_cast<at::cuda::CUDAGraph*>(graph); }

// Waits for the current stream (which must not be the default one: enter a
// side stream first; it waits for the stream it replaced), then starts
// capturing it into `graph` on a private memory pool, as torch.cuda.graph's
// `__enter__` does. The mode is thread-local: a capture on one rank's
// engine thread does not forbid other threads' CUDA calls (ranks that share
// a process in tests). The wait is the stream's, not the device's
// (torch.cuda.graph synchronizes the device): a cudaDeviceSynchronize while
// another thread captures invalidates that thread's capture, which is what
// two ranks in one process did on the H100 (2026-11-26: "operation failed
// due to a previous error during capture" in the other rank's backward).
int accrue_graph_capture_begin(void* graph, char* err, size_t len) {
  try {
    c10::cuda::getCurrentCUDAStream().synchronize();
    static_cast<at::cuda::CUDAGraph*>(graph)->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    return 0;
  } catch (const std::exception& e) {
    put(err, len, e.what());
    return -1;
  }
}

// Ends the capture and instantiates the graph. After a failure (an
// operation the capture refused, say) the graph is reset and holds nothing.
int accrue_graph_capture_end(void* graph, char* err, size_t len) {
  auto* g = static_cast<at::cuda::CUDAGraph*>(graph);
  try {
    g->capture_end();
    return 0;
  } catch (const std::exception& e) {
    put(err, len, e.what());
    try {
      g->reset();
    } catch (const std::exception&) {
      // The first error is the one worth reporting.
    }
    return -1;
  }
}

// Launches the captured work on the current stream.
int accrue_graph_replay(void* graph, char* err, size_t len) {
  try {
    static_cast<at::cuda::CUDAGraph*>(graph)->replay();
    return 0;
  } catch (const std::exception& e) {
    put(err, len, e.what());
    return -1;
  }
}
}
