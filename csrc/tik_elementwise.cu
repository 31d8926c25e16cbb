// areal-tik RMSNorm, RoPE and paged KV-cache write (plain CUDA, no torch headers).
//
// RMSNorm: one warp per row; lane l owns the 8-element groups l, l+32, l+64, ... and
// sums their squares in ascending element order, then a fixed xor-shuffle tree. The
// order depends only on the row length N, never on the number of rows or on pointer
// alignment (a vector-load variant must feed the same sequence), so rows are invariant
// to the batch. All arithmetic is explicitly rounded fp32 (no FMA contraction):
//   y = w * bf16(x * (1 / sqrt(sum(x^2) / N + eps)))   (HF Qwen2/Llama rounding points)
// RoPE: neox / rotate-half, fp32 math, one rounding to the output dtype:
//   y[i] = x[i]*cos[i] - x[i+h]*sin[i],  y[i+h] = x[i+h]*cos[i+h] + x[i]*sin[i+h]
// with each product and the sum rounded separately (the same bits as the unfused
// PyTorch expression x*cos + rotate_half(x)*sin in fp32). Its backward (the transpose, for autograd):
//   dx[i] = g[i]*cos[i] + g[i+h]*sin[i+h],  dx[i+h] = g[i+h]*cos[i+h] - g[i]*sin[i]
// with the same rounding points. 16-byte vector loads where dtype, D and alignment allow (same bits).
// The `// <tik:NAME>` markers delimit regions the optimisation agent's known transformations may replace
// (agent/proposers.py); they are comments and change nothing here.
#include "tik_api.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <algorithm>

namespace tik_ew {

__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(float v) { return v; }
template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }

// Rows (warps) per CTA: a launch-shape knob only (each row's arithmetic is one warp's, whatever the CTA
// holds), overridable at build time; the agent's csrc root for rms_norm searches it (agent/roots).
#ifndef TIK_RMS_WARPS
#define TIK_RMS_WARPS 4
#endif
constexpr int RMS_WARPS = TIK_RMS_WARPS;
static_assert(RMS_WARPS >= 1 && RMS_WARPS <= 32, "TIK_RMS_WARPS: 1..32 warps per CTA");

// rms_norm_kernel: y[row] = w * T(x[row] * (1 / sqrt(sum(x[row]^2) / n + eps))) with the rounding points
// of the header, one warp per row, RMS_WARPS rows per CTA. T = bf16, fp16 or fp32; any n > 0; x rows
// x_stride elements apart, y contiguous. A row's bits depend only on its values, n, w and eps, never on
// the number of rows or RMS_WARPS (the summation order is fixed by n).
template <typename T>
__global__ void __launch_bounds__(RMS_WARPS * 32)
    rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int64_t rows, int n,
                    int64_t x_stride, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t row = (int64_t)blockIdx.x * RMS_WARPS + (threadIdx.x >> 5);
  if (row >= rows) return;
  const T* xr = x + row * x_stride;
  T* yr = y + row * (int64_t)n;
  // <tik:rms-sumsq>
  float ss = 0.f;
  for (int c = lane; c * 8 < n; c += 32) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int idx = c * 8 + e;
      if (idx < n) {
        const float v = to_f(xr[idx]);
        ss = __fadd_rn(ss, __fmul_rn(v, v));
      }
    }
  }
  // </tik:rms-sumsq>
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, o));
  const float mean = __fdiv_rn(ss, (float)n);
  const float r = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(mean, eps)));
  // <tik:rms-scale>
  for (int c = lane; c * 8 < n; c += 32) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int idx = c * 8 + e;
      if (idx < n) {
        const float h = to_f(from_f<T>(__fmul_rn(to_f(xr[idx]), r)));  // hidden.to(input_dtype)
        yr[idx] = from_f<T>(__fmul_rn(to_f(w[idx]), h));                // weight * hidden
      }
    }
  }
  // </tik:rms-scale>
}

// A position's row of the cos/sin tables, clamped to [0, num_pos): positions are validated on the host, and a
// bad one must still never read out of bounds.
__device__ __forceinline__ int64_t table_row(int64_t pos, int64_t num_pos) {
  return pos < 0 ? 0 : (pos >= num_pos ? num_pos - 1 : pos);
}

