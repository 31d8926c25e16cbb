// Decode attention: launches of at most 16 rows per KV head (max_seqlen_q * G <= 16), i.e.
// attention_paged decode steps and short chunks. attn_decode_kernel and its launchers; the SPLIT-mode
// merges it uses are in tik_attention_merge.cuh.
//
// attn_decode_kernel repeats attn_kernel's per-row arithmetic instruction for instruction on every
// value that reaches a row's result, so its bits are attn_kernel's (the GPU tests compare them):
//   * 4 warps per CTA all hold the same 16 rows. Each computes S = Q K^T for a quarter of the
//     block's columns (each S value is attn_kernel's chain: k-steps ascending, same fragments), the
//     quarters are exchanged through shared memory (4 KB, one extra barrier per block), then every
//     warp runs the online softmax for the whole block exactly as attn_kernel does (redundantly),
//     and P V only for its quarter of the head dim (D/4 output columns; an output column's
//     accumulator sees the same P, the same V column and the same k-step order).
//   * Loader, cp.async: 128 threads; the page-table entries of the next block are loaded a block
//     ahead (registers, not waited for), so no copy waits for its page lookup; blocks inside one page
//     (contiguous K/V, pages of >= 64 rows) take one entry and constant row strides. K fragments by
//     ldmatrix.x4 (the values attn_kernel reads with 32-bit loads). A DEC_STAGES-deep ring, one
//     barrier per block.
//   * Loader, TMA (sm_90a, D = 128, power-of-two pages of >= TIK_DECODE_TMA_MIN_ROWS rows): thread 0
//     issues boxes by tma_kv_block into a swizzled ring, one mbarrier per stage; ldmatrix reads the same
//     values from the swizzled addresses. Same bits as the cp.async loader.
//   * The causal select runs only in blocks reaching past the tile's earliest row (elsewhere it would
//     select nothing); tiles of at most 8 rows (HALF) skip every operation on each thread's second
//     row, which is empty.
//   * SPLIT mode: a CTA walks up to cpc chunks of its tile's chunks that hold positions (strided over
//     as few CTAs as cpc allows), each from a fresh state with its own stored partial, exactly as cpc
//     CTAs of one chunk each would. Then either
//     - two launches (FUSED = false, when the caller passes no counter buffer): attn_decode_merge_kernel
//       folds the partials; or
//     - one launch (FUSED = true, when p.counters is large enough): a tile whose rows all end in chunk 0
//       finalizes in registers (merge_coeffs from the empty state, then O / L: the merge of one
//       partial, and FOLD mode's arithmetic at the end of chunk 0); otherwise each participating CTA
//       stores its partials, then a CTA barrier, one thread's __threadfence and one atomicAdd on the
//       tile's counter; the CTA that draws the last ticket resets the counter to 0 (so the next launch,
//       e.g. a CUDA-graph replay, starts from 0 without a memset) and merges the tile's rows with
//       decode_merge_tile. Which CTA draws the last ticket changes who merges, never the operations
//       or their order, so the bits are those of the two-launch path. The counters are shared by every
//       launch on the device: fused launches on one device must not overlap in time.
//   * Launch shape (chunks per CTA, ring depth, loader) changes timing only, never bits.

#include <algorithm>

#include "tik_attention_launch.h"
#include "tik_attention_merge.cuh"
#include "tik_attention_tma.cuh"

namespace tik_attn {

// cp.async ring depth (a template parameter; launch_decode picks): 3 stages (more prefetch per CTA) for
// small grids, 2 at D = 128 when the grid exceeds four CTAs per SM (2 x 35 KB + the 4 KB S exchange:
// three CTAs per SM, where three stages fit two); TikAttnParams::decode_stages forces either. On the
// H200 the large-grid cells are loader-bound at ~3.6 TB/s (skipping all compute is 1.5% faster), and
// 4-stage rings are 20-50% slower.
constexpr int DEC_STAGES_DEEP = 3;
constexpr int DEC_STAGES_WIDE = 2;

template <int D, int STAGES>
constexpr int decode_smem_bytes() {
  return STAGES * 2 * BN * (D + 8) * 2 + BN * 16 * 4;  // K/V ring + the S exchange (16 rows x BN fp32)
}
// TMA loader's shared memory (sm_90a, D = 128): a stage is K then V, each two 64-column halves of BN rows in
// the 128-byte swizzle (no padding), + the S exchange, one mbarrier per stage, 1024-byte alignment. On the
// H200 it is 4.5-17% faster than the cp.async loader with pages of 64 and 2% slower with pages of 16 (four
// boxes per block), hence TIK_DECODE_TMA_MIN_ROWS; TIK_DECODE_TMA=0 builds without it.
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

// attn_decode_kernel: causal attention of one 16-row tile (query token x query head of KV head
// blockIdx.y's GQA group, of sequence blockIdx.z) per CTA of DEC_WARPS = 4 warps; see the file header.
//   bf16 q/k/v/out, D in {64, 128} (TMA and DEC_STAGES = 2 only at D = 128), varlen or paged K/V with any
//   page size. Writes out (and p.lse in FOLD mode when set); in SPLIT mode the chunk partials, and with
//   FUSED the merged rows. Guarantee: the bits of attn_kernel for every row, whatever SPLITM, FUSED,
//   DEC_STAGES, HALF, TMA, cpc or box_rows.
//   cpc: SPLIT mode's chunks per CTA (grid x = tiles x decode_ctas_per_tile). tm_k / tm_v / box_rows:
//   the TMA descriptors and their box height (TMA only).
// HALF: launches of at most 8 rows per KV head (max_seqlen_q * G <= 8: one-query decode with up to 8
// query heads per KV head), so a thread's second row (g + 8) is always empty; the kernel then skips
// every operation on it (softmax, alpha scaling, the exchange of its scores), leaving row g's operations
// as they are.
// TMA: K/V blocks arrive by TMA boxes (thread 0, one mbarrier per stage) in the 128-byte swizzle instead
// of cp.async into padded rows; ldmatrix reads the same values from the swizzled addresses, V rows at or
// past kv_len are zeroed after landing (the cp.async zero-fill), K rows there stay unloaded or stale: every
// such column is past every valid row's position, so the causal select replaces its score.
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

