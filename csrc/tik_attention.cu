// areal-tik causal attention over packed (varlen) or paged KV, bf16, D in {64, 128}.
//
// One kernel family serves attention_varlen (R1 training forward) and attention_paged
// (R2 prefill, R3 chunked prefill, R4 decode). The contract (DESIGN.md section 2,
// within this backend): for a query at absolute position p the output bits do not
// depend on batch mix, packing, page size, chunking or launch shape. How:
//   * a "row" is one (query token, query head). Rows are packed 16 per warp into the
//     M dimension of mma.sync.m16n8k16 (bf16 in, fp32 accumulate). The GQA group of one
//     KV head shares each CTA, so K/V are read once per group. An mma row's result
//     depends only on that row of A, B and the accumulator row, so which rows share a
//     warp never changes a row's bits.
//   * KV is walked in blocks of TIK_ATTN_BLOCK_N positions aligned to position 0,
//     ascending; S = Q K^T chains the D/16 k-steps ascending; the online softmax uses
//     only explicitly rounded fp32 ops (__fmul_rn/__fadd_rn/__fsub_rn/__fdiv_rn, no
//     contraction) and ex2.approx; P is rounded to bf16 for P V.
//   * Split-KV: positions are partitioned into chunks of TIK_ATTN_SPLIT (absolute,
//     fixed). Each chunk runs its own online softmax from a fresh state; the chunk
//     partials (m, l, acc) are merged in ascending chunk order by merge_coeffs /
//     merge_val. FOLD mode does that merge in registers as the walk passes each chunk
//     end; SPLIT mode stores each chunk's fp32 partial (a chunk per CTA, or in the decode
//     kernel possibly several chunks per CTA, each from a fresh state) and merges them with
//     the same scalar code. Both modes and both entry points give the same bits; AUTO picks
//     SPLIT for decode-shaped launches (FOLD when the caller asks for the rows' lse).
//   * Two kernels walk the rows: attn_kernel (4 warps, 16 rows each, 64 rows per CTA;
//     + attn_merge_kernel in SPLIT mode) for launches with max_seqlen_q * G > 16, and
//     attn_decode_kernel (4 warps sharing 16 rows, each computing a quarter of S's columns and
//     of the head dim; a CTA may walk several split chunks; SPLIT mode merges in the same
//     launch, by the CTA that finishes a tile's last chunk, or,
//     without a counter buffer, in attn_decode_merge_kernel: same operations) for
//     decode-shaped launches (max_seqlen_q * G <= 16).
//     The decode kernel repeats attn_kernel's per-row arithmetic op for op (see its
//     comment), so which kernel ran never changes a row's bits. On sm_90a, FOLD-mode launches
//     that are not decode-shaped run attn_kernel_wgmma (tik_attention_wgmma.cuh: the same
//     per-row arithmetic on warpgroup MMAs fed by TMA; TikAttnParams::prefill_kernel selects).
//   * K/V positions at or beyond the sequence's KV length are zero-filled (never read),
//     causal-masked scores are -inf, so cache garbage never reaches a result.
#include "tik_api.h"

#include <cuda.h>  // CUtensorMap (types only; the encoder comes from the runtime's driver entry point)
#include <cuda_bf16.h>
#include <math_constants.h>
#include <stdint.h>
#include <algorithm>
#include <type_traits>
#include <stdio.h>

namespace tik_attn {

constexpr int BN = TIK_ATTN_BLOCK_N;
constexpr int SPLIT = TIK_ATTN_SPLIT;
constexpr int BPC = SPLIT / BN;  // blocks per chunk
static_assert(SPLIT % BN == 0, "split size must be a multiple of the KV block");
static_assert(BN % 16 == 0, "KV block must be a multiple of 16");

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                              uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ void cp_async16(uint32_t saddr, const void* gptr, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(gptr), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Merge of chunk partial (m, l) into the running (M, L): the one formula every path uses.
__device__ __forceinline__ void merge_coeffs(float& M, float& L, float m, float l, float& a, float& b) {
  const float Mn = fmaxf(M, m);
  a = (M == -CUDART_INF_F) ? 0.f : ex2(__fsub_rn(M, Mn));
  b = ex2(__fsub_rn(m, Mn));
  L = __fadd_rn(__fmul_rn(L, a), __fmul_rn(l, b));
  M = Mn;
}
__device__ __forceinline__ float merge_val(float O, float acc, float a, float b) {
  return __fadd_rn(__fmul_rn(O, a), __fmul_rn(acc, b));
}
// A finished row's base-2 log-sum-exp (TikAttnParams::lse): not part of any output's bits.
__device__ __forceinline__ float row_lse(float M, float L) { return M + log2f(L); }
// FOLD merge of a finished chunk into one of a thread's two rows (i = 0, 1): (M, L) absorb the chunk's
// (m, l) and O its acc, in the m16n8 fragment layout (elements dt * 4 + 2i and dt * 4 + 2i + 1 of
// O and acc viewed flat), dt ascending. Used by attn_kernel, the decode kernel and the wgmma kernel.
template <int DT>
__device__ __forceinline__ void merge_chunk_row(float& M, float& L, float m, float l, float* O, const float* acc,
                                                int i) {
  float ca, cb;
  merge_coeffs(M, L, m, l, ca, cb);
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
    O[dt * 4 + 2 * i] = merge_val(O[dt * 4 + 2 * i], acc[dt * 4 + 2 * i], ca, cb);
    O[dt * 4 + 2 * i + 1] = merge_val(O[dt * 4 + 2 * i + 1], acc[dt * 4 + 2 * i + 1], ca, cb);
  }
}

// The two rows a thread holds in the m16n8 layout of a 16-row group starting at row r0 (row r0 + lane/4
// and r0 + lane/4 + 8, lane/4 passed as g): rows are (query token, query head of KV head hk's GQA
// group), r = token * G + head. A row is valid when it is inside the sequence's n_q * G rows and its
// absolute position pos_off + token is >= 0; rpos is that position (-1 if invalid), rlast its last
// SPLIT chunk (-1 if invalid), rowid its index into [Tq * Hq] (computed for invalid rows too).
__device__ __forceinline__ void thread_rows(const TikAttnParams& p, int r0, int g, int G, int rows_total,
                                            int pos_off, int q0, int hk, int (&rpos)[2], int (&rlast)[2],
                                            bool (&rvalid)[2], int64_t (&rowid)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = r0 + g + 8 * i;
    const int j = r / G;
    rvalid[i] = r < rows_total && pos_off + j >= 0;
    rpos[i] = rvalid[i] ? pos_off + j : -1;
    rlast[i] = rvalid[i] ? rpos[i] / SPLIT : -1;
    rowid[i] = (int64_t)(q0 + j) * p.Hq + (int64_t)hk * G + r % G;
  }
}

// v[0] = op-tree of v[0 .. 2W): v[nt] = op(v[nt], v[nt + W]) for W, W / 2, .., 1, as a compile-time recursion
// (a rolled halving loop put a 16-value tree in local memory, bench/results/*_s13-bn128-probe).
template <int W, typename Op>
__device__ __forceinline__ void halving_tree(float* v, Op op) {
#pragma unroll
  for (int nt = 0; nt < W; ++nt) v[nt] = op(v[nt], v[nt + W]);
  if constexpr (W > 1) halving_tree<W / 2>(v, op);
}
// One thread's values of its row i in the m16n8 accumulator layout (elements nt * 4 + 2i and + 1 of NT
// n-tiles) reduced by op as a tree: the pair of each n-tile, then halving over n-tiles.
template <int NT, typename Op>
__device__ __forceinline__ float row_tree(const float* s, int i, Op op) {
  float v[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) v[nt] = op(s[nt * 4 + 2 * i], s[nt * 4 + 2 * i + 1]);
  if constexpr (NT > 1) halving_tree<NT / 2>(v, op);
  return v[0];
}

