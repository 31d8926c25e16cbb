// attn_kernel_wgmma: sm_90a prefill attention, attn_kernel's per-row arithmetic on warpgroup MMAs
// (wgmma) fed by TMA.
//
// Serves FOLD-mode launches that are not decode-shaped (max_seqlen_q * G > 16), D = 128, bf16, on
// sm_90a (H100/H200), when TMA descriptors can be made for k and v (16-byte aligned bases) and a box
// never crosses a page (page sizes dividing 64 or multiples of it); tik_attention_prefill.cu runs
// attn_kernel for every other launch. Writes bf16 out and, when p.lse is set, each row's lse.
//
// Guarantee: the same output bits as attn_kernel for every row (so as every kernel here). Why:
//   * rows = (query token, query head) as in attn_kernel; a CTA is 2 consumer warpgroups x 64 rows
//     (128 rows of one KV head's GQA group) and one producer warpgroup; consumer warp w holds rows
//     16w .. 16w+15 in the m16n8k16 fragment layout (the wgmma m64 accumulator and register-A layouts
//     are, per warp, those of mma.sync m16n8k16), so every per-row scalar operation is attn_kernel's,
//     op for op: same KV blocks of BN positions ascending, same explicitly rounded online softmax,
//     same P rounding to bf16, same FOLD merge at each split-chunk end. Two rewrites cannot change a
//     value: the row max is a tree (max is exact), and blocks entirely at or before both of a
//     thread's rows skip the causal select (it would select nothing).
//   * S = Q K^T chains the D/16 k-steps ascending (the first k-step ignores the accumulator) and
//     acc += P V chains the BN/16 k-steps ascending, attn_kernel's MMA chains, as wgmma.m64n64k16
//     (Q and K from shared memory) and wgmma.m64n128k16 (P from registers, V from shared memory,
//     transposed B). That a warpgroup MMA k-step rounds like an mma.sync k-step is a hardware
//     property the design relies on and the GPU tests check: they compare this kernel with
//     attn_kernel (prefill_kernel="mma", mode="split") and with the decode kernel bit for bit.
//   * V rows at or past the sequence's KV length are zeroed in shared memory after their block lands
//     (attn_kernel's zero-fill; here the producer warpgroup does it): a masked score's P is exactly
//     0, and 0 * V must not meet NaN garbage of a paged cache. Boxes starting past the KV length are
//     never loaded.
//   * A warpgroup whose 64 rows all lie before a block skips it (attn_kernel skips per warp; a fully
//     masked block is an exact no-op on a row's state either way).
//
// Pipeline (warp specialisation as in FlashAttention-3):
//   * K/V blocks arrive by TMA into a WG_STAGES-stage ring (boxes of min(64, page size) rows, the
//     128-byte swizzle the wgmma descriptors read). One thread of the producer warpgroup issues them
//     in order, each as soon as its stage is free: a "full" mbarrier per stage (TMA bytes landed)
//     and an "empty" one (8 arrivals, one per consumer warp after its P V of the block landed). No
//     CTA barrier in the walk: the two consumer warpgroups drift apart by up to the ring's slack.
//     The producer issues the first blocks while the consumers' Q copies are in flight (a short
//     prompt's CTA walks only a few blocks: these two latencies must not be serial).
//   * The last block's V rows at or past kv_len are zeroed by the producer warpgroup, which then
//     arrives on a third mbarrier the consumers wait on for that block. A parity wait starts only
//     once the awaited phase is the stage's current or next one (the producer warpgroup first waits
//     for its thread 0 to have issued the tail load): a wait begun earlier can return at an older
//     phase of the same parity.
//   * Per warpgroup, step j issues S_j and P_{j-1} V_{j-1} together and waits for S_j first. In the
//     SASS ptxas waits for P V before block j's softmax, because P_j is packed into the registers
//     P_{j-1} V_{j-1} reads (forcing the softmax ahead of that wait is 1-3% slower). acc is scaled
//     by alpha_{j-1} before P_{j-1} V_{j-1} lands and by alpha_j after, and a chunk merges after its
//     last P V, so each row sees attn_kernel's sequence of operations.
// Resources: 384 threads (launched at 168 registers; setmaxnreg gives the consumers 240: accumulator
// 64 + merged O 64 + S 32 + P 16 per thread, and the producer 24), ~225 KB shared memory, one CTA per
// SM. On the H200 (32 q / 8 kv heads, causal) it runs at 410-440 TF/s for L 4K-16K, about 2x the
// mma.sync kernel. Where the time goes (bench/csrc_ablations.py, L 16K): the load/barrier skeleton
// alone is ~43%, removing the softmax, P V or S saves 14-18.5% each, and loading only K is not
// faster (streaming K/V from L2 is not the bound).

