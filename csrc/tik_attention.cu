// areal-tik causal attention over packed (varlen) or paged KV: the C entry points of tik_api.h.
//
// Supports bf16 q/k/v/out, head dim D in {64, 128}, GQA (Hq a multiple of Hkv), contiguous
// [tokens, heads, D] q/out, varlen k/v [tokens, Hkv, D] or a paged cache [pages, page_size, Hkv, D]
// with a block table. One kernel family serves attention_varlen (training forward) and
// attention_paged (prefill, chunked prefill, decode).
//
// Contract (DESIGN.md section 2, within this backend): for a query at absolute position p the
// output bits do not depend on batch mix, packing, page size, chunking, launch shape, which kernel
// ran or the SPLIT/FOLD mode. How:
//   * a "row" is one (query token, query head). Rows are packed 16 per warp into the M dimension
//     of mma.sync.m16n8k16 (bf16 in, fp32 accumulate); a CTA holds rows of one KV head's GQA
//     group, so K/V are read once per group. An MMA row's result depends only on that row of A,
//     B and the accumulator, so which rows share a warp never changes a row's bits.
//   * KV is walked in blocks of TIK_ATTN_BLOCK_N positions aligned to position 0, ascending;
//     S = Q K^T chains the D/16 k-steps ascending; the online softmax uses only explicitly rounded
//     fp32 ops (__fmul_rn/__fadd_rn/__fsub_rn/__fdiv_rn, no contraction) and ex2.approx; P is
//     rounded to bf16 for P V (tik_attention_common.cuh: softmax_block, the one definition).
//   * Split-KV: positions are partitioned into chunks of TIK_ATTN_SPLIT (absolute, fixed). Each
//     chunk runs its own online softmax from a fresh state; the chunk partials (m, l, acc) are
//     merged in ascending chunk order by merge_coeffs / merge_val. FOLD mode merges in registers
//     as the walk passes each chunk end; SPLIT mode stores each chunk's fp32 partial and merges
//     them with the same scalar code (tik_attention_merge.cuh). AUTO picks SPLIT for
//     decode-shaped launches with more than one chunk, FOLD otherwise (and whenever the caller
//     asks for the rows' lse).
//   * K/V positions at or beyond the sequence's KV length are zero-filled (never read) and
//     causal-masked scores are -inf, so cache garbage never reaches a result.
//
// Files:
//   tik_attention_common.cuh   constants, mma.sync/ldmatrix/cp.async wrappers, the per-row arithmetic
//   tik_attention_merge.cuh    SPLIT-mode merges of chunk partials
//   tik_attention_tma.cuh      sm_90a TMA box loads and mbarriers (wgmma prefill, decode TMA loader)
//   tik_attention_prefill.cu   launches with max_seqlen_q * G > 16: attn_kernel (mma.sync, any
//                              mode) or, on sm_90a at D = 128 in FOLD mode, attn_kernel_wgmma
//                              (tik_attention_wgmma.cuh); TikAttnParams::prefill_kernel selects
//   tik_attention_decode.cu    launches with max_seqlen_q * G <= 16: attn_decode_kernel
//   tik_attention_launch.h     host interface between these translation units
// Every kernel repeats attn_kernel's per-row arithmetic op for op, so which one ran never changes
// a row's bits (the GPU tests compare them bit for bit).
#include "tik_attention_common.cuh"
#include "tik_attention_launch.h"

namespace tik_attn {

// The driver's cuTensorMapEncodeTiled through the runtime's entry-point query (no libcuda link), or
// nullptr when the driver lacks it. Looked up once per process.
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

// See tik_attention_launch.h.
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

}  // namespace tik_attn

extern "C" {

int tik_attention_max_chunks(const TikAttnParams* p) { return tik_attn::max_chunks_of(*p); }

int tik_attention_wgmma_available(void) { return tik_attn::wgmma_prefill_available() ? 1 : 0; }

// Decode-shaped: at most 16 rows (query token x query head of one GQA group) per KV head, one decode tile.
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
  if (tik_small(p)) return (int)tik_attn::decode_attention(*p, mode, stream);  // same bits as attn_kernel
  return (int)tik_attn::prefill_attention(*p, mode, stream);
}

int tik_attention_describe(char* buf, int buflen) {
  int used = 0;
  if (buflen > 0) buf[0] = 0;
  used = tik_attn::describe_prefill(buf, buflen, used);
  used = tik_attn::describe_decode(buf, buflen, used);
  return used;
}

}  // extern "C"
