"""Timing of a candidate against its reference versions, in the evaluator's worker process.

Timers: ``gpu`` captures N launches in a CUDA graph per version (rotating through input
copies larger than L2) and alternates versions round by round, reporting the median per
workload; ``simulated`` (CPU) evaluates a cost model (``tasks.simulated_latency_us``),
is labelled SIMULATED in every record, and can never be exported.
"""
from __future__ import annotations

import time


def time_gpu(task, kernels: dict, workloads: list[dict], rounds: int, min_ms: float) -> dict:
    """Interleaved CUDA-graph timing; returns {label: {workload_id: {"median_us", "samples"}}}."""
    import torch  # lazy: keeps torch out of this module's import
    dev = "cuda"
    out: dict = {lab: {} for lab in kernels}
    for wl in workloads:
        shape = wl["shape"]
        per_set = task.bytes(shape)
        copies = int(max(1, min(8, -(-256e6 // per_set))))
        sets = [task.make_inputs(shape, 9000 + i, dev) for i in range(copies)]
        outs = [task.alloc_out(s) for s in sets]
        fns = {}
        for lab, (kern, meta) in kernels.items():
            # ruff reads `del graphs, sets, outs` below as leaving these free names unbound; `one` is only
            # called within this workload's iteration, while they are bound
            def one(i, kern=kern, meta=meta):
                task.call(kern, sets[i % copies], outs[i % copies], meta)  # noqa: F821
            for i in range(3):
                one(i)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(5):
                one(i)
            torch.cuda.synchronize()
            est_us = (time.perf_counter() - t0) / 5 * 1e6
            fns[lab] = (one, est_us)
        graphs = {}
        for lab, (one, est_us) in fns.items():
            n_iter = int(min(200, max(copies, -(-min_ms * 1000 // max(est_us, 1.0)))))
            n_iter = -(-n_iter // copies) * copies
            try:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    one(0)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for i in range(n_iter):
                        one(i)
                graphs[lab] = (lambda g=g: g.replay(), n_iter)
            except Exception:  # eager fallback (includes launch overhead)
                graphs[lab] = (lambda one=one, n=n_iter: [one(i) for i in range(n)], n_iter)
        samples = {lab: [] for lab in kernels}
        labels = list(kernels)
        for lab in labels:
            graphs[lab][0]()
        torch.cuda.synchronize()
        for r in range(rounds):
            order = labels if r % 2 == 0 else labels[::-1]
            for lab in order:
                fn, n = graphs[lab]
                st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                st.record()
                fn()
                en.record()
                en.synchronize()
                samples[lab].append(st.elapsed_time(en) * 1000.0 / n)
        for lab in labels:
            sv = sorted(samples[lab])
            out[lab][str(wl["id"])] = {"median_us": sv[len(sv) // 2], "samples": samples[lab]}
        del graphs, sets, outs
        torch.cuda.empty_cache()
    return out


def time_simulated(task, versions: dict, workloads: list[dict]) -> dict:
    out = {}
    for lab, (source, meta) in versions.items():
        out[lab] = {str(wl["id"]): {"median_us": task.simulated_latency_us(wl["shape"], meta, source), "samples": []}
                    for wl in workloads}
    return out
