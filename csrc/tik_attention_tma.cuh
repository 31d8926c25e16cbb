// sm_90a TMA and mbarrier helpers, shared by the wgmma prefill (tik_attention_wgmma.cuh) and the decode
// kernel's TMA loader (tik_attention_decode.cu), D = 128 only.
//
// A K/V ring stage holds one KV block of BN = 64 positions: K, then V, each as two 64-column halves of
// BN rows x 128 bytes in the 128-byte swizzle (the layout wgmma descriptors and the swizzled ldmatrix
// addresses of the decode kernel read). Boxes come from TMA descriptors made by make_kv_map
// (tik_attention_launch.h). Device code exists only in the sm_90a pass (TIK_SM90A_DEVICE).
#pragma once
#include <cuda.h>  // CUtensorMap

#include "tik_attention_common.cuh"

// Defined while nvcc compiles device code for sm_90a (wgmma, setmaxnreg and TMA need the "a" target).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TIK_SM90A_DEVICE 1
#endif

namespace tik_attn {

constexpr int WG_HALF_BYTES = BN * 128;         // one 64-column half of a K or V block, or of 64 Q rows (8 KB)
constexpr int WG_TILE_BYTES = 2 * WG_HALF_BYTES;  // a 64 x 128 bf16 block (also one warpgroup's Q rows)

#ifdef TIK_SM90A_DEVICE
// mbarriers in shared memory (addresses as 32-bit shared-window offsets): init with an arrival count,
// arrive + expect TMA bytes, spin on a phase parity, plain arrive.
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One 3-d TMA box (D-columns c0.., head c1, rows c2..) -> shared memory, completion on bar.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
// K/V block j (positions j * BN ..) -> one ring stage by TMA, completion on bar: K at ks, V at ks + WG_TILE_BYTES,
// each two 64-column halves of BN rows in the 128-byte swizzle. Boxes of box_rows rows (BN, or the page size
// when pages are smaller); boxes starting at or past kv_len are not loaded (their block-table entries may be
// garbage). slot_of(pos): the K/V row (cache slot or token) of position pos. Serves the wgmma prefill's
// producer and the decode kernel's TMA loader.
template <typename SlotOf>
__device__ __forceinline__ void tma_kv_block(uint32_t ks, uint32_t bar, const CUtensorMap* tm_k, const CUtensorMap* tm_v,
                                             int hk, int j, int box_rows, int kv_len, SlotOf slot_of) {
  // Fast path, one box per half (box_rows == BN: contiguous K/V, or pages of >= 64 rows; the caller loads
  // only blocks starting before kv_len): four TMA instructions per block, no loop or per-box page lookup
  // (measured on the H200: the general loop on this path cost the prefill 9-11%).
  if (box_rows == BN) {
    const int64_t slot = slot_of(j * BN);
    mbar_expect_tx(bar, (uint32_t)(BN * 128 * 4));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tma_load_3d(ks + h * WG_HALF_BYTES, tm_k, h * 64, hk, (int)slot, bar);
      tma_load_3d(ks + WG_TILE_BYTES + h * WG_HALF_BYTES, tm_v, h * 64, hk, (int)slot, bar);
    }
    return;
  }
  const int nbox = BN / box_rows;
  int nload = 0;
  for (int u = 0; u < nbox; ++u) nload += (j * BN + u * box_rows < kv_len);
  mbar_expect_tx(bar, (uint32_t)(nload * box_rows * 128 * 4));
  for (int u = 0; u < nbox; ++u) {
    const int pos = j * BN + u * box_rows;
    if (pos >= kv_len) break;
    const int64_t slot = slot_of(pos);
    const uint32_t ro = (uint32_t)(u * box_rows * 128);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tma_load_3d(ks + h * WG_HALF_BYTES + ro, tm_k, h * 64, hk, (int)slot, bar);
      tma_load_3d(ks + WG_TILE_BYTES + h * WG_HALF_BYTES + ro, tm_v, h * 64, hk, (int)slot, bar);
    }
  }
}
// V rows r0 .. BN - 1 of a stage's V block at vs (two 64-column halves in the 128-byte swizzle) -> 0: the
// stores of thread tid of nthreads, then the proxy fence that orders them before the async proxy's accesses
// to the stage (wgmma reads, a later TMA refill). The zero-fill of rows at or past kv_len that the cp.async
// loaders get from their src-size operand: a masked score's P is exactly 0, and 0 * V must not meet a NaN.
__device__ __forceinline__ void zero_v_rows(uint32_t vs, int r0, int tid, int nthreads) {
  constexpr int SEGS = 16;  // 16-byte segments per 128-column row
  for (int i = tid; i < (BN - r0) * SEGS; i += nthreads) {
    const int r = r0 + i / SEGS, sg = i % SEGS;
    const uint32_t a = vs + (uint32_t)((sg >> 3) * WG_HALF_BYTES + r * 128 + (((sg & 7) ^ (r & 7)) << 4));
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(a), "r"(0u) : "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
#endif  // TIK_SM90A_DEVICE

}  // namespace tik_attn
