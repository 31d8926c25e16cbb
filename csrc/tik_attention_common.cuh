// What every attention kernel shares: the bit-defining constants (KV block, split chunk), the
// mma.sync / ldmatrix / cp.async wrappers (sm_80+), and the per-row arithmetic: the online-softmax
// step of one KV block (scale_block, softmax_block) and the merge of a finished split chunk
// (merge_coeffs, merge_val, merge_chunk_row). Every kernel calls these same functions on the same
// values in the same order, which is what makes their outputs bit-identical (see tik_attention.cu).
// Values are in the m16n8 accumulator layout of mma.sync.m16n8k16: a thread holds two rows
// (lane / 4 and lane / 4 + 8 of a 16-row group), element e of n-tile nt belongs to row e >> 1.
#pragma once
#include "tik_api.h"

#include <cuda_bf16.h>
#include <math_constants.h>
#include <stdint.h>

namespace tik_attn {

constexpr int BN = TIK_ATTN_BLOCK_N;  // KV positions per block (blocks aligned to position 0)
constexpr int SPLIT = TIK_ATTN_SPLIT;  // KV positions per split chunk (chunks aligned to position 0)
constexpr int BPC = SPLIT / BN;        // blocks per chunk
static_assert(SPLIT % BN == 0, "split size must be a multiple of the KV block");
static_assert(BN % 16 == 0, "KV block must be a multiple of 16");

typedef __nv_bfloat16 bf16;

// 2^x, MUFU.EX2 (flush-to-zero): every exponential of the softmax.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// d += a * [b0; b1]: one m16n8k16 MMA step, bf16 operands, fp32 accumulator (the k-step of every S and P V
// chain on sm_80+).
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldmatrix x4 from shared memory, transposed (V fragments as the B operand of P V) and not transposed (K).
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

// 16-byte global -> shared copy; src_bytes < 16 zero-fills the rest (0: a zero segment, the source unread).
__device__ __forceinline__ void cp_async16(uint32_t saddr, const void* gptr, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(gptr), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Two fp32 values rounded to nearest bf16, packed (lo in the low half): P for P V, and the output.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Merge of chunk partial (m, l) into the running (M, L), giving the coefficients a (old state) and b
// (the chunk) that merge_val applies to each accumulator: the one formula every merge uses (FOLD in
// registers, every SPLIT merge kernel). Merging into the empty state (M = -inf) gives a = 0.
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

// The Q fragments of a thread's two rows (A operand of m16n8k16, row-major 16 x D, KC = D / 16 k-chunks),
// read from q [Tq * Hq, D] bf16 at rowid; zero for invalid rows. The decode and the prefill kernels load Q
// this one way.
template <int D, int KC>
__device__ __forceinline__ void load_q_frags(uint32_t (&qa)[KC][4], const void* q, const int64_t (&rowid)[2],
                                             const bool (&rvalid)[2], int t) {
  const uint32_t* qp0 = reinterpret_cast<const uint32_t*>(static_cast<const bf16*>(q) + (rvalid[0] ? rowid[0] : 0) * D);
  const uint32_t* qp1 = reinterpret_cast<const uint32_t*>(static_cast<const bf16*>(q) + (rvalid[1] ? rowid[1] : 0) * D);
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
    qa[kc][0] = rvalid[0] ? qp0[kc * 8 + t] : 0u;
    qa[kc][1] = rvalid[1] ? qp1[kc * 8 + t] : 0u;
    qa[kc][2] = rvalid[0] ? qp0[kc * 8 + 4 + t] : 0u;
    qa[kc][3] = rvalid[1] ? qp1[kc * 8 + 4 + t] : 0u;
  }
}

// The state a thread starts its KV walk with: the chunk state (acc = 0, m = -inf, l = 0) and, when the
// kernel merges chunks in registers (ZERO_O), the merged state (O = 0, M = -inf, L = 0). NDT n-tiles of 8.
template <int NDT, bool ZERO_O, int NO>
__device__ __forceinline__ void init_walk_state(float (&acc)[NDT][4], float (&m)[2], float (&l)[2],
                                                float (&O)[NO][4], float (&M)[2], float (&L)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    m[i] = -CUDART_INF_F;
    l[i] = 0.f;
    M[i] = -CUDART_INF_F;
    L[i] = 0.f;
  }
#pragma unroll
  for (int dt = 0; dt < NDT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[dt][e] = 0.f;
  if constexpr (ZERO_O) {
#pragma unroll
    for (int dt = 0; dt < NO; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) O[dt][e] = 0.f;
  }
}

// v[0] = op-tree of v[0 .. 2W): v[nt] = op(v[nt], v[nt + W]) for W, W / 2, .., 1, as a compile-time recursion
// (fully unrolled, so the values stay in registers; a rolled loop would put a 16-value tree in local memory).
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

// Split chunks of the longest KV sequence the launch allows (the stride of the SPLIT-mode workspace).
__host__ __device__ __forceinline__ int max_chunks_of(const TikAttnParams& p) {
  return (p.max_seqlen_k + SPLIT - 1) / SPLIT;
}

constexpr int DEC_WARPS = 4;  // warps of a decode CTA (attn_decode_kernel; the fused merge strides over them)

}  // namespace tik_attn