// The online-softmax step of one KV block, the per-row arithmetic every attention kernel here
// shares (so one definition fixes the bits): s holds the block's scaled, masked scores in the
// m16n8 accumulator layout (NT n-tiles of 4: element e of tile nt belongs to row e >> 1), mx this
// thread's row maxima over them. Completes the row max over the quad (xor 1, 2), updates m, sets
// alpha = ex2(m_old - m_new), replaces s by P = ex2(s - m) and adds the row sum (this thread's 2 NT
// values of the row as a tree: the pair of each n-tile, then halving over n-tiles (nt + NT/2, ...);
// then xor 1, 2) to l scaled by alpha.
// NR = 1: only the thread's first row (g; the decode kernel's tiles of at most 8 rows, whose second
// rows g + 8 are all empty): the same operations on row g, none on row g + 8 (its s, m, l, alpha are
// left as they are).
template <int NT, int NR = 2>
__device__ __forceinline__ void softmax_block(float* s, float (&mx)[2], float (&m)[2], float (&l)[2],
                                              float (&alpha)[2]) {
  float muse[2];
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    const float mn = fmaxf(m[i], mx[i]);
    muse[i] = (mn == -CUDART_INF_F) ? 0.f : mn;
    alpha[i] = ex2(__fsub_rn(m[i], muse[i]));
    m[i] = mn;
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2 * NR; ++e) s[nt * 4 + e] = ex2(__fsub_rn(s[nt * 4 + e], muse[e >> 1]));
  float rs[2];
#pragma unroll
  for (int i = 0; i < NR; ++i)  // this thread's part of the row sum as a tree: depth log2(2 NT), not 2 NT
    rs[i] = row_tree<NT>(s, i, [](float a, float b) { return __fadd_rn(a, b); });
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    rs[i] = __fadd_rn(rs[i], __shfl_xor_sync(0xffffffffu, rs[i], 1));
    rs[i] = __fadd_rn(rs[i], __shfl_xor_sync(0xffffffffu, rs[i], 2));
    l[i] = __fadd_rn(__fmul_rn(l[i], alpha[i]), rs[i]);
  }
}

// Scores of one KV block (columns col0 + nt * 8 + 2t + (e & 1), m16n8 layout as softmax_block) into the
// log2 domain: s *= scale_log2, with MASK the causal select (a column past the row's position -> -inf),
// and this thread's row maxima over them, elements in order nt then e. NR as in softmax_block. Shared by
// attn_kernel and the decode kernel (the wgmma kernel takes its row max as a tree).
template <int NT, int NR = 2, bool MASK = true>
__device__ __forceinline__ void scale_block(float* s, int col0, int t, const int (&rpos)[2], float sl2,
                                            float (&mx)[2]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2 * NR; ++e) {
      const int i = e >> 1;
      const float v = (!MASK || col0 + nt * 8 + 2 * t + (e & 1) <= rpos[i]) ? __fmul_rn(s[nt * 4 + e], sl2)
                                                                           : -CUDART_INF_F;
      s[nt * 4 + e] = v;
      mx[i] = fmaxf(mx[i], v);
    }
}

__host__ __device__ __forceinline__ int max_chunks_of(const TikAttnParams& p) {
  return (p.max_seqlen_k + SPLIT - 1) / SPLIT;
}

template <int D>
constexpr int smem_bytes() {
  return 2 * 2 * BN * (D + 8) * 2;
}

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

  // Q fragments (A operand, row-major 16 x D), zero for invalid rows.
  uint32_t qa[KC][4];
  {
    const uint32_t* qp0 = reinterpret_cast<const uint32_t*>(static_cast<const bf16*>(p.q) + (rvalid[0] ? rowid[0] : 0) * D);
    const uint32_t* qp1 = reinterpret_cast<const uint32_t*>(static_cast<const bf16*>(p.q) + (rvalid[1] ? rowid[1] : 0) * D);
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
      qa[kc][0] = rvalid[0] ? qp0[kc * 8 + t] : 0u;
      qa[kc][1] = rvalid[1] ? qp1[kc * 8 + t] : 0u;
      qa[kc][2] = rvalid[0] ? qp0[kc * 8 + 4 + t] : 0u;
      qa[kc][3] = rvalid[1] ? qp1[kc * 8 + 4 + t] : 0u;
    }
  }

  // chunk state (online softmax within one split chunk)
  float acc[DT][4];
  float m[2], l[2];
  // merged state across chunks (FOLD mode)
  float O[SPLITM ? 1 : DT][4];
  float M[2], L[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    m[i] = -CUDART_INF_F;
    l[i] = 0.f;
    M[i] = -CUDART_INF_F;
    L[i] = 0.f;
  }
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[dt][e] = 0.f;
  if constexpr (!SPLITM) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) O[dt][e] = 0.f;
  }

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

// SPLIT mode: merge the chunk partials of one row in ascending chunk order.
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

}  // namespace tik_attn

#include "tik_attention_wgmma.cuh"

