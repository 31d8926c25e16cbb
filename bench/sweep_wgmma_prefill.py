"""Side-by-side sweep of the wgmma prefill kernel's scheduling knobs (H200, 32 q / 8 kv heads, D 128,
causal, batch 1), against PyTorch SDPA and the mma.sync kernel in the same process.

    python bench/sweep_wgmma_prefill.py --out DIR [--lens 4096 8192 16384]

Each variant sets AREAL_TIK_CUDA_WG_STAGES / _EARLY / _PINGPONG / _LOCKSTEP (scheduling only) and must give the
mma.sync kernel's bits (torch.equal, output poisoned with NaN before each checked launch). Writes
DIR/sweep_wgmma_prefill.json: per L, ms and TFLOP/s per variant, bits_equal, ratio to SDPA.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cuda import _median_ms  # noqa: E402

from areal_tik.kernels import cuda_ops  # noqa: E402

HQ, HKV, D = 32, 8, 128
# (name, stages, early refill, pingpong, lockstep)
VARIANTS = [("s5_early_pp", 5, 1, 1, 0), ("s5_early_nopp", 5, 1, 0, 0), ("s4_late_pp", 4, 0, 1, 0),
            ("s4_lockstep", 4, 1, 0, 1), ("s5_lockstep", 5, 1, 0, 1)]
KNOBS = ("AREAL_TIK_CUDA_WG_STAGES", "AREAL_TIK_CUDA_WG_EARLY", "AREAL_TIK_CUDA_WG_PINGPONG",
         "AREAL_TIK_CUDA_WG_LOCKSTEP")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lens", type=int, nargs="+", default=[4096, 8192, 16384])
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    F = torch.nn.functional
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    torch.manual_seed(0)
    for L in args.lens:
        q, k, v = (torch.randn(L, h, D, device="cuda", dtype=torch.bfloat16) for h in (HQ, HKV, HKV))
        cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
        flops = 2.0 * L * L * D * HQ
        tf = lambda ms: round(flops / (ms * 1e-3) / 1e12, 1)  # noqa: E731
        row = {"L": L}
        with torch.no_grad():
            row["sdpa_ms"] = _median_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                                               enable_gqa=True))
            ref = cuda_ops.attention_varlen_cuda(q, k, v, cu, L, prefill_kernel="mma")
            row["mma_ms"] = _median_ms(lambda: cuda_ops.attention_varlen_cuda(q, k, v, cu, L, prefill_kernel="mma"))
            for name, *knobs in VARIANTS:
                os.environ.update(dict(zip(KNOBS, map(str, knobs))))
                try:
                    out = torch.full_like(q, float("nan"))
                    cuda_ops.attention_varlen_cuda(q, k, v, cu, L, out=out, prefill_kernel="wgmma")
                    ms = _median_ms(lambda: cuda_ops.attention_varlen_cuda(q, k, v, cu, L, prefill_kernel="wgmma"))
                    row[name] = {"ms": ms, "tflops": tf(ms), "vs_sdpa": round(row["sdpa_ms"] / ms, 3),
                                 "bits_equal_mma": bool(torch.equal(out, ref))}
                finally:
                    for kn in KNOBS:
                        os.environ.pop(kn, None)
        row["sdpa_tflops"], row["mma_tflops"] = tf(row["sdpa_ms"]), tf(row["mma_ms"])
        res["rows"].append(row)
        print(f"L={L:6d} sdpa {row['sdpa_tflops']} TF/s  mma.sync {row['mma_tflops']}  " +
              "  ".join(f"{n} {row[n]['tflops']} ({row[n]['vs_sdpa']}x{'' if row[n]['bits_equal_mma'] else ' BITS DIFFER'})"
                        for n, *_ in VARIANTS), flush=True)
    with open(os.path.join(args.out, "sweep_wgmma_prefill.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0 if all(r[n]["bits_equal_mma"] for r in res["rows"] for n, *_ in VARIANTS) else 1


if __name__ == "__main__":
    sys.exit(main())
