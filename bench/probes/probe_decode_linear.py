"""The rollout's decode GEMMs at batch M (the stacked q/k/v, o, stacked gate/up and down projections of one layer,
and with ``--lm-head`` the output head, of the 1.5B or the 7B shape; the stacked q/k/v, o and router of the
Qwen3-30B-A3B): every tile config that fits M, bit-checked against the incumbent, timed in CUDA graphs on weights that are
not L2-resident (rotating buffers), beside cuBLAS, then the four GEMMs of a layer in sequence (one graph over
rotating per-layer weight sets) with the table's picks and with the winners.

    python bench/probes/probe_decode_linear.py --out $OUT [--layer 1.5b|7b|30b-a3b] [--lm-head] [--ms 64,128] [--write-table FILE]

``--write-table`` writes ``linear_tuned.json`` with the bucket of each measured M replaced by its winner (only where
the winner beats the current pick by more than ``--min-gain``; other buckets and shapes unchanged:
``bench/tune_linear.merge_winners``). Writes ``decode_linear.json``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))

# one decoder layer's GEMMs on the rollout side, per model shape (the Qwen3-30B-A3B's dense ones: its routed experts
# run the grouped GEMM, bench/probes/probe_moe_grouped_tiles.py)
LAYERS = {size: tuple(f"{size}_{g}" for g in ("qkv", "o", "gate_up", "down")) for size in ("1.5b", "7b")}
LAYERS["30b-a3b"] = ("30b-a3b_qkv", "30b-a3b_o", "30b-a3b_router")
MOE_SHAPES = {"30b-a3b_qkv": (4096 + 2 * 512, 2048), "30b-a3b_o": (2048, 4096), "30b-a3b_router": (128, 2048)}
LM_HEADS = {"1.5b": ("1.5b_lm_head", (151936, 1536)), "7b": ("7b_lm_head", (152064, 3584)),
            "30b-a3b": ("30b-a3b_lm_head", (151936, 2048))}


def candidates(M: int) -> list[str]:
    """Every bf16 config whose row tile is at most M rounded up to 16 (larger tiles only compute zeros)."""
    from areal_tik.kernels import linear as L
    cap = max(16, 1 << (M - 1).bit_length())
    return [n for n, c in L.CONFIGS.items() if c["BLOCK_M"] <= cap]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--layer", choices=sorted(LAYERS), default="1.5b", help="which model shape's layer")
    ap.add_argument("--lm-head", action="store_true", help="also the output head (timed alone, not in the layer sum)")
    ap.add_argument("--ms", default="64,128")
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--min-gain", type=float, default=0.03, help="a winner must beat the pick by this fraction")
    ap.add_argument("--write-table", help="write the merged linear_tuned.json here")
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from areal_tik.kernels import linear as L
    from areal_tik.kernels.linear import selection
    from bench.bench_dense import SHAPES, bench_graphed, rotating
    from bench.harness import gemm_probe_start
    from bench.tune_linear import INCUMBENT, merge_winners, same_bits_as_incumbent

    LAYER = LAYERS[a.layer]
    head_name, head_shape = LM_HEADS[a.layer]
    shapes = {**SHAPES, **MOE_SHAPES, head_name: head_shape}
    cell_names = LAYER + ((head_name,) if a.lm_head else ())

    dev, arch, deadline, res = gemm_probe_start(a.out, a.budget_s)
    res.update(cells=[], layer={}, layer_shape=a.layer)
    winners = {}
    for M in (int(m) for m in a.ms.split(",")):
        picks, bests = {}, {}
        for name in cell_names:
            N, K = shapes[name]
            wbytes = N * K * 2
            nxt = rotating(lambda: (torch.randn(M, K, device=dev).to(torch.bfloat16),
                                    (torch.randn(N, K, device=dev) * K ** -0.5).to(torch.bfloat16)),
                           wbytes + M * K * 2)
            x, w = nxt.bufs[0]
            ref = L.linear_fwd(x, w, config=INCUMBENT)
            picked = L.pick_config(M, N, K, arch)
            cell = dict(shape=name, N=N, K=K, M=M, picked=picked, cands={},
                        cublas_us=1e3 * bench_graphed(F.linear, nxt.bufs))
            for c in dict.fromkeys([picked] + candidates(M)):
                if cell["cands"] and time.time() > deadline:  # the pick is always timed
                    cell["cut_by_budget"] = True
                    break
                r = cell["cands"][c] = {}
                try:
                    ok = same_bits_as_incumbent(x, w, ref, c)
                    torch.cuda.synchronize()
                    r["bits_equal"] = ok
                    if ok:
                        t = bench_graphed(functools.partial(L.linear_fwd, config=c), nxt.bufs)
                        if t is not None:
                            r["us"] = 1e3 * t
                except Exception as e:  # compile/launch failure: recorded, excluded
                    r.update(bits_equal=False, error=f"{type(e).__name__}: {str(e)[:200]}")
                    if "illegal" in str(e).lower():
                        raise
            timed = {c: r["us"] for c, r in cell["cands"].items() if "us" in r}
            best = min(timed, key=timed.get)
            cell.update(best=best, best_us=timed[best], picked_us=timed.get(picked),
                        invalid=[c for c, r in cell["cands"].items() if not r.get("bits_equal")])
            picks[name], bests[name] = picked, best
            if cell["picked_us"] and timed[best] < (1 - a.min_gain) * cell["picked_us"]:
                winners[(N, K, M)] = best
            else:
                bests[name] = picked
            res["cells"].append(cell)
            print(f"M={M:4d} {name:13s} cuBLAS {cell['cublas_us']:6.1f} us  picked {picked:15s} "
                  f"{cell['picked_us'] or float('nan'):6.1f} us  best {best:15s} {timed[best]:6.1f} us"
                  + (f"  INVALID {cell['invalid']}" if cell["invalid"] else ""), flush=True)
            del nxt, x, w, ref
        # a layer's four GEMMs back to back over rotating per-layer weight sets, picks vs winners vs cuBLAS
        sets = []
        for _ in range(8):
            xs = {n: torch.randn(M, shapes[n][1], device=dev).to(torch.bfloat16) for n in LAYER}
            ws = {n: (torch.randn(*shapes[n], device=dev) * shapes[n][1] ** -0.5).to(torch.bfloat16) for n in LAYER}
            sets.append((xs, ws))

        def layer(choice, xs, ws):
            for n in LAYER:
                if choice is None:
                    F.linear(xs[n], ws[n])
                else:
                    L.linear_fwd(xs[n], ws[n], config=choice[n])
        row = {}
        for label, choice in (("picked", picks), ("best", bests), ("cublas", None)):
            t = bench_graphed(functools.partial(layer, choice), sets)
            row[label + "_us"] = None if t is None else 1e3 * t
        row.update(picked=picks, best=bests, layer_mb=sum(shapes[n][0] * shapes[n][1] * 2 for n in LAYER) / 1e6)
        res["layer"][str(M)] = row
        print(f"M={M:4d} layer of {len(LAYER)} GEMMs ({row['layer_mb']:.1f} MB of weights): picked {row['picked_us']:.1f} us, "
              f"best {row['best_us']:.1f} us, cuBLAS {row['cublas_us']:.1f} us", flush=True)
        del sets
        torch.cuda.empty_cache()
    res["winners"] = [dict(N=N, K=K, M=M, config=c) for (N, K, M), c in sorted(winners.items())]
    if a.write_table:
        table = json.load(open(selection.TUNED_TABLE_PATH))
        merged = merge_winners(table, arch, winners, by="bench/probes/probe_decode_linear.py")
        with open(a.write_table, "w") as f:
            json.dump(merged, f, indent=1)
        res["table_written"] = a.write_table
    json.dump(res, open(os.path.join(a.out, "decode_linear.json"), "w"), indent=1)
    print("winners:", res["winners"], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