namespace tik_attn {

// Whether the current device runs attn_kernel_wgmma: compute capability 9.0, the module holds the
// sm_90a body (binaryVersion 90; an sm_80-only build has no wgmma code) and the driver has the
// TMA descriptor encoder. Per device.
typedef CUresult (*TensorMapEncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                         const cuuint64_t*, const cuuint32_t*, const cuuint32_t*,
                                         CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                         CUtensorMapFloatOOBfill);

TensorMapEncodeTiled tensor_map_encoder() {
  static TensorMapEncodeTiled fn = []() -> TensorMapEncodeTiled {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return nullptr;
    return reinterpret_cast<TensorMapEncodeTiled>(f);
  }();
  return fn;
}

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

// TMA descriptor of a K or V tensor viewed as [rows][Hkv][D] bf16 (rows = tokens or cache slots):
// boxes of 64 columns x 1 head x box_rows rows, 128-byte swizzle. False if the encoder refuses
// (e.g. a base address that is not 16-byte aligned).
bool make_kv_map(CUtensorMap* map, const void* base, int64_t rows, int hkv, int box_rows) {
  TensorMapEncodeTiled enc = tensor_map_encoder();
  if (enc == nullptr || rows <= 0 || rows > 0x7fffffffLL) return false;  // coordinates are int32
  const cuuint64_t dims[3] = {128, (cuuint64_t)hkv, (cuuint64_t)rows};
  const cuuint64_t strides[2] = {128 * 2, (cuuint64_t)hkv * 128 * 2};
  const cuuint32_t box[3] = {64, 1, (cuuint32_t)box_rows};
  const cuuint32_t estr[3] = {1, 1, 1};
  return enc(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides, box, estr,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// cudaErrorNotSupported when no TMA descriptor can be made, or when a box of box_rows cache rows
// could cross a page (page sizes that neither divide 64 nor are a multiple of it; the Python entry
// points accept only powers of two 16..256, the binding itself any size): the caller then runs
// attn_kernel, which looks up every row's page.
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

template <int D>
cudaError_t dispatch(const TikAttnParams& p, int mode, cudaStream_t stream) {
  if (D == 128 && use_wgmma(p, mode)) {
    const cudaError_t err = launch_wgmma(p, stream);
    if (err != cudaErrorNotSupported || p.prefill_kernel == TIK_ATTN_PREFILL_WGMMA) return err;
  }  // no TMA descriptor for these tensors: the mma.sync kernel (same bits)
  if (p.prefill_kernel == TIK_ATTN_PREFILL_WGMMA) return cudaErrorNotSupported;
  return mode == TIK_ATTN_SPLIT_MODE ? launch<D, 4, true>(p, stream) : launch<D, 4, false>(p, stream);
}

// ---------------------------------------------------------------------------------------
// Decode path (launches with at most 16 rows per KV head, i.e. max_seqlen_q * G <= 16).
// Same per-row arithmetic as attn_kernel, instruction for instruction on every value that
// reaches a row's result, so the bits are those of attn_kernel:
//   * 4 warps per CTA all hold the same 16 rows. Each computes S = Q K^T for a quarter of the
//     block's columns (each S value is attn_kernel's chain: kc ascending, same fragments), the
//     quarters are exchanged through shared memory (4 KB, one extra barrier per block), then
//     every warp runs the online softmax (m, l) for the whole block exactly as attn_kernel does
//     (redundantly), and P V only for its quarter of the head dim (D/4 output columns; an
//     output column's accumulator sees the same P, the same V column and the same k-step order).
//     (Until 2026-11-30 session 8 every warp computed all of S: four times the MMAs and K reads.)
//   * loader: 128 threads, cp.async; the page-table entries of the next block are loaded a block
//     ahead (registers, not waited for), so no copy waits for its page lookup; blocks inside one
//     page (contiguous K/V, pages of >= 64 rows) take one entry and constant row strides.
//   * 3-stage cp.async ring, or 2 stages at D = 128 where three CTAs per SM (which then fit) save a
//     wave (decode_auto_shape; decode_stages forces either), one barrier per block; K fragments by
//     ldmatrix.x4 (the values of 32-bit loads, four k-step halves per instruction).
//   * causal select only in blocks reaching past the tile's earliest row; tiles of at most 8 rows
//     (HALF) skip all work on each thread's empty second row.
//   * SPLIT mode: a CTA walks up to cpc chunks (decode_cpc, or decode_auto_shape) of the tile's chunks
//     that hold positions, strided over as few CTAs as cpc allows, each from a fresh state with its
//     own stored partial, exactly as cpc CTAs of one chunk each would.
//   * SPLIT mode, two launches (FUSED = false; kept as the reference path, selected when no
//     counter buffer is passed): the merge kernel prefetches the chunk partials 16 at a time
//     and folds them in the same ascending order with the same scalar code; it derives each
//     row's chunk count from cu_seqlens_q / seqlens_k, so no ws_nc memset node is needed.
//   * SPLIT mode, one launch (FUSED = true, the default when the caller passes p.counters):
//     - a tile whose rows all end in chunk 0 (one participating CTA) finalizes in registers:
//       merge_coeffs from the empty state (M = -inf, L = 0, O = 0) then O / L, i.e. the merge
//       kernel's arithmetic for one partial (and FOLD mode's at the end of chunk 0);
//     - otherwise every participating chunk CTA stores its partials as in the two-launch
//       path, then a barrier, one thread's __threadfence and one atomicAdd on the tile's counter; the CTA
//       that draws the last ticket resets the counter to 0 (so the next launch, e.g. a
//       CUDA-graph replay, starts from 0 without a memset) and merges each of the tile's rows
//       over chunks 0..nc-1 ascending with merge_coeffs / merge_val, then O / L rounded once
//       to bf16, exactly the merge kernel's per-element operations. Which CTA draws the last
//       ticket changes who merges, never the operations or their order, so the bits are
//       those of the two-launch path. Partials are read with ld.global.cg (L2, never a
//       stale L1 line). The counters are shared by every launch on the device: fused launches
//       on one device must not overlap in time (one stream at a time, as the engine runs).
// ---------------------------------------------------------------------------------------
constexpr int DEC_WARPS = 4;
// cp.async ring depth of the decode kernel (a template parameter; launch_decode picks): 3 stages
// (more prefetch per CTA) for small grids, 2 at D = 128 when the grid exceeds four CTAs per SM
// (2 x 35 KB + the 4 KB S exchange: three CTAs per SM, where three stages fit two). Changes timing only,
// not bits; TikAttnParams::decode_stages forces either (session 8: 3 stages within 3% at large grids,
// 4 stages 20-50% slower). Session 11 (bench/results/*_s11-*): in the bandwidth cells the kernel is
// loader-bound (no compute: 1.5% faster) at ~3.6 TB/s; 4- or 6-stage rings at one CTA per SM, 8-32 chunks
// per CTA, L2 prefetch hints and head-major addressing move it by at most 2%. A bare cp.async ring is ~4%
// faster (bench/probe_load_paths.py), 16 KB bulk copies of head-major pages ~10%; SDPA ~20%.
constexpr int DEC_STAGES_DEEP = 3;
constexpr int DEC_STAGES_WIDE = 2;
// chunk partials in flight per thread in the fused merge: 8 (session 8: 16 at D = 128 spilled once
// the S exchange and the per-chunk partial stores joined the kernel under its 3-CTAs-per-SM register
// bound). The prefetch depth changes only when loads are issued, not the fold order or its operations.
// (Set in decode_merge_tile as DEC_FUSED_PF.)

// Fused decode merge, run by the one CTA that drew a tile's last ticket: every valid row of
// the tile (rows row0 .. row0 + nrows - 1 of sequence b / KV head hk) is folded over its
// chunks 0..nc-1 in ascending order. Thread work item = (row, 4 consecutive columns); per
// element the operations are attn_decode_merge_kernel's (merge_coeffs per chunk, merge_val,
// __fdiv_rn(O, L), round to nearest bf16).
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

template <int D, int STAGES>
constexpr int decode_smem_bytes() {
  return STAGES * 2 * BN * (D + 8) * 2 + BN * 16 * 4;  // K/V ring + the S exchange (16 rows x BN fp32)
}
// TMA loader (sm_90a, D = 128): a stage is K then V, each two 64-column halves of BN rows in the 128-byte
// swizzle (no padding), + the S exchange, one mbarrier per stage, 1024-byte alignment. Measured on the H200
// (bench/results/2026-11-30T1825_*): same bits as the cp.async loader, 4.5-17% faster with pages of 64 (16 x 8K
// 150 -> 143.5 us, 64 x 550 at the 1.5B shape 15.7 -> 13.3 us), 2% slower with pages of 16 (4 boxes per
// block), so by default it serves boxes of at least TIK_DECODE_TMA_MIN_ROWS rows.
#ifndef TIK_DECODE_TMA
#define TIK_DECODE_TMA 1
#endif
#ifndef TIK_DECODE_TMA_MIN_ROWS
#define TIK_DECODE_TMA_MIN_ROWS 64
#endif
constexpr int DEC_TMA_STAGE_BYTES = 4 * BN * 128;
template <int STAGES>
constexpr int decode_tma_smem_bytes() {
  return STAGES * DEC_TMA_STAGE_BYTES + BN * 16 * 4 + 8 * STAGES + 1024;
}

// Split chunks per decode CTA in SPLIT mode (p.decode_cpc, or picked from the grid), and the CTAs per 16-row tile.
__host__ __device__ __forceinline__ int decode_ctas_per_tile(int maxc, int cpc) { return (maxc + cpc - 1) / cpc; }

// HALF: launches of at most 8 rows per KV head (max_seqlen_q * G <= 8: one-query decode with up to 8
// query heads per KV head), so a thread's second row (g + 8) is always empty; the kernel then skips
// every operation on it (softmax, alpha scaling, the exchange of its scores), leaving row g's operations
// as they are.
// TMA (sm_90a, D = 128): K/V blocks arrive by TMA boxes (thread 0, one mbarrier per stage) in the 128-byte
// swizzle instead of cp.async into padded rows; ldmatrix reads the same values from the swizzled addresses,
// V rows at or past kv_len are zeroed after landing (the cp.async zero-fill), K rows there stay unloaded or
// stale: every such column is past every valid row's position, so the causal select replaces its score.
template <int D, bool SPLITM, bool FUSED = false, int DEC_STAGES = DEC_STAGES_DEEP, bool HALF = false, bool TMA = false>
__global__ void __launch_bounds__(DEC_WARPS * 32, 3) attn_decode_kernel(const TikAttnParams p, int cpc,
                                                                        const __grid_constant__ CUtensorMap tm_k,
                                                                        const __grid_constant__ CUtensorMap tm_v,
                                                                        int box_rows) {
  static_assert(!TMA || D == 128, "the TMA loader serves D = 128");
  static_assert(SPLITM || !FUSED, "the fused merge exists only in SPLIT mode");
  constexpr int NR = HALF ? 1 : 2;  // rows per thread that can hold a query
  constexpr int NT = BN / 8;
  constexpr int KC = D / 16;
  constexpr int DT = D / 8;
  constexpr int DTW = DT / DEC_WARPS;  // output n-tiles per warp
  constexpr int NTW = NT / DEC_WARPS;  // S n-tiles per warp
  constexpr int NPW = DTW / 2;         // 16-column V k-step pairs per warp
  constexpr int LDS = D + 8;
  constexpr int NTH = DEC_WARPS * 32;
  constexpr int SEGS = D / 8;
  constexpr int PER_T = BN * SEGS / NTH;  // 16-byte segments per thread per tile
  constexpr int RSTEP = NTH / SEGS;       // row step between a thread's segments
  static_assert(DTW % 2 == 0 && DTW >= 2, "head dim split needs an even number of n-tiles per warp");
  static_assert(NT % DEC_WARPS == 0, "S column split needs whole n-tiles per warp");
  static_assert((BN * SEGS) % NTH == 0 && NTH % SEGS == 0, "loader shape");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Ks = reinterpret_cast<bf16*>(smem_raw);   // [STAGES][BN][LDS]
  bf16* Vs = Ks + DEC_STAGES * BN * LDS;          // [STAGES][BN][LDS]
  // TMA: the ring from the first 1024-byte boundary, then the S exchange, then the stages' mbarriers
  const uint32_t raw_s = (uint32_t)__cvta_generic_to_shared(smem_raw);
  const uint32_t tbase = TMA ? ((raw_s + 1023u) & ~1023u) : raw_s;
  float4* Sx = TMA ? reinterpret_cast<float4*>(smem_raw + (tbase - raw_s) + DEC_STAGES * DEC_TMA_STAGE_BYTES)
                   : reinterpret_cast<float4*>(Vs + DEC_STAGES * BN * LDS);  // [NT][32 lanes]: S fragments
  [[maybe_unused]] const uint32_t bars = tbase + (uint32_t)(DEC_STAGES * DEC_TMA_STAGE_BYTES + BN * 16 * 4);

  const int b = blockIdx.z, hk = blockIdx.y, bx = blockIdx.x;
  const int G = p.Hq / p.Hkv;
  // SPLIT mode: a tile has cpt = ceil(maxc / cpc) CTAs, but only its nct chunks that hold positions
  // (nct <= maxc: block tables are sized for longer contexts) are walked: by its first
  // w = ceil(nct / cpc) CTAs (as few as consecutive runs of cpc would use), CTA k taking chunks k,
  // k + w, k + 2w, ... (at most cpc, and as even a share as w CTAs allow), each through one ring from a
  // fresh state, storing its own partial, exactly as if it had its own CTA: which CTA walks a chunk
  // changes no bit. The other CTAs exit. cpc = 1 is one CTA per chunk.
  int tile, ck = 0;
  if (SPLITM) {
    const int cpt = decode_ctas_per_tile(max_chunks_of(p), cpc);
    tile = bx / cpt;
    ck = bx % cpt;
  } else {
    tile = bx;
  }
  const int q0 = p.cu_seqlens_q[b];
  const int nq = p.cu_seqlens_q[b + 1] - q0;
  const int kv_len = p.paged ? p.seqlens_k[b] : nq;
  const int rows_total = nq * G;
  const int row0 = tile * 16;
  if (row0 >= rows_total) return;
  const int pos_off = kv_len - nq;
  const int last_row = min(rows_total, row0 + 16) - 1;
  const int tile_max_pos = pos_off + last_row / G;
  if (tile_max_pos < 0) return;
  const int nblk = tile_max_pos / BN + 1;
  // chunks (= participating partials) of this tile: chunk c has blocks iff c * SPLIT <= tile_max_pos,
  // capped by maxc (the merge kernel caps nc the same way)
  const int nct = SPLITM ? min(tile_max_pos / SPLIT + 1, max_chunks_of(p)) : 1;
  // Steps s = 0 .. ns - 1 of this CTA's walk visit blocks blk(s): its n_my chunks ck, ck + w, ...
  // below nct, BPC blocks each but the tile's last (ending at nblk). FOLD mode: all nblk blocks in order.
  int n_my = 1, ns = nblk, cstride = 1;
  if (SPLITM) {
    cstride = (nct + cpc - 1) / cpc;  // w: the working CTAs of this tile
    if (ck >= cstride) return;
    n_my = (nct - ck + cstride - 1) / cstride;  // <= cpc
    const int c_last = ck + (n_my - 1) * cstride;
    ns = (n_my - 1) * BPC + min(nblk, (c_last + 1) * BPC) - c_last * BPC;
  }
  auto blk = [&](int s) { return SPLITM ? (ck + (s / BPC) * cstride) * BPC + s % BPC : s; };

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int wrow0 = row0;  // every warp holds the same 16 rows
  const int warp_max_pos = pos_off + (min(rows_total, wrow0 + 16) - 1) / G;
  const int dt0 = warp * DTW;  // first output n-tile of this warp
  const int tile_min_pos = pos_off + row0 / G;  // position of the tile's first (earliest) row

  int rpos[2], rlast[2];
  bool rvalid[2];
  int64_t rowid[2];
  thread_rows(p, wrow0, g, G, rows_total, pos_off, q0, hk, rpos, rlast, rvalid, rowid);
  if (HALF) {  // the launcher guarantees rows_total <= 8: row g + 8 is empty
    rvalid[1] = false;
    rpos[1] = -1;
    rlast[1] = -1;
  }

  uint32_t qa[KC][4];
  {
    const uint32_t* qp0 = reinterpret_cast<const uint32_t*>(static_cast<const bf16*>(p.q) + (rvalid[0] ? rowid[0] : 0) * D);
    const uint32_t* qp1 = reinterpret_cast<const uint32_t*>(static_cast<const bf16*>(p.q) + (rvalid[1] ? rowid[1] : 0) * D);
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
      qa[kc][0] = rvalid[0] ? qp0[kc * 8 + t] : 0u;
      qa[kc][1] = rvalid[1] ? qp1[kc * 8 + t] : 0u;
      qa[kc][2] = rvalid[0] ? qp0[kc * 8 + 4 + t] : 0u;
      qa[kc][3] = rvalid[1] ? qp1[kc * 8 + 4 + t] : 0u;
    }
  }

  float acc[DTW][4];
  float m[2], l[2];
  float O[SPLITM ? 1 : DTW][4];
  float M[2], L[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    m[i] = -CUDART_INF_F;
    l[i] = 0.f;
    M[i] = -CUDART_INF_F;
    L[i] = 0.f;
  }
#pragma unroll
  for (int dt = 0; dt < DTW; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[dt][e] = 0.f;
  if constexpr (!SPLITM) {
#pragma unroll
    for (int dt = 0; dt < DTW; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) O[dt][e] = 0.f;
  }

  const bf16* kg0 = static_cast<const bf16*>(p.k);
  const bf16* vg0 = static_cast<const bf16*>(p.v);
  const int64_t kv_base = p.paged ? 0 : (int64_t)q0;
  const int* bt_row = p.paged ? p.block_table + (int64_t)b * p.max_pages : nullptr;
  const int lr0 = threadIdx.x / SEGS, ls = threadIdx.x % SEGS;
  const uint32_t ks_s = (uint32_t)__cvta_generic_to_shared(Ks), vs_s = (uint32_t)__cvta_generic_to_shared(Vs);

  // The page-table entries of block j + 1 are loaded (into registers, not waited for) right after block
  // j's copies are issued, so the copies of a block never wait for its page lookups (H200, session 8:
  // before this a decode CTA took ~2 us per 64-position block, with the page-table round trip and
  // ~860 instructions per warp, mostly address arithmetic, on its path).
  // Three loaders behind one uniform branch:
  //   * blocks that lie in one page (contiguous K/V, or power-of-two pages of at least BN rows): one
  //     page-table entry per block, and a thread's PER_T rows are a constant stride apart;
  //   * power-of-two pages of RSTEP .. BN / 2 rows (16 and 32 at D = 128; the engine's default is 16):
  //     the entries are the same for every thread (small_pages below). H200, session 9, 12/2 heads,
  //     pages of 16: 2-23% faster than the per-row loader (B=16 ctx 550 13.1 -> 10.6 us);
  //   * otherwise (a size the binding accepts that is no power of two) one entry per row.
  int pg[PER_T];  // next block's pages of this thread's rows (pg[0] only on the one-page path)
  const int ps = p.paged ? p.page_size : BN;
  const bool ps_pow2 = (ps & (ps - 1)) == 0;
  const bool one_page = !p.paged || (ps_pow2 && ps >= BN);
  // Power-of-two pages of RSTEP .. BN / 2 rows (16 and 32 at D = 128): a thread's rows lr0 + u * RSTEP
  // (lr0 < RSTEP) share the page of position u * RSTEP, so its page-table entries are the same for every
  // thread (one broadcast load each) and its in-page row offsets are constants per u.
  const bool small_pages = p.paged && ps_pow2 && ps >= RSTEP && ps < BN;
  const int ps_shift = __ffs(ps) - 1;
  const int row_elems = p.Hkv * D;
  const int64_t page_elems = (int64_t)ps * row_elems;
  const int col0 = hk * D + ls * 8;
  const int64_t rstep_elems = (int64_t)RSTEP * row_elems;
  auto fetch_pages = [&](int j) {
    if (!p.paged || j < 0) return;
    if (one_page) {
      pg[0] = __ldg(bt_row + ((j * BN) >> ps_shift));
    } else if (small_pages) {  // row u of every thread lies in the page of position j * BN + u * RSTEP
#pragma unroll
      for (int u = 0; u < PER_T; ++u) {
        const int pos = j * BN + u * RSTEP;
        pg[u] = pos < kv_len ? __ldg(bt_row + (pos >> ps_shift)) : 0;
      }
    } else {
#pragma unroll
      for (int u = 0; u < PER_T; ++u) {
        const int pos = j * BN + lr0 + u * RSTEP;
        pg[u] = pos < kv_len ? __ldg(bt_row + (ps_pow2 ? pos >> ps_shift : pos / ps)) : 0;
      }
    }
  };
  auto issue_tile = [&](int j, int buf) {  // the copies of block j (zero-fill past kv_len, as attn_kernel)
    const uint32_t so0 = (uint32_t)(((buf * BN + lr0) * LDS + ls * 8) * 2);
    if (one_page) {
      const int pos0 = j * BN;
      const int64_t row0e = p.paged ? (int64_t)pg[0] * ps + (ps_pow2 ? pos0 & (ps - 1) : 0) : kv_base + pos0;
      const bf16* kp = kg0 + (row0e + lr0) * row_elems + col0;
      const bf16* vp = vg0 + (row0e + lr0) * row_elems + col0;
      const bool full = pos0 + BN <= kv_len;
#pragma unroll
      for (int u = 0; u < PER_T; ++u) {
        const bool ok = full || pos0 + lr0 + u * RSTEP < kv_len;
        const uint32_t so = so0 + (uint32_t)(u * RSTEP * LDS * 2);
        cp_async16(ks_s + so, ok ? kp + u * rstep_elems : kg0, ok ? 16 : 0);
        cp_async16(vs_s + so, ok ? vp + u * rstep_elems : vg0, ok ? 16 : 0);
      }
    } else if (small_pages) {
      const int pos0 = j * BN;
      const bool full = pos0 + BN <= kv_len;
      const int64_t thr = (int64_t)lr0 * row_elems + col0;
#pragma unroll
      for (int u = 0; u < PER_T; ++u) {
        const bool ok = full || pos0 + lr0 + u * RSTEP < kv_len;
        const int64_t o = (int64_t)pg[u] * page_elems + (int64_t)(((u * RSTEP) & (ps - 1)) * row_elems) + thr;
        const uint32_t so = so0 + (uint32_t)(u * RSTEP * LDS * 2);
        cp_async16(ks_s + so, ok ? kg0 + o : kg0, ok ? 16 : 0);
        cp_async16(vs_s + so, ok ? vg0 + o : vg0, ok ? 16 : 0);
      }
    } else {
#pragma unroll
      for (int u = 0; u < PER_T; ++u) {
        const int pos = j * BN + lr0 + u * RSTEP;
        const bool ok = pos < kv_len;
        const int64_t o = ok ? (int64_t)pg[u] * page_elems + (int64_t)((ps_pow2 ? pos & (ps - 1) : pos % ps) * row_elems + col0)
                             : 0;
        const uint32_t so = so0 + (uint32_t)(u * RSTEP * LDS * 2);
        cp_async16(ks_s + so, kg0 + o, ok ? 16 : 0);
        cp_async16(vs_s + so, vg0 + o, ok ? 16 : 0);
      }
    }
  };

  // TMA: block j -> stage buf (thread 0), by the wgmma prefill's tma_kv_block on this kernel's ring.
  auto tma_tile = [&](int j, int buf) {
#ifdef TIK_SM90A_DEVICE
    tma_kv_block(tbase + (uint32_t)(buf * DEC_TMA_STAGE_BYTES), bars + 8 * buf, &tm_k, &tm_v, hk, j, box_rows, kv_len,
                 [&](int pos) -> int64_t {
                   return p.paged ? (int64_t)__ldg(bt_row + (pos >> ps_shift)) * ps + (pos & (ps - 1)) : kv_base + pos;
                 });
#endif
  };

  const float sl2 = p.scale_log2;
  if constexpr (TMA) {
#ifdef TIK_SM90A_DEVICE
    if (threadIdx.x == 0) {
      for (int s = 0; s < DEC_STAGES; ++s) mbar_init(bars + 8 * s, 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
      for (int s = 0; s < DEC_STAGES - 1 && s < ns; ++s) tma_tile(blk(s), s);
    }
    __syncthreads();  // barriers initialised before anyone waits on them
#endif
  } else {
    fetch_pages(blk(0));
#pragma unroll 1
    for (int s = 0; s < DEC_STAGES - 1; ++s) {
      if (s < ns) {
        issue_tile(blk(s), s);
        fetch_pages(s + 1 < ns ? blk(s + 1) : -1);
      }
      cp_async_commit();
    }
  }
  for (int st = 0; st < ns; ++st) {
    const int j = blk(st);
    const int buf = st % DEC_STAGES;
    if constexpr (TMA) {
#ifdef TIK_SM90A_DEVICE
      mbar_wait(bars + 8 * buf, (uint32_t)((st / DEC_STAGES) & 1));  // block j landed
      if (j * BN + BN > kv_len)  // V rows at or past kv_len -> 0 (the cp.async path's zero-fill)
        zero_v_rows(tbase + (uint32_t)(buf * DEC_TMA_STAGE_BYTES + WG_TILE_BYTES), kv_len - j * BN, threadIdx.x, NTH);
#endif
    } else {
      cp_async_wait<DEC_STAGES - 2>();  // tile j has landed (this thread's copies)
    }
    __syncthreads();                  // ... everyone's; and everyone is done with tile j-1
    {
      const int sn = st + DEC_STAGES - 1;
      if constexpr (TMA) {
        if (threadIdx.x == 0 && sn < ns) tma_tile(blk(sn), sn % DEC_STAGES);
      } else {
        if (sn < ns) {
          issue_tile(blk(sn), sn % DEC_STAGES);
          fetch_pages(sn + 1 < ns ? blk(sn + 1) : -1);
        }
        cp_async_commit();
      }
    }

    if (warp_max_pos >= j * BN) {
      const bf16* Vb = Vs + buf * BN * LDS;
      // S for this warp's NTW n-tiles only (the four warps hold the same rows, so S is split by
      // columns), then exchanged through shared memory: every warp reads back all of S in its
      // fragment layout. Each S value is the same chain as attn_kernel's (kc ascending from 0, same
      // A and B fragments); which warp computed it changes nothing.
      // K fragments by ldmatrix: one x4 load gives b0/b1 of k-steps 2kp and 2kp + 1 for n-tile nt
      // (the values attn_kernel reads with 32-bit loads).
      float so[NTW][4];
#pragma unroll
      for (int u = 0; u < NTW; ++u)
#pragma unroll
        for (int e = 0; e < 4; ++e) so[u][e] = 0.f;
      const uint32_t kbase = TMA ? tbase + (uint32_t)(buf * DEC_TMA_STAGE_BYTES + (lane & 7) * 128)
                                 : ks_s + (uint32_t)((buf * BN + (lane & 7)) * LDS * 2 + (lane >> 3) * 16);
#pragma unroll
      for (int kp = 0; kp < KC / 2; ++kp) {
#pragma unroll
        for (int u = 0; u < NTW; ++u) {
          const int nt = warp * NTW + u;
          uint32_t b0, b1, b2, b3;
          // TMA: row nt * 8 + (lane & 7) (its low 3 bits are lane & 7), 16-byte chunk (kp & 1) * 4 + (lane >> 3)
          // of half kp >> 1, swizzled by the row
          const uint32_t ka = TMA ? kbase + (uint32_t)((kp >> 1) * WG_HALF_BYTES + nt * 8 * 128 +
                                                       (((((kp & 1) << 2) + (lane >> 3)) ^ (lane & 7)) << 4))
                                  : kbase + (uint32_t)((nt * 8 * LDS + kp * 32) * 2);
          ldsm_x4(b0, b1, b2, b3, ka);
          mma16816(so[u], qa[2 * kp], b0, b1);
          mma16816(so[u], qa[2 * kp + 1], b2, b3);
        }
      }
      // One buffer is enough: block j + 1 writes it after the next top-of-block barrier, which
      // every warp reaches only after reading block j's S here.
      float s[NT][4];
      if constexpr (HALF) {  // row g only
        float2* Sx2 = reinterpret_cast<float2*>(Sx);
#pragma unroll
        for (int u = 0; u < NTW; ++u) Sx2[(warp * NTW + u) * 32 + lane] = make_float2(so[u][0], so[u][1]);
        __syncthreads();
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const float2 v2 = Sx2[nt * 32 + lane];
          s[nt][0] = v2.x;
          s[nt][1] = v2.y;
          s[nt][2] = 0.f;
          s[nt][3] = 0.f;
        }
      } else {
#pragma unroll
        for (int u = 0; u < NTW; ++u)
          Sx[(warp * NTW + u) * 32 + lane] = make_float4(so[u][0], so[u][1], so[u][2], so[u][3]);
        __syncthreads();
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const float4 v4 = Sx[nt * 32 + lane];
          s[nt][0] = v4.x;
          s[nt][1] = v4.y;
          s[nt][2] = v4.z;
          s[nt][3] = v4.w;
        }
      }
      float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
      // every column visible to every valid row: no select (a row past the sequence has zero Q, so its
      // unmasked scores are 0: finite, and never stored)
      if (j * BN + BN - 1 <= tile_min_pos) scale_block<NT, NR, false>(&s[0][0], j * BN, t, rpos, sl2, mx);
      else scale_block<NT, NR>(&s[0][0], j * BN, t, rpos, sl2, mx);
      float alpha[2];
      softmax_block<NT, NR>(&s[0][0], mx, m, l, alpha);
#pragma unroll
      for (int dt = 0; dt < DTW; ++dt)
#pragma unroll
        for (int e = 0; e < 2 * NR; ++e) acc[dt][e] = __fmul_rn(acc[dt][e], alpha[e >> 1]);
      const uint32_t vbase = (uint32_t)__cvta_generic_to_shared(Vb);
#pragma unroll
      for (int kc = 0; kc < BN / 16; ++kc) {
        uint32_t pa[4];
        pa[0] = pack_bf16(s[2 * kc][0], s[2 * kc][1]);
        pa[1] = HALF ? 0u : pack_bf16(s[2 * kc][2], s[2 * kc][3]);
        pa[2] = pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]);
        pa[3] = HALF ? 0u : pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3]);
#pragma unroll
        for (int npl = 0; npl < NPW; ++npl) {
          const int np = warp * NPW + npl;
          const int vr = kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
          const int vc = np * 16 + (lane >> 4) * 8;
          uint32_t r0, r1, r2, r3;
          // TMA: row vr (low 3 bits lane & 7), 16-byte chunk (np & 3) * 2 + (lane >> 4) of half np >> 2, swizzled
          const uint32_t va = TMA ? tbase + (uint32_t)(buf * DEC_TMA_STAGE_BYTES + 2 * WG_HALF_BYTES +
                                                       (np >> 2) * WG_HALF_BYTES + vr * 128 +
                                                       (((((np & 3) << 1) + (lane >> 4)) ^ (lane & 7)) << 4))
                                  : vbase + (uint32_t)((vr * LDS + vc) * 2);
          ldsm_x4_trans(r0, r1, r2, r3, va);
          mma16816(acc[2 * npl], pa, r0, r1);
          mma16816(acc[2 * npl + 1], pa, r2, r3);
        }
      }
    }

    // End of a chunk: SPLIT mode stores its partial (a tile with one chunk in all, in the fused launch,
    // keeps its state for the in-register finish below), FOLD mode merges it into (M, L, O); either way
    // the next chunk starts fresh.
    if (((st + 1) % BPC == 0 || st == ns - 1) && !(FUSED && nct == 1)) {
      const int c = j / BPC;
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        if constexpr (SPLITM) {
          if (rvalid[i] && c <= rlast[i]) {
            const int64_t base = rowid[i] * max_chunks_of(p) + c;
            float2* arow = reinterpret_cast<float2*>(p.ws_acc + base * D);
#pragma unroll
            for (int dt = 0; dt < DTW; ++dt) arow[(dt0 + dt) * 4 + t] = make_float2(acc[dt][2 * i], acc[dt][2 * i + 1]);
            if (warp == 0 && t == 0) {
              p.ws_ml[base * 2] = m[i];
              p.ws_ml[base * 2 + 1] = l[i];
            }
          }
        } else {
          if (c <= rlast[i]) merge_chunk_row<DTW>(M[i], L[i], m[i], l[i], &O[0][0], &acc[0][0], i);
        }
        m[i] = -CUDART_INF_F;
        l[i] = 0.f;
#pragma unroll
        for (int dt = 0; dt < DTW; ++dt) {
          acc[dt][2 * i] = 0.f;
          acc[dt][2 * i + 1] = 0.f;
        }
      }
    }
  }
  cp_async_wait<0>();  // drain (trailing groups are empty; keeps the exit clean)

  if constexpr (!SPLITM) {
    bf16* out = static_cast<bf16*>(p.out);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!rvalid[i]) continue;
      uint32_t* orow = reinterpret_cast<uint32_t*>(out + rowid[i] * D);
