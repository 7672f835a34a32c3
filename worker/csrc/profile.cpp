// libtorch's profiler (Kineto, what torch.profiler drives) for
// `accrue-worker train --profile` (issue 31): the CPU ops the engine's
// thread runs and, on CUDA, every kernel (CUPTI), saved as a Chrome trace
// like torch.profiler's export_chrome_trace. Compiled in every build (no
// CUDA header); the decisions (which steps) are on the Rust side
// (worker/src/profiler.rs).
//
// Every function catches every C++ exception and returns -1 with the
// message in `err` (at most `len` bytes, NUL-terminated).
#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstring>
#include <exception>
#include <set>
#include <string>

namespace {
void put(char* err, size_t len, const char* msg) {
  if (err != nullptr && len > 0) {
    std::strncpy(err, msg, len - 1);
    err[len - 1] = '\0';
  }
}
}  // namespace

extern "C" {

// Starts profiling CPU ops, and CUDA kernels when `cuda` is not 0.
int accrue_profiler_start(int cuda, char* err, size_t len) {
  using torch::profiler::impl::ActivityType;
  try {
    std::set<ActivityType> activities{ActivityType::CPU};
    if (cuda != 0) {
      activities.insert(ActivityType::CUDA);
    }
    const torch::profiler::impl::ProfilerConfig config(
        torch::profiler::impl::ProfilerState::KINETO);
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
    return 0;
  } catch (const std::exception& e) {
    put(err, len, e.what());
    return -1;
  }
}

// Stops profiling; writes the trace to `path` unless it is null. Returns
// the number of events recorded, or -1.
long long accrue_profiler_stop(const char* path, char* err, size_t len) {
  try {
    auto result = torch::autograd::profiler::disableProfiler();
    if (!result) {
      put(err, len, "the profiler returned no result");
      return -1;
    }
    if (path != nullptr) {
      result->save(std::string(path));
    }
    return static_cast<long long>(result->events().size());
  } catch (const std::exception& e) {
    put(err, len, e.what());
    return -1;
  }
}

}  // extern "C"
