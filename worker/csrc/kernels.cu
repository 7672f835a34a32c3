// accrue's fused CUDA kernels for the Llama family under autocast (bf16
// or fp16 activations, fp32 residual stream), compiled by nvcc with
// ACCRUE_CUDA=1 (worker/build.rs). Each replaces a chain of eager ATen
// kernels of transformers' computation and rounds where that chain rounds
// (docs/SEMANTICS.md, "Fused kernels"):
//
//   rms_norm_cast   LlamaRMSNorm on the fp32 residual stream followed by
//                   autocast's cast of its output for the next projection:
//                   y = cast(w * (x * rsqrt(mean(x^2) + eps))), optionally
//                   after the residual add x + a of a T-typed branch;
//   rope_qkv        the q/k/v projection's output [N, T, (Hq + 2 Hkv) D]
//                   split into heads [N, H, T, D], q and k rotated as
//                   transformers' apply_rotary_pos_emb does in fp32
//                   (x * cos + rotate_half(x) * sin), then cast as autocast
//                   casts them for the attention;
//   swiglu          silu(gate) * up of the gate/up projection's output
//                   [M, 2I], in the activation type;
//   cross_entropy   the head's T-typed logits [M, V] widened to fp32,
//                   log_softmax and the summed negative log-likelihood of
//                   the targets (-100 ignored), without the fp32 logits.
//
// Backward kernels give the gradients autograd gives for those chains,
// with the same roundings to the activation type. Nothing here knows
// libtorch: plain pointers and a stream, launched by csrc/fused_ops.cpp.
// Every launcher returns 0 or the CUDA error code of the launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

template <typename T>
__device__ __forceinline__ float to_f(T v);
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_f<__half>(__half v) {
  return __half2float(v);
}

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f<__half>(float v) {
  return __float2half_rn(v);
}

// Rounded to T and back: what an op whose result is a T tensor keeps.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_f<T>(from_f<T>(v));
}

constexpr int kThreads = 256;

// The sum of `v` over the block (every thread gets it). `scratch` holds
// kThreads / 32 floats.
__device__ float block_sum(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) {
    scratch[warp] = v;
  }
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < kThreads / 32; ++i) {
    total += scratch[i];
  }
  return total;
}

// One block a row: with a residual `a` (T-typed; may be null), the row
// of x + a (one fp32 rounding, as the residual stream's add; written to
// xa), else of x; its mean square, reciprocal root (kept for the
// backward) and the normalized, weighted row rounded to T.
template <typename T>
__global__ void rms_norm_cast_fwd(const float* __restrict__ x, const T* __restrict__ a,
                                  float* __restrict__ xa, const float* __restrict__ w,
                                  T* __restrict__ y, float* __restrict__ rstd, int64_t h,
                                  float eps) {
  __shared__ float scratch[kThreads / 32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * h;
  const T* ar = a == nullptr ? nullptr : a + row * h;
  float* xar = xa == nullptr ? nullptr : xa + row * h;
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < h; j += kThreads) {
    float v = xr[j];
    if (ar != nullptr) {
      v = __fadd_rn(v, to_f<T>(ar[j]));
      xar[j] = v;
    }
    s += v * v;
  }
  s = block_sum(s, scratch);
  const float r = rsqrtf(__fadd_rn(__fdiv_rn(s, static_cast<float>(h)), eps));
  if (threadIdx.x == 0) {
    rstd[row] = r;
  }
  // The summed row is read back by the thread that wrote it.
  const float* src = ar != nullptr ? xar : xr;
  T* yr = y + row * h;
  for (int64_t j = threadIdx.x; j < h; j += kThreads) {
    // transformers: hs = x * r (fp32), then weight * hs (fp32), then the
    // cast: two roundings in fp32, one to T.
    yr[j] = from_f<T>(__fmul_rn(w[j], __fmul_rn(src[j], r)));
  }
}

