// What every accrue C++ shim shares: a C++ exception becomes -1 and its
// message (without libtorch's backtrace) in the caller's buffer.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <exception>

namespace accrue_shim {

inline void write_error(const char* what, char* err, size_t len) {
  if (err == nullptr || len == 0) {
    return;
  }
  const size_t n = std::min(std::strlen(what), len - 1);
  std::memcpy(err, what, n);
  err[n] = '\0';
}

// Runs `f`, turning a C++ exception into -1 and its message.
template <typename F>
int guarded(F f, char* err, size_t len) {
  try {
    f();
    return 0;
  } catch (const c10::Error& e) {
    write_error(e.what_without_backtrace(), err, len);
  } catch (const std::exception& e) {
    write_error(e.what(), err, len);
  }
  return -1;
}

}  // namespace accrue_shim
