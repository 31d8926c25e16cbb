// Torch binding of the areal-tik CUDA kernels (the .cu files are torch-free; see tik_api.h).
//
// Built as areal_tik._C by setup.py or as areal_tik_C by the JIT loader
// (areal_tik/backend/cuda_ext.py); the module name comes from TORCH_EXTENSION_NAME.
// Python-side launchers (areal_tik/kernels/cuda_ops.py) validate arguments with clear
// messages first; the TORCH_CHECKs here are the last line of defence.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "tik_api.h"

namespace {

at::Tensor out_or_new(const c10::optional<at::Tensor>& out, const at::Tensor& like, at::IntArrayRef sizes,
                      const char* what) {
  if (!out.has_value()) return at::empty(sizes, like.options());
  const at::Tensor& o = *out;
  TORCH_CHECK(o.device() == like.device() && o.scalar_type() == like.scalar_type() && o.sizes() == sizes &&
                  o.is_contiguous(),
              what, ": out must be a contiguous ", like.scalar_type(), " tensor of shape ", sizes, " on ",
              like.device());
  return o;
}

void check_cuda(int err, const char* what) {
  TORCH_CHECK(err == 0, "areal-tik CUDA ", what, " failed: ", cudaGetErrorString((cudaError_t)err));
}

void check_dev(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == ref.device(), name, " is on ", t.device(), " but q/x is on ", ref.device());
}

int dtype_code(at::ScalarType s) {
  if (s == at::kBFloat16) return 0;
  if (s == at::kHalf) return 1;
  if (s == at::kFloat) return 2;
  TORCH_CHECK(false, "areal-tik CUDA: unsupported dtype ", s, " (bf16, fp16, fp32)");
  return -1;
}

// Fused-decode tile counters (TikAttnParams::counters): one int32 buffer per device, zeroed
// once and reused by every launch (each fused launch leaves it all zero). Never freed: a
// CUDA graph captured with a buffer keeps its address, so a replaced buffer stays alive
// (retired) instead of returning to the caching allocator. Grows only outside stream capture
// (allocation + memset + sync are not capturable); a launch that needs more counters than
// exist while capturing gets none and takes the two-launch path (same bits).
constexpr int64_t kMinDecodeCounters = 1 << 16;

struct DecodeCounters {
  at::Tensor buf;
  std::vector<at::Tensor> retired;
};

std::mutex& counters_mutex() {
  static std::mutex* m = new std::mutex();  // leaked on purpose: no destruction-order issues at exit
  return *m;
}

std::map<int, DecodeCounters>& counters_by_device() {
  static auto* m = new std::map<int, DecodeCounters>();  // leaked on purpose (see above)
  return *m;
}

// Returns the device's counter buffer when it holds at least `need` ints (allocating or
// growing it first when the stream is not capturing), else an undefined tensor.
at::Tensor decode_counters_for(const at::Tensor& like, int64_t need, cudaStream_t st) {
  std::lock_guard<std::mutex> lock(counters_mutex());
  DecodeCounters& dc = counters_by_device()[like.device().index()];
  if (dc.buf.defined() && dc.buf.numel() >= need) return dc.buf;
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(st, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) return at::Tensor();
  int64_t cap = dc.buf.defined() ? dc.buf.numel() : kMinDecodeCounters;
  while (cap < need) cap *= 2;
  at::Tensor fresh = at::zeros({cap}, like.options().dtype(at::kInt));
  check_cuda((int)cudaStreamSynchronize(st), "decode counter zeroing");  // zero before any stream uses it
  if (dc.buf.defined()) dc.retired.push_back(dc.buf);
  dc.buf = fresh;
  return dc.buf;
}