// Rows b, b + gridDim.x, ... of the backward, x the normalized input (the
// summed row with a residual): the input's gradient per row, plus the
// gradient `gx_extra` from the input's other uses (may be null), into gx;
// with `ga` (may be null) also cast to T there (the residual's gradient,
// as autograd casts an add's gradient to a T-typed input); and this
// block's share of the weight's gradient (summed over its rows, in shared
// memory; the host adds the blocks' shares).
template <typename T>
__global__ void rms_norm_cast_bwd(const T* __restrict__ gy, const float* __restrict__ x,
                                  const float* __restrict__ w, const float* __restrict__ rstd,
                                  const float* __restrict__ gx_extra, float* __restrict__ gx,
                                  T* __restrict__ ga, float* __restrict__ gw_part, int64_t rows,
                                  int64_t h) {
  extern __shared__ float acc[];  // h floats
  __shared__ float scratch[kThreads / 32];
  for (int64_t j = threadIdx.x; j < h; j += kThreads) {
    acc[j] = 0.f;
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float r = rstd[row];
    const float* xr = x + row * h;
    const T* gr = gy + row * h;
    float dot = 0.f;
    for (int64_t j = threadIdx.x; j < h; j += kThreads) {
      const float g = to_f<T>(gr[j]);
      dot += __fmul_rn(g, w[j]) * xr[j];
      acc[j] += g * __fmul_rn(xr[j], r);
    }
    dot = block_sum(dot, scratch);
    // d/dx of x * r(x): r * gn - x * r^3 / h * sum(gn * x)
    const float c = r * r * r * dot / static_cast<float>(h);
    float* gxr = gx + row * h;
    for (int64_t j = threadIdx.x; j < h; j += kThreads) {
      float v = r * __fmul_rn(to_f<T>(gr[j]), w[j]) - c * xr[j];
      if (gx_extra != nullptr) {
        v = __fadd_rn(gx_extra[row * h + j], v);
      }
      gxr[j] = v;
      if (ga != nullptr) {
        ga[row * h + j] = from_f<T>(v);
      }
    }
  }
  for (int64_t j = threadIdx.x; j < h; j += kThreads) {
    gw_part[blockIdx.x * h + j] = acc[j];
  }
}

// One thread a (row, head, i < D/2) pair of q or k, or a (row, head, i)
// pair of v's halves. y is [N, T, (hq + 2 hkv) D]; q, k, v are
// [N, H, T, D]; cos and sin [T, D/2] fp32.
template <typename T>
__global__ void rope_qkv_fwd(const T* __restrict__ y, const float* __restrict__ cos,
                             const float* __restrict__ sin, T* __restrict__ q,
                             T* __restrict__ k, T* __restrict__ v, int64_t n, int64_t t,
                             int64_t hq, int64_t hkv, int64_t d) {
  const int64_t half = d / 2;
  const int64_t heads = hq + 2 * hkv;
  const int64_t total = n * t * heads * half;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx % half;
    const int64_t head = (idx / half) % heads;
    const int64_t s = (idx / (half * heads)) % t;
    const int64_t b = idx / (half * heads * t);
    const T* src = y + ((b * t + s) * heads + head) * d;
    const float x1 = to_f<T>(src[i]), x2 = to_f<T>(src[i + half]);
    T* out;
    int64_t h;
    if (head < hq) {
      out = q;
      h = head;
    } else if (head < hq + hkv) {
      out = k;
      h = head - hq;
    } else {
      // v: the same two elements, moved to [N, Hkv, T, D].
      T* dst = v + ((b * hkv + (head - hq - hkv)) * t + s) * d;
      dst[i] = src[i];
      dst[i + half] = src[i + half];
      continue;
    }
    const int64_t heads_here = head < hq ? hq : hkv;
    T* dst = out + ((b * heads_here + h) * t + s) * d;
    const float c = cos[s * half + i], sn = sin[s * half + i];
    // x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1): each
    // product rounded in fp32, then the sum, then the cast for attention.
    dst[i] = from_f<T>(__fadd_rn(__fmul_rn(x1, c), __fmul_rn(-x2, sn)));
    dst[i + half] = from_f<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, sn)));
  }
}