#pragma unroll
      for (int dt = 0; dt < DTW; ++dt)
        orow[(dt0 + dt) * 4 + t] = pack_bf16(__fdiv_rn(O[dt][2 * i], L[i]), __fdiv_rn(O[dt][2 * i + 1], L[i]));
      if (p.lse != nullptr && warp == 0 && t == 0) p.lse[rowid[i]] = row_lse(M[i], L[i]);
    }
  } else {
    const int maxc = max_chunks_of(p);
    if constexpr (FUSED) {
      if (nct == 1) {  // every row ends in chunk 0: the merge of one partial, in registers
        bf16* out = static_cast<bf16*>(p.out);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          if (!rvalid[i]) continue;
          float Mr = -CUDART_INF_F, Lr = 0.f, ca, cb;
          merge_coeffs(Mr, Lr, m[i], l[i], ca, cb);
          uint32_t* orow = reinterpret_cast<uint32_t*>(out + rowid[i] * D);
#pragma unroll
          for (int dt = 0; dt < DTW; ++dt)
            orow[(dt0 + dt) * 4 + t] = pack_bf16(__fdiv_rn(merge_val(0.f, acc[dt][2 * i], ca, cb), Lr),
                                                 __fdiv_rn(merge_val(0.f, acc[dt][2 * i + 1], ca, cb), Lr));
        }
        return;
      }
    }
    if constexpr (FUSED) {
      __shared__ int s_last;
      // Release: the barrier orders every thread's partial stores before thread 0's fence,
      // which makes them visible device-wide before the ticket (the pattern of cooperative
      // groups' grid sync: bar.sync, then one thread's fence + atomic). One fence per CTA
      // instead of one per thread.
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        int* ctr = p.counters + ((int64_t)b * gridDim.y + hk) * (int64_t)(gridDim.x / decode_ctas_per_tile(maxc, cpc)) +
                   tile;
        const int mine = n_my;  // chunks this CTA stored
        const int ticket = atomicAdd(ctr, mine);
        const int last = ticket + mine == nct;
        if (last) {
          atomicExch(ctr, 0);  // every CTA of the tile has drawn: ready for the next launch
          __threadfence();     // acquire side: the other CTAs' partials before our reads
        }
        s_last = last;
      }
      __syncthreads();
      if (!s_last) return;
      decode_merge_tile<D>(p, row0, min(rows_total, row0 + 16) - row0, G, q0, pos_off, hk, maxc);
    }
  }
}

