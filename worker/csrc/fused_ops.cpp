// The Llama family's fused operations (docs/SEMANTICS.md, "On CUDA") as
// autograd functions: rms_norm_cast, rope_qkv, swiglu and
// cross_entropy_sum; and PyTorch's fused Adam/AdamW for the optimizer
// (accrue_fused_adam, at the end).
// Each has two implementations of the same function and gradient:
//
//   - ATen's ops, chained as transformers' computation chains them under
//     autocast (the reference; on the CPU, and on CUDA when asked);
//   - accrue's CUDA kernels (csrc/kernels.cu), one launch forward and one
//     backward, compiled only with ACCRUE_CUDA=1 (ACCRUE_CUDA_KERNELS).
//
// worker/src/fused_ops.rs calls these through the C functions at the end;
// every decision (when to use them) is on the Rust side.
#include <ATen/ATen.h>
#include "shim.h"
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#ifdef ACCRUE_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

#ifdef ACCRUE_CUDA_KERNELS
extern "C" {
int accrue_k_rms_norm_cast_fwd(int dtype, const float* x, const void* a, float* xa,
                               const float* w, void* y, float* rstd, int64_t rows, int64_t h,
                               float eps, void* stream);
int accrue_k_rms_norm_cast_bwd(int dtype, const void* gy, const float* x, const float* w,
                               const float* rstd, const float* gx_extra, float* gx, void* ga,
                               float* gw_part, int64_t rows, int64_t h, int blocks,
                               void* stream);
int accrue_k_rope_qkv_fwd(int dtype, const void* y, const float* cos, const float* sin, void* q,
                          void* k, void* v, int64_t n, int64_t t, int64_t hq, int64_t hkv,
                          int64_t d, void* stream);
int accrue_k_rope_qkv_bwd(int dtype, const void* gq, const void* gk, const void* gv,
                          const float* cos, const float* sin, void* gy, int64_t n, int64_t t,
                          int64_t hq, int64_t hkv, int64_t d, void* stream);
int accrue_k_swiglu_fwd(int dtype, const void* y, void* out, int64_t m, int64_t inner,
                        void* stream);
int accrue_k_swiglu_bwd(int dtype, const void* y, const void* go, void* gy, int64_t m,
                        int64_t inner, void* stream);
int accrue_k_cross_entropy_fwd(int dtype, const void* x, const int64_t* target, float* loss,
                               float* row_max, float* row_logsum, int64_t m, int64_t v,
                               void* stream);
int accrue_k_cross_entropy_bwd(int dtype, const void* x, const int64_t* target,
                               const float* row_max, const float* row_logsum, const float* g,
                               void* gx, int64_t m, int64_t v, void* stream);
}
#endif

