"""The MoE routing plan: the one-program kernel and the chunked kernel (two or three launches) against the device
torch ops, and what each changes in a whole routed-experts forward (Qwen3-30B-A3B widths: 128 experts, top-8,
hidden 2,048, expert width 768).

    python bench/probes/probe_moe_routing.py --out $OUT [--tokens 1,64,256,512] [--plan-tokens 2048,8192]

Per token count T of ``--tokens``: the plan alone (``routing_plan_torch``, ``routing_plan_triton``,
``routing_plan_chunked``, each a CUDA graph of ``--launches`` launches; the kernels also at other warp counts and
tile sizes), and the experts forward (``experts_triton_fwd``: plan, two grouped GEMMs, SiLU-mul) with each plan, a
CUDA graph over ``--layers`` per-layer weight sets (rotating, so the weights are read from memory as in a decode
step, not from L2). Per T of ``--plan-tokens`` (prefill sizes): the plan alone. Every plan is compared with the
torch plan element for element, and the forwards' outputs bit for bit (the plan decides which rows a launch
gathers, never a row's bits). Writes ``moe_routing.json``; prints one line per T.
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
    ap.add_argument("--plan-tokens", default="2048,8192", help="token counts timed for the plan alone (prefill)")
    a = ap.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    plan_tokens = [int(t) for t in a.plan_tokens.split(",") if t]
    if any(t < 1 for t in tokens + plan_tokens) or a.layers < 1 or a.launches < 1:
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
    plans = {"torch": rt.routing_plan_torch, "triton": rt.routing_plan_triton, "chunked": rt.routing_plan_chunked}
    real_plan = ex.routing_plan

    def plan_cell(T):
        """The plans alone at T tokens: each implementation timed, all compared with the torch plan."""
        ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:K_TOP] for _ in range(T)]).contiguous()
        bm = rt.block_m_for(T * K_TOP, E)
        want = rt.routing_plan_torch(ids, E, bm)
        cell = {"tokens": T, "assignments": T * K_TOP, "block_m": bm, "plans_equal": True}
        variants = [(name, fn) for name, fn in plans.items()]
        variants += [(f"triton_w{nw}_t{te}", lambda i, e, m, nw=nw, te=te: rt.routing_plan_triton(i, e, m, nw, te))
                     for nw, te in ((4, 8192), (8, 16384), (4, 4096))]       # other launch shapes (speed only)
        variants += [(f"chunked_w{nw}_t{te}", lambda i, e, m, nw=nw, te=te: rt.routing_plan_chunked(i, e, m, nw, te))
                     for nw, te in ((8, 8192), (4, 2048), (4, 4096), (4, 8192), (4, 16384))]
        variants += [("chunked_3launches", lambda i, e, m: rt.routing_plan_chunked(i, e, m, fuse_prefix=False))]
        for name, fn in variants:
            if (name == "triton" or name.startswith("triton_")) and T * K_TOP > 4096:
                continue                           # one SM walks every row: prefill sizes not timed
            got = fn(ids, E, bm)
            cell["plans_equal"] &= bool(torch.equal(got.order, want.order) and torch.equal(got.blocks, want.blocks))
            run, how = graphed(lambda fn=fn: [fn(ids, E, bm) for _ in range(a.launches)])
            cell[f"plan_{name}_us"] = round(time_ms(run).ms * 1000 / a.launches, 2)
            cell[f"plan_{name}_timed"] = how
        return ids, bm, cell

    for T in tokens:
        ids, bm, cell = plan_cell(T)
        x = torch.randn(T, H, device=dev, generator=g).bfloat16()
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
        cell["outputs_equal"] = all(torch.equal(u, v) for name in plans for u, v in zip(outs["torch"], outs[name]))
        res["cells"].append(cell)
        print(f"T {T:4d}: plan us " + ", ".join(f"{n} {cell[f'plan_{n}_us']:.2f}" for n in plans)
              + f" (equal {cell['plans_equal']}); experts us per layer "
              + ", ".join(f"{n} {cell[f'experts_{n}_us_per_layer']:.1f}" for n in plans)
              + f" (bits equal {cell['outputs_equal']})", flush=True)
        del outs
    for T in plan_tokens:
        _, _, cell = plan_cell(T)
        res["cells"].append(cell)
        print(f"T {T:4d}: plan us " + ", ".join(f"{k[5:-3]} {v:.2f}" for k, v in cell.items()
                                                   if k.startswith("plan_") and k.endswith("_us"))
              + f" (equal {cell['plans_equal']})", flush=True)
    os.makedirs(a.out, exist_ok=True)
    json.dump(res, open(os.path.join(a.out, "moe_routing.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
