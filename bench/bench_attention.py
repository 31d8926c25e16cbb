"""Benchmark: unified attention vs PyTorch SDPA (flash / cuDNN backends) on one GPU.

    python bench/bench_attention.py --out DIR [--quick]

Writes DIR/bench_attention.json and DIR/rows.csv (bench/harness.py) and prints a compact table last. Cells:
- prefill/training forward, batch 1, 32 q heads, 8 kv heads, d=128, causal, L in 1K/4K/8K/16K
  (ours: attention_varlen; SDPA: [1, H, L, D] with is_causal, GQA via enable_gqa, else
  K/V repeated outside the timed region);
- decode, batch {1,4,8,16} x context {128,1K,4K,8K} (ours: attention_paged over a paged
  cache, page 16 and 64; SDPA: one query over contiguous KV); CUDA-graph timing;
- backward at 4K (time of ``out.backward``, graph retained).
speedup = SDPA ms / ours ms (> 1 means we are faster); best SDPA backend is the baseline.
Median times from triton.testing.do_bench / do_bench_cudagraph (through bench/harness.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from harness import Recorder, time_ms  # noqa: E402

COPY_TBPS = 4.1  # measured device copy rate on the H200 (docs/results.md)
HQ, HKV, D = 32, 8, 128


def _bench(fn, graph=False):
    """Median ms: triton's do_bench_cudagraph for graph-captured decode cells, else do_bench (harness.time_ms)."""
    if graph:
        return time_ms(fn, "cudagraph", rep_ms=30).p50
    return time_ms(fn, "do_bench", warmup_ms=10, rep_ms=40).p50


def _sdpa_backends():
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def _sdpa_fn(backend, q, k, v, causal):
    """A callable for one SDPA backend (GQA native if supported, else pre-repeated K/V)."""
    from torch.nn.attention import sdpa_kernel
    g = q.shape[1] // k.shape[1]
    try:
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

        def fn():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return fn, "enable_gqa"
    except Exception:
        kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(q, kr, vr, is_causal=causal)

        def fn():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, kr, vr, is_causal=causal)
        return fn, "repeat_kv"


def _best_sdpa(q, k, v, causal, graph=False):
    res = {}
    for name, be in _sdpa_backends().items():
        try:
            fn, mode = _sdpa_fn(be, q, k, v, causal)
            res[name] = {"ms": _bench(fn, graph), "gqa": mode}
        except Exception as e:  # backend unsupported for this shape
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
    ok = {n: r["ms"] for n, r in res.items() if "ms" in r}
    best = min(ok, key=ok.get) if ok else None
    return res, best, (ok[best] if best else float("nan"))


