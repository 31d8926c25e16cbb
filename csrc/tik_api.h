// areal-tik CUDA kernels: plain C launcher API (no torch headers).
//
// The .cu files include only the CUDA toolkit; the torch binding lives in
// tik_bindings.cpp and calls these launchers with raw device pointers and the
// current stream. Every launcher returns a cudaError_t (cudaSuccess on success);
// argument errors are reported as cudaErrorInvalidValue and must be validated by
// the caller first (the Python launchers and the binding do).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Attention meta-parameters that define the bits (fingerprinted via cuda_ops.META).
#define TIK_ATTN_BLOCK_N 64      // KV positions per block, blocks aligned to position 0
#define TIK_ATTN_SPLIT 256       // KV positions per split-KV chunk (absolute, fixed)

enum TikAttnMode { TIK_ATTN_AUTO = 0, TIK_ATTN_FOLD = 1, TIK_ATTN_SPLIT_MODE = 2 };

typedef struct {
  const void* q;          // [Tq, Hq, D] bf16, contiguous
  const void* k;          // varlen: [Tk, Hkv, D]; paged: [num_pages, page_size, Hkv, D]
  const void* v;
  void* out;              // [Tq, Hq, D] bf16
  const int* cu_seqlens_q;  // [B+1]
  const int* seqlens_k;     // paged: [B]; varlen: NULL (k length = q length, cu_seqlens_q)
  const int* block_table;   // paged: [B, max_pages]; varlen: NULL
  int paged;
  int batch, Hq, Hkv, D;
  int max_pages, page_size;  // paged only
  int max_seqlen_q;          // upper bound on any n_i
  int max_seqlen_k;          // upper bound on any kv length (paged: max_pages*page_size)
  float scale_log2;          // softmax scale * log2(e)
  int mode;                  // TikAttnMode; AUTO picks, FOLD/SPLIT force (tests)
  // split-KV workspace (only used in SPLIT mode); sizes from tik_attention_workspace
  float* ws_acc;             // [Tq*Hq, max_chunks, D]
  float* ws_ml;              // [Tq*Hq, max_chunks, 2]
  int* ws_nc;                // [Tq*Hq]
  int total_q;               // Tq
  // Decode-shaped SPLIT launches: tile counters for the one-launch (fused) merge. NULL, or
  // counters_cap < tik_attention_decode_counters_needed(), selects the two-launch path
  // (decode kernel + merge kernel; same bits). The buffer must be all zero before the first
  // launch; every fused launch leaves it all zero again (the last CTA of a tile resets its
  // counter), so it is allocated and zeroed once and reused, also by CUDA-graph replays.
  // Fused launches sharing one buffer must not run concurrently (e.g. on two streams).
  int* counters;
  int64_t counters_cap;      // number of ints at counters
  // Kernel for FOLD-mode launches that are not decode-shaped: AUTO = the sm_90a warpgroup-MMA
  // kernel when the device and the build have it and D = 128, else the mma.sync kernel; MMA
  // forces the mma.sync kernel; WGMMA forces the wgmma kernel (cudaErrorNotSupported where it
  // cannot run). Same bits by design; the GPU tests compare them.
  int prefill_kernel;
  // Rows of k / v as the wgmma kernel's TMA descriptors see them: varlen, tokens (k.shape[0]);
  // paged, cache slots (num_pages * page_size). 0 (unknown) keeps launches on the mma.sync kernel.
  int64_t kv_rows;
  // Decode-shaped SPLIT launches: at most this many split chunks per CTA, walked one after another
  // through one K/V ring (each chunk still from a fresh softmax state, its partial stored as before;
  // a tile's chunks that hold positions go, strided, to as few of its CTAs as this allows). 0 = the
  // launcher picks from the grid size (with the ring depth); n > 0 forces n (tests, benchmarks).
  // Timing only, not bits.
  int decode_cpc;
  // Decode-shaped launches at D = 128: cp.async ring depth (2 or 3 stages); 0 = the launcher picks
  // from the grid size. Timing only, not bits (benchmarks, tests).
  int decode_stages;
  // Optional [total_q, Hq] fp32 (row = token * Hq + q head): each valid row's log-sum-exp of its scaled
  // scores in base 2, M + log2(L), where M is the row max and L the sum of ex2(score * scale_log2 - M)
  // the output was divided by (the Triton backward's convention). FOLD mode only: AUTO resolves to FOLD
  // when set, a forced SPLIT launch with it is refused. Rows not computed are left untouched. Output bits
  // are the same with or without it.
  float* lse;
} TikAttnParams;

