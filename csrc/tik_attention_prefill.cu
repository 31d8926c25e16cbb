// Prefill attention: launches with more than 16 rows per KV head (max_seqlen_q * G > 16), i.e.
// attention_varlen (training forward) and attention_paged prefill / chunked prefill.
//   * attn_kernel (mma.sync, sm_80+): every such launch in either mode, D in {64, 128}, any page size;
//     in SPLIT mode followed by attn_merge_kernel (tik_attention_merge.cuh).
//   * attn_kernel_wgmma (tik_attention_wgmma.cuh, sm_90a, D = 128, FOLD mode): preferred where it can
//     run (TikAttnParams::prefill_kernel AUTO), with the same per-row arithmetic, so the same bits.
#include "tik_attention_launch.h"
#include "tik_attention_merge.cuh"
#include "tik_attention_wgmma.cuh"

namespace tik_attn {

// attn_kernel's dynamic shared memory: a double-buffered K and V block, rows padded by 8 elements.
template <int D>
constexpr int smem_bytes() {
  return 2 * 2 * BN * (D + 8) * 2;
}

// attn_kernel: causal attention of one tile of WARPS x 16 rows (query token x query head of KV head
// blockIdx.y's GQA group, of sequence blockIdx.z); launched with WARPS = 4 (64 rows per CTA).
//   Computes out[row] = softmax(scale * q[row] . k[j], j <= pos(row)) @ v in bf16, fp32 accumulation,
//   D in {64, 128}; varlen (K/V rows = the sequence's tokens) or paged (any page size: each K/V row's
//   page is looked up). K/V blocks of BN positions arrive by cp.async into a double buffer (zero-filled
//   at or past kv_len); each warp skips blocks past all of its rows.
//   FOLD (SPLITM = false): the CTA walks blocks 0 .. the tile's last, merges each split chunk into
//   (M, L, O) in registers as the walk passes its end, writes out (and p.lse when set). Tiles are
//   launched longest walk first.
//   SPLIT (SPLITM = true): one CTA per (tile, chunk) walks that chunk's blocks from a fresh state and
//   stores its partial (ws_acc, ws_ml; ws_nc from chunk 0); attn_merge_kernel finishes.
//   Guarantee: a row's bits depend only on its own q, its sequence's K/V and its position, never on
//   the batch, packing, paging, the mode or which rows share the warp (see tik_attention.cu).
template <int D, int WARPS, bool SPLITM>
__global__ void __launch_bounds__(WARPS * 32) attn_kernel(const TikAttnParams p) {
  constexpr int NT = BN / 8;   // n-tiles of S
  constexpr int KC = D / 16;   // k-steps of Q K^T
  constexpr int DT = D / 8;    // n-tiles of O
  constexpr int LDS = D + 8;   // smem row stride in elements (pads banks)
  constexpr int ROWS = WARPS * 16;
  constexpr int NTH = WARPS * 32;
  constexpr int SEGS = D / 8;  // 16-byte segments per K/V row

  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Ks = reinterpret_cast<bf16*>(smem_raw);  // [2][BN][LDS]
  bf16* Vs = Ks + 2 * BN * LDS;                  // [2][BN][LDS]

  const int b = blockIdx.z, hk = blockIdx.y;
  const int G = p.Hq / p.Hkv;
  int tile, chunk = 0;
  if (SPLITM) {
    const int maxc = max_chunks_of(p);
    tile = blockIdx.x / maxc;
    chunk = blockIdx.x % maxc;
  } else {
    tile = gridDim.x - 1 - blockIdx.x;  // longest causal walks first
  }
  const int q0 = p.cu_seqlens_q[b];
  const int nq = p.cu_seqlens_q[b + 1] - q0;
  const int kv_len = p.paged ? p.seqlens_k[b] : nq;
  const int rows_total = nq * G;
  const int row0 = tile * ROWS;
  if (row0 >= rows_total) return;
  const int pos_off = kv_len - nq;  // absolute position of this launch's first query
  const int last_row = min(rows_total, row0 + ROWS) - 1;
  const int tile_max_pos = pos_off + last_row / G;
  if (tile_max_pos < 0) return;  // kv_len < n_q: invalid input, nothing defined to compute
  const int nblk = tile_max_pos / BN + 1;
  int jb = 0, je = nblk;
  if (SPLITM) {
    jb = chunk * BPC;
    je = min(nblk, jb + BPC);
    if (jb >= je) return;
  }

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int wrow0 = row0 + warp * 16;
  const int warp_max_pos = wrow0 < rows_total ? pos_off + (min(rows_total, wrow0 + 16) - 1) / G : -1;

  int rpos[2], rlast[2];
  bool rvalid[2];
  int64_t rowid[2];
  thread_rows(p, wrow0, g, G, rows_total, pos_off, q0, hk, rpos, rlast, rvalid, rowid);

  // The thread's Q fragments and walk state: declared here at this kernel's sizes, filled by the shared helpers
  // of tik_attention_common.cuh (so the decode and the prefill start from the same values the same way).
  // Q fragments (A operand, row-major 16 x D), zero for invalid rows.
  uint32_t qa[KC][4];
  load_q_frags<D, KC>(qa, p.q, rowid, rvalid, t);

  // chunk state (online softmax within one split chunk)
  float acc[DT][4];
  float m[2], l[2];
  // merged state across chunks (FOLD mode)
  float O[SPLITM ? 1 : DT][4];
  float M[2], L[2];
  init_walk_state<DT, !SPLITM>(acc, m, l, O, M, L);

  const bf16* kg0 = static_cast<const bf16*>(p.k);
  const bf16* vg0 = static_cast<const bf16*>(p.v);
  const int64_t kv_base = p.paged ? 0 : (int64_t)q0;

  auto load_tile = [&](int j, int buf) {
#pragma unroll 4
    for (int i = threadIdx.x; i < BN * SEGS; i += NTH) {
      const int r = i / SEGS, s = i % SEGS;
      const int pos = j * BN + r;
      const bool ok = pos < kv_len;
      int64_t off = 0;
      if (ok) {
        int64_t slot;
        if (p.paged) {
          const int page = p.block_table[(int64_t)b * p.max_pages + pos / p.page_size];
          slot = (int64_t)page * p.page_size + pos % p.page_size;
        } else {
          slot = kv_base + pos;
        }
        off = (slot * p.Hkv + hk) * D + s * 8;
      }
      const uint32_t so = (uint32_t)(((buf * BN + r) * LDS + s * 8) * 2);
      cp_async16((uint32_t)__cvta_generic_to_shared(Ks) + so, kg0 + off, ok ? 16 : 0);
      cp_async16((uint32_t)__cvta_generic_to_shared(Vs) + so, vg0 + off, ok ? 16 : 0);
    }
  };

  const float sl2 = p.scale_log2;
  load_tile(jb, 0);
  cp_async_commit();
  for (int j = jb; j < je; ++j) {
    const int buf = (j - jb) & 1;
    if (j + 1 < je) {
      load_tile(j + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    if (warp_max_pos >= j * BN) {  // warp-uniform: some row of this warp sees this block
      const bf16* Kb = Ks + buf * BN * LDS;
      const bf16* Vb = Vs + buf * BN * LDS;
      float s[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const bf16* kr = Kb + (nt * 8 + g) * LDS + kc * 16 + 2 * t;
          const uint32_t b0 = *reinterpret_cast<const uint32_t*>(kr);
          const uint32_t b1 = *reinterpret_cast<const uint32_t*>(kr + 8);
          mma16816(s[nt], qa[kc], b0, b1);
        }
      }
      // scale (log2 domain) + causal mask, row max
      float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
      scale_block<NT>(&s[0][0], j * BN, t, rpos, sl2, mx);
      float alpha[2];
      softmax_block<NT>(&s[0][0], mx, m, l, alpha);
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[dt][e] = __fmul_rn(acc[dt][e], alpha[e >> 1]);
      // acc += P V, k-steps of 16 KV positions ascending
      const uint32_t vbase = (uint32_t)__cvta_generic_to_shared(Vb);
#pragma unroll
      for (int kc = 0; kc < BN / 16; ++kc) {
        uint32_t pa[4];
        pa[0] = pack_bf16(s[2 * kc][0], s[2 * kc][1]);
        pa[1] = pack_bf16(s[2 * kc][2], s[2 * kc][3]);
        pa[2] = pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]);
        pa[3] = pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3]);
#pragma unroll
        for (int np = 0; np < D / 16; ++np) {
          const int vr = kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
          const int vc = np * 16 + (lane >> 4) * 8;
          uint32_t r0, r1, r2, r3;
          ldsm_x4_trans(r0, r1, r2, r3, vbase + (uint32_t)((vr * LDS + vc) * 2));
          mma16816(acc[2 * np], pa, r0, r1);
          mma16816(acc[2 * np + 1], pa, r2, r3);
        }
      }
    }

    if constexpr (!SPLITM) {
      if ((j + 1) % BPC == 0 || j == je - 1) {  // end of split chunk c: merge it, start fresh
        const int c = j / BPC;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          if (c <= rlast[i]) merge_chunk_row<DT>(M[i], L[i], m[i], l[i], &O[0][0], &acc[0][0], i);
          m[i] = -CUDART_INF_F;
          l[i] = 0.f;
#pragma unroll
          for (int dt = 0; dt < DT; ++dt) {
            acc[dt][2 * i] = 0.f;
            acc[dt][2 * i + 1] = 0.f;
          }
        }
      }
    }
    __syncthreads();
  }

  // Epilogue: out = O / L rounded once to bf16, and the row's lse. Written in each kernel on its own accumulator
  // layout (mma.sync fragments here; the decode's column split; wgmma's accumulators), with the same per-element
  // arithmetic (pack_bf16(__fdiv_rn(.)) and row_lse from tik_attention_common.cuh).
  if constexpr (!SPLITM) {
    bf16* out = static_cast<bf16*>(p.out);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!rvalid[i]) continue;
      uint32_t* orow = reinterpret_cast<uint32_t*>(out + rowid[i] * D);
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
        orow[dt * 4 + t] = pack_bf16(__fdiv_rn(O[dt][2 * i], L[i]), __fdiv_rn(O[dt][2 * i + 1], L[i]));
      if (p.lse != nullptr && t == 0) p.lse[rowid[i]] = row_lse(M[i], L[i]);
    }
  } else {
    const int maxc = max_chunks_of(p);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!rvalid[i] || chunk > rlast[i]) continue;
      const int64_t base = rowid[i] * maxc + chunk;
      float2* arow = reinterpret_cast<float2*>(p.ws_acc + base * D);
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) arow[dt * 4 + t] = make_float2(acc[dt][2 * i], acc[dt][2 * i + 1]);
      if (t == 0) {
        p.ws_ml[base * 2] = m[i];
        p.ws_ml[base * 2 + 1] = l[i];
        if (chunk == 0) p.ws_nc[rowid[i]] = rlast[i] + 1;
      }
    }
  }
}

