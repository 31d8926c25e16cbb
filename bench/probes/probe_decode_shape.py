"""The csrc decode attention's launch shape (split chunks per CTA, ring depth) at rollout decode shapes.

The decode kernel cuts each sequence's K/V into 256-position chunks; ``decode_auto_shape`` (csrc) picks how many
chunks one CTA walks (``cpc``) and the cp.async/TMA ring depth (2 or 3 stages) from the grid size. Every choice gives
the same bits (the chunk boundaries and the merge order are fixed); only the time changes. This probe times each
forced (cpc, stages) against the automatic pick at the shapes of the engine's long-generation rows, one query per
sequence over a paged cache (page 64, shuffled pages, larger than L2), each cell a CUDA graph of ``--launches``
launches, and checks every forced shape's output bit for bit against the automatic one (outputs poisoned first).

    python bench/probes/probe_decode_shape.py --out $OUT [--model 7b|1.5b|30b-a3b] [--batch 64] [--ctx 1024,2048,3072]

Writes ``decode_shape.json`` and prints per context: the automatic pick's time and read rate, the best forced shape
and its ratio, and the device's copy rate (read + write of the same bytes through ``copy_``) as the ceiling.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

HEADS = {"7b": (28, 4), "1.5b": (12, 2), "30b-a3b": (32, 4)}  # (q heads, kv heads); head dim 128
D, PAGE, CHUNK = 128, 64, 256


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model", choices=sorted(HEADS), default="7b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", default="1024,2048,3072")
    ap.add_argument("--cpcs", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--launches", type=int, default=10, help="launches per CUDA graph replay")
    a = ap.parse_args()
    ctxs = [int(c) for c in a.ctx.split(",")]
    cpcs = [int(c) for c in a.cpcs.split(",")]
    if a.batch < 1 or any(c < 1 for c in ctxs) or any(c < 1 or c > 64 for c in cpcs):
        raise SystemExit("probe_decode_shape: --batch and --ctx must be >= 1, --cpcs in 1..64")

    import torch
    from bench_cuda import decode_case
    from harness import graphed, time_ms, warm_up_clocks
    from areal_tik.kernels.cuda import attention as cuda_attention, extension as cuda_extension

    hq, hkv = HEADS[a.model]
    ext = cuda_extension.extension()
    mode = cuda_attention._mode("auto")
    merge = cuda_attention._decode_merge(None)
    props = torch.cuda.get_device_properties(0)
    warm_up_clocks(2.0)
    res = {"gpu": props.name, "sms": props.multi_processor_count, "model": a.model, "hq": hq, "hkv": hkv,
           "batch": a.batch, "page": PAGE, "cells": []}
    for ctx in ctxs:
        torch.manual_seed(ctx)
        q, kc, vc, bt, cq, sk = decode_case(a.batch, ctx, hq=hq, hkv=hkv, page=PAGE)
        kv_bytes = 2 * a.batch * ctx * hkv * D * 2
        out = torch.empty_like(q)
        # the attention_paged_cuda call (the engine's) with the launch shape forced
        cuda_attention.attention_paged_cuda(q, kc, vc, bt, cq, sk, 1)  # creates the fused-merge counters eagerly

        def launch(cpc, st):
            return lambda: [ext.attention_paged_fwd(q, kc, vc, bt, cq, sk, 1, D ** -0.5, mode, out=out,
                                                    decode_merge=merge, decode_cpc=cpc, decode_stages=st)
                            for _ in range(a.launches)]

        maxc = -(-ctx // CHUNK)
        shapes = [(0, 0)] + [(c, s) for c in cpcs if c <= maxc for s in (2, 3)]
        ref = None
        cells = []
        for cpc, st in shapes:
            out.fill_(float("nan"))
            ext.attention_paged_fwd(q, kc, vc, bt, cq, sk, 1, D ** -0.5, mode, out=out, decode_merge=merge,
                                    decode_cpc=cpc, decode_stages=st)
            torch.cuda.synchronize()
            if ref is None:
                ref = out.clone()
                same = bool(torch.isfinite(ref).all())
            else:
                same = torch.equal(out, ref)
            run, how = graphed(launch(cpc, st))
            ms = time_ms(run, "events", iters=5, reps=5).p50 / a.launches
            cells.append({"cpc": cpc, "stages": st, "us": round(ms * 1e3, 2),
                          "read_tb_s": round(kv_bytes / (ms * 1e-3) / 1e12, 3), "bits_equal_auto": same, "timing": how})
        dst = torch.empty_like(kc)
        copy_ms = time_ms(lambda: (dst.copy_(kc), dst.copy_(vc)), "events", iters=5, reps=5).p50
        auto = cells[0]
        best = min(cells[1:], key=lambda c: c["us"]) if len(cells) > 1 else auto
        row = {"ctx": ctx, "kv_mb": round(kv_bytes / 2 ** 20, 1), "copy_rate_tb_s": round(2 * kv_bytes / (copy_ms * 1e-3) / 1e12, 3),
               "auto_us": auto["us"], "best": best, "best_over_auto": round(auto["us"] / best["us"], 3),
               "all_bits_equal": all(c["bits_equal_auto"] for c in cells), "cells": cells}
        res["cells"].append(row)
        print(f"ctx {ctx}: auto {auto['us']} us ({auto['read_tb_s']} TB/s), best cpc {best['cpc']} stages "
              f"{best['stages']} {best['us']} us ({best['read_tb_s']} TB/s, {row['best_over_auto']}x), copy "
              f"{row['copy_rate_tb_s']} TB/s, bits equal {row['all_bits_equal']}", flush=True)
        del q, kc, vc, dst
        torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "decode_shape.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0 if all(r["all_bits_equal"] for r in res["cells"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