enum TikAttnPrefillKernel { TIK_ATTN_PREFILL_AUTO = 0, TIK_ATTN_PREFILL_MMA = 1, TIK_ATTN_PREFILL_WGMMA = 2 };

// Which mode AUTO resolves to for these parameters (1 = fold, 2 = split).
int tik_attention_resolve_mode(const TikAttnParams* p);
// Number of split chunks (max over sequences) for these parameters.
int tik_attention_max_chunks(const TikAttnParams* p);
int tik_attention(const TikAttnParams* p, cudaStream_t stream);
// 1 when this launch reads ws_nc (it must then be zeroed, [Tq*Hq] int); 0 otherwise
// (decode-shaped launches: their merge derives each row's chunk count itself).
int tik_attention_needs_ws_nc(const TikAttnParams* p);
// Counters a fused decode launch with these parameters uses (batch * Hkv * 16-row tiles);
// 0 for any other launch (not decode-shaped, or not SPLIT mode): it uses none.
int64_t tik_attention_decode_counters_needed(const TikAttnParams* p);
// Revision marker of the decode path, exported by the binding as DECODE_PATH; cuda_ops rejects an
// extension built with another value (a stale build). 4: decode-shaped launches (max_seqlen_q *
// Hq/Hkv <= 16) run the 4-warp decode kernel; SPLIT-mode decode merges in the decode launch itself
// (p.counters; binding argument decode_merge=1 selects the separate merge kernel); decode CTAs may
// walk several split chunks (decode_cpc); the forward can write each row's log-sum-exp
// (TikAttnParams::lse, binding argument lse=), which cuda_ops' autograd needs.
#define TIK_ATTN_DECODE_PATH 4
// Prefill kernels the build knows (TikAttnParams::prefill_kernel); exported as PREFILL_KERNELS so
// cuda_ops can reject a stale build that lacks the field.
#define TIK_ATTN_PREFILL_KERNELS 2
// Elementwise entry points' revision (exported as ELEMENTWISE_API; 2: tik_apply_rope has a backward flag).
#define TIK_ELEMENTWISE_API 2
// 1 when the current device runs the sm_90a wgmma prefill kernel (cc 9.0 and an sm_90a build).
int tik_attention_wgmma_available(void);

// Resource usage of every attention kernel instantiation, one line each, into buf.
int tik_attention_describe(char* buf, int buflen);

// y = w * bf16(x * rsqrt(mean(x^2) + eps)) per row; dtype 0 = bf16, 1 = fp16, 2 = fp32.
int tik_rms_norm(const void* x, const void* w, void* y, int64_t rows, int n, int64_t x_row_stride,
                 float eps, int dtype, cudaStream_t stream);

// out[t,h,:] = rope(x[t,h,:]) with fp32 tables cos/sin [P, D] (neox / rotate-half style); backward != 0:
// the transpose (x is the output gradient, out the input gradient).
int tik_apply_rope(const void* x, void* out, const float* cos, const float* sin, const int64_t* positions,
                   int64_t T, int H, int D, int64_t x_stride_t, int64_t x_stride_h, int64_t num_positions,
                   int dtype, int backward, cudaStream_t stream);

// k_cache.view(-1, Hkv*D)[slot[t]] = k[t] (same for v); slot < 0 skipped. elem_bytes 2 or 4.
int tik_kv_cache_write(const void* k, const void* v, void* k_cache, void* v_cache, const int64_t* slots,
                       int64_t T, int64_t row_elems, int64_t num_slots, int elem_bytes, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