namespace {

// The most columns the norm's backward kernel keeps in shared memory
// (48 KiB of floats, less the block's reduction scratch).
constexpr int64_t kMaxNormWidth = 12000;

// Whether this call runs accrue's kernels: CUDA tensors, a build with
// them, and the caller asking.
bool kernels_for(const at::Tensor& t, bool want) {
#ifdef ACCRUE_CUDA_KERNELS
  return want && t.is_cuda();
#else
  (void)t;
  (void)want;
  return false;
#endif
}

#ifdef ACCRUE_CUDA_KERNELS
// Where a kernel launches: the tensor's device made current while this
// lives (as ATen's ops guard it), and that device's current stream (a
// capture's, inside a CUDA graph capture).
struct Launch {
  c10::cuda::CUDAGuard guard;
  void* stream;
  explicit Launch(const at::Tensor& t)
      : guard(t.device()), stream(c10::cuda::getCurrentCUDAStream(t.device().index()).stream()) {}
};

int dtype_code(at::ScalarType s) {
  TORCH_CHECK(s == at::kBFloat16 || s == at::kHalf,
              "accrue's fused kernels take bf16 or fp16 activations, not ", s);
  return s == at::kBFloat16 ? 0 : 1;
}

void check_launch(int rc, const char* what) {
  TORCH_CHECK(rc == 0, what, ": CUDA error ", rc, " (",
              cudaGetErrorString(static_cast<cudaError_t>(rc)), ")");
}
#endif

// The norm's forward on rows x2 [rows, h] (float32), after the residual
// add x2 + a2 when a2 (T-typed [rows, h]) is defined: (y in out_type, the
// normalized rows (x2, or the sum), their rstd).
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_forward(const at::Tensor& x2,
                                                            const at::Tensor& a2,
                                                            const at::Tensor& w, double eps,
                                                            at::ScalarType out_type, bool fast) {
  at::Tensor y, src = x2, rstd;
  if (fast) {
#ifdef ACCRUE_CUDA_KERNELS
    y = at::empty(x2.sizes(), x2.options().dtype(out_type));
    rstd = at::empty({x2.size(0)}, x2.options());
    if (a2.defined()) {
      TORCH_CHECK(a2.scalar_type() == out_type, "add_rms_norm_cast: the residual is ",
                  a2.scalar_type(), ", the output ", out_type);
      src = at::empty_like(x2);
    }
    const Launch on(x2);
    check_launch(accrue_k_rms_norm_cast_fwd(
                     dtype_code(out_type), x2.data_ptr<float>(),
                     a2.defined() ? a2.data_ptr() : nullptr,
                     a2.defined() ? src.data_ptr<float>() : nullptr, w.data_ptr<float>(),
                     y.data_ptr(), rstd.data_ptr<float>(), x2.size(0), x2.size(1),
                     static_cast<float>(eps), on.stream),
                 "rms_norm_cast forward");
#endif
  } else {
    // The residual stream's add (fp32 + T: T widened, one rounding);
    // then transformers: variance = x.pow(2).mean(-1); x * rsqrt(variance
    // + eps); weight * that; then autocast's cast.
    if (a2.defined()) {
      src = x2 + a2;
    }
    rstd = at::rsqrt(src.pow(2).mean(-1) + eps);
    y = (w * (src * rstd.unsqueeze(-1))).to(out_type);
  }
  return {y, src, rstd};
}

// The norm's backward: (the input's gradient plus `extra` when defined,
// that cast to `residual_type` when given (the residual's gradient),
// the weight's gradient).
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward(
    const at::Tensor& gy, const at::Tensor& src, const at::Tensor& w, const at::Tensor& rstd,
    const at::Tensor& extra, std::optional<at::ScalarType> residual_type, bool fast) {
  const int64_t rows = src.size(0), h = src.size(1);
  at::Tensor gx, ga, gw;
  if (fast) {
#ifdef ACCRUE_CUDA_KERNELS
    const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, 512)));
    gx = at::empty_like(src);
    if (residual_type) {
      ga = at::empty(src.sizes(), src.options().dtype(*residual_type));
    }
    auto part = at::empty({blocks, h}, src.options());
    const auto ex = extra.defined() ? extra.to(at::kFloat).contiguous() : extra;
    const Launch on(src);
    check_launch(accrue_k_rms_norm_cast_bwd(
                     dtype_code(gy.scalar_type()), gy.data_ptr(), src.data_ptr<float>(),
                     w.data_ptr<float>(), rstd.data_ptr<float>(),
                     ex.defined() ? ex.data_ptr<float>() : nullptr, gx.data_ptr<float>(),
                     ga.defined() ? ga.data_ptr() : nullptr, part.data_ptr<float>(), rows, h,
                     blocks, on.stream),
                 "rms_norm_cast backward");
    gw = part.sum(0);
#endif
  } else {
    const auto g = gy.to(at::kFloat);
    const auto r = rstd.unsqueeze(-1);
    const auto gn = g * w;
    const auto dot = (gn * src).sum(-1, true);
    gx = r * gn - (r * r * r / static_cast<double>(h)) * src * dot;
    if (extra.defined()) {
      gx = extra + gx;
    }
    if (residual_type) {
      ga = gx.to(*residual_type);
    }
    gw = (g * (src * r)).sum(0);
  }
  return {gx, ga, gw};
}