// RoPE, element path: one thread per (token, head, i < D/2) pair of outputs, any strides, any dtype.
// BWD: the transpose (the gradient): y1 = x1*cos1 + x2*sin2, y2 = x2*cos2 - x1*sin1, same rounding points.
template <bool BWD>
__device__ __forceinline__ void rope_pair(float x1, float x2, float c1, float c2, float s1, float s2, float& y1,
                                          float& y2) {
  if constexpr (BWD) {
    y1 = __fadd_rn(__fmul_rn(x1, c1), __fmul_rn(x2, s2));
    y2 = __fadd_rn(__fmul_rn(x2, c2), __fmul_rn(-x1, s1));
  } else {
    y1 = __fadd_rn(__fmul_rn(x1, c1), __fmul_rn(-x2, s1));
    y2 = __fadd_rn(__fmul_rn(x2, c2), __fmul_rn(x1, s2));
  }
}

template <typename T, bool BWD>
__global__ void rope_kernel(const T* __restrict__ x, T* __restrict__ out, const float* __restrict__ cos_t,
                            const float* __restrict__ sin_t, const int64_t* __restrict__ positions, int64_t T_,
                            int H, int D, int64_t sx_t, int64_t sx_h, int64_t num_pos) {
  const int half = D / 2;
  const int64_t total = T_ * H * half;
  for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int i = (int)(idx % half);
    const int64_t th = idx / half;
    const int h = (int)(th % H);
    const int64_t t = th / H;
    const int64_t pos = table_row(positions[t], num_pos);
    const T* xr = x + t * sx_t + h * sx_h;
    const float* c = cos_t + pos * D;
    const float* s = sin_t + pos * D;
    float y1, y2;
    rope_pair<BWD>(to_f(xr[i]), to_f(xr[i + half]), c[i], c[i + half], s[i], s[i + half], y1, y2);
    T* o = out + (t * H + h) * (int64_t)D;
    o[i] = from_f<T>(y1);
    o[i + half] = from_f<T>(y2);
  }
}

// RoPE, vector path (2-byte types, D/2 a multiple of 8, x rows / strides / tables 16-byte aligned): a thread
// rotates 8 pairs (x1 = x[i .. i+8), x2 = x[i+D/2 .. i+D/2+8)) with 16-byte loads and stores, a CTA holds
// `tok` whole tokens, or (more than 256 groups per token) blockIdx.y's share of one token's `span` groups;
// thread -> (token, head, group) by 32-bit arithmetic. The same per-element operations as the element
// path, so the same bits.
template <typename T, bool BWD>
__global__ void __launch_bounds__(256) rope_vec_kernel(const T* __restrict__ x, T* __restrict__ out,
                                                       const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                                       const int64_t* __restrict__ positions, int64_t T_, int H, int D,
                                                       int64_t sx_t, int64_t sx_h, int64_t num_pos, int tok, int span) {
  const int half = D / 2, ng = half / 8, per_tok = H * ng;
  const int local = (int)threadIdx.x;
  const int lt = local / span, r = (int)blockIdx.y * span + (local - lt * span);
  if (lt >= tok || r >= per_tok) return;
  const int h = r / ng, gi = r - h * ng;
  const int64_t t = (int64_t)blockIdx.x * tok + lt;
  if (t >= T_) return;
  const int64_t pos = table_row(positions[t], num_pos);
  const int i = gi * 8;
  const T* xr = x + t * sx_t + h * sx_h;
  const uint4 u1 = __ldg(reinterpret_cast<const uint4*>(xr + i));
  const uint4 u2 = __ldg(reinterpret_cast<const uint4*>(xr + i + half));
  const float4* c = reinterpret_cast<const float4*>(cos_t + pos * D);
  const float4* s = reinterpret_cast<const float4*>(sin_t + pos * D);
  float c1[8], c2[8], s1[8], s2[8];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    *reinterpret_cast<float4*>(c1 + 4 * k) = __ldg(c + (i >> 2) + k);
    *reinterpret_cast<float4*>(c2 + 4 * k) = __ldg(c + ((i + half) >> 2) + k);
    *reinterpret_cast<float4*>(s1 + 4 * k) = __ldg(s + (i >> 2) + k);
    *reinterpret_cast<float4*>(s2 + 4 * k) = __ldg(s + ((i + half) >> 2) + k);
  }
  const T* a = reinterpret_cast<const T*>(&u1);
  const T* b = reinterpret_cast<const T*>(&u2);
  uint4 o1, o2;
  T* p1 = reinterpret_cast<T*>(&o1);
  T* p2 = reinterpret_cast<T*>(&o2);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    float y1, y2;
    rope_pair<BWD>(to_f(a[e]), to_f(b[e]), c1[e], c2[e], s1[e], s2[e], y1, y2);
    p1[e] = from_f<T>(y1);
    p2[e] = from_f<T>(y2);
  }
  T* orow = out + (t * H + h) * (int64_t)D;
  *reinterpret_cast<uint4*>(orow + i) = o1;
  *reinterpret_cast<uint4*>(orow + i + half) = o2;
}

