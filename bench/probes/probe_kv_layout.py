"""Does the paged cache's head interleaving cost the decode bandwidth? Same bytes, two layouts.

    python bench/probes/probe_kv_layout.py --out DIR

The decode bench compares the csrc/Triton paged decode with SDPA reading K/V gathered into
[B, H, ctx, D]: each head's rows contiguous. In the paged cache [pages, 64, Hkv, D] a KV head's row is
256 bytes with the other heads' rows between (2 KB stride at Hkv 8). Here the same decode work runs
twice: B sequences x Hkv 8 KV heads (32 q heads), and B*8 sequences x 1 KV head (4 q heads), where a
page holds one head's 64 rows contiguously (16 KB). Same bytes, same CTAs (one per KV head and chunk),
same arithmetic per CTA; only the memory layout (and the grid's order) differ. SDPA and the Triton
paged decode run beside them on both. CUDA-graph timings; writes DIR/probe_kv_layout.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: harness, bench_cuda, kernel_arms
sys.path[:0] = [os.path.dirname(BENCH), BENCH]  # the repo root (areal_tik) and bench/
ROOT = os.path.dirname(BENCH)


def _cell(B, hkv, hq, ctx, tri_paged):
    from bench_cuda import _graphed, _median_ms, decode_case, sdpa_layout
    from areal_tik.kernels.cuda import attention as cuda_attention
    q, kc, vc, bt, cq, sk = decode_case(B, ctx, hq=hq, hkv=hkv)
    qq, kk, vv = sdpa_layout(q, kc, vc, bt, ctx)
    F = torch.nn.functional
    row = {"batch": B, "hkv": hkv, "hq": hq, "ctx": ctx, "MB": round(2 * kc.numel() * 2 / 1e6, 1)}
    with torch.no_grad():
        for name, fn in (("sdpa", lambda: F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)),
                         ("cuda", lambda: cuda_attention.attention_paged_cuda(q, kc, vc, bt, cq, sk, 1)),
                         ("triton", (lambda: tri_paged(q, kc, vc, bt, cq, sk, 1)) if tri_paged else None)):
            if fn is None:
                continue
            g, how = _graphed(fn)
            row[f"{name}_us"] = round(_median_ms(g) * 1e3, 2)
            row[f"{name}_GBps"] = round(row["MB"] * 1e6 / (row[f"{name}_us"] * 1e-6) / 1e9, 1)
    return row


def main(argv=None):
    from bench_cuda import _triton_ops
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    _, tri_paged, why = _triton_ops()
    rows = []
    for B, ctx in ((16, 8192), (16, 4096), (64, 1024)):
        for b, hkv, hq in ((B, 8, 32), (B * 8, 1, 4)):
            rows.append(_cell(b, hkv, hq, ctx, tri_paged))
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    json.dump({"gpu": torch.cuda.get_device_name(), "triton_note": why, "rows": rows},
              open(os.path.join(a.out, "probe_kv_layout.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