// The backward: gq, gk, gv [N, H, T, D] (contiguous) into gy
// [N, T, (hq + 2 hkv) D]. For q and k, autograd's chain through
// transformers' ops: the T-typed input x times fp32 cos gives
// cast_T(g * cos); rotate_half's side gives cast_T(g * sin) moved back
// (with the sign); the two are added as T tensors.
template <typename T>
__global__ void rope_qkv_bwd(const T* __restrict__ gq, const T* __restrict__ gk,
                             const T* __restrict__ gv, const float* __restrict__ cos,
                             const float* __restrict__ sin, T* __restrict__ gy, int64_t n,
                             int64_t t, int64_t hq, int64_t hkv, int64_t d) {
  const int64_t half = d / 2;
  const int64_t heads = hq + 2 * hkv;
  const int64_t total = n * t * heads * half;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx % half;
    const int64_t head = (idx / half) % heads;
    const int64_t s = (idx / (half * heads)) % t;
    const int64_t b = idx / (half * heads * t);
    T* dst = gy + ((b * t + s) * heads + head) * d;
    if (head >= hq + hkv) {
      const T* src = gv + ((b * hkv + (head - hq - hkv)) * t + s) * d;
      dst[i] = src[i];
      dst[i + half] = src[i + half];
      continue;
    }
    const bool is_q = head < hq;
    const T* src = is_q ? gq + ((b * hq + head) * t + s) * d
                        : gk + ((b * hkv + (head - hq)) * t + s) * d;
    const float g1 = to_f<T>(src[i]), g2 = to_f<T>(src[i + half]);
    const float c = cos[s * half + i], sn = sin[s * half + i];
    const float a1 = round_to<T>(__fmul_rn(g1, c)), a2 = round_to<T>(__fmul_rn(g2, c));
    const float r1 = round_to<T>(__fmul_rn(g1, sn)), r2 = round_to<T>(__fmul_rn(g2, sn));
    dst[i] = from_f<T>(__fadd_rn(a1, r2));
    dst[i + half] = from_f<T>(__fadd_rn(a2, -r1));
  }
}

// silu as ATen's CUDA kernel computes it: x / (1 + exp(-x)) in fp32.
__device__ __forceinline__ float silu_f(float x) { return __fdiv_rn(x, __fadd_rn(1.f, expf(-x))); }

// y [M, 2I] (gate | up) -> out [M, I] = cast(cast(silu(gate)) * up).
template <typename T>
__global__ void swiglu_fwd(const T* __restrict__ y, T* __restrict__ out, int64_t m,
                           int64_t inner) {
  const int64_t total = m * inner;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / inner, j = idx % inner;
    const T* r = y + row * 2 * inner;
    const float s = round_to<T>(silu_f(to_f<T>(r[j])));
    out[idx] = from_f<T>(__fmul_rn(s, to_f<T>(r[inner + j])));
  }
}

// The backward of swiglu_fwd: go [M, I] -> gy [M, 2I]. autograd's chain:
// the product's gradients cast(go * up) and cast(go * silu), then silu's
// backward as ATen computes it, dy * sig * (1 + x * (1 - sig)).
template <typename T>
__global__ void swiglu_bwd(const T* __restrict__ y, const T* __restrict__ go,
                           T* __restrict__ gy, int64_t m, int64_t inner) {
  const int64_t total = m * inner;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / inner, j = idx % inner;
    const T* r = y + row * 2 * inner;
    const float x = to_f<T>(r[j]), u = to_f<T>(r[inner + j]), g = to_f<T>(go[idx]);
    const float s = round_to<T>(silu_f(x));
    const float gs = round_to<T>(__fmul_rn(g, u));
    const float sig = __fdiv_rn(1.f, __fadd_rn(1.f, expf(-x)));
    T* dst = gy + row * 2 * inner;
    dst[j] = from_f<T>(gs * sig * (1.f + x * (1.f - sig)));
    dst[inner + j] = from_f<T>(__fmul_rn(g, s));
  }
}

// The block's maximum of `v` (every thread gets it).
__device__ float block_max(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) {
    scratch[warp] = v;
  }
  __syncthreads();
  float m = scratch[0];
  for (int i = 1; i < kThreads / 32; ++i) {
    m = fmaxf(m, scratch[i]);
  }
  return m;
}