// kv_write_kernel: k_cache row slots[t] = k row t and v_cache row slots[t] = v row t (row_bytes each),
// one CTA per token; slots outside [0, num_slots) are skipped. 2- or 4-byte elements; 16-byte vectors
// when rows and pointers are 16-byte aligned (rows are for D in {64, 128}), else element copies. Exact
// byte copies either way.
__global__ void kv_write_kernel(const char* __restrict__ k, const char* __restrict__ v, char* __restrict__ kc,
                                char* __restrict__ vc, const int64_t* __restrict__ slots, int64_t row_bytes,
                                int64_t num_slots, int elem_bytes, int vec16) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0 || slot >= num_slots) return;
  const char* ks = k + t * row_bytes;
  const char* vs = v + t * row_bytes;
  char* kd = kc + slot * row_bytes;
  char* vd = vc + slot * row_bytes;
  if (vec16) {
    for (int64_t i = threadIdx.x; i < row_bytes / 16; i += blockDim.x) {
      reinterpret_cast<uint4*>(kd)[i] = reinterpret_cast<const uint4*>(ks)[i];
      reinterpret_cast<uint4*>(vd)[i] = reinterpret_cast<const uint4*>(vs)[i];
    }
  } else if (elem_bytes == 4) {
    for (int64_t i = threadIdx.x; i < row_bytes / 4; i += blockDim.x) {
      reinterpret_cast<uint32_t*>(kd)[i] = reinterpret_cast<const uint32_t*>(ks)[i];
      reinterpret_cast<uint32_t*>(vd)[i] = reinterpret_cast<const uint32_t*>(vs)[i];
    }
  } else {
    for (int64_t i = threadIdx.x; i < row_bytes / 2; i += blockDim.x) {
      reinterpret_cast<uint16_t*>(kd)[i] = reinterpret_cast<const uint16_t*>(ks)[i];
      reinterpret_cast<uint16_t*>(vd)[i] = reinterpret_cast<const uint16_t*>(vs)[i];
    }
  }
}

template <typename T>
cudaError_t rms_launch(const void* x, const void* w, void* y, int64_t rows, int n, int64_t xs, float eps,
                       cudaStream_t st) {
  const int64_t blocks = (rows + RMS_WARPS - 1) / RMS_WARPS;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  rms_norm_kernel<T><<<(unsigned)blocks, RMS_WARPS * 32, 0, st>>>(
      static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y), rows, n, xs, eps);
  return cudaGetLastError();
}

