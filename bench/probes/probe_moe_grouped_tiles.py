"""Tile configs of the grouped expert GEMMs at decode sizes, against the shipped table and vLLM's fused MoE.

    python bench/probes/probe_moe_grouped_tiles.py --out $OUT [--tokens 1,64,256,8192] [--layers 16]

Qwen3-30B-A3B widths by default (128 experts, top-8, hidden 2,048, expert width 768). Per token count T (random
routings, k distinct experts per token) and per GEMM of the routed experts (gate/up: ``[T*k] x 2,048 -> 1,536``,
rows gathered from x; down: ``[T*k] x 768 -> 2,048``): every candidate tile (BLOCK_N x num_warps x num_stages;
BLOCK_M and the plan the shipped ones for T; from ``--extra-from-tokens`` tokens on, also at ``--extra-block-m``
rows per block with that block size's own plan) timed in a CUDA graph over ``--layers`` per-layer weight sets
(rotating: weights read from memory as in a decode step), its output (into poisoned buffers) compared bit for bit
with the shipped tile's (a tile changes which rows and columns a program takes, never a row's reduction). Then the
whole routed-experts forward plus the combine (plan, two grouped GEMMs, SiLU-mul, weighted sum) with the shipped
tiles and with the best tile of each GEMM, beside vLLM's ``fused_experts`` (its tuned Triton fused MoE, same
weights and routing) when vLLM is importable, and the gate/up kernel with the SiLU-mul in its epilogue
(``grouped_linear(..., silu=True)``) at the shipped and the best tile (bits and time against the GEMM +
``silu_mul_packed`` pair). On a machine without a GPU it runs under the Triton interpreter as a smoke run (the
interpreter's tile is fixed). Writes ``moe_grouped_tiles.json``; prints one line per (T, GEMM) and per T.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

import torch  # noqa: E402


#: candidate tiles (speed only): BLOCK_N x num_warps x num_stages with K_UNROLL 1, then a few with two K tiles
#: loaded per loop trip (K_UNROLL 2: more bytes in flight, the same dot sequence)
CANDIDATES = [dict(BLOCK_N=bn, num_warps=nw, num_stages=ns, K_UNROLL=1)
              for bn, nw, ns in itertools.product((32, 64, 128, 256), (4, 8), (3, 4, 6))
              if not (bn == 256 and nw == 4) and not (bn == 32 and nw == 8)]
CANDIDATES += [dict(BLOCK_N=bn, num_warps=4, num_stages=ns, K_UNROLL=2)
               for bn, ns in itertools.product((64, 128), (3, 4))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tokens", default="1,64,256,8192",
                    help="token counts (decode batches, a prefill chunk of the engine)")
    ap.add_argument("--layers", type=int, default=16, help="weight sets each timing rotates over")
    ap.add_argument("--max-candidates", type=int, default=len(CANDIDATES), help="the first N candidate tiles only")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768, help="an expert's width")
    ap.add_argument("--extra-block-m", type=int, default=128,
                    help="a larger BLOCK_M also tried (its own plan) at token counts of --extra-from-tokens or more")
    ap.add_argument("--extra-from-tokens", type=int, default=1024)
    a = ap.parse_args(argv)
    tokens = [int(t) for t in a.tokens.split(",")]
    if (min(tokens + [a.layers, a.max_candidates, a.experts, a.top_k, a.hidden, a.inter, a.extra_block_m,
                      a.extra_from_tokens]) < 1 or a.top_k > a.experts):
        raise SystemExit("probe_moe_grouped_tiles: every count must be >= 1 and --top-k at most --experts")
    E, K_TOP, H, I = a.experts, a.top_k, a.hidden, a.inter

    from harness import graphed, time_ms, warm_up_clocks
    from areal_tik.kernels.moe import combine as cb
    from areal_tik.kernels.moe import grouped_linear as gl
    from areal_tik.kernels.moe import routing as rt
    from areal_tik.kernels.swiglu import silu_mul_packed_triton

    on_gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if on_gpu else "cpu")      # CPU: the interpreter, a smoke run (its tile is fixed)
    g = torch.Generator(device=dev).manual_seed(0)
    wgu = [(torch.randn(E, 2 * I, H, device=dev, generator=g) * 0.02).bfloat16() for _ in range(a.layers)]
    wd = [(torch.randn(E, H, I, device=dev, generator=g) * 0.02).bfloat16() for _ in range(a.layers)]
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts as vllm_fused_experts
        peer = "vllm.model_executor.layers.fused_moe.fused_experts"
    except Exception as e:  # noqa: BLE001  (vLLM is optional here)
        vllm_fused_experts, peer = None, f"unavailable: {type(e).__name__}: {str(e)[:120]}"
    if on_gpu:
        warm_up_clocks(2.0)
    res = {"gpu": torch.cuda.get_device_name() if on_gpu else "cpu", "experts": E, "top_k": K_TOP, "hidden": H,
           "inter": I, "layers": a.layers, "peer": peer, "shipped": {str(k): v for k, v in gl.GPU_TILES.items()},
           "cells": []}
    cands = CANDIDATES[:a.max_candidates]

    def timed(fn, per):
        if not on_gpu:
            t0 = time.perf_counter()
            fn()
            return round((time.perf_counter() - t0) * 1e6 / per, 2), "cpu wall clock, one call"
        run, how = graphed(fn)
        return round(time_ms(run, iters=5).ms * 1000 / per, 2), how

    for T in tokens:
        ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:K_TOP] for _ in range(T)]).contiguous()
        wts = torch.softmax(torch.randn(T, K_TOP, device=dev, generator=g), -1)
        x = torch.randn(T, H, device=dev, generator=g).bfloat16()
        plan = rt.routing_plan(ids, E)
        plans = {plan.block_m: plan}
        if T >= a.extra_from_tokens and a.extra_block_m != plan.block_m:
            plans[a.extra_block_m] = rt.routing_plan(ids, E, a.extra_block_m)
        shipped = gl.tile_config(plan.block_m)
        h = silu_mul_packed_triton(gl.grouped_linear(x, wgu[0], plan, K_TOP))
        cell = {"tokens": T, "block_m": plan.block_m, "plan": rt.plan_implementation(T * K_TOP, True), "gemms": {}}
        best = {}
        for name, src, ws, row_div, n in (("gate_up", x, wgu, K_TOP, 2 * I), ("down", h, wd, 1, H)):
            outs = [torch.full((T * K_TOP, n), float("nan"), device=dev, dtype=torch.bfloat16)
                    for _ in range(a.layers)]
            ref = None
            rows = []
            trials = [(plan.block_m, shipped)] + [(bm, c) for bm in plans for c in cands]
            for bm, tile in trials:
                def fwd(tile=tile, p=plans[bm]):
                    for li in range(a.layers):
                        gl.grouped_linear(src, ws[li], p, row_div, out=outs[li], tile=tile)
                try:
                    us, how = timed(fwd, a.layers)
                except Exception as e:  # noqa: BLE001  (a tile that does not compile or launch: recorded)
                    rows.append(dict(block_m=bm, tile=tile, error=f"{type(e).__name__}: {str(e)[:120]}"))
                    continue
                for o in outs:                 # poisoned again: a row this tile leaves unwritten reads NaN
                    o.fill_(float("nan"))
                fwd()
                if on_gpu:
                    torch.cuda.synchronize()
                if ref is None:
                    ref = [o.clone() for o in outs]
                equal = all(torch.equal(o, r) for o, r in zip(outs, ref))
                rows.append(dict(block_m=bm, tile=tile, us=us, timed=how, bits_equal_shipped=equal))
            ok = [r for r in rows if "us" in r and r["bits_equal_shipped"]]
            top = min(ok, key=lambda r: r["us"])
            best[name] = (top["block_m"], top["tile"])
            timed_rows = [r for r in rows if "us" in r]
            cell["gemms"][name] = dict(shipped_us=rows[0].get("us"), best=top, rows=rows,
                                       all_bits_equal=all(r["bits_equal_shipped"] for r in timed_rows),
                                       weights_gb_per_layer=round(ws[0].numel() * 2 / 1e9, 4))
            print(f"T {T:4d} {name:8s}: shipped {rows[0].get('us')} us, best {top['us']} us BLOCK_M {top['block_m']} "
                  f"{top['tile']} "
                  f"(bits equal in every tile: {cell['gemms'][name]['all_bits_equal']})", flush=True)
            del outs, ref

        def ours(tiles):
            (bm_gu, t_gu), (bm_d, t_d) = tiles["gate_up"], tiles["down"]

            def fwd():
                for li in range(a.layers):
                    p = rt.routing_plan(ids, E, bm_gu)
                    pd = p if bm_d == bm_gu else rt.routing_plan(ids, E, bm_d)
                    gu = gl.grouped_linear(x, wgu[li], p, K_TOP, tile=t_gu)
                    y = gl.grouped_linear(silu_mul_packed_triton(gu), wd[li], pd, 1, tile=t_d)
                    cb.combine_triton(y.view(T, K_TOP, H), wts)
            return fwd
        # the gate/up GEMM with the SiLU-mul fused in, at the shipped tile and the best gate/up tile: bits vs the
        # shipped pair (GEMM, then silu_mul_packed), time vs that pair
        pair_outs = [silu_mul_packed_triton(gl.grouped_linear(x, wgu[li], plan, K_TOP, tile=shipped))
                     for li in range(a.layers)]
        cell["fused_gate_up_silu"] = {}
        for label, (bm, tile) in (("shipped", (plan.block_m, shipped)), ("best", best["gate_up"])):
            p = plans[bm]
            try:
                outs = [gl.grouped_linear(x, wgu[li], p, K_TOP, tile=tile, silu=True,   # into poisoned buffers
                                          out=torch.full_like(r, float("nan"))) for li, r in enumerate(pair_outs)]
                equal = all(torch.equal(o, r) for o, r in zip(outs, pair_outs))
                us, _ = timed(lambda tile=tile, p=p: [gl.grouped_linear(x, wgu[li], p, K_TOP, tile=tile, silu=True)
                                                      for li in range(a.layers)], a.layers)
                pair_us, _ = timed(lambda tile=tile, p=p: [
                    silu_mul_packed_triton(gl.grouped_linear(x, wgu[li], p, K_TOP, tile=tile))
                    for li in range(a.layers)], a.layers)
                cell["fused_gate_up_silu"][label] = dict(block_m=bm, tile=tile, us=us, pair_us=pair_us,
                                                         bits_equal=equal)
            except Exception as e:  # noqa: BLE001  (recorded, the probe goes on)
                cell["fused_gate_up_silu"][label] = dict(block_m=bm, tile=tile,
                                                         error=f"{type(e).__name__}: {str(e)[:160]}")
        del pair_outs
        cell["layer_shipped_us"], _ = timed(ours({"gate_up": (plan.block_m, shipped),
                                                  "down": (plan.block_m, shipped)}), a.layers)
        cell["layer_best_us"], _ = timed(ours(best), a.layers)
        if vllm_fused_experts is not None and on_gpu:
            ids32 = ids.to(torch.int32)
            try:
                cell["layer_vllm_us"], cell["vllm_timed"] = timed(
                    lambda: [vllm_fused_experts(x, wgu[li], wd[li], wts, ids32) for li in range(a.layers)], a.layers)
            except Exception as e:  # noqa: BLE001
                cell["vllm_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        res["cells"].append(cell)
        os.makedirs(a.out, exist_ok=True)       # after every cell: a run stopped at its time limit keeps its cells
        json.dump(res, open(os.path.join(a.out, "moe_grouped_tiles.json"), "w"), indent=1)
        fz = cell["fused_gate_up_silu"]
        print(f"T {T:4d}: gate/up + SiLU-mul fused: " + "; ".join(
            f"{k} tile {v['us']} us vs pair {v['pair_us']} us (bits equal {v['bits_equal']})" if "us" in v
            else f"{k} tile: {v['error']}" for k, v in fz.items()), flush=True)
        print(f"T {T:4d}: routed experts + combine per layer: shipped {cell['layer_shipped_us']} us, best tiles "
              f"{cell['layer_best_us']} us, vLLM fused_experts "
              f"{cell.get('layer_vllm_us', cell.get('vllm_error', peer))}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