at::Tensor attention_common(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens_q, const c10::optional<at::Tensor>& seqlens_k,
                            const c10::optional<at::Tensor>& block_table, int64_t max_seqlen_q, double scale,
                            int64_t mode, const c10::optional<at::Tensor>& out_opt, int64_t decode_merge,
                            int64_t prefill_kernel, int64_t decode_cpc = 0,
                            int64_t decode_stages = 0, const c10::optional<at::Tensor>& lse = c10::nullopt) {
  TORCH_CHECK(q.is_cuda(), "q must be a CUDA tensor");
  check_dev(k, q, "k");
  check_dev(v, q, "v");
  check_dev(cu_seqlens_q, q, "cu_seqlens");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "attention: q, k, v must be bfloat16");
  TORCH_CHECK(q.dim() == 3, "q must be [Tq, Hq, D]");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "q, k, v must be contiguous");
  TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kInt && cu_seqlens_q.is_contiguous() && cu_seqlens_q.dim() == 1,
              "cu_seqlens must be contiguous int32 [B+1]");
  const bool paged = block_table.has_value();
  const int64_t D = q.size(2);
  TORCH_CHECK(D == 64 || D == 128, "head dim must be 64 or 128, got ", D);
  TikAttnParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.cu_seqlens_q = cu_seqlens_q.data_ptr<int>();
  p.paged = paged ? 1 : 0;
  p.batch = (int)(cu_seqlens_q.size(0) - 1);
  p.Hq = (int)q.size(1);
  p.D = (int)D;
  p.max_seqlen_q = (int)max_seqlen_q;
  p.total_q = (int)q.size(0);
  if (paged) {
    const at::Tensor& bt = *block_table;
    const at::Tensor& sk = *seqlens_k;
    check_dev(bt, q, "block_table");
    check_dev(sk, q, "seqlens_k");
    TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes(), "k_cache/v_cache must be [num_pages, page_size, Hkv, D]");
    TORCH_CHECK(k.size(3) == D, "cache head dim ", k.size(3), " != q head dim ", D);
    TORCH_CHECK(bt.scalar_type() == at::kInt && bt.dim() == 2 && bt.is_contiguous(),
                "block_table must be contiguous int32 [B, max_pages]");
    TORCH_CHECK(sk.scalar_type() == at::kInt && sk.dim() == 1 && sk.is_contiguous(),
                "seqlens_k must be contiguous int32 [B]");
    TORCH_CHECK(bt.size(0) >= p.batch && sk.size(0) >= p.batch, "block_table/seqlens_k have fewer rows than B");
    p.Hkv = (int)k.size(2);
    p.page_size = (int)k.size(1);
    p.max_pages = (int)bt.size(1);
    p.block_table = bt.data_ptr<int>();
    p.seqlens_k = sk.data_ptr<int>();
    p.max_seqlen_k = (int)std::min<int64_t>(bt.size(1) * k.size(1), INT32_MAX - 1024);
    p.kv_rows = k.size(0) * k.size(1);
  } else {
    TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == q.size(0) && k.size(2) == D,
                "k/v must be [Tq, Hkv, D] matching q");
    p.Hkv = (int)k.size(1);
    p.max_seqlen_k = (int)max_seqlen_q;
    p.kv_rows = k.size(0);
  }
  TORCH_CHECK(p.Hkv > 0 && p.Hq % p.Hkv == 0, "Hq (", p.Hq, ") must be a multiple of Hkv (", p.Hkv, ")");
  p.scale_log2 = (float)(scale * 1.4426950408889634);
  p.mode = (int)mode;
  TORCH_CHECK(prefill_kernel >= 0 && prefill_kernel <= 2, "attention: prefill_kernel must be 0 (auto), 1 (mma) or 2 (wgmma)");
  p.prefill_kernel = (int)prefill_kernel;
  TORCH_CHECK(decode_cpc >= 0 && decode_cpc <= 64, "attention: decode_cpc must be 0 (auto) or 1..64");
  p.decode_cpc = (int)decode_cpc;
  TORCH_CHECK(decode_stages == 0 || decode_stages == 2 || decode_stages == 3,
              "attention: decode_stages must be 0 (auto), 2 or 3");
  p.decode_stages = (int)decode_stages;
  if (lse.has_value()) {
    check_dev(*lse, q, "lse");
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->is_contiguous() && lse->dim() == 2 &&
                    lse->size(0) == q.size(0) && lse->size(1) == q.size(1),
                "attention: lse must be contiguous fp32 [Tq, Hq]");
    TORCH_CHECK(mode != TIK_ATTN_SPLIT_MODE, "attention: lse needs FOLD (or auto) mode");
    p.lse = lse->data_ptr<float>();
  }
  at::cuda::CUDAGuard guard(q.device());
  auto out = out_or_new(out_opt, q, q.sizes(), "attention");
  p.out = out.data_ptr();
  at::Tensor ws_acc, ws_ml, ws_nc;
  if (tik_attention_resolve_mode(&p) == TIK_ATTN_SPLIT_MODE) {
    const int64_t rows = q.size(0) * q.size(1);
    const int64_t maxc = tik_attention_max_chunks(&p);
    auto f = q.options().dtype(at::kFloat);
    ws_acc = at::empty({rows * maxc * D}, f);
    ws_ml = at::empty({rows * maxc * 2}, f);
    p.ws_acc = ws_acc.data_ptr<float>();
    p.ws_ml = ws_ml.data_ptr<float>();
    if (tik_attention_needs_ws_nc(&p)) {  // the decode merge derives chunk counts itself (no memset node)
      ws_nc = at::zeros({rows}, q.options().dtype(at::kInt));
      p.ws_nc = ws_nc.data_ptr<int>();
    }
  }
  cudaStream_t st = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  TORCH_CHECK(decode_merge == 0 || decode_merge == 1, "attention: decode_merge must be 0 (fused) or 1 (kernel)");
  at::Tensor counters;
  if (decode_merge == 0) {
    // Decode-shaped SPLIT launches merge in the decode launch itself (they need counters).
    // Any other eager launch (needs none) only makes sure the buffer exists (minimum size),
    // so a graph captured later finds it.
    const int64_t need = tik_attention_decode_counters_needed(&p);
    counters = decode_counters_for(q, need, st);
    if (need > 0 && counters.defined()) {
      p.counters = counters.data_ptr<int>();
      p.counters_cap = counters.numel();
    }
  }
  check_cuda(tik_attention(&p, st), "attention");
  return out;
}