#pragma once
#include <type_traits>

#include "tik_attention_common.cuh"
#include "tik_attention_tma.cuh"

namespace tik_attn {

constexpr int WG_ROWS = 128;      // 2 warpgroups x 64 rows
constexpr int WG_THREADS = 256;  // the two consumer warpgroups
constexpr int WG_CTA_THREADS = WG_THREADS + 128;  // + the producer warpgroup (TMA issue, tail zeroing)
// setmaxnreg: 128 x 24 + 256 x 240 <= 64K registers. The producer compiles without spills at 24; the
// consumers at 240 run 1.5-2% faster than at 232 (H200, L 4K/16K).
constexpr int WG_PRODUCER_REGS = 24, WG_CONSUMER_REGS = 240;
static_assert(128 * WG_PRODUCER_REGS + WG_THREADS * WG_CONSUMER_REGS <= 65536, "register file");
constexpr int WG_STAGES = 6;      // K/V ring depth (5 stages: 2% slower at L 4K on the H200)
constexpr int WG_Q_BYTES = 2 * WG_TILE_BYTES;     // the CTA's 128 Q rows
// + the full, empty and tail mbarriers, + alignment
constexpr int wg_smem_bytes() { return WG_Q_BYTES + WG_STAGES * 2 * WG_TILE_BYTES + 128 + 1024; }

// Shared-memory matrix descriptor, 128-byte swizzle: low word = address / 16 | LBO / 16 << 16, high
// word = SBO / 16 (1024 bytes: 8 rows of 128 bytes) | the 128-byte swizzle mode. Every operand here
// has that SBO, so only the low word varies, and an offset of k x 16 bytes adds k to it (shared
// addresses stay below 256 KB: no carry into the LBO field). About 7 instead of 14 instructions per
// wgmma than building the 64-bit descriptor from the address each time.
constexpr uint32_t WG_DESC_HI = (1024u >> 4) | (1u << 30);
__device__ __forceinline__ uint32_t wg_desc_lo(uint32_t saddr, uint32_t lbo) { return (saddr >> 4) | ((lbo >> 4) << 16); }

#ifdef TIK_SM90A_DEVICE
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// D[64 x 128] += A[64 x 16] (registers, bf16) * B[16 x 128] (shared memory, descriptor, N-major: transposed).
// Descriptors are passed as their low word (wg_desc_lo); the high word is WG_DESC_HI.
__device__ __forceinline__ void wgmma_m64n128k16_rs_tb(float (&d)[64], const uint32_t (&a)[4], uint32_t desc_lo) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 db;\nsetp.ne.b32 p, %69, 0;\nmov.b64 db, {%68, %70};\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, db, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(desc_lo), "n"(1), "r"(WG_DESC_HI));
}
// D[64 x 64] = A[64 x 16] * B[16 x 64], both from shared memory (descriptors, K-major) + (scale_d ? D : 0).
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint32_t a_lo, uint32_t b_lo, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %34, 0;\nmov.b64 da, {%32, %35};\nmov.b64 db, {%33, %35};\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "da, db, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a_lo), "r"(b_lo), "r"(scale_d), "r"(WG_DESC_HI));
}
#endif  // TIK_SM90A_DEVICE