// attn_kernel's grid: (tiles [x max chunks in SPLIT mode], Hkv, batch); SPLIT mode then merges.
template <int D, int WARPS, bool SPLITM>
cudaError_t launch(const TikAttnParams& p, cudaStream_t stream) {
  constexpr int ROWS = WARPS * 16;
  const int G = p.Hq / p.Hkv;
  const int64_t rows = (int64_t)p.max_seqlen_q * G;
  const int64_t ntiles = (rows + ROWS - 1) / ROWS;
  const int64_t gx = SPLITM ? ntiles * max_chunks_of(p) : ntiles;
  if (gx <= 0) return cudaSuccess;
  if (gx > 0x7fffffffLL || p.Hkv > 65535 || p.batch > 65535) return cudaErrorInvalidConfiguration;
  constexpr int SMEM = smem_bytes<D>();
  auto kern = attn_kernel<D, WARPS, SPLITM>;
  cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
  if (err != cudaSuccess) return err;
  kern<<<dim3((unsigned)gx, p.Hkv, p.batch), WARPS * 32, SMEM, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess || !SPLITM) return err;
  attn_merge_kernel<D><<<(unsigned)p.total_q * p.Hq, D, 0, stream>>>(p);
  return cudaGetLastError();
}

// See tik_attention_launch.h. Cached per device.
bool wgmma_prefill_available() {
  static int cached[64];  // 0 unknown, 1 yes, 2 no
  return per_device_cached(cached, [](int dev) {
           int major = 0, minor = 0;
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
           cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
           cudaFuncAttributes a;
           const bool ok = major == 9 && minor == 0 &&
                           cudaFuncGetAttributes(&a, attn_kernel_wgmma<128>) == cudaSuccess &&
                           a.binaryVersion == 90 && tensor_map_encoder() != nullptr;
           return ok ? 1 : 2;
         }) == 1;
}