// Decode merge: same ascending fold as attn_merge_kernel; partials prefetched 16 chunks
// at a time; chunk count recomputed from the sequence metadata (what attn_kernel stores in
// ws_nc: last position / SPLIT + 1 for a valid row, nothing otherwise).
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

// Counters the fused decode needs: one per (sequence, KV head, 16-row tile).
__host__ __device__ __forceinline__ int64_t decode_counters_needed(const TikAttnParams& p) {
  const int64_t rows = (int64_t)p.max_seqlen_q * (p.Hq / p.Hkv);
  return (int64_t)p.batch * p.Hkv * ((rows + 15) / 16);
}

template <int D, bool SPLITM, int STAGES, bool HALF, bool TMA>
cudaError_t launch_decode_kern(const TikAttnParams& p, int64_t gx, int cpc, cudaStream_t stream, const CUtensorMap& mk,
                               const CUtensorMap& mv, int box_rows) {
  constexpr int SMEM = TMA ? decode_tma_smem_bytes<STAGES>() : decode_smem_bytes<D, STAGES>();
  if (SPLITM && p.counters != nullptr && decode_counters_needed(p) <= p.counters_cap) {
    auto fk = attn_decode_kernel<D, true, true, STAGES, HALF, TMA>;  // one launch: merge in the last CTA of each tile
    cudaError_t e = cudaFuncSetAttribute(fk, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
    if (e != cudaSuccess) return e;
    fk<<<dim3((unsigned)gx, p.Hkv, p.batch), DEC_WARPS * 32, SMEM, stream>>>(p, cpc, mk, mv, box_rows);
    return cudaGetLastError();
  }
  auto kern = attn_decode_kernel<D, SPLITM, false, STAGES, HALF, TMA>;
  cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
  if (err != cudaSuccess) return err;
  kern<<<dim3((unsigned)gx, p.Hkv, p.batch), DEC_WARPS * 32, SMEM, stream>>>(p, cpc, mk, mv, box_rows);
  err = cudaGetLastError();
  if (err != cudaSuccess || !SPLITM) return err;
  attn_decode_merge_kernel<D><<<(unsigned)p.total_q * p.Hq, D, 0, stream>>>(p);
  return cudaGetLastError();
}

// The TMA loader where it can run (sm_90a, D = 128, TMA descriptors, power-of-two pages), else cp.async.
template <int D, bool SPLITM, int STAGES, bool HALF>
cudaError_t launch_decode_rows(const TikAttnParams& p, int64_t gx, int cpc, cudaStream_t stream) {
  CUtensorMap mk{}, mv{};
  if constexpr (D == 128) {
    if (TIK_DECODE_TMA && wgmma_prefill_available()) {
      const int box_rows = p.paged ? std::min(p.page_size, BN) : BN;
      const bool pow2 = !p.paged || (p.page_size > 0 && (p.page_size & (p.page_size - 1)) == 0);
      if (pow2 && box_rows >= TIK_DECODE_TMA_MIN_ROWS && BN % box_rows == 0 && make_kv_map(&mk, p.k, p.kv_rows, p.Hkv, box_rows) &&
          make_kv_map(&mv, p.v, p.kv_rows, p.Hkv, box_rows))
        return launch_decode_kern<D, SPLITM, STAGES, HALF, true>(p, gx, cpc, stream, mk, mv, box_rows);
    }
  }
  return launch_decode_kern<D, SPLITM, STAGES, HALF, false>(p, gx, cpc, stream, mk, mv, BN);
}

// Tiles of at most 8 rows (max_seqlen_q * G <= 8) run the HALF instantiation (same bits, less work).
template <int D, bool SPLITM, int STAGES>
cudaError_t launch_decode_stages(const TikAttnParams& p, int64_t gx, int cpc, cudaStream_t stream) {
  if ((int64_t)p.max_seqlen_q * (p.Hq / p.Hkv) <= 8) return launch_decode_rows<D, SPLITM, STAGES, true>(p, gx, cpc, stream);
  return launch_decode_rows<D, SPLITM, STAGES, false>(p, gx, cpc, stream);
}

int device_sm_count() {
  static int cached[64];
  return per_device_cached(cached, [](int dev) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n;
  });
}