// Checks the norm's input and weight; the input as rows [rows, h].
at::Tensor norm_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "rms_norm_cast takes float32 input and weight");
  const int64_t h = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == h, "rms_norm_cast: weight of ", w.sizes(),
              " for rows of ", h);
  return x.contiguous().view({-1, h});
}

// y = cast(w * (x * rsqrt(mean(x^2) + eps))) over the last dimension; x
// and w float32.
struct RmsNormCast : public torch::autograd::Function<RmsNormCast> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double eps, int64_t dtype, bool kernels) {
    const auto x2 = norm_rows(x, w);
    const auto wc = w.contiguous();
    const bool fast = kernels_for(x, kernels) && x2.size(1) <= kMaxNormWidth;
    auto [y, src, rstd] =
        norm_forward(x2, at::Tensor(), wc, eps, static_cast<at::ScalarType>(dtype), fast);
    ctx->save_for_backward({src, wc, rstd});
    ctx->saved_data["fast"] = fast;
    return y.view(x.sizes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& src = saved[0];
    const auto gy = grads[0].contiguous().view(src.sizes());
    auto [gx, ga, gw] = norm_backward(gy, src, saved[1], saved[2], at::Tensor(), std::nullopt,
                                      ctx->saved_data["fast"].toBool());
    return {gx.view(grads[0].sizes()), gw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The residual stream's add and the next norm: s = x + a (x float32, a
// the T-typed branch), y = cast_T(w * (s * rsqrt(mean(s^2) + eps))); both
// s and y are outputs.
struct AddRmsNormCast : public torch::autograd::Function<AddRmsNormCast> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& a,
                               const at::Tensor& w, double eps, bool kernels) {
    const auto x2 = norm_rows(x, w);
    TORCH_CHECK(a.sizes() == x.sizes(), "add_rms_norm_cast: a residual of ", a.sizes(),
                " for ", x.sizes());
    const auto a2 = a.contiguous().view(x2.sizes());
    const auto wc = w.contiguous();
    const auto type = a.scalar_type();
    const bool fast = kernels_for(x, kernels) && x2.size(1) <= kMaxNormWidth;
    auto [y, src, rstd] = norm_forward(x2, a2, wc, eps, type, fast);
    ctx->save_for_backward({src, wc, rstd});
    ctx->saved_data["fast"] = fast;
    ctx->saved_data["type"] = static_cast<int64_t>(type);
    return {src.view(x.sizes()), y.view(x.sizes())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& src = saved[0];
    const auto type = static_cast<at::ScalarType>(ctx->saved_data["type"].toInt());
    const auto shape = grads[1].defined() ? grads[1].sizes() : grads[0].sizes();
    const auto gy = grads[1].defined()
                        ? grads[1].contiguous().view(src.sizes())
                        : at::zeros(src.sizes(), src.options().dtype(type));
    const auto extra = grads[0].defined() ? grads[0].contiguous().view(src.sizes()) : at::Tensor();
    auto [gx, ga, gw] = norm_backward(gy, src, saved[1], saved[2], extra, type,
                                      ctx->saved_data["fast"].toBool());
    return {gx.view(shape), ga.view(shape), gw, at::Tensor(), at::Tensor()};
  }
};

// transformers' apply_rotary_pos_emb on halves x1 = x[..., :D/2] and
// x2 = x[..., D/2:] (float32), with cos and sin broadcast to them.
std::pair<at::Tensor, at::Tensor> rotate(const at::Tensor& x1, const at::Tensor& x2,
                                         const at::Tensor& c, const at::Tensor& s) {
  return {x1 * c + (-x2) * s, x2 * c + x1 * s};
}

// y [N, T, (hq + 2 hkv) D] -> q [N, hq, T, D], k and v [N, hkv, T, D],
// contiguous, in y's type; q and k rotated (cos and sin [T, D/2] fp32).
struct RopeQkv : public torch::autograd::Function<RopeQkv> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& y, const at::Tensor& cos,
                               const at::Tensor& sin, int64_t hq, int64_t hkv, bool kernels) {
    TORCH_CHECK(y.dim() == 3, "rope_qkv takes [N, T, features], not ", y.sizes());
    const int64_t n = y.size(0), t = y.size(1), heads = hq + 2 * hkv;
    TORCH_CHECK(heads > 0 && y.size(2) % heads == 0, "rope_qkv: ", y.size(2),
                " features for ", heads, " heads");
    const int64_t d = y.size(2) / heads, half = d / 2;
    TORCH_CHECK(d % 2 == 0, "rope_qkv: odd head width ", d);
    TORCH_CHECK(cos.sizes() == at::IntArrayRef({t, half}) && sin.sizes() == cos.sizes() &&
                    cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
                "rope_qkv: cos and sin must be float32 [", t, ", ", half, "]");
    const auto yc = y.contiguous();
    const auto cc = cos.contiguous(), sc = sin.contiguous();
    at::Tensor q, k, v;
    const bool fast = kernels_for(y, kernels);
    if (fast) {
#ifdef ACCRUE_CUDA_KERNELS
      q = at::empty({n, hq, t, d}, yc.options());
      k = at::empty({n, hkv, t, d}, yc.options());
      v = at::empty({n, hkv, t, d}, yc.options());
      const Launch on(yc);
      check_launch(accrue_k_rope_qkv_fwd(dtype_code(yc.scalar_type()), yc.data_ptr(),
                                         cc.data_ptr<float>(), sc.data_ptr<float>(),
                                         q.data_ptr(), k.data_ptr(), v.data_ptr(), n, t, hq,
                                         hkv, d, on.stream),
                   "rope_qkv forward");
#endif
    } else {
      const auto yv = yc.view({n, t, heads, d});
      const auto c = cc.view({1, t, 1, half}), s = sc.view({1, t, 1, half});
      const auto turn = [&](const at::Tensor& part) {
        const auto x = part.to(at::kFloat);
        const auto [o1, o2] = rotate(x.narrow(-1, 0, half), x.narrow(-1, half, half), c, s);
        return at::cat({o1, o2}, -1).to(yc.scalar_type()).permute({0, 2, 1, 3}).contiguous();
      };
      q = turn(yv.narrow(2, 0, hq));
      k = turn(yv.narrow(2, hq, hkv));
      v = yv.narrow(2, hq + hkv, hkv).permute({0, 2, 1, 3}).contiguous();
    }
    ctx->save_for_backward({cc, sc});
    ctx->saved_data["fast"] = fast;
    ctx->saved_data["hq"] = hq;
    ctx->saved_data["hkv"] = hkv;
    return {q, k, v};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &cos = saved[0], &sin = saved[1];
    const int64_t hq = ctx->saved_data["hq"].toInt(), hkv = ctx->saved_data["hkv"].toInt();
    // A head without a gradient (unused output) contributes zeros.
    const auto& any = grads[0].defined() ? grads[0] : grads[1].defined() ? grads[1] : grads[2];
    const int64_t n = any.size(0), t = any.size(2), d = any.size(3), half = d / 2;
    const auto opts = any.options();
    const auto grad = [&](int i, int64_t heads) {
      return grads[i].defined() ? grads[i].contiguous() : at::zeros({n, heads, t, d}, opts);
    };
    const auto gq = grad(0, hq), gk = grad(1, hkv), gv = grad(2, hkv);
    at::Tensor gy;
    if (ctx->saved_data["fast"].toBool()) {
#ifdef ACCRUE_CUDA_KERNELS
      gy = at::empty({n, t, (hq + 2 * hkv) * d}, opts);
      const Launch on(gq);
      check_launch(accrue_k_rope_qkv_bwd(dtype_code(opts.dtype().toScalarType()),
                                         gq.data_ptr(), gk.data_ptr(), gv.data_ptr(),
                                         cos.data_ptr<float>(), sin.data_ptr<float>(),
                                         gy.data_ptr(), n, t, hq, hkv, d, on.stream),
                   "rope_qkv backward");
#endif
    } else {
      // autograd's chain through transformers' ops: the T-typed input
      // times fp32 cos gives cast_T(g * cos); rotate_half's side gives
      // cast_T(g * sin) moved back with its sign; added as T tensors.
      const auto type = opts.dtype().toScalarType();
      const auto c = cos.view({1, 1, t, half}), s = sin.view({1, 1, t, half});
      const auto back = [&](const at::Tensor& g) {
        const auto gf = g.to(at::kFloat);
        const auto g1 = gf.narrow(-1, 0, half), g2 = gf.narrow(-1, half, half);
        const auto a1 = (g1 * c).to(type), a2 = (g2 * c).to(type);
        const auto r1 = (g1 * s).to(type), r2 = (g2 * s).to(type);
        return at::cat({a1 + r2, a2 + (-r1)}, -1).permute({0, 2, 1, 3});
      };
      gy = at::cat({back(gq), back(gk), gv.permute({0, 2, 1, 3})}, 2)
               .reshape({n, t, (hq + 2 * hkv) * d});
    }
    return {gy, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// y [..., 2I] (gate | up) -> silu(gate) * up [..., I], in y's type.
struct Swiglu : public torch::autograd::Function<Swiglu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y, bool kernels) {
    TORCH_CHECK(y.size(-1) % 2 == 0, "swiglu: ", y.size(-1), " features are not gate | up");
    const int64_t inner = y.size(-1) / 2;
    const auto yc = y.contiguous();
    at::Tensor out;
    const bool fast = kernels_for(y, kernels);
    if (fast) {
#ifdef ACCRUE_CUDA_KERNELS
      auto sizes = yc.sizes().vec();
      sizes.back() = inner;
      out = at::empty(sizes, yc.options());
      const Launch on(yc);
      check_launch(accrue_k_swiglu_fwd(dtype_code(yc.scalar_type()), yc.data_ptr(),
                                       out.data_ptr(), yc.numel() / (2 * inner), inner,
                                       on.stream),
                   "swiglu forward");
#endif
    } else {
      out = at::silu(yc.narrow(-1, 0, inner)) * yc.narrow(-1, inner, inner);
    }
    ctx->save_for_backward({yc});
    ctx->saved_data["fast"] = fast;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto yc = ctx->get_saved_variables()[0];
    const int64_t inner = yc.size(-1) / 2;
    const auto go = grads[0].contiguous();
    at::Tensor gy;
    if (ctx->saved_data["fast"].toBool()) {
#ifdef ACCRUE_CUDA_KERNELS
      gy = at::empty_like(yc);
      const Launch on(yc);
      check_launch(accrue_k_swiglu_bwd(dtype_code(yc.scalar_type()), yc.data_ptr(),
                                       go.data_ptr(), gy.data_ptr(), yc.numel() / (2 * inner),
                                       inner, on.stream),
                   "swiglu backward");
#endif
    } else {
      const auto g = yc.narrow(-1, 0, inner), u = yc.narrow(-1, inner, inner);
      const auto gs = go * u;
      const auto gu = go * at::silu(g);
      gy = at::cat({at::silu_backward(gs, g), gu}, -1);
    }
    return {gy, at::Tensor()};
  }
};

// sum over rows of -log_softmax(float(x))[target] (-100 ignored), x
// [..., V] in bf16 or fp16, targets int64 [...]: transformers' loss on the
// head's logits (`logits.float()`, cross_entropy with reduction sum),
// whose gradient comes back in x's type.
struct CrossEntropySum : public torch::autograd::Function<CrossEntropySum> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& targets,
                            bool kernels) {
    const int64_t v = x.size(-1);
    const auto x2 = x.contiguous().view({-1, v});
    const auto t = targets.to(at::kLong).contiguous().view({-1});
    TORCH_CHECK(t.size(0) == x2.size(0), "cross_entropy_sum: ", t.size(0), " targets for ",
                x2.size(0), " rows of logits");
    ctx->saved_data["type"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["shape"] = x.sizes().vec();
    const bool fast = kernels_for(x, kernels);
    ctx->saved_data["fast"] = fast;
    if (fast) {
#ifdef ACCRUE_CUDA_KERNELS
      const int64_t m = x2.size(0);
      const auto f = x2.options().dtype(at::kFloat);
      auto loss = at::empty({m}, f), row_max = at::empty({m}, f), row_logsum = at::empty({m}, f);
      const Launch on(x2);
      check_launch(accrue_k_cross_entropy_fwd(dtype_code(x2.scalar_type()), x2.data_ptr(),
                                              t.data_ptr<int64_t>(), loss.data_ptr<float>(),
                                              row_max.data_ptr<float>(),
                                              row_logsum.data_ptr<float>(), m, v,
                                              on.stream),
                   "cross_entropy_sum forward");
      ctx->save_for_backward({x2, t, row_max, row_logsum});
      return loss.sum();
#endif
    }
    const auto ls = at::log_softmax(x2.to(at::kFloat), -1);
    auto [out, total_weight] = at::nll_loss_forward(ls, t, {}, at::Reduction::Sum, -100);
    ctx->save_for_backward({ls, t, total_weight});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto type = static_cast<at::ScalarType>(ctx->saved_data["type"].toInt());
    const auto g = grads[0].to(at::kFloat).contiguous();
    at::Tensor gx;
    if (ctx->saved_data["fast"].toBool()) {
#ifdef ACCRUE_CUDA_KERNELS
      const auto &x2 = saved[0], &t = saved[1], &row_max = saved[2], &row_logsum = saved[3];
      gx = at::empty_like(x2);
      const Launch on(x2);
      check_launch(accrue_k_cross_entropy_bwd(dtype_code(x2.scalar_type()), x2.data_ptr(),
                                              t.data_ptr<int64_t>(), row_max.data_ptr<float>(),
                                              row_logsum.data_ptr<float>(), g.data_ptr<float>(),
                                              gx.data_ptr(), x2.size(0), x2.size(1),
                                              on.stream),
                   "cross_entropy_sum backward");
#endif
    } else {
      const auto &ls = saved[0], &t = saved[1], &total_weight = saved[2];
      const auto gls =
          at::nll_loss_backward(g, ls, t, {}, at::Reduction::Sum, -100, total_weight);
      gx = at::_log_softmax_backward_data(gls, ls, -1, at::kFloat).to(type);
    }
    return {gx.view(ctx->saved_data["shape"].toIntVector()), at::Tensor(), at::Tensor()};
  }
};

