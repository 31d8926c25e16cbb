"""Which fixed split of K the decode GEMMs want, and what it costs the training forward.

For each weight shape of the 1.5B and 7B models (``--shapes``: also the Qwen3-30B-A3B's, ``30b_a3b_*``) and each
decode M: cuBLAS, the current pick (one chunk), and for each split count every split-kernel config that fits M plus the current pick's config with in-program chunks, each
bit-checked against the in-program pointer kernel at the same split (one fixed split must give one set of bits),
timed in CUDA graphs on rotating weights (not L2-resident). Then, at training M, the current pick with in-program
chunks against one chunk (the cost of a split where it does not help). A split is a function of K alone, so the
summary adds up the decode time of every shape with that K per split count.

    python bench/probes/probe_split_linear.py --out $OUT [--ms 64,128,256] [--splits 2,4,6] [--train-ms 2048,8192]
    python bench/probes/probe_split_linear.py --out $OUT --shapes 30b_a3b_qkv,30b_a3b_o,30b_a3b_router --ms 64,256

Writes ``split_linear.json`` and prints one line per cell.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

SHAPES = {  # name: (N, K), the rollout side's GEMMs (stacked q/k/v and gate/up)
    "7b_qkv": (4608, 3584), "7b_o": (3584, 3584), "7b_gate_up": (37888, 3584), "7b_down": (3584, 18944),
    "1.5b_qkv": (2048, 1536), "1.5b_o": (1536, 1536), "1.5b_gate_up": (17920, 1536), "1.5b_down": (1536, 8960),
    # Qwen3-30B-A3B's dense GEMMs (its routed experts run the grouped GEMM, which reduces K as the linear op does:
    # a split of K 2,048 would reach its gate/up too)
    "30b_a3b_qkv": (5120, 2048), "30b_a3b_o": (2048, 4096), "30b_a3b_router": (128, 2048),
}
REF = "dec64_n32"  # the in-program pointer kernel every candidate's bits are compared with


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ms", default="64,128,256")
    ap.add_argument("--splits", default="2,4,6")
    ap.add_argument("--train-ms", default="2048,8192")
    ap.add_argument("--shapes", default=",".join(s for s in SHAPES if not s.startswith("30b")))
    ap.add_argument("--budget-s", type=float, default=300.0)
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from areal_tik.kernels import linear as L
    from bench_dense import bench_graphed, rotating
    from harness import gemm_probe_start

    dev, arch, deadline, res = gemm_probe_start(a.out, a.budget_s)
    split_counts = [int(s) for s in a.splits.split(",")]
    res.update(cells=[], train=[])

    def timed(fn, bufs):
        t = bench_graphed(fn, bufs)
        return None if t is None else round(1e3 * t, 2)

    for name in a.shapes.split(","):
        N, K = SHAPES[name]
        for M in (int(m) for m in a.ms.split(",")):
            if time.time() > deadline:
                res["cut_by_budget"] = True
                break
            nxt = rotating(lambda: (torch.randn(M, K, device=dev).to(torch.bfloat16),
                                    (torch.randn(N, K, device=dev) * K ** -0.5).to(torch.bfloat16)),
                           N * K * 2 + M * K * 2)
            x, w = nxt.bufs[0]
            picked = L.pick_config(M, N, K, arch)
            cell = dict(shape=name, N=N, K=K, M=M, picked=picked, cublas_us=timed(F.linear, nxt.bufs),
                        picked_us=timed(functools.partial(L.linear_fwd, config=picked, splits=1), nxt.bufs),
                        splits={})
            for s in split_counts:
                ref = L.linear_fwd(x, w, config=REF, splits=s)
                cands = [c for c, cfg in L.CONFIGS.items() if cfg["kernel"] == "splitk" and cfg["BLOCK_M"] <= max(16, M)]
                row = {}
                for c in dict.fromkeys([picked] + cands):
                    try:
                        ok = torch.equal(L.linear_fwd(x, w, config=c, splits=s), ref)
                        row[c] = {"bits_equal": ok}
                        if ok:
                            row[c]["us"] = timed(functools.partial(L.linear_fwd, config=c, splits=s), nxt.bufs)
                    except Exception as e:  # compile/launch failure: recorded, excluded
                        row[c] = {"bits_equal": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
                        if "illegal" in str(e).lower():
                            raise
                ok = {c: r["us"] for c, r in row.items() if r.get("us")}
                best = min(ok, key=ok.get) if ok else None
                cell["splits"][str(s)] = {"cands": row, "best": best, "best_us": ok.get(best),
                                          "invalid": [c for c, r in row.items() if not r.get("bits_equal")]}
            res["cells"].append(cell)
            line = "  ".join(f"s{s} {v['best']} {v['best_us']}" for s, v in cell["splits"].items())
            print(f"{name:12s} M={M:4d} cuBLAS {cell['cublas_us']} us  pick {picked} {cell['picked_us']} us  {line}"
                  + "".join(f"  INVALID s{s}: {v['invalid']}" for s, v in cell["splits"].items() if v["invalid"]),
                  flush=True)
            del nxt, x, w
            torch.cuda.empty_cache()
        for M in (int(m) for m in a.train_ms.split(",") if m):
            if time.time() > deadline:
                res["cut_by_budget"] = True
                break
            x = torch.randn(M, K, device=dev).to(torch.bfloat16)
            w = (torch.randn(N, K, device=dev) * K ** -0.5).to(torch.bfloat16)
            picked = L.pick_config(M, N, K, arch)
            row = dict(shape=name, N=N, K=K, M=M, picked=picked, cublas_us=timed(F.linear, [(x, w)]),
                       us={str(s): timed(functools.partial(L.linear_fwd, config=picked, splits=s), [(x, w)])
                           for s in [1] + split_counts})
            res["train"].append(row)
            print(f"{name:12s} train M={M:5d} cuBLAS {row['cublas_us']} us  {picked}: "
                  + "  ".join(f"s{s} {v}" for s, v in row["us"].items()), flush=True)
            del x, w
            torch.cuda.empty_cache()
    # a split is per K: sum the decode time of every shape with that K, per M and split count
    summary = {}
    for c in res["cells"]:
        d = summary.setdefault(str(c["K"]), {}).setdefault(str(c["M"]), {"cublas": 0.0, "s1": 0.0})
        d["cublas"] += c["cublas_us"] or 0
        d["s1"] += c["picked_us"] or 0
        for s, v in c["splits"].items():
            d[f"s{s}"] = d.get(f"s{s}", 0.0) + (v["best_us"] or float("inf"))
    res["per_k"] = summary
    for k, per_m in summary.items():
        for m, d in per_m.items():
            print(f"K={k:6s} M={m:4s} " + "  ".join(f"{key} {val:.1f}" for key, val in d.items()), flush=True)
    json.dump(res, open(os.path.join(a.out, "split_linear.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
