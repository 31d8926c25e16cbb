"""Where an engine decode step spends its time (for the host-overhead question).

For a step whose wall time is far above its device time (a 1.5B decode step at B=1 has measured
several times the ~0.7 ms it takes to read the weights once on an H200). This script splits one
step into its host phases (schedule, prepare + graph replay / eager forward, sample, postprocess;
each phase synchronised so the split is honest) and records a torch.profiler table of the top
device and host ops over the same steps.

    python bench/probes/profile_engine.py --out DIR [--model qwen2.5-1.5b] [--batches 1 64] [--kernels tik default]

Writes ``engine_profile.json`` (per kernels mode and batch: ms per step per phase, device
busy ms per step, top ops) and prints a table.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections import defaultdict

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: harness, bench_cuda, kernel_arms
sys.path[:0] = [os.path.dirname(BENCH), BENCH]  # the repo root (areal_tik) and bench/

import torch  # noqa: E402

from areal_tik.layers.patch import patch_model  # noqa: E402
from areal_tik.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from areal_tik.layers.models import build_model  # noqa: E402
from kernel_arms import parse_arms  # noqa: E402
from areal_tik.engine.profiling import profiler_activities, summarize_profile  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.no_grad()  # as ModelRunner.run: without it the eager forward runs under autograd
def _phased_step(eng: LLMEngine, acc: dict) -> None:
    """One ``LLMEngine.step``, phase by phase (same calls, same order, the runner's graph-or-eager rule)."""
    def timed(name, fn, *a):
        _sync()
        t0 = time.perf_counter()
        r = fn(*a)
        _sync()
        acc[name] += time.perf_counter() - t0
        return r

    batch = timed("schedule", eng.scheduler.schedule)
    runner = eng.runner
    t = runner.fused_temperature(batch)
    if t is not None:   # the decode graph also draws the tokens: one phase for both
        tokens, lps = timed("forward + sample (graph: prepare + replay + read-back)", runner.run_graph_sampled,
                            batch, t)
        timed("postprocess", eng.scheduler.postprocess, batch, tokens, lps, eng.version, eng.eos_token_id,
              eng.max_model_len)
        return
    mode = runner.step_mode(batch)
    label = {"graph": "forward (graph: prepare + replay)", "prefill_graph": "forward (prefill graph: prepare + replay)",
             "eager": "forward (eager)"}[mode]
    logits = timed(label, runner.forward_logits, batch, mode)
    chunks = [c for c in batch.chunks if c.sample]
    tokens, lps = timed("sample", runner.sampler, logits, [c.seq.params for c in chunks],
                        [c.seq.seed for c in chunks], [c.seq.num_tokens for c in chunks])
    timed("postprocess", eng.scheduler.postprocess, batch, tokens, lps, eng.version, eng.eos_token_id,
          eng.max_model_len)


def profile(eng: LLMEngine, B: int, prompt_len: int, steps: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(B)
    sp = SamplingParams(temperature=1.0, max_new_tokens=3 * steps + 16, ignore_eos=True, seed=B)
    for i in range(B):
        eng.add_request(f"p{B}-{i}", torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), sp)
    while eng.scheduler.waiting:
        eng.step()
    for _ in range(3):
        eng.step()   # graph capture
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    _sync()
    plain_ms = 1e3 * (time.perf_counter() - t0) / steps
    eng.drain()   # async_decode: record the step in flight before the phased steps drive the scheduler directly
    acc = defaultdict(float)
    for _ in range(steps):
        _phased_step(eng, acc)
    phases = {k: 1e3 * v / steps for k, v in acc.items()}
    with torch.profiler.profile(activities=profiler_activities()) as prof:
        for _ in range(steps):
            eng.step()
        _sync()
    eng.abort_all()
    return {"batch": B, "ms_per_step": plain_ms, "phase_ms_per_step": phases, **summarize_profile(prof, steps)}


def profile_prefill(eng: LLMEngine, B: int, prompt_len: int, vocab: int, reps: int = 3) -> dict:
    """B fresh prompts of prompt_len tokens prefilled (graph-replayed up to the engine's prefill_graph_max_tokens,
    else eager), phase by phase: one unmeasured
    pass, then `reps` timed passes and one under torch.profiler (the prefill step's host work:
    scheduling, building the step's tensors, launches)."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=B)

    def one_pass(tag: str, acc) -> tuple[float, int]:
        g = torch.Generator().manual_seed(B)
        for i in range(B):
            eng.add_request(f"pf{B}-{tag}-{i}", torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), sp)
        _sync()
        t0 = time.perf_counter()
        n = 0
        while eng.scheduler.waiting:
            _phased_step(eng, acc)
            n += 1
        _sync()
        dt = time.perf_counter() - t0
        eng.abort_all()
        return dt, n

    one_pass("warm", defaultdict(float))
    acc = defaultdict(float)
    times, steps = [], 0
    for r in range(reps):
        dt, steps = one_pass(f"r{r}", acc)
        times.append(dt)
    with torch.profiler.profile(activities=profiler_activities()) as prof:
        one_pass("prof", defaultdict(float))
    return {"batch": B, "prompt_len": prompt_len, "steps_per_prefill": steps,
            "ms_per_prefill": 1e3 * sorted(times)[len(times) // 2],
            "phase_ms_per_prefill": {k: 1e3 * v / reps for k, v in acc.items()},
            **summarize_profile(prof, 1)}


def profile_arm(kernels: str, label: str, a, dev: str, backend: str | None = None) -> list[dict]:
    model = patch_model(build_model(a.model, device=dev), kernels=kernels, backend=backend)
    eng = LLMEngine(model, EngineConfig(max_num_seqs=max(a.batches), max_model_len=a.prompt_len + 4 * a.steps + 64,
                                        max_num_batched_tokens=max(a.batches) * a.prompt_len,
                                        chunked_prefill=False, gpu_memory_utilization=a.memory,
                                        page_size=a.page_size,
                                        enable_prefix_sharing=False,    # passes repeat their prompts
                                        async_decode=a.async_decode))
    runs = []
    for B in a.batches:
        r = profile(eng, B, a.prompt_len, a.steps, model.config.vocab_size)
        runs.append(r)
        ph = "  ".join(f"{k} {v:.3f}" for k, v in r["phase_ms_per_step"].items())
        print(f"{label} B={B:3d}: {r['ms_per_step']:.3f} ms/step; device busy "
              f"{r['device_busy_ms_per_step']:.3f} ms; phases (ms): {ph}", flush=True)
        for row in r["top_device_ops"][:8]:
            print(f"      dev {row['ms_per_step']:8.3f} ms x{row['calls_per_step']:6.1f}  {row['name'][:90]}")
        for row in r["top_host_ops"][:8]:
            print(f"      cpu {row['self_ms_per_step']:8.3f} ms x{row['calls_per_step']:6.1f}  {row['name'][:90]}")
        if a.prefill:
            pf = profile_prefill(eng, B, a.prompt_len, model.config.vocab_size)
            r["prefill"] = pf
            ph = "  ".join(f"{k} {v:.3f}" for k, v in pf["phase_ms_per_prefill"].items())
            print(f"{label} B={B:3d} prefill of {a.prompt_len} tokens: {pf['ms_per_prefill']:.3f} ms in "
                  f"{pf['steps_per_prefill']} step(s); device busy {pf['device_busy_ms_per_step']:.3f} ms; "
                  f"phases (ms): {ph}", flush=True)
            for row in pf["top_host_ops"][:8]:
                print(f"      cpu {row['self_ms_per_step']:8.3f} ms x{row['calls_per_step']:6.1f}  {row['name'][:90]}")
    del eng, model
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return runs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--kernels", nargs="+", default=["tik", "default"],
                    help="arms KERNELS[@backend spec] (bench/kernel_arms.py)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--async-decode", action="store_true",
                    help="EngineConfig(async_decode=True), the engine's default: the plain ms/step is then the pipelined one "
                         "(without the flag the profile runs unpipelined, so its phases add up to the step)")
    ap.add_argument("--memory", type=float, default=0.3,
                    help="the engine's gpu_memory_utilization (share of the free memory for KV after the weights)")
    ap.add_argument("--page-size", type=int, default=EngineConfig.page_size, help="KV page size of every arm's engine")
    ap.add_argument("--prefill", action="store_true",
                    help="also profile a prefill of B fresh prompts per batch size (prefill graphs where the engine uses them)")
    ap.add_argument("--k-splits", help="replace the linear op's fixed K splits for this run: 'K:S,K:S' or 'none' "
                    "(a before/after of a split in one process; the bits change with it)")
    ap.add_argument("--linear-table", help="replace the linear op's tuned tile table for this run (a linear_tuned.json; "
                    "speed only) — with --k-splits, an earlier commit's linear op in one process")
    ap.add_argument("--emulate-graphs-on-cpu", action="store_true",
                    help="CPU test hook: run the CUDA-graph code path with the engine's CPU graph emulation")
    a = ap.parse_args()
    if a.k_splits is not None:
        from areal_tik.kernels.linear.splits import K_SPLITS
        K_SPLITS.clear()
        K_SPLITS.update({int(k): int(v) for k, v in (p.split(":") for p in a.k_splits.split(",") if p != "none")})
    if a.linear_table:
        from areal_tik.kernels.linear import selection
        with open(a.linear_table) as f:
            table = selection.parse_tuned_table(f.read())
        selection.TUNED.clear()
        selection.TUNED.update(table)
        selection.pick_config.cache_clear()
    if a.emulate_graphs_on_cpu:
        from areal_tik.engine import model_runner
        model_runner.EMULATE_GRAPHS_ON_CPU = True
    os.makedirs(a.out, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    from areal_tik.kernels.linear.splits import K_SPLITS
    res = {"model": a.model, "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "k_splits": dict(K_SPLITS),
           "torch": torch.__version__, "prompt_len": a.prompt_len, "steps": a.steps,
           "page_size": a.page_size, "runs": {}}
    for arm in parse_arms(a.kernels):
        res["runs"][arm.label] = profile_arm(arm.kernels, arm.label, a, dev, backend=arm.spec)
    with open(os.path.join(a.out, "engine_profile.json"), "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
