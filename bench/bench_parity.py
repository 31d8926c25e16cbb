"""Full-model parity on the GPU: Qwen2.5-1.5B shape (random weights), continuous batching.

Runs the regime harness (areal_tik/verify/parity.py) once with tik kernels and once with
HF-default kernels (cuBLAS, SDPA, HF RoPE) on the same weights: 64 prompts x 256 new
tokens, R2 prefill batch mix, R3 chunked prefill, R4 continuous batching (16-48 slots,
requests arriving over time), R5 abort/resume + weight update + preemption, R1 training
packings with autograd. Writes ``parity.json`` and ``rows.csv`` (bench/harness.py); exit 1 unless
tik has zero mismatching tokens in every regime AND default shows mismatches (the negative control).

    python bench/bench_parity.py --out DIR [--quick] [--model qwen2.5-1.5b]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness

import torch  # noqa: E402

from areal_tik.layers.patch import patch_model  # noqa: E402
from areal_tik.verify.parity import ParityConfig, run_parity  # noqa: E402
from areal_tik.layers.models import build_model  # noqa: E402
from harness import Recorder  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=None, help="override the number of prompts (smoke runs)")
    ap.add_argument("--new-tokens", type=int, default=None, help="override max_new_tokens (smoke runs)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.quick:
        cfg = ParityConfig(n_prompts=16, min_prompt_len=8, max_prompt_len=128, max_new_tokens=64, seed=a.seed,
                           backward=False, r4_max_num_seqs=(4, 12), r5_concurrent=6)
    else:
        cfg = ParityConfig(n_prompts=64, min_prompt_len=16, max_prompt_len=256, max_new_tokens=256, seed=a.seed,
                           backward=False, r4_max_num_seqs=(16, 48), r5_concurrent=24)
    if a.prompts:
        cfg.n_prompts, cfg.max_prompt_len, cfg.r4_max_num_seqs, cfg.r5_concurrent = a.prompts, 24, (2, 3), 2
    if a.new_tokens:
        cfg.max_new_tokens = a.new_tokens
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res = {"model": a.model, "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "torch": torch.__version__, "quick": a.quick, "runs": {}}
    for kernels in ("tik", "default"):
        t0 = time.perf_counter()
        model = patch_model(build_model(a.model, device=dev, seed=a.seed), kernels=kernels)
        rep = run_parity(model, cfg, progress=lambda name, frac, k=kernels: print(f"[{k}] {frac:4.0%} {name}",
                                                                                     flush=True))
        rep["wall_s"] = round(time.perf_counter() - t0, 1)
        res["runs"][kernels] = rep
        for r, v in rep["regimes"].items():
            print(f"{kernels:8s} {r}: {v['n_mismatch']}/{v['n_tokens']} mismatching, max|diff|={v['max_abs_diff']:.3g}, "
                  f"divergent seqs {v['divergent_sequences']}, engine {v.get('engine')}", flush=True)
        del model
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    tik_ok = res["runs"]["tik"]["passed"]
    control_ok = res["runs"]["default"]["n_mismatch_total"] > 0
    res["tik_zero_mismatch"] = tik_ok
    res["default_shows_mismatch"] = control_ok
    rec = Recorder("bench_parity", a.out)
    res.update(commit=rec.env["commit"], command=rec.env["command"])
    with open(os.path.join(a.out, "parity.json"), "w") as f:
        json.dump(res, f, indent=2, default=str)
    for kernels, rep in res["runs"].items():  # mismatching tokens per regime as harness rows
        for r, v in rep["regimes"].items():
            rec.add(f"{a.model} {r} ({v['n_tokens']} tokens)", kernels, "mismatching tokens", v["n_mismatch"], "tokens")
    rec.write()
    print(f"tik zero mismatches: {tik_ok}; default kernels mismatch (control): {control_ok}")
    return 0 if (tik_ok and control_ok) else 1


if __name__ == "__main__":
    sys.exit(main())
