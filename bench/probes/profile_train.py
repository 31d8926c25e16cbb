"""Where a training micro-batch spends its time, tik vs default kernels (the A/B's train-step gap).

For when the A/B's train step differs between the arms (tik kernels vs the default ones: cuBLAS +
FlashAttention varlen), e.g. at small micro-batches where launches are host-bound. This script times, per kernels mode, on the same packed
batch: the no-grad forward to token log-probs (what recompute runs) and forward + backward of
their sum (one PPO micro-batch; the recipe's 32 seqs x 272 tokens = one micro-batch of a
minibatch), and records a torch.profiler table of the top device ops of forward + backward.

    python bench/probes/profile_train.py --out DIR [--model qwen2.5-1.5b] [--seqs 32] [--seq-len 272] [--kernels tik default]

``--kernels`` takes arms (bench/kernel_arms.py), e.g. ``tik tik@attention_varlen=cuda,attention_paged=cuda``.

Writes ``train_profile.json`` and prints a table. Random weights, random tokens (speed only).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: harness, bench_cuda, kernel_arms
sys.path[:0] = [os.path.dirname(BENCH), BENCH]  # the repo root (areal_tik) and bench/

import torch  # noqa: E402

from areal_tik.layers.logprob_head import packed_logprobs  # noqa: E402
from areal_tik.layers.patch import patch_model  # noqa: E402
from areal_tik.layers.models import build_model  # noqa: E402
from areal_tik.engine.profiling import profiler_activities, summarize_profile  # noqa: E402
from kernel_arms import parse_arms  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_ms(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts)


def profile(kernels: str, model_name: str, seqs: int, seq_len: int, reps: int, device: str,
            backend: str | None = None) -> dict:
    torch.manual_seed(0)
    model = build_model(model_name, dtype=torch.bfloat16, device=device)
    model = patch_model(model, kernels=kernels, backend=backend)
    model.train()
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, min(vocab, 32000), (seqs * seq_len,), generator=g).to(device)
    cu = (torch.arange(seqs + 1, dtype=torch.int32) * seq_len).to(device)

    def fwd():
        with torch.no_grad():
            packed_logprobs(model, ids, cu)

    def fwd_bwd():
        packed_logprobs(model, ids, cu).float().sum().backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):  # compile / autotune / allocator warm-up
        fwd()
        fwd_bwd()
    res = {"kernels": kernels, "tokens": seqs * seq_len, "forward_ms": _median_ms(fwd, reps),
           "forward_backward_ms": _median_ms(fwd_bwd, reps)}
    with torch.profiler.profile(activities=profiler_activities()) as prof:
        for _ in range(reps):
            fwd_bwd()
        _sync()
    res.update(summarize_profile(prof, reps))
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=272)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernels", nargs="+", default=["tik", "default"])
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runs = {}
    for arm in parse_arms(a.kernels):
        runs[arm.label] = dict(profile(arm.kernels, a.model, a.seqs, a.seq_len, a.reps, device, backend=arm.spec),
                               backend_spec=arm.spec)
    out = {"model": a.model, "seqs": a.seqs, "seq_len": a.seq_len, "device": device,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "runs": runs}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "train_profile.json"), "w") as f:
        json.dump(out, f, indent=1)
    for k, r in runs.items():
        print(f"{k} tokens {r['tokens']}: forward {r['forward_ms']:.2f} ms, forward+backward "
              f"{r['forward_backward_ms']:.2f} ms, device busy {r['device_busy_ms_per_step']:.2f} ms")
        for o in r["top_device_ops"][:10]:
            print(f"    {o['ms_per_step']:8.3f} ms  x{o['calls_per_step']:.0f}  {o['name'][:90]}")
    first = next(iter(runs))
    for k in list(runs)[1:]:
        print(f"{k} / {first} time: forward {runs[k]['forward_ms'] / runs[first]['forward_ms']:.3f}, "
              f"forward+backward {runs[k]['forward_backward_ms'] / runs[first]['forward_backward_ms']:.3f}")
    if "tik" in runs and "default" in runs:
        print(f"tik/default time: forward {runs['tik']['forward_ms'] / runs['default']['forward_ms']:.3f}, "
              f"forward+backward {runs['tik']['forward_backward_ms'] / runs['default']['forward_backward_ms']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
