"""How fast can a decode CTA stream a paged K/V cache into shared memory, by which copy instruction?

    python bench/probes/probe_load_paths.py --out $OUT        # H100/H200 (sm_90a); writes OUT/load_paths.json

The decode kernel's loader (csrc attn_decode_kernel) measured at the same speed whether it computes or
not (bench/probes/csrc_ablations.py DECLOAD), at every ring depth and chunks-per-CTA setting, and with pages in
order or shuffled: ~3.6 TB/s at 16 sequences x 8192 positions, where SDPA reads its contiguous copy at
4.3 TB/s. This probe isolates the copy path. One CTA of 128 threads streams `bpc` blocks (64 positions,
one page) of one (sequence, KV head) of the engine's cache layout [page][64 rows][Hkv][128] bf16 through
an S-stage shared-memory ring (rows padded to 136 columns, as the decode kernel's):
    cpasync  128 threads x 16 cp.async.cg of 16 bytes per block (the decode kernel's loader); the same
             with an L2 prefetch hint (.L2::128B, .L2::256B) or with the src-size operand (zero-fill form)
    bulk256  one warp issues 128 cp.async.bulk copies of one 256-byte row each (K and V), mbarrier completion
    bulk16k  one thread issues 2 bulk copies of 16 KB (a head-major page: NOT the engine's layout; the
             size ceiling of the bulk path)
    tma_box  one thread issues 4 TMA tensor boxes (64 columns x 1 head x 64 rows, 128-byte swizzle) over the
             engine's layout, as the wgmma prefill loads K/V
The consumer touches two values per block; each CTA writes one float so nothing is elided. Bytes moved
are the same in every row of the output: 2 x B x ctx x Hkv x 128 x 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: harness, bench_cuda, kernel_arms
sys.path[:0] = [os.path.dirname(BENCH), BENCH]  # the repo root (areal_tik) and bench/

_SRC = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cstdint>
constexpr int BN = 64, D = 128, LDS = D + 8;
template <int V>
__device__ __forceinline__ void cp16(uint32_t s, const void* g) {
  if (V == 0) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(g) : "memory");
  if (V == 1) asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(s), "l"(g) : "memory");
  if (V == 2) asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(s), "l"(g) : "memory");
  if (V == 3) asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(g), "r"(16) : "memory");
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int c) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(c) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t b) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(b) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t ph) {
  uint32_t d = 0;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(d) : "r"(bar), "r"(ph) : "memory");
  } while (!d);
}
__device__ __forceinline__ void bulk(uint32_t s, const void* g, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(s), "l"(g), "r"(bytes), "r"(bar) : "memory");
}

template <int MODE, int S>
__global__ void __launch_bounds__(128) probe(const __nv_bfloat16* K, const __nv_bfloat16* V, const int* bt, int npg,
                                             int hkv, int bpc, float* out) {
  extern __shared__ __align__(128) unsigned char sm[];
  const int b = blockIdx.z, hk = blockIdx.y, blk0 = blockIdx.x * bpc;
  const int nb = min(bpc, npg - blk0);
  __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(sm);
  __nv_bfloat16* Vs = Ks + S * BN * LDS;
  const uint32_t ks = (uint32_t)__cvta_generic_to_shared(Ks), vs = (uint32_t)__cvta_generic_to_shared(Vs);
  const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(Vs + S * BN * LDS);
  const int row_elems = hkv * D;
  const int64_t page_elems = (int64_t)BN * row_elems;
  if ((MODE == 1 || MODE == 2) && threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) mbar_init(bar0 + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int i) {
    const int st = i % S;
    const int pg = __ldg(bt + (int64_t)b * npg + blk0 + i);
    if (MODE == 0 || MODE >= 3) {
      constexpr int CV = MODE == 0 ? 0 : MODE - 2;
      const int lr0 = threadIdx.x / 16, ls = threadIdx.x % 16;
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int r = lr0 + u * 8;
        const int64_t o = (int64_t)pg * page_elems + (int64_t)r * row_elems + hk * D + ls * 8;
        const uint32_t so = (uint32_t)(((st * BN + r) * LDS + ls * 8) * 2);
        cp16<CV>(ks + so, K + o);
        cp16<CV>(vs + so, V + o);
      }
    } else if (MODE == 1) {
      if (threadIdx.x < 32) {
        const uint32_t bar = bar0 + 8 * st;
        if (threadIdx.x == 0) mbar_expect(bar, 2 * BN * D * 2);
        __syncwarp();
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int r = threadIdx.x + u * 32;
          const int64_t o = (int64_t)pg * page_elems + (int64_t)r * row_elems + hk * D;
          const uint32_t so = (uint32_t)((st * BN + r) * LDS * 2);
          bulk(ks + so, K + o, D * 2, bar);
          bulk(vs + so, V + o, D * 2, bar);
        }
      }
    } else {
      if (threadIdx.x == 0) {
        const uint32_t bar = bar0 + 8 * st;
        mbar_expect(bar, 2 * BN * D * 2);
        const int64_t o = (int64_t)pg * page_elems + (int64_t)hk * BN * D;
        bulk(ks + st * BN * LDS * 2, K + o, BN * D * 2, bar);
        bulk(vs + st * BN * LDS * 2, V + o, BN * D * 2, bar);
      }
    }
  };
  float acc = 0.f;
  for (int i = 0; i < S - 1; ++i) {
    if (i < nb) issue(i);
    if (MODE != 1 && MODE != 2) asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  for (int i = 0; i < nb; ++i) {
    const int st = i % S;
    if (MODE != 1 && MODE != 2) asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 2) : "memory");
    else mbar_wait(bar0 + 8 * st, (i / S) & 1);
    __syncthreads();  // block i landed for everyone; everyone is done with block i - 1 (its stage refills now)
    if (i + S - 1 < nb) issue(i + S - 1);
    if (MODE != 1 && MODE != 2) asm volatile("cp.async.commit_group;\n" ::: "memory");
    const int e = st * BN * LDS + (threadIdx.x >> 1) * LDS + (threadIdx.x & 1) * 64;
    acc += __bfloat162float(Ks[e]) + __bfloat162float(Vs[e]);
  }
  if (threadIdx.x == 0) out[(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] = acc;
}

template <int MODE, int S>
void launch(const at::Tensor& K, const at::Tensor& V, const at::Tensor& bt, int64_t bpc, at::Tensor& out) {
  const int B = bt.size(0), npg = bt.size(1), hkv = K.size(2);
  const int smem = S * 2 * BN * LDS * 2 + S * 8;
  auto k = probe<MODE, S>;
  TORCH_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess, "smem");
  dim3 grid((npg + bpc - 1) / bpc, hkv, B);
  k<<<grid, 128, smem, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(K.data_ptr()), reinterpret_cast<const __nv_bfloat16*>(V.data_ptr()),
      bt.data_ptr<int>(), npg, hkv, (int)bpc, out.data_ptr<float>());
}

// TMA boxes over the engine's layout: a block of one head = 2 boxes (64 columns x 1 head x 64 rows, 128-byte
// swizzle) for K and 2 for V, issued by one thread, completion on the stage's mbarrier (the wgmma prefill's way).
__device__ __forceinline__ void tma3(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
               ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}

template <int S>
__global__ void __launch_bounds__(128) probe_tma(const __grid_constant__ CUtensorMap mk, const __grid_constant__ CUtensorMap mv,
                                                 const int* bt, int npg, int bpc, float* out) {
  extern __shared__ __align__(1024) unsigned char sm_raw[];
  unsigned char* sm = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(sm_raw) + 1023) & ~uintptr_t(1023));
  const int b = blockIdx.z, hk = blockIdx.y, blk0 = blockIdx.x * bpc;
  const int nb = min(bpc, npg - blk0);
  constexpr int STAGE = 4 * 8192;  // K halves, V halves
  const uint32_t smem0 = (uint32_t)__cvta_generic_to_shared(sm), bar0 = smem0 + S * STAGE;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) mbar_init(bar0 + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int i) {
    if (threadIdx.x != 0) return;
    const int st = i % S, row = __ldg(bt + (int64_t)b * npg + blk0 + i) * BN;
    const uint32_t bar = bar0 + 8 * st, d = smem0 + st * STAGE;
    mbar_expect(bar, STAGE);
    tma3(d, &mk, 0, hk, row, bar);
    tma3(d + 8192, &mk, 64, hk, row, bar);
    tma3(d + 16384, &mv, 0, hk, row, bar);
    tma3(d + 24576, &mv, 64, hk, row, bar);
  };
  float acc = 0.f;
  for (int i = 0; i < S - 1; ++i)
    if (i < nb) issue(i);
  for (int i = 0; i < nb; ++i) {
    const int st = i % S;
    mbar_wait(bar0 + 8 * st, (i / S) & 1);
    __syncthreads();
    if (i + S - 1 < nb) issue(i + S - 1);
    const __nv_bfloat16* blk = reinterpret_cast<const __nv_bfloat16*>(sm + st * STAGE);
    acc += __bfloat162float(blk[threadIdx.x * 64]) + __bfloat162float(blk[8192 + threadIdx.x * 64]);
  }
  if (threadIdx.x == 0) out[(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] = acc;
}

typedef CUresult (*EncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                                const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static void kv_map(CUtensorMap* map, const at::Tensor& t) {
  static EncodeTiled enc = nullptr;
  if (enc == nullptr) {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    TORCH_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
                q == cudaDriverEntryPointSuccess, "no cuTensorMapEncodeTiled");
    enc = reinterpret_cast<EncodeTiled>(f);
  }
  const int64_t rows = t.size(0) * t.size(1);
  const int hkv = t.size(2);
  const cuuint64_t dims[3] = {128, (cuuint64_t)hkv, (cuuint64_t)rows};
  const cuuint64_t strides[2] = {128 * 2, (cuuint64_t)hkv * 128 * 2};
  const cuuint32_t box[3] = {64, 1, 64};
  const cuuint32_t estr[3] = {1, 1, 1};
  TORCH_CHECK(enc(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, t.data_ptr(), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS,
              "tensor map");
}

template <int S>
void launch_tma(const at::Tensor& K, const at::Tensor& V, const at::Tensor& bt, int64_t bpc, at::Tensor& out) {
  const int B = bt.size(0), npg = bt.size(1), hkv = K.size(2);
  CUtensorMap mk, mv;
  kv_map(&mk, K);
  kv_map(&mv, V);
  const int smem = S * 4 * 8192 + S * 8 + 1024;
  auto k = probe_tma<S>;
  TORCH_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess, "smem");
  dim3 grid((npg + bpc - 1) / bpc, hkv, B);
  k<<<grid, 128, smem, c10::cuda::getCurrentCUDAStream()>>>(mk, mv, bt.data_ptr<int>(), npg, (int)bpc, out.data_ptr<float>());
}

void run(at::Tensor K, at::Tensor V, at::Tensor bt, int64_t mode, int64_t stages, int64_t bpc, at::Tensor out) {
  if (mode == 6) {
    if (stages == 2) return launch_tma<2>(K, V, bt, bpc, out);
    if (stages == 3) return launch_tma<3>(K, V, bt, bpc, out);
    if (stages == 4) return launch_tma<4>(K, V, bt, bpc, out);
    if (stages == 6) return launch_tma<6>(K, V, bt, bpc, out);
  }
#define TIK_PROBE_CASE(M, S) if (mode == M && stages == S) return launch<M, S>(K, V, bt, bpc, out);
  TIK_PROBE_CASE(0, 2) TIK_PROBE_CASE(0, 3) TIK_PROBE_CASE(0, 4) TIK_PROBE_CASE(0, 6)
  TIK_PROBE_CASE(1, 2) TIK_PROBE_CASE(1, 3) TIK_PROBE_CASE(1, 4) TIK_PROBE_CASE(1, 6)
  TIK_PROBE_CASE(2, 2) TIK_PROBE_CASE(2, 3) TIK_PROBE_CASE(2, 4) TIK_PROBE_CASE(2, 6)
  TIK_PROBE_CASE(3, 2) TIK_PROBE_CASE(3, 3) TIK_PROBE_CASE(4, 2) TIK_PROBE_CASE(4, 3) TIK_PROBE_CASE(5, 2) TIK_PROBE_CASE(5, 3)
  TORCH_CHECK(false, "mode 0..2 with stages 2/3/4/6, modes 3..5 with stages 2/3");
}
"""
_CPP = "void run(at::Tensor K, at::Tensor V, at::Tensor bt, int64_t mode, int64_t stages, int64_t bpc, at::Tensor out);"
MODES = {"cpasync": 0, "bulk256": 1, "bulk16k": 2, "cpasync_L2_128B": 3, "cpasync_L2_256B": 4, "cpasync_srcsize": 5,
         "tma_box": 6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cells", default="16x8192,64x1024", help="BATCHxCONTEXT, 8 KV heads, pages of 64")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4, 6])
    ap.add_argument("--bpc", type=int, nargs="+", default=[4, 16, 128], help="blocks (pages) per CTA")
    ap.add_argument("--paths", nargs="+", choices=list(MODES), default=list(MODES), help="copy paths to time")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("probe_load_paths needs an sm_90 GPU (cp.async.bulk)")
    from torch.utils.cpp_extension import load_inline

    from bench_cuda import _median_ms as _ms  # the bench scripts' CUDA-event timer
    mod = load_inline("tik_probe_load_paths", cpp_sources=_CPP, cuda_sources=_SRC, functions=["run"],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17"])
    rows = []
    for cell in a.cells.split(","):
        B, ctx = (int(x) for x in cell.split("x"))
        npg, hkv = ctx // 64, 8
        K = torch.randn(B * npg, 64, hkv, 128, device="cuda", dtype=torch.bfloat16)
        V = torch.randn_like(K)
        bt = torch.randperm(B * npg, device="cuda").to(torch.int32).view(B, npg)
        nbytes = 2 * K.numel() * 2
        for bpc in a.bpc:
            if bpc > npg:
                continue
            out = torch.empty(B * hkv * (-(-npg // bpc)), device="cuda")
            for name, mode in ((n, MODES[n]) for n in a.paths):
                for st in (a.stages if mode < 3 or mode == 6 else [s for s in a.stages if s in (2, 3)]):
                    ms = _ms(lambda: mod.run(K, V, bt, mode, st, bpc, out))
                    rows.append({"cell": cell, "bpc": bpc, "path": name, "stages": st, "us": round(ms * 1e3, 2),
                                 "TB_s": round(nbytes / ms / 1e9, 3)})
                    print(rows[-1], flush=True)
        x = K.view(-1)
        ms = _ms(lambda: x.sum())
        rows.append({"cell": cell, "path": "torch.sum(K)", "TB_s": round(K.numel() * 2 / ms / 1e9, 3)})
        print(rows[-1], flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "load_paths.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