  // The thread's Q fragments and walk state: declared here at this kernel's sizes, filled by the shared helpers
  // of tik_attention_common.cuh (so the decode and the prefill start from the same values the same way).
  uint32_t qa[KC][4];
  load_q_frags<D, KC>(qa, p.q, rowid, rvalid, t);

  float acc[DTW][4];
  float m[2], l[2];
  float O[SPLITM ? 1 : DTW][4];
  float M[2], L[2];
  init_walk_state<DTW, !SPLITM>(acc, m, l, O, M, L);

  const bf16* kg0 = static_cast<const bf16*>(p.k);
  const bf16* vg0 = static_cast<const bf16*>(p.v);
  const int64_t kv_base = p.paged ? 0 : (int64_t)q0;
  const int* bt_row = p.paged ? p.block_table + (int64_t)b * p.max_pages : nullptr;
  const int lr0 = threadIdx.x / SEGS, ls = threadIdx.x % SEGS;
  const uint32_t ks_s = (uint32_t)__cvta_generic_to_shared(Ks), vs_s = (uint32_t)__cvta_generic_to_shared(Vs);

  // The page-table entries of block j + 1 are loaded (into registers, not waited for) right after block
  // j's copies are issued, so the copies of a block never wait for its page lookups (a page-table round
  // trip per block would sit on the critical path of every block).
  // Three loaders behind one uniform branch:
  //   * blocks that lie in one page (contiguous K/V, or power-of-two pages of at least BN rows): one
  //     page-table entry per block, and a thread's PER_T rows are a constant stride apart;
  //   * power-of-two pages of RSTEP .. BN / 2 rows (16 and 32 at D = 128; the engine's default is 16):
  //     the entries are the same for every thread (small_pages below); 2-23% faster than the per-row
  //     loader with pages of 16 on the H200;
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

// One decode instantiation on grid (gx, Hkv, batch): in SPLIT mode the fused kernel when p.counters holds
// enough counters, else the decode kernel followed (SPLIT mode) by attn_decode_merge_kernel.
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

// SMs of the current device (cached per device).
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
// 72 KB (three per SM). For a grid of `tasks` chunk CTAs (rules measured on the H200):
//   * one wave at two per SM: one chunk per CTA, 3 stages;
//   * one wave at three per SM (D = 128 only): one chunk per CTA, 2 stages (B=64 x ctx 550, 12/2 heads:
//     30% faster than two waves of 3-stage CTAs or 2 chunks per CTA);
//   * else, when at most DEC_CPC_MAX chunks per CTA make one wave at two per SM: that many per CTA,
//     3 stages;
//   * else one chunk per CTA, and 2 stages for grids over four CTAs per SM. Grids of several waves gain
//     nothing from several chunks per CTA and lose up to 14% where the fewer CTAs leave a partial last
//     wave.
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

// A decode-shaped launch: tiles of 16 rows, chunks per CTA and ring depth (decode_auto_shape unless the
// caller forces them), then the loader and HALF choice below it.
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

// See tik_attention_launch.h.
cudaError_t decode_attention(const TikAttnParams& p, int mode, cudaStream_t stream) {
  const bool sp = mode == TIK_ATTN_SPLIT_MODE;
  if (p.D == 64) return sp ? launch_decode<64, true>(p, stream) : launch_decode<64, false>(p, stream);
  if (p.D == 128) return sp ? launch_decode<128, true>(p, stream) : launch_decode<128, false>(p, stream);
  return cudaErrorInvalidValue;
}

int describe_decode(char* buf, int buflen, int used) {
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
  return used;
}

}  // namespace tik_attn
