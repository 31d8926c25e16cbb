// Host-side interface between the attention translation units: tik_attention.cu (C entry points, TMA
// descriptors), tik_attention_prefill.cu and tik_attention_decode.cu (their launchers). Each function is
// defined in the file named above its declaration. Only nvcc compiles this header.
#pragma once
#include <cuda.h>  // CUtensorMap
#include <stdio.h>

#include "tik_api.h"

namespace tik_attn {

typedef CUresult (*TensorMapEncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                         const cuuint64_t*, const cuuint32_t*, const cuuint32_t*,
                                         CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                         CUtensorMapFloatOOBfill);

// tik_attention.cu
// cuTensorMapEncodeTiled from the driver, or nullptr when it has none.
TensorMapEncodeTiled tensor_map_encoder();
// TMA descriptor of a K or V tensor viewed as [rows][Hkv][D] bf16 (rows = tokens or cache slots):
// boxes of 64 columns x 1 head x box_rows rows, 128-byte swizzle. False if the encoder refuses
// (e.g. a base address that is not 16-byte aligned).
bool make_kv_map(CUtensorMap* map, const void* base, int64_t rows, int hkv, int box_rows);

// tik_attention_prefill.cu
// Whether the current device runs attn_kernel_wgmma: compute capability 9.0, the module holds the
// sm_90a body (binaryVersion 90; an sm_80-only build has no wgmma code) and the driver has the
// TMA descriptor encoder. Per device.
bool wgmma_prefill_available();
// Launches that are not decode-shaped (max_seqlen_q * G > 16); mode is resolved (FOLD or SPLIT), p validated.
// cudaErrorInvalidValue for a head dim other than 64 or 128.
cudaError_t prefill_attention(const TikAttnParams& p, int mode, cudaStream_t stream);
// Appends one describe_one line per prefill kernel instantiation to buf (used bytes so far); returns the new count.
int describe_prefill(char* buf, int buflen, int used);

// tik_attention_decode.cu
// Decode-shaped launches (max_seqlen_q * G <= 16); as prefill_attention.
cudaError_t decode_attention(const TikAttnParams& p, int mode, cudaStream_t stream);
// As describe_prefill, for the decode kernels.
int describe_decode(char* buf, int buflen, int used);

// A non-zero per-device property of the current device, computed once per device (compute(dev)
// must return non-zero); 0 when there is no current device.
template <typename F>
int per_device_cached(int (&cache)[64], F compute) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0) return 0;
  if (dev >= 64) return compute(dev);
  if (cache[dev] == 0) cache[dev] = compute(dev);
  return cache[dev];
}

// Counters the fused decode needs: one per (sequence, KV head, 16-row tile).
__host__ __device__ __forceinline__ int64_t decode_counters_needed(const TikAttnParams& p) {
  const int64_t rows = (int64_t)p.max_seqlen_q * (p.Hq / p.Hkv);
  return (int64_t)p.batch * p.Hkv * ((rows + 15) / 16);
}

// One line of tik_attention_describe: kernel `name`'s registers, spill, shared memory and binary version.
template <typename K>
void describe_one(char* buf, int buflen, int& used, const char* name, K kern, int smem) {
  cudaFuncAttributes a;
  cudaError_t e = cudaFuncGetAttributes(&a, kern);
  if (used >= buflen) return;
  int n;
  if (e != cudaSuccess)
    n = snprintf(buf + used, buflen - used, "%s: cudaFuncGetAttributes failed: %s\n", name, cudaGetErrorString(e));
  else
    n = snprintf(buf + used, buflen - used,
                 "%s: regs=%d local(spill)=%zuB static_smem=%zuB dyn_smem=%dB max_threads=%d ptx=%d binary=%d\n",
                 name, a.numRegs, a.localSizeBytes, a.sharedSizeBytes, smem, a.maxThreadsPerBlock, a.ptxVersion,
                 a.binaryVersion);
  if (n > 0) used += n;
}

}  // namespace tik_attn