template <typename T>
cudaError_t rope_launch(const void* x, void* out, const float* c, const float* s, const int64_t* pos, int64_t T_,
                        int H, int D, int64_t sxt, int64_t sxh, int64_t np, int backward, cudaStream_t st) {
  const uintptr_t ptrs = (uintptr_t)x | (uintptr_t)out | (uintptr_t)c | (uintptr_t)s;
  const int64_t per_tok = (int64_t)H * (D / 16);
  if (sizeof(T) == 2 && D % 16 == 0 && ptrs % 16 == 0 && sxt % 8 == 0 && sxh % 8 == 0 && per_tok <= 65535LL * 256) {
    const int span = (int)std::min<int64_t>(per_tok, 256), tok = 256 / span;
    const int64_t blocks = (T_ + tok - 1) / tok;
    if (blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
    auto k = backward ? rope_vec_kernel<T, true> : rope_vec_kernel<T, false>;
    k<<<dim3((unsigned)blocks, (unsigned)((per_tok + span - 1) / span)), tok * span, 0, st>>>(
        static_cast<const T*>(x), static_cast<T*>(out), c, s, pos, T_, H, D, sxt, sxh, np, tok, span);
    return cudaGetLastError();
  }
  const int64_t total = T_ * H * (D / 2);
  int64_t blocks = (total + 255) / 256;
  if (blocks > 65535LL * 16) blocks = 65535LL * 16;
  auto k = backward ? rope_kernel<T, true> : rope_kernel<T, false>;
  k<<<(unsigned)blocks, 256, 0, st>>>(static_cast<const T*>(x), static_cast<T*>(out), c, s, pos, T_, H, D, sxt, sxh,
                                      np);
  return cudaGetLastError();
}

}  // namespace tik_ew

extern "C" {

int tik_rms_norm(const void* x, const void* w, void* y, int64_t rows, int n, int64_t x_row_stride, float eps,
                 int dtype, cudaStream_t stream) {
  if (n <= 0 || rows < 0) return (int)cudaErrorInvalidValue;
  if (rows == 0) return (int)cudaSuccess;
  switch (dtype) {
    case 0: return (int)tik_ew::rms_launch<__nv_bfloat16>(x, w, y, rows, n, x_row_stride, eps, stream);
    case 1: return (int)tik_ew::rms_launch<__half>(x, w, y, rows, n, x_row_stride, eps, stream);
    case 2: return (int)tik_ew::rms_launch<float>(x, w, y, rows, n, x_row_stride, eps, stream);
  }
  return (int)cudaErrorInvalidValue;
}

int tik_apply_rope(const void* x, void* out, const float* cos, const float* sin, const int64_t* positions,
                   int64_t T, int H, int D, int64_t x_stride_t, int64_t x_stride_h, int64_t num_positions, int dtype,
                   int backward, cudaStream_t stream) {
  if (D <= 0 || D % 2 != 0 || H <= 0 || T < 0) return (int)cudaErrorInvalidValue;
  if (T == 0) return (int)cudaSuccess;
  switch (dtype) {
    case 0:
      return (int)tik_ew::rope_launch<__nv_bfloat16>(x, out, cos, sin, positions, T, H, D, x_stride_t, x_stride_h,
                                                     num_positions, backward, stream);
    case 1:
      return (int)tik_ew::rope_launch<__half>(x, out, cos, sin, positions, T, H, D, x_stride_t, x_stride_h,
                                              num_positions, backward, stream);
    case 2:
      return (int)tik_ew::rope_launch<float>(x, out, cos, sin, positions, T, H, D, x_stride_t, x_stride_h,
                                             num_positions, backward, stream);
  }
  return (int)cudaErrorInvalidValue;
}

int tik_kv_cache_write(const void* k, const void* v, void* k_cache, void* v_cache, const int64_t* slots, int64_t T,
                       int64_t row_elems, int64_t num_slots, int elem_bytes, cudaStream_t stream) {
  if (T < 0 || row_elems <= 0 || (elem_bytes != 2 && elem_bytes != 4)) return (int)cudaErrorInvalidValue;
  if (T == 0) return (int)cudaSuccess;
  if (T > 0x7fffffffLL) return (int)cudaErrorInvalidConfiguration;
  const int64_t row_bytes = row_elems * elem_bytes;
  const uintptr_t ptrs = (uintptr_t)k | (uintptr_t)v | (uintptr_t)k_cache | (uintptr_t)v_cache;
  const int vec16 = (row_bytes % 16 == 0) && (ptrs % 16 == 0);
  tik_ew::kv_write_kernel<<<(unsigned)T, 128, 0, stream>>>(
      static_cast<const char*>(k), static_cast<const char*>(v), static_cast<char*>(k_cache),
      static_cast<char*>(v_cache), slots, row_bytes, num_slots, elem_bytes, vec16);
  return (int)cudaGetLastError();
}

}  // extern "C"
