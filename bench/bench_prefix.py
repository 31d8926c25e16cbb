"""Prefix sharing in our engine: a GRPO-shaped rollout with sharing off and on.

B prompts x n samples (default 64 x 8, 136-token prompts -> 256 generated tokens, T = 1,
``ignore_eos``) on a random Qwen2.5-1.5B-shaped model with the tik kernels. Two engines on the
same model, ``EngineConfig(enable_prefix_sharing=False)`` and ``True``; each first runs the
workload once on other prompts (warm-up: JIT, lazily captured CUDA graphs), then once measured.
Reported per arm: generated tokens/s over the wall time of the whole batch (prefill included),
prefill tokens computed, prefix-hit tokens / prompt tokens; and whether every generated token and
every log-prob is bitwise equal between the arms (``torch.equal`` on the fp32 values).

    python bench/bench_prefix.py --out $OUT          # GPU, about a minute on an H200
    python bench/bench_prefix.py --smoke --out DIR   # CPU, tiny model, a few seconds

Writes ``prefix_p<prompt len>.json`` (medians of ``--repeats`` runs per arm, alternating which arm goes first) and rows to ``rows.csv`` (bench/harness.py); exits 1 when the arms' bits differ.
``bench/gpu_check.sh prefix`` runs it as a part (``--quick`` is accepted and changes nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

FULL = dict(model="qwen2.5-1.5b", prompts=64, n=8, prompt_len=136, new_tokens=256, page_size=64)
SMOKE = dict(model="tiny-qwen2", prompts=4, n=3, prompt_len=40, new_tokens=6, page_size=16)


def _log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def workload(w: dict, vocab: int, seed: int):
    """``w['prompts']`` random prompts and one ``SamplingParams`` each (n samples, T = 1)."""
    import torch

    from areal_tik.engine import SamplingParams
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (w["prompts"], w["prompt_len"]), generator=g).tolist()
    params = [SamplingParams(temperature=1.0, n=w["n"], max_new_tokens=w["new_tokens"], ignore_eos=True,
                             seed=seed * 1000003 + i) for i in range(w["prompts"])]
    return prompts, params


def warm_up(eng, w: dict, vocab: int) -> None:
    eng.generate(*workload(w, vocab, seed=7))


def run_arm(eng, w: dict, vocab: int, seed: int = 1) -> tuple[dict, list]:
    """One measured run on fresh prompts (``seed``); the row and the outputs."""
    before = eng.stats()
    prompts, params = workload(w, vocab, seed=seed)
    _sync()
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    _sync()
    dt = time.perf_counter() - t0
    st = eng.stats()
    n_gen = sum(len(o.output_ids) for o in outs)
    d = {k: st[k] - before[k] for k in ("steps", "prefill_tokens", "decode_tokens", "prompt_tokens",
                                        "prefix_hit_tokens", "preemptions")}
    row = dict(generated_tokens=n_gen, seconds=round(dt, 4), tokens_per_s=round(n_gen / dt, 1),
               all_full_length=all(len(o.output_ids) == w["new_tokens"] for o in outs),
               prefix_hit_rate=round(d["prefix_hit_tokens"] / max(1, d["prompt_tokens"]), 4), **d,
               num_pages=st["num_pages"], graph_steps=st["graph_steps"])
    return row, outs


def bits_equal(a: list, b: list) -> dict:
    import torch
    toks = len(a) == len(b) and all(x.output_ids == y.output_ids for x, y in zip(a, b))
    lps = toks and all(torch.equal(torch.tensor(x.output_logprobs, dtype=torch.float32),
                                   torch.tensor(y.output_logprobs, dtype=torch.float32)) for x, y in zip(a, b))
    return dict(tokens_equal=bool(toks), logprobs_equal=bool(lps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="tiny model and workload (CPU)")
    ap.add_argument("--model", help=f"preset or HF dir (default {FULL['model']}; --smoke: {SMOKE['model']})")
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--n", type=int, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--new-tokens", type=int)
    ap.add_argument("--page-size", type=int)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="per engine (two are alive at once)")
    ap.add_argument("--repeats", type=int, default=3, help="measured runs per arm (fresh prompts each; median kept)")
    ap.add_argument("--quick", action="store_true", help="accepted for bench/gpu_check.sh; the workload is the same")
    a = ap.parse_args(argv)
    import torch

    from areal_tik.engine import EngineConfig, LLMEngine
    from areal_tik.layers.models import build_model
    from areal_tik.layers.patch import patch_model

    w = dict(SMOKE if a.smoke else FULL)
    for k in w:
        v = getattr(a, k.replace("-", "_"), None)
        if v is not None:
            w[k] = v
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(a.out, exist_ok=True)
    t_start = time.perf_counter()
    model = patch_model(build_model(w["model"], device=dev, seed=0), kernels="tik")
    model.eval()
    vocab = model.config.vocab_size
    P = w["page_size"]
    max_len = -(-(w["prompt_len"] + w["new_tokens"] + 1) // P) * P
    seqs = w["prompts"] * w["n"]
    res = dict(workload=w, device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch=torch.__version__,
               expected_hit_rate=round((w["n"] - 1) / w["n"] * ((w["prompt_len"] - 1) // P * P) / w["prompt_len"], 4),
               arms={})
    engines = {arm: LLMEngine(model, EngineConfig(page_size=P, max_model_len=max_len, max_num_seqs=min(seqs, 512),
                                                  gpu_memory_utilization=a.gpu_memory_utilization,
                                                  enable_prefix_sharing=arm == "on"))
               for arm in ("off", "on")}
    for eng in engines.values():
        warm_up(eng, w, vocab)
    runs = {"off": [], "on": []}
    outs = {}
    for r in range(a.repeats):              # fresh prompts per repeat; the order alternates (off first, then on first)
        for arm in (("off", "on") if r % 2 == 0 else ("on", "off")):
            row, o = run_arm(engines[arm], w, vocab, seed=1 + r)
            runs[arm].append(row)
            if r == 0:
                outs[arm] = o
            _log(f"repeat {r} sharing {arm:3s}: {row['tokens_per_s']:10.1f} tok/s  ({row['generated_tokens']} tokens, "
                 f"{row['seconds']:.2f} s, {row['prefill_tokens']} prefill tokens, hit rate {row['prefix_hit_rate']})")
    for arm, rows in runs.items():
        med = sorted(rows, key=lambda x: x["tokens_per_s"])[len(rows) // 2]
        res["arms"][arm] = dict(med, runs_tokens_per_s=[x["tokens_per_s"] for x in rows])
    res.update(bits_equal(outs["off"], outs["on"]))
    res["speedup"] = round(res["arms"]["on"]["tokens_per_s"] / res["arms"]["off"]["tokens_per_s"], 3)
    res["seconds_total"] = round(time.perf_counter() - t_start, 1)
    _log(f"on / off (medians of {a.repeats}): {res['speedup']}x; tokens equal {res['tokens_equal']}, "
         f"log-probs equal {res['logprobs_equal']}; {res['seconds_total']} s in all")
    from harness import Recorder
    rec = Recorder("bench_prefix", a.out)
    res.update(commit=rec.env["commit"], command=rec.env["command"])
    json.dump(res, open(os.path.join(a.out, f"prefix_p{w['prompt_len']}.json"), "w"), indent=1)
    case = f"{w['model']} {w['prompts']}x{w['n']} prompt={w['prompt_len']} new={w['new_tokens']} page={P}"
    for arm, row in res["arms"].items():
        rec.add(case, f"sharing {arm}", "rollout throughput", row["tokens_per_s"], "tokens/s")
        rec.add(case, f"sharing {arm}", "prefix hit rate", row["prefix_hit_rate"], "fraction")
    rec.write()
    return 0 if res["tokens_equal"] and res["logprobs_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
