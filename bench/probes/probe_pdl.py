"""What programmatic dependent launch (PDL) would give a 7B decode step's GEMM chain.

A decode step at B 64 is ~112 back-to-back GEMMs (stacked q/k/v, o, gate/up and down of 28 layers), each reading
its weights once; between two kernels the GPU drains the first one's last wave before the next one's programs
start. With PDL (``launch_pdl=True``, Hopper and later) the next kernel's programs may start while the previous one
finishes and wait at ``griddepcontrol.wait`` for its results; what does not depend on the previous kernel (the
first weight tile) can be loaded before the wait. Arithmetic and reduction order are untouched, so a kernel's bits
cannot change.

The chain here is the real data flow (each GEMM reads the previous one's output), on the 7B shapes, 28 layers of
distinct weights (not L2-resident), in one CUDA graph, timed per replay, with a probe-local Triton GEMM in five
forms: ``plain``; ``pdl`` (launched with PDL, dependents released at the start, wait first); ``pdl_prefetch`` (the
first weight tile loaded before the wait); ``pdl_late`` and ``pdl_late_prefetch`` (dependents released after the K
loop, so the next kernel's programs start as this one's finish). cuBLAS (``torch.mm`` into the same buffers) is
the reference. Every Triton form's final output is compared bit for bit with ``plain`` (a race would show), the
buffers poisoned with NaN before each form's first replay.

    python bench/probes/probe_pdl.py --out $OUT [--m 64] [--layers 28] [--replays 20] [--stages 3]

Writes ``pdl.json`` and prints one line per form. Measured (H100, docs/results.md): at most 1.005x over ``plain``.
"""
from __future__ import annotations

import argparse
import json
import os

# (name, N, K, BLOCK_N): the stacked 7B layer at decode M; each GEMM reads the first K columns of the previous output
LAYER = (("qkv", 4608, 3584, 32), ("o", 3584, 3584, 32), ("gate_up", 37888, 3584, 128), ("down", 3584, 18944, 32))


def _kernel():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def gemm(x_ptr, w_ptr, y_ptr, K, stride_x, stride_y,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             PDL: tl.constexpr, PREFETCH: tl.constexpr, LATE: tl.constexpr):
        """y[m, n] = sum_k x[m, k] w[n, k], K ascending in BLOCK_K steps (shapes divide the blocks)."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + offs_n[:, None] * K + offs_k[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_x + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        start = 0
        if PDL:
            if PREFETCH:
                w0 = tl.load(w_ptrs)            # weights: written by no earlier kernel
                if not LATE:
                    gdc_launch_dependents()
                gdc_wait()
                acc = tl.dot(tl.load(x_ptrs), tl.trans(w0), acc)
                start = BLOCK_K
            else:
                if not LATE:
                    gdc_launch_dependents()
                gdc_wait()
        for k in range(start, K, BLOCK_K):
            acc = tl.dot(tl.load(x_ptrs + k), tl.trans(tl.load(w_ptrs + k)), acc)
        if PDL and LATE:
            gdc_launch_dependents()             # the next kernel's programs start as this one's finish
        y_ptrs = y_ptr + offs_m[:, None] * stride_y + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty))

    return gemm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--stages", type=int, default=4,
                    help="num_stages of every form (the prefetch form holds one tile more)")
    a = ap.parse_args()
    if a.m < 64 or a.m % 64:
        ap.error(f"--m must be a positive multiple of 64 (the probe's row tile), got {a.m}")
    import torch

    gemm = _kernel()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    M = a.m
    weights = [[(torch.randn((n, k), generator=g, device=dev, dtype=torch.bfloat16) * k ** -0.5)
                for _, n, k, _ in LAYER] for _ in range(a.layers)]
    outs = {name: torch.empty((M, n), device=dev, dtype=torch.bfloat16) for name, n, _, _ in LAYER}
    x0 = torch.randn((M, LAYER[0][2]), generator=g, device=dev, dtype=torch.bfloat16)

    def chain(form: str):
        x = x0
        for layer in weights:
            for (name, n, k, bn), w in zip(LAYER, layer):
                y = outs[name]
                if form == "cublas":
                    torch.mm(x[:, :k], w.t(), out=y)
                else:
                    pdl = form != "plain"
                    gemm[(n // bn, M // 64)](x, w, y, k, x.stride(0), y.stride(0), BLOCK_M=64, BLOCK_N=bn,
                                             BLOCK_K=128, PDL=pdl, PREFETCH="prefetch" in form,
                                             LATE="late" in form,
                                             num_warps=4, num_stages=a.stages, launch_pdl=pdl)
                x = y
        return x

    res = {"device": torch.cuda.get_device_name(), "m": M, "layers": a.layers, "num_stages": a.stages, "forms": {}}
    ref = None
    for form in ("plain", "pdl", "pdl_prefetch", "pdl_late", "pdl_late_prefetch", "cublas"):
        try:
            chain(form)                                   # compile / warm outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                last = chain(form)
            for t in outs.values():
                t.fill_(float("nan"))                     # poison: a replay must write every output
            graph.replay()
            torch.cuda.synchronize()
            got = last.clone()
            if ref is None:
                ref = got
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(a.replays):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            times.sort()
            med = times[len(times) // 2]
            row = {"ms_per_chain": round(med, 4), "us_per_gemm": round(1e3 * med / (4 * a.layers), 2),
                   "min_ms": round(times[0], 4), "finite": bool(torch.isfinite(got).all())}
            if form != "cublas":                          # cuBLAS reduces in its own order: other bits
                row["equal_to_plain"] = bool(torch.equal(got, ref))
        except Exception as e:  # noqa: BLE001 - a form this Triton/driver cannot launch is recorded, not fatal
            row = {"error": f"{type(e).__name__}: {e}"[:300]}
        res["forms"][form] = row
        print(form, row, flush=True)
    base = res["forms"]["plain"].get("ms_per_chain")
    for form, row in res["forms"].items():
        if base and row.get("ms_per_chain"):
            row["speedup_vs_plain"] = round(base / row["ms_per_chain"], 4)
    weight_bytes = sum(w.numel() * w.element_size() for layer in weights for w in layer)
    res["weight_gb"] = round(weight_bytes / 1e9, 3)
    os.makedirs(a.out, exist_ok=True)
    json.dump(res, open(os.path.join(a.out, "pdl.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