// attn_kernel_wgmma's launch: grid (ceil(max_seqlen_q * G / 128), Hkv, batch), K/V TMA boxes of
// min(page size, 64) rows. cudaErrorNotSupported when no TMA descriptor can be made, or when a box
// could cross a page (page sizes that neither divide 64 nor are a multiple of it; the Python entry
// points accept only powers of two 16..256, the binding any size): the caller then runs attn_kernel,
// which looks up every row's page.
cudaError_t launch_wgmma(const TikAttnParams& p, cudaStream_t stream) {
  const int G = p.Hq / p.Hkv;
  const int64_t rows = (int64_t)p.max_seqlen_q * G;
  const int64_t gx = (rows + WG_ROWS - 1) / WG_ROWS;
  if (gx <= 0) return cudaSuccess;
  if (gx > 0x7fffffffLL || p.Hkv > 65535 || p.batch > 65535) return cudaErrorInvalidConfiguration;
  const int box_rows = p.paged ? (p.page_size < BN ? p.page_size : BN) : BN;
  if (BN % box_rows != 0 || (p.paged && p.page_size % box_rows != 0)) return cudaErrorNotSupported;
  CUtensorMap mk, mv;
  if (!make_kv_map(&mk, p.k, p.kv_rows, p.Hkv, box_rows) || !make_kv_map(&mv, p.v, p.kv_rows, p.Hkv, box_rows))
    return cudaErrorNotSupported;
  constexpr int SMEM = wg_smem_bytes();
  auto kern = attn_kernel_wgmma<128>;
  cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
  if (err != cudaSuccess) return err;
  kern<<<dim3((unsigned)gx, p.Hkv, p.batch), WG_CTA_THREADS, SMEM, stream>>>(p, mk, mv, box_rows);
  return cudaGetLastError();
}

