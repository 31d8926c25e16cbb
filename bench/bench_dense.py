"""Dense-kernel benchmark (H200): our linear vs cuBLAS F.linear side by side, fused
token_logprobs vs the unfused path, rms_norm / rope / silu_mul vs torch.

    python bench/bench_dense.py --out DIR [--quick]     -> DIR/bench_dense.json, DIR/rows.csv + a table

Timing (bench/harness.py): triton.testing.do_bench (median of its repetitions after warm-up); inputs rotate
over several buffers for small shapes so weights/activations do not stay in L2 when the
working set is small (decode). Reports TFLOP/s, HBM GB/s for M <= 64 (vs a 4.1 TB/s copy
rate) and the ratio to cuBLAS. For M <= 256, or cuBLAS under 0.1 ms, the reported time is the kernel time inside a
CUDA graph (one replay calls every rotating buffer once), because eager timings of such
small launches are dominated by host overhead that varied 4x between two H200 machines;
the eager numbers stay in the row (``*_eager_ms``, ``eager_ratio``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness

from areal_tik.kernels import linear as L, logprobs as LP, rms_norm as R, rope as P, swiglu as S  # noqa: E402
from harness import Recorder, graphed, time_ms  # noqa: E402

COPY_TBS = 4.1
SHAPES = {  # name: (N, K)
    "1.5b_qkv": (1536 + 2 * 256, 1536), "1.5b_o": (1536, 1536), "1.5b_gate_up": (2 * 8960, 1536),
    "1.5b_down": (1536, 8960), "7b_qkv": (3584 + 2 * 512, 3584), "7b_o": (3584, 3584),
    "7b_gate_up": (2 * 18944, 3584), "7b_down": (3584, 18944), "1.5b_lm_head": (151936, 1536),
    # HF's Qwen2 modules (what the patched model runs) keep q/k/v and gate/up separate: q is o's
    # shape; k and v, gate and up are these (the fused *_qkv / *_gate_up above are not run by it)
    "1.5b_kv": (256, 1536), "1.5b_gate": (8960, 1536), "7b_kv": (512, 3584), "7b_gate": (18944, 3584),
}
MS = (1, 8, 64, 128, 256, 2048, 8192, 16384)  # 128: the A/B rollout's decode batch
L2_BYTES = 60 << 20


def bench(fn, reps=None):
    """Median ms of ``fn`` by triton's do_bench (L2 flushed per repetition; harness.time_ms)."""
    return time_ms(fn, "do_bench", warmup_ms=10, rep_ms=reps or 40).p50


def bench_graphed(call, args_list, reps=50):
    """Kernel time without host launch overhead: one CUDA graph calls ``call`` once per
    argument set; median over replays of (replay time / calls). None if capture fails."""
    replay, how = graphed(lambda: [call(*a) for a in args_list])
    if how != "graph":  # report, never hide: the row says the graphed timing is missing
        print(f"graph timing failed: {how}", flush=True)
        return None
    return time_ms(replay, "events", iters=1, reps=reps, warmup=1).p50 / len(args_list)


