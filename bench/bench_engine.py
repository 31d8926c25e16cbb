"""Engine throughput on the GPU, tik kernels vs HF-default kernels, side by side in one run.

Same engine (paged KV cache, continuous batching, CUDA graphs for decode), same
Qwen2.5-1.5B-shaped random weights; only the kernels differ (``patch_model(kernels=...)``).
For each batch size B: prefill tokens/s (B prompts of ``--prompt-len`` tokens in one
step; median of 5 fresh batches) and decode tokens/s (B sequences, ``--steps`` decode steps
after a warm-up that captures the CUDA graph). Each point runs once unmeasured first (JIT, graph capture).
Writes ``engine_throughput.json`` with ratio tik/default per point, and ``rows.csv`` (bench/harness.py).

    python bench/bench_engine.py --out DIR [--quick] [--model qwen2.5-1.5b] [--arms default tik ...]

``--arms`` (bench/kernel_arms.py) adds backend arms, e.g. ``tik@attention_varlen=cuda,attention_paged=cuda``;
every arm's ratio over the first arm is written too.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from areal_tik.layers.patch import patch_model  # noqa: E402
from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from areal_tik.layers.models import build_model  # noqa: E402
from harness import Recorder  # noqa: E402
from kernel_arms import parse_arms  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _add(eng: LLMEngine, B: int, prompt_len: int, steps: int, vocab: int, seed: int, tag: str) -> None:
    g = torch.Generator().manual_seed(seed)
    sp = SamplingParams(temperature=1.0, max_new_tokens=steps + 8, ignore_eos=True, seed=seed)
    for i in range(B):
        eng.add_request(f"b{B}-{seed}-{tag}{i}", torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), sp)


def _prefill(eng: LLMEngine) -> tuple[float, int]:
    _sync()
    t0 = time.perf_counter()
    n = 0
    while eng.scheduler.waiting:
        eng.step()
        n += 1
    _sync()
    return time.perf_counter() - t0, n


def measure(eng: LLMEngine, B: int, prompt_len: int, steps: int, vocab: int, seed: int,
            prefill_reps: int = 5) -> dict:
    """Prefill: median of ``prefill_reps`` fresh batches of B prompts (each prefilled, then
    aborted); one sample was too noisy for the small batches (host-bound, ~30 ms). Decode:
    ``steps`` steps of the last batch after two warm-up steps."""
    times = []
    for r in range(prefill_reps):
        _add(eng, B, prompt_len, steps, vocab, seed, f"p{r}-")
        t, n_prefill = _prefill(eng)
        times.append(t)
        if r < prefill_reps - 1:
            eng.abort_all()
    t_prefill = statistics.median(times)
    for _ in range(2):      # warm-up decode (graph capture on the unmeasured pass)
        eng.step()
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    _sync()
    t_decode = time.perf_counter() - t0
    eng.abort_all()
    return dict(batch=B, prefill_tokens_per_s=B * prompt_len / t_prefill, prefill_steps=n_prefill,
                prefill_ms=1e3 * t_prefill, prefill_ms_samples=[round(1e3 * t, 3) for t in times],
                decode_tokens_per_s=B * steps / t_decode, decode_ms_per_step=1e3 * t_decode / steps)


def run_arm(kernels: str, label: str, model_name: str, dev: str, batches: list[int], prompt_len: int,
            steps: int, page_size: int = EngineConfig.page_size,
            prefill_graph_max_tokens: int = EngineConfig.prefill_graph_max_tokens, backend: str | None = None) -> dict:
    """One engine with ``kernels`` (ops bound under ``backend``); a warm-up and a measured pass per batch size."""
    model = patch_model(build_model(model_name, device=dev), kernels=kernels, backend=backend)
    eng = LLMEngine(model, EngineConfig(max_num_seqs=max(batches), max_model_len=prompt_len + steps + 64,
                                        max_num_batched_tokens=max(batches) * prompt_len,
                                        chunked_prefill=False, gpu_memory_utilization=0.3, page_size=page_size,
                                        prefill_graph_max_tokens=prefill_graph_max_tokens,
                                        enable_prefix_sharing=False))   # the prefill reps repeat their prompts
    rows = []
    for B in batches:
        measure(eng, B, prompt_len, steps, model.config.vocab_size, seed=1)   # warm-up pass
        r = measure(eng, B, prompt_len, steps, model.config.vocab_size, seed=2)
        rows.append(r)
        print(f"{label:8s} B={B:3d} prefill {r['prefill_tokens_per_s']:10.0f} tok/s  "
              f"decode {r['decode_tokens_per_s']:9.0f} tok/s ({r['decode_ms_per_step']:.2f} ms/step)", flush=True)
    out = dict(rows=rows, engine=eng.stats())
    del eng, model
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


def _ratios(rows: list[dict], base: list[dict]) -> list[dict]:
    return [dict(batch=t["batch"], prefill=t["prefill_tokens_per_s"] / d["prefill_tokens_per_s"],
                 decode=t["decode_tokens_per_s"] / d["decode_tokens_per_s"]) for t, d in zip(rows, base)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=EngineConfig.page_size, help="KV page size of every arm's engine")
    ap.add_argument("--arms", nargs="+", default=["default", "tik"], help="KERNELS[@AREAL_TIK_BACKEND spec]")
    ap.add_argument("--prefill-graph-max-tokens", type=int, nargs="+", default=[EngineConfig.prefill_graph_max_tokens],
                    help="EngineConfig.prefill_graph_max_tokens; several values run every arm once per value "
                         "(labels ARM/pgN), e.g. 0 2048: eager vs graph-replayed prefill")
    ap.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1..64, --quick 1 16 64)")
    a = ap.parse_args()
    pgs = a.prefill_graph_max_tokens
    arms = [(arm, pg, arm.label if len(pgs) == 1 else f"{arm.label}/pg{pg}") for arm in parse_arms(a.arms) for pg in pgs]
    os.makedirs(a.out, exist_ok=True)
    batches = a.batches or ([1, 16, 64] if a.quick else [1, 2, 4, 8, 16, 32, 64])
    steps = 16 if a.quick else 64
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res = {"model": a.model, "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "torch": torch.__version__, "prompt_len": a.prompt_len, "decode_steps": steps,
           "page_size": a.page_size, "kernels": {}}
    for arm, pg, label in arms:
        res["kernels"][label] = dict(run_arm(arm.kernels, label, a.model, dev, batches, a.prompt_len,
                                             steps, a.page_size, pg, backend=arm.spec), backend_spec=arm.spec,
                                     prefill_graph_max_tokens=pg)
    first = arms[0][2]
    res["ratio_over_first_arm"] = {
        label: _ratios(res["kernels"][label]["rows"], res["kernels"][first]["rows"]) for _, _, label in arms[1:]}
    for label, rows in res["ratio_over_first_arm"].items():
        for r in rows:
            print(f"{label} / {first} B={r['batch']:3d}: prefill {r['prefill']:.3f}x  decode {r['decode']:.3f}x")
    if "tik" in res["kernels"] and "default" in res["kernels"]:
        res["ratio_tik_over_default"] = _ratios(res["kernels"]["tik"]["rows"], res["kernels"]["default"]["rows"])
        for r in res["ratio_tik_over_default"]:
            print(f"tik/default B={r['batch']:3d}: prefill {r['prefill']:.2f}x  decode {r['decode']:.2f}x")
    rec = Recorder("bench_engine", a.out)
    res.update(commit=rec.env["commit"], command=rec.env["command"])
    with open(os.path.join(a.out, "engine_throughput.json"), "w") as f:
        json.dump(res, f, indent=2)
    for label, arm_res in res["kernels"].items():  # wall-clock medians (host time included) as harness rows
        for r in arm_res["rows"]:
            case = f"{a.model} B={r['batch']} prompt={a.prompt_len} page={a.page_size}"
            rec.add(case, label, "prefill step", r["prefill_ms"] / 1e3, "s")
            rec.add(case, label, "decode step", r["decode_ms_per_step"], "ms")
            rec.add(case, label, "decode throughput", r["decode_tokens_per_s"], "tokens/s")
    rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