using accrue_shim::guarded;
using accrue_shim::write_error;

const at::Tensor& tensor(void* p) { return *static_cast<at::Tensor*>(p); }

}  // namespace

// Tensor handles are tch's (`at::Tensor*`); each output is a new handle
// the caller owns. kernels: 1 runs accrue's CUDA kernels on CUDA tensors
// (when built), 0 the ATen chain. Each returns 0, or -1 with libtorch's
// message (without its backtrace) in err.
extern "C" {

int accrue_ops_have_kernels() {
#ifdef ACCRUE_CUDA_KERNELS
  return 1;
#else
  return 0;
#endif
}

int accrue_op_rms_norm_cast(void* x, void* w, double eps, int dtype, int kernels, void** out,
                            char* err, size_t len) {
  return guarded(
      [&] {
        *out = new at::Tensor(
            RmsNormCast::apply(tensor(x), tensor(w), eps, static_cast<int64_t>(dtype), kernels != 0));
      },
      err, len);
}

int accrue_op_add_rms_norm_cast(void* x, void* a, void* w, double eps, int kernels, void** sum,
                                void** out, char* err, size_t len) {
  return guarded(
      [&] {
        auto outs = AddRmsNormCast::apply(tensor(x), tensor(a), tensor(w), eps, kernels != 0);
        *sum = new at::Tensor(outs[0]);
        *out = new at::Tensor(outs[1]);
      },
      err, len);
}

int accrue_op_rope_qkv(void* y, void* cos, void* sin, int64_t hq, int64_t hkv, int kernels,
                       void** q, void** k, void** v, char* err, size_t len) {
  return guarded(
      [&] {
        auto outs = RopeQkv::apply(tensor(y), tensor(cos), tensor(sin), hq, hkv, kernels != 0);
        *q = new at::Tensor(outs[0]);
        *k = new at::Tensor(outs[1]);
        *v = new at::Tensor(outs[2]);
      },
      err, len);
}

int accrue_op_cross_entropy_sum(void* logits, void* targets, int kernels, void** out, char* err,
                                size_t len) {
  return guarded(
      [&] {
        *out = new at::Tensor(CrossEntropySum::apply(tensor(logits), tensor(targets), kernels != 0));
      },
      err, len);
}

int accrue_op_swiglu(void* y, int kernels, void** out, char* err, size_t len) {
  return guarded([&] { *out = new at::Tensor(Swiglu::apply(tensor(y), kernels != 0)); }, err,
                 len);
}

// PyTorch's fused Adam and AdamW (`torch.optim.AdamW(fused=True)`):
// libtorch's `_fused_adam_` / `_fused_adamw_`, which tch does not wrap
// (tensor-list operators); worker/src/optim/aten_fused.rs decides the
// step, the learning rate and the skip. One step of `n` parameters:
// `step` is the float32 step count every parameter reads (PyTorch's
// per-parameter `state["step"]`, the same number for all of them here);
// `lr_tensor`, when not null, is the learning rate as a float32 device
// tensor (what a CUDA graph replays), else `lr` is; `found_inf`, when not
// null, is a float32 tensor whose 1 makes the kernel leave everything as
// it was. decoupled: 1 AdamW, 0 Adam.
int accrue_fused_adam(void* const* params, void* const* grads, void* const* exp_avgs,
                      void* const* exp_avg_sqs, int n, void* step, void* lr_tensor, double lr,
                      double beta1, double beta2, double weight_decay, double eps, int decoupled,
                      void* found_inf, char* err, size_t len) {
  return guarded(
      [&] {
        const auto list = [n](void* const* ptrs) {
          std::vector<at::Tensor> out;
          for (int i = 0; i < n; ++i) {
            out.push_back(tensor(ptrs[i]));
          }
          return out;
        };
        const auto p = list(params), g = list(grads), m = list(exp_avgs), v = list(exp_avg_sqs);
        const std::vector<at::Tensor> steps(static_cast<size_t>(n), tensor(step));
        const std::vector<at::Tensor> none;
        const std::optional<at::Tensor> scale = std::nullopt;
        const auto inf =
            found_inf == nullptr ? std::optional<at::Tensor>() : std::optional(tensor(found_inf));
        if (lr_tensor != nullptr) {
          const auto& lr_t = tensor(lr_tensor);
          if (decoupled != 0) {
            at::_fused_adamw_(p, g, m, v, none, steps, lr_t, beta1, beta2, weight_decay, eps,
                              false, false, scale, inf);
          } else {
            at::_fused_adam_(p, g, m, v, none, steps, lr_t, beta1, beta2, weight_decay, eps,
                             false, false, scale, inf);
          }
        } else if (decoupled != 0) {
          at::_fused_adamw_(p, g, m, v, none, steps, lr, beta1, beta2, weight_decay, eps, false,
                            false, scale, inf);
        } else {
          at::_fused_adam_(p, g, m, v, none, steps, lr, beta1, beta2, weight_decay, eps, false,
                           false, scale, inf);
        }
      },
      err, len);
}
}
