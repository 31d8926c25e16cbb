"""Tile-config tuner for the row-invariant linear (one device run, ~4 minutes).

    python bench/tune_linear.py --out DIR [--budget-s 200] [--ms 1,8,64,...] [--shapes a,b]

For every Qwen2.5 shape (bench_dense.SHAPES) and M in --ms, and every candidate config
of ``linear.CONFIGS`` that fits the M class:
  1. bit equality against the incumbent (``dec16_n16``, the config proven at every M in
     the first H200 run): the candidate's full output, and its outputs for row subsets
     (first row alone, last 3 rows alone) against the incumbent's full rows;
  2. timing (triton.testing.do_bench median) side by side with cuBLAS ``F.linear`` and
     the config the current table/default picks.
Failures (compile errors, mismatches) are recorded and the candidate is excluded.

Writes DIR/tune_linear.json (every cell, every candidate) and DIR/linear_tuned.json: the
table in the format ``linear.selection.parse_tuned_table`` reads, best valid config per (N, K, M
bucket), for this GPU's arch. To apply: copy DIR/linear_tuned.json to
areal_tik/kernels/linear/linear_tuned.json, run the GPU test
tests/kernels/test_linear.py::test_gpu_all_configs_bit_identical, commit. A time budget
guards the run: cells not reached are listed as skipped and get no rule (the built-in
default applies there).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from areal_tik.kernels import linear as L  # noqa: E402
from areal_tik.kernels.linear import configs, selection  # noqa: E402
from bench.bench_dense import SHAPES, rotating, L2_BYTES  # noqa: E402

INCUMBENT = "dec16_n16"
# walked in this order (goal buckets first, so a budget cut loses the least useful cells)
DEFAULT_MS = (2048, 1, 8192, 64, 256, 8, 16384, 128, 512)


def candidates_for(M: int, arch_tma: bool) -> list[str]:
    """Configs worth timing at this M (all are bit-checked before timing)."""
    out = []
    for name, c in L.CONFIGS.items():
        if c["kernel"] != "ptr" and not arch_tma:
            continue
        bm, bn = c["BLOCK_M"], c["BLOCK_N"]
        if M <= 8:
            ok = bm == 16
        elif M <= 64:
            ok = bm <= 64 and bn <= 128
        elif M <= 512:
            ok = (32 <= bm <= 128 and 32 <= bn <= 256 and not c.get("FLATTEN") and not c.get("WARP_SPEC")
                  and name != "big128_n256_g16")
        else:
            ok = bm >= 64 and bn >= 128
        if ok:
            out.append(name)
    return out


def bench_ms(fn, rep):
    """Median ms by triton's do_bench (bench/harness.py)."""
    from bench.harness import time_ms
    return time_ms(fn, "do_bench", warmup_ms=max(2, rep // 5), rep_ms=rep).p50


def bits_equal(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def same_bits_as_incumbent(x, w, ref, config: str, out=None) -> bool:
    """Whether ``config`` gives ``ref`` (the incumbent's output on ``x``) bit for bit: the whole output, the first
    row computed alone and (M >= 4) the last 3 rows alone (row-subset invariance)."""
    M = x.shape[0]
    ok = bits_equal(L.linear_fwd(x, w, config=config, out=out), ref)
    ok = ok and bits_equal(L.linear_fwd(x[:1].contiguous(), w, config=config), ref[:1])
    if M >= 4:
        ok = ok and bits_equal(L.linear_fwd(x[M - 3:].contiguous(), w, config=config), ref[M - 3:])
    return bool(ok)


def run(args) -> dict:
    dev = torch.device("cuda")
    arch, n_sms = selection.device_info(torch.cuda.current_device())
    arch_tma = configs.arch_has_tma(arch)
    t_start = time.time()
    deadline = t_start + args.budget_s
    shapes = args.shapes.split(",") if args.shapes else list(SHAPES)
    ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else DEFAULT_MS
    res = {"device": torch.cuda.get_device_name(), "arch": arch, "sms": n_sms, "torch": torch.__version__,
           "triton": __import__("triton").__version__, "incumbent": INCUMBENT, "ms": ms, "cells": [],
           "skipped": [], "budget_s": args.budget_s}
    g = torch.Generator(device=dev).manual_seed(1234)
    # large M first per shape would starve decode cells on a timeout: walk M outer, shapes inner
    for M in ms:
        for name in shapes:
            N, K = SHAPES[name]
            if name.endswith("lm_head") and M > 8192:
                continue
            if time.time() > deadline:
                res["skipped"].append(dict(shape=name, M=M))
                continue
            cell = dict(shape=name, N=N, K=K, M=M, cands={})
            t_cell = time.time()
            w = (torch.randn(N, K, device=dev, generator=g) * K ** -0.5).to(torch.bfloat16)
            x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
            ref = L.linear_fwd(x, w, config=INCUMBENT)
            buf = torch.empty_like(ref)
            wbytes = N * K * 2
            rep = 10 if M * N * K > 2e11 else 20
            if wbytes + M * K * 2 < 3 * L2_BYTES:  # rotate inputs so decode weights are not L2-resident
                nxt = rotating(lambda: ((torch.randn(M, K, device=dev) * 1).to(torch.bfloat16),
                                        (torch.randn(N, K, device=dev) * K ** -0.5).to(torch.bfloat16)),
                               wbytes + M * K * 2)
            else:
                nxt = lambda: (x, w)  # noqa: E731
            cell["cublas_ms"] = bench_ms(lambda: F.linear(*nxt()), rep)
            picked = L.pick_config(M, N, K, arch)
            cell["picked"] = picked
            for cname in dict.fromkeys([INCUMBENT, picked] + candidates_for(M, arch_tma)):
                if time.time() > deadline:
                    break
                r = cell["cands"][cname] = {}
                try:
                    ok = same_bits_as_incumbent(x, w, ref, cname, out=buf)
                    torch.cuda.synchronize()
                    r["bits_equal"] = bool(ok)
                    if ok:
                        r["ms"] = bench_ms(lambda c=cname: L.linear_fwd(*nxt(), config=c), rep)
                except Exception as e:  # compile/launch failure: record, exclude
                    r["bits_equal"] = False
                    r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    if "CUDA error" in str(e) or "illegal" in str(e).lower():
                        r["fatal"] = traceback.format_exc()[-2000:]
                        res["cells"].append(cell)
                        res["aborted"] = f"CUDA context error in {name} M={M} {cname}"
                        return res
            cell["cublas_ms_after"] = bench_ms(lambda: F.linear(*nxt()), rep)
            cub = min(cell["cublas_ms"], cell["cublas_ms_after"])
            valid = {k: v["ms"] for k, v in cell["cands"].items() if v.get("bits_equal") and "ms" in v}
            if valid:
                best = min(valid, key=valid.get)
                cell.update(best=best, best_ms=valid[best], best_ratio=cub / valid[best])
                if picked in valid:
                    cell["picked_ratio"] = cub / valid[picked]
            cell["seconds"] = round(time.time() - t_cell, 2)
            res["cells"].append(cell)
            bad = [k for k, v in cell["cands"].items() if not v.get("bits_equal")]
            print(f"{name:13s} M={M:6d} cublas {cub*1e3:8.1f}us best {cell.get('best', '-'):18s} "
                  f"{cell.get('best_ms', float('nan'))*1e3:8.1f}us ratio {cell.get('best_ratio', float('nan')):.2f} "
                  f"(picked {picked} {cell.get('picked_ratio', float('nan')):.2f})"
                  + (f"  INVALID: {','.join(bad)}" if bad else "") + f"  [{cell['seconds']}s]", flush=True)
            del x, w, ref, buf, nxt
    res["seconds"] = time.time() - t_start
    return res


def set_bucket(buckets: list, M: int, name: str) -> list:
    """``buckets`` ([[M_max, config], ..., [None, config]], ascending) with ``name`` chosen up to M from the bucket
    that holds M: that bucket splits at M (its rows above M keep their config); equal neighbours merge."""
    out, placed = [], False
    for mx, old in buckets:
        if not placed and (mx is None or M <= mx):
            out.append([M, name])
            placed = True
            if mx == M:
                continue
        out.append([mx, old])
    return _merge_equal_neighbours(out)


def _merge_equal_neighbours(buckets: list) -> list:
    """Neighbouring buckets with the same config become one (ending at the later bound)."""
    merged = []
    for mx, name in buckets:
        if merged and merged[-1][1] == name:
            merged[-1][0] = mx
        else:
            merged.append([mx, name])
    return merged


def merge_winners(table: dict, arch: str, winners: dict, by: str) -> dict:
    """A copy of the tuned ``table`` (format 1) with ``winners`` ({(N, K, M): config}) set by :func:`set_bucket`;
    an (N, K) without a rule gets one whose other M keep the built-in default. ``by`` (the script that measured
    the winners) goes into the entry's ``merged`` provenance list."""
    import copy
    out = copy.deepcopy(table)
    entry = out.setdefault("archs", {}).setdefault(arch, {"rules": []})
    rules = {(r["N"], r["K"]): r for r in entry["rules"]}
    for (N, K, M), name in sorted(winners.items()):
        if (N, K) not in rules:
            rules[(N, K)] = {"N": N, "K": K, "buckets": [[None, configs.default_config_name(M + 1, N, K, arch)]]}
            entry["rules"].append(rules[(N, K)])
        rules[(N, K)]["buckets"] = set_bucket(rules[(N, K)]["buckets"], M, name)
    if winners:   # provenance: which buckets a later probe set
        entry.setdefault("merged", []).extend(dict(N=N, K=K, M=M, config=c, by=by)
                                              for (N, K, M), c in sorted(winners.items()))
    return out


def build_table(res: dict) -> dict:
    """Best valid config per (N, K, M bucket); a bucket ends at its measured M, the last
    one is open-ended. Cells without a winner are left out of the buckets."""
    rules = []
    by_nk = {}
    for c in res["cells"]:
        if "best" in c:
            by_nk.setdefault((c["N"], c["K"]), []).append((c["M"], c["best"]))
    for (N, K), lst in sorted(by_nk.items()):
        lst.sort()
        buckets = [[m, name] for m, name in lst[:-1]] + [[None, lst[-1][1]]]
        rules.append({"N": N, "K": K, "buckets": _merge_equal_neighbours(buckets)})
    entry = {"rules": rules, "device": res["device"], "triton": res["triton"], "torch": res["torch"],
             "note": "written by bench/tune_linear.py; every config passed the bit-equality check"}
    return {"format": 1, "archs": {res["arch"]: entry}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("TUNE_BUDGET_S", 200)))
    ap.add_argument("--ms", default=os.environ.get("TUNE_MS", ""))
    ap.add_argument("--shapes", default=os.environ.get("TUNE_SHAPES", ""))
    ap.add_argument("--quick", action="store_true", help="(accepted for gpu_check BENCH_ARGS; ignored)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("tune_linear needs a CUDA GPU")
        return 1
    res = run(a)
    table = build_table(res)
    selection.parse_tuned_table(json.dumps(table))  # the table kernels/linear/ will read must parse
    os.makedirs(a.out, exist_ok=True)
    res["table"] = table
    with open(os.path.join(a.out, "tune_linear.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(a.out, "linear_tuned.json"), "w") as f:
        json.dump(table, f, indent=1)
    print("\n== best valid config / ratio vs cuBLAS (picked = current table/default)")
    ms = sorted({c["M"] for c in res["cells"]})
    print(f"{'shape':14s}" + "".join(f"{m:>8d}" for m in ms))
    for s in dict.fromkeys(c["shape"] for c in res["cells"]):
        best = {c["M"]: c.get("best_ratio") for c in res["cells"] if c["shape"] == s}
        pk = {c["M"]: c.get("picked_ratio") for c in res["cells"] if c["shape"] == s}
        print(f"{s:14s}" + "".join(f"{best[m]:8.2f}" if best.get(m) else f"{'-':>8s}" for m in ms) + "  best")
        print(f"{'':14s}" + "".join(f"{pk[m]:8.2f}" if pk.get(m) else f"{'-':>8s}" for m in ms) + "  picked")
    inval = sorted({k for c in res["cells"] for k, v in c["cands"].items() if not v.get("bits_equal")})
    print(f"invalid candidates (mismatch or error): {inval or 'none'}")
    if res.get("aborted"):
        print("ABORTED:", res["aborted"])
    print(f"skipped cells: {len(res['skipped'])}; done in {res.get('seconds', 0):.0f} s; "
          f"apply: cp {os.path.join(a.out, 'linear_tuned.json')} areal_tik/kernels/linear/linear_tuned.json")
    return 0 if not res.get("aborted") and not inval else 2


if __name__ == "__main__":
    sys.exit(main())
