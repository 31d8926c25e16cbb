"""Negative controls: the contract checkers must report violations on default kernels.

1. ``torch.mm`` row-subset invariance, bf16, 4096x4096 weight: row(s) computed with M=1
   vs the same rows inside M=4096 (cuBLAS picks other kernels per M).
2. PyTorch SDPA prefill vs decode: the last query's output computed by a causal
   prefill over the whole sequence vs by a single-query decode over the same KV.
Both are expected to be *violations*; the script records the counts and fails (exit 1)
if a checker reports equality where the baseline is known to differ.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from areal_tik.verify import contract


def mm_control(dev: str) -> dict:
    g = torch.Generator(device=dev).manual_seed(1)
    w = torch.randn(4096, 4096, device=dev, generator=g, dtype=torch.bfloat16) / 64
    x = torch.randn(4096, 4096, device=dev, generator=g, dtype=torch.bfloat16)
    subsets = [[0], [1], [4095], list(range(8)), list(range(64))]
    rep = contract.check_row_subset_invariance(lambda a: torch.mm(a, w.t()), x, subsets, name="torch.mm row-subset")
    return rep.to_dict()


def sdpa_control(dev: str) -> dict:
    g = torch.Generator(device=dev).manual_seed(2)
    h, hk, d, L = 32, 8, 128, 4096 if dev == "cuda" else 256
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    q = torch.randn(1, h, L, d, device=dev, dtype=dt, generator=g)
    k = torch.randn(1, hk, L, d, device=dev, dtype=dt, generator=g)
    v = torch.randn(1, hk, L, d, device=dev, dtype=dt, generator=g)
    kk, vv = k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)
    prefill = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
    outs = {}
    n = 64
    decode_rows = []
    for p in range(L - n, L):
        decode_rows.append(F.scaled_dot_product_attention(q[:, :, p:p + 1], kk[:, :, :p + 1], vv[:, :, :p + 1]))
    outs["prefill"] = prefill[:, :, L - n:]
    outs["decode"] = torch.cat(decode_rows, 2)
    rep = contract.check_regime_equality(outs, name="SDPA prefill vs decode")
    return rep.to_dict()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "torch.mm": mm_control(dev), "sdpa": sdpa_control(dev)}
    for k in ("torch.mm", "sdpa"):
        r = res[k]
        print(f"negative control {k}: passed={r['passed']} mismatching={r['n_mismatch']}/{r['n_compared']} "
              f"max|diff|={r['max_abs_diff']:.4g} first={r['first_mismatch']}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "negative_controls.json"), "w") as f:
        json.dump(res, f, indent=1)
    # On the GPU both must be violations; on the CPU they are informative only.
    if dev == "cuda" and (res["torch.mm"]["passed"] or res["sdpa"]["passed"]):
        print("ERROR: a negative control reported equality; the checker or the baseline changed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