// The kernel (see the header): one CTA per 128-row tile of KV head blockIdx.y's GQA group of sequence
// blockIdx.z, longest causal walk first; tm_k / tm_v are the K/V TMA descriptors (make_kv_map) with
// boxes of box_rows rows. D = 128 only; the body exists only in the sm_90a pass (an empty kernel in
// an sm_80 build, which wgmma_prefill_available never selects).
template <int D>
__global__ void __launch_bounds__(WG_CTA_THREADS, 1)
    attn_kernel_wgmma(const TikAttnParams p, const __grid_constant__ CUtensorMap tm_k,
                      const __grid_constant__ CUtensorMap tm_v, int box_rows) {
#ifdef TIK_SM90A_DEVICE
  static_assert(D == 128, "the wgmma prefill kernel is written for D = 128");
  constexpr int NT = BN / 8;   // n-tiles of S
  constexpr int KC = D / 16;   // k-steps of Q K^T
  constexpr int DT = D / 8;    // n-tiles of O
  constexpr int SEGS = D / 8;  // 16-byte segments per K/V/Q row
  static_assert(BN == 64, "S = m64n64 per warpgroup");

  extern __shared__ __align__(16) unsigned char wg_smem_raw[];  // aligned up to 1024 below (swizzle atoms)
  const uint32_t qbase = ((uint32_t)__cvta_generic_to_shared(wg_smem_raw) + 1023u) & ~1023u;
  const uint32_t sbase = qbase + WG_Q_BYTES;
  const uint32_t bars = sbase + WG_STAGES * 2 * WG_TILE_BYTES;  // WG_STAGES mbarriers ("block landed")
  const uint32_t ebars = bars + 8 * WG_STAGES;                   // WG_STAGES mbarriers ("stage read": 8 warps)
  const uint32_t tbar = ebars + 8 * WG_STAGES;                   // the tail block's V rows zeroed

  if (threadIdx.x == 0) {  // the K/V TMA descriptors into the descriptor cache before their first use
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tm_k)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tm_v)) : "memory");
  }
  const int b = blockIdx.z, hk = blockIdx.y;
  const int G = p.Hq / p.Hkv;
  const int tile = gridDim.x - 1 - blockIdx.x;  // longest causal walks first
  const int q0 = p.cu_seqlens_q[b];
  const int nq = p.cu_seqlens_q[b + 1] - q0;
  const int kv_len = p.paged ? p.seqlens_k[b] : nq;
  const int rows_total = nq * G;
  const int row0 = tile * WG_ROWS;
  if (row0 >= rows_total) return;
  const int pos_off = kv_len - nq;
  const int last_row = min(rows_total, row0 + WG_ROWS) - 1;
  const int tile_max_pos = pos_off + last_row / G;
  if (tile_max_pos < 0) return;  // kv_len < n_q: invalid input, nothing defined to compute
  const int nblk = tile_max_pos / BN + 1;

  // The warp index through a shuffle: ptxas then treats it (and the warpgroup, its Q, its walk length
  // and the stage of block j) as warp-uniform and computes the wgmma descriptors on the uniform
  // datapath, with no register-to-uniform moves before each wgmma (4% faster on the H200).
  const int warp = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 5, 0), lane = threadIdx.x & 31, g = lane >> 2,
            t = lane & 3;
  const int wgi = warp >> 2;
  const int wg0 = row0 + wgi * 64;  // first row of this warpgroup
  const int wg_max_pos = wg0 < rows_total ? pos_off + (min(rows_total, wg0 + 64) - 1) / G : -1;
  // This warpgroup's blocks are 0 .. nbw-1 (a row never sees a block past its position; attn_kernel
  // walks the CTA's blocks but a block past all of a warp's rows is skipped, and the chunk merges
  // it would run there find every row's state unchanged or the row past its last chunk).
  const int nbw = wg_max_pos >= 0 ? wg_max_pos / BN + 1 : 0;
  const int wrow0 = row0 + warp * 16;

  int rpos[2], rlast[2];
  bool rvalid[2];
  int64_t rowid[2];
  thread_rows(p, wrow0, g, G, rows_total, pos_off, q0, hk, rpos, rlast, rvalid, rowid);

  // Q: the CTA's rows in shared memory (A operand of S = Q K^T, K-major 128-byte swizzle), zero for
  // rows past the sequence or before position 0; cp.async, waited for before block 0.
  if (threadIdx.x < WG_THREADS) {
    const bf16* qg = static_cast<const bf16*>(p.q);
#pragma unroll
    for (int u = 0; u < WG_ROWS * SEGS / WG_THREADS; ++u) {
      const int i = threadIdx.x + u * WG_THREADS;
      const int r = i / SEGS, sg = i % SEGS;
      const int rg = row0 + r, j = rg / G;
      const bool ok = rg < rows_total && pos_off + j >= 0;
      const int64_t rid = (int64_t)(q0 + j) * p.Hq + (int64_t)hk * G + rg % G;
      const int rr = r & 63;
      const uint32_t so = (uint32_t)((r >> 6) * WG_TILE_BYTES + (sg >> 3) * WG_HALF_BYTES + rr * 128 +
                                     (((sg & 7) ^ (rr & 7)) << 4));
      cp_async16(qbase + so, qg + (ok ? rid * D + sg * 8 : 0), ok ? 16 : 0);
    }
    cp_async_commit();
  }
  const uint32_t qwg = qbase + (uint32_t)(wgi * WG_TILE_BYTES);
  const int rpos_min = min(rpos[0], rpos[1]);  // blocks ending at or before it need no causal mask

  // The walk state in wgmma's flat accumulator layout (init_walk_state's values for the mma.sync layout), plus
  // the state the producer/consumer handoff keeps (mo, lo).
  float acc[DT * 4], O[DT * 4];
  float m[2], l[2], M[2], L[2], mo[2], lo[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    m[i] = -CUDART_INF_F;
    l[i] = 0.f;
    M[i] = -CUDART_INF_F;
    L[i] = 0.f;
    mo[i] = -CUDART_INF_F;
    lo[i] = 0.f;
  }
