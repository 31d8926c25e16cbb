// SPLIT-mode merges: chunk partials -> the output rows.
//
// In SPLIT mode every (row, split chunk) leaves an fp32 partial in the workspace: ws_acc[row][c][D]
// (the chunk's unnormalised accumulator), ws_ml[row][c] = (m, l) (its running max and sum, log2
// domain), c < max_chunks_of(p); rows are token * Hq + q head. Each merge below folds a row's chunks
// 0 .. nc-1 in ascending order with merge_coeffs / merge_val from the empty state, then O / L
// (__fdiv_rn) rounded once to bf16: the operations of FOLD mode's in-register merge, so every path
// gives the same bits. Only when loads are issued differs between them, never the fold order.
#pragma once
#include "tik_attention_common.cuh"

namespace tik_attn {

// attn_merge_kernel: the SPLIT-mode merge after attn_kernel. One CTA of D threads per row
// (grid total_q * Hq), thread d owns output column d; nc = ws_nc[row] (attn_kernel stores it; rows
// it never reached keep the caller's 0 and are left untouched). bf16 out, D in {64, 128}.
template <int D>
__global__ void __launch_bounds__(D) attn_merge_kernel(const TikAttnParams p) {
  const int64_t row = blockIdx.x;
  const int d = threadIdx.x;
  const int nc = p.ws_nc[row];
  if (nc <= 0) return;
  const int maxc = max_chunks_of(p);
  float M = -CUDART_INF_F, L = 0.f, O = 0.f;
  for (int c = 0; c < nc; ++c) {
    const int64_t base = row * maxc + c;
    float ca, cb;
    merge_coeffs(M, L, p.ws_ml[base * 2], p.ws_ml[base * 2 + 1], ca, cb);
    O = merge_val(O, p.ws_acc[base * D + d], ca, cb);
  }
  static_cast<bf16*>(p.out)[row * D + d] = __float2bfloat16_rn(__fdiv_rn(O, L));
}

// decode_merge_tile: the fused decode merge, run inside attn_decode_kernel by the one CTA that drew
// a tile's last ticket: every valid row of the tile (rows row0 .. row0 + nrows - 1 of the sequence
// starting at token q0, KV head hk) is folded over its chunks 0 .. nc-1, nc = its last position /
// SPLIT + 1. Work item = (row, 4 consecutive columns), strided over the CTA's threads; per element
// the operations of attn_decode_merge_kernel. Partials are read with ld.global.cg (L2: never a stale
// L1 line of another CTA's stores), DEC_FUSED_PF chunks in flight per thread (8: at 16 the D = 128
// decode kernel spills under its three-CTAs-per-SM register bound).
template <int D>
__device__ __forceinline__ void decode_merge_tile(const TikAttnParams& p, int row0, int nrows, int G, int q0,
                                                  int pos_off, int hk, int maxc) {
  constexpr int Q4 = D / 4;
  constexpr int DEC_FUSED_PF = 8;
  bf16* out = static_cast<bf16*>(p.out);
  for (int it = threadIdx.x; it < nrows * Q4; it += DEC_WARPS * 32) {
    const int r = row0 + it / Q4, dq = it % Q4;
    const int j = r / G;
    const int pos = pos_off + j;
    if (pos < 0) continue;  // not a valid row: nothing stored, nothing written (as the merge kernel)
    const int64_t rowid = (int64_t)(q0 + j) * p.Hq + (int64_t)hk * G + r % G;
    const int nc = min(pos / SPLIT + 1, maxc);
    float M = -CUDART_INF_F, L = 0.f;
    float O[4] = {0.f, 0.f, 0.f, 0.f};
    for (int c0 = 0; c0 < nc; c0 += DEC_FUSED_PF) {
      const int n = min(DEC_FUSED_PF, nc - c0);
      float2 mlv[DEC_FUSED_PF];
      float4 av[DEC_FUSED_PF];
#pragma unroll
      for (int u = 0; u < DEC_FUSED_PF; ++u) {
        if (u < n) {
          const int64_t base = rowid * maxc + c0 + u;
          mlv[u] = __ldcg(reinterpret_cast<const float2*>(p.ws_ml + base * 2));
          av[u] = __ldcg(reinterpret_cast<const float4*>(p.ws_acc + base * D) + dq);
        }
      }
#pragma unroll
      for (int u = 0; u < DEC_FUSED_PF; ++u) {
        if (u < n) {
          float ca, cb;
          merge_coeffs(M, L, mlv[u].x, mlv[u].y, ca, cb);
          O[0] = merge_val(O[0], av[u].x, ca, cb);
          O[1] = merge_val(O[1], av[u].y, ca, cb);
          O[2] = merge_val(O[2], av[u].z, ca, cb);
          O[3] = merge_val(O[3], av[u].w, ca, cb);
        }
      }
    }
    uint32_t* o32 = reinterpret_cast<uint32_t*>(out + rowid * D + dq * 4);
    o32[0] = pack_bf16(__fdiv_rn(O[0], L), __fdiv_rn(O[1], L));
    o32[1] = pack_bf16(__fdiv_rn(O[2], L), __fdiv_rn(O[3], L));
  }
}

// attn_decode_merge_kernel: the SPLIT-mode merge after a decode launch without tile counters (the
// two-launch path). One CTA of D threads per row of [total_q * Hq], thread d owns column d. The chunk
// count is derived from the sequence metadata (cu_seqlens_q, seqlens_k: last position / SPLIT + 1,
// capped at max_chunks_of), so no ws_nc buffer or memset is needed; rows outside every sequence, past
// the decode kernel's 16-row tiles or at negative positions are left untouched. Partials are
// prefetched DEC_MERGE_PF chunks at a time. bf16 out, D in {64, 128}.
constexpr int DEC_MERGE_PF = 16;

template <int D>
__global__ void __launch_bounds__(D) attn_decode_merge_kernel(const TikAttnParams p) {
  const int64_t row = blockIdx.x;
  const int d = threadIdx.x;
  const int token = (int)(row / p.Hq);
  const int hq = (int)(row % p.Hq);
  const int* cu = p.cu_seqlens_q;
  if (token < cu[0] || token >= cu[p.batch]) return;  // padding rows: left untouched
  int lo = 0, hi = p.batch;                             // largest b with cu[b] <= token
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (cu[mid] <= token) lo = mid;
    else hi = mid;
  }
  const int b = lo;
  const int nq = cu[b + 1] - cu[b];
  const int j = token - cu[b];
  const int G = p.Hq / p.Hkv;
  const int rows_launched = ((p.max_seqlen_q * G + 15) / 16) * 16;  // decode kernel tiles rows by 16
  if ((int64_t)j * G + hq % G >= rows_launched) return;
  const int kv_len = p.paged ? p.seqlens_k[b] : nq;
  const int pos = kv_len - nq + j;
  if (pos < 0) return;
  const int maxc = max_chunks_of(p);
  const int nc = min(pos / SPLIT + 1, maxc);
  float M = -CUDART_INF_F, L = 0.f, O = 0.f;
  for (int c0 = 0; c0 < nc; c0 += DEC_MERGE_PF) {
    const int n = min(DEC_MERGE_PF, nc - c0);
    float mv[DEC_MERGE_PF], lv[DEC_MERGE_PF], av[DEC_MERGE_PF];
#pragma unroll
    for (int u = 0; u < DEC_MERGE_PF; ++u) {
      if (u < n) {
        const int64_t base = row * maxc + c0 + u;
        mv[u] = p.ws_ml[base * 2];
        lv[u] = p.ws_ml[base * 2 + 1];
        av[u] = p.ws_acc[base * D + d];
      }
    }
#pragma unroll
    for (int u = 0; u < DEC_MERGE_PF; ++u) {
      if (u < n) {
        float ca, cb;
        merge_coeffs(M, L, mv[u], lv[u], ca, cb);
        O = merge_val(O, av[u], ca, cb);
      }
    }
  }
  static_cast<bf16*>(p.out)[row * D + d] = __float2bfloat16_rn(__fdiv_rn(O, L));
}

}  // namespace tik_attn