// One block a row of logits x [M, V]: the row's max and log(sum(exp(x -
// max))) (kept for the backward), and its loss term -log_softmax(x)[t]
// as ATen's epilogue computes log_softmax, (x - max) - logsum; 0 for an
// ignored target.
template <typename T>
__global__ void cross_entropy_fwd(const T* __restrict__ x, const int64_t* __restrict__ target,
                                  float* __restrict__ loss, float* __restrict__ row_max,
                                  float* __restrict__ row_logsum, int64_t v) {
  __shared__ float scratch[kThreads / 32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * v;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < v; j += kThreads) {
    m = fmaxf(m, to_f<T>(xr[j]));
  }
  m = block_max(m, scratch);
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < v; j += kThreads) {
    s += expf(__fsub_rn(to_f<T>(xr[j]), m));
  }
  s = block_sum(s, scratch);
  const float logsum = logf(s);
  if (threadIdx.x == 0) {
    row_max[row] = m;
    row_logsum[row] = logsum;
    const int64_t t = target[row];
    loss[row] = (t < 0 || t >= v) ? 0.f : -__fsub_rn(__fsub_rn(to_f<T>(xr[t]), m), logsum);
  }
}

// The backward of the summed loss with upstream gradient *g: autograd's
// chain, nll_loss's gradient (-g at the target) through log_softmax's
// backward, gI = gO - exp(log_softmax) * sum(gO), then the cast of the
// widened logits' gradient to T. An ignored row's gradient is 0.
template <typename T>
__global__ void cross_entropy_bwd(const T* __restrict__ x, const int64_t* __restrict__ target,
                                  const float* __restrict__ row_max,
                                  const float* __restrict__ row_logsum,
                                  const float* __restrict__ g, T* __restrict__ gx, int64_t v) {
  const int64_t row = blockIdx.x;
  const int64_t t = target[row];
  const T* xr = x + row * v;
  T* gr = gx + row * v;
  const bool counted = t >= 0 && t < v;
  const float go = counted ? -*g : 0.f;  // the target's gO; the row's sum(gO)
  const float m = row_max[row], logsum = row_logsum[row];
  for (int64_t j = threadIdx.x; j < v; j += kThreads) {
    const float ls = __fsub_rn(__fsub_rn(to_f<T>(xr[j]), m), logsum);
    const float at = j == t ? go : 0.f;
    gr[j] = from_f<T>(__fsub_rn(at, __fmul_rn(expf(ls), go)));
  }
}

int grid_for(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1) : 65535 * 8);
}

int last_error() { return static_cast<int>(cudaGetLastError()); }

}  // namespace

// dtype: 0 bf16, 1 fp16 (csrc/fused_ops.cpp maps libtorch's types).
extern "C" {

// a and xa: both null, or the residual (T) and where x + a goes (fp32).
int accrue_k_rms_norm_cast_fwd(int dtype, const float* x, const void* a, float* xa,
                               const float* w, void* y, float* rstd, int64_t rows, int64_t h,
                               float eps, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (rows == 0) {
    return 0;
  }
  if (dtype == 0) {
    using T = __nv_bfloat16;
    rms_norm_cast_fwd<T><<<rows, kThreads, 0, s>>>(x, static_cast<const T*>(a), xa, w,
                                                   static_cast<T*>(y), rstd, h, eps);
  } else {
    using T = __half;
    rms_norm_cast_fwd<T><<<rows, kThreads, 0, s>>>(x, static_cast<const T*>(a), xa, w,
                                                   static_cast<T*>(y), rstd, h, eps);
  }
  return last_error();
}

// gw_part: [blocks, h]; blocks > 0. gx_extra and ga may be null.
int accrue_k_rms_norm_cast_bwd(int dtype, const void* gy, const float* x, const float* w,
                               const float* rstd, const float* gx_extra, float* gx, void* ga,
                               float* gw_part, int64_t rows, int64_t h, int blocks,
                               void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const size_t shared = static_cast<size_t>(h) * sizeof(float);
  if (dtype == 0) {
    using T = __nv_bfloat16;
    rms_norm_cast_bwd<T><<<blocks, kThreads, shared, s>>>(
        static_cast<const T*>(gy), x, w, rstd, gx_extra, gx, static_cast<T*>(ga), gw_part, rows,
        h);
  } else {
    using T = __half;
    rms_norm_cast_bwd<T><<<blocks, kThreads, shared, s>>>(
        static_cast<const T*>(gy), x, w, rstd, gx_extra, gx, static_cast<T*>(ga), gw_part, rows,
        h);
  }
  return last_error();
}

int accrue_k_rope_qkv_fwd(int dtype, const void* y, const float* cos, const float* sin, void* q,
                          void* k, void* v, int64_t n, int64_t t, int64_t hq, int64_t hkv,
                          int64_t d, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const int grid = grid_for(n * t * (hq + 2 * hkv) * (d / 2));
  if (dtype == 0) {
    using T = __nv_bfloat16;
    rope_qkv_fwd<T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(y), cos, sin,
                                              static_cast<T*>(q), static_cast<T*>(k),
                                              static_cast<T*>(v), n, t, hq, hkv, d);
  } else {
    using T = __half;
    rope_qkv_fwd<T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(y), cos, sin,
                                              static_cast<T*>(q), static_cast<T*>(k),
                                              static_cast<T*>(v), n, t, hq, hkv, d);
  }
  return last_error();
}

