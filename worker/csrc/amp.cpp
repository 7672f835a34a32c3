// Autocast for the engine (issue 18). tch turns CUDA autocast on and off
// only; torch.autocast(device, dtype) also sets the device (CPU or CUDA)
// and the lower-precision type. These two functions do what entering and
// leaving that context manager does, on the calling thread (autocast
// state is thread-local, and the engine's thread is the one that runs the
// forward). Every decision stays on the Rust side (worker/src/amp.rs).
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>

#include <exception>

namespace {
at::DeviceType device_of(int device) { return device == 1 ? at::kCUDA : at::kCPU; }
}  // namespace

extern "C" {

// device: 0 the CPU, 1 CUDA; dtype: a c10::ScalarType (tch's Kind::c_int);
// cache: 0 turns the cast cache off, as `torch.autocast(cache_enabled=False)`
// (what a CUDA-graph capture needs; issue 19). Returns 0, or -1 when
// libtorch threw.
int accrue_autocast_enter(int device, int dtype, int cache) {
  try {
    const auto d = device_of(device);
    at::autocast::set_autocast_cache_enabled(cache != 0);
    at::autocast::set_autocast_enabled(d, true);
    at::autocast::set_autocast_dtype(d, static_cast<at::ScalarType>(dtype));
    at::autocast::increment_nesting();
    return 0;
  } catch (const std::exception&) {
    return -1;
  }
}

// Leaves what accrue_autocast_enter entered: the cast cache is cleared
// when the outermost autocast region ends, as torch.autocast does, and
// caching is on again (its default).
int accrue_autocast_exit(int device) {
  try {
    if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
    at::autocast::set_autocast_cache_enabled(true);
    at::autocast::set_autocast_enabled(device_of(device), false);
    return 0;
  } catch (const std::exception&) {
    return -1;
  }
}

// The lower-precision type autocast casts to on the device (a
// c10::ScalarType, tch's Kind::c_int) when it is on; -1 when it is off or
// libtorch threw.
int accrue_autocast_dtype(int device) {
  try {
    const auto d = device_of(device);
    if (!at::autocast::is_autocast_enabled(d)) {
      return -1;
    }
    return static_cast<int>(at::autocast::get_autocast_dtype(d));
  } catch (const std::exception&) {
    return -1;
  }
}

// Whether autocast is on for the device (for tests).
int accrue_autocast_is_enabled(int device) {
  try {
    return at::autocast::is_autocast_enabled(device_of(device)) ? 1 : 0;
  } catch (const std::exception&) {
    return -1;
  }
}
}

// cuDNN's deterministic algorithms on or off, process-wide, as
// `torch.backends.cudnn.deterministic = ...` (issue 31; kept in this file,
// which every build compiles, since at::Context needs no CUDA header).
// Returns 0, or -1 when libtorch threw.
extern "C" int accrue_set_cudnn_deterministic(int on) {
  try {
    at::globalContext().setDeterministicCuDNN(on != 0);
    return 0;
  } catch (const std::exception&) {
    return -1;
  }
}

// The setting: 1 on, 0 off, -1 when libtorch threw.
extern "C" int accrue_cudnn_deterministic() {
  try {
    return at::globalContext().deterministicCuDNN() ? 1 : 0;
  } catch (const std::exception&) {
    return -1;
  }
}
