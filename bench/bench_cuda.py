"""CUDA (csrc/) attention vs the Triton attention vs PyTorch SDPA, side by side in one run.

    python bench/bench_cuda.py --out DIR [--quick]

Writes DIR/bench_cuda.json and DIR/rows.csv (bench/harness.py) and prints a table. Cells:
prefill batch 1, 32 q heads / 8 kv heads, d=128, causal, L in 1K/4K/8K/16K (attention_varlen
for cuda/triton, SDPA with enable_gqa; "cuda" is the default prefill kernel, on sm_90a the wgmma
one, and the mma.sync kernel is timed beside it as cuda_mma_*, with a bits-equal check); decode batch {1,4,8,16} x context {128,1K,4K,8K}
(attention_paged, page size 64, one query per sequence; SDPA on contiguous K/V; cuda decode
is the single 4-warp decode kernel, its split-KV merge in the same launch by default; the
two-launch merge-kernel path is timed too as cuda_2launch_*, with a bits-equal check).
Decode is timed inside a CUDA graph for every provider
(as the engine runs it; eager if capture fails, marked). Reports ms, speed-up vs SDPA,
TFLOP/s (prefill) and GB/s of KV read vs 4.1 TB/s (decode). Also: extension build/load
time (prebuilt or JIT), the ptxas resource report of every csrc/*.cu for this GPU, and
registers/spills per attention kernel. ``decode_wide_table``: ctx 128 / 1K decode with a block
table 8K positions wide (as an engine sized for 8K contexts passes it: 32 grid chunks, most
of them idle), fused vs two-launch merge. ``train_attention``: forward + backward of the training
attention (packed equal-length sequences: 16 x 1K at 12/2 heads, 4 x 4K at 32/8), cuda (csrc forward
+ the default backward on its lse, kernels/attention/flash_backward.py) vs the same with the Triton backward vs
Triton vs SDPA.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness

from harness import Recorder, graphed as _graphed, time_ms, warm_up_clocks  # noqa: E402,F401  (re-exported for probes)

PEAK_BW = 4.1e12
HQ, HKV, D = 32, 8, 128
PAGE = 64


def _median_ms(fn, iters=20, reps=5):
    """Median ms per call (``harness.time_ms``, CUDA events, warm L2); for the probes that import it from here."""
    return time_ms(fn, "events", iters=iters, reps=reps).p50


def decode_case(B, ctx, hq=HQ, hkv=HKV, page=PAGE, table_pages=None, device="cuda"):
    """B sequences of ctx cached positions each on shuffled pages of a paged bf16 cache, one query per
    sequence: (q [B, hq, D], k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k). ``table_pages``
    widens the block table (entries past a sequence's pages are -1), as an engine sized for longer
    contexts passes it."""
    npg = -(-ctx // page)
    kc = torch.randn(B * npg, page, hkv, D, device=device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    pages = torch.randperm(B * npg, device=device, dtype=torch.int64).to(torch.int32).view(B, npg)
    if table_pages is None:
        bt = pages
    else:
        bt = torch.full((B, table_pages), -1, dtype=torch.int32, device=device)
        bt[:, :npg] = pages
    q = torch.randn(B, hq, D, device=device, dtype=torch.bfloat16)
    cq = torch.arange(B + 1, dtype=torch.int32, device=device)
    sk = torch.full((B,), ctx, dtype=torch.int32, device=device)
    return q, kc, vc, bt, cq, sk


def sdpa_layout(q, kc, vc, bt, ctx):
    """The same decode for SDPA: q as [B, Hq, 1, D] and the first ctx positions of each sequence's pages
    gathered into contiguous [B, Hkv, ctx, D]."""
    B, page, hkv, d = q.shape[0], kc.shape[1], kc.shape[2], kc.shape[3]
    npg = -(-ctx // page)
    idx = bt[:, :npg].long()
    kk, vv = (c[idx].reshape(B, npg * page, hkv, d)[:, :ctx].transpose(1, 2).contiguous() for c in (kc, vc))
    return q.view(B, q.shape[1], 1, d), kk, vv


def _ptxas_report(arch):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return "nvcc not found"
    out = []
    for src in sorted(os.listdir(os.path.join(ROOT, "csrc"))):
        if not src.endswith(".cu"):
            continue
        r = subprocess.run([nvcc, "-c", os.path.join(ROOT, "csrc", src), "-o", os.devnull, "-std=c++17", "-O3",
                            f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v"],
                           capture_output=True, text=True)
        out.append(f"== {src} sm_{arch} rc={r.returncode}\n" + "\n".join(
            ln for ln in (r.stderr + r.stdout).splitlines() if "Compiling entry" in ln or "Used" in ln
            or "spill" in ln or "error" in ln))
    return "\n".join(out)


def _triton_ops():
    try:
        from areal_tik.kernels import attention as ta
        return ta.attention_varlen_triton, ta.attention_paged_triton, None
    except Exception as e:
        return None, None, f"{type(e).__name__}: {e}"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--elementwise-only", action="store_true",
                    help="only the RMSNorm / RoPE / KV-write cells (skips the attention sections and ptxas report)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rec = Recorder("bench_cuda", args.out)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "commit": rec.env["commit"], "command": rec.env["command"], "prefill": [], "decode": [], "notes": []}
    cc = torch.cuda.get_device_capability()
    arch = f"{cc[0]}{cc[1]}" + ("a" if cc == (9, 0) else "")

    # ---- build ---------------------------------------------------------------------------
    t0 = time.time()
    from areal_tik.kernels.cuda import loader as cuda_ext
    try:
        from areal_tik import _C  # noqa: F401
        prebuilt = True
    except ImportError:
        prebuilt = False
    try:
        from areal_tik.kernels.cuda import attention as cuda_attention, elementwise as cuda_elementwise, extension as cuda_extension
        mod = cuda_extension.extension()
        res["cuda_decode_merge"] = cuda_attention.DECODE_MERGE  # the default the "cuda" timings ran
        res["cuda_prefill_kernel"] = cuda_extension.PREFILL_KERNEL
        res["wgmma_prefill_available"] = bool(mod.wgmma_prefill_available())
        res["build"] = {"ok": True, "prebuilt": prebuilt, "seconds": round(time.time() - t0, 1),
                        "module": getattr(mod, "__file__", str(mod))}
    except Exception as e:
        res["build"] = {"ok": False, "prebuilt": prebuilt, "seconds": round(time.time() - t0, 1), "error": str(e)[-3000:]}
        print("CUDA extension build/load FAILED:\n", e)
        json.dump(res, open(os.path.join(args.out, "bench_cuda.json"), "w"), indent=1)
        return 1
    print(f"extension: {'prebuilt' if prebuilt else 'JIT'} load/build {res['build']['seconds']} s "
          f"({res['build']['module']})")
    if not args.elementwise_only:
        t1 = time.time()
        res["ptxas"] = _ptxas_report(arch)
        res["ptxas_seconds"] = round(time.time() - t1, 1)
        res["kernel_attrs"] = cuda_attention.describe()
        print(res["ptxas"])
        print(res["kernel_attrs"])
    _ = cuda_ext

    try:  # every section's rows so far reach the JSON even if a later one fails
        if args.elementwise_only:
            warm_up_clocks(1.0)  # the attention sections otherwise run first
            _elementwise_section(res, args, cuda_elementwise, rec)
        else:
            _sections(res, args, cuda_attention, cuda_elementwise, rec)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        json.dump(res, open(os.path.join(args.out, "bench_cuda.json"), "w"), indent=1)
        print(f"wrote {os.path.join(args.out, 'bench_cuda.json')} and {rec.write()}")
    return 0


def _sections(res, args, cuda_attention, cuda_elementwise, rec):
    """Prefill, training attention, decode and wide-table decode cells, appended to res as they finish."""
    tri_varlen, tri_paged, tri_why = _triton_ops()
    if tri_why:
        res["notes"].append(f"triton attention unavailable: {tri_why}")
    F = torch.nn.functional
    dev = "cuda"
    torch.manual_seed(0)

    # ---- prefill -------------------------------------------------------------------------
    for L in ((1024, 4096) if args.quick else (1024, 4096, 8192, 16384)):
        q = torch.randn(L, HQ, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(L, HKV, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(L, HKV, D, device=dev, dtype=torch.bfloat16)
        cu = torch.tensor([0, L], dtype=torch.int32, device=dev)
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
        row = {"L": L}
        flops = 2.0 * L * L * D * HQ  # causal: half of 4*L^2*D*H
        with torch.no_grad():
            sd = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)  # noqa: E731
            row["sdpa_ms"] = rec.time(f"prefill L={L}", "sdpa", sd)
            ref = sd()[0].transpose(0, 1)
            cf = lambda: cuda_attention.attention_varlen_cuda(q, k, v, cu, L)  # noqa: E731
            row["cuda_ms"] = rec.time(f"prefill L={L}", "cuda", cf)
            row["cuda_max_abs_diff_vs_sdpa"] = float((cf().float() - ref.float()).abs().max())
            # the mma.sync prefill kernel side by side (auto runs the wgmma kernel on sm_90a)
            cm = lambda: cuda_attention.attention_varlen_cuda(q, k, v, cu, L, prefill_kernel="mma")  # noqa: E731
            row["cuda_mma_ms"] = rec.time(f"prefill L={L}", "cuda_mma", cm)
            row["cuda_bits_equal_mma"] = bool(torch.equal(cf(), cm()))
            if tri_varlen is not None:
                try:
                    tf = lambda: tri_varlen(q, k, v, cu, L)  # noqa: E731
                    row["triton_ms"] = rec.time(f"prefill L={L}", "triton", tf)
                except Exception as e:
                    row["triton_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        for p in ("sdpa", "cuda", "cuda_mma", "triton"):
            if f"{p}_ms" in row:
                row[f"{p}_tflops"] = round(flops / (row[f"{p}_ms"] * 1e-3) / 1e12, 1)
        row["cuda_speedup_vs_sdpa"] = round(row["sdpa_ms"] / row["cuda_ms"], 3)
        row["cuda_speedup_vs_mma"] = round(row["cuda_mma_ms"] / row["cuda_ms"], 3)
        if "triton_ms" in row:
            row["cuda_speedup_vs_triton"] = round(row["triton_ms"] / row["cuda_ms"], 3)
        res["prefill"].append(row)
        print(f"prefill L={L:6d}: sdpa {row['sdpa_ms']:.3f} ms  cuda {row['cuda_ms']:.3f} ms "
              f"({row['cuda_speedup_vs_sdpa']}x, {row['cuda_tflops']} TF/s; mma.sync {row['cuda_mma_ms']:.3f} ms, bits equal {row['cuda_bits_equal_mma']})  triton {row.get('triton_ms', float('nan')):.3f} ms")
        del q, k, v, qs, ks, vs
        torch.cuda.empty_cache()

    # ---- training attention: forward + backward --------------------------------------------
    # cuda = the csrc forward (it also writes each row's lse) + the default backward on it; triton = the
    # Triton forward + the same backward; SDPA on [B, H, L, D] (equal lengths, so the same attention).
    res["train_attention"] = []
    from areal_tik.kernels.attention import flash_backward as attention_backward
    bwd_default = attention_backward.ATTN_BACKWARD
    for B, L, hq, hkv in ((16, 1024, 12, 2), (4, 4096, 32, 8)):
        T = B * L
        q = torch.randn(T, hq, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(T, hkv, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(T, hkv, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(T, hq, D, device=dev, dtype=torch.bfloat16)
        cu = torch.arange(0, T + 1, L, dtype=torch.int32, device=dev)
        qs, ks, vs = (t.detach().view(B, L, -1, D).transpose(1, 2).contiguous().requires_grad_(True)
                      for t in (q, k, v))
        dos = do.view(B, L, hq, D).transpose(1, 2).contiguous()
        row = {"batch": B, "L": L, "hq": hq, "hkv": hkv}

        def fb(f, inputs, g):
            out = f()
            torch.autograd.grad(out, inputs, g)
        provs = {"sdpa": (lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True),
                          (qs, ks, vs), dos),
                 "cuda": (lambda: cuda_attention.attention_varlen_cuda(q, k, v, cu, L), (q, k, v), do)}
        # the same csrc forward with the backward forced to the Triton recompute (kernels/attention/flash_backward.py)
        provs["cuda_tritonbwd"] = provs["cuda"]
        if tri_varlen is not None:
            provs["triton"] = (lambda: tri_varlen(q, k, v, cu, L), (q, k, v), do)
        row["attn_backward_auto"] = attention_backward.select_backward(q, k)
        for name, (f, inputs, g) in provs.items():
            attention_backward.ATTN_BACKWARD = "triton" if name == "cuda_tritonbwd" else bwd_default
            try:
                row[f"{name}_fwd_bwd_ms"] = rec.time(f"train B={B} L={L} {hq}/{hkv} fwd+bwd", name,
                                                      lambda: fb(f, inputs, g), iters=10)
                if name != "cuda_tritonbwd":
                    with torch.no_grad():
                        row[f"{name}_fwd_ms"] = rec.time(f"train B={B} L={L} {hq}/{hkv} fwd", name, f, iters=10)
            except Exception as e:
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            finally:
                attention_backward.ATTN_BACKWARD = bwd_default
        for name in ("sdpa", "triton", "cuda_tritonbwd"):
            if f"{name}_fwd_bwd_ms" in row and "cuda_fwd_bwd_ms" in row:
                row[f"cuda_speedup_vs_{name}"] = round(row[f"{name}_fwd_bwd_ms"] / row["cuda_fwd_bwd_ms"], 3)
        res["train_attention"].append(row)
        print(f"train attention B={B} L={L} {hq}/{hkv}: fwd+bwd sdpa {row.get('sdpa_fwd_bwd_ms', float('nan')):.3f} ms  "
              f"cuda {row.get('cuda_fwd_bwd_ms', float('nan')):.3f} ms  triton {row.get('triton_fwd_bwd_ms', float('nan')):.3f} ms"
              f"  (fwd only: {row.get('sdpa_fwd_ms', float('nan')):.3f} / {row.get('cuda_fwd_ms', float('nan')):.3f} / "
              f"{row.get('triton_fwd_ms', float('nan')):.3f}); cuda with the Triton backward "
              f"{row.get('cuda_tritonbwd_fwd_bwd_ms', float('nan')):.3f} ms; auto backward: {row['attn_backward_auto']}")
        del q, k, v, qs, ks, vs, do, dos
        torch.cuda.empty_cache()

    # ---- decode --------------------------------------------------------------------------
    batches = (1, 16) if args.quick else (1, 4, 8, 16)
    ctxs = (1024, 8192) if args.quick else (128, 1024, 4096, 8192)
    for B in batches:
        for ctx in ctxs:
            q, kc, vc, bt, cq, sk = decode_case(B, ctx, device=dev)
            qq, kk, vv = sdpa_layout(q, kc, vc, bt, ctx)  # SDPA on contiguous K/V gathered from the same pages
            row = {"batch": B, "ctx": ctx}
            kv_bytes = 2.0 * B * ctx * HKV * D * 2
            with torch.no_grad():
                sd = lambda: F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)  # noqa: E731
                ref = sd().view(B, HQ, D)
                fn, how = _graphed(sd)
                row["sdpa_ms"], row["sdpa_timing"] = rec.time(f"decode B={B} ctx={ctx}", "sdpa", fn), how
                cf = lambda: cuda_attention.attention_paged_cuda(q, kc, vc, bt, cq, sk, 1)  # noqa: E731
                row["cuda_max_abs_diff_vs_sdpa"] = float((cf().float() - ref.float()).abs().max())
                fn, how = _graphed(cf)
                row["cuda_ms"], row["cuda_timing"] = rec.time(f"decode B={B} ctx={ctx}", "cuda", fn), how
                c2 = lambda: cuda_attention.attention_paged_cuda(q, kc, vc, bt, cq, sk, 1, decode_merge="kernel")  # noqa: E731
                row["cuda_fused_bits_equal_2launch"] = bool(torch.equal(cf(), c2()))
                fn, how = _graphed(c2)
                row["cuda_2launch_ms"], row["cuda_2launch_timing"] = rec.time(f"decode B={B} ctx={ctx}", "cuda_2launch", fn), how
                row["cuda_speedup_vs_2launch"] = round(row["cuda_2launch_ms"] / row["cuda_ms"], 3)
                if tri_paged is not None:
                    try:
                        tf = lambda: tri_paged(q, kc, vc, bt, cq, sk, 1)  # noqa: E731
                        fn, how = _graphed(tf)
                        row["triton_ms"], row["triton_timing"] = rec.time(f"decode B={B} ctx={ctx}", "triton", fn), how
                    except Exception as e:
                        row["triton_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            for p in ("sdpa", "cuda", "cuda_mma", "triton"):
                if f"{p}_ms" in row:
                    gbs = kv_bytes / (row[f"{p}_ms"] * 1e-3) / 1e9
                    row[f"{p}_GBps"] = round(gbs, 1)
                    row[f"{p}_frac_of_4.1TBps"] = round(gbs * 1e9 / PEAK_BW, 3)
            row["cuda_speedup_vs_sdpa"] = round(row["sdpa_ms"] / row["cuda_ms"], 3)
            row["floor_us_at_4.1TBps"] = round(kv_bytes / PEAK_BW * 1e6, 2)
            if "triton_ms" in row:
                row["cuda_speedup_vs_triton"] = round(row["triton_ms"] / row["cuda_ms"], 3)
            res["decode"].append(row)
            print(f"decode B={B:2d} ctx={ctx:5d}: sdpa {row['sdpa_ms'] * 1e3:7.1f} us  cuda {row['cuda_ms'] * 1e3:7.1f} us "
                  f"({row['cuda_speedup_vs_sdpa']}x, {row['cuda_GBps']} GB/s)  "
                  f"2-launch {row['cuda_2launch_ms'] * 1e3:7.1f} us (bits equal: {row['cuda_fused_bits_equal_2launch']})  "
                  f"floor {row['floor_us_at_4.1TBps']:6.2f} us  "
                  f"triton {row.get('triton_ms', float('nan')) * 1e3:7.1f} us  [{row['cuda_timing'][:5]}]")
            del kc, vc, kk, vv
            torch.cuda.empty_cache()

    # ---- decode, wide block table (engine-shaped: table sized for 8K contexts) -------------
    res["decode_wide_table"] = []
    wide_pages = 8192 // PAGE
    for B in (1, 16):
        for ctx in (128, 1024):
            q, kc, vc, bt, cq, sk = decode_case(B, ctx, table_pages=wide_pages, device=dev)
            row = {"batch": B, "ctx": ctx, "table_positions": wide_pages * PAGE}
            with torch.no_grad():
                cf = lambda: cuda_attention.attention_paged_cuda(q, kc, vc, bt, cq, sk, 1, decode_merge="fused")  # noqa: E731
                c2 = lambda: cuda_attention.attention_paged_cuda(q, kc, vc, bt, cq, sk, 1, decode_merge="kernel")  # noqa: E731
                row["bits_equal"] = bool(torch.equal(cf(), c2()))
                fn, how = _graphed(cf)
                row["cuda_fused_ms"], row["cuda_fused_timing"] = rec.time(f"decode wide B={B} ctx={ctx}", "cuda", fn), how
                fn, how = _graphed(c2)
                row["cuda_2launch_ms"], row["cuda_2launch_timing"] = rec.time(f"decode wide B={B} ctx={ctx}", "cuda_2launch",
                                                                               fn), how
            row["fused_speedup"] = round(row["cuda_2launch_ms"] / row["cuda_fused_ms"], 3)
            res["decode_wide_table"].append(row)
            print(f"decode wide table B={B:2d} ctx={ctx:5d}: fused {row['cuda_fused_ms'] * 1e3:7.1f} us  "
                  f"2-launch {row['cuda_2launch_ms'] * 1e3:7.1f} us  ({row['fused_speedup']}x, bits equal: "
                  f"{row['bits_equal']})")
            del kc, vc
            torch.cuda.empty_cache()

    _elementwise_section(res, args, cuda_elementwise, rec)


def _elementwise_section(res, args, cuda_elementwise, rec):
    """RMSNorm, RoPE and the KV-cache write, csrc vs Triton (1.5B shapes: hidden 1536, 12 q / 2 kv heads,
    D 128), per token count: forward in a CUDA graph (decode-sized T is launch-bound), and forward +
    backward of RMSNorm and RoPE at training T. The registry default per op follows these cells."""
    from areal_tik.dispatch import ops
    from areal_tik.dispatch.registry import implementations
    from areal_tik.kernels import kv_cache as tkv, rms_norm as trn, rope as trp
    dev = "cuda"
    res["elementwise"] = []
    # An agent export registered as this arch's cuda rms_norm (kernels/exported/rms_norm_<arch>.py) is timed
    # beside the csrc root it was grown from.
    rms_src = implementations()["rms_norm"]["cuda"].sources[0]
    exported = "/exported/" in rms_src.replace("\\", "/")
    res["rms_norm_cuda_export"] = os.path.relpath(rms_src, ROOT) if exported else None
    cos, sin = trp.rope_table(D, 32768, 1000000.0, device=dev)
    for T in ((16, 16384) if args.quick else (1, 64, 1024, 16384)):
        x = torch.randn(T, 1536, device=dev, dtype=torch.bfloat16)
        w = torch.randn(1536, device=dev, dtype=torch.bfloat16)
        q = torch.randn(T, 12, D, device=dev, dtype=torch.bfloat16)
        kk, vv = (torch.randn(T, 2, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        pos = torch.randint(0, 32768, (T,), device=dev)
        kc, vc = (torch.zeros(max(T, 64) // 64 + 1, 64, 2, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        slots = torch.randperm(kc.shape[0] * 64, device=dev)[:T]
        provs = {
            "rms_norm": (lambda: cuda_elementwise.rms_norm_cuda(x, w, 1e-6), lambda: trn.rms_norm_triton(x, w, 1e-6)),
            "apply_rope": (lambda: cuda_elementwise.apply_rope_cuda(q, cos, sin, pos),
                           lambda: trp.apply_rope_triton(q, cos, sin, pos)),
            "kv_cache_write": (lambda: cuda_elementwise.kv_cache_write_cuda(kk, vv, kc, vc, slots),
                               lambda: tkv.kv_cache_write_triton(kk, vv, kc, vc, slots)),
        }
        for op, (cf, tf) in provs.items():
            row = {"op": op, "tokens": T}
            arms = [("cuda", cf), ("triton", tf)]
            if op == "rms_norm" and exported:
                arms.append(("cuda_export", lambda: ops.rms_norm(x, w, 1e-6, backend="cuda")))
            with torch.no_grad():
                for name, f in arms:
                    fn, how = _graphed(f)
                    row[f"{name}_fwd_us"], row[f"{name}_timing"] = round(rec.time(f"{op} T={T} fwd", name, fn) * 1e3, 2), how
            row["cuda_speedup_fwd"] = round(row["triton_fwd_us"] / row["cuda_fwd_us"], 3)
            extra = ""
            if "cuda_export_fwd_us" in row:
                row["cuda_export_speedup_fwd"] = round(row["triton_fwd_us"] / row["cuda_export_fwd_us"], 3)
                extra = f"  agent export {row['cuda_export_fwd_us']:8.2f} us ({row['cuda_export_speedup_fwd']}x)"
            res["elementwise"].append(row)
            print(f"{op:14s} T={T:6d}: fwd cuda {row['cuda_fwd_us']:8.2f} us  triton {row['triton_fwd_us']:8.2f} us "
                  f"({row['cuda_speedup_fwd']}x){extra}")
        if T >= 1024:  # training: forward + backward (autograd wrappers of each backend)
            xg, qg = x.clone().requires_grad_(True), q.clone().requires_grad_(True)
            wg = w.clone().requires_grad_(True)
            gx, gq = torch.randn_like(x), torch.randn_like(q)
            train = {"rms_norm": ((lambda: cuda_elementwise.rms_norm_cuda(xg, wg, 1e-6)),
                                  (lambda: trn.rms_norm_triton(xg, wg, 1e-6)), (xg, wg), gx),
                     "apply_rope": ((lambda: cuda_elementwise.apply_rope_cuda(qg, cos, sin, pos)),
                                    (lambda: trp.apply_rope_triton(qg, cos, sin, pos)), (qg,), gq)}
            for op, (cf, tf, inputs, g) in train.items():
                row = {"op": op, "tokens": T, "mode": "forward+backward"}
                for name, f in (("cuda", cf), ("triton", tf)):
                    row[f"{name}_fwd_bwd_us"] = round(rec.time(
                        f"{op} T={T} fwd+bwd", name, lambda: torch.autograd.grad(f(), inputs, g), iters=10) * 1e3, 2)
                row["cuda_speedup_fwd_bwd"] = round(row["triton_fwd_bwd_us"] / row["cuda_fwd_bwd_us"], 3)
                res["elementwise"].append(row)
                print(f"{op:14s} T={T:6d}: fwd+bwd cuda {row['cuda_fwd_bwd_us']:8.2f} us  triton "
                      f"{row['triton_fwd_bwd_us']:8.2f} us ({row['cuda_speedup_fwd_bwd']}x)")


if __name__ == "__main__":
    sys.exit(main())