int accrue_k_rope_qkv_bwd(int dtype, const void* gq, const void* gk, const void* gv,
                          const float* cos, const float* sin, void* gy, int64_t n, int64_t t,
                          int64_t hq, int64_t hkv, int64_t d, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const int grid = grid_for(n * t * (hq + 2 * hkv) * (d / 2));
  if (dtype == 0) {
    using T = __nv_bfloat16;
    rope_qkv_bwd<T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(gq),
                                              static_cast<const T*>(gk),
                                              static_cast<const T*>(gv), cos, sin,
                                              static_cast<T*>(gy), n, t, hq, hkv, d);
  } else {
    using T = __half;
    rope_qkv_bwd<T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(gq),
                                              static_cast<const T*>(gk),
                                              static_cast<const T*>(gv), cos, sin,
                                              static_cast<T*>(gy), n, t, hq, hkv, d);
  }
  return last_error();
}

int accrue_k_swiglu_fwd(int dtype, const void* y, void* out, int64_t m, int64_t inner,
                        void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const int grid = grid_for(m * inner);
  if (dtype == 0) {
    using T = __nv_bfloat16;
    swiglu_fwd<T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(y), static_cast<T*>(out), m,
                                            inner);
  } else {
    using T = __half;
    swiglu_fwd<T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(y), static_cast<T*>(out), m,
                                            inner);
  }
  return last_error();
}

int accrue_k_cross_entropy_fwd(int dtype, const void* x, const int64_t* target, float* loss,
                               float* row_max, float* row_logsum, int64_t m, int64_t v,
                               void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (m == 0) {
    return 0;
  }
  if (dtype == 0) {
    using T = __nv_bfloat16;
    cross_entropy_fwd<T><<<m, kThreads, 0, s>>>(static_cast<const T*>(x), target, loss, row_max,
                                                row_logsum, v);
  } else {
    using T = __half;
    cross_entropy_fwd<T><<<m, kThreads, 0, s>>>(static_cast<const T*>(x), target, loss, row_max,
                                                row_logsum, v);
  }
  return last_error();
}

// g: the upstream gradient, one float on the device (no host read, so a
// CUDA graph can hold the launch).
int accrue_k_cross_entropy_bwd(int dtype, const void* x, const int64_t* target,
                               const float* row_max, const float* row_logsum, const float* g,
                               void* gx, int64_t m, int64_t v, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (m == 0) {
    return 0;
  }
  if (dtype == 0) {
    using T = __nv_bfloat16;
    cross_entropy_bwd<T><<<m, kThreads, 0, s>>>(static_cast<const T*>(x), target, row_max,
                                                row_logsum, g, static_cast<T*>(gx), v);
  } else {
    using T = __half;
    cross_entropy_bwd<T><<<m, kThreads, 0, s>>>(static_cast<const T*>(x), target, row_max,
                                                row_logsum, g, static_cast<T*>(gx), v);
  }
  return last_error();
}

int accrue_k_swiglu_bwd(int dtype, const void* y, const void* go, void* gy, int64_t m,
                        int64_t inner, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const int grid = grid_for(m * inner);
  if (dtype == 0) {
    using T = __nv_bfloat16;
    swiglu_bwd<T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(y), static_cast<const T*>(go),
                                            static_cast<T*>(gy), m, inner);
  } else {
    using T = __half;
    swiglu_bwd<T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(y), static_cast<const T*>(go),
                                            static_cast<T*>(gy), m, inner);
  }
  return last_error();
}
}