at::Tensor attention_varlen_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& cu_seqlens, int64_t max_seqlen, double scale, int64_t mode,
                                const c10::optional<at::Tensor>& out, int64_t prefill_kernel,
                                const c10::optional<at::Tensor>& lse) {
  return attention_common(q, k, v, cu_seqlens, c10::nullopt, c10::nullopt, max_seqlen, scale, mode, out, 0,
                          prefill_kernel, 0, 0, lse);
}

at::Tensor attention_paged_fwd(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_table, const at::Tensor& cu_seqlens_q,
                               const at::Tensor& seqlens_k, int64_t max_seqlen_q, double scale, int64_t mode,
                               const c10::optional<at::Tensor>& out, int64_t decode_merge, int64_t prefill_kernel,
                               int64_t decode_cpc, int64_t decode_stages) {
  return attention_common(q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, max_seqlen_q, scale, mode,
                          out, decode_merge, prefill_kernel, decode_cpc, decode_stages);
}

// The device's fused-decode counter buffer (undefined before the first attention call on it);
// tests check that it is all zero between launches.
at::Tensor decode_counters(int64_t device_index) {
  std::lock_guard<std::mutex> lock(counters_mutex());
  auto& m = counters_by_device();
  auto it = m.find((int)device_index);
  return it == m.end() ? at::Tensor() : it->second.buf;
}

at::Tensor rms_norm_fwd(const at::Tensor& x, const at::Tensor& w, double eps, const c10::optional<at::Tensor>& out) {
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
  check_dev(w, x, "weight");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: x and weight dtypes differ");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1) && w.is_contiguous(),
              "rms_norm: weight must be [N] with N = x.shape[-1]");
  const int64_t n = x.size(-1);
  TORCH_CHECK(n > 0 && n < (1 << 30), "rms_norm: bad row length");
  at::Tensor x2 = x.stride(-1) == 1 ? x : x.contiguous();
  x2 = x2.reshape({-1, n});
  if (x2.stride(-1) != 1) x2 = x2.contiguous();
  at::cuda::CUDAGuard guard(x.device());
  auto y = out_or_new(out, x, x.sizes(), "rms_norm").view(x2.sizes());
  cudaStream_t st = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  check_cuda(tik_rms_norm(x2.data_ptr(), w.data_ptr(), y.data_ptr(), x2.size(0), (int)n, x2.stride(0), (float)eps,
                          dtype_code(x.scalar_type()), st),
             "rms_norm");
  return y.view(x.sizes());
}