// Chunks per CTA and ring depth when the caller leaves them to the launcher (timing only; every choice
// gives the same bits). A 3-stage D = 128 CTA takes 108 KB of shared memory (two per SM), a 2-stage one
// 72 KB (three per SM). For a grid of `tasks` chunk CTAs (H200, session 8, bench/results/
// *_decode-sx-mc-bisect, and session 9, *_engine-shape-bisect):
//   * one wave at two per SM: one chunk per CTA, 3 stages;
//   * one wave at three per SM (D = 128 only): one chunk per CTA, 2 stages. B=64 x ctx 550, 12/2 heads,
//     384 CTAs: 16.3 us, against 23.1 at 3 stages (two waves) and 22.0 at 2 chunks per CTA;
//   * else, when at most DEC_CPC_MAX chunks per CTA make one wave at two per SM: that many per CTA,
//     3 stages (B=16 ctx 1K 28.6 -> 26.3 us at 2 per CTA, B=4 ctx 8K 47.5 -> 46.3 at 4; B=128 ctx 550,
//     12/2 heads: 30.7 us at 3 per CTA, against 34.0 at 1 per CTA and 2 stages);
//   * else one chunk per CTA, and 2 stages for grids over four CTAs per SM (512 CTAs 0.91-0.92x,
//     1024+ CTAs 1.09-1.19x the 3-stage time). Grids of several waves gain nothing from several chunks
//     per CTA and lose up to 14% where the fewer CTAs leave a partial last wave.
constexpr int DEC_CPC_MAX = 4;
// The grid-size rule for the ring depth at D = 128: 2 stages past four CTAs per SM.
int decode_grid_stages(int64_t ctas) {
  return ctas > 4LL * device_sm_count() ? DEC_STAGES_WIDE : DEC_STAGES_DEEP;
}
struct DecodeShape {
  int cpc;
  int stages;
};
DecodeShape decode_auto_shape(int64_t tasks, int maxc, bool wide_ok) {
  const int64_t sms = device_sm_count();
  if (tasks <= 2 * sms) return {1, DEC_STAGES_DEEP};
  if (wide_ok && tasks <= 3 * sms) return {1, DEC_STAGES_WIDE};
  const int64_t c = (tasks + 2 * sms - 1) / (2 * sms);
  if (c <= DEC_CPC_MAX) return {(int)std::min<int64_t>(c, maxc), DEC_STAGES_DEEP};
  return {1, wide_ok ? decode_grid_stages(tasks) : DEC_STAGES_DEEP};
}