#pragma unroll
  for (int x = 0; x < DT * 4; ++x) {
    acc[x] = 0.f;
    O[x] = 0.f;
  }
  uint32_t pa[BN / 16][4];
  // (mo, lo) hold the row state of the chunk whose FOLD merge waits for its last P V to land.

  // K/V block j -> stage j % WG_STAGES by TMA (tma_kv_block). V rows at or past kv_len are zeroed after the
  // block lands (by the producer warpgroup), as attn_kernel's zero-fill: a masked score's P is exactly 0 and
  // 0 * V must not meet a NaN in the cache.
  const int64_t kv_base = p.paged ? 0 : (int64_t)q0;
  auto load_tile = [&](int j, int stage) {  // the producer's thread 0 only
    tma_kv_block(sbase + (uint32_t)(stage * 2 * WG_TILE_BYTES), bars + 8 * stage, &tm_k, &tm_v, hk, j, box_rows, kv_len,
                 [&](int pos) -> int64_t {
                   return p.paged ? (int64_t)p.block_table[(int64_t)b * p.max_pages + pos / p.page_size] * p.page_size +
                                        pos % p.page_size
                                  : kv_base + pos;
                 });
  };
  const int tail_blk = (kv_len % BN) ? kv_len / BN : -1;  // the block holding kv_len, if not aligned

  const float sl2 = p.scale_log2;
  // Prologue: thread 0 initialises the ring's barriers; after the one CTA barrier the producer issues
  // the first K/V blocks while the consumers' Q copies are still in flight (a short prompt's CTA walks
  // only a few blocks: these two latencies must not be serial).
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < WG_STAGES; ++st) {
      mbar_init(bars + 8 * st, 1);
      mbar_init(ebars + 8 * st, 8);  // one arrive per consumer warp after its last read of the stage
    }
    mbar_init(tbar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // barriers initialised (the consumers' Q copies are in flight)
  if (threadIdx.x >= WG_THREADS) {  // the producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WG_PRODUCER_REGS));
    if (threadIdx.x == WG_THREADS) {
      for (int j = 0; j < nblk; ++j) {
        const int st = j % WG_STAGES;
        if (j >= WG_STAGES) mbar_wait(ebars + 8 * st, (uint32_t)((j / WG_STAGES - 1) & 1));  // block j - S read
        load_tile(j, st);
      }
    }
    __syncwarp();
    if (tail_blk == nblk - 1) {  // V rows at or past kv_len of the last block -> 0, then release it
      const int jt = tail_blk, st = jt % WG_STAGES;
      // Only after thread 0 issued the tail block's load: the stage's barrier then is in the tail block's
      // phase (a parity wait started earlier would return at an older phase of the same parity).
      asm volatile("barrier.sync 1, 128;\n" ::: "memory");
      mbar_wait(bars + 8 * st, (uint32_t)((jt / WG_STAGES) & 1));
      zero_v_rows(sbase + (uint32_t)(st * 2 * WG_TILE_BYTES) + WG_TILE_BYTES, kv_len - jt * BN,
                  (int)threadIdx.x - WG_THREADS, 128);
      asm volatile("barrier.sync 1, 128;\n" ::: "memory");  // (not .aligned: warp 8's thread 0 came from the load loop)
      if (threadIdx.x == WG_THREADS) mbar_arrive(tbar);
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WG_CONSUMER_REGS));
  cp_async_wait<0>();  // this thread's Q segments
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  asm volatile("bar.sync 2, 256;\n" ::: "memory");  // Q in shared memory for every consumer thread
  // Software pipeline per warpgroup (written as FlashAttention-3's intra-warpgroup overlap; see the header
  // for what ptxas makes of it): step j issues S_j = Q K_j and then acc += P_{j-1} V_{j-1}, waits
  // for S_j, runs block j's softmax, waits for P V. Every row still sees attn_kernel's sequence: acc is
  // scaled by alpha_{j-1} before P_{j-1} V_{j-1} accumulates, and by alpha_j after; a chunk
  // ending at block j - 1 merges (with its saved m, l) after its last P V lands. The steps are
  // peeled (first S, steady S + P V, last P V) so no wgmma sits in a conditional path (ptxas
  // would serialize them).
  // Per warp: wait until block j landed (its stage's full barrier in the phase of block j: the ring
  // cannot run a phase ahead, since the producer refills a stage only after every consumer warp
  // released it); release block j after the P V that reads it last has completed.
  auto sync_block = [&](int j) {  // block j landed (the tail block: and its V rows past kv_len zeroed)
    if (j >= nblk) return;
    if (j == tail_blk) mbar_wait(tbar, 0u);
    else mbar_wait(bars + 8 * (j % WG_STAGES), (uint32_t)((j / WG_STAGES) & 1));
  };
  auto release = [&](int j) {  // this warp's reads of block j (S_j and P_j V_j) are complete
    if (lane == 0 && j + WG_STAGES < nblk) mbar_arrive(ebars + 8 * (j % WG_STAGES));
  };
  float s[NT * 4];
  // Descriptor low words: Q of this warpgroup and stage 0's K and V; a k-step / stage is a constant offset.
  const uint32_t q_lo = wg_desc_lo(qwg, 16), k0_lo = wg_desc_lo(sbase, 16),
                 v0_lo = wg_desc_lo(sbase + WG_TILE_BYTES, WG_HALF_BYTES);
  constexpr uint32_t STAGE_LO = 2 * WG_TILE_BYTES / 16;
  auto issue_s = [&](int j) {  // S_j = Q K_j^T; the first k-step ignores the old accumulator (zero start)
    const uint32_t k_lo = k0_lo + (uint32_t)(j % WG_STAGES) * STAGE_LO;
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {  // B = K^T: K-major, k-step kc = 32 bytes into half kc / 4
      const uint32_t off = (uint32_t)((kc >> 2) * WG_HALF_BYTES + (kc & 3) * 32) / 16;
      wgmma_m64n64k16_ss(s, q_lo + off, k_lo + off, kc > 0);
    }
    wg_commit();
  };
  auto issue_pv = [&](int j) {
    const uint32_t v_lo = v0_lo + (uint32_t)(j % WG_STAGES) * STAGE_LO;
#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc)  // B = V: N-major (transposed), 16 rows = 2 KB per k-step
      wgmma_m64n128k16_rs_tb(acc, pa[kc], v_lo + (uint32_t)(kc * 16 * 128 / 16));
    wg_commit();
  };
  float alpha[2];
  auto softmax = [&](int j) {  // attn_kernel's per-row operations on S_j; updates m, l, alpha, s := P
    if (j * BN + BN - 1 <= rpos_min) {  // no column of the block is past either row: the mask selects nothing
#pragma unroll
      for (int x = 0; x < NT * 4; ++x) s[x] = __fmul_rn(s[x], sl2);
    } else {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = j * BN + nt * 8 + 2 * t + (e & 1);
          s[nt * 4 + e] = (col <= rpos[e >> 1]) ? __fmul_rn(s[nt * 4 + e], sl2) : -CUDART_INF_F;
        }
    }
    // Row max as a tree (max is exact and fmaxf ignores NaN, so any order gives attn_kernel's value;
    // a +0/-0 tie cannot change a later result: both enter only differences and ex2).
    float mx[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) mx[i] = row_tree<NT>(s, i, [](float a, float b) { return fmaxf(a, b); });
    softmax_block<NT>(s, mx, m, l, alpha);
  };
  auto merge_chunk = [&](int c) {  // after the P V of chunk c's last block landed
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (c <= rlast[i]) merge_chunk_row<DT>(M[i], L[i], mo[i], lo[i], O, acc, i);
    }