at::Tensor apply_rope_fwd(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& positions, const c10::optional<at::Tensor>& out_opt, bool backward) {
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
  check_dev(cos, x, "cos");
  check_dev(sin, x, "sin");
  check_dev(positions, x, "positions");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "apply_rope: x must be [T, H, D] with a contiguous last dim");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) == x.size(2),
              "apply_rope: cos/sin must be contiguous fp32 [P, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 1 &&
                  positions.size(0) == x.size(0),
              "apply_rope: positions must be contiguous int64 [T]");
  at::cuda::CUDAGuard guard(x.device());
  auto out = out_or_new(out_opt, x, x.sizes(), "apply_rope");
  cudaStream_t st = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  check_cuda(tik_apply_rope(x.data_ptr(), out.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                            positions.data_ptr<int64_t>(), x.size(0), (int)x.size(1), (int)x.size(2), x.stride(0),
                            x.stride(1), cos.size(0), dtype_code(x.scalar_type()), backward ? 1 : 0, st),
             "apply_rope");
  return out;
}

void kv_cache_write(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.is_cuda(), "k must be a CUDA tensor");
  check_dev(v, k, "v");
  check_dev(k_cache, k, "k_cache");
  check_dev(v_cache, k, "v_cache");
  check_dev(slot_mapping, k, "slot_mapping");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "kv_cache_write: k, v and the caches must be contiguous");
  TORCH_CHECK(k.sizes() == v.sizes() && k_cache.sizes() == v_cache.sizes(), "kv_cache_write: shape mismatch");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type() &&
                  k.scalar_type() == v.scalar_type(),
              "kv_cache_write: dtype mismatch");
  TORCH_CHECK(k.dim() == 3 && k_cache.dim() == 4 && k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              "kv_cache_write: k [T, Hkv, D], cache [num_pages, page_size, Hkv, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == k.size(0),
              "kv_cache_write: slot_mapping must be contiguous int64 [T]");
  at::cuda::CUDAGuard guard(k.device());
  cudaStream_t st = c10::cuda::getCurrentCUDAStream(k.device().index()).stream();
  check_cuda(tik_kv_cache_write(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                slot_mapping.data_ptr<int64_t>(), k.size(0), k.size(1) * k.size(2),
                                k_cache.size(0) * k_cache.size(1), (int)k.element_size(), st),
             "kv_cache_write");
}

std::string describe() {
  std::vector<char> buf(1 << 14);
  tik_attention_describe(buf.data(), (int)buf.size());
  return std::string(buf.data());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "areal-tik CUDA kernels (csrc/)";
  m.def("attention_varlen_fwd", &attention_varlen_fwd, "causal varlen attention forward (bf16)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("cu_seqlens"), py::arg("max_seqlen"), py::arg("scale"), py::arg("mode"),
        py::arg("out") = py::none(), py::arg("prefill_kernel") = 0, py::arg("lse") = py::none());
  m.def("attention_paged_fwd", &attention_paged_fwd, "causal attention over a paged KV cache (bf16)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("cu_seqlens_q"), py::arg("seqlens_k"),
        py::arg("max_seqlen_q"), py::arg("scale"), py::arg("mode"), py::arg("out") = py::none(),
        py::arg("decode_merge") = 0, py::arg("prefill_kernel") = 0, py::arg("decode_cpc") = 0,
        py::arg("decode_stages") = 0);
  m.def("decode_counters", &decode_counters, "the device's fused-decode counter buffer (tests)",
        py::arg("device_index"));
  m.def("rms_norm_fwd", &rms_norm_fwd, "RMSNorm forward, HF rounding points", py::arg("x"), py::arg("w"),
        py::arg("eps"), py::arg("out") = py::none());
  m.def("apply_rope_fwd", &apply_rope_fwd, "neox RoPE, fp32 math, one rounding (backward: its transpose)",
        py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("positions"), py::arg("out") = py::none(),
        py::arg("backward") = false);
  m.def("kv_cache_write", &kv_cache_write, "scatter k/v rows into the paged caches");
  m.def("describe", &describe, "resource usage of the attention kernels (registers, spills, smem)");
  m.attr("BLOCK_N") = TIK_ATTN_BLOCK_N;
  m.attr("SPLIT") = TIK_ATTN_SPLIT;
  m.attr("DECODE_PATH") = TIK_ATTN_DECODE_PATH;
  m.attr("PREFILL_KERNELS") = TIK_ATTN_PREFILL_KERNELS;
  m.attr("ELEMENTWISE_API") = TIK_ELEMENTWISE_API;
  m.def("wgmma_prefill_available", []() { return tik_attention_wgmma_available() != 0; },
        "whether the current device runs the sm_90a wgmma prefill kernel (prefill_kernel auto picks it)");
}