template <int D, bool SPLITM>
cudaError_t launch_decode(const TikAttnParams& p, cudaStream_t stream) {
  const int64_t rows = (int64_t)p.max_seqlen_q * (p.Hq / p.Hkv);
  const int64_t ntiles = (rows + 15) / 16;
  const int maxc = max_chunks_of(p);
  // Ring depth: only D = 128 has a 2-stage instantiation. A FOLD launch (one CTA per tile) or a forced
  // chunk count keeps the grid-size rule for the stages; decode_stages forces them.
  const bool wide_ok = D == 128 && p.decode_stages != DEC_STAGES_DEEP;
  DecodeShape sh{1, DEC_STAGES_DEEP};
  if (SPLITM && p.decode_cpc == 0) sh = decode_auto_shape(ntiles * maxc * p.Hkv * p.batch, maxc, wide_ok);
  if (SPLITM && p.decode_cpc > 0) sh.cpc = min(p.decode_cpc, maxc);
  const int cpc = sh.cpc;
  const int64_t gx = SPLITM ? ntiles * decode_ctas_per_tile(maxc, cpc) : ntiles;
  if (gx <= 0) return cudaSuccess;
  if (gx > 0x7fffffffLL || p.Hkv > 65535 || p.batch > 65535) return cudaErrorInvalidConfiguration;
  if constexpr (D == 128) {
    const int64_t ctas = gx * p.Hkv * p.batch;
    int st = p.decode_stages;
    if (st == 0) st = (SPLITM && p.decode_cpc == 0) ? sh.stages : decode_grid_stages(ctas);
    if (st == DEC_STAGES_WIDE) return launch_decode_stages<D, SPLITM, DEC_STAGES_WIDE>(p, gx, cpc, stream);
  }
  return launch_decode_stages<D, SPLITM, DEC_STAGES_DEEP>(p, gx, cpc, stream);
}

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

