// PyTorch's fused Adam and AdamW (`torch.optim.AdamW(fused=True)`):
// libtorch's `_fused_adam_` / `_fused_adamw_`, which tch does not wrap
// (tensor-list operators). One multi-tensor kernel per step on CUDA, a
// vectorized loop on the CPU; the arithmetic is PyTorch's own, so the
// numbers are those of `fused=True`. Every decision (which step, which
// learning rate, skip or not) stays on the Rust side
// (worker/src/optim/aten_fused.rs); this file only calls the operator.
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <optional>
#include <vector>

namespace {
// tch's tensor handles are `at::Tensor*` (torch-sys' C API).
std::vector<at::Tensor> list(void* const* ptrs, int n) {
  std::vector<at::Tensor> out;
  out.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    out.push_back(*static_cast<at::Tensor*>(ptrs[i]));
  }
  return out;
}

std::optional<at::Tensor> optional(void* ptr) {
  if (ptr == nullptr) {
    return std::nullopt;
  }
  return *static_cast<at::Tensor*>(ptr);
}

void write_error(const char* what, char* err, size_t err_len) {
  if (err == nullptr || err_len == 0) {
    return;
  }
  const size_t n = std::min(std::strlen(what), err_len - 1);
  std::memcpy(err, what, n);
  err[n] = '\0';
}
}  // namespace

// One step of `n` parameters. `step` is the float32 step count every
// parameter reads (PyTorch's per-parameter `state["step"]`, the same
// number for all of them here); `lr_tensor`, when not null, is the
// learning rate as a float32 device tensor (what a CUDA graph replays),
// else `lr` is; `found_inf`, when not null, is a float32 tensor whose 1
// makes the kernel leave everything as it was (GradScaler's skip).
// decoupled: 1 AdamW, 0 Adam. Returns 0, or -1 with libtorch's message
// (without its backtrace) in `err`.
extern "C" int accrue_fused_adam(void* const* params, void* const* grads,
                                 void* const* exp_avgs, void* const* exp_avg_sqs,
                                 int n, void* step, void* lr_tensor, double lr,
                                 double beta1, double beta2, double weight_decay,
                                 double eps, int decoupled, void* found_inf,
                                 char* err, size_t err_len) {
  try {
    const auto p = list(params, n);
    const auto g = list(grads, n);
    const auto m = list(exp_avgs, n);
    const auto v = list(exp_avg_sqs, n);
    const std::vector<at::Tensor> steps(static_cast<size_t>(n),
                                        *static_cast<at::Tensor*>(step));
    const std::vector<at::Tensor> none;
    const auto inf = optional(found_inf);
    const std::optional<at::Tensor> scale = std::nullopt;
    if (lr_tensor != nullptr) {
      const auto& lr_t = *static_cast<at::Tensor*>(lr_tensor);
      if (decoupled != 0) {
        at::_fused_adamw_(p, g, m, v, none, steps, lr_t, beta1, beta2, weight_decay,
                          eps, false, false, scale, inf);
      } else {
        at::_fused_adam_(p, g, m, v, none, steps, lr_t, beta1, beta2, weight_decay,
                         eps, false, false, scale, inf);
      }
    } else if (decoupled != 0) {
      at::_fused_adamw_(p, g, m, v, none, steps, lr, beta1, beta2, weight_decay, eps,
                        false, false, scale, inf);
    } else {
      at::_fused_adam_(p, g, m, v, none, steps, lr, beta1, beta2, weight_decay, eps,
                       false, false, scale, inf);
    }
    return 0;
  } catch (const c10::Error& e) {
    write_error(e.what_without_backtrace(), err, err_len);
    return -1;
  } catch (const std::exception& e) {
    write_error(e.what(), err, err_len);
    return -1;
  }
}
