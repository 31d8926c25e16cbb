"""The MoE routing plan at decode sizes: the one-program kernel against the device torch ops, and what it changes in
a whole routed-experts forward (Qwen3-30B-A3B widths: 128 experts, top-8, hidden 2,048, expert width 768).

    python bench/probes/probe_moe_routing.py --out $OUT [--tokens 1,64,256,512] [--layers 16]

Per token count T: the plan alone (``routing_plan_torch`` vs ``routing_plan_triton``, each a CUDA graph of
``--launches`` launches; the kernel also at other warp counts and tile sizes), and the experts forward
(``experts_triton_fwd``: plan, two grouped GEMMs, SiLU-mul) with either plan, each a CUDA graph over ``--layers``
per-layer weight sets (rotating, so the weights are read from memory as in a decode step, not from L2). The two
plans are compared element for element first, and the two forwards' outputs bit for bit (the plan decides which
rows a launch gathers, never a row's bits). Writes ``moe_routing.json``; prints one line per T.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

E, K_TOP, H, I = 128, 8, 2048, 768


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tokens", default="1,64,256,512")
    ap.add_argument("--layers", type=int, default=16, help="weight sets the experts forward rotates over")
    ap.add_argument("--launches", type=int, default=48, help="plans per CUDA graph replay")
    a = ap.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    if any(t < 1 for t in tokens) or a.layers < 1 or a.launches < 1:
        raise SystemExit("probe_moe_routing: --tokens, --layers and --launches must be >= 1")

    import torch
    from harness import graphed, time_ms, warm_up_clocks
    from areal_tik.kernels.moe import experts as ex
    from areal_tik.kernels.moe import routing as rt

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    wgu = [(torch.randn(E, 2 * I, H, device=dev, generator=g) * 0.02).bfloat16() for _ in range(a.layers)]
    wd = [(torch.randn(E, H, I, device=dev, generator=g) * 0.02).bfloat16() for _ in range(a.layers)]
    warm_up_clocks(2.0)
    res = {"gpu": torch.cuda.get_device_name(), "experts": E, "top_k": K_TOP, "hidden": H, "inter": I,
           "layers": a.layers, "cells": []}
    plans = {"torch": rt.routing_plan_torch, "triton": rt.routing_plan_triton}
    real_plan = ex.routing_plan
    for T in tokens:
        ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:K_TOP] for _ in range(T)]).contiguous()
        x = torch.randn(T, H, device=dev, generator=g).bfloat16()
        bm = rt.block_m_for(T * K_TOP, E)
        p_t, p_k = rt.routing_plan_torch(ids, E, bm), rt.routing_plan_triton(ids, E, bm)
        cell = {"tokens": T, "assignments": T * K_TOP, "block_m": bm,
                "plans_equal": bool(torch.equal(p_t.order, p_k.order) and torch.equal(p_t.blocks, p_k.blocks))}
        for name, fn in plans.items():
            run, how = graphed(lambda fn=fn: [fn(ids, E, bm) for _ in range(a.launches)])
            cell[f"plan_{name}_us"] = round(time_ms(run).ms * 1000 / a.launches, 2)
            cell[f"plan_{name}_timed"] = how
        for nw, te in ((4, 8192), (8, 16384), (4, 4096)):     # the kernel's other launch shapes (speed only)
            run, how = graphed(lambda nw=nw, te=te: [rt.routing_plan_triton(ids, E, bm, nw, te)
                                                     for _ in range(a.launches)])
            cell[f"plan_triton_w{nw}_t{te}_us"] = round(time_ms(run).ms * 1000 / a.launches, 2)
            p_v = rt.routing_plan_triton(ids, E, bm, nw, te)
            cell["plans_equal"] &= bool(torch.equal(p_v.order, p_t.order) and torch.equal(p_v.blocks, p_t.blocks))
        outs = {}
        for name, fn in plans.items():
            ex.routing_plan = lambda i, e, block_m=None, fn=fn: fn(i, e, block_m or rt.block_m_for(i.numel(), e))
            try:
                outs[name] = [torch.full((T, K_TOP, H), float("nan"), device=dev, dtype=torch.bfloat16)
                              for _ in range(a.layers)]

                def fwd(o=outs[name]):
                    for li in range(a.layers):
                        o[li].copy_(ex.experts_triton_fwd(x, wgu[li], wd[li], ids))
                run, how = graphed(fwd)
                cell[f"experts_{name}_us_per_layer"] = round(time_ms(run, iters=5).ms * 1000 / a.layers, 2)
                run()
                torch.cuda.synchronize()
            finally:
                ex.routing_plan = real_plan
        cell["outputs_equal"] = all(torch.equal(u, v) for u, v in zip(outs["torch"], outs["triton"]))
        cell["plan_speedup"] = round(cell["plan_torch_us"] / cell["plan_triton_us"], 2)
        cell["experts_speedup"] = round(cell["experts_torch_us_per_layer"] / cell["experts_triton_us_per_layer"], 3)
        res["cells"].append(cell)
        print(f"T {T:4d}: plan torch {cell['plan_torch_us']:7.2f} us, kernel {cell['plan_triton_us']:7.2f} us "
              f"({cell['plan_speedup']}x, equal {cell['plans_equal']}); experts per layer "
              f"{cell['experts_torch_us_per_layer']:.1f} -> {cell['experts_triton_us_per_layer']:.1f} us "
              f"({cell['experts_speedup']}x, bits equal {cell['outputs_equal']})", flush=True)
        del outs
    os.makedirs(a.out, exist_ok=True)
    json.dump(res, open(os.path.join(a.out, "moe_routing.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