// Whether a FOLD-mode, not decode-shaped launch runs attn_kernel_wgmma (see TikAttnParams::prefill_kernel).
bool use_wgmma(const TikAttnParams& p, int mode) {
  if (p.prefill_kernel == TIK_ATTN_PREFILL_MMA) return false;
  return mode == TIK_ATTN_FOLD && p.D == 128 && wgmma_prefill_available();
}

// The prefill kernel for one launch: the wgmma kernel where use_wgmma says so and its descriptors can be
// made, else attn_kernel; prefill_kernel = WGMMA refuses the fallback (cudaErrorNotSupported).
template <int D>
cudaError_t dispatch(const TikAttnParams& p, int mode, cudaStream_t stream) {
  if (D == 128 && use_wgmma(p, mode)) {
    const cudaError_t err = launch_wgmma(p, stream);
    if (err != cudaErrorNotSupported || p.prefill_kernel == TIK_ATTN_PREFILL_WGMMA) return err;
  }  // no TMA descriptor for these tensors: the mma.sync kernel (same bits)
  if (p.prefill_kernel == TIK_ATTN_PREFILL_WGMMA) return cudaErrorNotSupported;
  return mode == TIK_ATTN_SPLIT_MODE ? launch<D, 4, true>(p, stream) : launch<D, 4, false>(p, stream);
}

// See tik_attention_launch.h.
cudaError_t prefill_attention(const TikAttnParams& p, int mode, cudaStream_t stream) {
  if (p.D == 64) return dispatch<64>(p, mode, stream);
  if (p.D == 128) return dispatch<128>(p, mode, stream);
  return cudaErrorInvalidValue;
}

int describe_prefill(char* buf, int buflen, int used) {
  describe_one(buf, buflen, used, "attn<D64,4warp,fold>", attn_kernel<64, 4, false>, smem_bytes<64>());
  describe_one(buf, buflen, used, "attn<D64,4warp,split>", attn_kernel<64, 4, true>, smem_bytes<64>());
  describe_one(buf, buflen, used, "attn<D128,4warp,fold>", attn_kernel<128, 4, false>, smem_bytes<128>());
  describe_one(buf, buflen, used, "attn<D128,4warp,split>", attn_kernel<128, 4, true>, smem_bytes<128>());
  describe_one(buf, buflen, used, "attn_wgmma<D128,2+1warpgroups,fold,tma>", attn_kernel_wgmma<128>, wg_smem_bytes());
  describe_one(buf, buflen, used, "attn_merge<D64>", attn_merge_kernel<64>, 0);
  describe_one(buf, buflen, used, "attn_merge<D128>", attn_merge_kernel<128>, 0);
  return used;
}

}  // namespace tik_attn