#pragma unroll
    for (int x = 0; x < DT * 4; ++x) acc[x] = 0.f;
  };
  auto scale_pack_close = [&](int j) {  // acc *= alpha_j; P_j -> bf16 A fragments; chunk end?
#pragma unroll
    for (int x = 0; x < DT * 4; ++x) acc[x] = __fmul_rn(acc[x], alpha[(x >> 1) & 1]);
#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc) {
      pa[kc][0] = pack_bf16(s[(2 * kc) * 4 + 0], s[(2 * kc) * 4 + 1]);
      pa[kc][1] = pack_bf16(s[(2 * kc) * 4 + 2], s[(2 * kc) * 4 + 3]);
      pa[kc][2] = pack_bf16(s[(2 * kc + 1) * 4 + 0], s[(2 * kc + 1) * 4 + 1]);
      pa[kc][3] = pack_bf16(s[(2 * kc + 1) * 4 + 2], s[(2 * kc + 1) * 4 + 3]);
    }
    if ((j + 1) % BPC == 0 || j == nbw - 1) {  // block j ends split chunk j / BPC for this warpgroup
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mo[i] = m[i];
        lo[i] = l[i];
        m[i] = -CUDART_INF_F;
        l[i] = 0.f;
      }
    }
  };

  int j = 0;
  if (nbw > 0) {
    sync_block(0);
    wg_fence();
    issue_s(0);
    wg_wait0();
    reg_fence(s);
    softmax(0);
    scale_pack_close(0);
    // Step j: S_j with P_{j-1} V_{j-1}; when block j - 1 ends a split chunk (MERGE), that chunk's
    // FOLD merge runs once its P V landed. The walk is split at chunk ends so the steady loop holds
    // no merge: a conditional merge inside it makes ptxas copy the accumulator every step.
    auto step = [&](int j, auto merge) {
      sync_block(j);
      reg_fence(acc);
      wg_fence();
      issue_s(j);
      issue_pv(j - 1);
      wg_wait1();
      reg_fence(s);
      softmax(j);
      wg_wait0();
      reg_fence(acc);
      release(j - 1);
      if constexpr (decltype(merge)::value) merge_chunk((j - 1) / BPC);
      scale_pack_close(j);
    };
    j = 1;
    while (true) {
      const int last = min((j - 1) / BPC * BPC + BPC - 1, nbw - 1);  // end of block j - 1's chunk
      for (; j <= last; ++j) step(j, std::false_type{});
      if (j >= nbw) break;
      step(j, std::true_type{});  // block j - 1 ended a chunk
      ++j;
    }
    reg_fence(acc);
    wg_fence();
    issue_pv(nbw - 1);
    wg_wait0();
    reg_fence(acc);
    release(nbw - 1);
    merge_chunk((nbw - 1) / BPC);
    j = nbw;
  }
  for (; j < nblk; ++j) {  // blocks past this warpgroup's rows: released once landed (phase order)
    if (j + WG_STAGES < nblk) {
      mbar_wait(bars + 8 * (j % WG_STAGES), (uint32_t)((j / WG_STAGES) & 1));
      release(j);
    }
  }

  // Epilogue: out = O / L rounded once to bf16, and the row's lse. Written in each kernel on its own accumulator
  // layout (mma.sync fragments here; the decode's column split; wgmma's accumulators), with the same per-element
  // arithmetic (pack_bf16(__fdiv_rn(.)) and row_lse from tik_attention_common.cuh).
  bf16* out = static_cast<bf16*>(p.out);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (!rvalid[i]) continue;
    uint32_t* orow = reinterpret_cast<uint32_t*>(out + rowid[i] * D);
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
      orow[dt * 4 + t] = pack_bf16(__fdiv_rn(O[dt * 4 + 2 * i], L[i]), __fdiv_rn(O[dt * 4 + 2 * i + 1], L[i]));
    if (p.lse != nullptr && t == 0) p.lse[rowid[i]] = row_lse(M[i], L[i]);
  }
#endif  // TIK_SM90A_DEVICE
}

}  // namespace tik_attn