extern "C" {

int tik_attention_max_chunks(const TikAttnParams* p) { return tik_attn::max_chunks_of(*p); }

int tik_attention_wgmma_available(void) { return tik_attn::wgmma_prefill_available() ? 1 : 0; }

static bool tik_small(const TikAttnParams* p) { return (int64_t)p->max_seqlen_q * (p->Hq / p->Hkv) <= 16; }

int tik_attention_resolve_mode(const TikAttnParams* p) {
  if (p->mode == TIK_ATTN_FOLD || p->mode == TIK_ATTN_SPLIT_MODE) return p->mode;
  if (p->lse != nullptr) return TIK_ATTN_FOLD;  // the row's final (M, L) live in the FOLD walk's registers
  return (tik_small(p) && tik_attention_max_chunks(p) > 1) ? TIK_ATTN_SPLIT_MODE : TIK_ATTN_FOLD;
}

int64_t tik_attention_decode_counters_needed(const TikAttnParams* p) {
  if (tik_attention_resolve_mode(p) != TIK_ATTN_SPLIT_MODE || !tik_small(p)) return 0;  // no fused merge
  return tik_attn::decode_counters_needed(*p);
}

int tik_attention_needs_ws_nc(const TikAttnParams* p) {
  if (tik_attention_resolve_mode(p) != TIK_ATTN_SPLIT_MODE) return 0;
  return tik_small(p) ? 0 : 1;  // the decode merge derives chunk counts itself
}

int tik_attention(const TikAttnParams* p, cudaStream_t stream) {
  if (p == nullptr || p->Hkv <= 0 || p->Hq % p->Hkv != 0 || p->batch < 0 || p->max_seqlen_q < 0 ||
      p->max_seqlen_k < 0)
    return (int)cudaErrorInvalidValue;
  if (p->paged && (p->page_size <= 0 || p->max_pages <= 0 || p->block_table == nullptr || p->seqlens_k == nullptr))
    return (int)cudaErrorInvalidValue;
  if (p->batch == 0 || p->max_seqlen_q == 0) return (int)cudaSuccess;
  const int mode = tik_attention_resolve_mode(p);
  if (mode == TIK_ATTN_SPLIT_MODE && p->lse != nullptr) return (int)cudaErrorInvalidValue;
  if (mode == TIK_ATTN_SPLIT_MODE &&
      (p->ws_acc == nullptr || p->ws_ml == nullptr || (tik_attention_needs_ws_nc(p) && p->ws_nc == nullptr)))
    return (int)cudaErrorInvalidValue;
  if (p->prefill_kernel < TIK_ATTN_PREFILL_AUTO || p->prefill_kernel > TIK_ATTN_PREFILL_WGMMA)
    return (int)cudaErrorInvalidValue;
  if (tik_small(p)) {  // decode-shaped launch (same bits as attn_kernel)
    const bool sp = mode == TIK_ATTN_SPLIT_MODE;
    if (p->D == 64)
      return (int)(sp ? tik_attn::launch_decode<64, true>(*p, stream) : tik_attn::launch_decode<64, false>(*p, stream));
    if (p->D == 128)
      return (int)(sp ? tik_attn::launch_decode<128, true>(*p, stream) : tik_attn::launch_decode<128, false>(*p, stream));
    return (int)cudaErrorInvalidValue;
  }
  if (p->D == 64) return (int)tik_attn::dispatch<64>(*p, mode, stream);
  if (p->D == 128) return (int)tik_attn::dispatch<128>(*p, mode, stream);
  return (int)cudaErrorInvalidValue;
}

int tik_attention_describe(char* buf, int buflen) {
  using namespace tik_attn;
  int used = 0;
  if (buflen > 0) buf[0] = 0;
  describe_one(buf, buflen, used, "attn<D64,4warp,fold>", attn_kernel<64, 4, false>, smem_bytes<64>());
  describe_one(buf, buflen, used, "attn<D64,4warp,split>", attn_kernel<64, 4, true>, smem_bytes<64>());
  describe_one(buf, buflen, used, "attn<D128,4warp,fold>", attn_kernel<128, 4, false>, smem_bytes<128>());
  describe_one(buf, buflen, used, "attn<D128,4warp,split>", attn_kernel<128, 4, true>, smem_bytes<128>());
  describe_one(buf, buflen, used, "attn_decode<D64,4warp,fold>", attn_decode_kernel<64, false>,
               decode_smem_bytes<64, DEC_STAGES_DEEP>());
  describe_one(buf, buflen, used, "attn_decode<D64,4warp,split>", attn_decode_kernel<64, true>,
               decode_smem_bytes<64, DEC_STAGES_DEEP>());
  describe_one(buf, buflen, used, "attn_decode<D128,4warp,fold>", attn_decode_kernel<128, false>,
               decode_smem_bytes<128, DEC_STAGES_DEEP>());
  describe_one(buf, buflen, used, "attn_decode<D128,4warp,split>", attn_decode_kernel<128, true>,
               decode_smem_bytes<128, DEC_STAGES_DEEP>());
  describe_one(buf, buflen, used, "attn_decode<D64,4warp,split,fused>", attn_decode_kernel<64, true, true>,
               decode_smem_bytes<64, DEC_STAGES_DEEP>());
  describe_one(buf, buflen, used, "attn_decode<D128,4warp,split,fused>", attn_decode_kernel<128, true, true>,
               decode_smem_bytes<128, DEC_STAGES_DEEP>());
  describe_one(buf, buflen, used, "attn_decode<D128,4warp,split,fused,2stage>",
               attn_decode_kernel<128, true, true, DEC_STAGES_WIDE>, decode_smem_bytes<128, DEC_STAGES_WIDE>());
  describe_one(buf, buflen, used, "attn_decode<D128,4warp,split,fused,tma>",
               attn_decode_kernel<128, true, true, DEC_STAGES_DEEP, false, true>, decode_tma_smem_bytes<DEC_STAGES_DEEP>());
  describe_one(buf, buflen, used, "attn_decode<D128,4warp,split,fused,2stage,tma>",
               attn_decode_kernel<128, true, true, DEC_STAGES_WIDE, false, true>, decode_tma_smem_bytes<DEC_STAGES_WIDE>());
  describe_one(buf, buflen, used, "attn_decode_merge<D64>", attn_decode_merge_kernel<64>, 0);
  describe_one(buf, buflen, used, "attn_decode_merge<D128>", attn_decode_merge_kernel<128>, 0);
  describe_one(buf, buflen, used, "attn_wgmma<D128,2+1warpgroups,fold,tma>", attn_kernel_wgmma<128>, wg_smem_bytes());
  describe_one(buf, buflen, used, "attn_merge<D64>", attn_merge_kernel<64>, 0);
  describe_one(buf, buflen, used, "attn_merge<D128>", attn_merge_kernel<128>, 0);
  return used;
}

}  // extern "C"