def bench_prefill(lengths, rows):
    from areal_tik.kernels.attention import attention_varlen_triton, attention_reference  # noqa: F401
    for L in lengths:
        q = torch.randn(L, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(L, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(L, HKV, D, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
        ours = _bench(lambda: attention_varlen_triton(q, k, v, cu, L))
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        sd, best, sms = _best_sdpa(qs, ks, vs, True)
        out = attention_varlen_triton(q, k, v, cu, L)
        ref = F.scaled_dot_product_attention(qs, ks.repeat_interleave(4, 1), vs.repeat_interleave(4, 1),
                                             is_causal=True)[0].transpose(0, 1)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        flops = 2.0 * HQ * D * L * L  # causal: half of 4*L^2*H*D
        rows.append(dict(kind="prefill", L=L, ms=ours, tflops=flops / ours / 1e9, sdpa_ms=sms, sdpa_best=best,
                         sdpa=sd, speedup=sms / ours, rel_err_vs_sdpa=err))


def bench_decode(batches, ctxs, pages, rows):
    from areal_tik.kernels.attention import attention_paged_triton
    for page in pages:
        for B in batches:
            for ctx in ctxs:
                npg = math.ceil(ctx / page)
                kc = torch.randn(B * npg, page, HKV, D, device="cuda", dtype=torch.bfloat16)
                vc = torch.randn_like(kc)
                bt = torch.randperm(B * npg, device="cuda", dtype=torch.int64).int().view(B, npg)
                q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
                cuq = torch.arange(B + 1, dtype=torch.int32, device="cuda")
                sk = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
                fn = lambda: attention_paged_triton(q, kc, vc, bt, cuq, sk, 1)  # noqa: E731
                fn()
                ours = _bench(fn, graph=True)
                # SDPA: contiguous KV of the same content
                slots = (bt.long()[:, :, None] * page + torch.arange(page, device="cuda")).view(B, -1)[:, :ctx]
                kcont = kc.view(-1, HKV, D)[slots].permute(0, 2, 1, 3).contiguous()
                vcont = vc.view(-1, HKV, D)[slots].permute(0, 2, 1, 3).contiguous()
                qs = q.unsqueeze(2)
                sd, best, sms = _best_sdpa(qs, kcont, vcont, False, graph=True)
                ref = F.scaled_dot_product_attention(qs, kcont.repeat_interleave(4, 1), vcont.repeat_interleave(4, 1))
                out = fn()
                err = float((out.float() - ref[:, :, 0].float()).norm() / ref.float().norm())
                kv_bytes = 2.0 * B * ctx * HKV * D * 2
                gbs = kv_bytes / ours / 1e6
                rows.append(dict(kind="decode", page=page, B=B, ctx=ctx, ms=ours, gbps=gbs,
                                 pct_copy=100 * gbs / (COPY_TBPS * 1000), sdpa_ms=sms, sdpa_best=best, sdpa=sd,
                                 sdpa_gbps=kv_bytes / sms / 1e6 if sms == sms else None,
                                 speedup=sms / ours, rel_err_vs_sdpa=err))


def bench_backward(L, rows):
    from areal_tik.kernels.attention import attention_varlen_triton
    q = torch.randn(L, HQ, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(L, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(L, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    g = torch.randn(L, HQ, D, device="cuda", dtype=torch.bfloat16)
    out = attention_varlen_triton(q, k, v, cu, L)
    ours = _bench(lambda: out.backward(g, retain_graph=True))
    res = {}
    for name, be in _sdpa_backends().items():
        from torch.nn.attention import sdpa_kernel
        try:
            qs = q.detach().transpose(0, 1).unsqueeze(0).requires_grad_()
            ks = k.detach().transpose(0, 1).unsqueeze(0).repeat_interleave(4, 1).requires_grad_()
            vs = v.detach().transpose(0, 1).unsqueeze(0).repeat_interleave(4, 1).requires_grad_()
            with sdpa_kernel([be]):
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            gs = g.transpose(0, 1).unsqueeze(0)
            res[name] = {"ms": _bench(lambda: o.backward(gs, retain_graph=True)), "gqa": "repeat_kv"}
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
    ok = {n: r["ms"] for n, r in res.items() if "ms" in r}
    best = min(ok, key=ok.get) if ok else None
    sms = ok[best] if best else float("nan")
    flops = 2.5 * 2.0 * HQ * D * L * L
    rows.append(dict(kind="backward", L=L, ms=ours, tflops=flops / ours / 1e9, sdpa_ms=sms, sdpa_best=best,
                     sdpa=res, speedup=sms / ours))


def geomean(xs):
    xs = [x for x in xs if x and x == x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    t0 = time.time()
    rows = []
    quick = a.quick
    bench_prefill([1024, 4096] if quick else [1024, 4096, 8192, 16384], rows)
    bench_decode([1, 16] if quick else [1, 4, 8, 16], [128, 4096] if quick else [128, 1024, 4096, 8192],
                 [64] if quick else [16, 64], rows)
    bench_backward(4096, rows)
    summary = {k: geomean([r["speedup"] for r in rows if r["kind"] == k]) for k in ("prefill", "decode", "backward")}
    summary["all"] = geomean([r["speedup"] for r in rows])
    from areal_tik.kernels import attention as A
    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, meta=A.META, shape=dict(HQ=HQ, HKV=HKV, D=D),
                copy_tbps=COPY_TBPS, seconds=round(time.time() - t0, 1), quick=quick)
    rec = Recorder("bench_attention", a.out)
    info.update(commit=rec.env["commit"], command=rec.env["command"])
    with open(os.path.join(a.out, "bench_attention.json"), "w") as f:
        json.dump(dict(info=info, rows=rows, geomean_speedup=summary), f, indent=1, default=str)
    for r in rows:  # medians (the JSON's figures) as harness rows
        case = f"decode page={r['page']} B={r['B']} ctx={r['ctx']}" if r["kind"] == "decode" else f"{r['kind']} L={r['L']}"
        rec.add(case, "triton", "time", r["ms"], "ms")
        if r["sdpa_best"]:
            rec.add(case, f"sdpa_{r['sdpa_best']}", "time", r["sdpa_ms"], "ms")
    rec.write()
    print(f"{'cell':34s} {'ours ms':>9s} {'sdpa ms':>9s} {'speedup':>8s}  rate")
    for r in rows:
        if r["kind"] == "decode":
            cell = f"decode p{r['page']} B{r['B']} ctx{r['ctx']}"
            rate = f"{r['gbps']:.0f} GB/s ({r['pct_copy']:.0f}% copy)"
        else:
            cell = f"{r['kind']} L{r['L']}"
            rate = f"{r['tflops']:.0f} TFLOP/s"
        print(f"{cell:34s} {r['ms']:9.4f} {r['sdpa_ms']:9.4f} {r['speedup']:8.2f}  {rate} [{r['sdpa_best']}]")
    print("geomean speedup vs best SDPA:", {k: (round(v, 3) if v else None) for k, v in summary.items()},
          f"({info['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