def rotating(make, bytes_each):
    n = max(1, min(8, (3 * L2_BYTES) // max(bytes_each, 1)))
    bufs = [make() for _ in range(n)]
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % n
        return bufs[state["i"]]
    nxt.bufs = bufs
    return nxt


def bench_linear(quick):
    rows = []
    shapes = ["1.5b_qkv", "1.5b_down", "7b_gate_up", "7b_down", "1.5b_lm_head"] if quick else list(SHAPES)
    ms = (1, 64, 2048, 8192) if quick else MS
    for name in shapes:
        N, K = SHAPES[name]
        for M in ms:
            if name == "1.5b_lm_head" and M > 8192:
                continue
            wbytes = N * K * 2
            nxt = rotating(lambda: (torch.randn(M, K, device="cuda", dtype=torch.bfloat16),
                                    torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5),
                           wbytes + M * K * 2) if wbytes < 3 * L2_BYTES else None
            if nxt is None:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
                nxt = lambda x=x, w=w: (x, w)  # noqa: E731
            ours = bench(lambda: L.linear_fwd(*nxt()))
            cub = bench(lambda: F.linear(*nxt()))
            eager = dict(ours_eager_ms=ours, cublas_eager_ms=cub, eager_ratio=cub / ours, timing="eager")
            if M <= 256 or cub < 0.1:  # short launches: eager timings include host overhead; use graphs
                bufs = getattr(nxt, "bufs", None) or [nxt()]
                go, gc = bench_graphed(L.linear_fwd, bufs), bench_graphed(F.linear, bufs)
                if go is not None and gc is not None:
                    ours, cub = go, gc
                    eager["timing"] = "cuda-graph"
                else:  # the row's ms/ratio stay eager (host-bound): say so instead of passing them off as kernel time
                    eager["timing"] = "eager (graph capture failed)"
            flops = 2.0 * M * N * K
            byts = wbytes + M * K * 2 + M * N * 2
            r = dict(shape=name, M=M, N=N, K=K, config=L.pick_config(M, N, K), ours_ms=ours, cublas_ms=cub,
                     ours_tflops=flops / ours / 1e9, cublas_tflops=flops / cub / 1e9, ratio=cub / ours, **eager)
            if M <= 64:
                r.update(ours_gbs=byts / ours / 1e6, cublas_gbs=byts / cub / 1e6,
                         ours_frac_copy=byts / ours / 1e9 / (COPY_TBS * 1e3))
            rows.append(r)
            print(f"linear {name:13s} M={M:6d} cfg={r['config']:12s} ours {ours*1e3:9.1f}us cublas {cub*1e3:9.1f}us "
                  f"ratio {r['ratio']:.2f}" + (f"  {r['ours_gbs']:.0f} GB/s" if M <= 64 else
                                               f"  {r['ours_tflops']:.0f} TF/s"), flush=True)
    return rows


def bench_logprobs(quick):
    rows = []
    V, K = 151936, 1536
    w = torch.randn(V, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
    for T in ((1, 64, 4096) if quick else (1, 64, 1024, 4096, 8192)):
        h = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        tok = torch.randint(0, V, (T,), device="cuda")

        def unfused():
            return torch.log_softmax(F.linear(h, w).float() / 0.9, -1).gather(1, tok[:, None])[:, 0]

        def fused():
            return LP.token_logprobs_triton(h, w, tok, 0.9)
        r = dict(T=T, V=V, K=K, unfused="torch: F.linear (cuBLAS) + log_softmax(fp32) + gather",
                 fused="areal_tik token_logprobs_triton")
        for nm, fn in (("fused", fused), ("unfused", unfused)):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            r[f"{nm}_peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            r[f"{nm}_ms"] = bench(fn)
        hg = h.clone().requires_grad_()
        r["fused_fwd_bwd_ms"] = bench(lambda: LP.token_logprobs_triton(hg, w, tok, 0.9).sum().backward())
        r["speedup"] = r["unfused_ms"] / r["fused_ms"]
        rows.append(r)
        print(f"token_logprobs T={T:5d} fused {r['fused_ms']:.3f}ms ({r['fused_peak_extra_mib']:.0f} MiB) "
              f"unfused {r['unfused_ms']:.3f}ms ({r['unfused_peak_extra_mib']:.0f} MiB) fwd+bwd {r['fused_fwd_bwd_ms']:.2f}ms",
              flush=True)
    return rows


def bench_small(quick):
    rows = []
    for T in ((1, 4096) if quick else (1, 64, 4096, 16384)):
        for N in (1536, 3584):
            x = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
            w = torch.ones(N, device="cuda", dtype=torch.bfloat16)

            def torch_rms():
                xf = x.float()
                return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
            a, b = bench(lambda: R.rms_norm_triton(x, w, 1e-6)), bench(torch_rms)
            rows.append(dict(op="rms_norm", T=T, N=N, ours_ms=a, torch_ms=b, ratio=b / a))
        I = 18944
        g = torch.randn(T, I, device="cuda", dtype=torch.bfloat16)
        u = torch.randn(T, I, device="cuda", dtype=torch.bfloat16)
        a, b = bench(lambda: S.silu_mul_triton(g, u)), bench(lambda: F.silu(g) * u)
        rows.append(dict(op="silu_mul", T=T, N=I, ours_ms=a, torch_ms=b, ratio=b / a))
        cos, sin = P.rope_table(128, 32768, 1e6, device="cuda")
        q = torch.randn(T, 28, 128, device="cuda", dtype=torch.bfloat16)
        pos = torch.randint(0, 32768, (T,), device="cuda")

        def torch_rope():
            c, s = cos[pos][:, None].to(q.dtype), sin[pos][:, None].to(q.dtype)
            return q * c + torch.cat([-q[..., 64:], q[..., :64]], -1) * s
        a, b = bench(lambda: P.apply_rope_triton(q, cos, sin, pos)), bench(torch_rope)
        rows.append(dict(op="rope", T=T, N=28 * 128, ours_ms=a, torch_ms=b, ratio=b / a))
    for r in rows:
        print(f"{r['op']:9s} T={r['T']:6d} N={r['N']:6d} ours {r['ours_ms']*1e3:8.1f}us torch {r['torch_ms']*1e3:8.1f}us "
              f"ratio {r['ratio']:.2f}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_dense needs a CUDA GPU")
        return 1
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "quick": a.quick}
    res["linear"] = bench_linear(a.quick)
    res["token_logprobs"] = bench_logprobs(a.quick)
    res["small_ops"] = bench_small(a.quick)
    res["seconds"] = time.time() - t0
    os.makedirs(a.out, exist_ok=True)
    rec = Recorder("bench_dense", a.out)
    res.update(commit=rec.env["commit"], command=rec.env["command"])
    with open(os.path.join(a.out, "bench_dense.json"), "w") as f:
        json.dump(res, f, indent=1)
    for r in res["linear"]:  # medians (the JSON's figures) as harness rows
        case = f"linear {r['shape']} M={r['M']} ({r['timing']})"
        rec.add(case, f"tik {r['config']}", "time", r["ours_ms"], "ms")
        rec.add(case, "cublas", "time", r["cublas_ms"], "ms")
    for r in res["token_logprobs"]:
        for nm in ("fused", "unfused"):
            rec.add(f"token_logprobs T={r['T']}", nm, "time", r[f"{nm}_ms"], "ms")
            rec.add(f"token_logprobs T={r['T']}", nm, "peak extra memory", r[f"{nm}_peak_extra_mib"], "MiB")
    for r in res["small_ops"]:
        rec.add(f"{r['op']} T={r['T']} N={r['N']}", "tik", "time", r["ours_ms"], "ms")
        rec.add(f"{r['op']} T={r['T']} N={r['N']}", "torch", "time", r["torch_ms"], "ms")
    rec.write()
    print("\n== linear vs cuBLAS (ratio = cuBLAS time / ours; >1 means faster)")
    shapes = sorted({r["shape"] for r in res["linear"]}, key=list(SHAPES).index)
    ms = sorted({r["M"] for r in res["linear"]})
    print(f"{'shape':14s}" + "".join(f"{m:>8d}" for m in ms))
    for s in shapes:
        cells = {r["M"]: r["ratio"] for r in res["linear"] if r["shape"] == s}
        print(f"{s:14s}" + "".join(f"{cells[m]:8.2f}" if m in cells else f"{'-':>8s}" for m in ms))
    dec = [r for r in res["linear"] if r["M"] <= 64]
    big = [r for r in res["linear"] if r["M"] >= 2048]
    if dec:
        print(f"decode (M<=64): min ratio {min(r['ratio'] for r in dec):.2f}, "
              f"median HBM {sorted(r['ours_gbs'] for r in dec)[len(dec)//2]:.0f} GB/s of {COPY_TBS*1e3:.0f}")
    if big:
        print(f"large M (>=2048): min ratio {min(r['ratio'] for r in big):.2f}, "
              f"max ours {max(r['ours_tflops'] for r in big):.0f} TFLOP/s")
    print(f"done in {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
